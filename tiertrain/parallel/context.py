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
timeout. Ring attention has its own backward (:class:`RingAttention`): it keeps only this
rank's q, k, v, output and log-sum-exp, and passes the key/value blocks around the ring once
more to recompute each block's probabilities, so no block's scores outlive their use.
"""
from __future__ import annotations

import datetime
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..errors import TiertrainError
from ..waits import run_timeout

__all__ = ["ContextParallelError", "ContextParallelTimeout", "GatherSequence", "context_split", "exact_token_mean",
           "next_token_labels", "ring_attention", "tokens_multiple", "ulysses_attention", "zigzag_positions",
           "zigzag_split", "zigzag_unsplit"]


class ContextParallelError(TiertrainError, ValueError):
    """Inputs that a context-parallel attention cannot split as asked (the message names the
    value and what would be valid)."""

    exit_code = 2


class ContextParallelTimeout(TiertrainError, TimeoutError):
    """An exchange of the cp group did not complete in time (a failed or stalled peer)."""


def _size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def _rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def _wait(work, what: str) -> None:
    timeout = run_timeout()
    try:
        work.wait(timeout=datetime.timedelta(seconds=timeout))
    except RuntimeError as e:
        raise ContextParallelTimeout(f"context parallelism: {what} did not complete within {timeout:g} s "
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


class UlyssesAllToAll(torch.autograd.Function):
    """Ulysses' all-to-all, from sequence-split to head-split (``to_heads``) or back; its
    gradient goes back by the inverse all-to-all."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, to_heads: bool) -> torch.Tensor:
        ctx.group, ctx.to_heads = group, to_heads
        return (_sequence_to_heads if to_heads else _heads_to_sequence)(x, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (_heads_to_sequence if ctx.to_heads else _sequence_to_heads)(grad, ctx.group), None, None


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
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)
    mask = _visible(0, 0, q.shape[2], k.shape[2], window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


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
    qh, kh, vh = (UlyssesAllToAll.apply(t, group, True) for t in (q, k, v))
    return UlyssesAllToAll.apply(_attend(qh, kh, vh, causal, scale, window), group, False)


# -- ring attention ----------------------------------------------------------------------------

def _ring_exchange(x: torch.Tensor, group, what: str, tag: int = 0) -> torch.Tensor:
    """x to the next rank of the ring; returns what the previous rank sent. One isend and one
    irecv, both waited on (no batch_isend_irecv: it has hung on gloo)."""
    c, r = _size(group), _rank(group)
    x = x.contiguous()
    received = torch.empty_like(x)
    handles = [dist.isend(x, dist.get_global_rank(group, (r + 1) % c), group=group, tag=tag),
               dist.irecv(received, dist.get_global_rank(group, (r - 1) % c), group=group, tag=tag)]
    for h in handles:
        _wait(h, what)
    return received


RING_TILE = 256
"""Most query (and key) tokens of one tile of ring attention: a tile's scores (then, in place,
probabilities) and their gradient are the attention memory that exists at once (two fp32
tiles per head, 256 KiB each). Smaller tiles cost more Python-level steps per block; at 1024
the tiles outweighed the tokens' own activations at 2048 tokens a rank
(bench/results/cp_memory.md)."""

MASKED = -1e30
"""The score of a masked (query, key) pair: finite, so that a query row a block masks whole
gets a finite log-sum-exp, whose weight in the combination is then exp(-1e30) = 0."""


def _visible(q_start: int, k_start: int, n_q: int, n_k: int, window: int | None, device) -> torch.Tensor | None:
    """The causal (and sliding-window) mask of a block whose queries sit at positions
    q_start... and keys at k_start...: True where the key is visible; None when all are."""
    if k_start + n_k - 1 <= q_start and (window is None or q_start + n_q - 1 - k_start < window):
        return None
    q_pos = torch.arange(q_start, q_start + n_q, device=device).unsqueeze(1)
    k_pos = torch.arange(k_start, k_start + n_k, device=device).unsqueeze(0)
    seen = k_pos <= q_pos
    return seen if window is None else seen & (q_pos - k_pos < window)


class _Ring:
    """Which (query chunk, key chunk) blocks a rank computes at each hop, and their masks."""

    def __init__(self, group, tokens: int, causal: bool, window: int | None):
        self.group, self.c, self.r = group, _size(group), _rank(group)
        self.causal, self.window = causal, window
        self.parts = 2 if causal else 1
        if tokens % self.parts:
            raise ContextParallelError(f"causal ring attention takes each rank's two zig-zag chunks of equal length; "
                                       f"this rank holds {tokens} tokens, an odd number")
        if window is not None and not causal:
            raise ContextParallelError(f"a sliding window ({window}) applies to causal attention only")
        self.n = tokens // self.parts

    def chunks(self, rank: int) -> list[int]:
        """The global chunk indices a rank's tokens hold: its zig-zag pair (chunks of s/2c)
        when causal, else its one contiguous chunk of s/c."""
        return [rank, 2 * self.c - 1 - rank] if self.causal else [rank]

    def blocks(self, hop: int):
        """(i, j, q tile, k tile, mask or None): tile ``q tile`` (a slice) of this rank's query
        chunk i sees tile ``k tile`` of key chunk j of the block arriving at this hop (the block
        of rank r - hop). Tiles are at most RING_TILE tokens a side, so that no more than one
        tile's scores exist at a time however long the chunks are."""
        n, window = self.n, self.window
        tiles = [slice(t, min(t + RING_TILE, n)) for t in range(0, n, RING_TILE)]
        for i, a in enumerate(self.chunks(self.r)):
            for j, b in enumerate(self.chunks((self.r - hop) % self.c)):
                for qt in tiles:
                    for kt in tiles:
                        if not self.causal:
                            yield i, j, qt, kt, None
                            continue
                        q_first, q_last = a * n + qt.start, a * n + qt.stop - 1
                        k_first, k_last = b * n + kt.start, b * n + kt.stop - 1
                        if k_first > q_last or (window is not None and q_first - k_last >= window):
                            continue  # (no key of the tile is visible to any query of this one)
                        yield i, j, qt, kt, _visible(q_first, k_first, qt.stop - qt.start, kt.stop - kt.start,
                                                     window, None)


class RingAttention(torch.autograd.Function):
    """Ring attention with its own backward, keeping for backward only this rank's q, k, v,
    output and log-sum-exp (no block's scores): forward passes the key/value blocks around
    the ring and folds each tile's attention into a running output by log-sum-exp
    (blockwise attention's online softmax); backward passes them around again, recomputes
    each tile's probabilities from the saved log-sum-exp, and sends each block's key/value
    gradient along with it, one more hop bringing it home."""

    @staticmethod
    def forward(ctx, q, k, v, group, causal: bool, scale: float, window: int | None):
        ring = _Ring(group, q.shape[2], causal, window)
        dtype = torch.promote_types(q.dtype, torch.float32)
        rep = q.shape[1] // k.shape[1]
        queries = [x.to(dtype) for x in q.chunk(ring.parts, dim=2)]
        out = [torch.zeros_like(x) for x in queries]
        lse = [torch.full(x.shape[:-1], float("-inf"), dtype=dtype, device=q.device) for x in queries]
        kv = torch.stack([k, v])
        for hop in range(ring.c):
            if hop:
                kv = _ring_exchange(kv, group, "a ring attention hop of keys and values")
            keys, values = (t.repeat_interleave(rep, 1).to(dtype).chunk(ring.parts, dim=2) for t in kv)
            for i, j, qt, kt, mask in ring.blocks(hop):
                # (in place wherever possible: a tile's scores are the largest transient)
                scores = torch.matmul(queries[i][:, :, qt], keys[j][:, :, kt].transpose(-1, -2)).mul_(scale)
                if mask is not None:
                    scores.masked_fill_(~mask.to(q.device), MASKED)
                running = lse[i][:, :, qt]
                merged = torch.logaddexp(running, torch.logsumexp(scores, dim=-1))
                probabilities = scores.sub_(merged.unsqueeze(-1)).exp_()
                out[i][:, :, qt] = out[i][:, :, qt] * torch.exp(running - merged).unsqueeze(-1) \
                    + torch.matmul(probabilities, values[j][:, :, kt])
                lse[i][:, :, qt] = merged
        out, lse = torch.cat(out, dim=2), torch.cat(lse, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.window = group, causal, scale, window
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        ring = _Ring(group, q.shape[2], ctx.causal, ctx.window)
        dtype = out.dtype
        rep = q.shape[1] // k.shape[1]
        grad_out = grad_out.to(dtype)
        queries = [x.to(dtype) for x in q.chunk(ring.parts, dim=2)]
        douts = grad_out.chunk(ring.parts, dim=2)
        lses = lse.chunk(ring.parts, dim=2)
        deltas = (grad_out * out).sum(-1).chunk(ring.parts, dim=2)  # rowsum(dO ∘ O)
        dq = [torch.zeros_like(x) for x in queries]
        kv = torch.stack([k, v])
        dkv = torch.zeros((2, *k.shape[:2], rep, *k.shape[2:]), dtype=dtype, device=k.device)
        for hop in range(ring.c):
            if hop:
                kv = _ring_exchange(kv, group, "a ring attention hop of keys and values in backward")
                dkv = _ring_exchange(dkv, group, "a ring attention hop of key and value gradients", tag=1)
            keys, values = (t.repeat_interleave(rep, 1).to(dtype).chunk(ring.parts, dim=2) for t in kv)
            # dkv[0|1] as [b, kv heads, rep, tokens, d] = the repeated heads' gradients, chunked like the keys
            dk = dkv[0].flatten(1, 2).chunk(ring.parts, dim=2)
            dv = dkv[1].flatten(1, 2).chunk(ring.parts, dim=2)
            for i, j, qt, kt, mask in ring.blocks(hop):
                qi, key, value, dout = queries[i][:, :, qt], keys[j][:, :, kt], values[j][:, :, kt], douts[i][:, :, qt]
                scores = torch.matmul(qi, key.transpose(-1, -2)).mul_(scale)
                if mask is not None:
                    scores.masked_fill_(~mask.to(q.device), MASKED)
                p = scores.sub_(lses[i][:, :, qt].unsqueeze(-1)).exp_()
                dv[j][:, :, kt] += torch.matmul(p.transpose(-1, -2), dout)
                ds = torch.matmul(dout, value.transpose(-1, -2)).sub_(deltas[i][:, :, qt].unsqueeze(-1)).mul_(p)
                del p, scores
                dq[i][:, :, qt] += torch.matmul(ds, key).mul_(scale)
                dk[j][:, :, kt] += torch.matmul(ds.transpose(-1, -2), qi).mul_(scale)
        if ring.c > 1:  # the block processed last is the next rank's: its gradient goes home
            dkv = _ring_exchange(dkv, group, "the key and value gradients' hop home", tag=1)
        dk, dv = (g.sum(2) for g in dkv)  # the repeated heads' gradients, summed per key/value head
        return (torch.cat(dq, dim=2).to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None)


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group, causal: bool = True,
                   scale: float | None = None, window: int | None = None) -> torch.Tensor:
    """Attention of this rank's tokens over the whole sequence, the key/value blocks passed
    around the ring of ``group`` (:class:`RingAttention`). q, k, v: ``[b, heads, tokens, d]``
    (grouped-query k, v allowed). With ``causal`` this rank's tokens must be its zig-zag pair
    of chunks (:func:`zigzag_split`), otherwise its contiguous 1/c of the sequence in rank
    order; ``window`` (causal only): each query sees the keys less than ``window`` positions
    back (Mistral's sliding window). Returns ``[b, heads, tokens, d]`` in q's dtype."""
    _check_heads(q, k, v)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return RingAttention.apply(q, k, v, group, causal, scale, window)


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
    firsts, seconds = zip(*(p.chunk(2, dim=dim) for p in pieces))
    return torch.cat(list(firsts) + list(reversed(seconds)), dim=dim)


# -- a model's tokens and loss under context parallelism ----------------------------------

def tokens_multiple(cp: int, algorithm: str) -> int:
    """What a sequence length split over ``cp`` ranks must be a multiple of: 2·cp for ring
    attention (the zig-zag split's chunks), cp for Ulysses."""
    return 2 * cp if algorithm == "ring" else cp


def context_split(x: torch.Tensor, dim: int, group, algorithm: str) -> torch.Tensor:
    """This rank's tokens of x along dim: its zig-zag pair (ring) or its contiguous 1/cp (ulysses)."""
    c, r = _size(group), _rank(group)
    if algorithm == "ring":
        return zigzag_split(x, dim, r, c)
    if x.shape[dim] % c:
        raise ContextParallelError(f"Ulysses gives each of the parallel.cp={c} ranks an equal share of the "
                                   f"sequence: {x.shape[dim]} tokens are not divisible by {c}")
    return x.chunk(c, dim=dim)[r]


def next_token_labels(labels: torch.Tensor) -> torch.Tensor:
    """transformers' causal-LM labels (the token at each position) as the target of each
    position, the next token's (the last position's: -100, ignored). Context parallelism shifts
    before the split, so the target of a rank's last token may be another rank's first."""
    return F.pad(labels, (0, 1), value=-100)[..., 1:]


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
        if _size(group) == 1:
            return x.view_as(x)
        pieces = [torch.empty_like(x) for _ in range(_size(group))]
        _wait(dist.all_gather(pieces, x.contiguous(), group=group, async_op=True), "the gather of the sequence's logits")
        return zigzag_unsplit(pieces, 1) if algorithm == "ring" else torch.cat(pieces, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return context_split(grad, 1, ctx.group, ctx.algorithm) * _size(ctx.group), None, None
