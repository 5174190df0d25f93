"""Context-parallel attention (tiertrain/parallel/context.py) equals one process's attention over
the whole sequence: outputs and the gradients of q, k and v, for Ulysses and ring attention, at
cp = 2 and 4 on gloo, causal and not, with as many key/value heads as query heads and with
fewer (grouped-query attention), and with a sliding window narrower than the sequence.

The bound is the float64 oracle's: the context-parallel run in fp32 is within twice the fp32
single-process attention's distance to the float64 one (plus 4 ulps), tensor by tensor; the
same run in float64 agrees with the float64 reference to 1e-12.
"""
from __future__ import annotations

import pytest
import torch

from reference import EPS32, rel_distances
from tiertrain.parallel.context import (ContextParallelError, ring_attention, ulysses_attention, zigzag_positions,
                                        zigzag_split, zigzag_unsplit)
from tiertrain.testing import run_distributed

BATCH, TOKENS, HEAD_DIM = 2, 16, 8
CASES = [  # (algorithm, causal, query heads, key/value heads, sliding window)
    ("ulysses", True, 8, 8, None), ("ulysses", True, 8, 2, None), ("ulysses", False, 4, 4, None),
    ("ulysses", True, 8, 2, 5),
    ("ring", True, 8, 8, None), ("ring", True, 8, 2, None), ("ring", False, 4, 2, None), ("ring", True, 8, 2, 5),
]
ATTENTION = {"ulysses": ulysses_attention, "ring": ring_attention}


def _inputs(heads: int, kv_heads: int, dtype: torch.dtype):
    """The whole sequence's q, k, v and the gradient of the output, the same on every rank."""
    g = torch.Generator().manual_seed(heads * 10 + kv_heads)
    shape = lambda h: (BATCH, h, TOKENS, HEAD_DIM)
    q, k, v, grad = (torch.randn(shape(h), generator=g, dtype=torch.float64)
                     for h in (heads, kv_heads, kv_heads, heads))
    return [t.to(dtype) for t in (q, k, v, grad)]


def _reference(q, k, v, grad, causal: bool, window: int | None = None, fused: bool = False) -> dict[str, torch.Tensor]:
    """Attention over the whole sequence in q's dtype, its output and gradients: written out
    (scores, softmax, weighted sum), or torch's fused kernel (blockwise, online softmax)."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    position = torch.arange(TOKENS)
    hidden = (position.unsqueeze(0) > position.unsqueeze(1)) if causal else torch.zeros(TOKENS, TOKENS, dtype=torch.bool)
    if window is not None:
        hidden |= position.unsqueeze(1) - position.unsqueeze(0) >= window
    if fused:
        out = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1),
                                                               v.repeat_interleave(rep, 1), attn_mask=~hidden)
    else:
        scores = q @ k.repeat_interleave(rep, 1).transpose(-1, -2) / HEAD_DIM ** 0.5
        out = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1) @ v.repeat_interleave(rep, 1)
    out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _split(x: torch.Tensor, rank: int, c: int, zigzag: bool) -> torch.Tensor:
    return zigzag_split(x, 2, rank, c) if zigzag else x.chunk(c, dim=2)[rank]


def _unsplit(pieces: list[torch.Tensor], zigzag: bool) -> torch.Tensor:
    return zigzag_unsplit(pieces, 2) if zigzag else torch.cat(pieces, dim=2)


def _run(rank, world, algorithm, causal, heads, kv_heads, dtype, zigzag, window=None):
    group = torch.distributed.group.WORLD
    q, k, v, grad = (_split(t, rank, world, zigzag).requires_grad_() for t in _inputs(heads, kv_heads, dtype))
    out = ATTENTION[algorithm](q, k, v, group, causal=causal, window=window)
    out.backward(grad)
    return {"out": out.detach(), "dq": q.grad, "dk": k.grad, "dv": v.grad}


def _rank_main(rank, world):
    results = {}
    for algorithm, causal, heads, kv_heads, window in CASES:
        zigzag = algorithm == "ring" and causal
        for dtype in (torch.float32, torch.float64):
            results[algorithm, causal, heads, kv_heads, window, dtype] = _run(rank, world, algorithm, causal, heads,
                                                                              kv_heads, dtype, zigzag, window)
    # Ring attention in tiles of 3 tokens (the chunks hold 4 or 2): uneven tiles, some skipped whole.
    from tiertrain.parallel import context

    tile, context.RING_TILE = context.RING_TILE, 3
    try:
        for causal, window in TILED:
            results["tiled", causal, window] = _run(rank, world, "ring", causal, 8, 2, torch.float32, causal, window)
    finally:
        context.RING_TILE = tile
    # The mutation: causal ring attention given contiguous tokens instead of its zig-zag pair.
    results["contiguous"] = _run(rank, world, "ring", True, 8, 8, torch.float32, zigzag=False)
    try:
        ulysses_attention(*(torch.zeros(1, 6, 4, 2) for _ in range(3)), torch.distributed.group.WORLD)
        results["heads"] = None
    except ContextParallelError as e:
        results["heads"] = str(e)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda c: f"cp={c}")
def runs(request):
    world = request.param
    return world, run_distributed(_rank_main, world, timeout=120)


def _gathered(per_rank: list[dict], zigzag: bool) -> dict[str, torch.Tensor]:
    return {name: _unsplit([r[name] for r in per_rank], zigzag) for name in per_rank[0]}


def _noise(heads: int, kv_heads: int, causal: bool, window: int | None, ref64: dict) -> dict[str, float]:
    """Per tensor, the larger distance to float64 of torch's two fp32 attentions (written out
    and fused): both are correct, and their rounding differs as blockwise attention's does."""
    inputs = _inputs(heads, kv_heads, torch.float32)
    written, fused = (rel_distances(_reference(*inputs, causal, window, fused=f), ref64) for f in (False, True))
    return {name: max(written[name], fused[name]) for name in written}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("algorithm,causal,heads,kv_heads,window", CASES,
                         ids=[f"{a}, {'causal' if c else 'full'}, {h}q/{kv}kv heads" + (f", window {w}" if w else "")
                              for a, c, h, kv, w in CASES])
def test_attention_over_the_split_sequence_equals_one_process(runs, algorithm, causal, heads, kv_heads, window):
    world, results = runs
    zigzag = algorithm == "ring" and causal
    ref64 = _reference(*_inputs(heads, kv_heads, torch.float64), causal, window)
    noise = _noise(heads, kv_heads, causal, window, ref64)
    got32 = _gathered([r[algorithm, causal, heads, kv_heads, window, torch.float32] for r in results], zigzag)
    got64 = _gathered([r[algorithm, causal, heads, kv_heads, window, torch.float64] for r in results], zigzag)
    for name, distance in rel_distances(got32, ref64).items():
        assert distance <= 2 * noise[name] + 4 * EPS32, (f"{algorithm} at cp={world}: {name} is {distance:.3g} from "
                                                         f"float64, the fp32 reference {noise[name]:.3g}")
    for name, distance in rel_distances(got64, ref64).items():
        assert distance <= 1e-12, f"{algorithm} at cp={world} in float64: {name} is {distance:.3g} from the reference"


TILED = [(True, None), (True, 5), (False, None)]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("causal,window", TILED, ids=["causal", "window 5", "full"])
def test_ring_attention_in_tiles_equals_one_process(runs, causal, window):
    """Tiles of 3 tokens, smaller than the chunks: each tile's scores are all that exists at once."""
    world, results = runs
    ref64 = _reference(*_inputs(8, 2, torch.float64), causal, window)
    noise = _noise(8, 2, causal, window, ref64)
    got = _gathered([r["tiled", causal, window] for r in results], zigzag=causal)
    for name, distance in rel_distances(got, ref64).items():
        assert distance <= 2 * noise[name] + 4 * EPS32, f"tiled at cp={world}: {name} is {distance:.3g} from float64"


@pytest.mark.timeout(180)
def test_causal_ring_attention_needs_the_zigzag_split(runs):
    """The check above rejects causal ring attention handed each rank's contiguous tokens."""
    world, results = runs
    got = _gathered([r["contiguous"] for r in results], zigzag=False)
    ref64 = _reference(*_inputs(8, 8, torch.float64), causal=True)
    assert max(rel_distances(got, ref64).values()) > 0.01


@pytest.mark.timeout(180)
def test_ulysses_refuses_heads_the_group_does_not_divide(runs):
    world, results = runs
    message = results[0]["heads"]
    if world == 2:
        assert message is None  # 6 heads split over 2 ranks
    else:
        assert message is not None and "6 query heads" in message and "parallel.cp=4" in message


def test_zigzag_split_balances_causal_work_and_unsplits():
    c, n = 4, 32
    positions = [zigzag_positions(n, r, c) for r in range(c)]
    assert torch.equal(zigzag_unsplit(positions, 0), torch.arange(n))
    assert positions[0].tolist() == [0, 1, 2, 3, 28, 29, 30, 31]
    visible_pairs = [int((p + 1).sum()) for p in positions]  # query at position i sees i + 1 keys
    assert len(set(visible_pairs)) == 1, visible_pairs


def test_zigzag_split_refuses_a_sequence_it_cannot_cut_evenly():
    with pytest.raises(ContextParallelError, match="not divisible by 8"):
        zigzag_split(torch.zeros(1, 12), 1, 0, 4)
    with pytest.raises(ContextParallelError, match="outside the context-parallel group"):
        zigzag_split(torch.zeros(1, 16), 1, 4, 4)


def test_ring_attention_keeps_for_backward_only_its_inputs_output_and_log_sum_exp():
    """No block's s × s scores are saved: backward recomputes them from the log-sum-exp, so
    the memory ring attention holds for backward grows with this rank's tokens, not their square."""
    q, k, v, _ = (t.requires_grad_() for t in _inputs(8, 2, torch.float32))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        out = ring_attention(q, k, v, None, causal=True)
    lse = q.shape[0] * q.shape[1] * q.shape[2]
    assert sorted(saved) == sorted([q.numel(), k.numel(), v.numel(), out.numel(), lse])





@pytest.mark.parametrize("causal", [True, False])
def test_ring_attention_in_16_bits_computes_in_fp32(causal):
    """bf16 q, k, v: the ring folds every key block into fp32 running outputs and log-sum-exps,
    and its backward recomputes and accumulates in fp32 too, rounding to bf16 once at the end:
    output and gradients are, bit for bit, the fp32 ring's on the same values rounded to bf16
    (whose accuracy the fp32 tests above bound by the float64 oracle). Accumulators in bf16 fail
    this (measured: a ring entirely in bf16 differs on most elements)."""
    torch.manual_seed(0)
    inputs = [torch.randn(1, 2, 256, 16).to(torch.bfloat16).requires_grad_() for _ in range(3)]
    as_fp32 = [x.detach().float().requires_grad_() for x in inputs]
    grad = torch.randn(1, 2, 256, 16).to(torch.bfloat16)
    out = ring_attention(*inputs, None, causal=causal)
    out32 = ring_attention(*as_fp32, None, causal=causal)
    assert out.dtype == torch.bfloat16 and torch.equal(out, out32.to(torch.bfloat16))
    grads = torch.autograd.grad(out, inputs, grad)
    grads32 = torch.autograd.grad(out32, as_fp32, grad.float())
    for name, g, g32 in zip("qkv", grads, grads32):
        assert g.dtype == torch.bfloat16 and torch.equal(g, g32.to(torch.bfloat16)), f"d{name}"
