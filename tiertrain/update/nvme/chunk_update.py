"""One NVMe optimizer step, chunk by chunk: the chunk records of the optimizer state, the AdamW
update applied to each chunk, and the statistics of a streamed pass.

:class:`~tiertrain.update.nvme.optimizer.NVMeAdamW` plans the chunks and streams them through
its buffers; the update it runs on each chunk is a :class:`ChunkUpdate`, the same object
whether the step runs synchronously (NVMeAdamW.step) or on a worker thread during backward
(:class:`~tiertrain.update.nvme.overlapped_step.OverlappedStep`, which gates each chunk on its
shard's gradient). Both modules build on this one, so neither needs the other's internals.

The update is an elementwise rule (tiertrain/elementwise.py): by default torch's fused CPU
AdamW through the public functional API ``torch.optim.adamw.adamw(..., fused=True)``, bit for
bit what ``torch.optim.AdamW(fused=True)`` computes on the same pieces (see the plan.py
module docstring for the chunk cuts that keep it so); SGD with momentum likewise. Calling the kernel on pieces of a chunk rather than on whole parameter pieces
relies on a private property of that kernel (its split into whole SIMD vectors from each
tensor's start and a scalar tail), for which torch has no public guarantee or API;
tests/test_private_apis.py fails if it changes.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Tuple

import torch

from ...elementwise import ElementwiseRule

__all__ = ["BYTES_PER_ELEM", "MASTER_BYTES", "MOMENT_BYTES", "Chunk", "ChunkUpdate", "StepStats", "publish_chunk"]

MASTER_BYTES = 4                         # fp32 master, a chunk's first record
MOMENT_BYTES = 8                         # two fp32 state slots (AdamW: exp_avg, exp_avg_sq), its second
BYTES_PER_ELEM = MASTER_BYTES + MOMENT_BYTES


@dataclass(frozen=True)
class Chunk:
    """A contiguous element range of one shard, updated, read and written as two swap records
    (master, moments) of ``BYTES_PER_ELEM`` bytes per element in all (plan._plan cuts
    the shards)."""

    shard: int
    index: int                            # chunk number within the shard
    lo: int                               # shard element range [lo, hi)
    hi: int
    groups: Tuple[Tuple[float, Tuple[Tuple[int, int], ...]], ...]   # (wd, chunk-relative ranges)

    @property
    def numel(self) -> int:
        return self.hi - self.lo

    @property
    def nbytes(self) -> int:
        return BYTES_PER_ELEM * (self.hi - self.lo)


@dataclass
class StepStats:
    """What one streamed pass (a step, or the pass of state_dict/load/publish) did.

    ``io_seconds``: wall time during which at least one of the pass's IO requests was in flight;
    ``io_wait_seconds``: time the calling thread was blocked on IO; ``busy_seconds`` =
    seconds - io_wait - ready_wait: time it worked (AdamW: ``compute_seconds``, copies to the
    destinations: ``publish_seconds``, and the bookkeeping of the pipeline); ``ready_wait_seconds``:
    time an overlapped step's worker waited for gradients (tiertrain/update/nvme/overlapped_step.py).
    ``overlap`` is the fraction of the shorter of IO and work that ran concurrently with the
    other, (io - io_wait) / min(io, busy): 1 when the pass took only as long as the longer of
    the two, as the paper's overlapped NVMe step aims for; 0 when they ran one after the other. ``io_hidden`` = 1 -
    io_wait / io is the fraction of the IO time hidden behind work (at most busy / io, so small
    whenever the update is much faster than the disk)."""

    op: str = "step"
    step: int = 0
    chunks: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    seconds: float = 0.0
    io_seconds: float = 0.0
    io_wait_seconds: float = 0.0
    compute_seconds: float = 0.0
    publish_seconds: float = 0.0
    ready_wait_seconds: float = 0.0
    masters_from_ram: int = 0             # chunks whose master was taken from RAM, not read
    masters_updated_in_ram: int = 0       # ... of which updated in place there and written from it (no copy)
    master_copy_cpu_seconds: float = 0.0  # CPU time of copying the others into the buffer (the pass's thread)
    _intervals: List[Tuple[float, float]] = field(default_factory=list, repr=False)

    @property
    def gbps(self) -> float:
        """Bytes read + written per second of the whole pass (10^9 B/s)."""
        return (self.bytes_read + self.bytes_written) / self.seconds / 1e9 if self.seconds else 0.0

    @property
    def io_gbps(self) -> float:
        """Bytes read + written per second of IO activity (10^9 B/s)."""
        return (self.bytes_read + self.bytes_written) / self.io_seconds / 1e9 if self.io_seconds else 0.0

    @property
    def busy_seconds(self) -> float:
        return max(0.0, self.seconds - self.io_wait_seconds - self.ready_wait_seconds)

    @property
    def overlap(self) -> float:
        shorter = min(self.io_seconds, self.busy_seconds)
        if shorter <= 0:
            return 0.0
        return max(0.0, min(1.0, (self.io_seconds - self.io_wait_seconds) / shorter))

    @property
    def io_hidden(self) -> float:
        if self.io_seconds <= 0:
            return 0.0
        return max(0.0, min(1.0, 1.0 - self.io_wait_seconds / self.io_seconds))

    def record_io(self, submitted: float, done: float) -> None:
        """One IO request of the pass was in flight from ``submitted`` to ``done``
        (time.perf_counter); may be called from IO threads."""
        self._intervals.append((submitted, done))

    def sum_io_time(self) -> None:
        """Set ``io_seconds`` to the time covered by the recorded IO requests (their union),
        once the pass is over."""
        total, end = 0.0, -math.inf
        for a, b in sorted(self._intervals):
            if b <= end:
                continue
            total += b - max(a, end)
            end = b
        self.io_seconds = total

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if not k.startswith("_")}
        d.update(gbps=self.gbps, io_gbps=self.io_gbps, busy_seconds=self.busy_seconds,
                 overlap=self.overlap, io_hidden=self.io_hidden)
        return d


def publish_chunk(dests, ch: Chunk, p: torch.Tensor) -> None:
    """Copy the fp32 values ``p`` of chunk ``ch`` to the destinations: ``dests(shard, start,
    end, p)`` when callable, else into the shard's tensor in ``dests`` (skipped when None)."""
    if callable(dests):
        dests(ch.shard, ch.lo, ch.hi, p)
    elif dests[ch.shard] is not None:
        with torch.no_grad():
            dests[ch.shard][ch.lo:ch.hi].copy_(p)


class ChunkUpdate:
    """The work of one step on each chunk: the rule (torch's fused AdamW, SGD) on the chunk's pieces, then the
    updated masters published to the destinations (after the chunk's write was submitted).
    ``gate(shard, stats)``, when set, runs first and blocks until the shard's gradient is final
    (an overlapped step). ``published`` lists the chunks already (being) published, so a failed
    or cancelled step knows what to restore; ``updated`` counts the chunks updated and published.

    ``grads`` and ``dests`` are as NVMeAdamW checked them: one flat fp32 gradient per shard,
    and None, a list with one flat tensor (or None) per shard, or a callable (see
    :func:`publish_chunk`). ``step_number`` is the step this update makes (1 for the first)."""

    def __init__(self, grads: List[torch.Tensor], dests, lr: float, step_number: int, rule: ElementwiseRule,
                 piece_step: Optional[Callable[[int, int], Optional[int]]] = None, skip: frozenset = frozenset()):
        self.grads = grads
        self.dests = dests
        self.lr = float(lr)
        if not math.isfinite(self.lr) or self.lr < 0:
            raise ValueError(f"lr={lr} must be finite and >= 0")
        self.step_number = step_number
        self.rule = rule
        self.piece_step = piece_step or (lambda shard, element: step_number)
        """(shard, element) → the update number of the piece holding that element in this step,
        or None when the piece is left unchanged (no rank computed its gradient)."""
        self.skip = skip
        """(shard, piece start) of the pieces this step leaves unchanged (counted at commit)."""
        self.gate: Optional[Callable[[int, StepStats], None]] = None
        self.masters_in_ram: Optional[Callable[[int], Optional[torch.Tensor]]] = None
        """shard → its committed master values when already in RAM (NVMeAdamW.begin_step)."""
        self.published: List[int] = []
        self.updated = 0

    def work(self, j: int, ch: Chunk, p, m, v, stats: StepStats):
        """The update of chunk ``ch`` (its values ``p`` and state slots ``m``, ``v`` in a
        streaming buffer); returns :meth:`publish`, which the pass runs once the chunk's write
        is submitted."""
        if self.gate is not None:
            self.gate(ch.shard, stats)
        t0 = time.perf_counter()
        g = self.grads[ch.shard]
        with torch.no_grad():
            # Pieces cut at ALIGN_ELEMS from their start: bit for bit the whole-piece update only
            # through the kernel's private vector/scalar split (tests/test_private_apis.py).
            for wd, ranges in ch.groups:
                steps = [self.piece_step(ch.shard, ch.lo + a) for a, _ in ranges]
                ranges = [r for r, step in zip(ranges, steps) if step is not None]
                if ranges:
                    self.rule.apply([p[a:b] for a, b in ranges], [g[ch.lo + a: ch.lo + b] for a, b in ranges],
                                    [m[a:b] for a, b in ranges], [v[a:b] for a, b in ranges],
                                    [step for step in steps if step is not None], self.lr, wd)
        stats.compute_seconds += time.perf_counter() - t0
        return self.publish                  # runs once the chunk's write is submitted

    def publish(self, j: int, ch: Chunk, p, m, v, stats: StepStats) -> None:
        """Copy chunk ``ch``'s updated masters ``p`` to the destinations."""
        if self.dests is not None:
            t0 = time.perf_counter()
            self.published.append(j)         # counted first: a half-done copy is restored too
            publish_chunk(self.dests, ch, p)
            stats.publish_seconds += time.perf_counter() - t0
        self.updated += 1                    # (updated and published)
