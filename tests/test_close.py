"""Engine.close() undoes everything wrap() did: the model comes back as a plain nn.Module
holding the trained fp32 values, with no hook, thread, swap file or activation checkpointing
left behind, and it can be wrapped again exactly like a fresh model with those values."""
from __future__ import annotations

import copy
import io
import os
import threading

import pytest
import torch

import tiertrain
from reference import global_batches, make_config, make_model, rank_slices
from tiertrain.offload.activations import checkpointing_of
from tiertrain.testing import run_distributed

MICRO = 2
CASES = {  # name: config sections
    "stage 0": {"zero": {"stage": 0}},
    "stage 1, overlapped parameter gather": {"zero": {"stage": 1, "overlap_param_gather": True}},
    "stage 2, activation checkpointing": {"zero": {"stage": 2}, "activations": {"checkpoint_every": 1}},
    "stage 3": {"zero": {"stage": 3}},
    "stage 3, NVMe optimizer and parameters": {"zero": {"stage": 3, "offload_optimizer": "nvme",
                                                        "offload_params": "nvme"}},
    "stage 2, delayed update": {"zero": {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True,
                                         "delayed_update_warmup": 1}},
}


def _config(name, swap_dir):
    sections = copy.deepcopy(CASES[name])
    if "nvme" in name.lower():
        sections["zero"]["nvme_path"] = os.path.join(swap_dir, str(abs(hash(name))))
    return make_config(batch={"micro_batch_size": MICRO}, optimizer={"eps": 1e-3}, **sections)


def _train(engine, rank, world, steps=2, seed=1):
    for batch in global_batches(steps, MICRO * world, seed=seed):
        engine.train_batch(rank_slices(batch, rank, world, MICRO, 1))


def _plain_gradients(model, batch):
    model.zero_grad(set_to_none=True)
    model(**batch).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _close_and_rewrap(rank, world, name, swap_dir):
    cfg = _config(name, swap_dir)
    topology = tiertrain.Topology.build(cfg.parallel)
    model = make_model()
    engine = tiertrain.wrap(model, cfg, topology)
    _train(engine, rank, world)
    trained = engine.full_state_dict()
    swap_files = engine.swapper.rank_dir if engine.swapper is not None else None
    engine.close()
    engine.close()  # idempotent

    # A plain module again: the trained fp32 values, its own storage, no checkpointing ...
    params = dict(model.named_parameters())
    assert all(torch.equal(params[n], trained[n]) and params[n].dtype == torch.float32 for n in trained), name
    assert checkpointing_of(model) is None, name
    # ... no thread and no swap file left ...
    assert not [t.name for t in threading.enumerate() if t.name.startswith("tiertrain-")], name
    assert swap_files is None or not os.path.exists(swap_files), name
    # ... and no hook: forward and backward give what an untouched copy of it gives.
    batch = next(rank_slices(global_batches(1, MICRO * world, seed=7)[0], rank, world, MICRO, 1))
    twin = copy.deepcopy(model)
    grads, twin_grads = _plain_gradients(model, batch), _plain_gradients(twin, batch)
    assert all(torch.equal(grads[n], twin_grads[n]) for n in twin_grads), name
    model.zero_grad(set_to_none=True)

    # Wrapped again, it trains exactly as a fresh model holding the same values would.
    fresh = copy.deepcopy(model)
    runs = []
    for m in (model, fresh):
        again = tiertrain.wrap(m, _config(name, os.path.join(swap_dir, "again")), topology)
        _train(again, rank, world, seed=3)
        runs.append(again.full_state_dict())
        again.close()
    assert all(torch.equal(runs[0][n], runs[1][n]) for n in runs[1]), name
    assert any(not torch.equal(runs[0][n], trained[n]) for n in trained), f"{name}: the second wrap trained nothing"
    return True


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CASES))
def test_close_hands_back_a_plain_model_that_wraps_again(name, tmp_path):
    assert run_distributed(_close_and_rewrap, 2, name, str(tmp_path), timeout=100) == [True, True]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [2, 3])
def test_a_model_still_wrapped_is_refused_by_name_and_wraps_again_once_closed(stage, one_torch_thread):
    """A second wrap() of a model an engine still holds used to build a second engine over the
    same parameters: at stage 2 its backward failed with "'NoneType' object has no attribute
    'reshape'" (the first engine's hook had taken the gradient), at stage 3 it read the first
    engine's released parameters."""
    model = make_model()
    cfg = make_config(zero={"stage": stage}, batch={"micro_batch_size": MICRO})
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    with pytest.raises(tiertrain.AlreadyWrappedError, match="already wrapped by an engine that is not closed .*"
                                                            "'embed.weight' first\\): call that engine's close\\(\\)"):
        tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    if stage < 3:  # a copy of the model (saved whole and loaded) is held by no engine: it wraps
        saved = io.BytesIO()
        torch.save(model, saved)
        saved.seek(0)
        tiertrain.wrap(torch.load(saved, weights_only=False), cfg, tiertrain.Topology.build(cfg.parallel)).close()
    batch = global_batches(1, MICRO)[0]
    engine.backward(engine(batch))  # the first engine is untouched by the refusal
    assert engine.step()
    engine.close()
    again = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    again.backward(again(batch))
    assert again.step()
    again.close()
    assert all(type(p) is torch.nn.Parameter for p in model.parameters())
