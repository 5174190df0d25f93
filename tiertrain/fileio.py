"""Durable file writes: a file is either absent, the old version, or complete."""
from __future__ import annotations

import hashlib
import os
import tempfile
from typing import BinaryIO, Callable


def atomic_write(path: str | os.PathLike, write: Callable[[BinaryIO], object]) -> None:
    """Write through write(f) to a temporary file beside path, fsync it, then rename it over
    path; on any failure the temporary file is removed and path is untouched."""
    path = os.fspath(path)
    directory = os.path.dirname(path) or "."
    tmp = None
    try:  # (mkstemp inside: a signal right after it still finds tmp to remove)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=os.path.basename(path) + ".", suffix=".tmp")
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
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
