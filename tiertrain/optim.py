"""AdamW over (sharded) fp32 master tensors, warmup + cosine schedule, and the
weight-decay grouping shared by the engine and by single-process references.
"""
from __future__ import annotations

import math
from typing import Iterable

import torch

from .config import OptimizerConfig, ScheduleConfig


def decays(name: str, shape: tuple[int, ...] | torch.Size) -> bool:
    """Weight decay applies to matrices (weights, embeddings), not to biases or norm gains."""
    return len(shape) >= 2


def param_groups(named_params: Iterable[tuple[str, torch.Tensor]], config: OptimizerConfig) -> list[dict]:
    """Two AdamW groups: decayed and not; the reference and the engine both use this split."""
    decay, no_decay = [], []
    for name, p in named_params:
        if p.requires_grad:
            (decay if decays(name, p.shape) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _kernel_flags(impl: str) -> dict:
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "single":
        return {"foreach": False}
    return {"fused": True}  # auto: torch's fused CPU/CUDA AdamW is the fastest correct kernel


def build_adamw(groups: list[dict], config: OptimizerConfig) -> torch.optim.AdamW:
    """torch AdamW with the configured kernel; groups as from param_groups (or their shards)."""
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                             **_kernel_flags(config.impl))


def lr_factor(step: int, schedule: ScheduleConfig) -> float:
    """Multiplier of the peak rate at optimizer step `step` (0-based): linear warmup, then cosine."""
    if schedule.warmup_steps and step < schedule.warmup_steps:
        return (step + 1) / schedule.warmup_steps
    if not schedule.decay_steps:
        return 1.0
    progress = min(1.0, (step - schedule.warmup_steps) / schedule.decay_steps)
    floor = schedule.min_lr_ratio
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def scheduled_lr(optimizer: OptimizerConfig, schedule: ScheduleConfig, step: int) -> float:
    """The learning rate of update number `step` (0-based): the peak rate times lr_factor, the
    product torch's LambdaLR forms (so both give the same float)."""
    return optimizer.lr * lr_factor(step, schedule)


def build_schedule(optimizer: torch.optim.Optimizer, schedule: ScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, schedule))


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor torch.nn.utils.clip_grad_norm_ applies: min(1, max_norm / (norm + 1e-6))."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
