"""Next-token labels given in the other model family's convention fail by name.

tiertrain's GPT takes its labels shifted already (``labels[:, t] = input_ids[:, t + 1]``, as
its data pipeline and nanoGPT-style loaders give them); a Hugging Face causal LM takes
``labels = input_ids`` and shifts them inside (what ``DataCollatorForLanguageModeling``
gives). Mixed up, training runs and the loss falls, toward the wrong objective: the GPT learns
to copy its input token, the Hugging Face model to predict the token after next. Nothing else
would say so.

The first batches are checked (:data:`BATCHES_CHECKED`). A batch proves the mix-up when every
labelled position (label != -100) holds the other convention's target and at least one of them
differs from this convention's (the next token differs from the current one): labels of the
right convention never satisfy both, so a correct batch is never refused. A batch of one token repeated proves nothing and passes.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from .errors import TiertrainError

IGNORE_INDEX = -100
"""The label of a position that takes no loss (torch's cross_entropy default, Hugging Face's)."""

BATCHES_CHECKED = 8
"""How many batches a model (or an engine, for its default loss) checks: the convention is the
data pipeline's, the same for every batch, so later ones are left alone (a check of tensors on
an accelerator makes the host wait for it)."""


class LabelConventionError(TiertrainError, ValueError):
    """The labels follow the other family's next-token convention (see the module docstring)."""

    exit_code = 1


def _proves(labels: torch.Tensor, input_ids: torch.Tensor, shifted: bool) -> bool:
    """Whether labels are, at every labelled position t < T-1, input_ids[t+1] (shifted) or
    input_ids[t] (not shifted), and at one of them the two differ."""
    labels, current, following = labels[..., :-1], input_ids[..., :-1], input_ids[..., 1:]
    labelled = labels != IGNORE_INDEX
    if not bool(labelled.any()):
        return False
    target = following if shifted else current
    matches = bool(((labels == target) | ~labelled).all())
    return matches and bool((labelled & (current != following)).any())


@torch.compiler.disable  # (a check of data, never a graph: called from a compiled model's eager frames too)
def check_gpt_labels(input_ids: torch.Tensor, labels: torch.Tensor) -> None:
    """tiertrain's GPT: refuse labels equal to input_ids (the Hugging Face convention)."""
    if labels.shape == input_ids.shape and labels.dtype == input_ids.dtype and _proves(labels, input_ids, False):
        raise LabelConventionError(
            "labels equal input_ids at every labelled position: tiertrain's GPT takes its labels shifted already "
            "(labels[:, t] = input_ids[:, t + 1], the next token), as Hugging Face causal LMs do not; with these it "
            "would learn to copy its input. Pass labels = tokens[:, 1:] beside input_ids = tokens[:, :-1] (set the "
            "last position to -100 if the sequence ends there)")


def _hf_causal_lm(model: nn.Module) -> nn.Module | None:
    """The Hugging Face causal LM the model is, or wraps as a peft model (get_base_model), or None."""
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    kind = type(base)
    return base if kind.__module__.startswith("transformers.") and kind.__name__.endswith("ForCausalLM") else None


@torch.compiler.disable
def check_batch_labels(model: nn.Module, batch: Any) -> None:
    """A Hugging Face causal LM (or a peft model of one) called with a dict batch: refuse labels
    shifted already."""
    causal = _hf_causal_lm(model) if isinstance(batch, dict) else None
    if causal is None:
        return
    input_ids, labels = batch.get("input_ids"), batch.get("labels")
    if not (isinstance(input_ids, torch.Tensor) and isinstance(labels, torch.Tensor)):
        return
    if labels.shape == input_ids.shape and _proves(labels, input_ids, True):
        raise LabelConventionError(
            f"labels are input_ids shifted by one (labels[:, t] = input_ids[:, t + 1]) at every labelled position, "
            f"but {type(causal).__name__} shifts its labels itself: it would learn to predict the token after next. "
            f"Pass labels = input_ids (with -100 where no loss is wanted), as DataCollatorForLanguageModeling does")


__all__ = ["BATCHES_CHECKED", "IGNORE_INDEX", "LabelConventionError", "check_batch_labels", "check_gpt_labels"]
