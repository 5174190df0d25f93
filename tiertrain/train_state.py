"""The engine's counters and the RNG state: checkpoint parts (tiertrain/checkpoint.py) besides
the optimizer-step form and the loss scaler."""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class TrainState:
    """The engine's counters: a checkpoint part."""

    micro_steps: int = 0
    steps: int = 0
    """Optimizer updates applied; update k uses the schedule's rate for k."""
    skipped_steps: int = 0
    """fp16 steps skipped on overflow."""

    def state_dict(self) -> dict:
        return {"micro_steps": self.micro_steps, "steps": self.steps, "skipped_steps": self.skipped_steps}

    def load_state_dict(self, state: dict) -> None:
        self.micro_steps, self.steps, self.skipped_steps = (state["micro_steps"], state["steps"],
                                                            state["skipped_steps"])


class RNGState:
    """torch's CPU generator: a checkpoint part, so a resumed run draws the same numbers."""

    def state_dict(self) -> dict:
        return {"cpu": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
