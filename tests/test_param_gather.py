"""zero.overlap_param_gather: the all-gather of the parameters a step updated runs on into
the next forward, whose operations each wait for the units they touch. Training is the same,
bit for bit, as waiting for the gathers inside step()."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tiertrain
from reference import global_batches, make_config, make_model, rank_slices
from tiertrain.comm import Work
from tiertrain.config import ConfigError
from tiertrain.testing import run_distributed


def _config(stage, overlap, dtype="fp32", accum=1, clip=0.0):
    return make_config(zero={"stage": stage, "overlap_param_gather": overlap, "bucket_mb": 0.01},
                       precision={"dtype": dtype}, optimizer={"grad_clip": clip},
                       batch={"micro_batch_size": 2, "grad_accum_steps": accum})


def _defer_parameter_gathers(engine):
    """Make the gathers a step leaves running land only when waited on: until then the
    chunks other ranks own hold NaN, so any read before the wait shows in the results.
    (Each collective runs at its wait; every rank waits in the same order.)"""
    comm = engine.comm
    all_gather = comm.all_gather

    def deferred(output, input, async_op=False):
        if not async_op:
            return all_gather(output, input)
        start = (input.data_ptr() - output.data_ptr()) // output.element_size()  # the shard is a view
        kept = input.clone()
        output.fill_(float("nan"))
        output[start:start + kept.numel()].copy_(kept)
        return Work(None, on_done=lambda: all_gather(output, kept))

    comm.all_gather = deferred


class ReadsChildWeight(nn.Module):
    """A forward that reads a child's weight without calling the child (no module hook sees it)."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.proj = nn.Linear(model.config.hidden, model.config.hidden)

    def forward(self, input_ids, labels):
        x = self.model.embed_tokens(input_ids)
        x = x + F.linear(x, self.proj.weight, self.proj.bias)
        for block in self.model.blocks:
            x = block(x)
        return self.model.head_output(x, labels)


def _train(rank, world, stage, overlap, dtype="fp32", accum=1, clip=0.0, defer=False, wrapper=None):
    torch.manual_seed(0)
    model = make_model(n_layers=2)
    if wrapper is not None:
        model = wrapper(model)
    cfg = _config(stage, overlap, dtype, accum, clip)
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    if defer:
        _defer_parameter_gathers(engine)
    losses, in_flight = [], []
    for batch in global_batches(3, 2 * accum * world):
        losses.append(engine.train_batch(rank_slices(batch, rank, world, 2, accum)))
        in_flight.append(engine.flat.gathers_in_flight)
    return losses, engine.full_state_dict(), in_flight


def _assert_same_training(overlapped, synchronous):
    for (losses, params, _), (ref_losses, ref_params, _) in zip(overlapped, synchronous):
        assert losses == ref_losses
        for name, ref in ref_params.items():
            assert torch.equal(params[name], ref), name


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,dtype,accum,clip", [
    (1, "fp32", 1, 0.0), (2, "fp32", 1, 0.0), (1, "bf16", 2, 1.0), (2, "bf16", 2, 0.0), (2, "fp32", 2, 0.5)])
def test_overlapped_gather_trains_exactly_like_the_synchronous_one(stage, dtype, accum, clip):
    overlapped = run_distributed(_train, 2, stage, True, dtype, accum, clip, timeout=100)
    synchronous = run_distributed(_train, 2, stage, False, dtype, accum, clip, timeout=100)
    _assert_same_training(overlapped, synchronous)
    assert all(all(r[2]) for r in overlapped), "each step returns with its gathers in flight"
    assert not any(any(r[2]) for r in synchronous)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("wrapper", [None, ReadsChildWeight], ids=["gpt", "reads-child-weight"])
def test_every_operation_waits_for_the_units_it_reads(wrapper):
    """With the gathers landing only when waited on, a read before the wait would see NaN:
    the results match the synchronous run, also for a weight read without its module."""
    deferred = run_distributed(_train, 2, 2, True, defer=True, wrapper=wrapper, timeout=100)
    synchronous = run_distributed(_train, 2, 2, False, wrapper=wrapper, timeout=100)
    _assert_same_training(deferred, synchronous)


def _reads_outside_the_engine(rank, world):
    torch.manual_seed(0)
    cfg = _config(2, True)
    model = make_model(n_layers=2)
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    _defer_parameter_gathers(engine)
    batches = global_batches(4, 2 * world)
    out = {}
    engine.train_batch(rank_slices(batches[0], rank, world, 2, 1))
    out["raw read before wait_for_parameters"] = bool(torch.isnan(model.head.weight).any())
    engine.wait_for_parameters()
    out["raw read after wait_for_parameters"] = bool(torch.isnan(model.head.weight).any())
    engine.train_batch(rank_slices(batches[1], rank, world, 2, 1))
    state = model.state_dict()
    out["model.state_dict()"] = any(bool(torch.isnan(v).any()) for v in state.values())
    engine.train_batch(rank_slices(batches[2], rank, world, 2, 1))
    with torch.no_grad():
        loss = model(**next(rank_slices(batches[3], rank, world, 2, 1)))
    out["direct model forward"] = bool(torch.isnan(loss))
    engine.train_batch(rank_slices(batches[3], rank, world, 2, 1))
    engine.state_dict()
    out["engine.state_dict()"] = any(bool(torch.isnan(u.full).any()) for u in engine.flat.units)
    return out


@pytest.mark.timeout(90)
def test_reads_outside_the_engine_wait_where_they_can():
    """model.state_dict(), a forward called on the model itself and the engine's entry points
    wait for the gathers; a raw read between step() and the next forward is what
    engine.wait_for_parameters() is for."""
    for out in run_distributed(_reads_outside_the_engine, 2, timeout=80):
        assert out == {"raw read before wait_for_parameters": True, "raw read after wait_for_parameters": False,
                       "model.state_dict()": False, "direct model forward": False,
                       "engine.state_dict()": False}


def test_overlap_param_gather_is_refused_under_pipeline_parallelism():
    with pytest.raises(ConfigError, match=r"zero.overlap_param_gather=True .* parallel.pp=2"):
        make_config(zero={"overlap_param_gather": True}, parallel={"pp": 2, "dp": 1})
