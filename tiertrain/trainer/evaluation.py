"""The Trainer's evaluation (:meth:`tiertrain.Trainer.evaluate`): the token-weighted mean loss of
up to ``eval.batches`` held-out micro-batches per data-parallel rank, and its perplexity. A
pipeline engine evaluates ``grad_accum_steps`` micro-batches per forward-only schedule, so that
they pipeline (tiertrain/pipeline/engine.py evaluate_each); one model, one at a time.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..config import ConfigError
from ..topology import Topology
from .batches import count_tokens, eval_batches
from .config import LoopConfig

__all__ = ["held_out_loss"]


def held_out_loss(engine, topology: Topology, eval_data: Any, config: LoopConfig,
                  collate_fn: Callable | None) -> dict[str, float]:
    """eval_loss, eval_ppl and eval_tokens over this run's ranks (collective: every
    data-parallel rank evaluates the same number of batches, so one whose data ends first ends
    the evaluation for all)."""
    dp, rank = topology.size("dp"), topology.coord("dp")
    batches = eval_batches(eval_data, rank, dp, config.batch.micro_batch_size, collate_fn)
    group = engine.accum if topology.size("pp") > 1 else 1
    scored: list[tuple[int, float]] = []  # (tokens, loss) of each batch evaluated
    pending: list[Any] = []
    for _ in range(config.eval.batches):
        batch = next(batches, None)
        if not _every_rank_has(batch is not None, topology):
            break
        pending.append(batch)
        if len(pending) == group:
            scored += _scored(engine, pending, topology)
            pending = []
    if pending:  # (the last, partial group)
        scored += _scored(engine, pending, topology)
    totals = torch.tensor([sum(n * loss for n, loss in scored), sum(n for n, _ in scored), len(scored)],
                          dtype=torch.float64)
    if topology.size("dp_cp") > 1 and dist.is_initialized():  # (cp ranks count their samples' tokens each)
        dist.all_reduce(totals, group=topology.group("dp_cp"))
    loss_sum, tokens, count = totals.tolist()
    if count == 0:
        raise ConfigError(f"eval_data gave no batch on some data-parallel rank: it needs at least {dp} samples "
                          f"(one per rank), or {dp} batches")
    loss = loss_sum / tokens if tokens else float("nan")
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)),
            "eval_tokens": int(tokens) // topology.size("cp")}


def _scored(engine, batches: list[Any], topology: Topology) -> list[tuple[int, float]]:
    """(tokens, loss) of each batch: a pipeline's in one forward-only schedule, one model's each alone."""
    if topology.size("pp") > 1:
        losses = engine.evaluate_each(batches)
    else:
        losses = [float(engine.evaluate(batch)) for batch in batches]
    return [(count_tokens(batch), loss) for batch, loss in zip(batches, losses, strict=True)]


def _every_rank_has(has: bool, topology: Topology) -> bool:
    flag = torch.tensor([1 if has else 0], dtype=torch.int32)
    if topology.size("dp") > 1 and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=topology.group("dp"))
    return bool(flag.item())
