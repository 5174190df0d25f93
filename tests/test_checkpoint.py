"""Sharded checkpoints: resuming continues bit-identically; a bad checkpoint is refused
with an error naming the file; an interrupted save leaves the previous one usable."""
from __future__ import annotations

import os

import pytest
import torch

import tiertrain
from reference import global_batches, make_config, make_model, rank_slices
from tiertrain.state.checkpoint import CheckpointError, committed_steps
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
    with pytest.raises(RankFailure, match=r"checkpoint directory .*ckpt.*Not a directory"):
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


# -- a save of a step already committed (issue 32, item 1) ----------------------------------

def _engine_after_a_skipped_step(directory):
    """An engine that saved step 1, then took a step skipped for non-finite gradients (the
    step count stays 1, the micro-step count moves on)."""
    cfg = make_config(batch={"micro_batch_size": 4})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    first, second = global_batches(2, 4)
    engine.train_batch(iter([first]))
    engine.save_checkpoint(str(directory), keep_last=1)
    loss = engine(second)
    engine.backward(loss * float("nan"))
    engine.step()
    assert engine.steps == 1 and engine.train_state.skipped_steps == 1
    return engine


def _step_entries(directory) -> list[str]:
    return sorted(n for n in os.listdir(directory) if n.startswith("step_"))


def _saved_micro_steps(directory, step=1) -> int:
    from tiertrain.state.checkpoint import find_committed, load_rank_file, rank_file_name, verified_file

    step_dir, marker = find_committed(str(directory), step)
    state = load_rank_file(verified_file(step_dir, rank_file_name(0), marker["sha256"][0]), torch.device("cpu"))
    return state["train_state"]["micro_steps"]


@pytest.mark.parametrize("atomic_exchange", [True, False], ids=["exchange", "two-renames"])
def test_a_save_of_a_committed_step_that_fails_keeps_the_committed_one(tmp_path, monkeypatch, atomic_exchange):
    """A step skipped for non-finite gradients leaves engine.steps as it was, so the next save
    names the same step directory. It used to uncommit the checkpoint there before rewriting
    it, so a kill or a full disk during the rewrite (with keep_last 1: nothing older) lost the
    run's only checkpoint. Now it is written beside and takes the old one's place only once
    committed."""
    import tiertrain.state.checkpoint as checkpoint_module

    if not atomic_exchange:
        monkeypatch.setattr(checkpoint_module, "exchange_paths", lambda a, b: False)
    engine = _engine_after_a_skipped_step(tmp_path)
    real_write = checkpoint_module.atomic_write

    def disk_full(path, write):
        if path.endswith("rank00000.pt"):
            raise OSError(28, "No space left on device", path)
        return real_write(path, write)
    monkeypatch.setattr(checkpoint_module, "atomic_write", disk_full)
    with pytest.raises(CheckpointError, match="No space left on device"):
        engine.save_checkpoint(str(tmp_path), keep_last=1)
    assert committed_steps(str(tmp_path)) == [1] and _saved_micro_steps(tmp_path) == 1
    monkeypatch.setattr(checkpoint_module, "atomic_write", real_write)
    engine.save_checkpoint(str(tmp_path), keep_last=1)
    assert committed_steps(str(tmp_path)) == [1] and _saved_micro_steps(tmp_path) == 2
    assert _step_entries(tmp_path) == ["step_00000001"], "nothing is left beside it"


def test_the_newest_save_is_resumed_not_the_highest_step(tmp_path):
    """Every commit gets a save number one above the directory's largest: after a run went back
    to step 2 (the newer ones diverged, or it loaded step 2 by name) and saved step 3 again, a
    resume continues that line, not the step 4 of the line it left."""
    from tiertrain.state.checkpoint import read_marker, saves_newest_first

    cfg = make_config(batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    batches = global_batches(6, 2)
    for i in range(4):
        engine.train_batch(iter([batches[i]]))
        engine.save_checkpoint(str(tmp_path), extra={"line": "first"})
    assert [read_marker(str(tmp_path), s)["save_id"] for s in (1, 2, 3, 4)] == [1, 2, 3, 4]
    engine.load_checkpoint(str(tmp_path), step=2)
    engine.train_batch(iter([batches[5]]))
    engine.save_checkpoint(str(tmp_path), extra={"line": "second"})
    assert saves_newest_first(str(tmp_path)) == [3, 4, 2, 1]
    assert engine.load_checkpoint(str(tmp_path)) == {"line": "second"} and engine.steps == 3
    engine.train_batch(iter([batches[4]]))
    engine.save_checkpoint(str(tmp_path), extra={"line": "second"})
    assert saves_newest_first(str(tmp_path)) == [4, 3, 2, 1]
    assert engine.load_checkpoint(str(tmp_path)) == {"line": "second"} and engine.steps == 4


def test_rotation_keeps_the_newest_saves(tmp_path):
    from tiertrain.state.checkpoint import rotate

    cfg = make_config(batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    batches = global_batches(4, 2)
    for i in range(3):
        engine.train_batch(iter([batches[i]]))
        engine.save_checkpoint(str(tmp_path), run_id="r")
    engine.load_checkpoint(str(tmp_path), step=1)
    engine.train_batch(iter([batches[3]]))
    engine.save_checkpoint(str(tmp_path), run_id="r")  # step 2 again, the newest save
    assert rotate(str(tmp_path), "r", keep_last=2) == [1]
    assert committed_steps(str(tmp_path)) == [2, 3]


def test_a_save_interrupted_between_its_two_renames_is_found_and_settled(tmp_path, monkeypatch):
    """Where the file system cannot exchange two directories atomically, the new checkpoint
    takes the old one's place in two renames; killed between them, step_N is gone for a moment:
    readers then take the committed step_N.next, and the next save (or the launcher's cleanup)
    puts it in place."""
    import tiertrain.state.checkpoint as checkpoint_module
    from tiertrain.state.checkpoint import find_committed, remove_crashed_saves

    monkeypatch.setattr(checkpoint_module, "exchange_paths", lambda a, b: False)
    engine = _engine_after_a_skipped_step(tmp_path)
    real_rename, calls = os.rename, []

    def killed_after_the_first(a, b):
        calls.append((a, b))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        return real_rename(a, b)
    monkeypatch.setattr(checkpoint_module.os, "rename", killed_after_the_first)
    with pytest.raises(KeyboardInterrupt):
        engine.save_checkpoint(str(tmp_path))
    monkeypatch.setattr(checkpoint_module.os, "rename", real_rename)
    assert _step_entries(tmp_path) == ["step_00000001.next", "step_00000001.old"]
    assert committed_steps(str(tmp_path)) == [1]
    assert find_committed(str(tmp_path))[0].endswith("step_00000001.next") and _saved_micro_steps(tmp_path) == 2
    remove_crashed_saves(str(tmp_path), None)
    assert _step_entries(tmp_path) == ["step_00000001"] and _saved_micro_steps(tmp_path) == 2
    fresh = tiertrain.wrap(make_model(seed=3), make_config(batch={"micro_batch_size": 4}),
                           tiertrain.Topology.build(make_config().parallel))
    fresh.load_checkpoint(str(tmp_path))
    assert fresh.train_state.micro_steps == 2


# -- every rank loads the same checkpoint (issue 32, item 2) --------------------------------

def _resume_when_the_newest_is_corrupt_on_one_rank(rank, world, directory):
    import warnings

    cfg = make_config(zero={"stage": 2}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    for batch in global_batches(2, 4):
        engine.train_batch(rank_slices(batch, rank, world, 2, 1))
        step_dir = engine.save_checkpoint(directory)
    if rank == 1:  # (rank 1's file of the newest checkpoint; rank 0's is intact)
        with open(os.path.join(step_dir, "rank00001.pt"), "r+b") as f:
            f.seek(100)
            f.write(b"garbage")
    torch.distributed.barrier()
    fresh = tiertrain.wrap(make_model(seed=7), cfg, tiertrain.Topology.build(cfg.parallel))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fresh.load_checkpoint(directory)
    return fresh.steps, [str(w.message) for w in caught if "falling back" in str(w.message)]


@pytest.mark.timeout(60)
def test_every_rank_falls_back_together_when_one_rank_file_of_the_newest_is_corrupt(tmp_path):
    """Each rank used to take "the newest committed checkpoint" on its own and verify only its
    own file: rank 0 loaded step 2 while rank 1 failed on its corrupt file (or, with a commit
    between their look-ups, the ranks loaded different steps). Rank 0 now picks, every rank
    verifies its file, and all move to the newest checkpoint intact on every rank."""
    results = run_distributed(_resume_when_the_newest_is_corrupt_on_one_rank, 2, str(tmp_path), timeout=50)
    assert [steps for steps, _ in results] == [1, 1]
    for _, warned in results:
        assert len(warned) == 1 and "rank 1:" in warned[0] and "rank00001.pt" in warned[0] and "step 1" in warned[0]


# -- one job per checkpoint directory (issue 32, item 3) ------------------------------------

def test_a_second_job_in_a_checkpoint_directory_is_refused_naming_the_first(tmp_path):
    """Two jobs given one checkpoint directory used to break each other: the second resumed the
    first's run, and each deleted the other's half-written steps. The directory is now locked by
    the job that uses it (its rank 0, for as long as its process lives): another job's save or
    load is an error naming the holder's host and pid. A lock dies with its process."""
    from tiertrain.testing import another_job_holding

    cfg = make_config()
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    with another_job_holding(str(tmp_path)) as pid:
        named = rf"checkpoint directory .* is in use by another job \(host .*, pid {pid}, since"
        with pytest.raises(CheckpointError, match=named):
            engine.save_checkpoint(str(tmp_path))
        with pytest.raises(CheckpointError, match=named):
            engine.load_checkpoint(str(tmp_path))
        assert committed_steps(str(tmp_path)) == []
    engine.save_checkpoint(str(tmp_path))  # (the holder is gone, and its lock with it)
    assert committed_steps(str(tmp_path)) == [0]


def test_a_disk_full_during_a_save_names_the_file_and_the_free_space(tmp_path, monkeypatch):
    """torch.save reports a full disk as "[enforce fail at inline_container.cc:672] . unexpected
    pos": a raw traceback naming neither the file nor the disk (issue 32, item 9). The save now
    fails on every rank with the file, torch's words and the bytes free, and commits nothing."""
    import tiertrain.state.checkpoint as checkpoint_module

    cfg = make_config()
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))

    def full(state, f):
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 4736 vs 4630")
    monkeypatch.setattr(checkpoint_module.torch, "save", full)
    with pytest.raises(CheckpointError, match=r"writing '.*rank00000\.pt' failed \(\[enforce fail at "
                                              r"inline_container\.cc:672\] \. unexpected pos.*\); \d+ bytes free"):
        engine.save_checkpoint(str(tmp_path))
    assert committed_steps(str(tmp_path)) == []
