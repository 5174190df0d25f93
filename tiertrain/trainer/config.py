"""The training loop's config: the engine's :class:`~tiertrain.config.Config` sections plus
the run length, the seed and evaluation. ``tiertrain train``'s TrainConfig extends it with
the model and the data it builds."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..config import Config, _check_positive, check_finite

__all__ = ["EvalConfig", "LoopConfig"]


@dataclass
class EvalConfig:
    every: int = 0
    """Evaluate on the held-out data every this many optimizer steps and after the last one; 0: never."""
    batches: int = 8
    """Micro-batches per data-parallel rank in each evaluation (fewer when the held-out data ends first)."""

    def validate(self, path: str = "eval") -> None:
        _check_positive(f"{path}.every", self.every, allow_zero=True)
        _check_positive(f"{path}.batches", self.batches)


@dataclass
class LoopConfig(Config):
    """A run of the training loop (tiertrain.trainer.Trainer): engine sections + steps, seed, eval."""

    steps: int = 250
    """Optimizer steps to run (each of batch.grad_accum_steps micro-batches per rank)."""
    seed: int = 0
    """Seed of the model initialisation (the same on every rank)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Periodic evaluation on held-out data."""

    def validate(self) -> "LoopConfig":
        check_finite(self)
        for f in dataclasses.fields(Config):
            getattr(self, f.name).validate(f.name)
        Config.validate(self.engine_config())  # the cross-section rules of the engine's Config
        _check_positive("steps", self.steps)
        _check_positive("seed", self.seed, allow_zero=True)
        self.eval.validate("eval")
        return self

    def engine_config(self) -> Config:
        """The plain engine Config (the sections wrap() reads)."""
        return Config(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Config)})
