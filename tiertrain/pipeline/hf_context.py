"""Context parallelism in the pipeline stages of a Hugging Face rotary decoder (issue 38, cp × pp).

A model converted by :func:`tiertrain.parallel.apply_context_parallel` (tiertrain/parallel/cp_hf.py:
its attention modules run ring or Ulysses attention over their cp group) and cut by
:func:`~.hf_split.split_hf` runs in each stage on this rank's share of the tokens: the first
stage embeds them, every stage rotates them by their places in the whole sequence, and the last
stage scores them with the exact token mean over the cp group, as the converted model's own
forward does at pp = 1 (with a vocabulary-parallel lm_head, from the vocab-sharded logits, as
tiertrain's tensor-parallel GPT does). The labels are shifted before the split (as
transformers' causal-LM loss shifts them), so the target of a rank's last token may be the
first token of another rank.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from ..parallel.context import ContextParallelError, context_split, exact_token_mean, next_token_labels
from ..tiling import cross_entropy_in_tiles, summed_cross_entropy

__all__ = ["check_stage", "local_tokens", "token_mean_share"]


def _vocab_parallel(head) -> bool:
    """Whether ``head`` is a vocabulary-parallel lm_head (a 'colwise' plan's, its logits [.., V/tp])."""
    from ..parallel.tensor import ColumnParallelLinear, tp_world_size

    return isinstance(head, ColumnParallelLinear) and not head.gather_output and tp_world_size(head.group) > 1


def check_stage(stage: nn.Module, model: nn.Module) -> None:
    """Refuse what a context-parallel stage cannot score exactly (the message says what works)."""
    if stage.kind != "rotary":
        raise ContextParallelError(f"a {stage.kind} model's pipeline stages do not run context parallelism; "
                                   f"apply_context_parallel converts the rotary decoders (Llama, Mistral, Qwen2, "
                                   f"Qwen3)")
    if stage.cp_loss_tile and _vocab_parallel(getattr(model, "lm_head", None)):
        raise ContextParallelError(f"activations.loss_tile_tokens={stage.cp_loss_tile} with a vocabulary-parallel "
                                   f"lm_head ('colwise' in the tensor-parallel plan): the loss in tiles is not "
                                   f"supported with vocab-sharded logits yet; set it to 0, or keep lm_head whole")


def local_tokens(stage: nn.Module, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(this rank's ids [B, T/cp], their positions in the whole sequence [1, T/cp])."""
    whole = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
    split = lambda x: context_split(x, 1, stage.cp_group, stage.cp_algorithm)  # noqa: E731
    return split(ids), split(whole)


def token_mean_share(stage: nn.Module, hidden: torch.Tensor, labels: torch.Tensor, shift: bool) -> torch.Tensor:
    """This rank's share of the batch's token-mean loss (``exact_token_mean``), from its final
    hidden states (after the norm) [B, T/cp, d] and the whole batch's labels [B, T]; ``shift``:
    the labels are the tokens themselves (transformers' causal-LM loss), shifted here, before the
    split."""
    if shift:
        labels = next_token_labels(labels)
    mine = context_split(labels, 1, stage.cp_group, stage.cp_algorithm).to(hidden.device)
    labelled = (mine != -100).sum()
    if stage.cp_loss_tile:
        summed = cross_entropy_in_tiles(hidden, stage.lm_head, mine, stage.cp_loss_tile)
    elif _vocab_parallel(stage.lm_head):  # the vocab-parallel cross-entropy's mean, times its tokens
        from ..parallel.tensor import vocab_parallel_cross_entropy

        logits = stage.lm_head(hidden)  # [B, T/cp, V/tp]
        mean = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), mine.reshape(-1),
                                            stage.lm_head.group)
        # (a rank none of whose tokens is labelled: 0, as the summed loss is, not the mean's 0/0)
        summed = torch.where(labelled > 0, mean * labelled, logits.sum() * 0)
    else:
        summed = summed_cross_entropy(stage.lm_head(hidden), mine)
    return exact_token_mean(summed, labelled, stage.cp_group)
