"""Where the NVMe optimizer's fp32 masters are, seen from the flat buffers (ZeRO-Infinity §6).

With the optimizer on NVMe, the fp32 masters live in its chunk records, not in RAM: the flat
buffers are told only that their masters are held elsewhere
(:meth:`~tiertrain.zero.flat.FlatParameters.hold_masters_elsewhere`), and this module does
the rest for the NVMe form: the master records become the shards of fp32 units on NVMe
(:func:`optimizer_holds_masters`, through the store wrapper
:class:`~tiertrain.offload.shard_store.OptimizerMasterShards`), and each step's updated
values reach the compute-dtype shards through a :class:`ShardWriter` ("p swap").
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ...offload.shard_store import NVMeShards, OptimizerMasterShards

if TYPE_CHECKING:
    from ...zero.flat import FlatParameters


def optimizer_holds_masters(flat: "FlatParameters", optimizer) -> None:
    """The NVMe optimizer now holds the fp32 master of every trained unit whose shard is its
    own master on NVMe (fp32 parameters, see FlatParameters._build_unit): those shards are
    read from and written to its master records, and their own swap files go
    (OptimizerMasterShards)."""
    units = [u.unit.index for u in flat.units if flat.on_nvme(u.unit.index) and u.master is u.shard]
    if not units:
        return
    flat.wait_writes()  # (the wrapper takes the files' state over: nothing may be in flight)
    store = OptimizerMasterShards(flat.shards, optimizer, units)
    flat.use_store(store)
    for index in units:
        store.swapper.release(NVMeShards.key(index))


def master_shards(flat: "FlatParameters") -> OptimizerMasterShards | None:
    """The store whose shards are the optimizer's masters, or None (the parameter tier is not
    NVMe, or the parameters are not fp32)."""
    return flat.shards if isinstance(flat.shards, OptimizerMasterShards) else None


class WriteStaging:
    """One tensor in which a ShardWriter assembles a unit's shard for its swap write, kept by
    the NVMe form across steps: a new one per unit would fault in its pages again at every step
    (see NVMeShards)."""

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def get(self, numel: int, largest: int, dtype: torch.dtype) -> torch.Tensor:
        buf = self._buffer
        if buf is None or buf.numel() < numel:
            self._buffer = buf = torch.empty(max(numel, largest), dtype=dtype)
        return buf[:numel]


class ShardWriter:
    """Receives updated fp32 master values chunk by chunk, ``writer(unit, start, end,
    values)``, units in order: copies them into the compute-dtype shards; a unit whose shard
    lives on NVMe is assembled in a staging tensor and written once the optimizer has moved
    on to the next unit (so one unit's shard is staged at a time). Use as a context manager:
    leaving it writes the last unit and waits for the writes.

    Only a completely assembled unit is written: a step that failed or was cancelled part-way
    through a unit leaves that unit's swap file as it was, i.e. holding the pre-step shard
    (the optimizer restores, through this writer, only what was published, and the part of
    the unit that was never published must not be written as anything)."""

    def __init__(self, flat: "FlatParameters", staging: WriteStaging | None = None):
        self.flat = flat
        self.staging = staging if staging is not None else WriteStaging()
        self._staged: dict[int, tuple[torch.Tensor, set[tuple[int, int]]]] = {}  # unit -> (shard, chunk ranges)

    @classmethod
    def open(cls, flat: "FlatParameters", staging: WriteStaging) -> "ShardWriter":
        """A writer for one update of flat's shards (copies of the shards staged for the
        device before the update are dropped first)."""
        flat.shards.drop_staged()
        return cls(flat, staging)

    def __call__(self, index: int, start: int, end: int, values: torch.Tensor) -> None:
        flat = self.flat
        if not flat.on_nvme(index):
            flat.units[index].shard[start:end].copy_(values)
            return
        masters = master_shards(flat)
        if masters is not None and masters.holds_masters(index):  # (the optimizer's write of the chunk was the shard's)
            masters.updated(index, start, end, values)
            return
        for other in [i for i in self._staged if i != index]:
            self._write(other)
        if index not in self._staged:
            numel = flat.units[index].unit.shard_numel
            self._staged[index] = (self.staging.get(numel, max(u.unit.shard_numel for u in flat.units), flat.dtype),
                                   set())
        staged, covered = self._staged[index]
        staged[start:end].copy_(values)
        covered.add((start, end))  # (a restore republishes the same ranges)

    def _write(self, index: int) -> None:
        staged, covered = self._staged.pop(index)
        if sum(end - start for start, end in covered) == staged.numel():  # chunks tile the shard
            self.flat.shards.write(index, self.flat.units[index].shard, staged)

    def __enter__(self) -> "ShardWriter":
        return self

    def __exit__(self, *exc) -> None:
        for index in list(self._staged):
            self._write(index)
        self.flat.shards.forget_values()  # (the optimizer wrote the shards it holds itself)
        self.flat.wait_writes()
