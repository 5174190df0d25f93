"""A fixed budget of page-aligned (pinned when CUDA is present) byte buffers reused for all
swap traffic.

The pool owns one arena of ``total_bytes`` carved into ``block_bytes`` blocks. ``acquire(n)``
hands out a contiguous run of ceil(n / block_bytes) blocks (at least one) as a :class:`Buffer`
whose start is aligned to ``alignment`` and whose ``capacity`` (a whole number of blocks, hence a
multiple of the alignment) leaves room to pad an O_DIRECT transfer of ``n`` logical bytes. When the
budget is used up ``acquire`` blocks until a buffer comes back, and raises
:class:`PoolExhaustedError` after ``timeout`` seconds, so a leak shows up as an error naming the
budget instead of a hang. Nothing is allocated after construction: the arena is reused for every
request, as DeepNVMe's pinned-buffer layer does.
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Callable, Optional

import torch

from ..device import host_empty, pins_host_by_default
from ..errors import TiertrainError
from ..waits import run_timeout

__all__ = ["AlignedBufferPool", "Buffer", "PoolExhaustedError", "page_aligned_empty", "round_up",
           "tensor_range_buffer"]

DEFAULT_ACQUIRE_TIMEOUT = None
"""The run's one timeout (tiertrain.waits.run_timeout()), read when a pool is built."""


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class PoolExhaustedError(TiertrainError, RuntimeError):
    """No buffer of the requested size became free within the timeout."""


class Buffer:
    """``nbytes`` logical bytes at an aligned address, inside ``capacity`` usable bytes.

    ``data`` is a uint8 tensor of the logical bytes; ``view(dtype, shape)`` reinterprets them
    without copying; ``padded`` is the capacity-sized view used for aligned IO: an O_DIRECT
    transfer of ``nbytes`` moves ``round_up(nbytes, 4096)`` bytes, so it may write the bytes
    between the logical end and the next page boundary (zeros on a write, the file's padding on
    a read). A buffer is a context manager that gives itself back to its pool on exit;
    ``release()`` does the same and is idempotent.

    ``owns_tail=False`` (a range of someone's tensor, :func:`tensor_range_buffer`): the bytes
    between the logical end and the next page boundary hold someone else's data, so an O_DIRECT
    write sends them as they are (the file's padding is then not zeros; reads verify only the
    logical bytes) and a read never lands on them (it is served without O_DIRECT unless the
    logical size is a whole number of pages).
    """

    __slots__ = ("_pool", "_start_block", "_nblocks", "_storage", "nbytes", "capacity", "_released",
                 "owns_tail", "__weakref__")

    def __init__(self, pool: Optional["AlignedBufferPool"], start_block: int, nblocks: int,
                 storage: torch.Tensor, nbytes: int, owns_tail: bool = True):
        self._pool = pool
        self._start_block = start_block
        self._nblocks = nblocks
        self._storage = storage          # uint8, length == capacity, aligned
        self.nbytes = nbytes
        self.capacity = storage.numel()
        self._released = False
        self.owns_tail = owns_tail

    # -- views ------------------------------------------------------------------------------
    @property
    def data(self) -> torch.Tensor:
        """The logical bytes as a uint8 tensor (no copy)."""
        return self._storage[: self.nbytes]

    @property
    def padded(self) -> torch.Tensor:
        """The whole aligned capacity as a uint8 tensor (no copy)."""
        return self._storage

    @property
    def address(self) -> int:
        return self._storage.data_ptr()

    def view(self, dtype: torch.dtype = torch.uint8, shape=None) -> torch.Tensor:
        """The logical bytes reinterpreted as ``dtype`` (and reshaped), without a copy."""
        t = self.data.view(dtype)
        return t if shape is None else t.view(shape)

    def memoryview(self, nbytes: Optional[int] = None) -> memoryview:
        """A writable memoryview over the first ``nbytes`` (default: capacity) bytes, for
        os.preadv/os.pwritev. Valid while the buffer is held."""
        n = self.capacity if nbytes is None else nbytes
        if n == 0:
            return memoryview(bytearray(0))
        return memoryview((ctypes.c_char * n).from_address(self.address)).cast("B")

    def slice(self, offset: int, nbytes: int, alignment: int = 4096) -> "Buffer":
        """A view of ``nbytes`` logical bytes starting ``offset`` bytes in, with capacity up to
        the next ``alignment`` boundary (within this buffer). It shares this buffer's memory and
        releases nothing itself; aligned IO needs ``offset`` to be a multiple of the alignment."""
        if not (0 <= offset <= self.capacity and 0 <= nbytes <= self.capacity - offset):
            raise ValueError(f"slice [{offset}, {offset + nbytes}) outside capacity {self.capacity}")
        cap = min(self.capacity - offset, round_up(nbytes, alignment))
        return Buffer(None, 0, 0, self._storage[offset: offset + cap], nbytes, self.owns_tail)

    def resized(self, nbytes: int) -> "Buffer":
        """Set the logical size (≤ capacity) in place and return self."""
        if not 0 <= nbytes <= self.capacity:
            raise ValueError(f"logical size {nbytes} outside buffer capacity {self.capacity}")
        self.nbytes = nbytes
        return self

    # -- lifetime ---------------------------------------------------------------------------
    @property
    def released(self) -> bool:
        return self._released

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._pool is not None:
            self._pool._give_back(self._start_block, self._nblocks)

    def __enter__(self) -> "Buffer":
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def __repr__(self) -> str:
        return (f"Buffer(nbytes={self.nbytes}, capacity={self.capacity}, "
                f"address=0x{self.address:x}{', released' if self._released else ''})")


def tensor_range_buffer(t: torch.Tensor, start: int, end: int, alignment: int = 4096,
                        owns_tail: bool = False) -> Optional[Buffer]:
    """Elements [start, end) of the contiguous CPU tensor ``t`` as a Buffer sharing its memory,
    which the swap layer writes from (and reads into) with no copy through the pool; None when
    the range cannot go to the disk without a copy: it does not start at an ``alignment``
    boundary, or ``t``'s storage ends before the next boundary after the range (an O_DIRECT
    transfer moves whole pages). The bytes after the range up to that boundary are not the
    buffer's unless ``owns_tail`` (the caller knows they are padding nobody uses, as after a
    tensor of :func:`page_aligned_empty`). The caller keeps the range unchanged (a write) or
    unread (a read) until the request is done."""
    if t.device.type != "cpu" or not t.is_contiguous() or not 0 <= start <= end <= t.numel():
        return None
    size = t.element_size()
    storage = t.untyped_storage()
    offset = t.data_ptr() + start * size - storage.data_ptr()
    nbytes = (end - start) * size
    padded = round_up(nbytes, alignment)
    if (storage.data_ptr() + offset) % alignment or nbytes == 0 or offset + padded > storage.nbytes():
        return None
    raw = torch.empty(0, dtype=torch.uint8).set_(storage, offset, (padded,), (1,))
    return Buffer(None, 0, 0, raw, nbytes, owns_tail=owns_tail)


def page_aligned_empty(numel: int, dtype: torch.dtype,
                       empty: Optional[Callable[[int, torch.dtype], torch.Tensor]] = None,
                       alignment: int = 4096) -> torch.Tensor:
    """An uninitialised 1-D tensor of ``numel`` elements that starts at an ``alignment``
    boundary, with its storage running on to the next boundary after its end, so that every
    aligned range of it goes to and from the disk with no copy (:func:`tensor_range_buffer`).
    ``empty(n, dtype)`` allocates (default torch.empty; e.g. pinned host memory)."""
    size = torch.empty(0, dtype=dtype).element_size()
    if alignment % size:
        raise ValueError(f"alignment={alignment} is not a multiple of {dtype}'s {size} bytes")
    padded = round_up(numel * size, alignment) // size
    raw = (empty or (lambda n, d: torch.empty(n, dtype=d)))(padded + alignment // size, dtype)
    shift = (-raw.data_ptr()) % alignment // size
    return raw[shift: shift + numel]


class AlignedBufferPool:
    """A fixed budget of aligned (optionally pinned) byte buffers; see the module docstring."""

    def __init__(self, total_bytes: int, block_bytes: int = 8 << 20, alignment: int = 4096,
                 pin: Optional[bool] = None, acquire_timeout: Optional[float] = None):
        if pin is None:
            pin = pins_host_by_default()
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        if block_bytes <= 0 or block_bytes % alignment:
            raise ValueError(f"block_bytes ({block_bytes}) must be a positive multiple of the "
                             f"alignment ({alignment})")
        if total_bytes < block_bytes:
            raise ValueError(f"total_bytes ({total_bytes}) must hold at least one block of "
                             f"{block_bytes} bytes")
        self.block_bytes = block_bytes
        self.alignment = alignment
        self.num_blocks = total_bytes // block_bytes
        self.total_bytes = self.num_blocks * block_bytes
        self.pinned = bool(pin)
        # None: the run's one timeout (--timeout, tiertrain.waits.run_timeout()); a buffer
        # frees when IO completes, so this is an IO wait like the swapper's.
        self.acquire_timeout = run_timeout() if acquire_timeout is None else acquire_timeout
        raw = host_empty(self.total_bytes + alignment, torch.uint8, pinned=self.pinned)
        skip = (-raw.data_ptr()) % alignment
        self._raw = raw
        self._arena = raw[skip: skip + self.total_bytes]
        assert self._arena.data_ptr() % alignment == 0
        self._free = [True] * self.num_blocks
        self._free_count = self.num_blocks
        self._cond = threading.Condition()
        self.peak_blocks_in_use = 0
        self.acquires = 0

    # -- accounting -------------------------------------------------------------------------
    @property
    def bytes_in_use(self) -> int:
        with self._cond:
            return (self.num_blocks - self._free_count) * self.block_bytes

    @property
    def bytes_free(self) -> int:
        with self._cond:
            return self._free_count * self.block_bytes

    def owns(self, t: torch.Tensor) -> bool:
        """Whether tensor ``t``'s bytes lie inside this pool's arena."""
        if t.device.type != "cpu":
            return False
        a0 = self._arena.data_ptr()
        p = t.data_ptr()
        return a0 <= p and p + t.numel() * t.element_size() <= a0 + self.total_bytes

    # -- allocation -------------------------------------------------------------------------
    def _find_run(self, n: int) -> int:
        run = 0
        for i, free in enumerate(self._free):
            run = run + 1 if free else 0
            if run == n:
                return i - n + 1
        return -1

    def try_acquire(self, nbytes: int) -> Optional[Buffer]:
        """A buffer if one is free right now, else None."""
        return self._acquire(nbytes, timeout=0.0, raise_on_timeout=False)

    def acquire(self, nbytes: int, timeout: Optional[float] = None) -> Buffer:
        """A buffer of ``nbytes`` logical bytes (capacity rounded up to whole blocks), waiting at
        most ``timeout`` seconds (default: the pool's ``acquire_timeout``) for room."""
        return self._acquire(nbytes, timeout, raise_on_timeout=True)

    def _acquire(self, nbytes: int, timeout: Optional[float], raise_on_timeout: bool):
        if nbytes < 0:
            raise ValueError(f"negative buffer size {nbytes}")
        n = max(1, round_up(nbytes, self.block_bytes) // self.block_bytes)
        if n > self.num_blocks:
            raise ValueError(
                f"a buffer of {nbytes} bytes needs {n} blocks of {self.block_bytes} bytes, more than "
                f"the pool's whole budget of {self.total_bytes} bytes; enlarge the pool or split "
                f"the request")
        timeout = self.acquire_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                start = self._find_run(n) if self._free_count >= n else -1
                if start >= 0:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    if not raise_on_timeout:
                        return None
                    raise PoolExhaustedError(
                        f"buffer pool exhausted: {nbytes} bytes ({n} blocks of {self.block_bytes}) "
                        f"requested, {(self.num_blocks - self._free_count) * self.block_bytes} of "
                        f"{self.total_bytes} bytes in use (largest free run too small) after "
                        f"waiting {timeout:.3g} s; buffers are not being released, or the pool "
                        f"budget is too small for the requests in flight")
                self._cond.wait(left)
            for i in range(start, start + n):
                self._free[i] = False
            self._free_count -= n
            self.acquires += 1
            self.peak_blocks_in_use = max(self.peak_blocks_in_use, self.num_blocks - self._free_count)
        b0 = start * self.block_bytes
        storage = self._arena[b0: b0 + n * self.block_bytes]
        return Buffer(self, start, n, storage, nbytes)

    def _give_back(self, start: int, n: int) -> None:
        with self._cond:
            for i in range(start, start + n):
                assert not self._free[i], "block released twice"
                self._free[i] = True
            self._free_count += n
            self._cond.notify_all()

    def __repr__(self) -> str:
        return (f"AlignedBufferPool(total_bytes={self.total_bytes}, block_bytes={self.block_bytes}, "
                f"alignment={self.alignment}, pinned={self.pinned}, in_use={self.bytes_in_use})")
