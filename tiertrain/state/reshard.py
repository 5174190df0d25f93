"""Resuming a checkpoint at another layout: data-parallel size, ZeRO stage, tensor- and
pipeline-parallel sizes, optimizer tier.

A rank file holds this rank's shard of every flat unit (fp32 masters) and the optimizer state
of those shards: a torch optimizer's state keyed by *piece* (one view per parameter per shard)
in memory, or the NVMe stream's per-shard moments (update/nvme/optimizer.py). Under another
layout the units are cut differently, so neither the shards nor the piece indices line up.
What does line up is each parameter's own coordinates: element k of ``blocks.0.w`` is element
k whatever the layout. So every rank records, at save, where each of its pieces lies in its
parameter (:func:`describe`, JSON kept in COMMITTED.json beside the checksums, so it is read
without unpickling anything), and which of its parameters are tensor-parallel slices (the
dimension, Megatron §3: a column-parallel weight is a dim-0 slice, a row-parallel one a dim-1
slice, a vocab-parallel embedding a dim-0 slice) or copies of another (the last pipeline
stage's copy of a tied embedding, Megatron's way of tying across stages).

At load, :func:`load_resharded` rebuilds each value this rank needs parameter by parameter:

1. the parameter's value in the saved run (its *global* tensor): the saved pieces of each
   tensor-parallel slice joined over data-parallel shards, and the slices concatenated along
   their dimension (a replicated parameter: one replica's pieces);
2. this rank's slice of it, when this run splits it over tensor-parallel ranks;
3. the elements this rank's shards hold, copied into its masters, its optimizer state (each
   per-element tensor the same way; scalars such as Adam's step from the saved piece) and its
   frozen shards.

Only one parameter is whole at a time, and a parameter nobody splits is read only over the
range this rank needs. The rank files needed are read memory-mapped, each checksum-verified
(``torch.load(weights_only=True)``), and the result goes through the parts' ordinary
``load_state_dict`` (masters published, gradients zeroed), so a resumed step is the step an
uninterrupted run at the new layout takes from the same state.

Supported forms, in any combination: the in-memory torch optimizer (zero.offload_optimizer
none or cpu), the delayed update (zero.delayed_update, whose checkpoint may also hold the
parameters one update behind the masters: cut like the masters) and the NVMe stream (nvme).
The same model and compute dtype are required; a difference is an error naming it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

import torch

from .checkpoint import (CheckpointError, Stateful, load_rank_file, rank_file_name, restore_rank_state,
                         verified_file)
from ..update.protocol import SLOT_NAME
from ..update.whole import WHOLE
from ..zero.layout import Slot, Unit

if TYPE_CHECKING:
    from ..update.protocol import OptimizerUpdate
    from ..zero.flat import FlatParameters

MEMORY_FORMS = ("InMemoryUpdate", "DelayedUpdate", "WholeParameterUpdate")
"""Update forms whose state is a torch optimizer's over per-parameter views (update/in_memory.py,
update/delayed.py; the delayed form may also hold "published" compute-dtype shards, the
parameters one update behind the masters) and whole parameters stepped by their owning rank
(update/whole.py)."""
NVME_FORMS = ("NVMeUpdate", "OverlappedNVMeUpdate")
"""Update forms whose state is the NVMe stream's per-shard moments (update/nvme/form.py)."""

REPLICATED_PARTS = ("scaler", "train_state", "rng")
"""Parts every rank holds a copy of; taken from this rank's saved file, or rank 0's."""

MASTER = "master"
"""The key of a parameter's fp32 master value (beside its optimizer-state keys)."""


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
    shard count), the shard this rank holds, the update form, (in-memory form) the optimizer's
    piece order, this rank's tensor-parallel (coordinate, size) and the dimension of each of
    its parameters that is a tensor-parallel slice, and ``copies``: {parameter: the parameter
    it is kept equal to} (a tied weight's copy on another pipeline stage). Recorded at save so
    another layout can find these values."""
    form = type(update).__name__
    optimizer = getattr(update, "optimizer", None) if form in MEMORY_FORMS else None
    names = [s.name for u in flat.units + flat.frozen_units for s in u.unit.slots]
    split = {}
    for name in names:
        param = flat.params.get(name)
        if getattr(param, "tp_sharded", False):
            split[name] = int(param.tp_shard_dim)
    return {"form": form, "shard_rank": flat.shard_rank,
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
    """Optimizer state index (trained pieces of the in-memory form), else -1."""
    group: int = -1


def _param_start(unit: Unit, shard_rank: int, slot_offset: int, start: int) -> int:
    return unit.shard_range(shard_rank)[0] + start - slot_offset


def _trained_pieces(rank: int, shards: dict) -> list[_Piece]:
    """The pieces of the in-memory form's optimizer, with their state index and group."""
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


# -- the saved run ---------------------------------------------------------------------------

def _state_names(rule: str) -> tuple[str, ...]:
    """The torch names of the NVMe stream's two state slots (saved under AdamW's names, see
    NVMeAdamW.state_dict), from the rule's words; "unused" slots dropped."""
    if rule.startswith("SGDRule"):
        return ("momentum_buffer",)
    return ("exp_avg", "exp_avg_sq")


class _SavedRun:
    """A checkpoint's ranks: their shard layouts, pieces and values, each rank file read at
    most once (checksum first, memory-mapped)."""

    def __init__(self, step_dir: str, marker: dict, prefer: int, verified: bool = False):
        self.step_dir, self.marker = step_dir, marker
        self.verified = verified
        """The rank files' checksums were checked already (not again at first read)."""
        self.layouts: list[dict] = marker["shards"]
        self.states: dict[int, dict] = {}
        self.prefer = prefer
        self._pieces: dict[tuple[str, int], dict[str, list[_Piece]]] = {}
        self.split: dict[str, int] = {}
        self.copies: dict[str, str] = {}
        self.shapes: dict[str, dict[str, tuple]] = {"units": {}, "frozen": {}}
        """kind -> parameter -> its global shape (tensor-parallel slices joined)."""
        self.tp_sizes: dict[str, int] = {}
        """parameter -> the tensor-parallel size of the ranks holding it."""
        for layout in self.layouts:
            self.split.update(layout.get("split", {}))
            self.copies.update(layout.get("copies", {}))
        for layout in self.layouts:
            size = self.tp(layout)[1]
            for kind in ("units", "frozen"):
                for _, slot in parameter_slots(layout, kind):
                    self.shapes[kind][slot.name] = _joined(slot.shape, self.split.get(slot.name), size)
                    self.tp_sizes[slot.name] = size

    @staticmethod
    def tp(layout: dict) -> tuple[int, int]:
        coord, size = layout.get("tp", (0, 1))
        return int(coord), int(size)

    def file(self, rank: int) -> dict:
        if rank not in self.states:
            path = os.path.join(self.step_dir, rank_file_name(rank)) if self.verified else \
                verified_file(self.step_dir, rank_file_name(rank), self.marker["sha256"][rank])
            self.states[rank] = load_rank_file(path, torch.device("cpu"), mmap=True)
        return self.states[rank]

    def pieces(self, kind: str, coord: int, state: bool = False) -> dict[str, list[_Piece]]:
        """The pieces of every parameter held by the ranks at tensor-parallel coordinate coord
        (their slices), one per element range: of their shards, or with ``state`` of their
        optimizer state (the in-memory forms' optimizer tensors: pieces of the shards, or
        whole parameters on their owners)."""
        key = (kind, coord, state)
        if key not in self._pieces:
            found = []
            for r, layout in enumerate(self.layouts):
                if self.tp(layout)[0] != coord:
                    continue
                if kind == "units" and state and layout["form"] in MEMORY_FORMS:
                    found += _trained_pieces(r, layout)
                else:
                    found += unit_pieces(r, layout, kind)
            self._pieces[key] = pieces_by_name(found, self.prefer)
        return self._pieces[key]

    # -- values of pieces --

    def master(self, piece: _Piece) -> torch.Tensor:
        return self.file(piece.rank)["update"]["masters"][piece.unit][piece.start:piece.start + piece.hi - piece.lo]

    def frozen(self, piece: _Piece) -> torch.Tensor:
        return self.file(piece.rank)["frozen"]["shards"][piece.unit][piece.start:piece.start + piece.hi - piece.lo]

    def published(self, piece: _Piece) -> torch.Tensor:
        return self.file(piece.rank)["update"]["published"][piece.unit][piece.start:piece.start + piece.hi - piece.lo]

    def holds_published(self) -> bool:
        """Saved by the delayed form with an update not yet published (every rank alike)."""
        return self.layouts[0]["form"] == "DelayedUpdate" and self.file(0)["update"].get("published") is not None

    def state(self, piece: _Piece) -> dict | None:
        """The piece's optimizer state as torch's optimizer keeps it ({"step", "exp_avg", ...},
        per-element tensors over the piece), or None when it was never stepped."""
        layout, update = self.layouts[piece.rank], self.file(piece.rank)["update"]
        if layout["form"] in MEMORY_FORMS:
            return update["optimizer"]["state"].get(piece.index) or None
        optimizer = update["optimizer"]
        starts = [p[0] for p in optimizer["pieces"][piece.unit]]
        # (an NVMe piece is one parameter's view of the shard: its start is this piece's)
        k = max((i for i, s in enumerate(starts) if s <= piece.start), default=None)
        if k is None:
            raise CheckpointError(f"{self.step_dir!r}: rank {piece.rank}'s NVMe optimizer has no piece at "
                                  f"element {piece.start} of unit {piece.unit} ({piece.name!r})")
        steps = int(optimizer["step"]) - int(optimizer["skipped"][piece.unit][k])
        if steps <= 0:
            return None
        shard = optimizer["shards"][piece.unit]
        n = piece.hi - piece.lo
        names = _state_names(optimizer["rule"])
        out: dict[str, Any] = {key: shard[slot][piece.start:piece.start + n]
                               for key, slot in zip(names, ("exp_avg", "exp_avg_sq"))}
        if "exp_avg_sq" in names:
            out["step"] = torch.tensor(float(steps))
        return out


def _joined(shape: tuple, dim: int | None, size: int) -> tuple:
    if dim is None or size == 1:
        return tuple(shape)
    return tuple(n * size if d == dim else n for d, n in enumerate(shape))


@dataclass
class _Value:
    """One parameter's values in the saved run, read as this rank needs them."""

    run: _SavedRun
    kind: str
    """"units" (trained) or "frozen"."""
    name: str
    """The saved parameter (this run's name, or the one it is a copy of)."""
    shape: tuple
    """The saved (global) shape."""

    def local(self, key: str, dim: int | None, coord: int, size: int, lo: int, hi: int) -> torch.Tensor | dict | None:
        """Elements [lo, hi) of this run's tensor-parallel slice coord of size (along dim, or
        the whole parameter when dim is None), flattened: of the master (key MASTER), the
        frozen value ("frozen"), the delayed form's published value ("published"), or of every
        optimizer-state tensor (key "state": a dict, or None when the parameter was never
        stepped)."""
        saved_dim = self.run.split.get(self.name)
        saved_size = self.run.tp_sizes.get(self.name, 1)
        if (saved_dim is None or saved_size == 1) and (dim is None or size == 1):
            return self._read(0, lo, hi, key)  # (no slice on either side: only the range needed)
        whole = self._whole(key, saved_dim, saved_size)
        if whole is None or not isinstance(whole, dict):
            return None if whole is None else _slice(whole, self.shape, dim, coord, size)[lo:hi]
        return {k: (_slice(v, self.shape, dim, coord, size)[lo:hi] if _per_element(v) else v)
                for k, v in whole.items()}

    def _whole(self, key: str, dim: int | None, size: int):
        """The parameter's global value (flat), or the dict of its state's global values."""
        if dim is None or size == 1:
            return self._read(0, 0, math.prod(self.shape), key)
        local_shape = tuple(n // size if d == dim else n for d, n in enumerate(self.shape))
        numel = math.prod(local_shape)
        slices = [self._read(t, 0, numel, key) for t in range(size)]
        if key != "state":
            return torch.cat([s.reshape(local_shape) for s in slices], dim).reshape(-1)
        if all(s is None for s in slices):
            return None
        if any(s is None for s in slices):
            raise CheckpointError(f"{self.run.step_dir!r}: parameter {self.name!r} has optimizer state in some "
                                  f"saved shards and not in others; it cannot be resharded")
        return {k: (torch.cat([s[k].reshape(local_shape) for s in slices], dim).reshape(-1)
                    if _per_element(v) else v) for k, v in slices[0].items()}

    def _read(self, coord: int, lo: int, hi: int, key: str):
        """Elements [lo, hi) of the slice held at tensor-parallel coordinate coord."""
        found = _overlaps(self.name, lo, hi, self.run.pieces(self.kind, coord, state=key == "state"),
                          self.run.step_dir)
        if key != "state":
            read = {MASTER: self.run.master, "frozen": self.run.frozen, "published": self.run.published}[key]
            values = [(a, b, read(s)[a - s.lo:b - s.lo]) for s, a, b in found]
            out = torch.empty(hi - lo, dtype=values[0][2].dtype)
            for a, b, value in values:
                out[a - lo:b - lo] = value
            return out
        states = [(s, a, b, self.run.state(s)) for s, a, b in found]
        present = [t for t in states if t[3]]
        if not present:
            return None  # (never stepped: a parameter no rank computed a gradient for yet)
        if len(present) != len(states):
            raise CheckpointError(f"{self.run.step_dir!r}: parameter {self.name!r} has optimizer state in some "
                                  f"saved shards and not in others; it cannot be resharded")
        first_piece, _, _, first = present[0]
        out: dict[str, Any] = {}
        for key_, value in first.items():
            if _per_element(value) and value.numel() == first_piece.hi - first_piece.lo:
                buf = torch.empty(hi - lo, dtype=value.dtype)
                for s, a, b, st in present:
                    src = st.get(key_)
                    if not (_per_element(src) and src.numel() == s.hi - s.lo):
                        raise CheckpointError(f"{self.run.step_dir!r}: optimizer state {key_!r} of {self.name!r} "
                                              f"is per-element in one shard and not in another")
                    buf[a - lo:b - lo] = src.reshape(-1)[a - s.lo:b - s.lo]
                out[key_] = buf
            else:
                out[key_] = value.clone() if isinstance(value, torch.Tensor) else value
        return out


def _per_element(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() > 0


def _slice(flat: torch.Tensor, shape: tuple, dim: int | None, coord: int, size: int) -> torch.Tensor:
    """Tensor-parallel slice coord of size along dim of the global value (flat), flattened."""
    if dim is None or size == 1:
        return flat
    width = shape[dim] // size
    return flat.reshape(shape).narrow(dim, coord * width, width).reshape(-1)


# -- at load: checks --------------------------------------------------------------------

def check_reshardable(step_dir: str, marker: dict, fingerprint: dict, shards: dict | None,
                      prefer: int = 0) -> _SavedRun:
    """The same model (every parameter's global shape, trained or frozen) and compute dtype,
    in update forms whose state this module reads and writes; otherwise an error naming what
    differs. Returns the saved run, read preferring rank prefer's file where ranks hold the
    same values."""
    saved_layouts, saved_shards = marker["layouts"], marker.get("shards")
    first = saved_layouts[0]
    where = (f"{step_dir!r} (saved at " + _layout_words(saved_layouts) + "; this run "
             + _layout_words([fingerprint]) + ")")
    if first["dtype"] != fingerprint["dtype"]:
        raise CheckpointError(f"{where}: saved with dtype={first['dtype']!r}, this run has "
                              f"dtype={fingerprint['dtype']!r}")
    if saved_shards is None:
        raise CheckpointError(f"{where}: the checkpoint records no shard layout (saved before resharding "
                              f"existed); it loads only at the layout it was saved at")
    for description in saved_shards + [shards or {"form": None, "pieces": None}]:
        form = description["form"]
        if not (form in NVME_FORMS or (form in MEMORY_FORMS and description["pieces"] is not None)):
            raise CheckpointError(f"{where}: resharding the state of the {form} update form is not supported; "
                                  f"the forms that reshard are {list(MEMORY_FORMS + NVME_FORMS)}, with optimizer "
                                  f"state held as views of the fp32 masters")
    if any("tp" not in s for s in saved_shards) and any(f["tp"] > 1 or f["pp"] > 1 for f in saved_layouts):
        raise CheckpointError(f"{where}: the checkpoint records no tensor-parallel slices (saved by an older "
                              f"version); it loads only at the layout it was saved at")
    run = _SavedRun(step_dir, marker, prefer)
    tp_size = _SavedRun.tp(shards)[1]
    for kind, what in (("units", "trained"), ("frozen", "frozen")):
        own = {slot.name: _joined(slot.shape, shards["split"].get(slot.name), tp_size)
               for _, slot in parameter_slots(shards, kind)}
        _compare_params(what, run.shapes[kind], own, run.copies, shards["copies"], step_dir,
                        whole_model=fingerprint["pp"] == 1)
    return run


def _layout_words(layouts: list[dict]) -> str:
    f = layouts[0]
    tiers = sorted({x["optimizer_tier"] for x in layouts})
    return f"dp={f['dp']}, tp={f['tp']}, pp={f['pp']}, stage={f['stage']}, optimizer {'/'.join(tiers)}"


def _compare_params(kind: str, saved: dict[str, tuple], mine: dict[str, tuple], saved_copies: dict[str, str],
                    my_copies: dict[str, str], step_dir: str, whole_model: bool) -> None:
    """Every parameter of this rank is in the checkpoint (itself, or the parameter this run's
    copy of it is kept equal to) with the same global shape; and when this rank holds the
    whole model (no pipeline), every saved one is in it (a saved copy of another parameter
    need not be)."""
    for name in sorted(set(saved) | set(mine)):
        if name not in mine:
            if name in saved_copies or not whole_model:
                continue  # (the saved run's tied copy: this run holds the one it copied)
            raise CheckpointError(f"{step_dir!r} holds the {kind} parameter {name!r} {saved[name]}, "
                                  f"which this model does not have (as a {kind} parameter)")
        source = name if name in saved else my_copies.get(name)
        if source not in saved:
            raise CheckpointError(f"{step_dir!r} holds no {kind} parameter {name!r}; this model has it "
                                  f"with shape {mine[name]}")
        if saved[source] != mine[name]:
            copy = "" if source == name else f" (whose copy {name!r} this model has)"
            raise CheckpointError(f"{step_dir!r} holds {source!r}{copy} with shape {saved[source]}, this model has "
                                  f"shape {mine[name]}")


# -- the saved run's parameters, whole (the offline export, tiertrain/state/consolidate.py) ----------

def open_saved(step_dir: str, marker: dict, verified: bool = False) -> _SavedRun:
    """A committed checkpoint's values, read as needed (verified: every rank file's checksum
    was checked already)."""
    if marker.get("shards") is None:
        raise CheckpointError(f"{step_dir!r} records no shard layout (saved before resharding existed)")
    return _SavedRun(step_dir, marker, 0, verified)


def saved_parameters(run: _SavedRun) -> list[tuple[str, str, tuple]]:
    """(kind, name, global shape) of every parameter of the saved model, in the model's order
    (ranks in order: pipeline stages first to last; their units in order), trained ("units")
    then frozen, each once, without a pipeline stage's copy of a tied weight."""
    out, seen = [], set()
    for kind in ("units", "frozen"):
        for layout in run.layouts:
            for _, slot in parameter_slots(layout, kind):
                if slot.name not in seen and slot.name not in run.copies:
                    seen.add(slot.name)
                    out.append((kind, slot.name, run.shapes[kind][slot.name]))
    return out


def global_value(run: _SavedRun, kind: str, name: str) -> torch.Tensor:
    """The saved value of one parameter, whole and flat: its fp32 master (kind "units") or its
    compute-dtype value (kind "frozen"), tensor-parallel slices joined."""
    shape = run.shapes[kind][name]
    return _Value(run, kind, name, shape).local(MASTER if kind == "units" else "frozen", None, 0, 1, 0,
                                                math.prod(shape))


def opened_files(run: _SavedRun) -> list[str]:
    """The paths of the rank files read so far."""
    return [os.path.join(run.step_dir, rank_file_name(r)) for r in run.states]


# -- at load: the copy ------------------------------------------------------------------

def _value(run: _SavedRun, kind: str, name: str, my_copies: dict[str, str]) -> _Value:
    source = name if name in run.shapes[kind] else my_copies[name]
    return _Value(run, kind, source, run.shapes[kind][source])


def _fill(mine: list[_Piece], units: list[Unit], run: _SavedRun, kind: str, key: str, shards: dict,
          dtype: torch.dtype) -> list[torch.Tensor]:
    """This rank's flat shard of each unit (zero padded) from the saved values (key MASTER or
    "frozen")."""
    out = [torch.zeros(unit.shard_numel, dtype=dtype) for unit in units]
    coord, size = _SavedRun.tp(shards)
    split, copies = shards["split"], shards["copies"]
    for piece in mine:
        values = _value(run, kind, piece.name, copies).local(key, split.get(piece.name), coord, size,
                                                             piece.lo, piece.hi)
        out[piece.unit][piece.start:piece.start + piece.hi - piece.lo] = values
    return out


def _states(mine: list[_Piece], run: _SavedRun, shards: dict) -> dict[_Piece, dict]:
    """The optimizer state of each of this rank's trained pieces that was ever stepped."""
    coord, size = _SavedRun.tp(shards)
    split, copies = shards["split"], shards["copies"]
    out = {}
    for piece in mine:
        state = _value(run, "units", piece.name, copies).local("state", split.get(piece.name), coord, size,
                                                               piece.lo, piece.hi)
        if state is not None:
            out[piece] = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in state.items()}
    return out


def _memory_update(update: "OptimizerUpdate", run: _SavedRun, rank: int, shards: dict, units: list[Unit],
                   masters: list[torch.Tensor], source: int) -> dict:
    """The in-memory form's state: masters, the torch optimizer's state by piece index, and
    each group's hyper-parameters from the saved group its first piece came from (this run's
    own when the checkpoint's form keeps none: the NVMe stream)."""
    optimizer = update.optimizer
    mine = _trained_pieces(rank, shards)
    states = _states(mine, run, shards)
    by_index = {p.index: s for p, s in states.items()}
    current = optimizer.state_dict()
    groups = []
    for g, group in enumerate(current["param_groups"]):
        saved_group = None
        first = next((p for p in mine if p.group == g), None)
        if first is not None:
            value = _value(run, "units", first.name, shards.get("copies", {}))
            origin = next((s for s in run.pieces("units", 0, state=True).get(value.name, []) if s.index >= 0), None)
            if origin is not None:
                saved_group = run.file(origin.rank)["update"]["optimizer"]["param_groups"][origin.group]
        elif run.layouts[source]["form"] in MEMORY_FORMS:
            saved_groups = run.file(source)["update"]["optimizer"]["param_groups"]
            saved_group = saved_groups[g] if g < len(saved_groups) else None
        options = saved_group if saved_group is not None else group
        groups.append({**{k: v for k, v in options.items() if k != "params"}, "params": group["params"]})
    state = {"masters": masters, "optimizer": {"state": by_index, "param_groups": groups},
             "schedule": run.file(source)["update"].get("schedule")}
    if shards["form"] == "DelayedUpdate":
        # The parameters the next forward reads, one update behind the masters; a form without
        # such an update in flight publishes the masters themselves.
        state["published"] = None
        if run.holds_published():
            dtype = run.file(0)["update"]["published"][0].dtype
            state["published"] = _fill(unit_pieces(rank, shards, "units"), units, run, "units", "published",
                                       shards, dtype)
    return state


def _nvme_update(update: "OptimizerUpdate", run: _SavedRun, rank: int, shards: dict, units: list[Unit],
                 masters: list[torch.Tensor], source: int) -> dict:
    """The NVMe form's state: masters, each shard's two state slots, the stream's step count
    and, per piece of the stream, the steps it was left out of (the saved piece's own count
    of updates, torch's per-parameter step)."""
    nvme = update.nvme
    names = nvme.rule.state_names
    run_steps = int(run.file(source)["train_state"]["steps"])
    mine = unit_pieces(rank, shards, "units")
    states = _states(mine, run, shards)
    slots = [{"exp_avg": torch.zeros(u.shard_numel), "exp_avg_sq": torch.zeros(u.shard_numel)} for u in units]
    steps: dict[tuple[int, int], int] = {}
    for piece in mine:
        state = states.get(piece)
        if state is None:
            steps[(piece.unit, piece.start)] = 0
            continue
        n = piece.hi - piece.lo
        for name, slot in zip(names, ("exp_avg", "exp_avg_sq")):
            if name in state:
                slots[piece.unit][slot][piece.start:piece.start + n] = state[name]
        # (torch's SGD keeps no step: a stepped piece then counts every step of the run)
        step = state.get("step")
        steps[(piece.unit, piece.start)] = int(step) if step is not None else run_steps
    count = max(steps.values(), default=0)
    skipped = []
    for s, pieces in enumerate(nvme.pieces):
        skipped.append([count - steps.get((s, a), count) for a, _, _ in pieces])
    return {"masters": masters,
            "optimizer": {"step": count, "rule": repr(nvme.rule), "skipped": skipped,
                          "pieces": [list(p) for p in nvme.pieces], "shards": slots},
            "schedule": run.file(source)["update"].get("schedule")}


def _buffers(run: _SavedRun, world: int, source: int) -> dict:
    """Every saved rank's persistent buffers by name (a pipeline stage saved its own; the
    data-parallel copies are equal), the replicated source's first."""
    out: dict = {}
    for r in [source] + [r for r in range(world) if r != source]:
        for name, value in (run.file(r).get("buffers") or {}).items():
            out.setdefault(name, value)
    return out


def load_resharded(parts: Mapping[str, Stateful], step_dir: str, marker: dict, rank: int, fingerprint: dict,
                   shards: dict, update: "OptimizerUpdate") -> dict:
    """Rebuild this rank's state from a checkpoint saved at another layout (marker: its commit
    marker; checked here by check_reshardable against this rank's fingerprint) and load it
    into the parts; returns the saved extras.

    shards: describe() of this rank; update: its optimizer-step form (the in-memory form keeps
    its optimizer's param_groups, piece indices, and takes each group's hyper-parameters from
    the saved group its pieces came from)."""
    run = check_reshardable(step_dir, marker, fingerprint, shards, prefer=rank)
    source = rank if rank < marker["world_size"] else 0  # of the replicated parts
    units = [_unit_of(e, k) for k, e in enumerate(shards["units"])]
    masters = _fill(unit_pieces(rank, shards, "units"), units, run, "units", MASTER, shards, torch.float32)
    if shards["form"] in MEMORY_FORMS:
        state = {"update": _memory_update(update, run, rank, shards, units, masters, source)}
    else:
        state = {"update": _nvme_update(update, run, rank, shards, units, masters, source)}
    for name in REPLICATED_PARTS:
        if name in parts:
            state[name] = run.file(source)[name]
    if "frozen" in parts:
        frozen_units = [_unit_of(e, k) for k, e in enumerate(shards["frozen"])]
        dtype = next((s.dtype for r, layout in enumerate(run.layouts) if layout["frozen"]
                      for s in run.file(r)["frozen"]["shards"]), torch.float32)
        state["frozen"] = {"shards": _fill(unit_pieces(rank, shards, "frozen"), frozen_units, run, "frozen",
                                           "frozen", shards, dtype)}
    if "buffers" in parts:
        state["buffers"] = _buffers(run, marker["world_size"], source)
    unknown = [n for n in parts if n not in state]
    if unknown:
        raise CheckpointError(f"resharding does not know how to rebuild the checkpoint parts {unknown}; it "
                              f"rebuilds 'update', 'frozen', 'buffers' and the replicated {list(REPLICATED_PARTS)}")
    restore_rank_state(parts, state)
    return run.file(source)["extra"]


__all__ = ["describe", "load_resharded", "check_reshardable", "unit_pieces", "parameter_slots",
           "pieces_by_name", "piece_order", "open_saved", "saved_parameters", "global_value", "opened_files"]
