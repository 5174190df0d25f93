"""A DeepSpeed universal checkpoint (the output of DeepSpeed's ``ds_to_universal``: one folder per
parameter) loaded into an engine of any layout: the fp32 masters, Adam's moments and step, the
frozen values, the buffers, the step count, an fp16 run's loss scale and the client state
(docs/migrate-deepspeed.md). Being whole parameters by name, it loads as a run of one rank
holding every parameter whole, as a DCP checkpoint does (tiertrain/state/dcp_checkpoint.py).

What ``ds_to_universal --output_folder <dir>/<tag>`` writes, as read here:

- ``<dir>/latest_universal``: the tag;
- ``<tag>/zero/<name>/fp32.pt``: ``{"param": value}``, the parameter's fp32 value whole (tensor-
  parallel slices joined, vocabulary padding cut); beside it, for a parameter the optimizer
  stepped, ``exp_avg.pt`` and ``exp_avg_sq.pt`` (the same form) and, from ZeRO stages 1-2,
  ``step.pt`` (a number). A frozen parameter, or one that never had a gradient, has its model
  value in fp32.pt alone (at stage 3, a frozen parameter stays in the model-states files'
  fragments, below);
- ``<tag>/zero/optimizer_state.pt``: the optimizer's shared state (param groups, loss scaler;
  from stage 3, rank 0's optimizer state, whose step DeepSpeed gives every parameter);
- the original run's model-states files, copied: the counters, the buffers, the client state;
  from stage 3, one per rank, with that rank's fragment of each frozen parameter.
"""
from __future__ import annotations

import glob
import math
import os
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint import CheckpointError
from .dcp_checkpoint import load_items
from .dcp_files import NestedState
from .deepspeed_files import client_state_of, load_file, loss_scale_of, rank_files

if TYPE_CHECKING:
    from ..training_core import TrainingCore

LATEST = "latest_universal"
"""The file naming the tag of a universal checkpoint (as ``latest`` names a ZeRO checkpoint's)."""

_STATES = ("exp_avg", "exp_avg_sq", "step")
"""The optimizer state ds_to_universal writes beside a parameter's fp32 value (Adam's)."""


def is_universal(path: str) -> bool:
    """Whether path is a universal checkpoint's tag directory (a ``zero`` folder of parameter
    folders, and no ZeRO optimizer files)."""
    return os.path.isdir(os.path.join(path, "zero")) and not glob.glob(os.path.join(path, "*_optim_states.pt"))


def universal_path(directory: str, tag: str | None) -> str | None:
    """The universal checkpoint that ``load_deepspeed_checkpoint(directory, tag)`` names, or None
    for a ZeRO checkpoint: the tag's directory when it is one; without a tag, directory itself
    when it is one, else ``directory/latest_universal``'s tag where there is no ``latest``."""
    if tag is not None:
        path = os.path.join(directory, tag)
        return path if is_universal(path) else None
    if is_universal(directory):
        return directory
    latest = os.path.join(directory, LATEST)
    if os.path.isfile(os.path.join(directory, "latest")) or not os.path.isfile(latest):
        return None
    with open(latest) as f:
        path = os.path.join(directory, f.read().strip())
    if not is_universal(path):
        raise CheckpointError(f"{latest!r} names {path!r}, which is no universal checkpoint (no 'zero' folder of "
                              f"parameters, as DeepSpeed's ds_to_universal writes)")
    return path


def _value(path: str, name: str, shape: tuple | None) -> Any:
    """A parameter's tensor in one of its files (``{"param": tensor, ...}``), in its shape as the
    model states record it (stage 3's are written flat), or a step's number."""
    saved = load_file(path)
    value = saved.get("param") if isinstance(saved, dict) else saved
    if not isinstance(value, (torch.Tensor, int, float)):
        keys = sorted(saved) if isinstance(saved, dict) else ""
        raise CheckpointError(f"{path!r} holds {type(saved).__name__} {keys}, not parameter {name!r}'s value "
                              f"({{'param': tensor}}, as ds_to_universal writes it)")
    if isinstance(value, torch.Tensor) and shape is not None and value.numel() == math.prod(shape):
        return value.reshape(shape)
    return value


def _shared_step(shared: dict, path: str) -> int | None:
    """The step in the optimizer state ds_to_universal keeps from stage 3 (every param group's
    alike; DeepSpeed's own loader takes the first group's for every parameter), or None."""
    groups = (shared.get("optimizer_state_dict") or {}).get("state") or {}
    steps = {int(state["step"]) for state in groups.values() if isinstance(state, dict) and "step" in state}
    if len(steps) > 1:
        raise CheckpointError(f"{path!r}: its param groups took different numbers of steps {sorted(steps)}, and "
                              f"ds_to_universal kept none per parameter: which step is each parameter's is not known")
    return steps.pop() if steps else None


def _stage3_frozen(path: str, first: dict) -> dict[str, torch.Tensor]:
    """Stage 3's frozen values, which ds_to_universal leaves in the model-states files it copies:
    each rank's fragment of every frozen parameter (``frozen_param_fragments``), joined in rank
    order (``first``: rank 0's file, read)."""
    shapes = first.get("frozen_param_shapes") or {}
    ranked = rank_files(path, "model_states")
    if not shapes or not ranked:
        return {}
    parts = [first.get("frozen_param_fragments") or {}] + [load_file(f).get("frozen_param_fragments") or {}
                                                            for f in ranked[1:]]
    out = {}
    for name, shape in shapes.items():
        numel = math.prod(shape)
        joined = torch.cat([part[name].reshape(-1) for part in parts if name in part] or [torch.empty(0)])
        if joined.numel() < numel:
            raise CheckpointError(f"{path!r}: the model-states files' fragments of frozen {name!r} {tuple(shape)} "
                                  f"hold {joined.numel()} of its {numel} elements ({len(ranked)} rank files)")
        out[name] = joined[:numel].reshape(tuple(shape))
    return out


class UniversalCheckpoint:
    """A universal checkpoint's tag directory, read (values memory-mapped): ``state``, the nested
    dict load_items reads ({"model": values and buffers by name, "optimizer": {"state": {name:
    Adam's state}}}), the counters, the loss scale and the client state."""

    def __init__(self, path: str):
        self.directory = path
        model_states = next((p for p in (os.path.join(path, "mp_rank_00_model_states.pt"),
                                         os.path.join(path, "zero_pp_rank_0_mp_rank_00_model_states.pt"))
                             if os.path.exists(p)), None)
        if model_states is None:
            raise CheckpointError(f"{path!r} holds no model-states file (mp_rank_00_model_states.pt, or "
                                  f"zero_pp_rank_0_mp_rank_00_model_states.pt at stage 3), which ds_to_universal "
                                  f"copies beside the 'zero' folder: the step count and buffers are in it")
        meta = load_file(model_states)
        self.global_steps = int(meta.get("global_steps", 0))
        self.skipped_steps = int(meta.get("skipped_steps", 0))
        self.client_state = client_state_of(meta)
        shared_path = os.path.join(path, "zero", "optimizer_state.pt")
        shared = load_file(shared_path) if os.path.exists(shared_path) else {}
        self.loss_scale = loss_scale_of(shared, self.skipped_steps)
        shared_step = _shared_step(shared, shared_path)
        shapes = {n: tuple(shape) for group in meta.get("param_shapes") or [] for n, shape in group.items()}
        values, state = {}, {}
        for entry in sorted(os.scandir(os.path.join(path, "zero")), key=lambda e: e.name):
            if not entry.is_dir():
                continue
            files = {f[:-3]: os.path.join(entry.path, f) for f in os.listdir(entry.path) if f.endswith(".pt")}
            if "fp32" not in files:
                raise CheckpointError(f"{entry.path!r} holds no fp32.pt (it has {sorted(os.listdir(entry.path))}): "
                                      f"parameter {entry.name!r} has no value in this universal checkpoint")
            shape = shapes.get(entry.name)
            values[entry.name] = _value(files["fp32"], entry.name, shape)
            kept = {k: _value(files[k], entry.name, shape) for k in _STATES if k in files}
            if kept and "step" not in kept:
                if shared_step is None:
                    raise CheckpointError(f"{entry.path!r} holds no step.pt, nor does {shared_path!r} hold the "
                                          f"optimizer's step: how many updates parameter {entry.name!r} took is "
                                          f"not in this universal checkpoint")
                kept["step"] = shared_step
            if kept:
                state[entry.name] = kept
        for name, value in _stage3_frozen(path, meta).items():
            values.setdefault(name, value)
        module = meta.get("module") or {}
        buffers = {n: module[n] for n in meta.get("buffer_names") or [] if n in module}
        clash = sorted(set(buffers) & set(values))
        if clash:
            raise CheckpointError(f"{path!r}: {clash[:5]} are both buffers and parameter folders")
        self.state = {"model": {**values, **buffers}, "optimizer": {"state": state}}


def load_universal(engine: "TrainingCore", path: str) -> dict:
    """Load the universal checkpoint at path (its tag directory) into the engine's parts; returns
    its client state. The counters continue from DeepSpeed's global step (so does the schedule),
    an fp16 engine's loss scale from DeepSpeed's dynamic one; the optimizer's hyper-parameters
    and the RNG stay this engine's."""
    checkpoint = UniversalCheckpoint(path)
    return load_items(engine, path, [NestedState(path, checkpoint.state)],
                      f"the DeepSpeed universal checkpoint {path!r}", counted=checkpoint.global_steps,
                      loss_scale=checkpoint.loss_scale, extra=checkpoint.client_state)


__all__ = ["LATEST", "UniversalCheckpoint", "is_universal", "load_universal", "universal_path"]
