"""Context parallelism for Hugging Face decoders (Llama, Mistral, Qwen2, Qwen3), through the
model's own attention interface: no modeling code is copied (issue 38, item 1).

:func:`convert_hf_decoder` registers one attention function with transformers'
``AttentionInterface`` and selects it with ``model.set_attn_implementation``; each attention
module is told its cp group. The model's class is swapped for a subclass (as FSDP2's
``fully_shard`` does) whose ``forward`` takes the whole batch, as before, and runs the model on
this rank's tokens with their positions in the whole sequence (``position_ids``: the rotary
embedding rotates each token by its global position). The loss is computed there, exact over
the cp group (tiertrain/parallel/context.py :func:`exact_token_mean`), from

* ``labels`` as transformers takes them (the token at each position; shifted by one here,
  before the split, so the target of a rank's last token is the next rank's first), or
* ``shift_labels``, already the next token's (tiertrain's datasets: ``labels = tokens[1:]``).

An ``attention_mask`` is accepted when it only pads on the right (each row's ones, then zeros):
under a causal mask no real token attends to the padding, and padded positions are not scored.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import transformers

from ..models.hf import ROTARY_DECODERS
from ..tiling import cross_entropy_in_tiles, summed_cross_entropy
from .context import (ContextParallelError, GatherSequence, context_split, exact_token_mean, next_token_labels,
                      ring_attention, ulysses_attention)

__all__ = ["ATTENTION_NAME", "convert_hf_decoder"]

ATTENTION_NAME = "tiertrain_context_parallel"
"""The name tiertrain's attention is registered under in transformers' AttentionInterface."""

ALGORITHMS = {"ring": ring_attention, "ulysses": ulysses_attention}


def context_parallel_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                               scaling: float | None = None, is_causal: bool | None = None,
                               sliding_window: int | None = None, softcap: float | None = None, **kwargs):
    """transformers' attention-function signature: q [b, h, s/cp, d], k and v [b, h_kv, s/cp, d]
    (this rank's tokens) in, [b, s/cp, h, d] out, attending over the whole sequence."""
    group = getattr(module, "cp_group", None)
    algorithm = getattr(module, "cp_algorithm", None)
    if algorithm is None:
        raise ContextParallelError(f"{type(module).__name__} runs tiertrain's context-parallel attention but was not "
                                   f"converted: use tiertrain.parallel.apply_context_parallel(model, topology)")
    if dropout:
        raise ContextParallelError(f"attention dropout {dropout} in training: context-parallel attention has none; "
                                   f"set the model config's attention_dropout to 0")
    if softcap is not None:
        raise ContextParallelError(f"attention logit soft-capping ({softcap}) is not supported by context-parallel "
                                   f"attention")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = ALGORITHMS[algorithm](query, key, value, group, causal=causal, scale=scaling, window=sliding_window)
    return out.transpose(1, 2).contiguous(), None


def _right_padding_only(mask: torch.Tensor) -> None:
    """An attention mask whose zeros all follow its ones in each row; otherwise an error."""
    if mask.dim() != 2:
        raise ContextParallelError(f"attention_mask of shape {tuple(mask.shape)}: context parallelism takes a "
                                   f"[batch, seq] padding mask")
    ones = mask.bool()
    if bool((ones[:, 1:] & ~ones[:, :-1]).any()):
        raise ContextParallelError("attention_mask pads on the left (or between tokens): context-parallel attention "
                                   "is causal without a mask, which is exact only for padding on the right; pad "
                                   "sequences on the right")


def _forward(self, input_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None,
             attention_mask: torch.Tensor | None = None, shift_labels: torch.Tensor | None = None,
             **kwargs: Any):
    """The whole batch in; the model run on this rank's tokens; the loss exact over the cp
    group (or, with no labels, the logits of the whole sequence)."""
    for name in ("position_ids", "inputs_embeds", "past_key_values", "cache_position"):
        if kwargs.get(name) is not None:
            raise ContextParallelError(f"{name}= is not supported by a context-parallel model: it computes each "
                                       f"rank's positions itself from the whole input_ids")
    if input_ids is None or input_ids.dim() != 2:
        raise ContextParallelError("a context-parallel model takes input_ids of shape [batch, seq]")
    if labels is not None and shift_labels is not None:
        raise ContextParallelError("give labels (the model shifts them) or shift_labels (already shifted), not both")
    group, algorithm = self.cp_group, self.cp_algorithm
    split = lambda x: context_split(x, 1, group, algorithm)
    b, t = input_ids.shape
    if labels is not None:
        shift_labels = next_token_labels(labels)
    if attention_mask is not None:
        _right_padding_only(attention_mask)
        if shift_labels is not None:
            shift_labels = shift_labels.masked_fill(attention_mask == 0, -100)
    positions = split(torch.arange(t, device=input_ids.device).expand(b, t))
    kwargs["use_cache"] = False
    if shift_labels is None:
        out = self.cp_base.forward(self, input_ids=split(input_ids), position_ids=positions, **kwargs)
        out.logits = GatherSequence.apply(out.logits, group, algorithm)
        return out
    mine = split(shift_labels)
    if self.cp_loss_tile:  # the decoder's hidden states, then the head and loss one tile at a time
        hidden = self.get_decoder()(input_ids=split(input_ids), position_ids=positions, **kwargs).last_hidden_state
        summed = cross_entropy_in_tiles(hidden, self.get_output_embeddings(), mine.to(hidden.device), self.cp_loss_tile)
        out = transformers.modeling_outputs.CausalLMOutputWithPast(logits=None)
    else:
        out = self.cp_base.forward(self, input_ids=split(input_ids), position_ids=positions, **kwargs)
        summed = summed_cross_entropy(out.logits, mine)
    out.loss = exact_token_mean(summed, (mine != -100).sum(), group)
    return out


@functools.cache
def _converted_class(base: type) -> type:
    """The subclass of ``base`` with the context-parallel forward (one per base class, so that
    models of one class share it, as FSDP2's ``fully_shard`` classes are shared)."""
    return type(f"ContextParallel{base.__name__}", (base,), {"forward": _forward, "cp_base": base, "__module__": __name__})


def convert_hf_decoder(model, group, size: int, algorithm: str, loss_tile_tokens: int = 0):
    """Convert a transformers causal LM of a recognised decoder family in place; returns it."""

    config = model.config
    model_type = getattr(config, "model_type", None)
    if model_type not in ROTARY_DECODERS:
        raise TypeError(f"apply_context_parallel converts tiertrain's GPT and the Hugging Face decoders "
                        f"{sorted(ROTARY_DECODERS)}; got a {type(model).__name__} (model_type {model_type!r})")
    heads = config.num_attention_heads
    if algorithm == "ulysses" and heads % size:
        raise ContextParallelError(f"num_attention_heads={heads} is not divisible by parallel.cp={size}: Ulysses "
                                   f"splits the heads over the context-parallel ranks; use ring attention")
    if getattr(config, "attention_dropout", 0.0):
        raise ContextParallelError(f"attention_dropout={config.attention_dropout}: context-parallel attention has "
                                   f"no dropout; set it to 0")
    transformers.AttentionInterface.register(ATTENTION_NAME, context_parallel_attention)
    model.set_attn_implementation(ATTENTION_NAME)
    for module in model.modules():
        if hasattr(module, "config"):
            module.cp_group, module.cp_algorithm, module.cp_size = group, algorithm, size
    model.__class__ = _converted_class(type(model))
    model.cp_loss_tile = loss_tile_tokens
    return model
