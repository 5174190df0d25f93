"""Mixed precision: compute dtypes and the dynamic loss scaler for fp16.

Master weights and Adam state are always fp32 (ZeRO §1's K = 12 bytes per parameter);
gradients are accumulated and reduced in fp32 (as Megatron does for bf16), so only the
forward/backward arithmetic runs in the compute dtype.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import LossScaleConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


@dataclass
class ScalerState:
    scale: float
    good_steps: int = 0
    hysteresis_left: int = 1
    overflows: int = 0


class DynamicLossScaler:
    """fp16 loss scaling (Micikevicius et al.; DeepSpeed's hysteresis variant).

    The loss is multiplied by ``scale`` before backward; gradients are divided by it before
    the step. A step whose gradients hold inf/NaN anywhere (on any rank: the caller reduces
    the overflow flag first) is skipped, and after ``hysteresis`` such steps the scale is
    multiplied by ``backoff_factor``. ``growth_interval`` good steps in a row multiply it by
    ``growth_factor``.
    """

    def __init__(self, config: LossScaleConfig, enabled: bool = True):
        self.config = config
        self.enabled = enabled
        self.state = ScalerState(scale=config.initial_scale if enabled else 1.0,
                                 hysteresis_left=config.hysteresis)

    @property
    def scale(self) -> float:
        return self.state.scale

    def update(self, overflow: bool) -> None:
        """Advance after a step: lower the scale on overflow, grow it after a good run."""
        if not self.enabled:
            return
        s, c = self.state, self.config
        if overflow:
            s.overflows += 1
            s.good_steps = 0
            s.hysteresis_left -= 1
            if s.hysteresis_left <= 0:
                s.scale = max(s.scale * c.backoff_factor, c.min_scale)
                s.hysteresis_left = c.hysteresis
            return
        s.good_steps += 1
        if s.good_steps % c.growth_interval == 0:
            s.scale *= c.growth_factor
            s.hysteresis_left = c.hysteresis

    def state_dict(self) -> dict:
        return dict(vars(self.state))

    def load_state_dict(self, state: dict) -> None:
        self.state = ScalerState(**state)
