"""What the engine is given besides the model, config and topology: the loss function it calls on
each micro-batch (``LossFn``; :func:`default_loss` when none is given) and the state I/O its
checkpoint and export methods call (``StateIO``, over ``Stateful`` parts; tiertrain.wrap() passes
tiertrain/state/engine_io.py).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Mapping, Protocol

import torch
import torch.nn as nn

if TYPE_CHECKING:
    from .training_core import TrainingCore

__all__ = ["LossFn", "StateIO", "Stateful", "default_loss"]

LossFn = Callable[[nn.Module, Any], torch.Tensor]


class Stateful(Protocol):
    """A checkpoint part: anything with state_dict() and load_state_dict()."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class StateIO(Protocol):
    """What the engine's checkpoint and export methods call: reading and writing its state
    lives above the engine (tiertrain/state/engine_io.py, which tiertrain.wrap() passes in),
    so the engine imports none of it. Each function takes the engine and reads its parts."""

    def fingerprint(self, engine: "TrainingCore") -> dict: ...

    def shard_description(self, engine: "TrainingCore") -> dict: ...

    def rank_state(self, parts: Mapping[str, Stateful]) -> dict: ...

    def restore_rank_state(self, parts: Mapping[str, Stateful], state: dict) -> None: ...

    def save_checkpoint(self, engine: "TrainingCore", directory: str, extra: dict | None, keep_last: int, run_id: str,
                        background: bool, background_group: Any) -> Any:
        """The step directory (str), or a pending background save (wait_serialized(), wait())."""

    def load_checkpoint(self, engine: "TrainingCore", directory: str, step: int | None, reshard: bool) -> dict: ...

    def load_deepspeed_checkpoint(self, engine: "TrainingCore", directory: str, tag: str | None) -> dict: ...

    def load_dcp_checkpoint(self, engine: "TrainingCore", path: str) -> dict: ...

    def save_pretrained(self, engine: "TrainingCore", directory: str, dtype: Any = None, max_shard_bytes: int | None = None,
                        peft: Any = None) -> Any: ...


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Call the model on the batch (dict → keywords, tuple → positional) and find the loss.
    (The engine checks its first batches' labels for this loss: label_conventions.py.)"""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if isinstance(out, torch.Tensor):
        loss = out
    elif isinstance(out, dict) and "loss" in out:
        loss = out["loss"]
    elif getattr(out, "loss", None) is not None:
        loss = out.loss
    else:
        raise TypeError(f"the model returned {type(out).__name__} with no loss; pass loss_fn=... to wrap()")
    if loss.dim() != 0:
        raise TypeError(f"the loss must be a scalar, got shape {tuple(loss.shape)}; pass loss_fn=... to wrap()")
    return loss
