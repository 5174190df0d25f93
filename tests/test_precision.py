"""fp16 loss scaling: an overflow anywhere skips the step on every rank, lowers the scale
after `hysteresis` overflows, and never lets inf/NaN reach the parameters. A static scale
(DeepSpeed's fp16.loss_scale) never moves, and overflowing steps are still skipped."""
from __future__ import annotations

import pytest
import torch

import tiertrain
from reference import global_batches, make_config, make_model, rank_slices
from tiertrain.config import LossScaleConfig
from tiertrain.precision import DynamicLossScaler
from tiertrain.testing import run_distributed


def _poison_step(rank, world, stage, bad_value, hysteresis, dynamic=True):
    cfg = make_config(zero={"stage": stage}, batch={"micro_batch_size": 2},
                      precision={"dtype": "fp16", "loss_scale": {"hysteresis": hysteresis, "dynamic": dynamic,
                                                                 "growth_interval": 1}})
    topology = tiertrain.Topology.build(cfg.parallel)
    model = make_model()
    engine = tiertrain.wrap(model, cfg, topology)
    poison = {"on": False}
    # Only rank 0's gradient is poisoned: the overflow must still be seen by every rank.
    if rank == 0:
        model.blocks[0].mlp.fc1.weight.register_hook(
            lambda g: torch.full_like(g, bad_value) if poison["on"] else g)
    batches = global_batches(3, 2 * world)
    engine.train_batch(rank_slices(batches[0], rank, world, 2, 1))
    before = engine.full_state_dict()
    scale_before = engine.scaler.scale
    poison["on"] = True
    loss = engine(next(rank_slices(batches[1], rank, world, 2, 1)))
    engine.backward(loss)
    stepped = engine.step()
    after = engine.full_state_dict()
    unchanged = all(torch.equal(before[k], after[k]) for k in before)
    finite = all(torch.isfinite(v).all() for v in after.values())
    result = dict(stepped=stepped, unchanged=unchanged, finite=finite, scale_before=scale_before,
                  scale_after=engine.scaler.scale, skipped=engine.skipped_steps)
    poison["on"] = False  # the next clean step trains again
    result["recovered"] = engine.train_batch(rank_slices(batches[2], rank, world, 2, 1)) > 0 and engine.steps == 2
    return result


@pytest.mark.timeout(60)
@pytest.mark.parametrize("bad_value", [float("inf"), float("nan")])
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_overflow_skips_step_and_lowers_scale(stage, bad_value):
    for r in run_distributed(_poison_step, 2, stage, bad_value, 1, timeout=50):
        assert r["stepped"] is False
        assert r["unchanged"] and r["finite"], "a skipped step must leave every parameter untouched"
        assert r["scale_after"] == r["scale_before"] / 2
        assert r["skipped"] == 1
        assert r["recovered"]


@pytest.mark.timeout(60)
def test_hysteresis_keeps_scale_for_first_overflow():
    for r in run_distributed(_poison_step, 2, 1, float("inf"), 2, timeout=50):
        assert r["stepped"] is False and r["unchanged"]
        assert r["scale_after"] == r["scale_before"]


def test_scaler_grows_after_growth_interval_and_respects_min_scale():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale=4.0, growth_interval=3, hysteresis=1, min_scale=2.0))
    for _ in range(3):
        scaler.update(overflow=False)
    assert scaler.scale == 8.0
    for _ in range(5):
        scaler.update(overflow=True)
    assert scaler.scale == 2.0


@pytest.mark.timeout(60)
def test_a_static_scale_skips_the_overflowing_step_and_never_moves():
    for r in run_distributed(_poison_step, 2, 2, float("inf"), 1, False, timeout=50):
        assert r["stepped"] is False and r["unchanged"] and r["finite"] and r["skipped"] == 1
        assert r["scale_before"] == r["scale_after"] == 2.0**16, "a good step (growth_interval 1) and an overflow"
        assert r["recovered"]


def test_a_static_scale_is_the_configs_also_after_a_resume():
    scaler = DynamicLossScaler(LossScaleConfig(initial_scale=128.0, growth_interval=1, hysteresis=1, dynamic=False))
    for overflow in (False, True, True, False):
        scaler.update(overflow=overflow)
    assert scaler.scale == 128.0
    scaler.load_state_dict({**scaler.state_dict(), "scale": 2.0**16})  # (a run saved with another scale)
    assert scaler.scale == 128.0 and scaler.state.consecutive_skips == 0
