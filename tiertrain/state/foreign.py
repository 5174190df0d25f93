"""What every load of another framework's checkpoint into an engine checks and does, whatever
the files (DeepSpeed's: tiertrain/state/deepspeed_checkpoint.py; torch.distributed.checkpoint's:
tiertrain/state/dcp_checkpoint.py): the engine's optimizer keeps the saved state (checked by
tiertrain/state/optimizer_state.py), every buffer has a value, frozen parameters come from the
checkpoint or are kept (said), and those the engine's module holds whole are copied in. A checkpoint here is anything with ``directory``, ``shapes``
(trained name -> shape), ``frozen_shapes``, ``frozen_value(name)`` and ``buffers``.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint import CheckpointError
from .reshard import REPLICATED_PARTS
from .saved_run import MASTER, _SavedRun, _slice

if TYPE_CHECKING:
    from ..training_core import TrainingCore


class ForeignRun(_SavedRun):
    """Another framework's checkpoint seen as a tiertrain run (what tiertrain/state/reshard.py
    rebuilds any layout from): a subclass reads ranges of values (``values``: MASTER or
    "frozen") and of the optimizer's state (``state_values``), and says its frozen values'
    dtype. The optimizer's hyper-parameters are the loading run's own (param_group: None); the
    replicated parts are the ones given; nothing is held one update behind."""

    def __init__(self, directory: str, layouts: list[dict], replicated: dict):
        super().__init__(directory, {"shards": layouts}, prefer=0, verified=True)
        self._replicated = replicated

    def file(self, rank: int) -> dict:
        """What every rank's file would replicate (no tensors of the run: those come by piece)."""
        return self._replicated

    def master(self, piece) -> torch.Tensor:
        return self.values(MASTER, piece, piece.lo, piece.hi)

    def frozen(self, piece) -> torch.Tensor:
        return self.values("frozen", piece, piece.lo, piece.hi)

    def holds_published(self) -> bool:
        return False

    def param_group(self, rank: int, group: int) -> dict | None:
        return None

    def state(self, piece) -> dict | None:
        return self.state_values(piece, piece.lo, piece.hi)


def replicated_at(engine: "TrainingCore", parts: dict, applied: int, skipped: int,
                  loss_scale: dict | None) -> dict:
    """What every rank restores of a foreign run beside its shards: this engine's own parts (the
    RNG), the counters at the saved run's updates applied and fp16 steps skipped on overflow,
    the schedule as built (a client lr_scheduler is moved to the saved step once the run is
    loaded: GroupSchedule.fast_forward), and an fp16 engine's loss scale from the saved run's
    (loss_scale: as tiertrain's scaler keeps it; None: this engine's own)."""
    replicated = {name: parts[name].state_dict() for name in REPLICATED_PARTS if name in parts}
    replicated["train_state"] = {"micro_steps": (applied + skipped) * engine.config.batch.grad_accum_steps,
                                 "steps": applied, "skipped_steps": skipped}
    replicated["update"] = {"schedule": engine.update.schedule.state_dict()}
    if loss_scale is not None and "scaler" in parts and getattr(parts["scaler"], "enabled", False):
        replicated["scaler"] = {**replicated["scaler"], **loss_scale, "overflows": skipped}
    return replicated


class FrozenKeptWarning(UserWarning):
    """A checkpoint without frozen parameters left the model's own frozen values."""


def frozen_kept(engine: "TrainingCore", checkpoint: Any, saved_how: str) -> int:
    """How many frozen parameters of this engine keep their values because the checkpoint holds
    none (saved_how: the save option that leaves them out, as a LoRA run saves: the frozen
    weights are the pretrained ones, loaded before), said in a warning; 0 otherwise."""
    if checkpoint.frozen_shapes:
        return 0
    first_name = {}  # (one name per parameter: a tied alias is the same one)
    for name, param in frozen_of(engine).items():
        if name not in checkpoint.shapes:
            first_name.setdefault(id(param), name)
    frozen = sorted(first_name.values())
    if frozen:
        warnings.warn(f"the checkpoint {checkpoint.directory!r} holds no frozen parameter (saved with {saved_how}): "
                      f"this model's {len(frozen)} frozen parameters keep the values they have (e.g. {frozen[0]!r});"
                      f" load the pretrained weights they come from before (from_pretrained, or "
                      f"tiertrain.load_pretrained before this checkpoint)", FrozenKeptWarning, stacklevel=4)
    return len(frozen)


def check_buffers(own: dict[str, torch.Tensor], checkpoint: Any) -> None:
    """Every persistent buffer of this model has a value of its shape in the checkpoint: checked
    before anything is loaded, so a refused checkpoint leaves the engine as it was."""
    missing = sorted(n for n in own if n not in checkpoint.buffers)
    if missing:
        raise CheckpointError(f"{checkpoint.directory!r} holds no value for the buffers {missing[:10]} of this model "
                              f"(its buffers: {sorted(checkpoint.buffers)[:10]}); nothing was loaded")
    for name, value in own.items():
        if tuple(checkpoint.buffers[name].shape) != tuple(value.shape):
            raise CheckpointError(f"{checkpoint.directory!r} holds buffer {name!r} with shape "
                                  f"{tuple(checkpoint.buffers[name].shape)}, this model has {tuple(value.shape)}; "
                                  f"nothing was loaded")


def frozen_of(engine: "TrainingCore") -> dict[str, torch.nn.Parameter]:
    """The engine's frozen parameters under every name its modules give them (tied aliases too)."""
    return {n: p for module in engine.named_modules_of_state()
            for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


def held_frozen(engine: "TrainingCore", checkpoint: Any, sharded: set[str]) -> dict:
    """{name: (the engine's parameter, its value)} for the checkpoint's frozen parameters that
    the engine's module holds whole (stages 0-2; a tensor-parallel slice: its slice)."""
    own = frozen_of(engine)
    out = {}
    for name in checkpoint.frozen_shapes:
        if name in sharded:
            continue
        value = checkpoint.frozen_value(name)
        param = own.get(name)
        if param is None:
            if engine.topology.size("pp") > 1:
                continue  # (another pipeline stage's)
            raise CheckpointError(f"{checkpoint.directory!r} holds the frozen parameter {name!r} "
                                  f"{tuple(value.shape)}, which this model does not have (as a frozen parameter)")
        if getattr(param, "tp_sharded", False):
            size, coord = engine.topology.size("tp"), engine.topology.coord("tp")
            value = _slice(value.reshape(-1), tuple(value.shape), int(param.tp_shard_dim), coord, size)
        if value.numel() != param.numel():
            raise CheckpointError(f"{checkpoint.directory!r} holds frozen {name!r} with shape "
                                  f"{tuple(value.shape)}, this model has shape {tuple(param.shape)}")
        out[name] = (param, value.reshape(param.shape))
    loaded = {id(p) for p, _ in out.values()}
    missing = sorted(n for n, p in own.items() if id(p) not in loaded and n not in sharded
                     and n not in checkpoint.shapes)
    if missing:
        raise CheckpointError(f"{checkpoint.directory!r} holds no value for the frozen parameters {missing[:10]} of "
                              f"this model (it has {sorted(checkpoint.frozen_shapes)[:10]})")
    return out


def copy_held(held: dict) -> None:
    """Copy held_frozen's values into the module's parameters."""
    with torch.no_grad():
        for param, value in held.values():
            param.copy_(value)


__all__ = ["ForeignRun", "FrozenKeptWarning", "check_buffers", "copy_held", "frozen_kept", "frozen_of",
           "held_frozen"]
