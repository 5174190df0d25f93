"""Sharded checkpoints: resuming continues bit-identically; a bad checkpoint is refused
with an error naming the file; an interrupted save leaves the previous one usable."""
from __future__ import annotations

import os

import pytest
import torch

import tiertrain
from reference import global_batches, make_config, make_model, rank_slices
from tiertrain.checkpoint import CheckpointError, committed_steps
from tiertrain.testing import RankFailure, run_distributed

STEPS, SPLIT = 6, 3


def _train(rank, world, stage, dtype, directory, resume, tiers=("none", "none")):
    zero = {"stage": stage, "bucket_mb": 0.02, "offload_optimizer": tiers[0], "offload_params": tiers[1],
            "nvme_path": os.path.join(directory, "swap"), "nvme_chunk_mb": 0.01}
    cfg = make_config(zero=zero, precision={"dtype": dtype},
                      batch={"micro_batch_size": 2, "grad_accum_steps": 2})
    engine = tiertrain.wrap(make_model(seed=5 if resume else 0), cfg, tiertrain.Topology.build(cfg.parallel))
    batches = global_batches(STEPS, 2 * 2 * world)
    start = 0
    if resume:
        start = engine.load_checkpoint(directory)["next_batch"]
    losses = []
    for i in range(start, STEPS):
        losses.append(engine.train_batch(rank_slices(batches[i], rank, world, 2, 2)))
        if not resume and i + 1 == SPLIT:
            engine.save_checkpoint(directory, extra={"next_batch": i + 1})
    return losses, engine.full_state_dict()


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage,dtype", [(0, "fp32"), (1, "bf16"), (2, "fp32"), (3, "fp32"), (3, "bf16")])
def test_resume_is_bit_identical(tmp_path, stage, dtype):
    full_losses, full_params = run_distributed(_train, 2, stage, dtype, str(tmp_path), False, timeout=40)[0]
    # The resumed run starts from a differently-seeded model: everything must come from the checkpoint.
    resumed_losses, resumed_params = run_distributed(_train, 2, stage, dtype, str(tmp_path), True, timeout=40)[0]
    assert resumed_losses == full_losses[SPLIT:]
    assert all(torch.equal(resumed_params[k], full_params[k]) for k in full_params)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage,tiers", [(2, ("nvme", "none")), (3, ("nvme", "nvme"))])
def test_resume_from_the_nvme_tiers_is_bit_identical(tmp_path, stage, tiers):
    full_losses, full_params = run_distributed(_train, 2, stage, "bf16", str(tmp_path), False, tiers,
                                               timeout=40)[0]
    resumed_losses, resumed_params = run_distributed(_train, 2, stage, "bf16", str(tmp_path), True, tiers,
                                                     timeout=40)[0]
    assert resumed_losses == full_losses[SPLIT:]
    assert all(torch.equal(resumed_params[k], full_params[k]) for k in full_params)


def _save_then(rank, world, directory, action):
    cfg = make_config(zero={"stage": 2}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    engine.train_batch(rank_slices(global_batches(1, 4)[0], rank, world, 2, 1))
    step_dir = engine.save_checkpoint(directory)
    if action == "corrupt" and rank == 1:
        with open(os.path.join(step_dir, "rank00001.pt"), "r+b") as f:
            f.seek(100)
            f.write(b"garbage")
    if action == "other_stage":
        cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2})
        engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    torch.distributed.barrier()
    engine.load_checkpoint(directory, reshard=action != "other_stage")


@pytest.mark.timeout(60)
def test_corrupt_shard_is_refused_with_its_path(tmp_path):
    with pytest.raises(RankFailure, match=r"rank00001\.pt' is corrupt"):
        run_distributed(_save_then, 2, str(tmp_path), "corrupt", timeout=40)


@pytest.mark.timeout(60)
def test_layout_mismatch_is_refused_when_resharding_is_off(tmp_path):
    """(With resharding on, the default, tests/test_reshard.py loads it at the new stage.)"""
    with pytest.raises(RankFailure, match=r"saved with stage=2, this run has stage=3"):
        run_distributed(_save_then, 2, str(tmp_path), "other_stage", timeout=40)


def _save_to(rank, world, directory):
    cfg = make_config(batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    engine.save_checkpoint(directory)


@pytest.mark.timeout(60)
def test_unwritable_directory_fails_on_every_rank_without_hanging(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(RankFailure, match=r"checkpoint not committed.*writing"):
        run_distributed(_save_to, 2, str(blocker / "ckpt"), timeout=40)


def test_uncommitted_step_is_ignored(tmp_path):
    (tmp_path / "step_00000009").mkdir()
    (tmp_path / "step_00000009" / "rank00000.pt").write_bytes(b"partial")
    assert committed_steps(str(tmp_path)) == []
    cfg = make_config()
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        engine.load_checkpoint(str(tmp_path))
    engine.save_checkpoint(str(tmp_path))
    assert committed_steps(str(tmp_path)) == [0]
