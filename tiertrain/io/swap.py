"""Tensor swapping to files through :class:`~tiertrain.io.aio.AsyncIO` and an
:class:`~tiertrain.io.buffers.AlignedBufferPool`.

Every rank owns ``swap_dir/rank{r}/`` (created, locked with ``flock`` so two live processes never
share it, emptied of stale files left by a crashed run, and removed on ``close()``, at exit, or
when the swapper is garbage collected; under tiertrain.launch.launch_local also by the launcher
once the rank is gone, since its workers never run exit handlers: ``CLEANUP_ENV``). Each key is
one file.

``swap_out(key, tensor)`` copies the tensor's bytes into pool buffers (pieces of at most
``piece_bytes``, so a tensor larger than the pool still streams through it) and submits their
writes; the tensor may be freed or reused as soon as it returns. Passing a pool ``Buffer``
instead writes straight from it with no copy (the caller keeps it unchanged until the handle is
done). ``swap_in(key, out)`` reads into pool buffers and copies into ``out`` in the IO worker
(or reads straight into ``out`` when it is a pool ``Buffer``); ``prefetch(keys)`` starts those
reads early so a later ``swap_in`` only waits for what is still in flight. Every size works —
0 bytes, a few bytes, anything not a multiple of 4096 — through the same aligned path: nothing is
silently kept in memory instead. Reads are verified against the size and checksums recorded at
write time (see :mod:`tiertrain.io.aio`).

Ordering per key is the swapper's job: a ``swap_in``/``prefetch`` after a ``swap_out`` of the
same key waits for (or chains after) that write, a ``swap_out`` over a key waits for its reads.
"""
from __future__ import annotations

import ctypes
import errno as _errno
import os
import re
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple

import torch

from .aio import (AsyncIO, Checksum, Handle, SwapCorruptionError, SwapDirError, SwapSpaceError,
                  errno_name)
from .buffers import AlignedBufferPool, Buffer, round_up
from .fileio import LockHeld, lock_file
from .swap_dir import _cleanup, _register_for_launcher, check_swap_dir
from .swap_handle import SwapHandle
from ..waits import WaitClock, run_timeout

__all__ = ["TensorSwapper"]

DEFAULT_WAIT_TIMEOUT = None
"""Waits default to the run's one timeout (tiertrain.waits.run_timeout(): ``--timeout``, as the
launcher hands it to every rank), read when the swapper is built: a constant here used to cut
IO waits at 300 s whatever the run's timeout was."""


@dataclass
class _Record:
    path: str
    nbytes: int
    dtype: torch.dtype
    shape: Tuple[int, ...]
    pieces: List[Tuple[int, int]]                       # (offset, nbytes)
    checksums: List[Optional[Checksum]]
    write: Optional[SwapHandle] = None                  # the write that produced the file
    reads: List[SwapHandle] = field(default_factory=list)
    prefetch: Dict[int, Tuple[Buffer, Handle]] = field(default_factory=dict)
    prefetch_wanted: bool = False


def _tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes of a contiguous tensor as a flat uint8 view (no copy)."""
    if not t.is_contiguous():
        raise ValueError("swap needs a contiguous tensor")
    flat = t.reshape(-1)
    if flat.dtype == torch.uint8:
        return flat
    if flat.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.view(torch.uint8)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy equal-length uint8 tensors. CPU to CPU is one memmove (single-threaded, GIL
    released): torch's copy_ would open an OpenMP parallel region from the IO worker thread,
    which on an oversubscribed machine waits on descheduled OpenMP threads (measured here at
    ~10x slower than memmove under load)."""
    n = src.numel()
    if n == 0:
        return
    if dst.device.type == "cpu" and src.device.type == "cpu":
        ctypes.memmove(dst.data_ptr(), src.data_ptr(), n)
    else:
        dst.copy_(src)


def _default_rank() -> int:
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    except Exception:  # noqa: BLE001
        pass
    return int(os.environ.get("RANK", "0"))


class TensorSwapper:
    """Swap tensors of any dtype and size to per-key files under ``swap_dir/rank{r}/``.

    ``piece_bytes`` bounds the pool memory one request holds at a time (default: half the pool,
    whole blocks); ``prefetch_bytes`` bounds the pool memory prefetched reads may hold (default:
    half the pool) so that prefetching never starves swap_out; ``wait_timeout`` bounds every
    internal wait.
    """

    def __init__(self, swap_dir, aio: AsyncIO, pool: AlignedBufferPool, rank: Optional[int] = None,
                 create: bool = False, piece_bytes: Optional[int] = None,
                 prefetch_bytes: Optional[int] = None,
                 wait_timeout: Optional[float] = DEFAULT_WAIT_TIMEOUT):
        self.aio = aio
        self.pool = pool
        self.waits = WaitClock()
        """Seconds the training thread blocked waiting for this swapper's reads and writes."""
        self.rank = _default_rank() if rank is None else int(rank)
        self.wait_timeout = run_timeout() if wait_timeout is None else wait_timeout
        bb = pool.block_bytes
        half = max(bb, (pool.total_bytes // 2) // bb * bb)
        self.piece_bytes = half if piece_bytes is None else max(bb, round_up(piece_bytes, bb))
        if self.piece_bytes > pool.total_bytes:
            raise ValueError(f"piece_bytes {self.piece_bytes} exceeds the pool budget "
                             f"{pool.total_bytes}")
        self.prefetch_bytes = half if prefetch_bytes is None else prefetch_bytes
        existed = os.path.exists(os.fspath(swap_dir))
        self.swap_dir = check_swap_dir(swap_dir, create)
        self.rank_dir = os.path.join(self.swap_dir, f"rank{self.rank}")
        self._lock = threading.RLock()
        self._records: Dict[Any, _Record] = {}
        self._seq = 0
        self._prefetched_bytes = 0
        self._closed = False
        self.stats = {"swap_out": 0, "swap_in": 0, "prefetch_hits": 0, "prefetch_skipped": 0,
                      "bytes_out": 0, "bytes_in": 0}
        self.cpu_seconds = {"copy": 0.0}
        """CPU time spent copying between tensors and the pool's IO buffers (thread CPU time, all
        threads); the AsyncIO's ``cpu_seconds`` has the checksums'."""
        lock_box: list = [None]
        try:
            os.makedirs(self.rank_dir, exist_ok=True)
        except OSError as e:
            raise SwapDirError(f"cannot create per-rank swap directory {self.rank_dir}: "
                               f"{e.strerror} ({errno_name(e.errno)})", self.rank_dir,
                               e.errno) from e
        lock_path = os.path.join(self.rank_dir, ".lock")
        try:
            lock_box[0] = lock_file(lock_path)
        except LockHeld as e:
            raise SwapDirError(f"swap directory {self.rank_dir} is in use by another live process "
                               f"({e.holder}); give each job its own swap path (zero.nvme_path)",
                               self.rank_dir, _errno.EWOULDBLOCK) from None
        except OSError as e:
            raise SwapDirError(f"swap directory {self.rank_dir} is not writable: cannot create "
                               f"{lock_path}: {e.strerror} ({errno_name(e.errno)})",
                               self.rank_dir, e.errno) from e
        parent = None if existed else self.swap_dir
        self._finalizer = weakref.finalize(self, _cleanup, self.rank_dir, lock_box, parent,
                                           _register_for_launcher(self.rank_dir, parent))
        for name in os.listdir(self.rank_dir):       # stale files of a crashed run
            if name.endswith(".swp") or name.startswith(".probe"):
                try:
                    os.unlink(os.path.join(self.rank_dir, name))
                except OSError:
                    pass
        self._probe()

    # -- construction-time check ----------------------------------------------------------
    def _probe(self) -> None:
        """Write, read back and delete one aligned page through the real IO path, so an
        unwritable or full location fails now, with its path, not in the middle of a step."""
        path = os.path.join(self.rank_dir, f".probe{os.getpid()}")
        try:
            with self.pool.acquire(4096, timeout=self.wait_timeout) as buf:
                buf.data.copy_(torch.arange(4096, dtype=torch.int64).to(torch.uint8))
                w = self.aio.submit_write(path, buf, 0, truncate=True)
                w.wait(self.wait_timeout)
                buf.data.zero_()
                self.aio.submit_read(path, buf, 0, checksum=w.checksum).wait(self.wait_timeout)
                if not torch.equal(buf.data, torch.arange(4096, dtype=torch.int64).to(torch.uint8)):
                    raise SwapCorruptionError(f"probe file {path} read back different bytes",
                                              path, 4096, 4096)
        except (SwapSpaceError, SwapCorruptionError):
            self.close()
            raise
        except SwapDirError as e:
            self.close()
            raise SwapDirError(f"swap directory {self.rank_dir} is not writable: {e}",
                               self.rank_dir, e.errno) from e
        except OSError as e:
            self.close()
            raise SwapDirError(f"swap directory {self.rank_dir} failed a write/read probe: {e}",
                               self.rank_dir, e.errno) from e
        finally:
            try:
                os.unlink(path)
            except OSError:
                pass

    # -- helpers --------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError(f"TensorSwapper({self.rank_dir}) is closed")

    def _path_for(self, key) -> str:
        self._seq += 1
        name = re.sub(r"[^A-Za-z0-9._-]", "_", str(key))[:80]
        return os.path.join(self.rank_dir, f"{self._seq:06d}_{name}.swp")

    def _pieces(self, nbytes: int) -> List[Tuple[int, int]]:
        if nbytes == 0:
            return [(0, 0)]
        p = self.piece_bytes
        return [(off, min(p, nbytes - off)) for off in range(0, nbytes, p)]

    def _wait_quiet(self, handles: Iterable[SwapHandle]) -> None:
        for h in handles:
            try:
                h.wait(self.wait_timeout)
            except (TimeoutError, KeyboardInterrupt):  # (Ctrl-C, SIGTERM: the run is stopping)
                raise
            except BaseException:  # noqa: BLE001 - reported to whoever owns that handle
                pass

    def keys(self) -> List[Any]:
        with self._lock:
            return list(self._records)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._records

    def nbytes(self, key) -> int:
        return self._record(key).nbytes

    def _record(self, key) -> _Record:
        with self._lock:
            try:
                return self._records[key]
            except KeyError:
                raise KeyError(f"key {key!r} was never swapped out to {self.rank_dir} (or was "
                               f"released)") from None

    # -- swap out -------------------------------------------------------------------------
    def swap_out(self, key, tensor) -> SwapHandle:
        """Write ``tensor`` (any dtype/size/device; or a pool Buffer, written without a copy)
        under ``key``; returns once its bytes are staged in pool buffers, with the writes in
        flight (a tensor larger than ``piece_bytes`` waits for pool room piece by piece).
        A Buffer is written as one request, so reading it back into a tensor needs pool room
        for its whole size (or pass a Buffer to ``swap_in``)."""
        self._check_open()
        zero_copy = isinstance(tensor, Buffer)
        if zero_copy:
            nbytes, dtype, shape = tensor.nbytes, torch.uint8, (tensor.nbytes,)
            src = None
        else:
            src = _tensor_bytes(tensor.contiguous())    # a strided view is copied once
            nbytes, dtype, shape = src.numel(), tensor.dtype, tuple(tensor.shape)
        with self._lock:
            old = self._records.get(key)
        if old is not None:                        # same key again: finish its IO first
            self._drain(old)
        if old is not None and round_up(old.nbytes, 4096) > round_up(nbytes, 4096):
            # Same key again, smaller: shrink the file. A swap file is overwritten in place,
            # never truncated to 0 first: O_TRUNC frees every extent synchronously (measured
            # ~80 ms for 256 MiB on ext4 here) and the writes would then allocate them again.
            try:
                os.truncate(old.path, round_up(nbytes, 4096))
            except OSError:
                pass
        with self._lock:
            path = old.path if old is not None else self._path_for(key)
            pieces = [(0, nbytes)] if zero_copy else self._pieces(nbytes)
            rec = _Record(path, nbytes, dtype, shape, pieces, [None] * len(pieces))
            handle = SwapHandle("swap_out", key, path, clock=self.waits)
            rec.write = handle
            self._records[key] = rec
            self.stats["swap_out"] += 1
            self.stats["bytes_out"] += nbytes
        try:
            for i, (off, n) in enumerate(pieces):
                if zero_copy:
                    buf = tensor
                else:
                    buf = self.pool.acquire(n, timeout=self.wait_timeout)
                    try:
                        self._copy(buf.data, src[off: off + n])
                    except BaseException:
                        buf.release()
                        raise
                try:
                    h = self.aio.submit_write(path, buf, off)
                except BaseException:
                    if not zero_copy:
                        buf.release()
                    raise
                handle._attach(h, self._write_finisher(rec, i, None if zero_copy else buf))
        except BaseException as e:
            handle._seal(e)
            raise
        handle._seal()
        return handle

    @staticmethod
    def _write_finisher(rec: _Record, i: int, buf: Optional[Buffer]):
        def finish(h: Handle) -> None:
            if h._error is None:
                rec.checksums[i] = h.checksum
            if buf is not None:
                buf.release()
        return finish

    def _drain(self, rec: _Record) -> None:
        """Wait (bounded) for every request on a record and drop its prefetched buffers."""
        handles = ([rec.write] if rec.write is not None else []) + list(rec.reads)
        self._wait_quiet(handles)
        with self._lock:
            prefetched, rec.prefetch = rec.prefetch, {}
        for buf, h in prefetched.values():
            if h.exception(self.wait_timeout) is not None:  # TimeoutError: keep the buffer
                h.claim_error()              # a prefetch nobody consumed: nothing to report
            self._release_prefetch(buf)

    # -- swap in --------------------------------------------------------------------------
    def swap_in(self, key, out=None) -> SwapHandle:
        """Read ``key`` into ``out`` (a tensor with the same byte size, any device; a pool
        Buffer for a read with no copy; None to allocate one of the recorded dtype/shape).
        ``handle.wait()`` returns ``out``."""
        self._check_open()
        rec = self._record(key)
        if rec.write is not None:
            rec.write.wait(self.wait_timeout)      # raises the write's error: data not on disk
        if out is None:
            out = torch.empty(rec.shape, dtype=rec.dtype)
        if isinstance(out, Buffer):
            if out.nbytes != rec.nbytes:
                raise ValueError(f"swap_in({key!r}): buffer holds {out.nbytes} bytes, key has "
                                 f"{rec.nbytes}")
            dst = None
        else:
            dst = _tensor_bytes(out)
            if dst.numel() != rec.nbytes:
                raise ValueError(f"swap_in({key!r}): destination has {dst.numel()} bytes "
                                 f"({out.dtype}, {tuple(out.shape)}), the swapped tensor "
                                 f"{rec.nbytes} ({rec.dtype}, {rec.shape})")
        handle = SwapHandle("swap_in", key, rec.path, out, clock=self.waits)
        with self._lock:
            prefetched, rec.prefetch = rec.prefetch, {}
            rec.prefetch_wanted = False
            rec.reads = [r for r in rec.reads if not r.done()] + [handle]
            self.stats["swap_in"] += 1
            self.stats["bytes_in"] += rec.nbytes
        try:
            for i, (off, n) in enumerate(rec.pieces):
                if i in prefetched:  # (copied from the prefetch's buffer, into a pool Buffer too)
                    buf, h = prefetched.pop(i)
                    with self._lock:
                        self.stats["prefetch_hits"] += 1
                    handle._attach(h, self._read_finisher(out.data if dst is None else dst, off, n, buf, True))
                    continue
                if dst is None:                  # straight into the caller's buffer
                    h = self.aio.submit_read(rec.path, out.slice(off, n), off, n,
                                             rec.checksums[i])
                    handle._attach(h, lambda h: None)
                    continue
                buf = self.pool.acquire(n, timeout=self.wait_timeout)
                try:
                    h = self.aio.submit_read(rec.path, buf, off, n, rec.checksums[i])
                except BaseException:
                    buf.release()
                    raise
                handle._attach(h, self._read_finisher(dst, off, n, buf, False))
        except BaseException as e:
            for buf, h in prefetched.values():      # not handed to the handle: give back
                h.add_done_callback(lambda h, b=buf: (h.claim_error(), self._release_prefetch(b)))
            handle._seal(e)
            raise
        handle._seal()
        return handle

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        t0 = time.thread_time()
        _copy_bytes(dst, src)
        seconds = time.thread_time() - t0
        with self._lock:
            self.cpu_seconds["copy"] += seconds

    def _release_prefetch(self, buf: Buffer) -> None:
        buf.release()
        with self._lock:
            self._prefetched_bytes -= buf.capacity

    def _read_finisher(self, dst: torch.Tensor, off: int, n: int, buf: Buffer,
                       prefetched: bool):
        def finish(h: Handle) -> None:
            try:
                if h._error is None:
                    self._copy(dst[off: off + n], buf.data[:n])
            finally:
                if prefetched:
                    self._release_prefetch(buf)
                else:
                    buf.release()
        return finish

    # -- prefetch ---------------------------------------------------------------------------
    def prefetch(self, keys) -> int:
        """Start reading ``keys`` into pool buffers so that a later ``swap_in`` finds them
        (in flight or done). A hint: a key is skipped when the prefetch budget or the pool has
        no room right now. A key whose write is still in flight is read as soon as it lands.
        Returns the number of pieces started now."""
        self._check_open()
        started = 0
        for key in keys:
            rec = self._record(key)
            with self._lock:
                if rec.prefetch or rec.prefetch_wanted:
                    continue
                rec.prefetch_wanted = True
            if rec.write is not None and not rec.write.done():
                rec.write.add_done_callback(lambda _h, k=key, r=rec: self._start_prefetch(k, r))
            else:
                started += self._start_prefetch(key, rec)
        return started

    def _start_prefetch(self, key, rec: _Record) -> int:
        started = 0
        with self._lock:
            if (self._closed or self._records.get(key) is not rec or not rec.prefetch_wanted
                    or (rec.write is not None and rec.write._error is not None)):
                return 0
            rec.prefetch_wanted = False
            for i, (off, n) in enumerate(rec.pieces):
                if i in rec.prefetch:
                    continue
                need = self.pool.block_bytes * max(1, round_up(n, self.pool.block_bytes)
                                                   // self.pool.block_bytes)
                if self._prefetched_bytes + need > self.prefetch_bytes:
                    self.stats["prefetch_skipped"] += 1
                    break
                buf = self.pool.try_acquire(n)
                if buf is None:
                    self.stats["prefetch_skipped"] += 1
                    break
                try:
                    h = self.aio.submit_read(rec.path, buf, off, n, rec.checksums[i])
                except BaseException:  # noqa: BLE001 - swap_in will read it and report
                    buf.release()
                    break
                self._prefetched_bytes += buf.capacity
                rec.prefetch[i] = (buf, h)
                started += 1
        return started

    # -- release / close --------------------------------------------------------------------
    def release(self, key) -> None:
        """Forget ``key``: wait for its IO, free its prefetched buffers, delete its file."""
        with self._lock:
            rec = self._records.pop(key, None)
        if rec is None:
            return
        rec.prefetch_wanted = False
        self._drain(rec)
        try:
            os.unlink(rec.path)
        except FileNotFoundError:
            pass

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait for every swap_out and swap_in issued so far; raise the first error."""
        with self._lock:
            handles = [h for r in self._records.values()
                       for h in ([r.write] if r.write else []) + r.reads]
        t = self.wait_timeout if timeout is None else timeout
        for h in handles:
            h.wait(t)

    def close(self) -> None:
        """Wait for outstanding IO, free buffers, remove ``swap_dir/rank{r}`` (idempotent)."""
        if self._closed:
            return
        self._closed = True
        with self._lock:
            records = list(self._records.values())
            self._records.clear()
        try:
            for rec in records:
                rec.prefetch_wanted = False
                self._drain(rec)
        finally:
            fin = getattr(self, "_finalizer", None)
            if fin is not None:
                fin()

    def __enter__(self) -> "TensorSwapper":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TensorSwapper({self.rank_dir}, keys={len(self._records)})"
