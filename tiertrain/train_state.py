"""The engine's counters and the RNG state: checkpoint parts (tiertrain/state/checkpoint.py) besides
the optimizer-step form and the loss scaler."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .device import device_module, is_accelerator


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
    """torch's CPU generator and, on an accelerator, the device's generator (dropout draws
    there): a checkpoint part, so a resumed run draws the same numbers. A checkpoint's tensors
    are loaded onto the compute device, and torch takes generator states as CPU tensors only."""

    def __init__(self, device: torch.device = torch.device("cpu")):
        self.device = torch.device(device)

    def state_dict(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if is_accelerator(self.device):
            state["device"] = device_module(self.device).get_rng_state(self.device)
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"].cpu())
        # (A checkpoint from a CPU run leaves the device's generator as seeded; one from an
        # accelerator resumed on the CPU has no device generator to restore.)
        if "device" in state and is_accelerator(self.device):
            device_module(self.device).set_rng_state(state["device"].cpu(), self.device)
