"""The deferred-copy harness (tiertrain/device.py): the tier transfers' waits, checked on the CPU.

On a GPU a tier transfer (a parameter shard CPU/NVMe → device before its all-gather, a reduced
gradient device → CPU for the CPU optimizer, an activation checkpoint out to the host and back)
is an asynchronous copy, and reading its destination before waiting for it is a race. On the
CPU every copy is synchronous, so the harness makes them asynchronous in effect: each copy's
destination holds NaN until the copy is waited on.

* Under it, training at every tier equals training without it, bit for bit: every
  transfer is waited on before its destination is read.
* With the waits of one kind of transfer removed (``skip-wait:KIND``, what deleting those
  lines would do), the run differs: the harness catches a missing wait of every kind.

One launch per harness setting (2 gloo ranks) runs every scenario of this file.
"""
from __future__ import annotations

import math
import os

import pytest
import torch

import tiertrain
from reference import global_batches, make_config, make_model, rank_slices
from tiertrain.device import DEFER_COPIES_ENV, Copy
from tiertrain.launch import WorkerFailure
from tiertrain.testing import run_distributed

MICRO, STEPS = 2, 3

SCENARIOS = {
    # name: (zero config, activations config, accumulation steps)
    "params on the cpu tier, stage 3": ({"stage": 3, "offload_params": "cpu"}, {}, 1),
    "params on the nvme tier, stage 3": ({"stage": 3, "offload_params": "nvme"}, {}, 1),
    "params on the cpu tier, optimizer on nvme, stage 3": (
        {"stage": 3, "offload_params": "cpu", "offload_optimizer": "nvme", "nvme_chunk_mb": 0.01}, {}, 1),
    "optimizer on the cpu tier, stage 2": ({"stage": 2, "offload_optimizer": "cpu"}, {}, 1),
    "optimizer on the cpu tier, stage 2, accumulation": ({"stage": 2, "offload_optimizer": "cpu"}, {}, 2),
    "everything on nvme, stage 3, accumulation": (
        {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_chunk_mb": 0.01}, {}, 2),
    "delayed update, stage 2, accumulation": (
        {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True, "delayed_update_warmup": 0}, {}, 2),
    "activation checkpoints on the cpu tier": ({"stage": 2}, {"checkpoint_every": 1, "offload": "cpu"}, 1),
}
"""Every kind of transfer at least once (Copy.PARAM_TO_DEVICE in the first three,
GRAD_TO_HOST where a reduced shard is copied into the CPU tier's gradient (the fourth: at the
boundary, issued as the collective is launched) or added to it (the fifth: a second micro-batch),
ACTIVATION_TO_HOST/TO_DEVICE in the last, UPDATE_TO_DEVICE wherever the optimizer on the CPU
tier updates shards that stand for device memory: the fourth, fifth and seventh)."""

EXERCISES = {
    Copy.PARAM_TO_DEVICE: "params on the cpu tier, stage 3",
    Copy.GRAD_TO_HOST: "optimizer on the cpu tier, stage 2, accumulation",
    Copy.ACTIVATION_TO_HOST: "activation checkpoints on the cpu tier",
    Copy.ACTIVATION_TO_DEVICE: "activation checkpoints on the cpu tier",
    Copy.UPDATE_TO_DEVICE: "optimizer on the cpu tier, stage 2, accumulation",
}
"""The scenario in which removing the waits of each kind must show."""


def _train(rank: int, world: int, root: str, names: list[str], harness: str) -> dict:
    # (set in the worker: the launcher's forkserver keeps the environment it started with)
    os.environ[DEFER_COPIES_ENV] = harness
    out = {}
    for name in names:
        zero, activations, accum = SCENARIOS[name]
        zero = {**zero, "bucket_mb": 0.02, "nvme_path": os.path.join(root, f"swap{rank}")}
        cfg = make_config(zero=zero, activations=activations, optimizer={"eps": 1e-3},
                          batch={"micro_batch_size": MICRO, "grad_accum_steps": accum})
        engine = tiertrain.wrap(make_model(n_layers=3), cfg, tiertrain.Topology.build(cfg.parallel))
        losses = [engine.train_batch(rank_slices(batch, rank, world, MICRO, accum))
                  for batch in global_batches(STEPS, MICRO * accum * world)]
        out[name] = (losses, engine.full_state_dict())
        engine.close()
    return out


def _launch(root: str, names: list[str], skip_wait: Copy | None = None, defer: bool = True) -> dict:
    harness = "0" if not defer else "1" if skip_wait is None else f"skip-wait:{skip_wait.value}"
    return run_distributed(_train, 2, root, names, harness, timeout=60)[0]


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    return _launch(str(tmp_path_factory.mktemp("plain")), list(SCENARIOS), defer=False)


def _differences(a: tuple, b: tuple) -> list[str]:
    (losses_a, params_a), (losses_b, params_b) = a, b
    out = [f"loss {i}" for i, (x, y) in enumerate(zip(losses_a, losses_b)) if not x == y]
    out += [n for n, p in params_a.items() if not torch.equal(p, params_b[n])]
    return out


@pytest.mark.timeout(90)
def test_every_transfer_is_waited_for_before_it_is_read(plain, tmp_path):
    deferred = _launch(str(tmp_path), list(SCENARIOS))
    for name in SCENARIOS:
        assert all(math.isfinite(x) for x in deferred[name][0]), (name, deferred[name][0])
        assert _differences(deferred[name], plain[name]) == [], name


@pytest.mark.timeout(90)
@pytest.mark.parametrize("kind", list(EXERCISES), ids=[k.value for k in EXERCISES])
def test_a_missing_wait_of_each_kind_is_caught(plain, tmp_path, kind):
    name = EXERCISES[kind]
    try:
        unwaited = _launch(str(tmp_path), [name], skip_wait=kind)
    except WorkerFailure as e:  # (the engine's own check: compute copies that are not the masters rounded)
        assert "InPlaceEditError" in str(e), e
        return
    assert _differences(unwaited[name], plain[name]), \
        f"with the waits of {kind.value} transfers removed, {name!r} trained exactly as before: the harness " \
        f"would not catch a missing wait there"
