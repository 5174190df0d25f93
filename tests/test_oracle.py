"""The float64 oracle of tests/reference.py is a real oracle and its bounds still catch bugs.

Each test family's bound is "the engine's distance to a float64 run of the reference is at
most NOISE_MULTIPLE × the fp32 reference's distance, plus FLOOR". These specifications show
that (1) the float64 run really is float64 (it differs from fp32 by rounding noise, not by
nothing), (2) an unmodified engine run passes, and (3) each bug a family exists to catch
still fails under the new bound, by orders of magnitude: one rank's gradient contribution
dropped from the reduce-scatter, the 1/dp averaging skipped, a stale shard read after the
all-gather, the tied-embedding gradient sum between the first and last pipeline stage
skipped, and (operator level) a tile that loses its bias.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tiertrain
import tiertrain.gathered
import tiertrain.pipeline.engine as pipeline_engine
from reference import (FLOOR, NOISE_MULTIPLE, Oracle, assert_within_rounding, engine_train, global_batches,
                       make_config, make_model, reference_train)
from tiertrain.comm import Collectives, Work
from tiertrain.testing import run_distributed
from tiertrain.tiling import TiledLinear

STEPS, MICRO, WORLD = 4, 2, 2


def _config(stage=2, pp=1, eps=1e-3):
    return make_config(zero={"stage": stage, "bucket_mb": 0.02}, parallel={"pp": pp},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": 2 if pp > 1 else 1},
                       optimizer={"eps": eps, "lr": 1e-2, "grad_clip": 0.0})  # clipping would hide scale


def _batches(pp=1):
    return global_batches(STEPS, MICRO * (2 if pp > 1 else WORLD))


# -- the mutations, applied inside each rank's process -----------------------------------------

def _drop_rank1_gradients(monkeypatch):
    original = Collectives.reduce_scatter

    def reduce_scatter(self, output, input, async_op=False):
        if self.rank == 1:  # rank 1 contributes zeros: its micro-batch's gradient is lost
            input.zero_()
        return original(self, output, input, async_op)
    monkeypatch.setattr(Collectives, "reduce_scatter", reduce_scatter)


def _skip_one_over_dp(monkeypatch):
    original = tiertrain.wrap

    def wrap(*args, **kwargs):
        engine = original(*args, **kwargs)
        engine.dp = 1  # the loss is then scaled by 1/accum only: gradients summed, not averaged
        return engine
    monkeypatch.setattr(tiertrain, "wrap", wrap)


def _stale_shards(monkeypatch):
    def all_gather(self, output, input, async_op=False):
        # only this rank's own chunk is refreshed: every peer's chunk keeps last step's values
        output.view(self.size, -1)[self.rank].copy_(input.view(-1))
        return Work(None)
    monkeypatch.setattr(Collectives, "all_gather", all_gather)
    # The ranks' copies then differ, which full_state_dict's check of in-place edits refuses
    # first (tiertrain/in_place_edits.py): off here, so that the oracle's bound is what is tested.
    monkeypatch.setattr(tiertrain.gathered, "refuse_in_place_edits", lambda *args, **kwargs: None)


def _skip_tied_sum(monkeypatch):
    monkeypatch.setattr(pipeline_engine, "sum_tied_gradients", lambda *args, **kwargs: None)


# name: (mutation, zero stage, pp, AdamW eps). Adam normalises the gradient's scale away
# wherever sqrt(v) >> eps, so a wrong 1/dp would hide there; with eps = 1 the update is
# proportional to the gradient, as with SGD.
MUTATIONS = {"drop one rank's gradient": (_drop_rank1_gradients, 2, 1, 1e-3),
             "skip the 1/dp scaling": (_skip_one_over_dp, 2, 1, 1.0),
             "read a stale shard": (_stale_shards, 1, 1, 1e-3),
             "skip the tied-weight sum": (_skip_tied_sum, 2, 2, 1e-3)}
UNMODIFIED = (None, 2, 1, 1e-3)


def _runs(rank, world, names):
    out = {}
    for name in names:
        mutate, stage, pp, eps = MUTATIONS.get(name, UNMODIFIED)
        with pytest.MonkeyPatch.context() as monkeypatch:
            if mutate is not None:
                mutate(monkeypatch)
            losses, params, _ = engine_train(rank, world, make_model(), _config(stage, pp, eps), _batches(pp))
        params.pop("head.weight", None)  # a pipeline's last stage holds the tied copy
        out[name] = (losses, params)
    return out


def _merged(results, name):
    """Losses of rank 0 and the parameters held by any rank (a pipeline's stages together)."""
    params = {}
    for r in results:
        params.update(r[name][1])
    return results[0][name][0], params


@pytest.mark.timeout(120)
def test_every_mutation_fails_the_bound_that_the_unmodified_engine_meets():
    names = [None, *MUTATIONS]
    results = run_distributed(_runs, WORLD, names, timeout=110)
    for name in names:
        _, stage, pp, eps = MUTATIONS.get(name, UNMODIFIED)
        oracle = Oracle.run(reference_train, make_model(), _config(stage, pp, eps), _batches(pp))
        losses, params = _merged(results, name)
        if name is None:
            oracle.check(losses, params, "unmodified engine")
            continue
        with pytest.raises(AssertionError, match="from the float64 reference") as info:
            oracle.check(losses, params, name)
        # Not a near miss: the mutation moves the result by far more than the bound.
        bound = NOISE_MULTIPLE * max(oracle.param_noise, oracle.loss_noise()) + FLOOR
        worst = float(str(info.value).split(" are ")[1].split(" ")[0])
        print(f"{name}: {worst:.2e}, bound {bound:.2e}")
        assert worst > 100 * bound, f"{name}: {worst:.2e} vs bound {bound:.2e}"


def test_the_float64_run_is_float64_and_its_noise_is_rounding():
    oracle = Oracle.run(reference_train, make_model(), _config(), _batches())
    assert all(p.dtype == torch.float64 for p in oracle.params64.values())
    assert all(p.dtype == torch.float32 for p in oracle.params32.values())
    # fp32 rounding moves the result, but only by rounding: ulps, not percent
    assert 0 < oracle.param_noise < 1e-4 and 0 < oracle.loss_noise() < 1e-5


def test_failure_message_names_both_distances_and_their_ratio():
    oracle = Oracle.run(reference_train, make_model(), _config(), global_batches(2, MICRO))
    bad = {n: p + 1e-3 * p.abs().max() for n, p in oracle.params32.items()}
    with pytest.raises(AssertionError) as info:
        oracle.check(None, bad, "shifted")
    message = str(info.value)
    assert "shifted: parameters are" in message and "from the float64 reference" in message
    assert "the fp32 reference is" in message and "ratio" in message and "bound" in message


def test_a_tile_without_its_bias_breaks_the_rounding_bound():
    torch.manual_seed(0)
    linear = nn.Linear(24, 40)
    tiled = TiledLinear.from_linear(linear, 4)
    with torch.no_grad():
        tiled.tiles[2].bias.zero_()
    x = torch.randn(5, 7, 24)
    w, b, x64 = linear.weight.detach().double(), linear.bias.detach().double(), x.double()
    exact = torch.nn.functional.linear(x64, w, b)
    terms = torch.nn.functional.linear(x64.abs(), w.abs(), b.abs())
    assert_within_rounding(linear(x).detach(), exact, terms, 25, "untiled")
    with pytest.raises(AssertionError, match="rounding bound gamma_25"):
        assert_within_rounding(tiled(x).detach(), exact, terms, 25, "tile 2 without bias")
