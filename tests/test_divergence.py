"""A run that diverges while its numbers stay finite (issue 32, item 9): a step whose loss is
far above the recent ones, or whose gradient norm is, makes the checkpoint saved at it
"diverged", and a resume passes over it to the newest healthy one, as it does for a run whose
gradients stopped being finite (tests/test_faults_config.py)."""
from __future__ import annotations

import math

import pytest

from reference import global_batches, make_model
from tiertrain.state import checkpoint
from tiertrain.config import ConfigError, from_dict
from tiertrain.testing import run_distributed
from tiertrain.trainer import LoopConfig, Trainer
from tiertrain.trainer.divergence import DivergenceWatch

WORLD, MICRO = 2, 2


# --------------------------------------------------------------------------- the rule


def test_a_spike_is_a_loss_or_gradient_norm_factor_times_the_windows_largest():
    watch = DivergenceWatch(loss_factor=10, grad_norm_factor=100, window=3)
    assert watch.observe(1, 5.0, 1.0) is None, "no window yet: nothing to compare with"
    for step, loss in ((2, 6.0), (3, 4.0), (4, 3.0)):
        assert watch.observe(step, loss, 1.0) is None
    assert [h[0] for h in watch.history] == [6.0, 4.0, 3.0], "the window keeps the last 3 steps"
    assert watch.observe(5, 59.0, 1.0) is None, "59 is under 10 x 6"
    spike = watch.observe(6, 41.0, 1.0)  # the window is now (4, 3, 59): not a spike against 59
    assert spike is None
    watch = DivergenceWatch(loss_factor=10, grad_norm_factor=100, window=3)
    watch.observe(1, 5.0, 2.0)
    spike = watch.observe(2, 51.0, 2.0)
    assert spike is not None and spike.what == "loss" and spike.baseline == 5.0
    assert "step 2's loss 51 is 10.2 times the largest of the previous 1 steps (5)" in spike.describe()
    spike = watch.observe(3, 5.0, 201.0)
    assert spike is not None and spike.what == "gradient norm"
    assert list(watch.history) == [(5.0, 2.0)], "spiking steps stay out of the window"


def test_a_run_that_keeps_diverging_is_judged_against_its_last_healthy_steps():
    watch = DivergenceWatch(loss_factor=10, grad_norm_factor=0, window=2)
    watch.observe(1, 2.0, 1.0)
    assert all(watch.observe(step, 30.0, 1e9) is not None for step in range(2, 10))
    assert watch.spike.what == "loss", "grad_norm_spike_factor 0 turns the gradient check off"


def test_non_finite_values_are_left_to_the_skip_logic():
    watch = DivergenceWatch(loss_factor=10, grad_norm_factor=100, window=4)
    watch.observe(1, 2.0, 1.0)
    assert watch.observe(2, math.inf, 1.0) is None and watch.observe(3, 2.0, math.nan) is None
    assert list(watch.history) == [(2.0, 1.0)]


def test_the_window_round_trips_and_a_malformed_one_is_named():
    watch = DivergenceWatch(10, 100, window=2)
    for step, loss in enumerate((3.0, 2.0, 1.0), 1):
        watch.observe(step, loss, 0.5)
    again = DivergenceWatch(10, 100, window=2)
    again.load_state_dict(watch.state_dict(), "here")
    assert list(again.history) == [(2.0, 0.5), (1.0, 0.5)]
    for bad in (None, {"history": [[1.0]]}, {"history": [[1.0, float("nan")]]}, {"history": "x"}):
        with pytest.raises(ValueError, match="here: the saved divergence window is malformed"):
            again.load_state_dict(bad, "here")


@pytest.mark.parametrize("field,value", [("loss_spike_factor", 1.0), ("grad_norm_spike_factor", -2),
                                         ("spike_window", 0)])
def test_the_thresholds_are_validated_fields(field, value):
    with pytest.raises(ConfigError, match=f"checkpoint.{field}={value}"):
        from_dict(LoopConfig, {"checkpoint": {field: value}}).validate()


# --------------------------------------------------------------------------- in a run


def _scaled_loss(model, batch):
    """The model's loss times the batch's "scale": a finite loss spike where the data says so."""
    return model(input_ids=batch["input_ids"], labels=batch["labels"]) * batch["scale"].max()


def _batches(spike_from: int, steps: int) -> list[dict]:
    """Each rank's micro-batches of ``steps`` steps, the losses of steps >= spike_from times 1000."""
    import torch

    out = []
    for step, g in enumerate(global_batches(steps, WORLD * MICRO), 1):
        scale = torch.full((WORLD * MICRO,), 1000.0 if step >= spike_from else 1.0)
        for r in range(WORLD):
            rows = slice(r * MICRO, (r + 1) * MICRO)
            out.append({"input_ids": g["input_ids"][rows], "labels": g["labels"][rows], "scale": scale[rows]})
    return out


def _fit(rank, world, config, batches):
    """(whether the last step spiked, steps trained, what the rank wrote to stderr and warned)."""
    import contextlib
    import io
    import warnings

    err = io.StringIO()
    with contextlib.redirect_stderr(err), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with Trainer(make_model(), config, batches, loss_fn=_scaled_loss) as trainer:
            trainer.fit()
    said = err.getvalue() + "".join(str(w.message) for w in caught)
    return trainer.divergence.spike is not None, trainer.step, said


@pytest.mark.timeout(90)
def test_checkpoints_saved_in_a_loss_spike_are_marked_and_a_resume_takes_the_last_healthy_one(tmp_path):
    directory = str(tmp_path / "ckpt")

    def config(steps: int) -> LoopConfig:
        return from_dict(LoopConfig, {
            "steps": steps, "optimizer": {"lr": 1e-3}, "batch": {"micro_batch_size": MICRO},
            "logging": {"progress": False, "metrics_file": ""},
            "checkpoint": {"dir": directory, "interval": 1, "keep_last": 10}}).validate()

    spiking = run_distributed(_fit, WORLD, config(6), _batches(spike_from=5, steps=6), timeout=60)
    assert [r[:2] for r in spiking] == [(True, 6)] * WORLD
    said = spiking[0][2]
    assert "warning: step 5's loss" in said and "times the largest of the previous 4 steps" in said
    assert "the checkpoint of step 5" in said and "the checkpoint of step 6" in said
    assert checkpoint.committed_steps(directory) == [1, 2, 3, 4, 5, 6]
    assert [s for s in range(1, 7) if checkpoint.diverged_reason(directory, s)] == [5, 6]
    assert "step 5's loss" in checkpoint.diverged_reason(directory, 5)

    resumed = run_distributed(_fit, WORLD, config(6), _batches(spike_from=99, steps=6), timeout=60)
    assert [r[:2] for r in resumed] == [(False, 6)] * WORLD
    assert "falling back to step 4" in resumed[0][2]
    assert [s for s in range(1, 7) if checkpoint.diverged_reason(directory, s)] == [], \
        "the resumed run's saves of steps 5 and 6 replaced the diverged ones"
