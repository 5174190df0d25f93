"""ZeRO-Offload: optimizer state (and, at stage 3, parameter shards) on the CPU tier trains
exactly like keeping everything on the device (PAPERS.md §2). On a machine without an
accelerator both tiers are host memory and the same copies run."""
from __future__ import annotations

import pytest
import torch

from reference import engine_train, global_batches, make_config, make_model
from tiertrain.testing import run_distributed

CASES = [  # (stage, offload_optimizer, offload_params, dtype)
    (2, "cpu", "none", "fp32"), (2, "cpu", "none", "bf16"),
    (3, "cpu", "none", "fp32"), (3, "none", "cpu", "fp32"), (3, "cpu", "cpu", "fp32"), (3, "cpu", "cpu", "bf16"),
]


def _runs(rank, world, stage, offload_optimizer, offload_params, dtype):
    out = []
    for opt, par in (("none", "none"), (offload_optimizer, offload_params)):
        cfg = make_config(zero={"stage": stage, "offload_optimizer": opt, "offload_params": par},
                          precision={"dtype": dtype}, batch={"micro_batch_size": 2, "grad_accum_steps": 2},
                          optimizer={"grad_clip": 0.05})
        losses, params, engine = engine_train(rank, world, make_model(), cfg, global_batches(3, 8))
        out.append((losses, params, engine.memory_report()))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage,offload_optimizer,offload_params,dtype", CASES)
def test_offloaded_run_is_identical_to_device_run(stage, offload_optimizer, offload_params, dtype):
    (base_losses, base_params, base_mem), (losses, params, mem) = run_distributed(
        _runs, 2, stage, offload_optimizer, offload_params, dtype, timeout=50)[0]
    assert losses == base_losses
    assert all(torch.equal(params[k], base_params[k]) for k in params)
    assert base_mem.cpu_tier == 0
    expected = 0
    if offload_optimizer == "cpu":
        expected += mem.optimizer + mem.grads  # master, Adam moments and gradient shard
    if offload_params == "cpu":
        expected += mem.params
    assert mem.cpu_tier == expected
