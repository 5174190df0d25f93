"""Context parallelism: one attention over a sequence whose tokens are split across the ranks
of a group, so that no rank holds the activations of the whole sequence (issue 38).

Both algorithms are plain functions of this rank's queries, keys and values, laid out as
``[batch, heads, tokens, head_dim]`` (the layout of ``scaled_dot_product_attention`` and of
transformers' attention interface), and of the group, passed in:

* **Ulysses** (:func:`ulysses_attention`, DeepSpeed-Ulysses): an all-to-all turns the
  sequence-split q, k, v ``[b, h, s/c, d]`` into head-split ones ``[b, h/c, s, d]``; each rank
  attends over the whole sequence for its h/c heads, and a second all-to-all brings the output
  back to this rank's tokens. It needs c to divide the query heads.
* **Ring attention** (:func:`ring_attention`): each rank keeps its queries and passes its key
  and value block to the next rank, c - 1 hops; the partial attention over each block is
  combined with the others by their log-sum-exp (blockwise attention's online softmax). With a
  causal mask the *zig-zag* split (:func:`zigzag_split`) balances the work: the sequence is cut
  into 2c chunks and rank r holds chunks r and 2c - 1 - r, so every rank has as many visible
  (query, key) pairs as any other.

The communication is in small autograd functions that take their group, as the tensor-parallel
f and g operators do (tiertrain/parallel/tensor.py); every handle is waited on with the run's
timeout. The blocks' attention is differentiated by autograd: each hop's keys and values are
kept for backward (a custom backward that passes them around the ring again would keep one
block at a time; not yet).
"""
from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist

from ..errors import TiertrainError
from ..waits import run_timeout

__all__ = ["ContextParallelError", "GatherSequence", "context_split", "exact_token_mean", "ring_attention", "ulysses_attention", "zigzag_positions", "zigzag_split",
           "zigzag_unsplit"]


class ContextParallelError(TiertrainError, ValueError):
    """Inputs that a context-parallel attention cannot split as asked (the message names the
    value and what would be valid)."""

    exit_code = 2


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _wait(work, what: str) -> None:
    timeout = run_timeout()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise TimeoutError(f"context parallelism: {what} did not complete within {timeout:g} s "
                           f"(a failed or stalled peer): {e}") from e


# -- Ulysses: sequence-split <-> head-split ----------------------------------------------------

def _all_to_all(x: torch.Tensor, group, what: str) -> torch.Tensor:
    """Chunk i of x's first dimension to rank i; returns chunk i from rank i, stacked."""
    x = x.contiguous()
    out = torch.empty_like(x)
    _wait(dist.all_to_all_single(out, x, group=group, async_op=True), what)
    return out


def _sequence_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[b, h, s/c, d] holding this rank's tokens of every head -> [b, h/c, s, d] holding every
    token of this rank's heads (head group r = heads r·h/c ... (r+1)·h/c - 1)."""
    c = _size(group)
    b, h, s, d = x.shape
    sent = x.reshape(b, c, h // c, s, d).permute(1, 0, 2, 3, 4)
    got = _all_to_all(sent, group, "the Ulysses all-to-all to head-split")  # [c, b, h/c, s, d]: rank j's tokens
    return got.permute(1, 2, 0, 3, 4).reshape(b, h // c, c * s, d)


def _heads_to_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of :func:`_sequence_to_heads`: [b, h/c, s, d] -> [b, h, s/c, d]."""
    c = _size(group)
    b, hc, s, d = x.shape
    sent = x.reshape(b, hc, c, s // c, d).permute(2, 0, 1, 3, 4)
    got = _all_to_all(sent, group, "the Ulysses all-to-all to sequence-split")  # [c, b, h/c, s/c, d]: rank j's heads
    return got.permute(1, 0, 2, 3, 4).reshape(b, c * hc, s // c, d)


class SequenceToHeads(torch.autograd.Function):
    """Ulysses' first all-to-all; its gradient goes back by the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _sequence_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _heads_to_sequence(grad, ctx.group), None


class HeadsToSequence(torch.autograd.Function):
    """Ulysses' second all-to-all; its gradient goes back by the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _heads_to_sequence(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _sequence_to_heads(grad, ctx.group), None


def _repeat_kv(k: torch.Tensor, heads: int) -> torch.Tensor:
    """Grouped-query attention: each of k's heads serves heads / k.shape[1] query heads."""
    return k if k.shape[1] == heads else k.repeat_interleave(heads // k.shape[1], dim=1)


def _check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    if q.dim() != 4 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2:] != q.shape[2:]:
        raise ContextParallelError(f"q, k, v must be [batch, heads, tokens, head_dim] with k and v alike and the "
                                   f"same batch, tokens and head_dim as q; got q {tuple(q.shape)}, "
                                   f"k {tuple(k.shape)}, v {tuple(v.shape)}")
    if q.shape[1] % k.shape[1]:
        raise ContextParallelError(f"{q.shape[1]} query heads cannot share {k.shape[1]} key/value heads: the "
                                   f"query heads must be a multiple of the key/value heads")


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float | None,
            window: int | None) -> torch.Tensor:
    """torch's attention over whole sequences (key/value heads repeated for the query heads)."""
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    if window is None:
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    mask = _visible(0, 0, q.shape[2], k.shape[2], window, q.device)
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool = True,
                      scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of this rank's tokens (a contiguous 1/c of the sequence, in rank order) over
    the whole sequence, by two all-to-alls over ``group`` (DeepSpeed-Ulysses). q, k, v:
    ``[b, heads, s/c, d]``; key/value heads fewer than the query heads (grouped-query
    attention) are repeated first when c does not divide them; ``window`` (causal only): each
    query sees the keys less than ``window`` positions back. Returns ``[b, heads, s/c, d]``."""
    _check_heads(q, k, v)
    c = _size(group)
    if q.shape[1] % c:
        raise ContextParallelError(f"Ulysses splits the heads over the context-parallel ranks: {q.shape[1]} query "
                                   f"heads are not divisible by parallel.cp={c}; use a cp size that divides "
                                   f"them, or ring attention")
    if window is not None and not causal:
        raise ContextParallelError(f"a sliding window ({window}) applies to causal attention only")
    if c == 1:
        return _attend(q, k, v, causal, scale, window)
    if k.shape[1] % c:
        k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    qh, kh, vh = (SequenceToHeads.apply(t, group) for t in (q, k, v))
    return HeadsToSequence.apply(_attend(qh, kh, vh, causal, scale, window), group)


# -- ring attention ----------------------------------------------------------------------------

def _ring_exchange(x: torch.Tensor, group, forward: bool, what: str) -> torch.Tensor:
    """x to the next rank of the ring (forward) or the previous one; returns what the other
    neighbour sent. One isend and one irecv each, both waited on (no batch_isend_irecv: it
    has hung on gloo)."""
    c, r = _size(group), _rank(group)
    to, frm = ((r + 1) % c, (r - 1) % c) if forward else ((r - 1) % c, (r + 1) % c)
    x = x.contiguous()
    received = torch.empty_like(x)
    handles = [dist.isend(x, dist.get_global_rank(group, to), group=group),
               dist.irecv(received, dist.get_global_rank(group, frm), group=group)]
    for h in handles:
        _wait(h, what)
    return received


class RingPass(torch.autograd.Function):
    """One hop of the ring: the block goes to the next rank, the previous rank's arrives; the
    gradient goes the other way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _ring_exchange(x, group, True, "a ring attention hop of keys and values")

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _ring_exchange(grad, ctx.group, False, "a ring attention hop of key and value gradients"), None


MASKED = -1e30
"""The score of a masked (query, key) pair: finite, so that a query row a block masks whole
gets a finite log-sum-exp (its weight in the combination is then exp(-1e30) = 0, and its
gradient is 0, where -inf would give nan)."""


def _visible(q_start: int, k_start: int, n_q: int, n_k: int, window: int | None, device) -> torch.Tensor | None:
    """The causal (and sliding-window) mask of a block whose queries sit at positions
    q_start... and keys at k_start...: True where the key is visible; None when all are."""
    last_k, first_q = k_start + n_k - 1, q_start
    if last_k <= first_q and (window is None or q_start + n_q - 1 - k_start < window):
        return None
    q_pos = torch.arange(q_start, q_start + n_q, device=device).unsqueeze(1)
    k_pos = torch.arange(k_start, k_start + n_k, device=device).unsqueeze(0)
    seen = k_pos <= q_pos
    return seen if window is None else seen & (q_pos - k_pos < window)


class _AfterTheRing(torch.autograd.Function):
    """Returns the output unchanged, with the last hop's block as an input of no influence
    (zero gradient), so that every rank's backward runs every hop's exchange: a rank whose
    queries see none of the last blocks (a sliding window) would otherwise skip those hops'
    backward while its neighbours wait for it."""

    @staticmethod
    def forward(ctx, out: torch.Tensor, last_block: torch.Tensor) -> torch.Tensor:
        ctx.block_shape, ctx.block_dtype = last_block.shape, last_block.dtype
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, grad.new_zeros(ctx.block_shape, dtype=ctx.block_dtype)


def _block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, visible: torch.Tensor | None):
    """Attention of q over one key/value block: (output normalised within the block, its
    log-sum-exp per query), computed in at least fp32, keys outside ``visible`` masked."""
    dtype = torch.promote_types(q.dtype, torch.float32)
    scores = torch.matmul(q.to(dtype), k.to(dtype).transpose(-1, -2)) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible, MASKED)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), v.to(dtype))
    return out, lse


def _combine(blocks: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """The attention over the union of the blocks, from each block's (output, log-sum-exp)."""
    lse = torch.logsumexp(torch.stack([b[1] for b in blocks]), dim=0)
    return sum(torch.exp(b[1] - lse).unsqueeze(-1) * b[0] for b in blocks)


def _chunk_indices(rank: int, c: int, causal: bool) -> list[int]:
    """The global chunk indices this rank's tokens hold, in order: the zig-zag pair (chunks of
    s/2c) when causal, else its one contiguous chunk of s/c."""
    return [rank, 2 * c - 1 - rank] if causal else [rank]


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool = True,
                   scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of this rank's tokens over the whole sequence, the key/value blocks passed
    around the ring of ``group``. q, k, v: ``[b, heads, tokens, d]`` (grouped-query k, v
    allowed). With ``causal`` this rank's tokens must be its zig-zag pair of chunks
    (:func:`zigzag_split`), otherwise its contiguous 1/c of the sequence in rank order;
    ``window`` (causal only): each query sees the keys less than ``window`` positions back
    (Mistral's sliding window). Returns ``[b, heads, tokens, d]`` in q's dtype."""
    _check_heads(q, k, v)
    c, r = _size(group), _rank(group)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    parts = 2 if causal else 1
    if q.shape[2] % parts:
        raise ContextParallelError(f"causal ring attention takes each rank's two zig-zag chunks of equal length; "
                                   f"this rank holds {q.shape[2]} tokens, an odd number")
    if window is not None and not causal:
        raise ContextParallelError(f"a sliding window ({window}) applies to causal attention only")
    n = q.shape[2] // parts
    k, v = _repeat_kv(k, q.shape[1]), _repeat_kv(v, q.shape[1])
    mine = _chunk_indices(r, c, causal)
    queries = q.chunk(parts, dim=2)
    partial: list[list] = [[] for _ in mine]
    kv = torch.stack([k, v])
    for hop in range(c):
        if hop:
            kv = RingPass.apply(kv, group)
        theirs = _chunk_indices((r - hop) % c, c, causal)
        keys, values = kv[0].chunk(parts, dim=2), kv[1].chunk(parts, dim=2)
        for i, a in enumerate(mine):
            for j, b in enumerate(theirs):
                if causal and (b > a or (window is not None and (a - b - 1) * n + 1 >= window)):
                    continue  # (no key of that chunk is visible to any query of this one)
                visible = _visible(a * n, b * n, n, n, window, q.device) if causal else None
                partial[i].append(_block(queries[i], keys[j], values[j], scale, visible))
    out = torch.cat([_combine(blocks) for blocks in partial], dim=2).to(q.dtype)
    return _AfterTheRing.apply(out, kv) if c > 1 else out


# -- the zig-zag split -------------------------------------------------------------------------

def _check_split(length: int, c: int, rank: int) -> int:
    if not 0 <= rank < c:
        raise ContextParallelError(f"rank {rank} is outside the context-parallel group of {c} ranks")
    if length % (2 * c):
        raise ContextParallelError(f"the zig-zag split cuts the sequence into 2·cp = {2 * c} equal chunks: a "
                                   f"sequence of {length} tokens is not divisible by {2 * c}; pad it to a "
                                   f"multiple of {2 * c}")
    return length // (2 * c)


def zigzag_split(x: torch.Tensor, dim: int, rank: int, c: int) -> torch.Tensor:
    """This rank's tokens of x along dim: chunks rank and 2c - 1 - rank of 2c equal chunks."""
    n = _check_split(x.shape[dim], c, rank)
    return torch.cat([x.narrow(dim, rank * n, n), x.narrow(dim, (2 * c - 1 - rank) * n, n)], dim=dim)


def zigzag_positions(length: int, rank: int, c: int, device=None) -> torch.Tensor:
    """The positions in the whole sequence of this rank's zig-zag tokens (for rotary or
    learned position embeddings)."""
    return zigzag_split(torch.arange(length, device=device), 0, rank, c)


def zigzag_unsplit(pieces: list[torch.Tensor], dim: int) -> torch.Tensor:
    """The whole sequence from every rank's zig-zag tokens, given in rank order."""
    c = len(pieces)
    firsts, seconds = zip(*(p.chunk(2, dim=dim) for p in pieces))
    return torch.cat(list(firsts) + list(reversed(seconds)), dim=dim)


# -- a model's tokens and loss under context parallelism ----------------------------------

def context_split(x: torch.Tensor, dim: int, group, algorithm: str) -> torch.Tensor:
    """This rank's tokens of x along dim: its zig-zag pair (ring) or its contiguous 1/cp (ulysses)."""
    c, r = _size(group), _rank(group)
    if algorithm == "ring":
        return zigzag_split(x, dim, r, c)
    if x.shape[dim] % c:
        raise ContextParallelError(f"Ulysses gives each of the parallel.cp={c} ranks an equal share of the "
                                   f"sequence: {x.shape[dim]} tokens are not divisible by {c}")
    return x.chunk(c, dim=dim)[r]


def exact_token_mean(summed: torch.Tensor, labelled: torch.Tensor, group) -> torch.Tensor:
    """cp · summed / (labelled tokens over the group): the share of the batch's token mean that
    this rank's summed loss makes, scaled so that the mean over the group's ranks is that mean."""
    total = labelled.detach().to(torch.float64).reshape(1)
    if _size(group) > 1:
        _wait(dist.all_reduce(total, group=group, async_op=True), "the sum of the labelled tokens over the cp group")
    return summed * (_size(group) / total.to(summed.dtype).squeeze(0))


class GatherSequence(torch.autograd.Function):
    """Every rank's tokens, in sequence order; each rank's own slice takes cp times the gradient
    (every rank computes the same function of the whole, and the engine averages the ranks)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, algorithm: str) -> torch.Tensor:
        ctx.group, ctx.algorithm = group, algorithm
        pieces = [torch.empty_like(x) for _ in range(_size(group))]
        _wait(dist.all_gather(pieces, x.contiguous(), group=group, async_op=True), "the gather of the sequence's logits")
        return zigzag_unsplit(pieces, 1) if algorithm == "ring" else torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return context_split(grad, 1, ctx.group, ctx.algorithm) * _size(ctx.group), None, None
