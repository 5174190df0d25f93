"""A model that checkpoints its own blocks (transformers' ``gradient_checkpointing_enable``),
as the estimator and the planner must see it: its blocks keep only their inputs, as with the
engine's ``activations.checkpoint_every``, and the engine refuses to add its own beside it
(tiertrain.offload.activations), so a plan never chooses any and the estimate counts the
model's checkpoints instead."""
from __future__ import annotations

import dataclasses
from typing import Any

from ..tiers import Tier

__all__ = ["with_own_checkpointing"]


def with_own_checkpointing(layout: Any, dims: Any) -> tuple[Any, str | None]:
    """(layout, note): the layout the estimate must count for a model that checkpoints its own
    blocks — its interval, the checkpoints on the device, whole blocks recomputed — and a
    note saying so; the layout unchanged (note None) for any other model. ValueError when the
    layout adds the engine's checkpointing too, which the engine refuses."""
    own = getattr(dims, "own_checkpointing", 0) or 0
    if not own:
        return layout, None
    if layout.checkpoint_interval:
        raise ValueError(f"checkpoint_interval={layout.checkpoint_interval} is invalid for this model: it checkpoints "
                         f"every {own}-th block itself (transformers' gradient_checkpointing_enable), and the engine "
                         f"refuses activations.checkpoint_every beside it; estimate with checkpoint_interval=0")
    own = min(own, dims.n_layers)
    note = (f"the model checkpoints every {own}-th block itself (transformers' gradient_checkpointing_enable): "
            f"counted as activations.checkpoint_every={own} on the device, none added by the engine")
    return dataclasses.replace(layout, checkpoint_interval=own, checkpoint_tier=Tier.DEVICE, recompute="block"), note
