"""A DeepSpeed ZeRO checkpoint (read by tiertrain/state/deepspeed_files.py) loaded into an engine
of any layout: each trained parameter's fp32 master and Adam moments and step, the frozen values,
the buffers, the step count, an fp16 engine's loss scale and the client state, so a run moved
from DeepSpeed continues where it stopped instead of restarting its optimizer
(docs/migrate-deepspeed.md). The DeepSpeed run goes through the resharding path
(tiertrain/state/reshard.py) as the tiertrain run of its own ranks and partitions.
"""
from __future__ import annotations

import math
import os
import warnings
from typing import TYPE_CHECKING, Any

import torch

from .checkpoint import CheckpointError
from .deepspeed_files import DEEPSPEED_OBJECTS, DeepSpeedCheckpoint
from .reshard import REPLICATED_PARTS, check_reshardable_format, compare_models, load_run
from .saved_run import MASTER, _SavedRun, _slice
from .shard_layout import _unit_of, parameter_slots
from ..optimizer_list import OptimizerList
from ..update.state_format import TorchOptimizerState

if TYPE_CHECKING:
    from ..training_core import TrainingCore


class DeepSpeedRun(_SavedRun):
    """A DeepSpeed checkpoint seen as the tiertrain checkpoint of the same ranks and partitions
    (what tiertrain/state/reshard.py rebuilds any layout from, reading of each rank's buffers
    only the pieces it needs): one unit per bucket, cut in as many shards as DeepSpeed had
    ranks. The optimizer's hyper-parameters are the loading run's own (param_group: None); the
    replicated parts (counters, RNG, loss scaler) are the ones given; of the frozen parameters,
    those named (the ones the loading engine keeps in shards: stage 3's), one unit each."""

    def __init__(self, checkpoint: DeepSpeedCheckpoint, replicated: dict, frozen: list[str]):
        self.checkpoint = checkpoint
        world = checkpoint.world
        slots = [[[s.name, s.offset, s.numel, list(s.shape)] for s in b.slots] for b in checkpoint.buckets]
        units = [[f"deepspeed {k}", b.shard * world, world, slots[k]] for k, b in enumerate(checkpoint.buckets)]
        shards = world if checkpoint.frozen_sharded else 1
        frozen_units = []
        for name in frozen:
            shape = checkpoint.frozen_shapes[name]
            part = -(-math.prod(shape) // shards)
            frozen_units.append([name, part * shards, shards, [[name, 0, math.prod(shape), list(shape)]]])
        layouts = []
        for r in range(world):
            pieces = [[k, slot.name, a, b, bucket.group] for k, bucket in enumerate(checkpoint.buckets)
                      for slot, a, b in _unit_of(units[k], k).shard_pieces(r)]
            layouts.append({"state_format": TorchOptimizerState().record(), "shard_rank": r, "units": units,
                            "frozen": frozen_units, "pieces": pieces, "tp": [0, 1], "split": {}, "copies": {}})
        super().__init__(checkpoint.directory, {"shards": layouts}, prefer=0, verified=True)
        self._replicated = {**replicated, "buffers": checkpoint.buffers, "extra": checkpoint.client_state}

    def file(self, rank: int) -> dict:
        """What every rank's file would replicate (no tensors of the run: those come by piece)."""
        return self._replicated

    def _at(self, piece, a: int) -> tuple[int, int]:
        """(rank, offset in its buffers joined) of element a of a piece of a trained unit."""
        return piece.rank, self.checkpoint.buckets[piece.unit].start + piece.start + a - piece.lo

    def values(self, key: str, piece, a: int, b: int) -> torch.Tensor:
        if key == "frozen":
            return self.checkpoint.frozen_piece(piece.rank, piece.name, piece.start + a - piece.lo, b - a)
        rank, offset = self._at(piece, a)
        return self.checkpoint.read(rank, key, offset, b - a)

    def master(self, piece) -> torch.Tensor:
        return self.values(MASTER, piece, piece.lo, piece.hi)

    def frozen(self, piece) -> torch.Tensor:
        return self.values("frozen", piece, piece.lo, piece.hi)

    def frozen_dtype(self) -> torch.dtype:
        return self.checkpoint.frozen_dtype

    def holds_published(self) -> bool:
        return False

    def param_group(self, rank: int, group: int) -> dict | None:
        return None

    def state(self, piece) -> dict | None:
        return self.state_values(piece, piece.lo, piece.hi)

    def state_values(self, piece, a: int, b: int) -> dict | None:
        rank, offset = self._at(piece, a)
        c = self.checkpoint
        return {"step": torch.tensor(float(c.step_at(rank, offset))),
                **{key: c.read(rank, key, offset, b - a) for key in ("exp_avg", "exp_avg_sq")}}


# -- into an engine --------------------------------------------------------------------------

def _check_adam(update: Any, where: str) -> None:
    """The engine's optimizer keeps Adam's two moments and step, as DeepSpeed's Adam did: torch's
    Adam or AdamW (without amsgrad) in memory, or the NVMe stream under AdamW's names."""
    fmt = update.state_format
    if isinstance(fmt, TorchOptimizerState):
        optimizer = update.optimizer
        parts = optimizer.parts if isinstance(optimizer, OptimizerList) else [optimizer]
        other = [type(p).__name__ for p in parts if not isinstance(p, (torch.optim.Adam, torch.optim.AdamW))]
        amsgrad = any(g.get("amsgrad") for p in parts for g in p.param_groups)
        if other or amsgrad:
            raise CheckpointError(f"{where}: it holds the moments of DeepSpeed's Adam/AdamW; this engine's optimizer "
                                  f"is {other[0] if other else 'AdamW with amsgrad=True'}: use tiertrain's AdamW "
                                  f"(the default optimizer) or torch's Adam/AdamW without amsgrad")
    elif tuple(fmt.state_names) != ("exp_avg", "exp_avg_sq"):
        raise CheckpointError(f"{where}: it holds the moments of DeepSpeed's Adam/AdamW; this engine's NVMe optimizer "
                              f"keeps {list(fmt.state_names)}")


def load_into(engine: "TrainingCore", directory: str | os.PathLike, tag: str | None = None) -> dict:
    """Load the DeepSpeed checkpoint into the engine's parts (every rank reads the files it
    needs, memory-mapped); returns its client state. The counters continue from DeepSpeed's
    global step (so does the config's learning-rate schedule), an fp16 engine's loss scale from
    DeepSpeed's dynamic one; the optimizer's hyper-parameters and the RNG stay this engine's."""
    try:
        checkpoint = DeepSpeedCheckpoint(directory, tag)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{os.fspath(directory)!r} (tag {tag!r}) is not a DeepSpeed ZeRO checkpoint this "
                              f"version reads ({type(e).__name__}: {e})") from e
    where = f"the DeepSpeed checkpoint {checkpoint.directory!r}"
    shards = engine.shard_description()
    check_reshardable_format(shards, where)
    _check_adam(engine.update, where)
    parts = engine.checkpoint_parts()
    replicated = {name: parts[name].state_dict() for name in REPLICATED_PARTS if name in parts}
    # (DeepSpeed's global_steps counts the fp16 steps skipped on overflow too)
    applied = checkpoint.global_steps - checkpoint.skipped_steps
    replicated["train_state"] = {"micro_steps": checkpoint.global_steps * engine.config.batch.grad_accum_steps,
                                 "steps": applied, "skipped_steps": checkpoint.skipped_steps}
    replicated["update"] = {"schedule": engine.update.schedule.state_dict()}
    if "scaler" in parts and getattr(parts["scaler"], "enabled", False) and checkpoint.loss_scale is not None:
        replicated["scaler"] = {**replicated["scaler"], **checkpoint.loss_scale}
    sharded = {slot.name for _, slot in parameter_slots(shards, "frozen")}
    run = DeepSpeedRun(checkpoint, replicated, [n for n in checkpoint.frozen_shapes if n in sharded])
    kept = _frozen_kept(engine, checkpoint)
    if kept:
        parts = {name: part for name, part in parts.items() if name != "frozen"}
    compare_models(run, shards, checkpoint.directory, whole_model=engine.topology.size("pp") == 1,
                   kinds=("units",) if kept else ("units", "frozen"))
    held = {} if kept else _held_frozen(engine, checkpoint, sharded)
    if "buffers" in parts:
        _check_buffers(parts["buffers"].named(), checkpoint)
    extra = load_run(parts, run, engine.topology.rank, shards, engine.update, checkpoint.world, 0)
    with torch.no_grad():
        for name, (param, value) in held.items():
            param.copy_(value)
    return extra


def _frozen_kept(engine: "TrainingCore", checkpoint: DeepSpeedCheckpoint) -> int:
    """How many frozen parameters of this engine keep their values because the checkpoint holds
    none (DeepSpeed's save_checkpoint(exclude_frozen_parameters=True), as a LoRA run saves: the
    frozen weights are the pretrained ones, loaded before), said in a warning; 0 otherwise."""
    if checkpoint.frozen_shapes:
        return 0
    first_name = {}  # (one name per parameter: a tied alias is the same one)
    for name, param in _frozen_of(engine).items():
        if name not in checkpoint.shapes:
            first_name.setdefault(id(param), name)
    frozen = sorted(first_name.values())
    if frozen:
        warnings.warn(f"the DeepSpeed checkpoint {checkpoint.directory!r} holds no frozen parameter (saved with "
                      f"exclude_frozen_parameters=True): this model's {len(frozen)} frozen parameters keep the "
                      f"values they have (e.g. {frozen[0]!r}); load the pretrained weights they come from "
                      f"before (from_pretrained, or tiertrain.load_pretrained before the DeepSpeed checkpoint)",
                      FrozenKeptWarning, stacklevel=4)
    return len(frozen)


def _check_buffers(own: dict[str, torch.Tensor], checkpoint: DeepSpeedCheckpoint) -> None:
    """Every persistent buffer of this model has a value of its shape in the checkpoint: checked
    before anything is loaded, so a refused checkpoint leaves the engine as it was."""
    missing = sorted(n for n in own if n not in checkpoint.buffers)
    if missing:
        raise CheckpointError(f"{checkpoint.directory!r} holds no value for the buffers {missing[:10]} of this model "
                              f"(DeepSpeed's buffer_names: {sorted(checkpoint.buffers)[:10]}); nothing was loaded")
    for name, value in own.items():
        if tuple(checkpoint.buffers[name].shape) != tuple(value.shape):
            raise CheckpointError(f"{checkpoint.directory!r} holds buffer {name!r} with shape "
                                  f"{tuple(checkpoint.buffers[name].shape)}, this model has {tuple(value.shape)}; "
                                  f"nothing was loaded")


def _frozen_of(engine: "TrainingCore") -> dict[str, torch.nn.Parameter]:
    """The engine's frozen parameters under every name its modules give them (tied aliases too)."""
    return {n: p for module in engine.named_modules_of_state()
            for n, p in module.named_parameters(remove_duplicate=False) if not p.requires_grad}


class FrozenKeptWarning(UserWarning):
    """A DeepSpeed checkpoint without frozen parameters left the model's own frozen values."""


def _held_frozen(engine: "TrainingCore", checkpoint: DeepSpeedCheckpoint, sharded: set[str]) -> dict:
    """{name: (the engine's parameter, its value)} for the checkpoint's frozen parameters that
    the engine's module holds whole (stages 0-2; a tensor-parallel slice: its slice)."""
    own = _frozen_of(engine)
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


__all__ = ["DEEPSPEED_OBJECTS", "DeepSpeedCheckpoint", "DeepSpeedRun", "FrozenKeptWarning", "load_into"]
