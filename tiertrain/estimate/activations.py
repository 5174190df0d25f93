"""Activation bytes of one micro-batch on one rank, as the peak simulation
(:mod:`tiertrain.estimate.peak`) consumes them: :class:`ActivationBytes`, the per-block, head
and backward-buffer sizes of a model, and :func:`gpt_activation_bytes`, those of tiertrain's GPT.

Activation sizes are those of ``tiertrain.models.gpt.GPT`` (pre-LN blocks, fused SDPA that
keeps its output and log-sum-exp instead of the s×s scores, GELU, tied head), counted with
``torch.autograd.graph.saved_tensors_hooks`` on this code: per block (8 + 2·ffn_mult)·s·b·h
elements of the compute dtype (x, ln1 out, qkv (3), attention out, x + attn, ln2 out, fc1
out (f), GELU out (f)), LayerNorm mean/rstd (4·b·s) and the fp32 log-sum-exp (b·a·s).
Activation checkpointing (``tiertrain.offload.activations``) keeps only the input of every
k-th block (blocks 0, k, 2k, …) and recomputes that block in backward.

Any other model described by :class:`tiertrain.estimate.modules.HFModelDims` (a Hugging Face
transformer) brings its own :class:`ActivationBytes` (per block, from the transformers
modeling code, :mod:`tiertrain.estimate.modules`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

__all__ = ["ActivationBytes", "context_parallel_activation_bytes", "gpt_activation_bytes", "tiled_mlp_activation_bytes"]


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of one micro-batch's activations in tiertrain's GPT (per rank)."""

    block: int
    """Saved for backward by one block that is not checkpointed."""
    checkpoint: int
    """Saved by one checkpointed block: its input only."""
    head: int
    """Saved outside the blocks: final-LN input, head input, LN stats, fp32 log-softmax
    output, position ids, plus the micro-batch's input ids and labels (int64)."""
    logits_in_flight: int
    """Forward end: the logits (compute dtype) and, with 16-bit compute, their fp32 copy."""
    head_backward: int
    """Start of backward: gradient of the log-softmax output and of its input (fp32), and the
    16-bit cast of it when the compute dtype is not fp32."""
    block_backward: int
    """Inside one block's backward: gradient of the MLP inner activation (f·s·b·h), the
    residual-stream gradient (s·b·h) and the largest weight gradient (f·h², compute dtype)."""
    tied_head_grad: int
    """The head's weight gradient (V·h, compute dtype) held from the head's backward until
    the embedding's gradient arrives, when the weights are tied (0 otherwise)."""
    blocks: tuple[int, ...] = ()
    """Per block, in registration order, when blocks differ (an encoder-decoder's decoder
    blocks also keep cross-attention); empty: every block keeps ``block``."""
    kept: tuple[int, ...] = ()
    """Per block (one entry: every block), the outputs a selectively checkpointed block keeps
    besides its input (``activations.recompute = "selective"``): its matrix multiplications
    and fused attention (tiertrain.offload.activations.SELECTIVE_SAVED_OPS)."""
    kept_unused: int = 0
    """Of a block's ``kept`` bytes, those its backward never reads (the outputs of the
    projections back to the residual stream, and of Q/K before rotary): the recomputed block
    shares the rest with the cache, so these are what recomputation holds on top of ``block``'s
    other tensors."""

    def block_at(self, i: int) -> int:
        """Bytes saved by block ``i`` (not checkpointed)."""
        return self.blocks[i] if i < len(self.blocks) else self.block

    def kept_at(self, i: int) -> int:
        """Bytes block ``i`` keeps besides its input when checkpointed selectively."""
        return self.kept[min(i, len(self.kept) - 1)] if self.kept else 0

    def recompute_working(self, i: int, selective: bool) -> int:
        """Bytes the recomputation of block ``i`` adds while its backward runs: every tensor
        the block saves, less the kept outputs it takes from the cache (already held)."""
        if not selective:
            return self.block_at(i)
        return self.block_at(i) - (self.kept_at(i) - self.kept_unused)


def gpt_activation_bytes(dims: Any, micro_batch: int, precision_bytes: int) -> ActivationBytes:
    """:class:`ActivationBytes` of ``tiertrain.models.gpt.GPT`` with ``dims``
    (:class:`~tiertrain.estimate.dims.ModelDims`) at ``micro_batch`` sequences."""
    D = precision_bytes
    s, b, h, a, V, f = dims.seq_len, micro_batch, dims.hidden, dims.n_heads, dims.vocab, dims.ffn_mult
    sbh = s * b * h
    drop = 1 if dims.dropout else 0
    # x, ln1 out, qkv (3), attention out, x + attn, ln2 out, fc1 out (f), gelu out (f);
    # LN mean/rstd (2 per LN, compute dtype), SDPA log-sum-exp (fp32); dropout masks (bool)
    block = (8 + 2 * f) * sbh * D + 4 * b * s * D + 4 * b * a * s + 2 * drop * sbh
    head = 2 * sbh * D + 2 * b * s * D + 4 * s * b * V + 8 * s + 2 * 8 * b * s + drop * sbh
    logits = s * b * V * D + (4 * s * b * V if D != 4 else 0)
    head_bwd = 2 * 4 * s * b * V + (s * b * V * D if D != 4 else 0)
    block_bwd = (f + 1) * sbh * D + f * h * h * D
    tied = V * h * D if dims.tie_embeddings else 0
    # selective: qkv (3), proj, fc1 (f), fc2 outputs, and the fused SDPA's output and lse
    # (with attention dropout SDPA takes the math path: nothing of it is kept)
    kept = (5 + f) * sbh * D + (0 if drop else sbh * D + 4 * b * a * s)
    return ActivationBytes(block=block, checkpoint=sbh * D, head=head, logits_in_flight=logits,
                           head_backward=head_bwd, block_backward=block_bwd, tied_head_grad=tied,
                           kept=(kept,), kept_unused=2 * sbh * D)


def tiled_mlp_activation_bytes(acts: ActivationBytes, dims: Any, micro_batch: int, precision_bytes: int,
                               tile_tokens: int) -> ActivationBytes:
    """``acts`` (of ``dims``, at ``dims.seq_len`` tokens per sequence: a rank's own under context
    parallelism) with every block's MLP run in tiles of T = ``tile_tokens`` tokens
    (tiertrain.tiling.mlp_in_tiles; ALST's tiled MLP): a block no longer keeps the MLP's
    intermediates for backward (GPT: fc1 and GELU outputs, 2·f·s·b·h·D; a Hugging Face MLP: the
    gate, up and activation outputs, ``dims.mlp_saved_bytes``), and a block's backward holds one
    tile's: its recomputed intermediates and their gradient (f·T·b·h·D instead of f·s·b·h·D).
    A tile of the whole sequence or more changes nothing (the MLP then runs untiled). Kept
    outputs of selective recomputation are unchanged: its policy caches the tiles' matmul
    outputs for the whole sequence all the same."""
    s, b, D = dims.seq_len, micro_batch, precision_bytes
    if not tile_tokens or tile_tokens >= s:
        return acts
    if getattr(dims, "kind", "decoder") == "encoder-decoder":
        raise ValueError("activations.mlp_tile_tokens: the tiled MLP of an encoder-decoder is not modelled "
                         "(tiertrain.tiling.apply_tiled_mlp tiles the blocks' 'mlp' submodules)")
    if hasattr(dims, "mlp_saved_bytes"):  # tiertrain.estimate.modules.HFModelDims
        saved, inner = dims.mlp_saved_bytes(b * s, D), dims.intermediate
        tile_saved = dims.mlp_saved_bytes(b * tile_tokens, D)
    else:  # tiertrain's GPT: fc1 out and GELU out, f·h wide each
        inner = dims.ffn_mult * dims.hidden
        saved, tile_saved = 2 * inner * b * s * D, 2 * inner * b * tile_tokens * D
    tile_backward = tile_saved - inner * b * (s - tile_tokens) * D
    return dataclasses.replace(acts, block=acts.block - saved, blocks=tuple(x - saved for x in acts.blocks),
                               block_backward=acts.block_backward + tile_backward)


def context_parallel_activation_bytes(dims: Any, micro_batch: int, precision_bytes: int, cp: int,
                                      algorithm: str, loss_tile_tokens: int = 0,
                                      mlp_tile_tokens: int = 0) -> ActivationBytes:
    """:class:`ActivationBytes` of one rank of a context-parallel group of ``cp`` ranks: the
    model's activations at seq/cp tokens (``dims.activation_bytes`` of a Hugging Face model, else
    tiertrain's GPT), with what the context-parallel attention (tiertrain/parallel/context.py)
    adds per block:

    * ring: its output is kept for backward in fp32 ((4 - D)·s·b·q_width more than attention's
      own output), and backward holds, besides this rank's q, k, v, the key/value block passing
      through and the next one (2·2·s·b·kv_width·D), their gradients in fp32 with the repeated
      heads (2·2·4·s·b·q_width), the query gradient (4·s·b·q_width) and one tile's
      probabilities and their gradient (2·4·b·a·T², T = min(s/2, RING_TILE)), s being this
      rank's tokens, while the
      residual stream's gradient (s·b·h·D) and the attention's weight gradients are held;
    * Ulysses: the head-split q, k, v and output kept beside the sequence-split ones
      ((2·q_width + 2·kv_width)·s·b·D);
    * with ``loss_tile_tokens`` = T (tiertrain.tiling.cross_entropy_in_tiles), no fp32
      log-softmax of all s tokens is kept (4·s·b·V), and the logits in flight at the end of
      forward and the start of backward are one tile's: T tokens instead of s;
    * with ``mlp_tile_tokens``, the MLP in tiles of min(s, T) tokens (:func:`tiled_mlp_activation_bytes`).
    """
    s = dims.seq_len // cp
    changes = {"seq_len": s}
    if hasattr(dims, "decoder_seq_len"):
        changes.update(decoder_seq_len=dims.decoder_seq_len // cp, attention="flash")
    local = dataclasses.replace(dims, **changes)
    acts = (local.activation_bytes(micro_batch, precision_bytes) if hasattr(local, "activation_bytes")
            else gpt_activation_bytes(local, micro_batch, precision_bytes))
    acts = tiled_mlp_activation_bytes(acts, local, micro_batch, precision_bytes, mlp_tile_tokens)
    if cp == 1:
        return acts
    D, b, a = precision_bytes, micro_batch, dims.n_heads
    head_dim = getattr(dims, "head_dim", dims.hidden // a)
    q_width, kv_width = a * head_dim, getattr(dims, "kv_heads", a) * head_dim
    if algorithm == "ring":
        saved = (4 - D) * s * b * q_width
        from ..parallel.context import RING_TILE

        tile = min(s // 2, RING_TILE)
        backward = 4 * s * b * kv_width * D + 16 * s * b * q_width + 4 * s * b * q_width + 8 * b * a * tile * tile
    else:
        saved = (2 * q_width + 2 * kv_width) * s * b * D
        backward = 0
    h = dims.hidden
    attention_backward = s * b * h * D + h * (2 * q_width + 2 * kv_width) * D + backward
    blocks = tuple(x + saved for x in acts.blocks)
    acts = dataclasses.replace(acts, block=acts.block + saved, blocks=blocks,
                               block_backward=max(acts.block_backward, attention_backward))
    if loss_tile_tokens and loss_tile_tokens < s:
        V, ratio = dims.vocab, loss_tile_tokens / s
        acts = dataclasses.replace(acts, head=acts.head - 4 * s * b * V,
                                   logits_in_flight=math.ceil(acts.logits_in_flight * ratio),
                                   head_backward=math.ceil(acts.head_backward * ratio))
    return acts
