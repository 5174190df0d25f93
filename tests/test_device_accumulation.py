"""Gradient accumulation on the device at ZeRO stages 2-3 (zero.accumulate_on_device;
tiertrain/zero/accumulation.py, the reducer's ``accumulate``): each unit's gradient accumulates
over the micro-batches in a full fp32 device buffer and is reduce-scattered into its shard (and
so copied to the CPU tier) once per step, at the boundary's backward, instead of once per
micro-batch (ZeRO §5.2 with ZeRO-Offload §4's gradient offload). The runs match the
single-process reference within the float64 oracle's bound (fp32) or bf16's tolerance of it, as
tests/test_engine.py's runs of those stages; the reduction is counted through a reducer
subscription; the run plan says what it decided and why; the estimator counts the buffers."""
from __future__ import annotations

import pytest
import torch

from reference import (Oracle, engine_train, fp32_parameters, global_batches, make_config, make_model, max_rel_diff,
                       mean_over_ranks, reference_train)
from tiertrain.config import ConfigError
from tiertrain.testing import run_distributed

STEPS = 3
MICRO = 2
ACCUM = 4


def _config(stage, opt, dtype="fp32", setting="on", accum=ACCUM):
    params = opt if stage == 3 else "none"  # (stage 3 with the optimizer on the CPU tier: parameters too)
    return make_config(zero={"stage": stage, "offload_optimizer": opt, "offload_params": params, "bucket_mb": 0.02,
                             "accumulate_on_device": setting},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": accum}, precision={"dtype": dtype},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _train(rank, world, stage, opt, dtype, setting, accum=ACCUM):
    """(losses, parameters, reductions landed per step, trained units, the plan's line, bytes the
    reducer's buckets hold between two micro-batches of a step, the plan's accumulator bytes)."""
    import tiertrain

    cfg = _config(stage, opt, dtype, setting, accum)
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    landed: list[int] = []
    subscription = engine.reducer.subscribe(reduced=landed.append)
    from reference import rank_slices
    losses, per_step, between = [], [], None
    for batch in global_batches(STEPS, MICRO * accum * world):
        total = 0.0
        for j, micro in enumerate(rank_slices(batch, rank, world, MICRO, accum)):
            loss = engine(micro)
            engine.backward(loss)
            total += float(loss)
            if j == 0 and between is None:
                between = engine.reducer.bucket_bytes
        engine.step()
        losses.append(total / accum)
        per_step.append(len(landed))
        landed.clear()
    subscription.remove()
    losses = mean_over_ranks(losses, world)
    params = fp32_parameters(engine)
    units = len(engine.flat.units)
    line, planned = engine.plan.describe(), engine.plan.accumulation.device_bytes
    engine.close()
    return losses, params, per_step, units, line, between, planned


def _check(stage, opt, world, dtype):
    losses, params, per_step, units, line, between, planned = run_distributed(
        _train, world, stage, opt, dtype, "on", timeout=80)[0]
    what = f"stage {stage}, optimizer {opt}, {world} rank(s), {dtype}, accumulation {ACCUM} on the device"
    assert "accumulate on the device" in line, line
    assert per_step == [units] * STEPS, f"{what}: reductions per step {per_step}, expected {units} (one per unit)"
    assert between == planned > 0, f"{what}: {between} bytes of buckets kept between micro-batches, planned {planned}"
    batches = global_batches(STEPS, MICRO * ACCUM * world)
    if dtype == "fp32":
        oracle = Oracle.run(reference_train, make_model(), _config(stage, opt), batches)
        oracle.check(losses, params, what)
        return
    ref_losses, ref_params = reference_train(make_model(), _config(stage, opt), batches)
    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    assert loss_err <= 1e-3, f"{what}: loss differs by {loss_err:.2e}"  # (tests/test_engine.py's bf16 bounds)
    param_err = max_rel_diff(params, ref_params)
    assert param_err <= 4e-2, f"{what}: parameters differ by {param_err:.2e}"


FAST = [(2, "cpu", 2, "fp32"), (3, "cpu", 2, "fp32"), (3, "none", 2, "bf16"), (2, "none", 1, "bf16")]
SLOW = [(s, o, w, d) for s in (2, 3) for o in ("cpu", "none") for w in (1, 2) for d in ("fp32", "bf16")
        if (s, o, w, d) not in FAST]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage,opt,world,dtype", FAST + [pytest.param(*c, marks=pytest.mark.slow) for c in SLOW])
def test_device_accumulation_matches_reference_and_reduces_once_per_step(stage, opt, world, dtype):
    _check(stage, opt, world, dtype)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_without_it_every_micro_batch_is_reduced(stage):
    """The counter sees the difference: off, every unit lands once per micro-batch; with one
    micro-batch per step, on changes nothing (it is not chosen)."""
    _, _, per_step, units, line, between, _ = run_distributed(_train, 2, stage, "cpu", "fp32", "off", timeout=80)[0]
    assert per_step == [units * ACCUM] * STEPS and between == 0
    assert "reduced every micro-batch (zero.accumulate_on_device=off)" in line
    _, _, per_step, units, line, between, _ = run_distributed(_train, 2, stage, "cpu", "fp32", "on", 1, timeout=80)[0]
    assert per_step == [units] * STEPS and between == 0
    assert "gradient accumulation: one micro-batch per step, nothing to accumulate" in line


# -- the decision ------------------------------------------------------------------------------

def _plan(config):
    from tiertrain.run_plan import resolve_run_plan
    from tiertrain.zero.plan import default_plan

    return resolve_run_plan(config, None, default_plan(make_model(), config, 1), dp_rank=0, tp_rank=0, tp_size=1)


def test_run_plan_records_the_decision_and_its_reason():
    from tiertrain.zero.accumulation import accumulator_bytes
    from tiertrain.zero.plan import default_plan

    cfg = _config(2, "cpu")
    plan = _plan(cfg)
    expected = accumulator_bytes(u.padded_numel for u in default_plan(make_model(), cfg, 1).layout.units)
    assert plan.accumulation.on and plan.accumulation.device_bytes == expected
    assert "zero.accumulate_on_device=on" in plan.accumulation.reason and plan.accumulation.reason in plan.describe()
    off = _plan(_config(3, "cpu", setting="off")).accumulation
    assert not off.on and off.reason == "zero.accumulate_on_device=off" and off.device_bytes == 0 and off.applies
    # auto keeps today's path on a CPU-only host (also under the emulated GPU host, whose free
    # device memory is unknown)
    auto = _plan(_config(2, "cpu", setting="auto")).accumulation
    assert not auto.on and auto.reason.startswith("auto: ")
    single = _plan(_config(2, "cpu", accum=1))
    assert "nothing to accumulate" in single.accumulation.reason and not single.accumulation.applies
    assert "gradient accumulation: one micro-batch per step" in single.describe()
    assert "stage 1 keeps whole gradients" in _plan(make_config(
        zero={"stage": 1, "accumulate_on_device": "on"}, batch={"grad_accum_steps": 4})).accumulation.reason


def test_auto_accumulates_on_the_device_when_the_buffers_fit():
    from tiertrain.zero.accumulation import AUTO_SHARE, decide

    def auto(**kw):
        args = dict(stage=2, accum=8, launch_when_ready=True, extra_bytes=4 << 30, accelerator=True,
                    free_device_bytes=lambda: 40 << 30)
        return decide("auto", **{**args, **kw})
    assert auto().on and auto().device_bytes == 4 << 30 and "fit in 0.5 of the 40960.0 MiB free" in auto().reason
    at_limit = int((4 << 30) / AUTO_SHARE)
    assert auto(free_device_bytes=lambda: at_limit).on and not auto(free_device_bytes=lambda: at_limit - 1).on
    assert "exceed" in auto(free_device_bytes=lambda: at_limit - 1).reason
    assert not auto(accelerator=False).on and "no accelerator" in auto(accelerator=False).reason
    assert not auto(free_device_bytes=lambda: None).on
    asked = []  # the free memory (a collective across the group) is asked only where auto needs it
    for kw in (dict(accelerator=False), dict(stage=1), dict(accum=1), dict(launch_when_ready=False)):
        auto(free_device_bytes=lambda: asked.append(kw) or 0, **kw)
    assert asked == []
    assert not auto(launch_when_ready=False).on and "pipeline" in auto(launch_when_ready=False).reason
    assert not auto(stage=3, accum=1).on


@pytest.mark.parametrize("stage", [2, 3])
def test_memory_report_counts_the_device_accumulators(stage):
    """engine.memory_report()'s gradients include the accumulators the plan holds (device
    memory, not the CPU tier), in place of the CPU tier's landing buffers that the path
    without them keeps on an accelerator host (none on a CPU-only host)."""
    import tiertrain

    reports = {}
    for setting in ("on", "off"):
        cfg = _config(stage, "cpu", setting=setting)
        engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
        reports[setting] = (engine.memory_report(), engine.reducer.landing_bytes, engine.plan.accumulation.device_bytes)
        engine.close()
    (on, on_landing, planned), (off, off_landing, _) = reports["on"], reports["off"]
    assert planned > 0 and on_landing == 0
    assert on.grads - planned == off.grads - off_landing
    assert on.cpu_tier == off.cpu_tier - off_landing


def test_a_bad_setting_is_refused_naming_the_valid_ones():
    with pytest.raises(ConfigError, match=r"zero\.accumulate_on_device='sometimes' is invalid: expected one of "
                                          r"'auto', 'on', 'off'"):
        make_config(zero={"stage": 2, "accumulate_on_device": "sometimes"})
    from tiertrain.config import ZeroConfig
    with pytest.raises(ConfigError, match=r"zero\.accumulate_on_device=3 is invalid"):
        ZeroConfig(stage=2, accumulate_on_device=3).validate()
    # YAML 1.1 reads an unquoted on/off as true/false: they mean on/off
    assert make_config(zero={"stage": 2, "accumulate_on_device": True}).zero.accumulate_on_device == "on"
    assert make_config(zero={"stage": 2, "accumulate_on_device": False}).zero.accumulate_on_device == "off"


# -- the estimator -----------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [2, 3])
def test_estimator_counts_the_device_accumulators(stage):
    """4 bytes per padded element of every trained unit, on the device, only when on."""
    from tiertrain.estimate import estimate
    from tiertrain.estimate.layout import ZeroLayout
    from tiertrain.estimate.units import engine_units

    model = make_model()
    name = "gradient accumulators (accumulate_on_device)"
    on = estimate(model, ZeroLayout(dp=2, stage=stage, accumulate_on_device=True, bucket_mb=0.02))
    off = estimate(model, ZeroLayout(dp=2, stage=stage, bucket_mb=0.02))
    units = engine_units(model, stage, 2, 0.02, 0).units
    line = on.line(name)
    assert line.bytes == 4 * sum(u.padded_numel for u in units) and line.tier == "device"
    assert name not in [x.name for x in off.lines]
    assert on.total("device") == off.total("device") + line.bytes
    # the layout of a config: on as decided (auto stays off without an accelerator)
    cfg = _config(stage, "cpu")
    assert ZeroLayout.from_config(cfg, 2).accumulate_on_device
    assert not ZeroLayout.from_config(_config(stage, "cpu", setting="auto"), 2).accumulate_on_device
    assert not ZeroLayout.from_config(_config(stage, "cpu", accum=1), 2).accumulate_on_device


def _auto_with_free_memory(rank, world, free_by_rank):
    """auto on a pretended accelerator whose free memory differs by rank: the ranks decide from
    the least (one all-reduce), so they issue the same collectives."""
    import tiertrain
    import tiertrain.run_plan as run_plan
    import tiertrain.zero.accumulation as accumulation

    run_plan.acts_as_accelerator = lambda device: True
    accumulation.free_memory = lambda device: free_by_rank[rank]
    cfg = _config(2, "cpu", setting="auto")
    losses, _, engine = engine_train(rank, world, make_model(), cfg, global_batches(1, MICRO * ACCUM * world))
    return engine.plan.accumulation.on, engine.plan.accumulation.reason


@pytest.mark.timeout(60)
def test_auto_decides_alike_on_every_rank_from_the_least_free_memory():
    plenty, little = 1 << 40, 1 << 16  # (the buffers: 0.1 MiB)
    decisions = run_distributed(_auto_with_free_memory, 2, [plenty, little], timeout=50)
    assert [on for on, _ in decisions] == [False, False]
    assert all("exceed 0.5 of the 0.1 MiB free" in reason for _, reason in decisions)
    decisions = run_distributed(_auto_with_free_memory, 2, [plenty, 2 * plenty], timeout=50)
    assert [on for on, _ in decisions] == [True, True]
    assert all(f"of the {plenty / 2**20:.1f} MiB free" in reason for _, reason in decisions)
