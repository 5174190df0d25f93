"""Every data-parallel rank trains from data-parallel rank 0's model, as under DDP and DeepSpeed.

A loop that builds its model on each rank without one seed (or loads a checkpoint on rank 0
only) used to train what each rank happened to hold: at stage 0 replicas that drifted apart, at
stages 1-3 a model cut from several (each rank's shard from its own copy), without a word.
``wrap()`` now broadcasts rank 0's parameters, frozen ones and buffers included, before it cuts
the shards, so the run is the single-process reference's from rank 0's model.
"""
from __future__ import annotations

import pytest
import torch

from reference import Oracle, engine_train, global_batches, make_config, make_model, reference_train
from tiertrain.testing import run_distributed

pytestmark = pytest.mark.timeout(120)
WORLD, MICRO, STEPS = 2, 2, 3
STAGES = (0, 2, 3)


def model_of_seed(seed: int):
    """The reference model of another seed, its first MLP frozen, with a buffer of the seed."""
    model = make_model(seed=seed)
    model.blocks[0].mlp.fc1.weight.requires_grad_(False)
    model.register_buffer("seed_mark", torch.full((2,), float(seed)))
    return model


def _train(rank, world):
    out = {}
    for stage in STAGES:
        config = make_config(zero={"stage": stage}, batch={"micro_batch_size": MICRO})
        losses, params, engine = engine_train(rank, world, model_of_seed(seed=rank), config,
                                              global_batches(STEPS, MICRO * world))
        out[stage] = (losses, {n: t.float() for n, t in params.items()})
        engine.close()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_train, WORLD, timeout=100)


@pytest.mark.parametrize("stage", STAGES)
def test_ranks_seeded_differently_train_rank_0s_model(runs, stage):
    (losses, params), (_, params_1) = runs[0][stage], runs[1][stage]
    assert all(torch.equal(params[n], params_1[n]) for n in params), "both ranks hold one model"
    assert torch.equal(params["seed_mark"], torch.zeros(2)), "rank 0's buffer"
    config = make_config(zero={"stage": stage}, batch={"micro_batch_size": MICRO})
    oracle = Oracle.run(reference_train, model_of_seed(seed=0), config, global_batches(STEPS, MICRO * WORLD))
    oracle.check(losses, {n: t for n, t in params.items() if n != "seed_mark"}, f"stage {stage}")
    assert torch.equal(params["blocks.0.mlp.fc1.weight"], make_model(seed=0).blocks[0].mlp.fc1.weight.detach()), \
        "the frozen weight is rank 0's"
