"""The flat, aligned partition layout of ZeRO (§5 of the ZeRO paper).

Parameters are packed into *units*: contiguous flat buffers, each padded so that it splits
into ``num_shards`` equal, aligned shards; data-parallel rank r owns shard r of every
unit. Under stages 0-2 a unit is a gradient bucket (reduced as soon as its last gradient
arrives); under stage 3 a unit is the set of parameters of one module, gathered just
before that module runs. Checkpointing and offload address state through this layout, so
it is a plain, printable value: which parameter lives where, in which shard.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Iterable

import torch


@dataclass(frozen=True)
class Slot:
    """One parameter's place in a unit's full flat buffer."""

    name: str
    offset: int
    numel: int
    shape: tuple[int, ...]

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class Unit:
    """A flat buffer of parameters, split into equal shards across data-parallel ranks."""

    index: int
    label: str
    slots: tuple[Slot, ...]
    padded_numel: int
    num_shards: int
    resident: bool

    @property
    def numel(self) -> int:
        """Elements of parameters (the gaps between slots and the tail are padding)."""
        return sum(s.numel for s in self.slots)

    @functools.cached_property
    def padding(self) -> list[tuple[int, int]]:
        """[start, end) of each run of padding in the full flat buffer: the gaps that align the
        slots (SLOT_ALIGN), then the tail."""
        runs, at = [], 0
        for slot in sorted(self.slots, key=lambda s: s.offset):
            if slot.offset > at:
                runs.append((at, slot.offset))
            at = max(at, slot.end)
        if at < self.padded_numel:
            runs.append((at, self.padded_numel))
        return runs

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.num_shards

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of rank's shard in the unit's full flat buffer."""
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def shard_pieces(self, rank: int) -> list[tuple[Slot, int, int]]:
        """(slot, start, end) of each parameter's piece inside rank's shard, in shard-local offsets."""
        lo, hi = self.shard_range(rank)
        pieces = []
        for slot in self.slots:
            a, b = max(lo, slot.offset), min(hi, slot.end)
            if a < b:
                pieces.append((slot, a - lo, b - lo))
        return pieces


@dataclass(frozen=True)
class FlatLayout:
    """All units of a model; rank r owns shard r of each.

    ``units`` are the trained units (gradients, fp32 masters, optimizer state). ``frozen``
    holds stage 3's partitioned frozen parameters (``requires_grad=False``: a pretrained
    backbone under adapters): sharded and gathered like the others, with no gradient, master
    or optimizer state. Their indices continue after the trained units', and each carries the
    label of the module it belongs to, so it is gathered together with that module's trained
    unit."""

    units: tuple[Unit, ...]
    num_shards: int
    frozen: tuple[Unit, ...] = ()

    @property
    def all_units(self) -> tuple[Unit, ...]:
        """Trained units, then frozen ones: position i holds the unit of index i."""
        return self.units + self.frozen

    @property
    def numel(self) -> int:
        return sum(u.numel for u in self.units)

    @property
    def padded_numel(self) -> int:
        return sum(u.padded_numel for u in self.units)

    def shard_numel(self) -> int:
        return sum(u.shard_numel for u in self.units)

    @property
    def frozen_numel(self) -> int:
        return sum(u.numel for u in self.frozen)

    def locate(self, name: str) -> tuple[Unit, Slot]:
        for unit in self.all_units:
            for slot in unit.slots:
                if slot.name == name:
                    return unit, slot
        raise KeyError(f"parameter {name!r} is not in the layout")

    def describe(self) -> str:
        lines = [f"FlatLayout: {len(self.units)} units, {self.numel} elements "
                 f"({self.padded_numel} padded), {self.num_shards} shards"]
        for u in self.all_units:
            kind = ("resident" if u.resident else "partitioned") + (" frozen" if u in self.frozen else "")
            lines.append(f"  unit {u.index} [{u.label}] {kind}: {len(u.slots)} params, "
                         f"{u.numel} → {u.padded_numel} elements, shard {u.shard_numel}")
        return "\n".join(lines)


def _padded(numel: int, num_shards: int, align: int) -> int:
    quantum = num_shards * align
    return max(quantum, -(-numel // quantum) * quantum)


SLOT_ALIGN = 8
"""Each parameter starts at a multiple of this many elements of its unit (16 bytes at a 2-byte
compute dtype, 32 at fp32), as it would in an allocation of its own: a view of a parameter as
another dtype needs it (``torch.view_as_complex`` of a (..., 2) weight, an S4D or FNO layer's,
needs an even offset), and so do aligned vector and tensor-core kernels. The gaps are padding,
zero like a unit's tail."""


def _unit(index: int, label: str, entries: list[tuple[str, torch.Size]], num_shards: int,
          align: int, resident: bool) -> Unit:
    slots, offset = [], 0
    for name, shape in entries:
        numel = torch.Size(shape).numel()
        offset = -(-offset // SLOT_ALIGN) * SLOT_ALIGN
        slots.append(Slot(name, offset, numel, tuple(shape)))
        offset += numel
    return Unit(index, label, tuple(slots), _padded(offset, num_shards, align), num_shards, resident)


def bucket_layout(named_params: Iterable[tuple[str, torch.Tensor]], num_shards: int,
                  bucket_numel: int, align: int = 64) -> FlatLayout:
    """Stages 0-2: parameters in reverse registration order (the order backward produces
    gradients) cut into buckets of about bucket_numel elements; all units resident."""
    params = list(named_params)[::-1]
    units, current, size = [], [], 0
    for name, p in params:
        if current and size + p.numel() > bucket_numel:
            units.append(current)
            current, size = [], 0
        current.append((name, p.shape))
        size += p.numel()
    if current:
        units.append(current)
    return FlatLayout(tuple(_unit(i, f"bucket{i}", u, num_shards, align, True) for i, u in enumerate(units)),
                      num_shards)


def concatenate(layouts: Iterable[FlatLayout], labels: Iterable[str]) -> FlatLayout:
    """One layout holding the units of several, renumbered in order, each label prefixed
    (pipeline chunks: a bucket never spans two chunks, so each chunk's buckets can be
    reduced as soon as that chunk's backward is over)."""
    layouts, units = list(layouts), []
    shards = {l.num_shards for l in layouts}
    if len(shards) != 1:
        raise ValueError(f"concatenate: layouts have different shard counts {sorted(shards)}")
    for layout, label in zip(layouts, labels, strict=True):
        for u in layout.units:
            units.append(Unit(len(units), f"{label}.{u.label}", u.slots, u.padded_numel, u.num_shards, u.resident))
    return FlatLayout(tuple(units), shards.pop())


ROOT = "<root>"
"""The label of stage 3's unit of parameters that belong to no unit module."""


def module_layout(named_params: Iterable[tuple[str, torch.Tensor]], unit_prefixes: list[str],
                  num_shards: int, persistence_threshold: int = 0, align: int = 64,
                  shape_of: Callable[[torch.Tensor], torch.Size] | None = None,
                  frozen_params: Iterable[tuple[str, torch.Tensor]] = (),
                  aliases: dict[str, list[str]] | None = None) -> FlatLayout:
    """Stage 3: one partitioned unit per module prefix (e.g. ``blocks.3``), one for the
    remaining (root) parameters, and one resident unit for parameters of at most
    persistence_threshold elements, which stay whole on every rank (ZeRO-Infinity's
    persistent parameters).

    Unit 0 is the root unit; module units follow in the given order. frozen_params are
    grouped by the same prefixes into frozen units (FlatLayout.frozen), labelled like the
    module's trained unit; frozen parameters of at most persistence_threshold elements are
    left out (they stay whole on every rank, as plain parameters).

    aliases: every name of a parameter registered under several (a tied embedding and head,
    a weight shared by two blocks). Such a parameter belongs to the deepest unit whose module
    contains every one of its names, the root at worst: a module that uses it then always
    runs inside that unit's module, while the parameter is gathered.
    """
    shape_of = shape_of or (lambda p: p.shape)
    ordered = sorted(unit_prefixes, key=len, reverse=True)  # deepest prefix wins
    aliases = aliases or {}

    def owner(name: str) -> str:
        names = aliases.get(name, [name])
        return next((pre for pre in ordered if all(n.startswith(pre + ".") for n in names)), "")

    def by_owner(named) -> tuple[dict[str, list], list]:
        groups: dict[str, list] = {prefix: [] for prefix in [""] + unit_prefixes}
        small = []
        for name, p in named:
            if torch.Size(shape_of(p)).numel() <= persistence_threshold:
                small.append((name, p))
                continue
            groups[owner(name)].append((name, p))
        return groups, small

    groups, persistent = by_owner(named_params)
    units = []
    for prefix, named in groups.items():
        if named or prefix == "":
            entries = [(n, shape_of(p)) for n, p in named]
            units.append(_unit(len(units), prefix or ROOT, entries, num_shards, align, False))
    if persistent:
        entries = [(n, shape_of(p)) for n, p in persistent]
        units.append(_unit(len(units), "<persistent>", entries, num_shards, align, True))
    frozen_groups, _ = by_owner(frozen_params)
    frozen = []
    for prefix, named in frozen_groups.items():
        if named:
            entries = [(n, shape_of(p)) for n, p in named]
            frozen.append(_unit(len(units) + len(frozen), prefix or ROOT, entries, num_shards, align, False))
    return FlatLayout(tuple(units), num_shards, tuple(frozen))
