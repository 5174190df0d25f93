"""The NVMe optimizer's swap records: each chunk's two records in a streaming buffer and on
disk (their keys, the generation committed, reads and writes as one handle per chunk), and one
shard's fp32 masters read or written alone, for a parameter tier that keeps no copy of its own.

**Chunk records.** A chunk of ``n`` elements is two swap records: its fp32 master values
(``4·n`` bytes, key ``….p``) and its two moments ``[exp_avg | exp_avg_sq]`` (``8·n`` bytes, key
``….mv``), each verified by the swap layer's size and checksum records (XXH3 by default). A
chunk costs two read and two write requests per pass. The master record on its own is what
makes the parameter tier and the optimizer share one copy of an fp32 shard: a stage-3 gather
reads a unit's master records (:meth:`NVMeAdamW.read_master`, 4 bytes per element, not 12),
so fp32 parameters on NVMe need no swap file of their own
(tiertrain/offload/shard_store.py, OptimizerMasterShards). A step given a shard's masters in
RAM (:meth:`NVMeAdamW.begin_step`, ``masters_in_ram``: the staging that gather read) reads only
the moments record, and a chunk that starts at a page boundary of that tensor is updated there
and its master record written from it with no copy: chunks are whole pages of masters
(``PAGE_ELEMS``) whenever the chunk size allows, so every cut of a shard whose pieces start at
multiples of ``ALIGN_ELEMS`` falls on a page boundary.

With ``transactional`` each record has two generations on disk: ``_gens`` names the committed
one of each chunk, a pass writes the other, and :meth:`ChunkRecords._commit` makes the ones
written current (tiertrain/update/nvme/optimizer.py, **Failures**).
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...io.buffers import Buffer, tensor_range_buffer
from ...io.swap_handle import SwapHandle
from .chunk_update import MASTER_BYTES, MOMENT_BYTES, Chunk

__all__ = ["ChunkRecords"]


class _Requests:
    """The swap requests of one chunk (its master and moments records) as one handle:
    ``wait`` waits for all of them, then raises the first error."""

    def __init__(self, handles: Sequence[SwapHandle]):
        self.handles = list(handles)

    def wait(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        first: Optional[BaseException] = None
        for h in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                h.wait(left)
            except BaseException as e:  # noqa: BLE001 - the others are waited for first
                first = first or e
        if first is not None:
            raise first

    def add_done_callback(self, fn: Callable[["_Requests"], None]) -> None:
        """Run ``fn(self)`` once every request completed (in the thread completing the last)."""
        left = [len(self.handles)]
        lock = threading.Lock()

        def one_done(_h) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn(self)
        for h in self.handles:
            h.add_done_callback(one_done)


class ChunkRecords:
    """The records part of :class:`~tiertrain.update.nvme.optimizer.NVMeAdamW` (a base class of
    it, working on its attributes: the chunks, their generations, the buffers, the swapper)."""

    # -- a chunk's records ------------------------------------------------------------------
    def _key(self, j: int, gen: int, part: str) -> str:
        """The key of chunk j's record ``part`` ("p": master, "mv": moments) of generation gen."""
        ch = self._chunks[j]
        return f"{self.name}.s{ch.shard}.c{ch.index}.g{gen}.{part}"

    def _positions(self, shards) -> List[int]:
        return [j for j, c in enumerate(self._chunks) if c.shard in shards]

    def _commit(self, new_gens: Dict[int, int]) -> None:
        for j, g in new_gens.items():
            self._gens[j] = g
        self._version += 1

    def _views(self, i: int, ch: Chunk):
        n = ch.numel
        padded = self._slots[i % self.num_buffers].padded
        moments = padded[self._moments_at: self._moments_at + MOMENT_BYTES * n].view(torch.float32)
        return padded[: MASTER_BYTES * n].view(torch.float32), moments[:n], moments[n:]

    def _records(self, j: int, i: int):
        """(key part, buffer) of chunk j's two records in the buffer of pass position i."""
        slot, n = self._slots[i % self.num_buffers], self._chunks[j].numel
        return (("p", slot.slice(0, MASTER_BYTES * n)), ("mv", slot.slice(self._moments_at, MOMENT_BYTES * n)))

    def _read(self, j: int, i: int, master: bool = True) -> _Requests:
        """Read chunk j's committed records into the buffer of pass position i (without the
        master record: only the moments)."""
        return _Requests([self.swapper.swap_in(self._key(j, self._gens[j], part), buf)
                          for part, buf in self._records(j, i) if master or part != "p"])

    def _write(self, j: int, i: int, gen: int, master: Optional[Buffer] = None) -> _Requests:
        """Write the buffer of pass position i as chunk j's records of generation gen (the
        master record from ``master`` instead, when given)."""
        records = self._records(j, i)
        if master is not None:
            records = (("p", master), records[1])
        return _Requests([self.swapper.swap_out(self._key(j, gen, part), buf) for part, buf in records])

    def _note_write_from_ram(self, shard: int, h: _Requests) -> None:
        with self._lock:
            self._writes_from_ram.setdefault(shard, []).append(h)

    def when_written(self, shard: int, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once every write the step issued straight from ``shard``'s masters in
        RAM (:meth:`begin_step`'s ``masters_in_ram``) has completed, landed or failed (in the IO
        thread completing the last, or now if none is in flight): until then the tensor must
        stay as it is."""
        with self._lock:
            pending = self._writes_from_ram.pop(shard, [])
        if not pending:
            fn()
            return
        _Requests([h for requests in pending for h in requests.handles]).add_done_callback(lambda _r: fn())

    def files(self, part: str = "mv") -> List[str]:
        """Paths of the swap files of the current generation, in chunk order: the moments
        records (``part="mv"``) or the masters (``"p"``)."""
        return [self.swapper._record(self._key(j, g, part)).path for j, g in enumerate(self._gens)]

    # -- one shard's masters, for a parameter tier that keeps no copy of its own --------------
    def _master_keys(self, shard: int) -> List[Tuple[str, Chunk]]:
        return [(self._key(j, self._gens[j], "p"), self._chunks[j]) for j in self._positions({shard})]

    def read_master(self, shard: int, out: torch.Tensor, padded: bool = False) -> _Requests:
        """Start reading shard's committed fp32 master values into ``out`` (fp32, the shard's
        size): its chunks' master records alone, 4 bytes per element. A chunk that starts at a
        page boundary of ``out`` lands there with no copy through the swap pool (``padded``:
        ``out``'s storage runs on past its end to a page boundary, bytes the read may fill, as
        from tiertrain/io/buffers.py page_aligned_empty). Allowed while an overlapped step
        runs, for shards it has not reached (a stage-3 gather during backward reads units whose
        gradients are not final yet; the engine guarantees that)."""
        self._check_readable()
        if out.numel() != self._shard_numels[shard] or out.dtype != torch.float32:
            raise ValueError(f"out is {out.dtype} of {out.numel()} elements; shard {shard} is fp32 "
                             f"of {self._shard_numels[shard]}")

        def into(ch: Chunk):
            buf = tensor_range_buffer(out, ch.lo, ch.hi, owns_tail=padded and ch.hi == out.numel())
            return out[ch.lo:ch.hi] if buf is None else buf
        return _Requests([self.swapper.swap_in(key, into(ch)) for key, ch in self._master_keys(shard)])

    def write_master(self, shard: int, values: torch.Tensor) -> Optional[_Requests]:
        """Replace shard's master values (any dtype, the shard's size), keeping its moments. In
        place, only the master records are written (the requests are returned: the values may
        be reused at once); transactional, :meth:`write_masters` runs (atomic) and None is
        returned."""
        if self.transactional:
            edited: List[Optional[torch.Tensor]] = [None] * self.num_shards
            edited[shard] = values
            self.write_masters(edited)
            return None
        self._check_usable()
        src = self._check_out([values if s == shard else None for s in range(self.num_shards)])[shard]
        try:
            return _Requests([self.swapper.swap_out(key, src[ch.lo:ch.hi].to(torch.float32))
                              for key, ch in self._master_keys(shard)])
        except BaseException as e:
            self._broken = f"write_master failed with {type(e).__name__}: {e}"
            raise
