"""Asynchronous bulk file IO in the style of DeepNVMe: a thread pool issuing parallel
``os.pwritev``/``os.preadv`` calls on files opened with ``O_DIRECT``.

A request is split into ``block_bytes`` chunks that run in parallel on ``num_threads`` workers;
the workers release the GIL inside the system calls (and inside ``zlib.crc32``), so several
requests to the device are in flight at once, which is what reaches the device's sequential
bandwidth. ``submit_*`` returns a :class:`Handle` at once; ``Handle.wait(timeout)`` returns when
every chunk finished and re-raises the first IO error; ``flush()`` waits for everything.

O_DIRECT needs the memory address, the file offset and the length to be multiples of the
device's logical block size (4096 covers every device we meet). A request whose buffer is an
:class:`~tiertrain.io.buffers.Buffer` of the aligned pool always qualifies: a write of ``n``
logical bytes writes ``round_up(n, 4096)`` bytes (the tail of the last page zero-filled from the
buffer's own capacity, or sent as it is when the tail is not the buffer's:
``Buffer.owns_tail``) and a read of ``n`` bytes reads the padded length into the buffer and
reports exactly ``n`` logical bytes. So any size works, including 0 and a few bytes. A request
with an unaligned buffer or offset (a plain tensor, ``bytes``) is served through the page cache
instead, with the same results.

When a filesystem refuses O_DIRECT (EINVAL on open or on the first transfer) the device is
remembered as buffered-only, a line is added to :attr:`AsyncIO.notes`, and its IO continues
buffered with ``fdatasync`` at the end of every write and ``POSIX_FADV_DONTNEED`` so that the
page cache neither inflates the measured bandwidth nor holds swapped data in RAM.

Integrity: a write records one checksum per chunk of the logical bytes (:class:`Checksum`,
returned in ``Handle.checksum``); a read given that record verifies each chunk as it lands and
raises :class:`SwapCorruptionError` naming the file and the byte range on a mismatch. A read that
finds fewer bytes than requested (a truncated file) raises :class:`SwapCorruptionError` with the
expected and the actual byte count. The record lives in the caller's memory (the swapper keeps
it per key): swap files never outlive the process that wrote them, so there is no on-disk header
to keep in sync and no extra IO. The default checksum is XXH3-64 (the ``xxhash`` package; its
C code releases the GIL), chosen for its CPU cost per byte: the checksums run on the same few
cores as the optimizer update and the copies, and every byte swapped is hashed twice (when
written, when read back). One idle thread of this project's 2-core machines hashes 20.5 GB/s
with XXH3, 17.2 with :func:`sum64` (position-weighted 64-bit page sums by numpy's SIMD
reductions, the default before), 17.2 with crc32c and 3.7 with ``zlib.crc32``; under load
(another process compiling) 12.2, 8.8, 9.9 and 2.2 (bench/results/scale.md, "CPU per byte").
XXH3 is also the stronger of the fast ones: a real hash of every byte in order, which catches
the swapped words sum64 can miss.
``checksum="sum64"`` remains (and is the default where ``xxhash`` is missing), and ``"crc32"``;
``checksum=None`` turns verification off (sizes are still checked). :attr:`AsyncIO.cpu_seconds`
counts the CPU time the checksums took (thread CPU time, all workers).

Errors always name the path: :class:`SwapSpaceError` for ENOSPC/EDQUOT/EFBIG (with the bytes
requested), :class:`SwapDirError` for a missing, non-directory or read-only location,
:class:`SwapCorruptionError` for a short read or a checksum mismatch.
"""
from __future__ import annotations

import enum
import errno as _errno
import os
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from ..errors import TiertrainError
from ..waits import run_timeout
from .buffers import Buffer, round_up

__all__ = ["AsyncIO", "Checksum", "Handle", "SwapCorruptionError", "SwapDirError", "SwapError",
           "SwapSpaceError"]

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def _load_fallocate():
    """libc's fallocate(2) wrapper: unlike os.posix_fallocate it never falls back to writing
    zeros when the filesystem cannot preallocate (it fails with EOPNOTSUPP instead)."""
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        fn = libc.fallocate
        fn.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong]
        fn.restype = ctypes.c_int

        def fallocate(fd: int, offset: int, length: int) -> None:
            if fn(fd, 0, offset, length) != 0:
                e = ctypes.get_errno()
                raise OSError(e, os.strerror(e))
        return fallocate
    except (OSError, AttributeError):
        return None


_fallocate = _load_fallocate()
_SPACE_ERRNOS = {_errno.ENOSPC, _errno.EDQUOT, _errno.EFBIG}
_DIR_ERRNOS = {_errno.ENOENT, _errno.ENOTDIR, _errno.EACCES, _errno.EPERM, _errno.EROFS,
               _errno.EISDIR}


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------
class SwapError(TiertrainError, OSError):
    """Base of the swap errors; ``path`` is the file or directory concerned."""

    def __init__(self, message: str, path: str, errno: Optional[int] = None):
        super().__init__(message)
        self.path = path
        if errno is not None:
            self.errno = errno


class SwapDirError(SwapError):
    """The swap location is missing, not a directory, or not writable."""

    exit_code = 1


class SwapSpaceError(SwapError):
    """The filesystem (or a file size limit) has no room for a write."""

    def __init__(self, message: str, path: str, requested_bytes: int, errno: Optional[int] = None):
        super().__init__(message, path, errno)
        self.requested_bytes = requested_bytes


class SwapCorruptionError(SwapError):
    """A swap file is shorter than what was written to it, or its bytes changed."""

    def __init__(self, message: str, path: str, expected_bytes: Optional[int] = None,
                 actual_bytes: Optional[int] = None):
        super().__init__(message, path, _errno.EIO)
        self.expected_bytes = expected_bytes
        self.actual_bytes = actual_bytes


def _free_bytes(path: str) -> Optional[int]:
    try:
        st = os.statvfs(os.path.dirname(path) or ".")
        return st.f_bavail * st.f_frsize
    except OSError:
        return None


def _translate(e: OSError, path: str, op: str, nbytes: int, offset: int) -> OSError:
    """An OSError from a transfer or an open, as the error a user can act on (path included)."""
    if isinstance(e, SwapError):
        return e
    code = e.errno
    if code in _SPACE_ERRNOS:
        if code == _errno.EFBIG:
            why = ("file too large (EFBIG: the process's RLIMIT_FSIZE or the filesystem's "
                   "maximum file size)")
        else:
            free = _free_bytes(path)
            why = (f"{os.strerror(code)} ({errno_name(code)}; "
                   f"{'unknown' if free is None else free} bytes free on the filesystem)")
        return SwapSpaceError(f"out of swap space writing {nbytes} bytes to {path} at offset "
                              f"{offset}: {why}", path, nbytes, code)
    if code in _DIR_ERRNOS:
        return SwapDirError(f"cannot {op} swap file {path}: {os.strerror(code)} "
                            f"({errno_name(code)})", path, code)
    err = OSError(code, f"{op} of {nbytes} bytes at offset {offset} of {path} failed: "
                        f"{e.strerror or e}")
    err.filename = path
    return err


def errno_name(code: Optional[int]) -> str:
    return _errno.errorcode.get(code, str(code)) if code is not None else "?"


# ---------------------------------------------------------------------------------------------
# Checksums
# ---------------------------------------------------------------------------------------------
_PAGE = 4096


def sum64(data) -> int:
    """A fast position-aware checksum: per 4 KiB page the wrapping 64-bit sum of its words, and
    over the pages their plain sum and their sum weighted by page number (both mod 2^64); the
    bytes after the last whole page go through CRC-32. One pass of numpy reductions (SIMD, GIL
    released), which is why it is cheaper per byte than zlib.crc32. It catches any change of a
    single byte or of bytes within one 64-bit word, a truncated, zeroed or stale page (unless
    its sum happens to be unchanged) and pages written to the wrong place; it can miss changes
    that cancel in the sum, e.g. two words of a page swapped, which CRC-32 ("crc32") would catch
    at a higher CPU cost."""
    mv = memoryview(data).cast("B")
    n = mv.nbytes
    full = n - n % _PAGE
    weighted = plain = 0
    if full:
        pages = np.frombuffer(mv[:full], dtype=np.uint64).reshape(-1, _PAGE // 8).sum(
            axis=1, dtype=np.uint64)
        plain = int(pages.sum(dtype=np.uint64))
        weighted = int((pages * np.arange(1, pages.shape[0] + 1, dtype=np.uint64)).sum(
            dtype=np.uint64))
    return (weighted << 96) | (plain << 32) | zlib.crc32(mv[full:])


_CHECKSUM_FUNCS = {"sum64": sum64, "crc32": zlib.crc32, "adler32": zlib.adler32}
try:
    import xxhash as _xxhash
except ImportError:  # (a dependency of tiertrain; an environment without it falls back to sum64)
    _xxhash = None
else:
    _CHECKSUM_FUNCS["xxh3"] = _xxhash.xxh3_64_intdigest
DEFAULT_CHECKSUM = "xxh3" if _xxhash is not None else "sum64"
"""The checksum swap files are verified with unless a caller picks another (module docstring)."""


@dataclass(frozen=True)
class Checksum:
    """Per-chunk checksums of ``nbytes`` logical bytes, chunked by ``block_bytes``."""

    kind: str
    block_bytes: int
    nbytes: int
    values: Tuple[int, ...]


# ---------------------------------------------------------------------------------------------
# Handles
# ---------------------------------------------------------------------------------------------
class Op(enum.StrEnum):
    """What a request does (a str: messages and reprs read "read"/"write")."""

    READ = "read"
    WRITE = "write"


class Handle:
    """One submitted request. ``wait(timeout)`` returns the logical byte count or raises the IO
    error (a ``TimeoutError`` naming the path if it is not done in time)."""

    def __init__(self, io: "AsyncIO", op: Op, path: str, offset: int, nbytes: int):
        self._io = io
        self.op = op
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.checksum: Optional[Checksum] = None
        self.direct = False
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: Optional[BaseException] = None
        self._callbacks: List[Callable[["Handle"], None]] = []
        self._observed = False
        self.submitted_at = time.perf_counter()
        self.finished_at: Optional[float] = None

    def done(self) -> bool:
        return self._event.is_set()

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        self._wait_event(timeout)
        return self._error

    def wait(self, timeout: Optional[float] = None) -> int:
        """None: the run's timeout (tiertrain.waits.run_timeout()); nothing waits unbounded."""
        self._wait_event(run_timeout() if timeout is None else timeout)
        if self._error is not None:
            self._observed = True
            self._io._observed(self)
            raise self._error
        return self.nbytes

    def _wait_event(self, timeout: Optional[float]) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.op} of {self.nbytes} bytes at offset {self.offset} of "
                               f"{self.path} not finished after {timeout} s")

    def claim_error(self) -> None:
        """Take over reporting this request's error (a layer on top re-raises it from its own
        handle), so that ``AsyncIO.flush`` does not report it a second time."""
        self._observed = True
        self._io._observed(self)

    def add_done_callback(self, fn: Callable[["Handle"], None]) -> None:
        """Run ``fn(handle)`` when the request completes (in the worker thread that completes
        it, or now if it already has). Exceptions from ``fn`` are ignored."""
        with self._lock:
            if not self._event.is_set():
                self._callbacks.append(fn)
                return
        _call_quietly(fn, self)

    def _finish(self, error: Optional[BaseException]) -> None:
        with self._lock:
            self._error = error
            self.finished_at = time.perf_counter()
            self._event.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            _call_quietly(fn, self)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"Handle({self.op} {self.path}@{self.offset}+{self.nbytes}, {state})"


def _call_quietly(fn, arg) -> None:
    try:
        fn(arg)
    except BaseException:  # noqa: BLE001 - a callback must not kill an IO worker
        pass


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------
class _Request:
    """Shared state of the chunks of one request."""

    def __init__(self, io: "AsyncIO", handle: Handle, fd: int, direct: bool, mv: memoryview,
                 io_len: int, flags: int, nchunks: int, verify: Optional[Checksum]):
        self.io = io
        self.handle = handle
        self.fd = fd
        self.direct = direct
        self.mv = mv
        self.io_len = io_len
        self.flags = flags               # open flags without O_DIRECT, for a buffered fallback
        self.remaining = nchunks
        self.lock = threading.Lock()
        self.error: Optional[BaseException] = None
        self.crcs: List[int] = [0] * nchunks
        self.verify = verify
        self.fallback_fd: Optional[int] = None
        self.keepalive = None

    def buffered_fd(self) -> int:
        with self.lock:
            if self.fallback_fd is None:
                self.fallback_fd = os.open(self.handle.path, self.flags & ~os.O_TRUNC, 0o600)
            return self.fallback_fd


def _normalize(buffer, nbytes: Optional[int], writable: bool):
    """(memoryview over the usable bytes, logical byte count, aligned capacity or 0, address,
    keepalive). The memoryview may extend past the logical bytes only for pool buffers."""
    if isinstance(buffer, Buffer):
        if buffer.released:
            raise ValueError("buffer was released to its pool")
        n = buffer.nbytes if nbytes is None else nbytes
        if n > buffer.capacity:
            raise ValueError(f"{n} bytes requested from a buffer of capacity {buffer.capacity}")
        return buffer.memoryview(), n, buffer.capacity, buffer.address, buffer
    if isinstance(buffer, torch.Tensor):
        if buffer.device.type != "cpu":
            raise ValueError("AsyncIO transfers need a CPU tensor (stage CUDA tensors through "
                             "a pinned pool buffer)")
        if not buffer.is_contiguous():
            raise ValueError("AsyncIO transfers need a contiguous tensor")
        size = buffer.numel() * buffer.element_size()
        n = size if nbytes is None else nbytes
        if n > size:
            raise ValueError(f"{n} bytes requested from a tensor of {size} bytes")
        if size == 0:
            return memoryview(bytearray(0)), 0, 0, 0, buffer
        import ctypes
        mv = memoryview((ctypes.c_char * size).from_address(buffer.data_ptr())).cast("B")
        return mv, n, size, buffer.data_ptr(), buffer
    mv = memoryview(buffer).cast("B")
    if writable and mv.readonly:
        raise ValueError("a read needs a writable buffer")
    n = mv.nbytes if nbytes is None else nbytes
    if n > mv.nbytes:
        raise ValueError(f"{n} bytes requested from a buffer of {mv.nbytes} bytes")
    return mv, n, 0, 0, buffer          # address unknown: served buffered


class AsyncIO:
    """Parallel chunked file IO with O_DIRECT; see the module docstring.

    ``num_threads`` workers, ``block_bytes`` per chunk (a multiple of ``alignment``),
    ``use_direct`` to try O_DIRECT, ``checksum`` in {"xxh3", "sum64", "crc32", "adler32", None},
    ``fsync_buffered`` to fdatasync buffered (non-direct) writes before they count as done,
    ``preallocate`` to fallocate the range of a write that extends its file first, in a worker
    (see ``_preallocate``; a full disk then fails the request before any data is written).
    """

    def __init__(self, num_threads: int = 4, block_bytes: int = 8 << 20, use_direct: bool = True,
                 alignment: int = 4096, checksum: Optional[str] = DEFAULT_CHECKSUM,
                 fsync_buffered: bool = True, preallocate: bool = True):
        if num_threads < 1:
            raise ValueError(f"num_threads must be ≥ 1, got {num_threads}")
        if block_bytes <= 0 or block_bytes % alignment:
            raise ValueError(f"block_bytes ({block_bytes}) must be a positive multiple of the "
                             f"alignment ({alignment})")
        if checksum is not None and checksum not in _CHECKSUM_FUNCS:
            raise ValueError(f"checksum must be one of {sorted(_CHECKSUM_FUNCS)} or None, "
                             f"got {checksum!r}")
        self.num_threads = num_threads
        self.block_bytes = block_bytes
        self.alignment = alignment
        self.use_direct = bool(use_direct and _O_DIRECT)
        self.checksum = checksum
        self._crc = _CHECKSUM_FUNCS.get(checksum) if checksum else None
        self.fsync_buffered = fsync_buffered
        self.preallocate = preallocate
        self.notes: List[str] = []
        self._direct_ok: dict = {}      # st_dev -> True (confirmed) / False (refused)
        self._lock = threading.Lock()
        self._pending: set = set()
        self._unobserved: List[Handle] = []
        self._closed = False
        self._executor = ThreadPoolExecutor(num_threads, thread_name_prefix="tiertrain-aio")
        self.stats = {"write_requests": 0, "read_requests": 0, "bytes_written": 0,
                      "bytes_read": 0, "buffered_requests": 0}
        self.cpu_seconds = {"checksum": 0.0}
        """CPU time the workers spent computing and verifying checksums (thread CPU time)."""

    # -- public API -------------------------------------------------------------------------
    def submit_write(self, path, buffer, offset: int = 0, nbytes: Optional[int] = None,
                     truncate: bool = False) -> Handle:
        """Write the logical bytes of ``buffer`` (a pool Buffer, a CPU tensor or a bytes-like
        object) to ``path`` at ``offset``; the file is created if needed (and truncated first
        with ``truncate``). ``handle.checksum`` holds the checksum record once it is done."""
        return self._submit(Op.WRITE, os.fspath(path), buffer, offset, nbytes, None, truncate)

    def submit_read(self, path, buffer, offset: int = 0, nbytes: Optional[int] = None,
                    checksum: Optional[Checksum] = None) -> Handle:
        """Read ``nbytes`` (default: the buffer's logical size) from ``path`` at ``offset`` into
        ``buffer``; with a ``checksum`` record from the write, verify the bytes."""
        return self._submit(Op.READ, os.fspath(path), buffer, offset, nbytes, checksum, False)

    def flush(self, timeout: Optional[float] = None) -> None:
        """Wait for every submitted request; raise the first error no ``wait`` has reported.
        timeout None: the run's timeout (tiertrain.waits.run_timeout())."""
        deadline = time.monotonic() + (run_timeout() if timeout is None else timeout)
        while True:
            with self._lock:
                pending = list(self._pending)
            if not pending:
                break
            for h in pending:
                h._wait_event(max(0.0, deadline - time.monotonic()))
        with self._lock:
            errors = [h for h in self._unobserved if not h._observed]
            self._unobserved.clear()
        if errors:
            first = errors[0]
            first._observed = True
            if len(errors) > 1:
                first._error.add_note(f"... and {len(errors) - 1} more failed IO request(s): "
                                      + ", ".join(h.path for h in errors[1:4]))
            raise first._error

    def close(self, timeout: Optional[float] = None) -> None:
        """Wait for outstanding requests and stop the workers (idempotent)."""
        if self._closed:
            return
        stuck = False
        try:
            self.flush(timeout)
        except TimeoutError:
            stuck = True  # a request blocked in the kernel: joining its thread would hang too
            raise
        finally:
            self._closed = True
            self._executor.shutdown(wait=not stuck, cancel_futures=stuck)

    def __enter__(self) -> "AsyncIO":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def direct_supported(self, path) -> Optional[bool]:
        """True/False once a transfer on ``path``'s filesystem showed whether O_DIRECT works;
        None before."""
        try:
            dev = os.stat(os.path.dirname(os.fspath(path)) or ".").st_dev
        except OSError:
            return None
        return self._direct_ok.get(dev)

    # -- internals --------------------------------------------------------------------------
    def _observed(self, h: Handle) -> None:
        with self._lock:
            if h in self._unobserved:
                self._unobserved.remove(h)

    def _note_refused(self, dev: int, path: str, how: str) -> None:
        with self._lock:
            if self._direct_ok.get(dev) is False:
                return
            self._direct_ok[dev] = False
            self.notes.append(f"O_DIRECT refused on the filesystem of {os.path.dirname(path)} "
                              f"(st_dev {dev}, {how}); its IO is buffered, with fdatasync after "
                              f"each write and POSIX_FADV_DONTNEED")

    def _open(self, op: Op, path: str, direct_wanted: bool, truncate: bool,
              nbytes: int, offset: int):
        flags = (os.O_WRONLY | os.O_CREAT) if op is Op.WRITE else os.O_RDONLY
        if truncate:
            flags |= os.O_TRUNC
        flags |= getattr(os, "O_CLOEXEC", 0)
        dev = None
        if direct_wanted:
            try:
                dev = os.stat(os.path.dirname(path) or ".").st_dev
            except OSError as e:
                raise _translate(e, path, "open", nbytes, offset) from e
            if self._direct_ok.get(dev) is False:
                direct_wanted = False
        try:
            if direct_wanted:
                try:
                    return os.open(path, flags | _O_DIRECT, 0o600), True, flags, dev
                except OSError as e:
                    if e.errno != _errno.EINVAL:
                        raise
                    self._note_refused(dev, path, "EINVAL on open")
            return os.open(path, flags, 0o600), False, flags, dev
        except OSError as e:
            raise _translate(e, path, "open" if op is Op.READ else "create", nbytes, offset) from e

    def _preallocate(self, fd: int, path: str, offset: int, length: int, nbytes: int) -> None:
        """Reserve [offset, offset+length) before the parallel chunk writes when it extends the
        file: the file stays in few extents (parallel writes into an empty ext4 file left ~100
        extents per GiB here, against 9 for dd) and a full disk fails now, before any data is
        written. Filesystems that cannot preallocate are skipped."""
        if os.fstat(fd).st_size >= offset + length:
            return
        try:
            _fallocate(fd, offset, length)
        except OSError as e:
            if e.errno in (_errno.EOPNOTSUPP, _errno.ENOSYS, _errno.EINVAL):
                return
            raise _translate(e, path, "write", nbytes, offset) from e

    def _submit(self, op, path, buffer, offset, nbytes, verify, truncate) -> Handle:
        if self._closed:
            raise RuntimeError("AsyncIO is closed")
        if offset < 0:
            raise ValueError(f"negative offset {offset}")
        mv, n, capacity, address, keep = _normalize(buffer, nbytes, writable=(op is Op.READ))
        if verify is not None and verify.nbytes != n:
            raise ValueError(f"checksum record covers {verify.nbytes} bytes, read asks for {n}")
        a = self.alignment
        padded = round_up(n, a)
        owns_tail = getattr(buffer, "owns_tail", True)   # (a range of someone's tensor: see Buffer)
        if not owns_tail and op is Op.READ:
            capacity = min(capacity, n)
        aligned = (address % a == 0 and address != 0 and offset % a == 0 and padded <= capacity)
        fd, direct, flags, dev = self._open(op, path, self.use_direct and aligned and n > 0,
                                            truncate, n, offset)
        io_len = padded if direct else n
        if direct and op is Op.WRITE and padded > n and owns_tail:
            mv[n:padded] = bytes(padded - n)        # zero the tail of the last page
        handle = Handle(self, op, path, offset, n)
        handle.direct = direct
        bb = self.block_bytes
        nchunks = max(1, -(-io_len // bb))
        req = _Request(self, handle, fd, direct, mv, io_len, flags, nchunks, verify)
        req.keepalive = keep
        req.dev = dev
        with self._lock:
            self._pending.add(handle)
            self.stats[f"{op}_requests"] += 1
            if not direct and n > 0:
                self.stats["buffered_requests"] += 1
        if op is Op.WRITE and io_len and self.preallocate and _fallocate is not None:
            try:                         # fallocate runs in a worker, then queues the chunks
                self._executor.submit(self._preallocate_then_start, req)
            except BaseException as e:  # noqa: BLE001 - executor shut down underneath us
                for _ in range(nchunks):
                    self._chunk_done(req, e)
        else:
            self._start_chunks(req)
        return handle

    def _start_chunks(self, req: _Request) -> None:
        work = self._write_chunk if req.handle.op is Op.WRITE else self._read_chunk
        bb, nchunks, i = self.block_bytes, req.remaining, 0
        try:
            for i in range(nchunks):
                lo = i * bb
                self._executor.submit(self._run_chunk, work, req, i, lo, min(req.io_len, lo + bb))
        except BaseException as e:       # noqa: BLE001 - executor shut down underneath us
            for _ in range(nchunks - i):
                self._chunk_done(req, e)

    def _preallocate_then_start(self, req: _Request) -> None:
        h = req.handle
        try:
            self._preallocate(req.fd, h.path, h.offset, req.io_len, h.nbytes)
        except BaseException as e:  # noqa: BLE001 - reported through the handle
            for _ in range(req.remaining):
                self._chunk_done(req, e)
            return
        self._start_chunks(req)

    def _run_chunk(self, work, req: _Request, i: int, lo: int, hi: int) -> None:
        err = None
        if req.error is None:            # a failed sibling makes the rest moot
            try:
                work(req, i, lo, hi)
            except BaseException as e:   # noqa: BLE001 - reported through the handle
                err = e
        self._chunk_done(req, err)

    def _chunk_done(self, req: _Request, err: Optional[BaseException]) -> None:
        with req.lock:
            if err is not None and req.error is None:
                req.error = err
            req.remaining -= 1
            last = req.remaining == 0
        if last:
            self._finish(req)

    def _fallback(self, req: _Request, e: OSError, path: str) -> bool:
        """Whether an EINVAL on a direct transfer means 'filesystem refuses O_DIRECT' (then the
        request continues buffered)."""
        if not req.direct or e.errno != _errno.EINVAL:
            return False
        dev = req.dev
        if self._direct_ok.get(dev) is True:
            return False                 # O_DIRECT worked here before: a real error
        self._note_refused(dev, path, "EINVAL on the first transfer")
        return True

    def _write_chunk(self, req: _Request, i: int, lo: int, hi: int) -> None:
        h = req.handle
        n = h.nbytes
        if self._crc is not None and lo < n:
            t0 = time.thread_time()
            req.crcs[i] = self._crc(req.mv[lo:min(hi, n)])
            self._count_cpu("checksum", time.thread_time() - t0)
        fd, pos = req.fd, lo
        while pos < hi:
            try:
                k = os.pwritev(fd, [req.mv[pos:hi]], h.offset + pos)
            except OSError as e:
                if fd == req.fd and self._fallback(req, e, h.path):
                    fd = req.buffered_fd()
                    continue
                raise _translate(e, h.path, "write", n, h.offset) from e
            if k <= 0:
                raise SwapSpaceError(f"out of swap space writing {n} bytes to {h.path} at offset "
                                     f"{h.offset}: the write made no progress at byte "
                                     f"{pos}", h.path, n, _errno.ENOSPC)
            pos += k
        if req.direct and fd == req.fd and req.dev is not None:
            self._direct_ok.setdefault(req.dev, True)

    def _read_chunk(self, req: _Request, i: int, lo: int, hi: int) -> None:
        h = req.handle
        n = h.nbytes
        need = max(0, min(hi, n) - lo)    # logical bytes this chunk must deliver
        fd, pos = req.fd, lo
        while pos - lo < need:
            try:
                k = os.preadv(fd, [req.mv[pos:hi]], h.offset + pos)
            except OSError as e:
                if fd == req.fd and req.direct and e.errno == _errno.EINVAL and pos > lo:
                    fd = req.buffered_fd()   # short direct read left an unaligned position
                    continue
                if fd == req.fd and self._fallback(req, e, h.path):
                    fd = req.buffered_fd()
                    continue
                raise _translate(e, h.path, "read", n, h.offset) from e
            if k == 0:
                try:
                    size = os.fstat(fd).st_size
                except OSError:
                    size = -1
                actual = max(0, size - h.offset)
                raise SwapCorruptionError(
                    f"short read from {h.path}: expected {n} bytes at offset {h.offset}, the file "
                    f"holds only {actual} (size {size}); the swap file was truncated",
                    h.path, expected_bytes=n, actual_bytes=actual)
            pos += k
        if req.direct and fd == req.fd and req.dev is not None:
            self._direct_ok.setdefault(req.dev, True)
        ck = req.verify
        if ck is not None and ck.block_bytes == self.block_bytes and need > 0:
            self._verify(req, ck, i, lo, lo + need)

    def _verify(self, req: _Request, ck: Checksum, i: int, lo: int, hi: int) -> None:
        fn = _CHECKSUM_FUNCS[ck.kind]
        t0 = time.thread_time()
        got = fn(req.mv[lo:hi])
        self._count_cpu("checksum", time.thread_time() - t0)
        if got != ck.values[i]:
            h = req.handle
            raise SwapCorruptionError(
                f"checksum mismatch in {h.path}: {ck.kind} of bytes {lo}..{hi} of the "
                f"{h.nbytes}-byte record at offset {h.offset} is {got:#x}, was {ck.values[i]:#x} "
                f"when written; the swap file was modified or the device corrupted it",
                h.path, expected_bytes=h.nbytes, actual_bytes=None)

    def _count_cpu(self, what: str, seconds: float) -> None:
        with self._lock:
            self.cpu_seconds[what] += seconds

    def _finish(self, req: _Request) -> None:
        h = req.handle
        err = req.error
        try:
            if err is None and h.op is Op.READ and req.verify is not None and h.nbytes > 0 \
                    and req.verify.block_bytes != self.block_bytes:
                ck = req.verify
                for j, lo in enumerate(range(0, h.nbytes, ck.block_bytes)):
                    self._verify(req, ck, j, lo, min(h.nbytes, lo + ck.block_bytes))
            buffered = (not req.direct) or req.fallback_fd is not None
            if err is None and h.op is Op.WRITE and buffered and self.fsync_buffered and h.nbytes:
                fd = req.fallback_fd if req.fallback_fd is not None else req.fd
                try:
                    os.fdatasync(fd)
                except OSError as e:
                    raise _translate(e, h.path, "write", h.nbytes, h.offset) from e
            if buffered and h.nbytes and hasattr(os, "posix_fadvise"):
                for fd in (req.fd, req.fallback_fd):
                    if fd is not None:
                        try:
                            os.posix_fadvise(fd, h.offset, req.io_len, os.POSIX_FADV_DONTNEED)
                        except OSError:
                            pass
        except BaseException as e:   # noqa: BLE001
            err = e
        finally:
            for fd in (req.fd, req.fallback_fd):
                if fd is not None:
                    try:
                        os.close(fd)
                    except OSError:
                        pass
        if err is None:
            if h.op is Op.WRITE and self._crc is not None:
                nck = max(1, -(-h.nbytes // self.block_bytes)) if h.nbytes else 0
                h.checksum = Checksum(self.checksum, self.block_bytes, h.nbytes,
                                      tuple(req.crcs[:nck]))
            elif h.op is Op.READ:
                h.checksum = req.verify
            with self._lock:
                self.stats["bytes_written" if h.op is Op.WRITE else "bytes_read"] += h.nbytes
        req.mv = None
        req.keepalive = None
        with self._lock:
            self._pending.discard(h)
            if err is not None:
                self._unobserved.append(h)
        h._finish(err)

    def __repr__(self) -> str:
        return (f"AsyncIO(num_threads={self.num_threads}, block_bytes={self.block_bytes}, "
                f"use_direct={self.use_direct}, checksum={self.checksum!r})")
