"""Resuming a checkpoint at another data-parallel size or ZeRO stage.

A rank file holds this rank's shard of every flat unit (fp32 masters) and a torch optimizer
whose state is keyed by *piece*: one view per parameter per shard. Under another dp size or
stage the units are cut differently, so neither the shards nor the piece indices line up.
What does line up is each parameter's own flat coordinates: element k of ``blocks.0.w`` is
element k whatever the layout. So every rank records, at save, where each of its pieces lies
in its parameter (:func:`describe`, JSON kept in COMMITTED.json beside the checksums, so it is
read without unpickling anything); at load, :func:`load_resharded` builds this rank's new
pieces from the saved pieces that overlap them, reading only the rank files it needs (each
checksum-verified, memory-mapped so only the needed pages are touched), and hands the result
to the parts' ordinary ``load_state_dict`` (masters published, gradients zeroed).

Supported: the in-memory torch optimizer (zero.offload_optimizer none or cpu, no
zero.delayed_update), tp = pp = 1, the same model and compute dtype. The NVMe optimizer keeps
its state in swap files of its own layout; resharding it is not supported yet.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import torch

from .checkpoint import (CheckpointError, Stateful, load_rank_file, rank_file_name, restore_rank_state,
                         verified_file)
from .update.protocol import SLOT_NAME
from .zero.layout import Slot, Unit

if TYPE_CHECKING:
    from .update.protocol import OptimizerUpdate
    from .zero.flat import FlatParameters

RESHARDABLE_FORM = "InMemoryUpdate"
"""The update form whose optimizer state this module knows how to cut (update/in_memory.py)."""

REPLICATED_PARTS = ("scaler", "train_state", "rng")
"""Parts every rank holds a copy of; taken from this rank's saved file, or rank 0's."""


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
    rank's master shard of that unit. Found from the views' storage, not recomputed, so a
    client's param groups in any order are described as they are. None when some tensor is
    not such a view (the checkpoint then loads only at its own layout)."""
    spans = []
    for k, u in enumerate(flat.units):
        m = u.master
        spans.append((m.data_ptr(), m.data_ptr() + m.numel() * m.element_size(), m.element_size(), k))
    out = []
    for g, group in enumerate(optimizer.param_groups):
        for view in group["params"]:
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


def describe(flat: "FlatParameters", update: "OptimizerUpdate") -> dict:
    """This rank's shard layout, JSON-like: the trained and frozen units (slots, padded size,
    shard count), the shard this rank holds, the update form, and (in-memory form only) the
    optimizer's piece order. Recorded at save so another layout can find these values."""
    form = type(update).__name__
    optimizer = getattr(update, "optimizer", None) if form == RESHARDABLE_FORM else None
    return {"form": form, "shard_rank": flat.shard_rank,
            "units": [_unit_json(u.unit) for u in flat.units],
            "frozen": [_unit_json(u.unit) for u in flat.frozen_units],
            "pieces": None if optimizer is None else piece_order(flat, optimizer)}


# -- at load: checks --------------------------------------------------------------------

def _shapes(entries: list) -> dict[str, tuple]:
    return {n: tuple(shape) for _, _, _, slots in entries for n, _, _, shape in slots}


def _compare_params(kind: str, saved: dict[str, tuple], mine: dict[str, tuple], step_dir: str) -> None:
    for name in sorted(set(saved) | set(mine)):
        if name not in mine:
            raise CheckpointError(f"{step_dir!r} holds the {kind} parameter {name!r} {saved[name]}, "
                                  f"which this model does not have (as a {kind} parameter)")
        if name not in saved:
            raise CheckpointError(f"{step_dir!r} holds no {kind} parameter {name!r}; this model has it "
                                  f"with shape {mine[name]}")
        if saved[name] != mine[name]:
            raise CheckpointError(f"{step_dir!r} holds {name!r} with shape {saved[name]}, this model has "
                                  f"shape {mine[name]}")


def check_reshardable(step_dir: str, marker: dict, fingerprint: dict, shards: dict | None) -> None:
    """Everything but the dp size and stage must agree; otherwise an error naming what differs."""
    saved_layouts, saved_shards = marker["layouts"], marker.get("shards")
    first = saved_layouts[0]
    where = f"{step_dir!r} (saved at dp={first['dp']}, stage={first['stage']}; this run dp={fingerprint['dp']}, " \
            f"stage={fingerprint['stage']})"
    for key in ("tp", "pp"):
        sizes = {f[key] for f in saved_layouts} | {fingerprint[key]}
        if sizes != {1}:
            raise CheckpointError(f"{where}: resharding is supported only at {key}=1; the checkpoint has "
                                  f"{key}={first[key]}, this run {key}={fingerprint[key]}")
    tiers = {f["optimizer_tier"] for f in saved_layouts}
    if "nvme" in tiers or fingerprint["optimizer_tier"] == "nvme":
        raise CheckpointError(f"{where}: resharding of the NVMe optimizer state is not supported yet "
                              f"(checkpoint optimizer_tier={sorted(tiers)}, this run "
                              f"{fingerprint['optimizer_tier']!r}); load it at the layout it was saved at")
    if first["dtype"] != fingerprint["dtype"]:
        raise CheckpointError(f"{where}: saved with dtype={first['dtype']!r}, this run has "
                              f"dtype={fingerprint['dtype']!r}")
    if saved_shards is None:
        raise CheckpointError(f"{where}: the checkpoint records no shard layout (saved before resharding "
                              f"existed); it loads only at the layout it was saved at")
    for description in saved_shards + [shards or {"form": None, "pieces": None}]:
        form = description["form"]
        if form != RESHARDABLE_FORM or description["pieces"] is None:
            raise CheckpointError(f"{where}: resharding the state of the {form} update form is not supported "
                                  f"yet; only the in-memory torch optimizer ({RESHARDABLE_FORM}: "
                                  f"zero.offload_optimizer none or cpu, without zero.delayed_update)")
    _compare_params("trained", _shapes(saved_shards[0]["units"]), _shapes(shards["units"]), step_dir)
    _compare_params("frozen", _shapes(saved_shards[0]["frozen"]), _shapes(shards["frozen"]), step_dir)


# -- at load: the copy ------------------------------------------------------------------

@dataclass(frozen=True)
class _Piece:
    """A run of one parameter's elements in one rank's shard."""

    rank: int
    name: str
    lo: int
    """First element, in the parameter's flat coordinates."""
    hi: int
    unit: int
    """Position of the unit in the rank's list (trained or frozen)."""
    start: int
    """Offset in the rank's shard of that unit."""
    index: int = -1
    """Optimizer state index (trained pieces), else -1."""
    group: int = -1


def _param_start(unit: Unit, shard_rank: int, slot_offset: int, start: int) -> int:
    return unit.shard_range(shard_rank)[0] + start - slot_offset


def _trained_pieces(rank: int, shards: dict) -> list[_Piece]:
    units = [_unit_of(e, k) for k, e in enumerate(shards["units"])]
    out = []
    for i, (k, name, start, end, group) in enumerate(shards["pieces"]):
        if name is None or end <= start:
            continue
        slot = next(s for s in units[k].slots if s.name == name)
        lo = _param_start(units[k], shards["shard_rank"], slot.offset, start)
        out.append(_Piece(rank, name, lo, lo + end - start, k, start, i, group))
    return out


def _frozen_pieces(rank: int, shards: dict) -> list[_Piece]:
    out = []
    for k, entry in enumerate(shards["frozen"]):
        unit = _unit_of(entry, k)
        for slot, a, b in unit.shard_pieces(shards["shard_rank"]):
            lo = _param_start(unit, shards["shard_rank"], slot.offset, a)
            out.append(_Piece(rank, slot.name, lo, lo + b - a, k, a))
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


def covering_pieces(name: str, numel: int, saved: dict[str, list[_Piece]],
                    step_dir: str) -> list[tuple[_Piece, int, int]]:
    """(saved piece, lo, hi) covering elements [0, numel) of parameter name exactly once (saved:
    pieces_by_name's output); a CheckpointError if any element is missing."""
    return _overlaps(_Piece(-1, name, 0, numel, 0, 0), saved, step_dir)


def pieces_by_name(pieces: list[_Piece], prefer: int = 0) -> dict[str, list[_Piece]]:
    """The pieces by parameter, one per element range (see _by_name)."""
    return _by_name(pieces, prefer)


def _by_name(pieces: list[_Piece], prefer: int) -> dict[str, list[_Piece]]:
    """Saved pieces by parameter, one per element range: where ranks hold the same range
    (stage 0: every rank the whole unit), the preferred rank's (this rank: its file is read
    anyway), else the lowest rank's."""
    chosen: dict[tuple[str, int, int], _Piece] = {}
    for p in sorted(pieces, key=lambda p: (p.rank != prefer, p.rank)):
        chosen.setdefault((p.name, p.lo, p.hi), p)
    out: dict[str, list[_Piece]] = {}
    for p in chosen.values():
        out.setdefault(p.name, []).append(p)
    return out


def _overlaps(piece: _Piece, saved: dict[str, list[_Piece]], step_dir: str) -> list[tuple[_Piece, int, int]]:
    """(saved piece, lo, hi) covering piece's elements exactly once; an error if any is missing."""
    found = sorted(((s, max(s.lo, piece.lo), min(s.hi, piece.hi)) for s in saved.get(piece.name, [])
                    if s.lo < piece.hi and piece.lo < s.hi), key=lambda t: t[1])
    at = piece.lo
    for _, lo, hi in found:
        if lo != at:
            break
        at = hi
    if at != piece.hi:
        raise CheckpointError(f"{step_dir!r} does not hold elements [{at}, {piece.hi}) of {piece.name!r}: "
                              f"a rank's shard layout in COMMITTED.json disagrees with its file")
    return found


class _Files:
    """The saved rank files, each read at most once, checksum first, memory-mapped."""

    def __init__(self, step_dir: str, marker: dict):
        self.step_dir, self.marker = step_dir, marker
        self.states: dict[int, dict] = {}

    def __call__(self, rank: int) -> dict:
        if rank not in self.states:
            path = verified_file(self.step_dir, rank_file_name(rank), self.marker["sha256"][rank])
            self.states[rank] = load_rank_file(path, torch.device("cpu"), mmap=True)
        return self.states[rank]


def _is_elementwise(value: Any, numel: int) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0 and value.numel() == numel


def _optimizer_state(mine: list[_Piece], saved: dict[str, list[_Piece]], files: _Files,
                     step_dir: str) -> dict[int, dict]:
    """This rank's optimizer state by index: per-element tensors cut from the overlapping saved
    pieces' state, scalars (Adam's step) taken from the first of them."""
    state: dict[int, dict] = {}
    for piece in mine:
        numel = piece.hi - piece.lo
        parts = [(s, lo, hi, files(s.rank)["update"]["optimizer"]["state"].get(s.index))
                 for s, lo, hi in _overlaps(piece, saved, step_dir)]
        present = [p for p in parts if p[3]]
        if not present:
            continue  # (never stepped: a parameter no rank computed a gradient for yet)
        if len(present) != len(parts):
            raise CheckpointError(f"{step_dir!r}: parameter {piece.name!r} has optimizer state in some saved "
                                  f"shards and not in others; it cannot be resharded")
        first = present[0][3]
        out: dict[str, Any] = {}
        for key, value in first.items():
            if _is_elementwise(value, present[0][0].hi - present[0][0].lo):
                buf = torch.empty(numel, dtype=value.dtype)
                for s, lo, hi, st in present:
                    src = st[key]
                    if not _is_elementwise(src, s.hi - s.lo):
                        raise CheckpointError(f"{step_dir!r}: optimizer state {key!r} of {piece.name!r} is "
                                              f"per-element in one shard and not in another")
                    buf[lo - piece.lo:hi - piece.lo] = src.reshape(-1)[lo - s.lo:hi - s.lo]
                out[key] = buf
            else:
                out[key] = value.clone() if isinstance(value, torch.Tensor) else value
        state[piece.index] = out
    return state


def _shards(mine: list[_Piece], units: list[Unit], saved: dict[str, list[_Piece]], files: _Files,
            read: Callable[[dict], list[torch.Tensor]], dtype: torch.dtype, step_dir: str) -> list[torch.Tensor]:
    """This rank's flat shard of each unit, zero padded, filled from the saved shards."""
    out = [torch.zeros(unit.shard_numel, dtype=dtype) for unit in units]
    for piece in mine:
        for s, lo, hi in _overlaps(piece, saved, step_dir):
            src = read(files(s.rank))[s.unit]
            out[piece.unit][piece.start + lo - piece.lo:piece.start + hi - piece.lo] = \
                src[s.start + lo - s.lo:s.start + hi - s.lo]
    return out


def load_resharded(parts: Mapping[str, Stateful], step_dir: str, marker: dict, rank: int, fingerprint: dict,
                   shards: dict, update: "OptimizerUpdate") -> dict:
    """Rebuild this rank's state from a checkpoint saved at another dp size or stage (marker:
    its commit marker; checked here by check_reshardable against this rank's fingerprint) and
    load it into the parts; returns the saved extras.

    shards: describe() of this rank; update: its optimizer-step form, whose optimizer's
    param_groups (piece indices) are kept and whose hyper-parameters are replaced by the saved
    group each new group's pieces came from."""
    check_reshardable(step_dir, marker, fingerprint, shards)
    optimizer = getattr(update, "optimizer", None)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise CheckpointError(f"{step_dir!r} was saved at another layout; resharding needs the in-memory "
                              f"optimizer ({type(update).__name__} has none)")
    optimizer_state = optimizer.state_dict()
    saved_shards = marker["shards"]
    files = _Files(step_dir, marker)
    source = rank if rank < marker["world_size"] else 0  # of the replicated parts
    mine_trained = _trained_pieces(rank, shards)
    saved_trained = _by_name([p for r, s in enumerate(saved_shards) for p in _trained_pieces(r, s)], rank)
    units = [_unit_of(e, k) for k, e in enumerate(shards["units"])]
    master_dtype = files(source)["update"]["masters"][0].dtype
    masters = _shards(mine_trained, units, saved_trained, files, lambda st: st["update"]["masters"],
                      master_dtype, step_dir)
    state_by_index = _optimizer_state(mine_trained, saved_trained, files, step_dir)
    groups = []
    for g, group in enumerate(optimizer_state["param_groups"]):
        origin = next((_overlaps(p, saved_trained, step_dir)[0][0] for p in mine_trained if p.group == g), None)
        if origin is not None:
            saved_group = files(origin.rank)["update"]["optimizer"]["param_groups"][origin.group]
        else:
            saved_groups = files(source)["update"]["optimizer"]["param_groups"]
            saved_group = saved_groups[g] if g < len(saved_groups) else group
        groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": group["params"]})
    state = {"update": {"masters": masters, "optimizer": {"state": state_by_index, "param_groups": groups},
                        "schedule": files(source)["update"].get("schedule")}}
    for name in REPLICATED_PARTS:
        if name in parts:
            state[name] = files(source)[name]
    if "frozen" in parts:
        frozen_units = [_unit_of(e, k) for k, e in enumerate(shards["frozen"])]
        saved_frozen = _by_name([p for r, s in enumerate(saved_shards) for p in _frozen_pieces(r, s)], rank)
        mine_frozen = _frozen_pieces(rank, shards)
        frozen_dtype = files(source)["frozen"]["shards"][0].dtype
        state["frozen"] = {"shards": _shards(mine_frozen, frozen_units, saved_frozen, files,
                                             lambda st: st["frozen"]["shards"], frozen_dtype, step_dir)}
    unknown = [n for n in parts if n not in state]
    if unknown:
        raise CheckpointError(f"resharding does not know how to rebuild the checkpoint parts {unknown}; it "
                              f"rebuilds 'update', 'frozen' and the replicated {list(REPLICATED_PARTS)}")
    restore_rank_state(parts, state)
    return files(source)["extra"]

