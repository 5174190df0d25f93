"""Background checkpoint saves (``save_checkpoint(background=True)``, ``checkpoint.async_save``).

The save returns at once; a thread serialises the live state, writes, checksums and commits it
(over a process group of its own) while training goes on, and the next optimizer step (which
changes the state) waits until the state is serialised. What must hold:

* the checkpoint holds the state *at the save*, bit for bit, although the next steps change
  the live masters and Adam moments in place while it is being written;
* until it is committed the previous checkpoint stays the newest loadable one, and a failed
  background write is raised by ``wait_for_checkpoint`` naming what failed, on every rank;
* ``close()`` waits for it (nothing half-written is left behind by a clean exit).
"""
from __future__ import annotations

import os
import time

import pytest
import torch

import tiertrain
from reference import global_batches, make_config, make_model, rank_slices
import tiertrain.state.checkpoint as checkpoint_module
from tiertrain.state.checkpoint import CheckpointError, committed_steps
from tiertrain.testing import run_distributed

MICRO, GLOBAL = 2, 8


def _engine(seed: int, stage: int = 2):
    cfg = make_config(zero={"stage": stage, "bucket_mb": 0.02},
                      batch={"micro_batch_size": MICRO, "grad_accum_steps": GLOBAL // (MICRO * 2)})
    return tiertrain.wrap(make_model(seed=seed), cfg, tiertrain.Topology.build(cfg.parallel)), cfg


def _train(engine, cfg, batch, rank):
    engine.train_batch(rank_slices(batch, rank, 2, MICRO, cfg.batch.grad_accum_steps))


def _copy(state):
    """A state whose tensors share no memory with the engine's."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _copy(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(_copy(v) for v in state)
    return state


def _equal(a, b, path="state") -> list[str]:
    """Paths where two rank states differ (tensors bit for bit)."""
    if isinstance(a, torch.Tensor):
        return [] if isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) else [path]
    if isinstance(a, dict):
        if not isinstance(b, dict) or a.keys() != b.keys():
            return [path]
        return [d for k in a for d in _equal(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if not isinstance(b, (list, tuple)) or len(a) != len(b):
            return [path]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _equal(x, y, f"{path}[{i}]")]
    return [] if a == b else [path]


def _write_slowly(seconds: float = 1.0) -> None:
    """Each checkpoint file written `seconds` late (in this worker process only)."""
    write = checkpoint_module.atomic_write

    def late(path, fill):
        time.sleep(seconds)
        return write(path, fill)
    checkpoint_module.atomic_write = late


def _snapshot_while_training(rank, world, root):
    batches = global_batches(4, GLOBAL)
    engine, cfg = _engine(seed=0)
    _train(engine, cfg, batches[0], rank)
    engine.save_checkpoint(root)  # (the previous checkpoint: step 1)
    _train(engine, cfg, batches[1], rank)
    at_save = _copy(engine.state_dict())
    _write_slowly()  # (so that the steps below run while the thread writes)
    engine.save_checkpoint(root, background=True)
    # Training goes on while the thread writes: these steps change the masters and moments
    # in place. The newest committed checkpoint is step 1 or (once committed) step 2.
    seen_while_pending = committed_steps(root)
    _train(engine, cfg, batches[2], rank)
    _train(engine, cfg, batches[3], rank)
    assert engine.wait_for_checkpoint() == os.path.join(root, "step_00000002")
    after = engine.state_dict()
    engine.close()

    fresh, _ = _engine(seed=7)
    fresh.load_checkpoint(root)
    loaded = fresh.state_dict()
    fresh.close()
    return _equal(at_save, loaded), _equal(at_save, after) != [], seen_while_pending, committed_steps(root)


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_background_save_holds_the_state_at_the_save_while_training_goes_on(tmp_path):
    for differ, moved, seen, committed in run_distributed(_snapshot_while_training, 2, str(tmp_path), timeout=60):
        assert differ == [], f"the checkpoint differs from the state at the save in {differ[:5]}"
        assert moved, "training after the save did not change the state (the test would prove nothing)"
        assert seen == [1], seen
        assert committed == [1, 2]


def _failing_background_write(rank, world, root):
    engine, cfg = _engine(seed=0)
    batches = global_batches(2, GLOBAL)
    _train(engine, cfg, batches[0], rank)
    engine.save_checkpoint(root)
    _train(engine, cfg, batches[1], rank)
    # The step directory cannot be created: a file is in its place.
    blocker = os.path.join(root, "step_00000002")
    if rank == 0:
        with open(blocker, "w") as f:
            f.write("not a directory")
    torch.distributed.barrier()
    engine.save_checkpoint(root, background=True)
    try:
        engine.wait_for_checkpoint()
        outcome = "committed"
    except CheckpointError as e:
        outcome = str(e)
    newest = committed_steps(root)
    engine.close()
    return outcome, newest


@pytest.mark.timeout(90)
def test_a_failed_background_write_is_raised_on_every_rank_and_the_previous_checkpoint_stays(tmp_path):
    for outcome, newest in run_distributed(_failing_background_write, 2, str(tmp_path), timeout=60):
        assert outcome != "committed"
        assert "checkpoint not committed" in outcome and "step_00000002" in outcome, outcome
        assert newest == [1]


def _close_waits(rank, world, root):
    engine, cfg = _engine(seed=0, stage=3)
    _train(engine, cfg, global_batches(1, GLOBAL)[0], rank)
    engine.save_checkpoint(root, background=True)
    engine.close()  # (no wait_for_checkpoint: close must wait)
    return committed_steps(root), sorted(os.listdir(os.path.join(root, "step_00000001")))


@pytest.mark.timeout(90)
def test_close_waits_for_a_background_save(tmp_path):
    for committed, files in run_distributed(_close_waits, 2, str(tmp_path), timeout=60):
        assert committed == [1]
        assert "COMMITTED.json" in files and not [f for f in files if f.endswith(".tmp")], files
