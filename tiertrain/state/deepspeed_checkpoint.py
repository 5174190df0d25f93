"""A DeepSpeed ZeRO checkpoint (read by tiertrain/state/deepspeed_files.py) loaded into an engine
of any layout: each trained parameter's fp32 master and optimizer state (Adam's moments and step,
or whatever DeepSpeed's optimizer kept: SGD's momentum), the frozen values,
the buffers, the step count, an fp16 engine's loss scale and the client state, so a run moved
from DeepSpeed continues where it stopped instead of restarting its optimizer
(docs/migrate-deepspeed.md). The DeepSpeed run goes through the resharding path
(tiertrain/state/reshard.py) as the tiertrain run of its own ranks and partitions.
"""
from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

from .checkpoint import CheckpointError
from .deepspeed_files import DEEPSPEED_OBJECTS, DeepSpeedCheckpoint
from .deepspeed_universal import load_universal, universal_path
from .foreign import ForeignRun, FrozenKeptWarning, check_buffers, copy_held, frozen_kept, held_frozen, replicated_at
from .optimizer_state import OptimizerStateKeys
from .reshard import check_reshardable_format, compare_models, load_run
from .shard_layout import _unit_of, parameter_slots
from ..update.state_format import TorchOptimizerState

if TYPE_CHECKING:
    from ..training_core import TrainingCore


class DeepSpeedRun(ForeignRun):
    """A DeepSpeed checkpoint seen as the tiertrain checkpoint of the same ranks and partitions
    (reading of each rank's buffers only the pieces it needs): one unit per bucket, cut in as
    many shards as DeepSpeed had ranks; of the frozen parameters, those named (the ones the
    loading engine keeps in shards: stage 3's), one unit each."""

    def __init__(self, checkpoint: DeepSpeedCheckpoint, replicated: dict, frozen: list[str],
                 kept: OptimizerStateKeys):
        self.checkpoint = checkpoint
        self.kept = kept
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
        super().__init__(checkpoint.directory, layouts,
                         {**replicated, "buffers": checkpoint.buffers, "extra": checkpoint.client_state})

    def _at(self, piece, a: int) -> tuple[int, int]:
        """(rank, offset in its buffers joined) of element a of a piece of a trained unit."""
        return piece.rank, self.checkpoint.buckets[piece.unit].start + piece.start + a - piece.lo

    def values(self, key: str, piece, a: int, b: int) -> torch.Tensor:
        if key == "frozen":
            return self.checkpoint.frozen_piece(piece.rank, piece.name, piece.start + a - piece.lo, b - a)
        rank, offset = self._at(piece, a)
        return self.checkpoint.read(rank, key, offset, b - a)

    def frozen_dtype(self) -> torch.dtype:
        return self.checkpoint.frozen_dtype

    def state_values(self, piece, a: int, b: int) -> dict | None:
        rank, offset = self._at(piece, a)
        c = self.checkpoint
        state = {key: c.read(rank, key, offset, b - a) for key in c.state_keys}
        if c.counts_steps:
            state["step"] = self.kept.step_as_kept(piece.name, c.shapes[piece.name], c.step_at(rank, offset))
        return state


# -- into an engine --------------------------------------------------------------------------

def load_into(engine: "TrainingCore", directory: str | os.PathLike, tag: str | None = None) -> dict:
    """Load the DeepSpeed checkpoint into the engine's parts (every rank reads the files it
    needs, memory-mapped); returns its client state. The counters continue from DeepSpeed's
    global step (so does the schedule: the config's, or a client lr_scheduler stepped once per
    update applied), an fp16 engine's loss scale from DeepSpeed's dynamic one; the optimizer's
    hyper-parameters and the RNG stay this engine's. A universal checkpoint (ds_to_universal's:
    ``directory/latest_universal``'s tag, the tag given, or directory itself) loads the same way
    (tiertrain/state/deepspeed_universal.py)."""
    universal = universal_path(os.fspath(directory), tag)
    if universal is not None:
        return load_universal(engine, universal)
    try:
        checkpoint = DeepSpeedCheckpoint(directory, tag)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(f"{os.fspath(directory)!r} (tag {tag!r}) is not a DeepSpeed ZeRO checkpoint this "
                              f"version reads ({type(e).__name__}: {e})") from e
    where = f"the DeepSpeed checkpoint {checkpoint.directory!r}"
    shards = engine.shard_description()
    check_reshardable_format(shards, where)
    kept_state = OptimizerStateKeys(engine)
    for name, shape in checkpoint.shapes.items():  # (the engine's optimizer must keep what DeepSpeed's kept)
        kept_state.check(where, name, shape, {**{key: shape for key in checkpoint.state_keys},
                                              **({"step": ()} if checkpoint.counts_steps else {})})
    parts = engine.checkpoint_parts()
    # (DeepSpeed's global_steps counts the fp16 steps skipped on overflow too)
    applied = checkpoint.global_steps - checkpoint.skipped_steps
    replicated = replicated_at(engine, parts, applied, checkpoint.skipped_steps, checkpoint.loss_scale)
    sharded = {slot.name for _, slot in parameter_slots(shards, "frozen")}
    run = DeepSpeedRun(checkpoint, replicated, [n for n in checkpoint.frozen_shapes if n in sharded], kept_state)
    kept = frozen_kept(engine, checkpoint, "exclude_frozen_parameters=True")
    if kept:
        parts = {name: part for name, part in parts.items() if name != "frozen"}
    compare_models(run, shards, checkpoint.directory, whole_model=engine.topology.size("pp") == 1,
                   kinds=("units",) if kept else ("units", "frozen"))
    held = {} if kept else held_frozen(engine, checkpoint, sharded)
    if "buffers" in parts:
        check_buffers(parts["buffers"].named(), checkpoint)
    extra = load_run(parts, run, engine.topology.rank, shards, engine.update, checkpoint.world, 0)
    engine.update.schedule.fast_forward(applied)  # (a client lr_scheduler: built afresh, at step 0)
    copy_held(held)
    return extra


__all__ = ["DEEPSPEED_OBJECTS", "DeepSpeedCheckpoint", "DeepSpeedRun", "FrozenKeptWarning", "load_into"]
