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
    loss_sum = tokens = count = 0.0
    pending: list[Any] = []
    for k in range(config.eval.batches):
        batch = next(batches, None)
        ended = not _every_rank_has(batch is not None, topology)
        if not ended:
            pending.append(batch)
        if pending and (ended or len(pending) == group or k == config.eval.batches - 1):
            for b, loss in zip(pending, _losses(engine, pending, topology), strict=True):
                n = count_tokens(b)
                loss_sum += loss * n
                tokens += n
                count += 1
            pending = []
        if ended:
            break
    totals = torch.tensor([loss_sum, tokens, count], dtype=torch.float64)
    if topology.size("dp_cp") > 1 and dist.is_initialized():  # (cp ranks count their samples' tokens each)
        dist.all_reduce(totals, group=topology.group("dp_cp"))
    loss_sum, tokens, count = totals.tolist()
    if count == 0:
        raise ConfigError(f"eval_data gave no batch on some data-parallel rank: it needs at least {dp} samples "
                          f"(one per rank), or {dp} batches")
    loss = loss_sum / tokens if tokens else float("nan")
    return {"eval_loss": loss, "eval_ppl": math.exp(min(loss, 700.0)),
            "eval_tokens": int(tokens) // topology.size("cp")}


def _losses(engine, batches: list[Any], topology: Topology) -> list[float]:
    if topology.size("pp") > 1:
        return engine.evaluate_each(batches)
    return [float(engine.evaluate(batch)) for batch in batches]


def _every_rank_has(has: bool, topology: Topology) -> bool:
    flag = torch.tensor([1 if has else 0], dtype=torch.int32)
    if topology.size("dp") > 1 and dist.is_initialized():
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=topology.group("dp"))
    return bool(flag.item())
