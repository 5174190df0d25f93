"""A rank's shard layout as a checkpoint records it (:func:`describe`, kept in COMMITTED.json):
its units, the update form's state format, the optimizer's piece order, its tensor-parallel slices and copies;
and the *pieces* found from it, the runs of each parameter's elements a rank's shard holds, in
the parameter's own coordinates (what tiertrain/state/reshard.py lines up across layouts).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch

from .checkpoint import CheckpointError
from ..update.protocol import SLOT_NAME
from ..update.state_format import TorchOptimizerState
from ..update.whole import WHOLE
from ..zero.layout import Slot, Unit

if TYPE_CHECKING:
    from ..update.protocol import OptimizerUpdate
    from ..zero.flat import FlatParameters


# -- at save: what each rank holds --------------------------------------------------------

def _unit_json(unit: Unit) -> list:
    return [unit.label, unit.padded_numel, unit.num_shards,
            [[s.name, s.offset, s.numel, list(s.shape)] for s in unit.slots]]


def _unit_of(entry: list, index: int) -> Unit:
    label, padded, shards, slots = entry
    return Unit(index, label, tuple(Slot(n, o, k, tuple(shape)) for n, o, k, shape in slots), padded, shards, False)


def piece_order(flat: "FlatParameters", optimizer: torch.optim.Optimizer) -> list[list] | None:
    """[unit position, parameter name, start, end, group] for each tensor of the optimizer, in
    the order torch's state_dict numbers them (group by group): start/end are offsets in this
    rank's master shard of that unit, or, for a parameter this rank steps whole (its owner:
    update/whole.py), start None and end its number of elements. Found from the views'
    storage, not recomputed, so a client's param groups in any order are described as they
    are. None when some tensor is neither (the checkpoint then loads only at its own layout)."""
    spans = []
    for k, u in enumerate(flat.units):
        m = u.master
        spans.append((m.data_ptr(), m.data_ptr() + m.numel() * m.element_size(), m.element_size(), k))
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for view in group["params"]:
            whole = getattr(view, WHOLE, None)
            if whole is not None:
                out.append([whole[0], getattr(view, SLOT_NAME), None, whole[1], g])
                continue
            if view.numel() == 0:  # (the placeholder of an otherwise empty optimizer)
                out.append([0, None, 0, 0, g])
                continue
            ptr = view.data_ptr()
            found = next((s for s in spans if s[0] <= ptr < s[1]), None)
            if found is None:
                return None
            start = (ptr - found[0]) // found[2]
            name = getattr(view, SLOT_NAME, None)
            out.append([found[3], name, start, start + view.numel(), g])
    return out


def describe(flat: "FlatParameters", update: "OptimizerUpdate", tp: tuple[int, int] = (0, 1),
             copies: Mapping[str, str] | None = None) -> dict:
    """This rank's shard layout, JSON-like: the trained and frozen units (slots, padded size,
    shard count), the shard this rank holds, the update form's state format (its record:
    update/state_format.py), (a torch optimizer's state) the optimizer's piece order, this rank's tensor-parallel (coordinate, size) and the dimension of each of
    its parameters that is a tensor-parallel slice, and ``copies``: {parameter: the parameter
    it is kept equal to} (a tied weight's copy on another pipeline stage). Recorded at save so
    another layout can find these values."""
    state_format = update.state_format
    optimizer = getattr(update, "optimizer", None) if isinstance(state_format, TorchOptimizerState) else None
    names = [s.name for u in flat.units + flat.frozen_units for s in u.unit.slots]
    split = {}
    for name in names:
        param = flat.params.get(name)
        if getattr(param, "tp_sharded", False):
            split[name] = int(param.tp_shard_dim)
    return {"state_format": state_format.record(), "shard_rank": flat.shard_rank,
            "units": [_unit_json(u.unit) for u in flat.units],
            "frozen": [_unit_json(u.unit) for u in flat.frozen_units],
            "pieces": None if optimizer is None else piece_order(flat, optimizer),
            "tp": list(tp), "split": split, "copies": dict(copies or {})}


# -- pieces --------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
    """A run of one parameter's elements in one rank's shard."""

    rank: int
    name: str
    lo: int
    """First element, in the flat coordinates of the parameter as that rank holds it (its
    tensor-parallel slice, if split)."""
    hi: int
    unit: int
    """Position of the unit in the rank's list (trained or frozen)."""
    start: int
    """Offset in the rank's shard of that unit."""
    index: int = -1
    """Optimizer state index (trained pieces of a torch optimizer's state), else -1."""
    group: int = -1


def _param_start(unit: Unit, shard_rank: int, slot_offset: int, start: int) -> int:
    return unit.shard_range(shard_rank)[0] + start - slot_offset


def _trained_pieces(rank: int, shards: dict) -> list[_Piece]:
    """The pieces of a torch optimizer's state (TorchOptimizerState), with their state index
    and group."""
    units = [_unit_of(e, k) for k, e in enumerate(shards["units"])]
    out = []
    for i, (k, name, start, end, group) in enumerate(shards["pieces"]):
        if name is not None and start is None:  # (a parameter this rank stepped whole)
            out.append(_Piece(rank, name, 0, end, k, -1, i, group))
            continue
        if name is None or end <= start:
            continue
        slot = next(s for s in units[k].slots if s.name == name)
        shard = shards["shard_rank"] if units[k].num_shards > 1 else 0
        lo = _param_start(units[k], shard, slot.offset, start)
        out.append(_Piece(rank, name, lo, lo + end - start, k, start, i, group))
    return out


def unit_pieces(rank: int, shards: dict, kind: str) -> list[_Piece]:
    """Every parameter piece rank holds in its "units" (trained: its fp32 masters) or "frozen"
    (compute-dtype shards) according to its shard layout (describe()), found from the units
    alone (no optimizer piece order needed: any update form)."""
    out = []
    for k, entry in enumerate(shards[kind]):
        unit = _unit_of(entry, k)
        shard = shards["shard_rank"] if unit.num_shards > 1 else 0
        for slot, a, b in unit.shard_pieces(shard):
            lo = _param_start(unit, shard, slot.offset, a)
            out.append(_Piece(rank, slot.name, lo, lo + b - a, k, a))
    return out


def parameter_slots(shards: dict, kind: str) -> list[tuple[int, Slot]]:
    """(unit position, slot) of every parameter in a shard layout's units of this kind, in order."""
    return [(k, slot) for k, entry in enumerate(shards[kind]) for slot in _unit_of(entry, k).slots]


def pieces_by_name(pieces: list[_Piece], prefer: int = 0) -> dict[str, list[_Piece]]:
    """The pieces by parameter, one per element range: where ranks hold the same range
    (stage 0: every rank the whole unit), the preferred rank's (this rank: its file is read
    anyway), else the lowest rank's."""
    chosen: dict[tuple[str, int, int], _Piece] = {}
    for p in sorted(pieces, key=lambda p: (p.rank != prefer, p.rank)):
        chosen.setdefault((p.name, p.lo, p.hi), p)
    out: dict[str, list[_Piece]] = {}
    for p in chosen.values():
        out.setdefault(p.name, []).append(p)
    return out


def _overlaps(name: str, lo: int, hi: int, saved: dict[str, list[_Piece]],
              step_dir: str) -> list[tuple[_Piece, int, int]]:
    """(saved piece, lo, hi) covering elements [lo, hi) of name exactly once; an error if any
    is missing."""
    found = sorted(((s, max(s.lo, lo), min(s.hi, hi)) for s in saved.get(name, []) if s.lo < hi and lo < s.hi),
                   key=lambda t: t[1])
    at = lo
    for _, a, b in found:
        if a != at:
            break
        at = b
    if at != hi:
        raise CheckpointError(f"{step_dir!r} does not hold elements [{at}, {hi}) of {name!r}: "
                              f"a rank's shard layout in COMMITTED.json disagrees with its file")
    return found


__all__ = ["describe", "parameter_slots", "piece_order", "pieces_by_name", "unit_pieces"]
