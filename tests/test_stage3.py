"""Stage 3 specifics: persistent small parameters, reading and editing full parameters
outside forward, and the prefetch and live-parameter budgets."""
from __future__ import annotations

import pytest
import torch

import tiertrain
from reference import engine_train, global_batches, make_config, make_model, max_rel_diff, rank_slices, reference_train
from tiertrain.testing import run_distributed


def _config(**zero):
    return make_config(zero={"stage": 3, **zero}, batch={"micro_batch_size": 2}, optimizer={"eps": 1e-3})


def _train(rank, world, zero):
    losses, params, engine = engine_train(rank, world, make_model(n_layers=3), _config(**zero), global_batches(3, 4))
    resident = [u.unit.label for u in engine.flat.units if u.unit.resident]
    return losses, params, resident, engine.flat.peak_gathered_bytes


def _reference():
    return reference_train(make_model(n_layers=3), _config(), global_batches(3, 4))


@pytest.mark.timeout(60)
def test_persistent_small_parameters_stay_whole_and_train_identically():
    losses, params, resident, _ = run_distributed(_train, 2, {"persistence_threshold": 64}, timeout=50)[0]
    ref_losses, ref_params = _reference()
    assert resident == ["<persistent>"], "layer norms (32 elements) form one resident unit"
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= 1e-6
    assert max_rel_diff(params, ref_params) <= 1e-6


@pytest.mark.timeout(90)
def test_prefetch_gathers_ahead_within_the_live_budget():
    unit_bytes = 12 * 32 * 32 * 4  # one block's parameters (bias-free)
    _, no_prefetch_params, _, no_prefetch_peak = run_distributed(_train, 2, {"prefetch_mb": 0.0}, timeout=50)[0]
    _, prefetch_params, _, prefetch_peak = run_distributed(_train, 2, {"prefetch_mb": 1.0}, timeout=50)[0]
    cap = 1.5 * unit_bytes + no_prefetch_peak
    _, capped_params, _, capped_peak = run_distributed(
        _train, 2, {"prefetch_mb": 1.0, "max_live_mb": cap / 2**20}, timeout=50)[0]
    assert prefetch_peak > no_prefetch_peak, "prefetching holds the next units while the current one runs"
    assert capped_peak <= cap, "prefetch never exceeds max_live_mb"
    for params in (prefetch_params, capped_params):
        assert all(torch.equal(params[k], no_prefetch_params[k]) for k in params), "prefetch changes no value"


def _edit_full_parameters(rank, world):
    cfg = _config()
    model = make_model(n_layers=3)
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    engine.train_batch(rank_slices(global_batches(1, 4)[0], rank, world, 2, 1))
    before = engine.full_state_dict()
    weight = model.blocks[1].mlp.fc1.weight
    assert weight.untyped_storage().size() == 0, "outside forward a partitioned parameter holds no storage"
    with engine.gathered_parameters([weight], modifier_rank=0):
        seen = weight.detach().clone()
        if rank == 0:
            weight.data.fill_(0.5)  # only rank 0's edit counts: it is broadcast on exit
        else:
            weight.data.fill_(-1.0)
    after = engine.full_state_dict()
    released = weight.untyped_storage().size() == 0
    loss = engine.train_batch(rank_slices(global_batches(2, 4)[1], rank, world, 2, 1))
    return seen, before["blocks.1.mlp.fc1.weight"], after, released, loss


@pytest.mark.timeout(60)
def test_gathered_parameters_reads_and_writes_back_full_values():
    for seen, before, after, released, loss in run_distributed(_edit_full_parameters, 2, timeout=50):
        assert torch.equal(seen, before), "inside the context the full parameter is readable"
        assert torch.equal(after["blocks.1.mlp.fc1.weight"], torch.full_like(before, 0.5))
        assert released, "leaving the context releases the gathered unit again"
        assert torch.isfinite(torch.tensor(loss))
