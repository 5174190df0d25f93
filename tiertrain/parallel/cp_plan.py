"""Context parallelism applied to a model: every rank of a cp group is given the same samples,
embeds, attends with and scores only its share of each sequence's tokens (issue 38).

:func:`apply_context_parallel` converts tiertrain's GPT in place (its class swapped, as
:func:`~tiertrain.parallel.tp_plan.apply_tensor_parallel` does). The converted model takes the
whole ``input_ids`` and ``labels`` ``[B, T]`` as before and keeps its rank's tokens: the zig-zag
pair of chunks for ring attention (causal load balance), a contiguous T/cp for Ulysses. Each
rank's positions are those tokens' places in the whole sequence.

The loss is exact over the cp group: each rank returns ``cp · (its tokens' summed loss) /
(the labelled tokens of the whole batch)``, the count summed over the group, so the engine's
mean over the dp × cp ranks (tiertrain/engine.py: every replica's loss scaled by 1/(dp·cp))
is the mean over every labelled token of the batch: no token counted twice or lost, however
the -100 labels fall between the ranks.
"""
from __future__ import annotations

import torch

from ..models.gpt import GPT, CausalSelfAttention
from .tensor import GatherFromTensorParallel, tp_world_size, vocab_parallel_cross_entropy
from .tp_plan import TensorParallelGPT
from ..tiling import cross_entropy_in_tiles, summed_cross_entropy
from .context import (ContextParallelError, GatherSequence, _size, context_split, exact_token_mean, ring_attention,
                      tokens_multiple, ulysses_attention)

__all__ = ["CP_ATTRIBUTES", "ContextParallelGPT", "apply_context_parallel", "cp_attributes"]

CP_ATTRIBUTES = {"cp_group": None, "cp_algorithm": "ring", "cp_size": 1, "cp_loss_tile": 0}
"""What a converted model carries (a pipeline stage of it copies them: tiertrain/pipeline/stage.py,
hf_split.py), with their values for a model that is not context-parallel."""


def cp_attributes(model) -> dict:
    """The model's context-parallel attributes (:data:`CP_ATTRIBUTES`), or those of no cp."""
    return {name: getattr(model, name, default) for name, default in CP_ATTRIBUTES.items()}

ALGORITHMS = {"ring": ring_attention, "ulysses": ulysses_attention}


class ContextParallelAttention(CausalSelfAttention):
    """:class:`CausalSelfAttention` over this rank's tokens, attending to the whole sequence by
    the group's context-parallel algorithm."""

    cp_group = None
    cp_algorithm = "ring"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)
        n_heads = qkv.shape[-1] // (3 * self.head_dim)
        q, k, v = qkv.view(b, t, n_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        y = ALGORITHMS[self.cp_algorithm](q, k, v, self.cp_group, causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, n_heads * self.head_dim)))


def _arch(module) -> type:
    """The converted model's class: the module's own, or for a pipeline stage the class of
    the model it was cut from (its ``arch``)."""
    return getattr(module, "arch", type(module))


class ContextParallelGPT(GPT):
    """A :class:`GPT` after :func:`apply_context_parallel`. Attributes: ``cp_group``,
    ``cp_algorithm``, ``cp_size``, ``cp_loss_tile`` (:data:`CP_ATTRIBUTES`)."""

    cp_group = None
    cp_algorithm = "ring"
    cp_size = 1
    cp_loss_tile = 0

    def __init__(self, *args, **kwargs):
        raise TypeError("ContextParallelGPT is not constructed directly: build a GPT and call "
                        "apply_context_parallel(model, topology)")

    # GPT.forward runs embed_tokens, the blocks and head_output; a pipeline stage of this model
    # (tiertrain/pipeline/stage.py) runs the same two methods on itself, carrying the model's
    # cp attributes and naming the model's class as ``arch``: so the maths is written once.

    def position_ids(self, t: int, device: torch.device) -> torch.Tensor:
        """The places in the whole sequence of this rank's tokens (its zig-zag pair of chunks
        for ring attention, its contiguous 1/cp for Ulysses)."""
        whole = torch.arange(t, device=device).unsqueeze(0)
        return context_split(whole, 1, self.cp_group, self.cp_algorithm).squeeze(0)

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The whole batch's ``input_ids`` [B, T] in; this rank's tokens, embedded at their
        global positions, out: [B, T/cp, hidden]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"input_ids sequence length {t} exceeds GPTConfig.seq_len={self.config.seq_len}")
        mine = context_split(input_ids, 1, self.cp_group, self.cp_algorithm)
        return self.drop(self.embed(mine) + self.pos_embed(self.position_ids(t, input_ids.device)))

    def head_output(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's activations [B, T/cp, hidden] and the whole batch's ``labels`` [B, T]
        (already shifted: split as the inputs are) in; this rank's share of the exact
        token-mean loss out (see the module docstring), or without labels the logits of the
        whole sequence [B, T, V]."""
        arch = _arch(self)
        if labels is None:
            return GatherSequence.apply(arch._logits(self, x), self.cp_group, self.cp_algorithm)
        mine = context_split(labels, 1, self.cp_group, self.cp_algorithm)
        return exact_token_mean(arch._summed_loss(self, x, mine), (mine != -100).sum(), self.cp_group)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(x))

    def _summed_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """The cross-entropy summed over this rank's labelled tokens (in tiles, when set)."""
        logits_of = lambda h: _arch(self)._logits(self, h)  # noqa: E731
        if self.cp_loss_tile:
            return cross_entropy_in_tiles(x, logits_of, labels, self.cp_loss_tile)
        return summed_cross_entropy(logits_of(x), labels)


class ContextParallelTensorParallelGPT(ContextParallelGPT, TensorParallelGPT):
    """A :class:`~tiertrain.parallel.tp_plan.TensorParallelGPT` (without sequence parallelism)
    after :func:`apply_context_parallel`: the cp ranks split each sequence, the tp ranks of each
    split the heads, MLP and vocabulary (Megatron §2.3); the loss from the vocab-sharded logits."""

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return GatherFromTensorParallel.apply(self.head(self.norm(x)), self.tp_group)

    def _summed_loss(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.norm(x))  # [B, T/cp, V/tp]
        labelled = (labels != -100).sum()
        mean = vocab_parallel_cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), self.tp_group)
        # (a rank none of whose tokens is labelled: 0, as the summed loss is, not the mean's 0/0)
        return torch.where(labelled > 0, mean * labelled, logits.sum() * 0)


def apply_context_parallel(model, topology, algorithm: str = "ring", loss_tile_tokens: int = 0):
    """Convert a model in place to context parallelism over ``topology``'s cp axis
    (``topology`` may also be a process group or None) with ``algorithm`` ("ring" or
    "ulysses"); returns the same object: tiertrain's GPT becomes a :class:`ContextParallelGPT`,
    a Hugging Face Llama, Mistral, Qwen2 or Qwen3 causal LM its context-parallel subclass
    (tiertrain/parallel/cp_hf.py). ``loss_tile_tokens`` (activations.loss_tile_tokens): the
    loss over tiles of that many tokens (tiertrain.tiling.cross_entropy_in_tiles)."""
    if isinstance(loss_tile_tokens, bool) or not isinstance(loss_tile_tokens, int) or loss_tile_tokens < 0:
        raise ContextParallelError(f"activations.loss_tile_tokens={loss_tile_tokens!r} is invalid: expected a "
                                   f"number of tokens >= 0 (0: no tiles)")
    if algorithm not in ALGORITHMS:
        raise ContextParallelError(f"parallel.cp_algorithm={algorithm!r} is unknown: valid are "
                                   f"{', '.join(ALGORITHMS)}")
    is_grid = hasattr(topology, "group") and callable(topology.group)
    group = topology.group("cp") if is_grid else topology
    c = topology.size("cp") if is_grid else _size(group)
    converted = {GPT: ContextParallelGPT, TensorParallelGPT: ContextParallelTensorParallelGPT}.get(type(model))
    if converted is None:
        if isinstance(model, GPT):
            raise TypeError(f"apply_context_parallel converts tiertrain's GPT, or one tensor-parallel, not a "
                            f"{type(model).__name__}")
        from .cp_hf import convert_hf_decoder

        return convert_hf_decoder(model, group, c, algorithm, loss_tile_tokens)
    if getattr(model, "sequence_parallel", False):
        raise ContextParallelError("a tensor-parallel GPT with sequence parallelism already splits each sequence "
                                   "over its tp ranks: convert it with apply_tensor_parallel(..., "
                                   "sequence_parallel=False) before context parallelism")
    if converted is ContextParallelTensorParallelGPT and loss_tile_tokens:
        raise ContextParallelError(f"activations.loss_tile_tokens={loss_tile_tokens} with tensor parallelism: the "
                                   f"loss in tiles is not supported with vocab-sharded logits yet; set it to 0")
    cfg = model.config
    if cfg.dropout:
        raise ContextParallelError(f"GPTConfig.dropout={cfg.dropout}: context-parallel attention has no dropout; "
                                   f"set dropout=0")
    if cfg.seq_len % tokens_multiple(c, algorithm):
        raise ContextParallelError(f"GPTConfig.seq_len={cfg.seq_len} cannot be split over parallel.cp={c} with "
                                   f"{algorithm}: it needs a multiple of {tokens_multiple(c, algorithm)}")
    tp = tp_world_size(getattr(model, "tp_group", None))
    if algorithm == "ulysses" and (cfg.n_heads // tp) % c:
        raise ContextParallelError(f"GPTConfig.n_heads={cfg.n_heads}" + (f" over tp={tp} ranks" if tp > 1 else "")
                                   + f" is not divisible by parallel.cp={c}: Ulysses splits each rank's heads over "
                                   f"the context-parallel ranks; use ring attention")
    for block in model.blocks:
        block.attn.__class__ = ContextParallelAttention
        block.attn.cp_group, block.attn.cp_algorithm = group, algorithm
    model.__class__ = converted
    model.cp_group, model.cp_algorithm, model.cp_size, model.cp_loss_tile = group, algorithm, c, loss_tile_tokens
    return model
