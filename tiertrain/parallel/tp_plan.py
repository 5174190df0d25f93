"""Apply Megatron tensor (and sequence) parallelism to a model from a plan.

A *plan* maps module names to parallel styles, like torchtitan's ``parallelize_module``
plans. Keys are :mod:`fnmatch` patterns over ``model.named_modules()`` names (``*`` also
matches dots, so ``"blocks.*.attn.qkv"`` names the qkv of every block); every key must match
at least one module. Styles:

``"colwise"``
    ``nn.Linear`` → :class:`ColumnParallelLinear` (output features split; input all-gathered
    along the sequence under sequence parallelism, else preceded by **f**).
``"rowwise"``
    ``nn.Linear`` → :class:`RowParallelLinear` (input features split, input already
    parallel; output all-reduced, or reduce-scattered along the sequence under sequence
    parallelism; bias replicated).
``"vocab"``
    ``nn.Embedding`` → :class:`VocabParallelEmbedding` (vocabulary split; output
    all-reduced, or reduce-scattered along the sequence).
``"sequence"``
    the module stays as it is (its parameters replicated) but runs on a sequence chunk under
    sequence parallelism, so its own parameters get ``tp_partial_grad = True``: LayerNorms,
    position embeddings. Without sequence parallelism it is a no-op.
a callable ``(module, group, sequence_parallel) -> nn.Module``
    any other conversion; the returned module replaces the matched one.

Modules the plan does not name stay replicated with full gradients. Weight tying is kept:
when two planned modules share a parameter and both shard it along the same dimension (a
vocab-parallel embedding and a column-parallel head both split dim 0 of a ``[V, H]``
weight), they share the one shard; a tied parameter sharded by one module and left whole
(or split differently) by another raises ValueError.

Writing a plan for another model (say a LLaMA-style block ``attn.{q,k,v,o}``,
``mlp.{gate,up,down}``, ``norm``s, ``tok_embeddings``, ``output``)::

    plan = {
        "tok_embeddings": "vocab",
        "layers.*.attention_norm": "sequence", "layers.*.ffn_norm": "sequence", "norm": "sequence",
        "layers.*.attention.w[qkv]": "colwise", "layers.*.attention.wo": "rowwise",
        "layers.*.feed_forward.w[13]": "colwise", "layers.*.feed_forward.w2": "rowwise",
        "output": "colwise",
    }
    parallelize_module(model, topology.group("tp"), plan, sequence_parallel=True)

then check three things the plan cannot see:

1. Code that reads head counts or widths from config must derive them from the (now
   sharded) tensors instead: colwise outputs carry ``1/t`` of the heads/features. Column
   splits must cut whole heads (a contiguous dim-0 chunk of q/k/v, or of a fused qkv laid
   out per head, as :mod:`tiertrain.models.gpt` does).
2. Under sequence parallelism, everything between the tensor-parallel blocks holds
   ``seq/t`` positions: code that reads the sequence length from the block input (attention
   reshapes, position embeddings, rotary tables, masks) must use the local length and
   offset ``tp_rank · seq/t``.
3. The loss: a colwise ``output`` yields vocab-sharded logits; feed them to
   :func:`vocab_parallel_cross_entropy` (never gather them for the loss).

:func:`apply_tensor_parallel` does all of this for the reference GPT.

Gradients after backward: sharded parameters (``tp_sharded``) hold the gradient of their
slice — complete, no tp communication needed. Replicated parameters hold identical full
gradients on every tp rank, except under sequence parallelism where those marked
``tp_partial_grad`` (LayerNorms, row-parallel biases, the position embedding) hold partial
sums: call :func:`tensor_parallel_grad_sync` before clipping/stepping. The global gradient
norm is :func:`tensor_parallel_grad_norm` (sharded squares summed over tp, replicated ones
counted once).

Dropout caveat: tp ranks draw dropout masks from their own global RNG. With equal seeds,
replicated-region dropout (embeddings, residuals) gets identical masks on every rank, which
is what the non-sequence-parallel region needs; but attention-probability dropout then uses
the same mask pattern on every rank's heads, and sequence-parallel dropout the same pattern
on every sequence chunk. Megatron uses a separate "model-parallel" RNG stream for those
regions; that tracker is not implemented yet, so runs with ``dropout > 0`` are valid
training but not equal to the tp=1 run (tests use dropout 0).
"""
from __future__ import annotations

import fnmatch
from typing import Callable, Mapping, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..models.gpt import GPT, CausalSelfAttention
from .tensor import (
    ColumnParallelLinear,
    GatherFromTensorParallel,
    RowParallelLinear,
    VocabParallelEmbedding,
    tp_rank,
    tp_world_size,
    vocab_parallel_cross_entropy,
)

__all__ = ["STYLES", "GPT_PLAN", "Style", "parallelize_module", "apply_tensor_parallel",
           "TensorParallelGPT", "SequenceParallelAttention"]

STYLES = ("colwise", "rowwise", "vocab", "sequence")
Style = Union[str, Callable[[nn.Module, object, bool], nn.Module]]

GPT_PLAN: dict[str, str] = {
    "embed": "vocab",
    "pos_embed": "sequence",
    "blocks.*.ln1": "sequence",
    "blocks.*.attn.qkv": "colwise",
    "blocks.*.attn.proj": "rowwise",
    "blocks.*.ln2": "sequence",
    "blocks.*.mlp.fc1": "colwise",
    "blocks.*.mlp.fc2": "rowwise",
    "norm": "sequence",
    "head": "colwise",
}
"""Megatron §2.3 for :class:`tiertrain.models.gpt.GPT`: qkv/fc1 column-, proj/fc2 row-parallel,
embedding (and the tied head) split along the vocabulary, norms/positions replicated."""


def _convert(name: str, module: nn.Module, style: Style, group, sequence_parallel: bool, seq_dim: int):
    """The replacement for one planned module (the module itself for "sequence")."""
    if callable(style):
        return style(module, group, sequence_parallel)
    if style == "sequence":
        if sequence_parallel:
            for p in module.parameters(recurse=False):
                p.tp_partial_grad = True
        return module
    expected = {"colwise": nn.Linear, "rowwise": nn.Linear, "vocab": nn.Embedding}[style]
    if not isinstance(module, expected):
        raise TypeError(f"plan style {style!r} for {name!r} needs an {expected.__name__}, "
                        f"got {type(module).__name__}")
    if style == "colwise":
        return ColumnParallelLinear.from_linear(module, group, sequence_parallel=sequence_parallel, seq_dim=seq_dim)
    if style == "rowwise":
        return RowParallelLinear.from_linear(module, group, sequence_parallel=sequence_parallel, seq_dim=seq_dim)
    return VocabParallelEmbedding.from_embedding(module, group, sequence_parallel=sequence_parallel, seq_dim=seq_dim)


def parallelize_module(model: nn.Module, group, plan: Mapping[str, Style], *,
                       sequence_parallel: bool = False, seq_dim: int = 1) -> nn.Module:
    """Convert ``model`` in place according to ``plan`` (see the module docstring) over the
    tensor-parallel ``group`` (``None``: a single rank); returns ``model``. Each rank keeps
    its slice of the current (full) weights, so a model built with the same seed on every
    rank starts exactly where the tp=1 model does."""
    modules = dict(model.named_modules())
    matched: dict[str, Style] = {}
    for pattern, style in plan.items():
        if not callable(style) and style not in STYLES:
            raise ValueError(f"plan style {style!r} for {pattern!r} is unknown: valid styles are "
                             f"{', '.join(STYLES)} or a callable")
        names = [n for n in modules if n and fnmatch.fnmatchcase(n, pattern)]
        if not names:
            raise ValueError(f"plan entry {pattern!r} matches no module of {type(model).__name__}")
        for n in names:
            if n in matched and matched[n] != style:
                raise ValueError(f"module {n!r} is given two styles: {matched[n]!r} and {style!r}")
            matched[n] = style

    # id(full parameter) -> (full parameter, shard dim, shard); the full one is kept alive so
    # ids stay unique until the end.
    shards: dict[int, tuple[torch.Tensor, int, nn.Parameter]] = {}
    for name in [n for n in modules if n in matched]:  # model order: deterministic ties
        old = modules[name]
        new = _convert(name, old, matched[name], group, sequence_parallel, seq_dim)
        if new is old:
            continue
        old_params = dict(old.named_parameters(recurse=False))
        for pname, shard in list(new.named_parameters(recurse=False)):
            full = old_params.get(pname)
            if full is None:
                continue
            dim = getattr(shard, "tp_shard_dim", None) if getattr(shard, "tp_sharded", False) else None
            if id(full) in shards:
                _, first_dim, first = shards[id(full)]
                if dim != first_dim:
                    raise ValueError(f"{name}.{pname} is tied to a parameter sharded along dim "
                                     f"{first_dim}, but its style splits it along {dim}")
                setattr(new, pname, first)
            elif dim is not None:
                shards[id(full)] = (full, dim, shard)
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, new)

    for pname, p in model.named_parameters(remove_duplicate=False):
        if id(p) in shards and p is shards[id(p)][0]:
            raise ValueError(f"{pname} is tied to a parameter the plan shards, but its module is "
                             f"not in the plan (it would keep the full copy): add it to the plan")
    return model


# --------------------------------------------------------------------------- the reference GPT


class SequenceParallelAttention(CausalSelfAttention):
    """:class:`CausalSelfAttention` whose input is a sequence chunk (sequence parallelism):
    the batch and sequence sizes are read from the all-gathered ``qkv`` output, not from
    the input. (The one-line change ``b, t = qkv.shape[:2]`` in ``gpt.py`` would make the
    base class serve both cases.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.qkv(x)  # [B, T, n_local_heads * 3 * head_dim]: the full sequence
        b, t = qkv.shape[:2]
        n_heads = qkv.shape[-1] // (3 * self.head_dim)
        qkv = qkv.view(b, t, n_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, n_heads * self.head_dim)
        return self.resid_drop(self.proj(y))


class TensorParallelGPT(GPT):
    """A :class:`GPT` after :func:`apply_tensor_parallel` (its class is swapped in place,
    as FSDP2's ``fully_shard`` does; ``forward`` and the blocks are unchanged). Overrides
    the embedding (positions of the local sequence chunk under sequence parallelism) and
    the head (vocab-parallel cross-entropy; logits are gathered only when no labels are
    given). Attributes: ``tp_group``, ``sequence_parallel``."""

    tp_group = None
    sequence_parallel = False

    def __init__(self, *args, **kwargs):
        raise TypeError("TensorParallelGPT is not constructed directly: build a GPT and call "
                        "apply_tensor_parallel(model, topology)")

    def position_ids(self, t: int, device: torch.device) -> torch.Tensor:
        """All t positions, or under sequence parallelism those of this rank's T/tp chunk
        (the vocab-parallel embedding then returns only that chunk)."""
        start, length = 0, t
        if self.sequence_parallel:
            tp = tp_world_size(self.tp_group)
            if t % tp:
                raise ValueError(f"sequence parallelism needs the sequence length {t} to be "
                                 f"divisible by the tensor-parallel size {tp}")
            length = t // tp
            start = tp_rank(self.tp_group) * length
        return torch.arange(start, start + length, device=device)

    def head_output(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        """Final LayerNorm and the vocab-parallel head: the mean loss computed from the
        vocab-sharded logits, or with no labels the full logits [B, T, V] (gathered)."""
        logits = self.head(self.norm(x))  # [B, T, V/tp] (the full sequence, also under SP)
        if labels is None:
            return GatherFromTensorParallel.apply(logits, self.tp_group)
        return vocab_parallel_cross_entropy(
            logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), self.tp_group
        )


def apply_tensor_parallel(model: GPT, topology, sequence_parallel: bool = False) -> GPT:
    """Convert the reference GPT in place to Megatron tensor parallelism over
    ``topology``'s tp axis (``topology`` may also be a process group or None), with
    Megatron sequence parallelism when asked; returns the same object, now a
    :class:`TensorParallelGPT`. Each rank keeps its slice of the model's current weights,
    so build the full model with the same seed on every tp rank first."""
    if type(model) is not GPT:
        raise TypeError(f"apply_tensor_parallel converts a tiertrain GPT, got {type(model).__name__}"
                        + (" (already tensor-parallel)" if isinstance(model, TensorParallelGPT) else ""))
    group = topology.group("tp") if hasattr(topology, "group") and callable(topology.group) else topology
    tp = tp_world_size(group)
    cfg = model.config
    for field, value in (("n_heads", cfg.n_heads), ("ffn_hidden", cfg.ffn_hidden), ("vocab_size", cfg.vocab_size)):
        if value % tp:
            raise ValueError(f"GPTConfig.{field}={value} is not divisible by the tensor-parallel size {tp}")
    if cfg.tie_embeddings and model.head.weight is not model.embed.weight:
        raise ValueError("GPTConfig.tie_embeddings is set but head.weight is not embed.weight")
    parallelize_module(model, group, GPT_PLAN, sequence_parallel=sequence_parallel)
    if sequence_parallel:
        for block in model.blocks:
            block.attn.__class__ = SequenceParallelAttention
    model.__class__ = TensorParallelGPT
    model.tp_group = group
    model.sequence_parallel = bool(sequence_parallel)
    return model
