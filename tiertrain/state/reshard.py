"""Resuming a checkpoint at another layout: data-parallel size, ZeRO stage, tensor- and
pipeline-parallel sizes, optimizer tier (and so the optimizer state's format).

A rank file holds this rank's shard of every flat unit (fp32 masters) and the optimizer state
of those shards: a torch optimizer's state keyed by *piece* (one view per parameter per shard)
in memory, or the NVMe stream's per-shard moments (update/nvme/optimizer.py). Under another
layout the units are cut differently, so neither the shards nor the piece indices line up.
What does line up is each parameter's own coordinates: element k of ``blocks.0.w`` is element
k whatever the layout. So every rank records, at save, where each of its pieces lies in its
parameter (:func:`describe`, JSON kept in COMMITTED.json beside the checksums, so it is read
without unpickling anything), and which of its parameters are tensor-parallel slices (the
dimension, Megatron §2.3: a column-parallel weight is a dim-0 slice, a row-parallel one a dim-1
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

Supported state formats (tiertrain/update/state_format.py, as each update form declares it), in
any combination: a torch optimizer's state (TorchOptimizerState: the in-memory forms,
zero.offload_optimizer none or cpu, and the delayed update, zero.delayed_update, whose
checkpoint may also hold the parameters one update behind the masters: cut like the masters)
and the NVMe stream's (NVMeStreamState: nvme).
The same model and compute dtype are required; a difference is an error naming it.

The shard layouts and their pieces are tiertrain/state/shard_layout.py's, the saved run's values
tiertrain/state/saved_run.py's.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

import torch

from .checkpoint import CheckpointError, Stateful, restore_rank_state
from .saved_run import MASTER, _joined, _SavedRun, _Value
from .recorded_formats import fingerprint_tag, recorded_type
from .shard_layout import _Piece, _trained_pieces, _unit_of, parameter_slots, unit_pieces
from ..update.state_format import NVMeStreamState, TorchOptimizerState
from ..zero.layout import Unit

if TYPE_CHECKING:
    from ..update.protocol import OptimizerUpdate

REPLICATED_PARTS = ("scaler", "train_state", "rng")
"""Parts every rank holds a copy of; taken from this rank's saved file, or rank 0's."""


# -- at load: checks --------------------------------------------------------------------

def check_reshardable(step_dir: str, marker: dict, fingerprint: dict, shards: dict,
                      prefer: int = 0) -> _SavedRun:
    """The same model (every parameter's global shape, trained or frozen) and compute dtype,
    in state formats this module reads and writes (tiertrain/update/state_format.py: a torch
    optimizer's state whose pieces are recorded, the NVMe stream's); otherwise an error naming
    what differs. Returns the saved run, read preferring rank prefer's file where ranks hold the
    same values."""
    saved_layouts, saved_shards = marker["layouts"], marker.get("shards")
    first = saved_layouts[0]
    where = (f"{step_dir!r} (saved at " + _layout_words(saved_layouts, saved_shards) + "; this run "
             + _layout_words([fingerprint], None) + ")")
    if first["dtype"] != fingerprint["dtype"]:
        raise CheckpointError(f"{where}: saved with dtype={first['dtype']!r}, this run has "
                              f"dtype={fingerprint['dtype']!r}")
    if saved_shards is None:
        raise CheckpointError(f"{where}: the checkpoint records no shard layout (saved before resharding "
                              f"existed); it loads only at the layout it was saved at")
    for description in saved_shards + [shards]:
        check_reshardable_format(description, where)
    if any("tp" not in s for s in saved_shards) and any(f["tp"] > 1 or f["pp"] > 1 for f in saved_layouts):
        raise CheckpointError(f"{where}: the checkpoint records no tensor-parallel slices (saved by an older "
                              f"version); it loads only at the layout it was saved at")
    run = _SavedRun(step_dir, marker, prefer)
    compare_models(run, shards, step_dir, whole_model=fingerprint["pp"] == 1)
    return run


def compare_models(run: _SavedRun, shards: dict, step_dir: str, whole_model: bool,
                   kinds: tuple[str, ...] = ("units", "frozen")) -> None:
    """The saved run's parameters of each kind ("units": trained, "frozen") against this rank's
    shard layout (compare_params), tensor-parallel slices joined to their global shapes."""
    tp_size = _SavedRun.tp(shards)[1]
    for kind in kinds:
        own = {slot.name: _joined(slot.shape, shards["split"].get(slot.name), tp_size)
               for _, slot in parameter_slots(shards, kind)}
        what = "trained" if kind == "units" else kind
        compare_params(what, run.shapes[kind], own, run.copies, shards["copies"], step_dir, whole_model)


def check_reshardable_format(description: dict, where: str) -> None:
    """A shard layout whose optimizer state this module reads and writes, else an error."""
    kind = recorded_type(description)
    if not (issubclass(kind, NVMeStreamState)
            or (issubclass(kind, TorchOptimizerState) and description["pieces"] is not None)):
        raise CheckpointError(f"{where}: resharding optimizer state in the {kind.TAG!r} format is not "
                              f"supported; the formats that reshard are {[TorchOptimizerState.TAG]} with "
                              f"optimizer state held as views of the fp32 masters, and {[NVMeStreamState.TAG]}")


def _layout_words(layouts: list[dict], shards: list[dict] | None) -> str:
    f = layouts[0]
    formats = sorted({fingerprint_tag(x, None if shards is None else shards[r]) for r, x in enumerate(layouts)})
    return f"dp={f['dp']}, tp={f['tp']}, pp={f['pp']}, stage={f['stage']}, optimizer state {'/'.join(formats)}"


def compare_params(kind: str, saved: dict[str, tuple], mine: dict[str, tuple], saved_copies: dict[str, str],
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
                saved_group = run.param_group(origin.rank, origin.group)
        elif run.torch_state(source):
            saved_group = run.param_group(source, g)
        options = saved_group if saved_group is not None else group
        groups.append({**{k: v for k, v in options.items() if k != "params"}, "params": group["params"]})
    state = {"masters": masters, "optimizer": {"state": by_index, "param_groups": groups},
             "schedule": run.file(source)["update"].get("schedule")}
    if update.state_format.published:
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
    names = update.state_format.state_names
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
            "optimizer": {"step": count, "state_names": list(names), "skipped": skipped,
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
    return load_run(parts, run, rank, shards, update, marker["world_size"], source)


def load_run(parts: Mapping[str, Stateful], run: _SavedRun, rank: int, shards: dict, update: "OptimizerUpdate",
             world: int, source: int) -> dict:
    """Load this rank's state rebuilt from a saved run (checked already) of world ranks, the
    replicated parts from rank source's file; returns the saved extras."""
    units = [_unit_of(e, k) for k, e in enumerate(shards["units"])]
    masters = _fill(unit_pieces(rank, shards, "units"), units, run, "units", MASTER, shards, torch.float32)
    if isinstance(update.state_format, TorchOptimizerState):
        state = {"update": _memory_update(update, run, rank, shards, units, masters, source)}
    else:  # (check_reshardable let through no other format)
        state = {"update": _nvme_update(update, run, rank, shards, units, masters, source)}
    for name in REPLICATED_PARTS:
        if name in parts:
            state[name] = run.file(source)[name]
    if "frozen" in parts:
        frozen_units = [_unit_of(e, k) for k, e in enumerate(shards["frozen"])]
        state["frozen"] = {"shards": _fill(unit_pieces(rank, shards, "frozen"), frozen_units, run, "frozen",
                                           "frozen", shards, run.frozen_dtype())}
    if "buffers" in parts:
        state["buffers"] = _buffers(run, world, source)
    unknown = [n for n in parts if n not in state]
    if unknown:
        raise CheckpointError(f"resharding does not know how to rebuild the checkpoint parts {unknown}; it "
                              f"rebuilds 'update', 'frozen', 'buffers' and the replicated {list(REPLICATED_PARTS)}")
    restore_rank_state(parts, state)
    return run.file(source)["extra"]


__all__ = ["check_reshardable", "check_reshardable_format", "compare_models", "load_resharded", "load_run"]
