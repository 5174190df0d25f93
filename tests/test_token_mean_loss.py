"""Which mean the engine's gradient is, when micro-batches hold different numbers of labelled
tokens (prompts or padding labelled -100).

The gradient ``engine.step()`` applies is the mean, over the data-parallel ranks and the
accumulation window's micro-batches, of each micro-batch loss's gradient: DDP's and DeepSpeed's
convention. A loss that is its micro-batch's token mean (what a model returns) so weights every
micro-batch alike, whatever its number of labelled tokens, which is not the token mean of the
whole batch that one process computes. The loss to give for that mean is the labelled tokens'
loss sum over the window's global count, times dp × grad_accum_steps (what transformers' Trainer
does with ``num_items_in_batch``; tiertrain.integrations.TiertrainTrainer passes it on). Both
are specified here against plain PyTorch on the whole batch, stepped by SGD (Adam's normalised
first steps would hide a weighting).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import tiertrain
from reference import Oracle, make_config, make_model, reference_train
from tiertrain.testing import run_distributed

DP, ACCUM, MICRO, STEPS = 2, 2, 1, 2
LR = 0.5
LABELLED = [2, 16, 5, 16]
"""Labelled tokens per sequence of a global batch (rank r's micro-batch j is sequence j·dp + r)."""


def _batches():
    g = torch.Generator().manual_seed(4)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, 256, (DP * ACCUM * MICRO, 16), generator=g)
        labels = torch.randint(0, 256, ids.shape, generator=g)
        for row, n in enumerate(LABELLED):
            labels[row, : 16 - n] = -100  # (a prompt: no loss)
        out.append({"input_ids": ids, "labels": labels})
    return out


def _config():
    return make_config(zero={"stage": 2}, parallel={"dp": DP}, optimizer={"grad_clip": 0.0},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": ACCUM})


def _sgd(params):
    return torch.optim.SGD(params, lr=LR)


def _token_sum_loss(model, batch):
    """The labelled tokens' loss sum over the window's global count, times dp × grad_accum_steps."""
    logits = model(batch["input_ids"])
    total = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100,
                            reduction="sum")
    return total / batch["window_tokens"] * (DP * ACCUM)


def _run(rank, world, token_weighted):
    cfg = _config()
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel), optimizer=_sgd,
                            lr_scheduler=None, loss_fn=_token_sum_loss if token_weighted else None)
    for batch in _batches():
        window = [{k: v[(j * DP + rank) * MICRO:(j * DP + rank + 1) * MICRO] for k, v in batch.items()}
                  for j in range(ACCUM)]
        if token_weighted:  # (the window's labelled tokens on every rank: one all-reduce per step)
            count = torch.tensor(float(sum(int((b["labels"] != -100).sum()) for b in window)))
            dist.all_reduce(count)
            window = [{**b, "window_tokens": count} for b in window]
        engine.train_batch(iter(window))
    params = {n: v.float().clone() for n, v in engine.full_state_dict().items()}
    engine.close()
    return params


@pytest.fixture(scope="module")
def oracle(one_torch_thread):
    return Oracle.run(reference_train, make_model(), _config(), _batches(), build_optimizer=lambda m: _sgd(m.parameters()),
                      lr_scheduler=None)


@pytest.mark.timeout(90)
def test_a_loss_over_the_windows_token_count_steps_the_whole_batchs_token_mean(oracle):
    params = run_distributed(_run, DP, True, timeout=45)[0]
    oracle.check(None, params, "token-weighted loss")


@pytest.mark.timeout(90)
def test_the_models_own_mean_loss_weights_each_micro_batch_alike(oracle):
    """(The convention above, and the premise that it differs here: a sequence of 2 labelled
    tokens weighs as much as one of 16.)"""
    params = run_distributed(_run, DP, False, timeout=45)[0]
    with pytest.raises(AssertionError, match="parameters are"):
        oracle.check(None, params, "micro-batch mean loss")
