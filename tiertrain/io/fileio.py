"""Durable file writes: a file is either absent, the old version, or complete."""
from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import socket
import tempfile
import time
from typing import BinaryIO, Callable

from ..errors import TiertrainError


def _umask() -> int:
    """The process's umask, read without changing it (os.umask can only be read by setting it,
    which races with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def temporary_beside(directory: str, prefix: str, suffix: str) -> tuple[int, str]:
    """mkstemp in directory, with the mode open() would have given the file (0666 less the
    umask): mkstemp's 0600 would survive the rename, leaving checkpoints and exported models
    readable by their owner only."""
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=prefix, suffix=suffix)
    try:
        os.fchmod(fd, 0o666 & ~_umask())
    except BaseException:
        os.close(fd)
        os.unlink(tmp)
        raise
    return fd, tmp


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Write through write(f) to a temporary file beside path, fsync it, then rename it over
    path; on any failure the temporary file is removed and path is untouched. The file gets
    the mode open() would give it."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp = None
    try:  # (created inside: a signal right after it still finds tmp to remove)
        fd, tmp = temporary_beside(directory, os.path.basename(path) + ".", ".tmp")
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        raise


def file_sha256(path) -> str:
    """The sha256 of a file's content, read 1 MiB at a time."""
    with open(path, "rb") as f:
        return stream_sha256(f)


def stream_sha256(f: BinaryIO) -> str:
    """The sha256 of what is left to read in the open binary file f, read 1 MiB at a time."""
    h = hashlib.sha256()
    for block in iter(lambda: f.read(1 << 20), b""):
        h.update(block)
    return h.hexdigest()


def fsync_directory(path: str | os.PathLike) -> None:
    """Make the entries of directory path (renames, creations) durable."""
    fd = os.open(os.fspath(path), os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2  # (linux/fs.h)
_AT_FDCWD = -100


def exchange_paths(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Swap two existing paths in one atomic step (Linux renameat2 RENAME_EXCHANGE): at every
    instant each name holds one of the two. Returns False where the system or the file system
    cannot (the caller then swaps in two renames); other errors are raised."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, os.strerror(err), os.fspath(a), os.fspath(b))


def nearest_existing(path: str) -> str:
    """``path`` itself if it exists, else its nearest ancestor that does (where a directory
    about to be created would be)."""
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return path


class LockHeld(TiertrainError):
    """Another process holds the lock; ``holder`` is what it wrote there (host, pid, since)."""

    def __init__(self, holder: str):
        super().__init__(holder)
        self.holder = holder


def unreadable_file(path: str) -> str | None:
    """Why an entry that is there cannot be read as a weight file (a dangling symlink, as a
    Hugging Face cache snapshot with a missing blob leaves; a directory, FIFO or device; no
    read permission), or None when it is a readable regular file. Links are followed: a cache
    snapshot is a directory of links into the cache's blobs."""
    if os.path.islink(path) and not os.path.exists(path):
        return (f"a symlink to {os.readlink(path)!r}, which does not exist (a cache snapshot whose blob is "
                f"missing?)")
    if not os.path.isfile(path):
        return "not a regular file" + (f" (a link to {os.path.realpath(path)!r})" if os.path.islink(path) else "")
    if not os.access(path, os.R_OK):
        return "not readable (permissions)"
    return None


def lock_file(path: str | os.PathLike) -> int:
    """An open descriptor holding an exclusive flock on ``path`` (created if missing), which
    then names this process: host, pid, since when. LockHeld naming the holder when another
    process holds it. The kernel drops the lock when the process ends, however it ends; the
    descriptor is not inherited by children (O_CLOEXEC)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 4096).decode("utf-8", "replace").strip() or "a process that wrote no name"
        os.close(fd)
        raise LockHeld(holder) from None
    except BaseException:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.write(fd, (f"host {socket.gethostname()}, pid {os.getpid()}, since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}").encode())
    return fd
