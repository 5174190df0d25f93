"""The gradient copy overlapped with backward (issue 36 item 3; ZeRO-Offload §4's gradient
offload; tiertrain/zero/reducer.py's ``defer_landing``): at stages 2-3 with the optimizer on the
CPU tier and gradients reduced every micro-batch (zero.accumulate_on_device off), a micro-batch
that is not the accumulation boundary copies each reduced shard to its unit's host landing
buffer without the host waiting; the host waits only when that buffer is reused (the unit's
next landing) or before the step reads the gradients.

The runs are on the emulated GPU host (pinned landing buffers) under the deferred-copy harness
(TIERTRAIN_DEFER_COPIES=1: a landing buffer read before its copy is waited holds NaN): the
results are bit-identical to the same engine landing every reduction at once (the behaviour
before, ``reducer.defer_landing = False``) and equal the single-process reference within the
float64 oracle's bound; a spy on the copies' host waits shows that none inside a non-boundary
backward waits for a copy issued in that backward."""
from __future__ import annotations

import os

import pytest
import torch

from reference import (Oracle, fp32_parameters, global_batches, make_config, make_model, mean_over_ranks, rank_slices,
                       reference_train)
from tiertrain.testing import run_distributed

STEPS = 2
MICRO = 2
ACCUM = 4


def _config(stage: int, accum: int = ACCUM):
    params = "cpu" if stage == 3 else "none"
    return make_config(zero={"stage": stage, "offload_optimizer": "cpu", "offload_params": params, "bucket_mb": 0.02,
                             "accumulate_on_device": "off"},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": accum},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _train(rank, world, stage, deferred, accum=ACCUM):
    """(losses, parameters, the landing copies' host waits inside backward as (micro-batch of
    the wait, micro-batch the copy was issued in), ``reduced`` hooks per step, units, the
    memory report's landing bytes, whether landing was deferred)."""
    from tiertrain.device import DEFER_COPIES_ENV, GPU_HOST_ENV, Copy, Transfer

    # (In the worker: the launcher's forkserver keeps the environment it started with.)
    os.environ[GPU_HOST_ENV] = "1"
    os.environ[DEFER_COPIES_ENV] = "1"
    import tiertrain

    cfg = _config(stage, accum)
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    switch = engine.reducer.defer_landing
    engine.reducer.defer_landing = deferred and switch
    landing_bytes = engine.memory_report().cpu_tier
    phase = {"micro": None}  # the micro-batch whose backward runs now (None: outside backward)
    issued: dict[int, int | None] = {}
    waits: list[tuple[int, int | None]] = []
    streams = engine.flat.streams
    copy = streams.copy

    def spy_copy(dst, src, kind, stream=None):
        transfer = copy(dst, src, kind, stream)
        issued[id(transfer)] = phase["micro"]
        return transfer
    synchronize = Transfer.synchronize

    def spy_synchronize(self):
        if self.kind is Copy.GRAD_TO_HOST and phase["micro"] is not None:
            waits.append((phase["micro"], issued.get(id(self), "?")))
        return synchronize(self)
    streams.copy = spy_copy
    Transfer.synchronize = spy_synchronize
    landed: list[int] = []
    subscription = engine.reducer.subscribe(reduced=landed.append)
    losses, per_step = [], []
    try:
        for batch in global_batches(STEPS, MICRO * accum * world):
            total = 0.0
            for j, micro in enumerate(rank_slices(batch, rank, world, MICRO, accum)):
                loss = engine(micro)
                phase["micro"] = j
                engine.backward(loss)
                phase["micro"] = None
                total += float(loss.detach())
            engine.step()
            losses.append(total / accum)
            per_step.append(len(landed))
            landed.clear()
    finally:
        Transfer.synchronize = synchronize
        subscription.remove()
    losses = mean_over_ranks(losses, world)
    params = fp32_parameters(engine)
    units = len(engine.flat.units)
    shard_bytes = sum(u.unit.shard_numel * 4 for u in engine.flat.units)
    engine.close()
    return losses, params, waits, per_step, units, (landing_bytes, shard_bytes), switch


def _runs(stage, world):
    deferred = run_distributed(_train, world, stage, True, timeout=80)[0]
    today = run_distributed(_train, world, stage, False, timeout=80)[0]
    return deferred, today


def _check(stage, world):
    (losses, params, waits, per_step, units, _, switch), today = _runs(stage, world)
    what = f"stage {stage}, optimizer on the CPU tier, {world} rank(s), accumulation {ACCUM}"
    assert switch, f"{what}: the reducer does not land late on an (emulated) GPU host"
    # Bit-identical to landing every reduction at once (the adds in the same order).
    assert losses == today[0], f"{what}: losses {losses} != {today[0]} landing at once"
    for name, p in params.items():
        assert torch.equal(p, today[1][name]), f"{what}: {name} differs from the run landing at once"
    Oracle.run(reference_train, make_model(), _config(stage), global_batches(STEPS, MICRO * ACCUM * world)).check(
        losses, params, what)
    # Every micro-batch's reductions still land once per unit (the late ones by the step).
    assert per_step == [units * ACCUM] * STEPS == today[3], f"{what}: landings per step {per_step}"
    # No host wait inside a non-boundary backward for a copy of that backward: only for a
    # landing buffer reused (its copy issued in an earlier backward).
    inside = [(j, at) for j, at in waits if j != ACCUM - 1]
    assert all(at is not None and at != "?" and at < j for j, at in inside), f"{what}: waits {inside}"
    assert inside, f"{what}: no landing buffer was reused (the spy saw nothing)"
    before = [(j, at) for j, at in today[2] if j != ACCUM - 1]
    assert any(at == j for j, at in before), f"{what}: the spy misses the waits of landing at once: {before}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,world", [(2, 1), (3, 2), pytest.param(2, 2, marks=pytest.mark.slow),
                                         pytest.param(3, 1, marks=pytest.mark.slow)])
def test_landing_copies_overlap_backward_and_change_nothing(stage, world):
    _check(stage, world)


def _estimated_landing(stage: int, accum: int, dp: int, setting: str = "off") -> int:
    from tiertrain.estimate import estimate
    from tiertrain.estimate.layout import ZeroLayout
    from tiertrain.estimate.lines import LANDING_LINE

    cfg = _config(stage, accum)
    cfg.zero.accumulate_on_device = setting
    lines = estimate(make_model(), ZeroLayout.from_config(cfg.validate(), dp)).lines
    return sum(line.bytes for line in lines if line.name == LANDING_LINE)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [2, 3])
def test_the_landing_buffers_are_counted_and_only_where_they_are_used(stage):
    """One gradient shard per unit on the CPU tier, in the memory report and the estimate; none
    without accumulation, where every backward is a boundary, nor with it on the device."""
    *_, (landing, shard_bytes), switch = run_distributed(_train, 1, stage, True, timeout=50)[0]
    *_, (none_landing, _), none_switch = run_distributed(_train, 1, stage, True, 1, timeout=50)[0]
    assert switch and not none_switch
    assert landing - none_landing == shard_bytes > 0
    assert _estimated_landing(stage, ACCUM, 1) == shard_bytes
    assert _estimated_landing(stage, 1, 1) == 0 == _estimated_landing(stage, ACCUM, 1, "on")


def test_a_layout_with_landing_buffers_where_none_land_is_refused():
    from tiertrain.estimate.layout import ZeroLayout

    assert ZeroLayout(dp=2, stage=2, optimizer_tier="cpu", landing_buffers=True).validate().landing_buffers
    with pytest.raises(ValueError, match=r"ZeroLayout\.landing_buffers=True is invalid with stage=1, "
                                         r"optimizer_tier=cpu"):
        ZeroLayout(dp=2, stage=1, optimizer_tier="cpu", landing_buffers=True).validate()
    with pytest.raises(ValueError, match=r"optimizer_tier=device"):
        ZeroLayout(dp=2, stage=3, landing_buffers=True).validate()
    with pytest.raises(ValueError, match=r"ZeroLayout\.landing_buffers='yes' is invalid: must be True or False"):
        ZeroLayout(dp=2, stage=2, optimizer_tier="cpu", landing_buffers="yes").validate()
