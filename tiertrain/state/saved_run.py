"""A saved run's values, read as another layout needs them: each rank file read at most once
(checksum first, memory-mapped), a parameter's pieces joined over data-parallel shards and its
tensor-parallel slices concatenated (its *global* value), for resharding
(tiertrain/state/reshard.py) and the offline export (tiertrain/state/consolidate.py).
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch

from .checkpoint import CheckpointError, load_rank_file, rank_file_name, verified_file
from .recorded_formats import recorded_format, recorded_type
from .shard_layout import _overlaps, _Piece, _trained_pieces, parameter_slots, pieces_by_name, unit_pieces
from ..update.state_format import NVMeStreamState, StateFormat, TorchOptimizerState

MASTER = "master"
"""The key of a parameter's fp32 master value (beside its optimizer-state keys)."""


# -- the saved run ---------------------------------------------------------------------------

class _SavedRun:
    """A checkpoint's ranks: their shard layouts, pieces and values, each rank file read at
    most once (checksum first, memory-mapped)."""

    def __init__(self, step_dir: str, marker: dict, prefer: int, verified: bool = False):
        self.step_dir, self.marker = step_dir, marker
        self.verified = verified
        """The rank files' checksums were checked already (not again at first read)."""
        self.layouts: list[dict] = marker["shards"]
        self.states: dict[int, dict] = {}
        self._formats: dict[int, StateFormat] = {}
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

    def format(self, rank: int) -> StateFormat:
        """The format of rank's saved optimizer state (its shard layout's record)."""
        if rank not in self._formats:
            self._formats[rank] = recorded_format(self.layouts[rank], lambda: self.file(rank)["update"]["optimizer"])
        return self._formats[rank]

    def torch_state(self, rank: int) -> bool:
        """Rank saved a torch optimizer's state (TorchOptimizerState), keyed by piece."""
        return issubclass(recorded_type(self.layouts[rank]), TorchOptimizerState)

    def file(self, rank: int) -> dict:
        if rank not in self.states:
            path = os.path.join(self.step_dir, rank_file_name(rank)) if self.verified else \
                verified_file(self.step_dir, rank_file_name(rank), self.marker["sha256"][rank])
            self.states[rank] = load_rank_file(path, torch.device("cpu"), mmap=True)
        return self.states[rank]

    def pieces(self, kind: str, coord: int, state: bool = False) -> dict[str, list[_Piece]]:
        """The pieces of every parameter held by the ranks at tensor-parallel coordinate coord
        (their slices), one per element range: of their shards, or with ``state`` of their
        optimizer state (a torch optimizer's tensors: pieces of the shards, or whole
        parameters on their owners)."""
        key = (kind, coord, state)
        if key not in self._pieces:
            found = []
            for r, layout in enumerate(self.layouts):
                if self.tp(layout)[0] != coord:
                    continue
                if kind == "units" and state and self.torch_state(r):
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

    def values(self, key: str, piece: _Piece, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) (the parameter's coordinates) of piece's master (key MASTER), frozen
        value ("frozen") or published value ("published")."""
        read = {MASTER: self.master, "frozen": self.frozen, "published": self.published}[key]
        return read(piece)[a - piece.lo:b - piece.lo]

    def state_values(self, piece: _Piece, a: int, b: int) -> dict | None:
        """Piece's optimizer state (state()) with each per-element tensor cut to elements [a, b)."""
        state = self.state(piece)
        if not state:
            return state
        n = piece.hi - piece.lo
        return {k: (v.reshape(-1)[a - piece.lo:b - piece.lo] if _per_element(v) and v.numel() == n else v)
                for k, v in state.items()}

    def frozen_dtype(self) -> torch.dtype:
        """The dtype the saved frozen shards were kept in (fp32 when the run had none)."""
        return next((s.dtype for r, layout in enumerate(self.layouts) if layout["frozen"]
                     for s in self.file(r)["frozen"]["shards"]), torch.float32)

    def param_group(self, rank: int, group: int) -> dict | None:
        """The hyper-parameters of rank's saved param group (None: it saved none)."""
        groups = self.file(rank)["update"]["optimizer"]["param_groups"]
        return groups[group] if group < len(groups) else None

    def holds_published(self) -> bool:
        """Saved in a format that may hold the parameters one update behind the masters (the
        delayed update's), with an update not yet published (every rank alike)."""
        if not self.torch_state(0):
            return False
        saved = self.format(0)
        return isinstance(saved, TorchOptimizerState) and saved.published and \
            self.file(0)["update"].get("published") is not None

    def state(self, piece: _Piece) -> dict | None:
        """The piece's optimizer state as torch's optimizer keeps it ({"step", "exp_avg", ...},
        per-element tensors over the piece), or None when it was never stepped."""
        saved, update = self.format(piece.rank), self.file(piece.rank)["update"]
        if isinstance(saved, TorchOptimizerState):
            return update["optimizer"]["state"].get(piece.index) or None
        if not isinstance(saved, NVMeStreamState):
            raise CheckpointError(f"{self.step_dir!r}: rank {piece.rank} saved its optimizer state in the "
                                  f"{saved.TAG!r} format, which is read only at the layout it was saved at")
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
        names = saved.state_names
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
            values = [(a, b, self.run.values(key, s, a, b)) for s, a, b in found]
            out = torch.empty(hi - lo, dtype=values[0][2].dtype)
            for a, b, value in values:
                out[a - lo:b - lo] = value
            return out
        states = [(s, a, b, self.run.state_values(s, a, b)) for s, a, b in found]
        present = [t for t in states if t[3]]
        if not present:
            return None  # (never stepped: a parameter no rank computed a gradient for yet)
        if len(present) != len(states):
            raise CheckpointError(f"{self.run.step_dir!r}: parameter {self.name!r} has optimizer state in some "
                                  f"saved shards and not in others; it cannot be resharded")
        _, first_a, first_b, first = present[0]
        out: dict[str, Any] = {}
        for key_, value in first.items():
            if _per_element(value) and value.numel() == first_b - first_a:
                buf = torch.empty(hi - lo, dtype=value.dtype)
                for s, a, b, st in present:
                    src = st.get(key_)
                    if not (_per_element(src) and src.numel() == b - a):
                        raise CheckpointError(f"{self.run.step_dir!r}: optimizer state {key_!r} of {self.name!r} "
                                              f"is per-element in one shard and not in another")
                    buf[a - lo:b - lo] = src.reshape(-1)
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


__all__ = ["MASTER", "global_value", "open_saved", "opened_files", "saved_parameters"]
