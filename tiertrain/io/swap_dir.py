"""The swap directories of :class:`~tiertrain.io.swap.TensorSwapper`: checking the swap path
(``check_swap_dir``), removing a rank's directory when its swapper ends, and the registry through
which tiertrain.launch.launch_local removes the directories its workers leave behind
(``CLEANUP_ENV``, ``remove_left_behind``, ``locked_by_another``).
"""
from __future__ import annotations

import errno as _errno
import fcntl
import os
import shutil
import stat
from typing import Optional

from .aio import SwapDirError, errno_name

__all__ = ["CLEANUP_ENV", "check_swap_dir", "locked_by_another", "remove_left_behind"]


def _cleanup(rank_dir: str, lock_fd_box: list, remove_parent: Optional[str],
             registration: Optional[str] = None) -> None:
    shutil.rmtree(rank_dir, ignore_errors=True)
    if registration:
        try:
            os.unlink(registration)
        except OSError:
            pass
    if lock_fd_box and lock_fd_box[0] is not None:
        try:
            os.close(lock_fd_box[0])
        except OSError:
            pass
        lock_fd_box[0] = None
    if remove_parent:
        try:
            os.rmdir(remove_parent)
        except OSError:
            pass


CLEANUP_ENV = "TIERTRAIN_CLEANUP_DIR"
"""Set by tiertrain.launch.launch_local in every worker: a directory where each swapper
registers the directories it created, so that the launcher can remove them after the
worker is gone however it ended. A worker started by multiprocessing never runs atexit
handlers (it leaves through os._exit), and one killed by a signal runs nothing at all."""


def _register_for_launcher(rank_dir: str, parent: Optional[str]) -> Optional[str]:
    """Record rank_dir (and parent, when this swapper created it) in $TIERTRAIN_CLEANUP_DIR;
    returns the registration file (removed again on a normal close), or None."""
    where = os.environ.get(CLEANUP_ENV)
    if not where or not os.path.isdir(where):
        return None
    path = os.path.join(where, f"swap-{os.getpid()}-{abs(hash(rank_dir))}")
    try:
        with open(path, "w") as f:
            f.write(rank_dir + "\n" + (parent or "") + "\n")
    except OSError:
        return None
    return path


def remove_left_behind(cleanup_dir: str, owner_pid: Optional[int] = None) -> list:
    """Remove the swap directories registered in cleanup_dir by swappers whose process is
    gone (their flock is free), or by ``owner_pid`` (this process, about to exit); returns
    the directories removed. A directory another live process still locks is left alone."""
    removed, parents = [], []
    try:
        names = sorted(os.listdir(cleanup_dir))
    except OSError:
        return removed
    for name in names:
        if not name.startswith("swap-"):
            continue
        if owner_pid is not None and not name.startswith(f"swap-{owner_pid}-"):
            continue
        reg = os.path.join(cleanup_dir, name)
        try:
            with open(reg) as f:
                rank_dir, parent = (f.read().split("\n") + ["", ""])[:2]
        except OSError:
            continue
        if rank_dir and os.path.isdir(rank_dir):
            if owner_pid is None and locked_by_another(os.path.join(rank_dir, ".lock")):
                continue
            shutil.rmtree(rank_dir, ignore_errors=True)
            removed.append(rank_dir)
        if parent:
            parents.append(parent)
        try:
            os.unlink(reg)
        except OSError:
            pass
    for parent in parents:  # after every rank's directory: the rank that made it may come first
        try:
            os.rmdir(parent)  # only when empty: a live rank's directory may still be in it
        except OSError:
            pass
    return removed


def locked_by_another(lock_path: str) -> bool:
    """Whether a live process holds the swap directory's flock."""
    try:
        fd = os.open(lock_path, os.O_RDWR | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)  # releases the probe's lock too


def check_swap_dir(swap_dir: str, create: bool = False) -> str:
    """Raise SwapDirError (naming the path) unless ``swap_dir`` is an existing directory
    (created first with ``create``). Returns the absolute path."""
    swap_dir = os.path.abspath(os.fspath(swap_dir))
    try:
        st = os.stat(swap_dir)
    except FileNotFoundError:
        if not create:
            raise SwapDirError(f"swap directory {swap_dir} does not exist (create it, or point "
                               f"the swap path at a mounted NVMe directory)", swap_dir,
                               _errno.ENOENT) from None
        try:
            os.makedirs(swap_dir, exist_ok=True)
        except OSError as e:
            raise SwapDirError(f"cannot create swap directory {swap_dir}: {e.strerror} "
                               f"({errno_name(e.errno)})", swap_dir, e.errno) from e
        st = os.stat(swap_dir)
    except NotADirectoryError:
        raise SwapDirError(f"swap directory {swap_dir} is not usable: a component of the path "
                           f"is a regular file, not a directory (ENOTDIR)", swap_dir,
                           _errno.ENOTDIR) from None
    except OSError as e:
        raise SwapDirError(f"swap directory {swap_dir} is not usable: {e.strerror} "
                           f"({errno_name(e.errno)})", swap_dir, e.errno) from e
    if not stat.S_ISDIR(st.st_mode):
        raise SwapDirError(f"swap directory {swap_dir} is not a directory", swap_dir,
                           _errno.ENOTDIR)
    return swap_dir
