"""The chunk plan of the NVMe optimizer (tiertrain/update/nvme/optimizer.py): each shard cut
into chunks of at most one buffer's elements, each chunk with the parameter pieces (element
ranges, grouped by weight decay) it updates, and the pieces derived from param groups.

**Exactness.** The update is torch's own fused CPU AdamW, called through the public functional
API ``torch.optim.adamw.adamw(..., fused=True)`` on views of each parameter piece inside the
chunk: bit for bit what ``torch.optim.AdamW(fused=True)`` computes on the same pieces in memory
(``tests/test_nvme_optimizer.py``). That needs care at chunk boundaries: the kernel runs whole
SIMD vectors from the start of each tensor it is given and a scalar loop over the last
``numel % vector`` elements, which rounds some elements differently, so a piece cut at an
arbitrary element would round its elements around the cut differently from the uncut piece.
Chunks therefore cut inside a piece only at multiples of ``ALIGN_ELEMS`` (64, a multiple of
every CPU vector width of fp32 and of the kernel's 16-element task unit) counted from the
piece's start; the vectorised/scalar split of every element is then the same as for the whole
piece. That split is the kernel's internal behaviour, not something torch documents, and no
public API updates part of a tensor exactly as the whole would be updated: the library relies
on it, and ``tests/test_private_apis.py`` fails if it changes (whole and cut pieces compared
bit for bit, under 1 and 2 threads, including the cuts :func:`_plan` makes). The step count is
one per optimizer (every piece is at the same step, as in torch), and the learning rate is
passed by the caller at every step (the schedule lives in the engine).
"""
from __future__ import annotations

import bisect
import math
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from .chunk_update import MASTER_BYTES, Chunk

__all__ = ["ALIGN_ELEMS", "DEFAULT_CHUNK_BYTES", "PAGE_ELEMS", "Destination", "Piece", "pieces_from_param_groups"]

ALIGN_ELEMS = 64
"""Cuts inside a parameter piece fall at multiples of this many elements from its start, so that
the fused AdamW kernel's private vector/scalar split of every element is the one of the uncut
piece (module docstring; checked by tests/test_private_apis.py)."""
PAGE_ELEMS = 4096 // MASTER_BYTES
"""fp32 master elements per 4 KiB page (the unit of O_DIRECT transfers)."""
DEFAULT_CHUNK_BYTES = 24 << 20
Piece = Tuple[int, int, float]           # (start, end, weight_decay) in shard elements
Destination = Union[None, Sequence[Optional[torch.Tensor]], Callable[[int, int, int, torch.Tensor], None]]


def _check_pieces(s: int, numel: int, pieces: Sequence[Piece]) -> List[Piece]:
    out, end = [], 0
    for k, piece in enumerate(pieces):
        try:
            a, b, wd = int(piece[0]), int(piece[1]), float(piece[2])
        except (TypeError, ValueError, IndexError):
            raise ValueError(f"pieces[{s}][{k}]={piece!r}: expected (start, end, weight_decay)") from None
        if not 0 <= a <= b <= numel:
            raise ValueError(f"pieces[{s}][{k}]=({a}, {b}): outside shard {s} of {numel} elements")
        if a < end:
            raise ValueError(f"pieces[{s}][{k}]=({a}, {b}) overlaps or precedes the previous piece "
                             f"(ending at {end}); give each shard's pieces sorted and disjoint")
        if not math.isfinite(wd) or wd < 0:
            raise ValueError(f"pieces[{s}][{k}]: weight_decay={wd} must be finite and >= 0")
        out.append((a, b, wd))
        end = b
    return out


def _plan(s: int, numel: int, pieces: List[Piece], cap: int) -> List[Chunk]:
    """Cut shard ``s`` into chunks of at most ``cap`` elements (a multiple of ALIGN_ELEMS); a cut
    inside a piece falls at a multiple of ALIGN_ELEMS from the piece's start."""
    live = [p for p in pieces if p[1] > p[0]]
    starts = [p[0] for p in live]
    chunks, lo = [], 0
    while lo < numel:
        hi = min(numel, lo + cap)
        k = bisect.bisect_right(starts, hi - 1) - 1           # last piece starting before hi
        if hi < numel and k >= 0 and live[k][0] < hi < live[k][1]:
            a = live[k][0]
            hi = a + (hi - a) // ALIGN_ELEMS * ALIGN_ELEMS    # > lo: see the module docstring
        assert lo < hi
        groups: Dict[float, List[Tuple[int, int]]] = {}
        for a, b, wd in live:
            x, y = max(a, lo), min(b, hi)
            if x < y:
                groups.setdefault(wd, []).append((x - lo, y - lo))
        chunks.append(Chunk(s, len(chunks), lo, hi,
                            tuple((wd, tuple(r)) for wd, r in groups.items())))
        lo = hi
    return chunks


def pieces_from_param_groups(shards: Sequence[torch.Tensor], groups: Sequence[dict],
                             default_weight_decay: float = 0.0) -> List[List[Piece]]:
    """The ``pieces`` argument from torch-style param groups whose params are contiguous 1-D
    views of ``shards`` (as tiertrain.update.protocol.shard_param_groups builds them over the
    units' shards): each view becomes (start, end, group's weight_decay) of the shard it lies
    in. Empty views are skipped."""
    spans = []
    for s, t in enumerate(shards):
        base = t.data_ptr()
        spans.append((base, base + t.numel() * t.element_size(), s, t))
    out: List[List[Piece]] = [[] for _ in shards]
    for gi, g in enumerate(groups):
        wd = float(g.get("weight_decay", default_weight_decay))
        for pi, p in enumerate(g["params"]):
            if p.numel() == 0:
                continue
            if p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"groups[{gi}].params[{pi}]: expected a contiguous fp32 view of a shard")
            ptr = p.data_ptr()
            for lo, hi, s, t in spans:
                if lo <= ptr < hi and p.untyped_storage().data_ptr() == t.untyped_storage().data_ptr():
                    a = (ptr - lo) // 4
                    if a + p.numel() > t.numel():
                        raise ValueError(f"groups[{gi}].params[{pi}] runs past the end of shard {s}")
                    out[s].append((a, a + p.numel(), wd))
                    break
            else:
                raise ValueError(f"groups[{gi}].params[{pi}] is not a view of any of the shards")
    for pieces in out:
        pieces.sort()
    return out
