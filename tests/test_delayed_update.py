"""ZeRO-Offload's one-step delayed parameter update (``zero.delayed_update``,
tiertrain/update/delayed.py) against a plain PyTorch form of the same schedule.

The reference (:func:`reference_delayed`): one process, the whole global batch per step,
torch AdamW. Steps t < warmup are ordinary; from step `warmup` on, the gradients of step t
are held back and applied (clipped by their own norm, at the schedule's next rate) only
after step t+1's forward and backward, so step t+1's gradients are computed at parameters
that lack the update from step t's. What is held back after the last step is applied at
the end (the engine's flush). Tolerances are test_engine.py's: fp32 within the float64
oracle's bound (tests/reference.py) with AdamW eps=1e-3 (test_engine's docstring says why),
bf16 its bf16 bounds.
"""
from __future__ import annotations

import copy
import threading

import pytest
import torch
from reference import (
    Oracle,
    engine_train,
    global_batches,
    make_config,
    make_model,
    max_rel_diff,
    rank_slices,
    reference_train,
)

import tiertrain
from tiertrain.config import ConfigError, from_dict
from tiertrain.engine_contract import default_loss
from tiertrain.optim import build_adamw, build_schedule, param_groups
from tiertrain.testing import run_distributed

STEPS, MICRO, WARMUP = 5, 2, 1
EXACT_OPT = {"eps": 1e-3, "lr": 1e-2}


def reference_delayed(model, config, batches, warmup):
    """Plain PyTorch with the one-step-stale schedule; returns (losses, final parameters)."""
    model = copy.deepcopy(model)
    params = list(model.parameters())
    opt = build_adamw(param_groups(model.named_parameters(), config.optimizer), config.optimizer)
    sched = build_schedule(opt, config.schedule)

    def apply(grads):
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        sched.step()
        for p in params:
            p.grad = None

    losses, held = [], None
    for t, batch in enumerate(batches):
        loss = default_loss(model, batch)  # at parameters lacking the held-back update, if any
        loss.backward()
        if config.optimizer.grad_clip > 0:  # the norm of the gradients that will be applied
            torch.nn.utils.clip_grad_norm_(params, config.optimizer.grad_clip)
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        if held is not None:
            apply(held)
            held = None
        if t < warmup:
            apply(grads)
        else:
            held = grads
        losses.append(loss.item())
    if held is not None:
        apply(held)
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _config(stage, accum, clip, dtype="fp32", delayed=True, warmup=WARMUP, params="none", **zero):
    return make_config(zero={"stage": stage, "bucket_mb": 0.02, "offload_optimizer": "cpu",
                             "offload_params": params, "delayed_update": delayed,
                             "delayed_update_warmup": warmup, **zero},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": accum},
                       precision={"dtype": dtype}, optimizer={**EXACT_OPT, "grad_clip": clip})


# (accum, clip, dtype, offload_params): accumulation, clipping (0.05 is below these runs'
# gradient norm, so it really scales), bf16, and at stage 3 the parameter shards on the CPU
# tier too (where the fp32 master is otherwise the shard the forward reads).
VARIANTS = {2: [(1, 0.0, "fp32", "none"), (2, 0.05, "fp32", "none"), (2, 0.05, "bf16", "none")],
            3: [(1, 0.0, "fp32", "cpu"), (2, 0.05, "fp32", "none"), (2, 0.05, "bf16", "cpu")]}


def _delayed_runs(rank, world, stage):
    out = []
    for accum, clip, dtype, params in VARIANTS[stage]:
        cfg = _config(stage, accum, clip, dtype, params=params)
        losses, final, engine = engine_train(rank, world, make_model(), cfg,
                                             global_batches(STEPS, MICRO * accum * world))
        out.append((losses, final, engine.update.overlapped_steps, engine.memory_report()))
    # warmup >= steps: every update synchronous, bit-identical to the engine without DPU
    sync = [engine_train(rank, world, make_model(), _config(stage, 2, 0.05, delayed=d, warmup=STEPS),
                         global_batches(STEPS, MICRO * 2 * world))[:2] for d in (True, False)]
    return out, sync


def _compiled_pass_runs(rank, world, variants):
    from tiertrain.update import host_adamw

    host_adamw.SMALL_PIECE = 0  # (every piece takes the pass: the tiny GPT's are far below the default)
    out = []
    for stage, accum, clip, dtype, params in variants:
        cfg = _config(stage, accum, clip, dtype, params=params)
        batches = global_batches(STEPS, MICRO * accum * world)
        losses, final, engine = engine_train(rank, world, make_model(), cfg, batches)
        out.append((losses, final, engine.update.host_pass is not None, engine.update.overlapped_steps))
        engine.close()
    return out


def test_optimizer_impl_compiled_is_the_delayed_updates_pass_and_refused_with_the_nvme_optimizer():
    cfg = make_config(zero={"stage": 2, "offload_optimizer": "cpu", "delayed_update": True},
                      optimizer={"impl": "compiled"})
    assert cfg.optimizer.impl == "compiled" and cfg.zero.delayed_update
    with pytest.raises(ConfigError, match=r"optimizer.impl='compiled' is not used with zero.offload_optimizer="
                                          r"'nvme' \(the NVMe optimizer streams its own chunks\)"):
        make_config(zero={"stage": 2, "offload_optimizer": "nvme", "nvme_path": "/unused"},
                    optimizer={"impl": "compiled"})


@pytest.mark.timeout(60)
def test_on_the_cpu_tier_the_delayed_update_is_the_compiled_pass_into_its_staging():
    """optimizer.impl auto takes the compiled CPU-tier pass for the delayed update too: the clip
    factor, AdamW and the cast into the staging buffers the next publish copies, in one pass on
    the worker thread (the gradient snapshots swapped in at stage 2, copied at stage 3 whose
    CPU-tier parameters the engine keeps views of)."""
    variants = [(2, 2, 0.05, "fp32", "none"), (2, 1, 0.05, "bf16", "none"), (3, 2, 0.05, "bf16", "cpu")]
    world = 2
    out = run_distributed(_compiled_pass_runs, world, variants, timeout=50)[0]
    for (stage, accum, clip, dtype, params), (losses, final, pass_used, overlapped) in zip(variants, out):
        what = f"stage {stage} {dtype} accum={accum} params={params}"
        assert pass_used and overlapped == STEPS - WARMUP, what
        batches = global_batches(STEPS, MICRO * accum * world)
        oracle = Oracle.run(reference_delayed, make_model(), _config(stage, accum, clip), batches, WARMUP)
        if dtype == "fp32":
            oracle.check(losses, final, what)
        else:
            loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, oracle.losses32))
            assert loss_err <= 1e-3, f"{what}: losses differ by {loss_err:.2e}"
            assert max_rel_diff(final, oracle.params32) <= 4e-2, what


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [2, 3])
def test_matches_one_step_stale_reference(stage):
    world = 2
    out, ((sync_losses, sync_params), (plain_losses, plain_params)) = run_distributed(
        _delayed_runs, world, stage, timeout=50)[0]
    for (accum, clip, dtype, params), (losses, final, overlapped, mem) in zip(VARIANTS[stage], out):
        batches = global_batches(STEPS, MICRO * accum * world)
        cfg = _config(stage, accum, clip)
        oracle = Oracle.run(reference_delayed, make_model(), cfg, batches, WARMUP)
        ref_losses, ref_params = oracle.losses32, oracle.params32
        _, sync_ref = reference_train(make_model(), cfg, batches)
        # The reference is really stale: it ends far from the synchronous run.
        assert max_rel_diff(ref_params, sync_ref) > 1e-3
        assert overlapped == STEPS - WARMUP
        what = f"stage {stage} {dtype} accum={accum} clip={clip} params={params}"
        if dtype == "fp32":
            oracle.check(losses, final, what)
        else:  # bf16 compute, fp32 masters: test_engine's bounds for bf16 against fp32
            loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            param_err = max_rel_diff(final, ref_params)
            assert loss_err <= 1e-3, f"{what}: losses differ by {loss_err:.2e}"
            assert param_err <= 4e-2, f"{what}: parameters differ by {param_err:.2e}"
        # The snapshot the background update reads: one more fp32 gradient shard, on the CPU tier.
        in_cpu = mem.grads + mem.optimizer + (mem.params if params == "cpu" else 0)
        assert mem.cpu_tier == in_cpu
    assert sync_losses == plain_losses
    assert all(torch.equal(sync_params[k], plain_params[k]) for k in plain_params)


def _memory(rank, world):
    reports = []
    for delayed in (False, True):
        cfg = _config(2, 1, 0.0, delayed=delayed)
        reports.append(engine_train(rank, world, make_model(), cfg, global_batches(1, MICRO * world))[2]
                       .memory_report())
    return reports


@pytest.mark.timeout(60)
def test_memory_report_counts_the_gradient_snapshot():
    plain, delayed = run_distributed(_memory, 2, timeout=50)[0]
    assert delayed.grads == 2 * plain.grads
    assert delayed.optimizer == plain.optimizer and delayed.params == plain.params
    assert delayed.cpu_tier == plain.cpu_tier + plain.grads


def test_update_runs_in_the_background_and_flushes_see_it():
    """One process: step() returns while the update is still running (it waits for a signal
    only the main thread gives after step() returned); masters(), full_state_dict() and
    gathered_parameters() then wait for it; close() finishes it."""
    cfg = _config(2, 1, 0.05, warmup=0)
    batches = global_batches(3, MICRO)
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    ran_on, released = [], threading.Event()
    original = engine.update._update

    def slow_step():
        ran_on.append(threading.current_thread().name)
        assert released.wait(10), "the main thread never got past step(): the update was not in the background"
        released.clear()
        original()

    engine.update._update = slow_step
    oracle = Oracle.run(reference_delayed, make_model(), cfg, batches, warmup=0)
    losses = []
    for i, batch in enumerate(batches):
        losses.append(engine.train_batch(iter([batch])))
        assert engine.update.in_flight
        released.set()
    oracle.check(losses, None, "delayed update in the background")
    masters = engine.masters()  # waits
    assert len(ran_on) == 3 and all(name.startswith("tiertrain-delayed-update") for name in ran_on)
    assert not engine.update.in_flight and engine.update.unpublished
    oracle.check(None, engine.full_state_dict(), "delayed update, flushed masters")
    assert all(m is u.master for m, u in zip(masters, engine.flat.units))
    with engine.gathered_parameters():  # publishes: the model's own parameters are the newest
        live = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    assert not engine.update.unpublished
    oracle.check(None, live, "delayed update, published parameters")
    engine.train_batch(iter([batches[0]]))
    released.set()
    engine.close()
    assert not engine.update.in_flight


# -- checkpoints ----------------------------------------------------------------------------

RESUME_STEPS, SPLIT = 6, 3


def _train(rank, world, stage, directory, mode):
    """mode: 'save' trains all steps saving after SPLIT, 'plain' the same without saving,
    'resume' starts from a differently seeded model and loads the checkpoint."""
    cfg = _config(stage, 2, 0.05, dtype="bf16", warmup=1, params="cpu" if stage == 3 else "none")
    engine = tiertrain.wrap(make_model(seed=5 if mode == "resume" else 0), cfg,
                            tiertrain.Topology.build(cfg.parallel))
    batches = global_batches(RESUME_STEPS, 2 * 2 * world)
    start = engine.load_checkpoint(directory)["next_batch"] if mode == "resume" else 0
    losses = []
    for i in range(start, RESUME_STEPS):
        losses.append(engine.train_batch(rank_slices(batches[i], rank, world, 2, 2)))
        if mode == "save" and i + 1 == SPLIT:
            assert engine.update.in_flight  # the save catches an update in flight
            engine.save_checkpoint(directory, extra={"next_batch": i + 1})
    return losses, engine.full_state_dict()


def _save_and_plain(rank, world, stage, directory):
    return [_train(rank, world, stage, directory, mode) for mode in ("save", "plain")]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [2, 3])
def test_resume_with_delayed_update_is_bit_identical(tmp_path, stage):
    (saved_losses, saved_params), (plain_losses, plain_params) = run_distributed(
        _save_and_plain, 2, stage, str(tmp_path), timeout=40)[0]
    # Saving waits for the update in flight but does not publish it: the run is unperturbed.
    assert saved_losses == plain_losses
    assert all(torch.equal(saved_params[k], plain_params[k]) for k in plain_params)
    resumed_losses, resumed_params = run_distributed(_train, 2, stage, str(tmp_path), "resume", timeout=40)[0]
    assert resumed_losses == plain_losses[SPLIT:]
    assert all(torch.equal(resumed_params[k], plain_params[k]) for k in plain_params)


# -- a failing update -------------------------------------------------------------------------

def _fault(rank, world, fail_rank, fail_update):
    from tiertrain.update.delayed import DelayedUpdateError

    cfg = _config(2, 1, 0.05, warmup=1)
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    original, calls = engine.update._update, [0]

    def step():
        calls[0] += 1
        if rank == fail_rank and calls[0] == fail_update + 1:
            raise RuntimeError("injected fault in the optimizer update")
        original()

    engine.update._update = step
    batches = global_batches(6, MICRO * world)
    for i, batch in enumerate(batches):
        try:
            engine.train_batch(rank_slices(batch, rank, world, MICRO, 1))
        except DelayedUpdateError as e:
            return i, str(e)
    return None, "no error"


@pytest.mark.timeout(60)
def test_a_failed_update_is_raised_at_the_next_step_on_every_rank():
    # Update 2 runs in the background during step 3's forward/backward; step 3's boundary reports it.
    results = run_distributed(_fault, 2, 1, 2, timeout=40)
    for step, message in results:
        assert step == 3, message
        assert "update of step 2" in message and "failed on rank 1" in message
        assert "RuntimeError: injected fault in the optimizer update" in message


# -- configuration ----------------------------------------------------------------------------

BAD = [
    ({"zero": {"stage": 2, "delayed_update": True}},
     r"zero\.delayed_update=True is invalid with zero\.offload_optimizer='none': expected offload_optimizer='cpu'"),
    ({"zero": {"stage": 2, "offload_optimizer": "nvme", "nvme_path": "/tmp/x", "delayed_update": True}},
     r"offload_optimizer='nvme': expected offload_optimizer='cpu' \(the NVMe optimizer writes"),
    ({"zero": {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True, "delayed_update_warmup": -1}},
     r"zero\.delayed_update_warmup=-1 is invalid: expected a value >= 0"),
    ({"zero": {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True, "offload": "auto"}},
     r"zero\.delayed_update=True is invalid with zero\.offload='auto'"),
    ({"zero": {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True}, "precision": {"dtype": "fp16"}},
     r"zero\.delayed_update=True is not supported with precision\.dtype='fp16'.*valid with fp32 or bf16"),
    ({"zero": {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True}, "parallel": {"pp": 2}},
     r"zero\.delayed_update=True is not supported with parallel\.pp=2.*parallel\.pp=1"),
]


@pytest.mark.parametrize("data,message", BAD)
def test_invalid_combinations_are_refused(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(tiertrain.Config, data).validate()


def test_default_is_off_and_warmup_is_a_few_tens():
    cfg = tiertrain.Config()
    assert cfg.zero.delayed_update is False and 10 <= cfg.zero.delayed_update_warmup <= 100
