"""The NVMe optimizer step overlapped with backward (tiertrain/update/nvme/overlapped_step.py): each
shard's chunks are updated once its gradient is declared final, on a worker thread, and the
result is the synchronous step bit for bit; a cancelled or failed step commits nothing and
gives the destinations their pre-step values back."""
from __future__ import annotations

import math
import os
import time

import pytest
import torch

from reference import make_config, make_model, global_batches, rank_slices
from test_nvme_optimizer import (CFG, CHUNK, LRS, PIECES, SIZES, T, Reference, _assert_same, _grads, _shards,
                                 swapper)  # noqa: F401 - the fixture
from tiertrain.io import SwapCorruptionError
from tiertrain.update.nvme import NVMeAdamW
from tiertrain.testing import run_distributed
from tiertrain.update.nvme.masters import ShardWriter

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]
ORDER = [4, 0, 5, 3, 1, 2]  # the order gradients become final (a backward visits units last-first)


def _wait_until(condition, what: str) -> None:
    deadline = time.monotonic() + T
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _chunks_of(opt: NVMeAdamW, shards) -> int:
    return len(opt._positions(set(shards)))


def test_overlapped_step_is_the_synchronous_step_bit_for_bit(swapper):
    shards = _shards()
    ref = Reference(shards)
    opt = NVMeAdamW(shards, PIECES, CFG, swapper, chunk_bytes=CHUNK, wait_timeout=T)
    outs = [torch.full((n,), math.nan) for n in SIZES]
    for k, lr in enumerate(LRS[:3]):
        grads = _grads(k)
        ref.step(grads, lr)
        live = [torch.full((n,), math.nan) for n in SIZES]  # gradients land after the step began
        step = opt.begin_step(live, lr, out=outs, shard_order=ORDER)
        for s in ORDER[:3]:
            live[s].copy_(grads[s])
            step.shard_ready(s)
        ready = _chunks_of(opt, ORDER[:3])
        _wait_until(lambda: step.chunks_done == ready, "the ready shards' chunks")
        _wait_until(step.stalled, "the worker to wait on a shard not ready")  # so it waits through the sleep
        time.sleep(0.05)
        assert step.chunks_done == ready  # nothing past a shard whose gradient is not final
        assert step.progress() == {"shards_ready": 3, "shards": 6, "chunks_done": ready, "chunks": opt.num_chunks}
        assert all(torch.equal(outs[s], ref.shards[s]) for s in ORDER[:3])  # published already
        for s in ORDER[3:]:
            live[s].copy_(grads[s])
        stats = step.finish()
        n = 12 * sum(SIZES)
        assert (stats.chunks, stats.bytes_read, stats.bytes_written) == (opt.num_chunks, n, n)
        assert stats.ready_wait_seconds >= 0.05 and stats.busy_seconds >= 0
        assert opt.step_count == k + 1
    _assert_same(opt, ref)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref.shards))
    opt.close()


def test_cancel_restores_what_was_published_and_commits_nothing(swapper):
    shards = _shards(2)
    ref = Reference(shards)
    opt = NVMeAdamW(shards, PIECES, CFG, swapper, chunk_bytes=CHUNK, wait_timeout=T)
    outs = [t.clone() for t in shards]
    ref.step(_grads(0), LRS[0])
    opt.step(_grads(0), LRS[0], out=outs)
    before = [o.clone() for o in outs]
    step = opt.begin_step(_grads(1), LRS[1], out=outs, shard_order=ORDER)
    step.shard_ready(ORDER[0])
    step.shard_ready(ORDER[1])
    published = _chunks_of(opt, ORDER[:2])
    _wait_until(lambda: step.chunks_done == published, "two shards' chunks")
    assert not torch.equal(outs[ORDER[0]], before[ORDER[0]])
    assert step.cancel() == published
    assert all(torch.equal(o, b) for o, b in zip(outs, before))
    assert opt.step_count == 1
    _assert_same(opt, ref)                        # the state on NVMe is step 1's
    ref.step(_grads(2), LRS[2])                   # and the next step starts from it
    opt.step(_grads(2), LRS[2], out=outs)
    _assert_same(opt, ref)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref.shards))
    opt.close()


def test_a_step_in_progress_blocks_other_passes_and_bad_input_is_refused(swapper, tmp_path):
    opt = NVMeAdamW(_shards(), PIECES, CFG, swapper, chunk_bytes=CHUNK, wait_timeout=T)
    with pytest.raises(ValueError, match=r"shard_order=\[0, 0, 1, 2, 3, 4\] is not a permutation of the 6 shards"):
        opt.begin_step(_grads(0), LRS[0], shard_order=[0, 0, 1, 2, 3, 4])
    step = opt.begin_step(_grads(0), LRS[0])
    for call in (lambda: opt.step(_grads(0), LRS[0]), opt.state_dict, opt.prefetch,
                 lambda: opt.begin_step(_grads(0), LRS[0])):
        with pytest.raises(RuntimeError, match="has step 1 in progress"):
            call()
    step.finish()
    with pytest.raises(RuntimeError, match="already ended"):
        step.cancel()
    assert opt.step_count == 1
    step = opt.begin_step(_grads(1), LRS[1])
    opt.close()                                    # cancels the step in progress
    assert step.progress()["chunks_done"] == 0


def test_in_place_overlapped_step_is_the_synchronous_step_and_a_late_cancel_leaves_it_unusable(tmp_path):
    """zero.nvme_in_place: one generation on disk. Overlapped, the step is the synchronous one
    bit for bit; a cancel before any chunk was updated changes nothing, one after cannot be undone
    (the pre-step state was overwritten), so the optimizer refuses further steps, saying why."""
    shards = _shards(4)
    ref = Reference(shards)
    opt = NVMeAdamW(shards, PIECES, CFG, swap_dir=tmp_path / "p", rank=0, chunk_bytes=CHUNK,
                    transactional=False, wait_timeout=T)
    outs = [t.clone() for t in shards]
    assert opt.begin_step(_grads(0), LRS[0], out=outs, shard_order=ORDER).cancel() == 0  # nothing ready yet
    for k in range(2):
        ref.step(_grads(k), LRS[k])
        step = opt.begin_step(_grads(k), LRS[k], out=outs, shard_order=ORDER)
        for s in ORDER:
            step.shard_ready(s)
        step.finish()
    _assert_same(opt, ref)
    assert all(torch.equal(o, r) for o, r in zip(outs, ref.shards))
    step = opt.begin_step(_grads(2), LRS[2], out=outs, shard_order=ORDER)
    step.shard_ready(ORDER[0])
    _wait_until(lambda: step.chunks_done > 0, "the first shard's chunks")
    assert step.cancel() == 0
    with pytest.raises(RuntimeError, match=r"unusable after a failure \(step 3 failed with StepCancelled: "
                                           r"step 3 was cancelled after \d+ chunk\(s\) were updated in place"):
        opt.step(_grads(2), LRS[2], out=outs)
    opt.close()


def test_io_failure_surfaces_at_finish_with_the_previous_state(swapper):
    shards = _shards(3)
    opt = NVMeAdamW(shards, PIECES, CFG, swapper, chunk_bytes=CHUNK, wait_timeout=T)
    outs = [t.clone() for t in shards]
    opt.step(_grads(0), LRS[0], out=outs)
    before = [o.clone() for o in outs]
    path = opt.files()[opt.num_chunks // 2]
    os.truncate(path, 100)
    step = opt.begin_step(_grads(1), LRS[1], out=outs)
    for s in range(len(SIZES)):
        step.shard_ready(s)
    with pytest.raises(SwapCorruptionError, match=f"short read from {path}") as e:
        step.finish()
    notes = "".join(e.value.__notes__)
    assert "not applied" in notes and "restored" in notes
    assert opt.step_count == 1
    assert all(torch.equal(o, b) for o, b in zip(outs, before))
    opt.close()


class _FakeFlat:
    """The part of FlatParameters a ShardWriter uses: two units on NVMe, whose store (shards)
    records what is written."""

    dtype = torch.float32

    def __init__(self):
        self.units = [type("U", (), {"unit": type("L", (), {"shard_numel": 6})(), "shard": None})()
                      for _ in range(2)]
        self.written: dict[int, torch.Tensor] = {}
        self.shards = self

    def on_nvme(self, index):
        return True

    def holds_masters(self, index):  # (shards with their own files, as with bf16 parameters)
        return False

    def forget_values(self):
        pass

    def write(self, index, shard, values):
        self.written[index] = values.clone()

    def wait_writes(self):
        pass


def test_shard_writer_writes_only_whole_units():
    """A unit cut short by a failed or cancelled step keeps its swap file (the pre-step shard),
    even when the restore republishes its chunks into the same staging tensor."""
    flat = _FakeFlat()
    with ShardWriter(flat) as writer:
        writer(0, 0, 4, torch.ones(4))
        writer(0, 4, 6, torch.ones(2))
        writer(1, 0, 3, torch.ones(3))        # moving on writes unit 0 (complete)
        writer(1, 0, 3, torch.zeros(3))       # a restore of the same chunk: still 3 of 6
    assert set(flat.written) == {0} and torch.equal(flat.written[0], torch.ones(6))


# ----------------------------------------------------------------------------- the engine
def _train_with_a_nan_step(rank, world, stage, nvme_path, overlap):
    """Three steps; the second's loss is NaN on rank 0, so every rank's reduced gradient is and
    the engine skips that step. Returns the losses, the final parameters and whether the
    overlapped step published the NaN update before step() cancelled it."""
    import tiertrain

    cfg = make_config(zero={"stage": stage, "offload_optimizer": "nvme", "offload_params": "nvme" if stage == 3
                            else "none", "nvme_path": nvme_path, "bucket_mb": 0.02, "overlap_nvme_step": overlap},
                      batch={"micro_batch_size": 2, "grad_accum_steps": 1}, optimizer={"grad_clip": 0.0})
    topology = tiertrain.Topology.build(cfg.parallel)
    engine = tiertrain.wrap(make_model(), cfg, topology)
    losses, published_nan = [], False
    for k, batch in enumerate(global_batches(3, 4)):
        micro = next(rank_slices(batch, rank, world, 2, 1))
        loss = engine(micro)
        engine.backward(loss * float("nan") if (k == 1 and rank == 0) else loss)
        if k == 1 and overlap:
            engine.reducer.wait()               # every shard ready: let the worker publish it all
            step = engine.update.in_flight
            _wait_until(lambda: step.chunks_done == step.progress()["chunks"], "the NaN update")
            published_nan = True
        stepped = engine.step()
        assert stepped == (k != 1)
        losses.append(float(loss))
    return losses, engine.full_state_dict(), published_nan


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_skipped_step_undoes_the_update_published_during_backward(tmp_path, stage):
    runs = {overlap: run_distributed(_train_with_a_nan_step, 2, stage, str(tmp_path / f"swap{overlap}"), overlap,
                                     timeout=60)[0] for overlap in (False, True)}
    (sync_losses, sync_params, _), (losses, params, published_nan) = runs[False], runs[True]
    assert published_nan
    assert all(math.isfinite(x) for i, x in enumerate(losses) if i != 1)
    assert [x for i, x in enumerate(losses) if i != 1] == [x for i, x in enumerate(sync_losses) if i != 1]
    assert all(torch.equal(params[k], sync_params[k]) for k in params)


def _train_in_place(rank, world, nvme_path, in_place, grads_in_ram_mb=0.0, hf_llama=False):
    """Three steps at stage 3 with parameters and optimizer on NVMe; returns what the tests
    compare, by name."""
    import tiertrain

    cfg = make_config(zero={"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": nvme_path,
                            "bucket_mb": 0.02, "nvme_in_place": in_place, "nvme_grads_in_ram_mb": grads_in_ram_mb},
                      batch={"micro_batch_size": 2, "grad_accum_steps": 1}, optimizer={"grad_clip": 0.0})
    if hf_llama:  # a Hugging Face architecture (GQA, rotary), not our GPT
        from hf_pipeline_models import llama
        model = llama()
    else:
        model = make_model()
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    losses = []
    for batch in global_batches(3, 4):
        if hf_llama:  # (a Hugging Face causal LM shifts its labels itself)
            batch = {"input_ids": batch["input_ids"], "labels": batch["input_ids"]}
        loss = engine(next(rank_slices(batch, rank, world, 2, 1)))
        engine.backward(loss)
        assert engine.step()
        losses.append(loss.item())
    nvme = engine.update.nvme
    shard_bytes = [u.grad.numel() * 4 for u in engine.flat.units]
    return {"losses": losses, "params": engine.full_state_dict(), "disk_bytes": nvme.disk_bytes,
            "state_bytes": nvme.state_bytes, "overlapped": engine.last_overlapped_step,
            "released": [u.grad_released for u in engine.flat.units], "grad_norm": engine.last_grad_norm,
            "peak_held_bytes": engine.update.peak_held_bytes, "largest_grad_shard": max(shard_bytes),
            "all_grad_shards": sum(shard_bytes)}


@pytest.mark.timeout(90)
def test_in_place_nvme_optimizer_trains_the_same_with_half_the_disk_and_releases_consumed_gradients(tmp_path):
    """zero.nvme_in_place: the same losses, parameters and gradient norm as two generations, on
    half the disk; and each unit's gradient shard gives its memory back once the step running
    in backward has consumed it (the two-generation step keeps them, to redo a cancelled step)."""
    two_gens, in_place = (run_distributed(_train_in_place, 2, str(tmp_path / f"swap{flag}"), flag, timeout=60)[0]
                          for flag in (False, True))
    assert two_gens["losses"] == in_place["losses"]
    assert all(torch.equal(two_gens["params"][k], in_place["params"][k]) for k in two_gens["params"])
    # one generation of 12 B/param
    assert in_place["disk_bytes"] * 2 == two_gens["disk_bytes"] and in_place["disk_bytes"] >= in_place["state_bytes"]
    assert in_place["overlapped"] is not None  # the step ran overlapped with backward, in place too
    assert all(in_place["released"]) and not any(two_gens["released"])
    # the global norm, from squares taken as each reduction landed
    assert in_place["grad_norm"] == two_gens["grad_norm"]


@pytest.mark.timeout(90)
def test_a_cap_on_gradients_held_for_the_in_place_step_bounds_them_and_changes_nothing(tmp_path):
    """zero.nvme_grads_in_ram_mb: a reduction that would hold more reduced gradient shards than
    the cap waits until the step running in backward has consumed (and freed) earlier ones. The
    cap here is below one unit's shard, so at most one more than the cap is held at once."""
    free, capped = (run_distributed(_train_in_place, 2, str(tmp_path / f"swap{cap}"), True, cap, timeout=60)[0]
                    for cap in (0.0, 1e-6))
    assert capped["losses"] == free["losses"] and capped["grad_norm"] == free["grad_norm"]
    assert all(torch.equal(free["params"][k], capped["params"][k]) for k in free["params"])
    # the cap (1 byte) and the unit whose reduction landed
    assert capped["peak_held_bytes"] <= 1 + capped["largest_grad_shard"]
    assert free["peak_held_bytes"] <= free["all_grad_shards"]


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_in_place_step_with_capped_gradients_trains_a_hugging_face_llama_as_the_transactional_step(tmp_path):
    """The same on a transformers Llama (GQA, rotary) built from a small config: in place with
    the gradients capped at one unit, the losses, parameters and norm are those of the
    two-generation step, the consumed gradients are freed, and at most one shard over the cap
    is held."""
    pytest.importorskip("transformers")
    two_gens, capped = (run_distributed(_train_in_place, 2, str(tmp_path / f"swap{flag}"), flag, 1e-6 if flag else 0.0,
                                        True, timeout=60)[0] for flag in (False, True))
    assert capped["losses"] == two_gens["losses"] and capped["grad_norm"] == two_gens["grad_norm"]
    assert all(torch.equal(two_gens["params"][k], capped["params"][k]) for k in two_gens["params"])
    assert all(capped["released"]) and not any(two_gens["released"])
    assert capped["peak_held_bytes"] <= 1 + capped["largest_grad_shard"]
