"""Sharded checkpoints: each rank saves its own shard; nothing is lost on failure.

A checkpoint is built from stateful parts (torchtitan's checkpointer): anything with
``state_dict()``/``load_state_dict()``. The engine hands over its parts (the optimizer-step
form with the masters and optimizer state, the loss scaler, the counters, the RNG; see
``Engine.checkpoint_parts``) and a fingerprint of its layout; this module handles files,
commit and checks, and knows nothing of the engine.

Layout on disk::

    DIR/step_00000120/rank00000.pt   this rank's parts' states (by part name) and the
    DIR/step_00000120/rank00001.pt   caller's extras
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
from typing import Any, Mapping, Protocol

import torch
import torch.distributed as dist

from .fileio import atomic_write

MARKER = "COMMITTED.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, corrupt or was saved with another layout."""


class Stateful(Protocol):
    """A checkpoint part."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def layout_fingerprint(layout, topology, stage: int, dtype: str, state_format: str) -> dict:
    """What a rank's checkpoint must match to load: parallel sizes, ZeRO stage, compute dtype,
    the optimizer state's format and the flat units (names and sizes)."""
    frozen = {"frozen_units": [[u.label, u.padded_numel, [s.name for s in u.slots]] for u in layout.frozen]} \
        if layout.frozen else {}
    return {
        **frozen,
        "stage": stage,
        "dp": topology.size("dp"),
        "tp": topology.size("tp"),
        "pp": topology.size("pp"),
        "dtype": dtype,
        "optimizer_tier": state_format,
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


def rank_state(parts: Mapping[str, Stateful]) -> dict:
    """This rank's complete training state: every part's state, by part name."""
    return {name: part.state_dict() for name, part in parts.items()}


def restore_rank_state(parts: Mapping[str, Stateful], state: dict) -> None:
    """Inverse of rank_state, part by part in the parts' order."""
    missing = [name for name in parts if name not in state]
    if missing:
        raise CheckpointError(f"the checkpoint holds no state for {missing}; it has {sorted(state)}")
    for name, part in parts.items():
        part.load_state_dict(state[name])


def save(parts: Mapping[str, Stateful], directory: str, step: int, topology, fingerprint: dict,
         extra: dict | None = None, keep_last: int = 0) -> str:
    """Save this rank's parts under directory/step_NNNNNNNN (collective: every rank calls it);
    fingerprint: this rank's layout_fingerprint, checked at load."""
    step_dir = os.path.join(directory, f"step_{step:08d}")
    rank, world = topology.rank, topology.world_size
    group = topology.world_group()
    if rank == 0 and os.path.exists(os.path.join(step_dir, MARKER)):
        os.remove(os.path.join(step_dir, MARKER))  # re-saving a step: uncommit it first
    if group is not None:
        dist.barrier(group=group)
    state = rank_state(parts)
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
    digests = _gather_objects((digest, error, fingerprint), group)
    errors = [e for _, e, _ in digests if e]
    if errors:
        raise CheckpointError("checkpoint not committed; " + "; ".join(errors))
    if rank == 0:
        marker = {"step": step, "world_size": world, "layouts": [f for _, _, f in digests],
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


def load(parts: Mapping[str, Stateful], directory: str, step: int | None, topology, fingerprint: dict,
         device: torch.device) -> dict:
    """Restore the newest (or the given) committed checkpoint into the parts; returns the
    saved extras. fingerprint must match the one saved by this rank."""
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
    rank = topology.rank
    if marker["world_size"] != topology.world_size:
        raise CheckpointError(f"{step_dir!r} was saved by {marker['world_size']} ranks, "
                              f"this run has {topology.world_size}; resharding is not supported yet")
    expected, saved = fingerprint, marker["layouts"][rank]
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
    state = torch.load(path, map_location=device, weights_only=False)
    restore_rank_state(parts, state)
    return state["extra"]
