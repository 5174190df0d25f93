"""Which data-parallel rank updates each parameter whole, and the exchange that brings it there.

ZeRO partitions the flat buffers into equal shards, so a parameter may lie across several
ranks' shards. An optimizer that needs the whole tensor (Muon orthogonalises each matrix,
Adafactor factors its second moment) instead gets one *owner* per parameter: parameters are
dealt out largest first, each to the rank that already holds most of it among those it keeps
near an even share, so every rank steps about 1/N of the elements and as few as possible
move (bench/results/muon.md). Each rank
sends the pieces of its shards to their owners (one all_to_all: masters and gradients), the
owners step their parameters whole, and send the new values back the same way (a second
all_to_all into the master shards). This module is the plan: pure arithmetic on the layout,
the same on every rank.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

from ..zero.layout import Unit


@dataclass(frozen=True)
class Owned:
    """A parameter this rank updates whole."""

    name: str
    unit: int
    """Position of its unit in the trained units."""
    shape: tuple[int, ...]
    offset: int
    """Where it starts in this rank's buffer of owned parameters."""
    numel: int


@dataclass(frozen=True)
class Run:
    """Consecutive elements of one parameter that one rank's shard holds and another owns."""

    unit: int
    """Position of the unit in the trained units."""
    start: int
    """Offset in the holder's shard of that unit."""
    numel: int
    owned_offset: int
    """Offset in the owner's buffer of owned parameters."""


def owners(units: Iterable[Unit], names: set[str], world: int) -> dict[str, int]:
    """Parameter name → owning rank, for the named parameters. Largest first, each goes to the
    rank whose shards already hold most of it (fewest elements to move), among the ranks it
    keeps within ``(n−1)/n`` of the largest parameter above an even share; ties to the least
    loaded, then the lowest rank. The least-loaded rank always qualifies, so every rank ends
    within one largest parameter of an even share. Deterministic: every rank computes the same."""
    slots = [(u, s) for u in units for s in u.slots if s.name in names]
    if not slots:
        return {}
    largest = max(s.numel for _, s in slots)
    cap = sum(s.numel for _, s in slots) / world + largest * (world - 1) / world
    loads = [0] * world
    out = {}
    for unit, slot in sorted(slots, key=lambda us: -us[1].numel):  # (stable: layout order among equals)
        held = [_held(unit, slot, r) for r in range(world)]
        eligible = [r for r in range(world) if loads[r] + slot.numel <= cap] or [min(range(world), key=loads.__getitem__)]
        rank = min(eligible, key=lambda r: (-held[r], loads[r], r))
        out[slot.name] = rank
        loads[rank] += slot.numel
    return out


def _held(unit: Unit, slot, rank: int) -> int:
    """Elements of the slot in rank's shard of the unit (all of them with one shard)."""
    if unit.num_shards == 1:
        return slot.numel
    lo, hi = unit.shard_range(rank)
    return max(0, min(hi, slot.end) - max(lo, slot.offset))


@dataclass(frozen=True)
class Exchange:
    """This rank's side of the two all_to_alls of a whole-parameter step."""

    owned: tuple[Owned, ...]
    """The parameters this rank updates, in layout order."""
    owned_numel: int
    sends: tuple[tuple[Run, ...], ...]
    """Per rank: the runs of this rank's shards it owns, in the order they travel."""
    receives: tuple[tuple[Run, ...], ...]
    """Per rank: the runs of that rank's shards this rank owns (owned_offset into this rank's
    buffer), in the same order."""
    owner_of: dict[str, int]

    @property
    def send_splits(self) -> list[int]:
        return [sum(r.numel for r in runs) for runs in self.sends]

    @property
    def receive_splits(self) -> list[int]:
        return [sum(r.numel for r in runs) for runs in self.receives]


def exchange(units: tuple[Unit, ...], names: set[str], world: int, rank: int) -> Exchange:
    """The plan of rank ``rank`` among ``world`` shards (world 1: it owns everything)."""
    owner_of = owners(units, names, world)
    owned, at = [], {}
    offset = 0
    for k, unit in enumerate(units):
        for slot in unit.slots:
            if owner_of.get(slot.name) == rank:
                owned.append(Owned(slot.name, k, tuple(slot.shape), offset, slot.numel))
                at[slot.name] = offset
                offset += slot.numel
    sends: list[list[Run]] = [[] for _ in range(world)]
    receives: list[list[Run]] = [[] for _ in range(world)]
    for k, unit in enumerate(units):
        for holder in range(world):
            if holder != rank and not any(owner_of.get(s.name) == rank for s in unit.slots):
                continue  # (nothing of this unit for this rank to send or receive from holder)
            base = unit.shard_range(holder)[0]
            for slot, a, b in unit.shard_pieces(holder):
                owner = owner_of.get(slot.name)
                if owner is None:
                    continue
                into = base + a - slot.offset  # (the piece's first element in the parameter)
                if holder == rank:
                    sends[owner].append(Run(k, a, b - a, -1))
                if owner == rank:
                    receives[holder].append(Run(k, a, b - a, at[slot.name] + into))
    return Exchange(tuple(owned), offset, tuple(map(tuple, sends)), tuple(map(tuple, receives)), owner_of)


__all__ = ["Owned", "Run", "Exchange", "owners", "exchange"]
