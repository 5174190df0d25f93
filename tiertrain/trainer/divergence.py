"""Loss spikes and gradient-norm explosions, watched step by step, so that a checkpoint saved
while the run is diverging is marked (``checkpoint.mark_diverged``) and a resume passes over
it (issue 32; gradients that stay non-finite are the other way a run diverges, handled where
the step is skipped).

A step *spikes* when its loss, the mean over data-parallel ranks, exceeds
``checkpoint.loss_spike_factor`` times the largest loss of the previous
``checkpoint.spike_window`` steps, or its gradient norm ``checkpoint.grad_norm_spike_factor``
times the largest of theirs (Megatron-Core's rerun machinery flags a loss ten times the recent
maximum the same way). Spiking steps stay out of the window, so a run that keeps diverging is
judged against its last healthy steps; non-finite values are left to the skip logic (a skipped
step changed nothing). The window travels in every checkpoint, so that a resumed run judges its
steps as the uninterrupted run would have.
"""
from __future__ import annotations

import collections
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["Spike", "DivergenceWatch"]


@dataclass(frozen=True)
class Spike:
    """One step's loss or gradient norm far above the window's largest."""

    step: int
    what: str
    """"loss" or "gradient norm"."""
    value: float
    baseline: float
    """The largest value of the window."""
    window: int
    """Steps in the window."""

    def describe(self) -> str:
        ratio = self.value / self.baseline if self.baseline > 0 else math.inf
        return (f"step {self.step}'s {self.what} {self.value:.6g} is {ratio:.3g} times the largest of the previous "
                f"{self.window} steps ({self.baseline:.6g})")


class DivergenceWatch:
    """The window of recent healthy (loss, gradient norm) pairs and the latest step's spike."""

    def __init__(self, loss_factor: float, grad_norm_factor: float, window: int):
        self.loss_factor, self.grad_norm_factor = float(loss_factor), float(grad_norm_factor)
        self.history: collections.deque[tuple[float, float]] = collections.deque(maxlen=window)
        self.spike: Spike | None = None
        """The spike of the step observed last, None when it was healthy."""

    @property
    def enabled(self) -> bool:
        return self.loss_factor > 0 or self.grad_norm_factor > 0

    def observe(self, step: int, loss: float, grad_norm: float) -> Spike | None:
        """Judge one step (the same values on every rank, so every rank judges alike); returns
        its spike, or None."""
        self.spike = None
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            return None
        if self.history:
            for what, value, factor, index in (("loss", loss, self.loss_factor, 0),
                                               ("gradient norm", grad_norm, self.grad_norm_factor, 1)):
                baseline = max(h[index] for h in self.history)
                if factor > 0 and value > factor * baseline:
                    self.spike = Spike(step, what, value, baseline, len(self.history))
                    return self.spike
        self.history.append((float(loss), float(grad_norm)))
        return None

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(h) for h in self.history]}

    def load_state_dict(self, state: Any, source: str) -> None:
        """Restore a window saved by state_dict; ValueError naming ``source`` for anything else."""
        history = state.get("history") if isinstance(state, dict) else None
        if not isinstance(history, list) or not all(
                isinstance(h, (list, tuple)) and len(h) == 2
                and all(isinstance(v, (int, float)) and math.isfinite(v) for v in h) for h in history):
            raise ValueError(f"{source}: the saved divergence window is malformed (expected a list of finite "
                             f"[loss, gradient norm] pairs)")
        self.history.clear()
        self.history.extend((float(a), float(b)) for a, b in history[-(self.history.maxlen or 0):])
        self.spike = None
