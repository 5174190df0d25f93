"""Whole tensors' values written into an engine's units as each rank keeps them: the compute
copy (a resident unit's full buffer, a partitioned unit's shard, on its tier) and the fp32
master, cast from the given values themselves (a bf16 compute copy would round them).

Used by ``tiertrain.load_pretrained`` (tiertrain/state/pretrained.py: values read from
safetensors files, only the rows a rank keeps) and by ``model.load_state_dict`` on a wrapped
model (tiertrain/module_load.py: values from the state dict in memory). Each rank writes its
own part from the values it was given; nothing is communicated.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from .training_core import TrainingCore
    from .zero.flat import UnitBuffers


class ValueSource(Protocol):
    """Where the values come from, by key."""

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor."""

    def read_flat(self, key: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the row-major flattened tensor of this shape."""


class ValuesInMemory:
    """A ValueSource of tensors in memory, by name (a state dict's values); also tells its keys
    and each value's shape, as a checkpoint reader does (tiertrain/state/hf_conversion.py)."""

    def __init__(self, values: dict[str, torch.Tensor]):
        self.values = values

    def keys(self) -> list[str]:
        return list(self.values)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self.values[key].shape)

    def read(self, key: str) -> torch.Tensor:
        return self.values[key].detach()

    def read_flat(self, key: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        return self.values[key].detach().reshape(-1)[start:end]


def write_into_units(engine: "TrainingCore", keys: dict[str, str], source: ValueSource) -> set[str]:
    """Write the value of each layout parameter named in ``keys`` (slot name → the source's
    key) into its unit on this rank; returns the names of every parameter the layout holds
    (the caller copies the rest itself: parameters left whole, buffers). An update still in
    flight lands first, so that it cannot land on top of the values written."""
    engine.quiesce()
    engine.update.flush()
    placed: set[str] = set()
    for u in engine.flat.all_units:
        slots = {slot.name: keys[slot.name] for slot in u.unit.slots if slot.name in keys}
        placed.update(slot.name for slot in u.unit.slots)
        if slots:
            _into_unit(engine, u, slots, source)
    return placed


def _into_unit(engine: "TrainingCore", u: "UnitBuffers", keys: dict[str, str], source: ValueSource) -> None:
    """One unit on this rank. Resident: every slot whole into the unit's full buffer (every
    rank holds it whole), this rank's piece into the master. Partitioned: this rank's piece
    of each slot, read as the rows that hold it, into the shard and the master. A shard or a
    master on NVMe is assembled for the unit here and written once."""
    flat = engine.flat
    index, rank = u.unit.index, flat.shard_rank
    lo, hi = u.unit.shard_range(rank)
    pieces = u.unit.shard_pieces(rank)
    masters_elsewhere = u.trainable and flat.masters_elsewhere  # the NVMe optimizer keeps them
    master = None
    if masters_elsewhere:
        complete = all(slot.name in keys for slot, _, _ in pieces)
        master = (torch.zeros(u.unit.shard_numel, dtype=torch.float32) if complete
                  else MasterShards(engine).copy(index))
    elif u.trainable and u.master is not u.shard:
        master = u.master

    if u.unit.resident:
        for slot in u.unit.slots:
            if slot.name not in keys:
                continue
            values = source.read(keys[slot.name]).reshape(-1)
            u.full[slot.offset:slot.end].copy_(values)
            a, b = max(lo, slot.offset), min(hi, slot.end)
            if master is not None and a < b:
                master[a - lo:b - lo].copy_(values[a - slot.offset:b - slot.offset])
    else:
        flat.release(index)  # a gathered copy would hold the old values
        staged = flat.read_shard(index) if flat.on_nvme(index) else None
        shard = u.shard if staged is None else staged
        for slot, a, b in pieces:
            if slot.name not in keys:
                continue
            values = source.read_flat(keys[slot.name], slot.shape, lo + a - slot.offset, lo + b - slot.offset)
            shard[a:b].copy_(values)
            if master is not None:
                master[a:b].copy_(values)
        if staged is not None:
            flat.shards.write(index, u.shard, staged)
            flat.wait_writes()
    if masters_elsewhere and not flat.shards.holds_masters(index):  # (a shard that is its master was written)
        edited: list[torch.Tensor | None] = [None] * len(flat.units)
        edited[index] = master
        engine.update.write_masters(edited)


class MasterShards:
    """This rank's fp32 master shard of each trained unit, one unit at a time: where the
    optimizer keeps them on NVMe, only that unit's are read (never the rank's whole shard);
    in memory, the masters themselves (no copy)."""

    def __init__(self, engine: "TrainingCore"):
        self.update = engine.update
        nvme = getattr(engine.update, "nvme", None)
        self._read_one = getattr(nvme, "read_masters", None)
        self._all: list[torch.Tensor] | None = None

    def shard(self, index: int) -> torch.Tensor:
        if self._read_one is not None:
            return self._read_one(shards=[index])[index]
        if self._all is None:
            self._all = self.update.masters()
        return self._all[index]

    def copy(self, index: int) -> torch.Tensor:
        """Unit index's master shard as a tensor of the caller's own (what NVMe reads is one
        already; the masters in memory are copied)."""
        shard = self.shard(index)
        return shard if self._read_one is not None else shard.detach().clone()


__all__ = ["MasterShards", "ValueSource", "ValuesInMemory", "write_into_units"]
