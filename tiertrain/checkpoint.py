"""Sharded checkpoints: each rank saves its own shard; nothing is lost on failure.

Layout on disk::

    DIR/step_00000120/rank00000.pt   this rank's masters, shards, optimizer, schedule,
    DIR/step_00000120/rank00001.pt   scaler, counters, RNG state and the caller's extras
    DIR/step_00000120/COMMITTED.json written last, by rank 0, once every rank's file is
                                     durable: each rank's layout fingerprint and file sha256

Each file is written to a temporary name, fsynced and renamed into place, so a crash
leaves either the old checkpoint or a directory without COMMITTED.json, which loading
ignores. Loading verifies the checksum of this rank's file and that the layout (stage,
data-parallel size, units) is the one saved; a mismatch is an error naming what differs.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from .fileio import atomic_write

if TYPE_CHECKING:
    from .engine import Engine

MARKER = "COMMITTED.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or was saved with another layout."""


def _fingerprint(engine: "Engine") -> dict:
    layout = engine.layout
    return {
        "stage": engine.stage,
        "dp": engine.dp,
        "tp": engine.topology.size("tp"),
        "pp": engine.topology.size("pp"),
        "dtype": engine.config.precision.dtype,
        "optimizer_tier": "nvme" if engine.nvme_optimizer is not None else "memory",
        "units": [[u.label, u.padded_numel, [s.name for s in u.slots]] for u in layout.units],
    }


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _gather_objects(obj: Any, group) -> list[Any]:
    if group is None or not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def rank_state(engine: "Engine") -> dict:
    """This rank's complete training state (the engine's state_dict)."""
    delayed = getattr(engine, "delayed", None)
    if delayed is not None:  # the update in flight lands in the state (zero.delayed_update)
        delayed.wait(agree=False)
    if engine.nvme_optimizer is not None:  # masters and moments come back from NVMe
        optimizer = engine.nvme_optimizer.state_dict()
        masters = [shard.pop("master") for shard in optimizer["shards"]]
    else:
        optimizer = engine.optimizer.state_dict()
        masters = [u.master.detach().clone() for u in engine.flat.units]
    return {
        **({"delayed": delayed.state_dict()} if delayed is not None else {}),
        "masters": masters,
        "optimizer": optimizer,
        "schedule": engine.schedule.state_dict(),
        "scaler": engine.scaler.state_dict(),
        "counters": {"micro_steps": engine.micro_steps, "steps": engine.steps,
                     "skipped_steps": engine.skipped_steps},
        "rng": torch.get_rng_state(),
    }


def restore_rank_state(engine: "Engine", state: dict) -> None:
    """Inverse of rank_state: masters are copied in place (the optimizer holds views of
    them), compute-dtype shards and resident full buffers are rebuilt from them."""
    delayed = getattr(engine, "delayed", None)
    if delayed is not None:
        delayed.discard()  # an update still in flight must not write over the loaded masters
    if engine.nvme_optimizer is not None:
        optimizer = state["optimizer"]
        for shard, master in zip(optimizer["shards"], state["masters"]):
            shard["master"] = master.cpu()
        engine.nvme_optimizer.load_state_dict(optimizer)
        with engine.flat.shard_writer() as write:
            for index, master in enumerate(state["masters"]):
                write(index, 0, master.numel(), master)
    else:
        with torch.no_grad():
            for u, master in zip(engine.flat.units, state["masters"]):
                u.master.copy_(master)
        engine.optimizer.load_state_dict(state["optimizer"])
    engine.flat.publish_masters()
    engine.flat.zero_grads()
    engine.schedule.load_state_dict(state["schedule"])
    engine.scaler.load_state_dict(state["scaler"])
    engine.micro_steps = state["counters"]["micro_steps"]
    engine.steps = state["counters"]["steps"]
    engine.skipped_steps = state["counters"]["skipped_steps"]
    if delayed is not None:  # a run saved between an update and its publication resumes there
        delayed.load_state_dict(state.get("delayed"))
    torch.set_rng_state(state["rng"])


def save(engine: "Engine", directory: str, extra: dict | None = None, keep_last: int = 0) -> str:
    """Save this rank's state under directory/step_NNNNNNNN (collective: every rank calls it)."""
    step_dir = os.path.join(directory, f"step_{engine.steps:08d}")
    rank, world = engine.topology.rank, engine.topology.world_size
    group = engine.topology.world_group()
    if rank == 0 and os.path.exists(os.path.join(step_dir, MARKER)):
        os.remove(os.path.join(step_dir, MARKER))  # re-saving a step: uncommit it first
    if group is not None:
        dist.barrier(group=group)
    state = rank_state(engine)
    state["extra"] = extra or {}
    path = os.path.join(step_dir, f"rank{rank:05d}.pt")
    error = digest = None
    try:  # every rank reports success or its error, so no rank waits on a failed one
        os.makedirs(step_dir, exist_ok=True)
        atomic_write(path, lambda f: torch.save(state, f))
        digest = _sha256(path)
    except OSError as e:
        error = f"rank {rank}: writing {path!r} failed: {e.strerror or e}"
    # Each rank's own layout is recorded: under pipeline or tensor parallelism they differ.
    digests = _gather_objects((digest, error, _fingerprint(engine)), group)
    errors = [e for _, e, _ in digests if e]
    if errors:
        raise CheckpointError("checkpoint not committed; " + "; ".join(errors))
    if rank == 0:
        marker = {"step": engine.steps, "world_size": world, "layouts": [f for _, _, f in digests],
                  "sha256": [d for d, _, _ in digests]}
        atomic_write(os.path.join(step_dir, MARKER), lambda f: f.write(json.dumps(marker, indent=1).encode()))
        if keep_last:
            for old in committed_steps(directory)[:-keep_last]:
                shutil.rmtree(os.path.join(directory, f"step_{old:08d}"), ignore_errors=True)
    if group is not None:
        dist.barrier(group=group)
    return step_dir


def committed_steps(directory: str) -> list[int]:
    """Steps with a complete (committed) checkpoint in directory, oldest first."""
    if not os.path.isdir(directory):
        return []
    steps = []
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name)
        if m and os.path.exists(os.path.join(directory, name, MARKER)):
            steps.append(int(m.group(1)))
    return sorted(steps)


def load(engine: "Engine", directory: str, step: int | None = None) -> dict:
    """Restore the newest (or the given) committed checkpoint; returns the saved extras."""
    steps = committed_steps(directory)
    if not steps:
        raise CheckpointError(f"no committed checkpoint in {directory!r}")
    if step is None:
        step = steps[-1]
    elif step not in steps:
        raise CheckpointError(f"no committed checkpoint for step {step} in {directory!r}; committed: {steps}")
    step_dir = os.path.join(directory, f"step_{step:08d}")
    with open(os.path.join(step_dir, MARKER)) as f:
        marker = json.load(f)
    rank = engine.topology.rank
    if marker["world_size"] != engine.topology.world_size:
        raise CheckpointError(f"{step_dir!r} was saved by {marker['world_size']} ranks, "
                              f"this run has {engine.topology.world_size}; resharding is not supported yet")
    expected, saved = _fingerprint(engine), marker["layouts"][rank]
    for key in ("stage", "dp", "tp", "pp", "dtype", "optimizer_tier"):
        if saved[key] != expected[key]:
            raise CheckpointError(f"{step_dir!r} was saved with {key}={saved[key]!r}, "
                                  f"this run has {key}={expected[key]!r}")
    if saved["units"] != expected["units"]:
        raise CheckpointError(f"{step_dir!r} was saved with another unit layout "
                              f"(a different model or zero.bucket_mb)")
    path = os.path.join(step_dir, f"rank{rank:05d}.pt")
    if not os.path.exists(path):
        raise CheckpointError(f"{path!r} is missing from a committed checkpoint")
    if _sha256(path) != marker["sha256"][rank]:
        raise CheckpointError(f"{path!r} is corrupt: its sha256 differs from the one committed")
    state = torch.load(path, map_location=engine.device, weights_only=False)
    restore_rank_state(engine, state)
    return state["extra"]
