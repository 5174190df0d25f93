"""AdamW whose fp32 master weights and moments live on NVMe: ZeRO-Infinity's optimizer step
from NVMe (docs/concepts.md#optimizer-step-with-nvme; ZeRO-Offload §2 is the CPU-memory case).

Between steps this rank's optimizer state — for every ZeRO unit, the fp32 master shard and
AdamW's ``exp_avg`` and ``exp_avg_sq`` — is held only in swap files (one
:class:`~tiertrain.io.swap.TensorSwapper` key per chunk). :meth:`NVMeAdamW.step` streams it
through CPU memory chunk by chunk, in a ring of ``num_buffers`` aligned buffers of
``chunk_bytes`` each, with the three kinds of work of the paper overlapped:

* reading chunk i+1 (and further ahead with more buffers) from NVMe — IO worker threads;
* the AdamW update of chunk i in the calling thread (torch's fused CPU kernel), followed by
  publishing the updated fp32 parameters of the chunk to the caller's destination (e.g. the
  compute-dtype shard ``u.shard``, any dtype, or a callback);
* writing chunk i-1 back to NVMe — IO worker threads, straight from the buffer (no copy).

So the RAM the optimizer needs is ``num_buffers × chunk_bytes`` whatever the model size
(:attr:`NVMeAdamW.resident_bytes`); the gradients stay where the caller keeps them (the fp32
gradient shards the reducer produced) and are read in place.

**Chunk records.** A chunk of ``n`` elements is two swap records: its fp32 master values
(``4·n`` bytes, key ``….p``) and its two moments ``[exp_avg | exp_avg_sq]`` (``8·n`` bytes, key
``….mv``), each verified by the swap layer's size and checksum records (XXH3 by default). A
chunk costs two read and two write requests per pass. The master record on its own is what
makes the parameter tier and the optimizer share one copy of an fp32 shard: a stage-3 gather
reads a unit's master records (:meth:`NVMeAdamW.read_master`, 4 bytes per element, not 12),
so fp32 parameters on NVMe need no swap file of their own
(tiertrain/offload/shard_store.py, OptimizerMasterShards). A step given a shard's masters in
RAM (:meth:`NVMeAdamW.begin_step`, ``masters_in_ram``: the staging that gather read) reads only
the moments record, and a chunk that starts at a page boundary of that tensor is updated there
and its master record written from it with no copy: chunks are whole pages of masters
(``PAGE_ELEMS``) whenever the chunk size allows, so every cut of a shard whose pieces start at
multiples of ``ALIGN_ELEMS`` falls on a page boundary.

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

**Failures.** Every IO error surfaces as the swap layer's exception naming the file or directory
(:class:`~tiertrain.io.aio.SwapDirError`, :class:`~tiertrain.io.aio.SwapSpaceError`,
:class:`~tiertrain.io.aio.SwapCorruptionError`, or ``TimeoutError`` after
``wait_timeout`` — nothing waits unbounded), with a note saying what state is left:

* ``transactional=True`` (default): every chunk's record has two generations on disk; a step
  reads each chunk's committed generation and writes the other, and only once every write
  landed does it commit (switch the generations, count the step). A step that fails leaves the NVMe state, the step count and — by
  streaming the pre-step masters back into the chunks it had already published — the
  destinations as they were before the step, so the step can be retried (e.g. after freeing
  disk space). If that restore itself fails the note says so, and the destinations hold new
  values for a prefix of the chunks until the next successful step or :meth:`publish`. A
  corrupt or truncated file of generation g fails every retry the same way: load a checkpoint
  (:meth:`load_state_dict`). Costs twice the disk space (``24`` bytes per parameter).
* ``transactional=False``: one generation, updated in place (``12`` bytes per parameter on
  disk). A failed step leaves chunks before the failure updated and the failing one possibly
  half-written (its record then raises on every read instead of returning stale bytes); the
  optimizer refuses further steps until :meth:`load_state_dict` restores a consistent state.

**Threads.** The update runs on ``compute_threads`` torch threads during a pass ("auto": one
fewer than torch's setting), so that a core stays free for the IO workers' copies and
checksums: OpenMP threads on every core contend with the IO workers, which slows the update, the
publish copies and the whole step (bench/results/nvme_optimizer.md, the "2 compute thread(s)"
row against the "auto" rows, on 2 cores).

**Overlapped step.** :meth:`begin_step` runs the same step on a worker thread that updates each
shard's chunks as soon as the caller declares that shard's gradient final, so that the disk
works during backward (tiertrain/update/nvme/overlapped_step.py; the engine uses it when no global
norm gates the step).

**Other passes.** :meth:`prefetch` starts the first reads of the next step early (e.g. during
the gradient-norm all-reduce); :meth:`state_dict` gathers the state from NVMe into CPU tensors,
:meth:`load_state_dict` writes one back (as the other generation when transactional, so a
failed load leaves the old state); :meth:`read_masters` / :meth:`write_masters` read or replace
the fp32 masters alone (full state dicts, parameters edited outside training); :meth:`publish`
streams the masters into destinations (after a load). :attr:`last_stats` reports bytes moved,
seconds, achieved GB/s and the overlap of IO and work (:class:`StepStats`).
"""
from __future__ import annotations

import bisect
import contextlib
import math
import shutil
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...elementwise import AdamWRule, ElementwiseRule
from ...io.aio import DEFAULT_CHECKSUM, AsyncIO, SwapSpaceError
from ...io.buffers import AlignedBufferPool, Buffer, round_up, tensor_range_buffer
from .chunk_update import BYTES_PER_ELEM, MASTER_BYTES, MOMENT_BYTES, Chunk, ChunkUpdate, StepStats, publish_chunk
from .overlapped_step import OverlappedStep
from ...comm import run_timeout
from ...io.swap import DEFAULT_WAIT_TIMEOUT, SwapHandle, TensorSwapper

__all__ = ["ALIGN_ELEMS", "NVMeAdamW", "StepStats", "pieces_from_param_groups"]

ALIGN_ELEMS = 64
"""Cuts inside a parameter piece fall at multiples of this many elements from its start, so that
the fused AdamW kernel's private vector/scalar split of every element is the one of the uncut
piece (module docstring; checked by tests/test_private_apis.py)."""
PAGE_ELEMS = 4096 // MASTER_BYTES
"""fp32 master elements per 4 KiB page (the unit of O_DIRECT transfers)."""
DEFAULT_CHUNK_BYTES = 24 << 20
Piece = Tuple[int, int, float]           # (start, end, weight_decay) in shard elements
Destination = Union[None, Sequence[Optional[torch.Tensor]], Callable[[int, int, int, torch.Tensor], None]]


# ---------------------------------------------------------------------------------------------
# Plan: chunks of each shard, cut so that the fused kernel rounds every element as it would
# for the uncut piece
# ---------------------------------------------------------------------------------------------
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


def _last_shard_kept(read: Callable[[int], torch.Tensor]) -> Callable[[int], torch.Tensor]:
    """``read`` keeping only the last shard it returned: a pass visits each shard's chunks one
    after the other, so one shard's values are held at a time, not the whole rank's."""
    last: List = [None, None]

    def values(s: int) -> torch.Tensor:
        if last[0] != s:
            last[0], last[1] = s, None
            last[1] = read(s).detach().reshape(-1)
        return last[1]
    return values


class _Requests:
    """The swap requests of one chunk (its master and moments records) as one handle:
    ``wait`` waits for all of them, then raises the first error."""

    def __init__(self, handles: Sequence[SwapHandle]):
        self.handles = list(handles)

    def wait(self, timeout: Optional[float] = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        first: Optional[BaseException] = None
        for h in self.handles:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                h.wait(left)
            except BaseException as e:  # noqa: BLE001 - the others are waited for first
                first = first or e
        if first is not None:
            raise first

    def add_done_callback(self, fn: Callable[["_Requests"], None]) -> None:
        """Run ``fn(self)`` once every request completed (in the thread completing the last)."""
        left = [len(self.handles)]
        lock = threading.Lock()

        def one_done(_h) -> None:
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                fn(self)
        for h in self.handles:
            h.add_done_callback(one_done)


# ---------------------------------------------------------------------------------------------
# The optimizer
# ---------------------------------------------------------------------------------------------
class NVMeAdamW:
    """AdamW over fp32 master shards kept on NVMe; see the module docstring.

    Args:
        shards: this rank's fp32 master shards (one flat tensor per ZeRO unit) with their
            initial values; copied to NVMe here (the caller may free them afterwards).
        pieces: per shard, the (start, end, weight_decay) element ranges the optimizer updates
            (sorted, disjoint; 0-length allowed); elements outside every piece (padding) are kept
            unchanged. None: each shard is one piece with ``config.weight_decay``. See
            :func:`pieces_from_param_groups` to derive them from param groups of views.
        config: an :class:`~tiertrain.config.OptimizerConfig` (betas, eps, weight_decay used).
        rule: the update (tiertrain/elementwise.py); None: AdamW with config's betas and eps.
            A step may pass another rule (a scheduler changed betas or momentum).
        swapper: a TensorSwapper to keep the files in (shared with other users of the rank's
            swap directory; keys are prefixed with ``name``) — or None with ``swap_dir`` to
            create a private AsyncIO + TensorSwapper (closed by :meth:`close`).
        chunk_bytes: RAM of one streaming buffer (master + exp_avg + exp_avg_sq of one chunk:
            ``chunk_bytes // 12`` elements, rounded down to a multiple of 64).
        num_buffers: ring size (≥ 3): chunk i+1 .. i+num_buffers-2 are read while chunk i is
            updated and chunk i-1 written. RAM used = num_buffers × chunk_bytes (rounded to pages;
            less when the largest shard is smaller than one chunk), whatever the model size.
        transactional: keep two generations on disk so a failed step changes nothing.
        initial: ``initial(s)`` returns shard s's initial values (called once per shard, in
            order), when ``shards`` give only sizes (tensors without storage: parameters whose
            values are in another tier's swap file); None reads them from ``shards``.
        compute_threads: torch intra-op threads while streaming (set and restored around each
            pass): "auto" = one fewer than torch's setting (at least 1), leaving a core to the IO
            threads' copies and checksums; an int; None keeps the caller's setting (see
            **Threads** in the module docstring).
    """

    def __init__(self, shards: Sequence[torch.Tensor], pieces: Optional[Sequence[Sequence[Piece]]],
                 config, swapper: Optional[TensorSwapper] = None, *, swap_dir=None,
                 rank: Optional[int] = None, chunk_bytes: int = DEFAULT_CHUNK_BYTES,
                 num_buffers: int = 4, transactional: bool = True, name: str = "nvme_adamw",
                 aio_threads: int = 4, aio_block_bytes: int = 8 << 20,
                 checksum: Optional[str] = DEFAULT_CHECKSUM, pin: Optional[bool] = None,
                 compute_threads: Union[int, str, None] = "auto",
                 wait_timeout: Optional[float] = DEFAULT_WAIT_TIMEOUT, rule: Optional[ElementwiseRule] = None,
                 initial: Optional[Callable[[int], torch.Tensor]] = None):
        if (swapper is None) == (swap_dir is None):
            raise ValueError("give exactly one of swapper= (a TensorSwapper) or swap_dir=")
        if num_buffers < 3:
            raise ValueError(f"num_buffers={num_buffers}: the read/update/write pipeline needs at least 3")
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes={chunk_bytes} must be positive")
        self.rule = rule or AdamWRule(tuple(float(b) for b in config.betas), float(config.eps))
        self.transactional = bool(transactional)
        self.name = name
        # None: the run's one timeout (--timeout; tiertrain.comm.run_timeout()).
        self.wait_timeout = wait_timeout = run_timeout() if wait_timeout is None else wait_timeout
        self.step_count = 0
        self.last_stats: Optional[StepStats] = None
        self.totals = {"steps": 0, "bytes_read": 0, "bytes_written": 0, "seconds": 0.0}
        self._closed = False
        self._broken: Optional[str] = None
        self._version = 0                 # commits so far (a prefetch is valid for one version)
        self._prefetched: Dict[int, Tuple[_Requests, float]] = {}   # chunk -> (reads, submitted)
        self._writes_from_ram: Dict[int, List[_Requests]] = {}     # shard -> writes from its masters in RAM (when_written)
        self._prefetch_version = -1
        self._active = None               # the OverlappedStep in progress, if any
        self.compute_threads = compute_threads
        self._lock = threading.Lock()
        self._shard_numels = [int(t.numel()) for t in shards]
        if pieces is None:
            pieces = [[(0, n, float(config.weight_decay))] for n in self._shard_numels]
        if len(pieces) != len(shards):
            raise ValueError(f"{len(pieces)} piece lists for {len(shards)} shards")
        self.pieces = [_check_pieces(s, n, p) for s, (n, p) in enumerate(zip(self._shard_numels, pieces))]
        self._piece_starts = [[a for a, _, _ in p] for p in self.pieces]
        self.skipped = [[0] * len(p) for p in self.pieces]
        """Per shard and piece: the steps that left the piece unchanged (its parameter had no
        gradient on any rank), so its own update number is the optimizer's minus these, as torch
        keeps one step count per parameter."""
        for s, t in enumerate(shards):
            if t.dtype != torch.float32:
                raise ValueError(f"shards[{s}] is {t.dtype}; master shards are fp32")
        # Whole pages of masters where the size allows: a shard whose pieces start at multiples
        # of ALIGN_ELEMS is then cut at page boundaries, so that a master already in RAM in a
        # page-aligned tensor is updated and written in place (begin_step's masters_in_ram).
        per_chunk = chunk_bytes // BYTES_PER_ELEM
        unit = PAGE_ELEMS if per_chunk >= PAGE_ELEMS else ALIGN_ELEMS
        self.chunk_elems = max(ALIGN_ELEMS, per_chunk // unit * unit)
        self._chunks = [c for s, (n, p) in enumerate(zip(self._shard_numels, self.pieces))
                        for c in _plan(s, n, p, self.chunk_elems)]
        self._gens = [0] * len(self._chunks)   # generation holding each chunk's committed record
        # The streaming buffers: one private pool, every buffer acquired now and held (no
        # larger than the largest chunk, so a model smaller than one chunk needs less).
        biggest = max((c.numel for c in self._chunks), default=0)
        # A buffer holds a chunk's master at its start and its moments at the next aligned
        # offset, so that both records are read and written straight from it.
        self._moments_at = round_up(MASTER_BYTES * biggest, 4096)
        slot = max(4096, self._moments_at + round_up(MOMENT_BYTES * biggest, 4096))
        self.num_buffers = num_buffers
        self._pool = AlignedBufferPool(num_buffers * slot, slot, pin=pin, acquire_timeout=wait_timeout)
        self._own_swapper = swapper is None
        self._aio: Optional[AsyncIO] = None
        if swapper is None:
            self._aio = AsyncIO(aio_threads, aio_block_bytes, checksum=checksum)
            try:
                swapper = TensorSwapper(swap_dir, self._aio, self._pool, rank=rank, create=True,
                                        wait_timeout=wait_timeout)
            except BaseException:
                self._aio.close(wait_timeout)
                raise
        self.swapper = swapper
        self._owns_keys = False           # until the name is known to be free on the swapper
        prefix = f"{name}."
        if any(str(k).startswith(prefix) for k in swapper.keys()):
            self._release_resources()
            raise ValueError(f"{swapper.rank_dir} already holds keys named {prefix}*; give each "
                             f"NVMeAdamW on a swapper its own name")
        self._owns_keys = True
        self._slots: List[Buffer] = [self._pool.acquire(slot) for _ in range(num_buffers)]
        try:
            self._check_space()
            if initial is None:
                given = [t.detach().reshape(-1) for t in shards]
                values = given.__getitem__
            else:
                values = _last_shard_kept(initial)

            def fill(j, ch: Chunk, p, m, v, stats) -> None:
                p.copy_(values(ch.shard)[ch.lo:ch.hi])
                m.zero_()
                v.zero_()
            self._commit(self._stream("init", fill, read=False, write=True)[1])
        except BaseException:
            self.close()
            raise

    # -- properties -------------------------------------------------------------------------
    @property
    def num_shards(self) -> int:
        return len(self._shard_numels)

    def shard_numel(self, shard: int) -> int:
        """Elements of shard ``shard``."""
        return self._shard_numels[shard]

    @property
    def num_chunks(self) -> int:
        return len(self._chunks)

    @property
    def version(self) -> int:
        """Commits so far (steps, loads, edits of the masters): the state on NVMe may have changed
        whenever it moves."""
        return self._version

    @property
    def resident_bytes(self) -> int:
        """RAM this optimizer holds: the streaming buffers (constant in the model size)."""
        return self._pool.total_bytes

    @property
    def disk_bytes(self) -> int:
        """Swap file bytes (page-padded) across the generations kept."""
        per_gen = sum(round_up(MASTER_BYTES * c.numel, 4096) + round_up(MOMENT_BYTES * c.numel, 4096)
                      for c in self._chunks)
        return per_gen * (2 if self.transactional else 1)

    @property
    def state_bytes(self) -> int:
        """Logical bytes of master + exp_avg + exp_avg_sq (one generation)."""
        return BYTES_PER_ELEM * sum(self._shard_numels)

    def memory_report(self) -> dict:
        return {"resident_bytes": self.resident_bytes, "state_bytes": self.state_bytes,
                "disk_bytes": self.disk_bytes, "chunks": self.num_chunks,
                "chunk_elems": self.chunk_elems, "num_buffers": self.num_buffers}

    def files(self, part: str = "mv") -> List[str]:
        """Paths of the swap files of the current generation, in chunk order: the moments
        records (``part="mv"``) or the masters (``"p"``)."""
        return [self.swapper._record(self._key(j, g, part)).path for j, g in enumerate(self._gens)]

    # -- the step ---------------------------------------------------------------------------
    def prefetch(self) -> int:
        """Start reading the first chunks of the next step now (e.g. while the gradient norm is
        all-reduced). Optional; :meth:`step` picks the reads up, any other pass drops them.
        Returns the number of reads started."""
        self._check_usable()
        if self._prefetched or not self._chunks:
            return 0
        # Every buffer: none is busy before the step, whose pipeline reuses buffer i only once
        # the write of position i - B has finished.
        depth = min(self.num_buffers, len(self._chunks))
        with self._lock:
            self._prefetch_version = self._version
            for j in range(depth):
                t0 = time.perf_counter()
                self._prefetched[j] = (self._read(j, j), t0)
        return depth

    def step(self, grads: Sequence[torch.Tensor], lr: float, out: Destination = None,
             rule: Optional[ElementwiseRule] = None, skip: frozenset = frozenset()) -> StepStats:
        """One AdamW step at learning rate ``lr`` with ``grads`` (one fp32 tensor per shard, of
        the shard's size; only the pieces' ranges are read). ``out``: where the updated fp32
        parameters go, chunk by chunk, as soon as each is updated — a list with one tensor (any
        dtype, the shard's size; None to skip) per shard, or ``fn(shard, start, end, fp32)``.
        Returns once every chunk is written back (and, transactional, committed). ``rule``:
        this step's update (default: the optimizer's). ``skip``: (shard, piece start) of the
        pieces this step leaves unchanged, their state included."""
        self._check_usable()
        update = self._new_update(grads, lr, out, rule, skip)
        try:
            stats, new_gens = self.stream_step(update)
        except BaseException as e:
            self.recover_failed_step(e, update)
            raise
        return self.commit_step(update, stats, new_gens)

    def begin_step(self, grads: Sequence[torch.Tensor], lr: float, out: Destination = None,
                   shard_order: Optional[Sequence[int]] = None,
                   rule: Optional[ElementwiseRule] = None,
                   masters_in_ram: Optional[Callable[[int], Optional[torch.Tensor]]] = None) -> OverlappedStep:
        """Start the step of :meth:`step` on a worker thread that updates each shard's chunks
        once the caller declares the shard's gradient final (:meth:`OverlappedStep.shard_ready`),
        in ``shard_order`` (default: shard order; give the order in which they become final).
        Until :meth:`OverlappedStep.finish` (commits) or :meth:`OverlappedStep.cancel` (restores
        the destinations) every other call on this optimizer raises. See
        tiertrain/update/nvme/overlapped_step.py. ``masters_in_ram(shard)``: a tensor (fp32, the
        shard's size) holding the shard's committed master values when they are in RAM already
        (e.g. the staging of a stage-3 gather), or None; asked (on the worker) as each chunk's
        read is issued, and the chunks of a shard it gives read only their moments record. A
        chunk that starts at a page boundary of that tensor (with the tensor's storage running
        on to the page boundary after the chunk: tiertrain/io/buffers.py,
        page_aligned_empty) is updated in it and its master record written from it, with no
        copy: the tensor then holds the step's new values for those chunks. The tensor is the
        step's until the shard is updated (``on_shard_updated``) and the writes from it landed
        (:meth:`when_written`)."""
        self._check_usable()
        order = list(range(self.num_shards)) if shard_order is None else [int(s) for s in shard_order]
        if sorted(order) != list(range(self.num_shards)):
            raise ValueError(f"shard_order={list(shard_order)} is not a permutation of the "
                             f"{self.num_shards} shards 0..{self.num_shards - 1}")
        update = self._new_update(grads, lr, out, rule)
        update.masters_in_ram = masters_in_ram
        positions = [j for s in order for j in self._positions({s})]
        self._active = OverlappedStep(self, update, positions)
        return self._active

    # -- the pieces of a step, shared by step() and OverlappedStep ----------------------------
    def stream_step(self, update: ChunkUpdate, positions: Optional[List[int]] = None, *,
                    set_threads: bool = True) -> Tuple[StepStats, Dict[int, int]]:
        """Run ``update`` over the chunks at ``positions`` (default: all, in order, picking up
        :meth:`prefetch`'s reads): read each chunk, update it and write it back (to its other
        generation when transactional). Returns the stats and the generations written, for
        :meth:`commit_step`; nothing is committed yet. ``set_threads=False`` leaves torch's
        process-wide thread setting alone (a pass on a worker thread). Only for a step begun by
        :meth:`step` or :meth:`begin_step`."""
        return self._stream("step", update.work, positions=positions, read=True, write=True,
                            step=update.step_number, set_threads=set_threads, masters_in_ram=update.masters_in_ram)

    def commit_step(self, update: ChunkUpdate, stats: StepStats, new_gens: Dict[int, int]) -> StepStats:
        """Make the generations a step wrote current and count the step; returns its stats."""
        self._commit(new_gens)
        self.step_count = update.step_number
        for shard, start in update.skip:
            self.skipped[shard][self._piece_starts[shard].index(start)] += 1
        self.totals["steps"] += 1
        self.totals["bytes_read"] += stats.bytes_read
        self.totals["bytes_written"] += stats.bytes_written
        self.totals["seconds"] += stats.seconds
        return stats

    def recover_failed_step(self, error: BaseException, update: ChunkUpdate) -> None:
        """After ``update``'s pass raised ``error``: restore the chunks it already published
        (transactional) or mark the optimizer unusable, and add a note to ``error`` saying
        what state is left. The caller re-raises ``error``."""
        self._after_failed_step(error, update.step_number, update.dests, update.published)

    def restore_published(self, update: ChunkUpdate) -> int:
        """Stream the committed (pre-step) masters back into the destinations of the chunks
        ``update`` already published (a cancelled step). Returns the chunks restored."""
        return self._restore_published(update.dests, update.published)

    def end_overlapped_step(self) -> None:
        """Called by the OverlappedStep of :meth:`begin_step` once it has finished or been
        cancelled: the optimizer accepts other calls again."""
        self._active = None
        with self._lock:  # (the pass waited for or drained every write: nothing in flight)
            self._writes_from_ram = {}

    def publish(self, out: Destination) -> StepStats:
        """Stream the current masters into ``out`` (as :meth:`step` does), e.g. after
        :meth:`load_state_dict`."""
        self._check_usable()
        dests = self._check_out(out)

        def work(j, ch, p, m, v, stats):
            t0 = time.perf_counter()
            publish_chunk(dests, ch, p)
            stats.publish_seconds += time.perf_counter() - t0
        return self._stream("publish", work, read=True, write=False)[0]

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The whole state gathered from NVMe into new CPU tensors: ``step``, ``rule`` (its
        words), ``pieces`` and per shard ``{"master", "exp_avg", "exp_avg_sq"}`` (fp32,
        shard-sized; the rule's two state slots under AdamW's names, see rule.state_names)."""
        self._check_usable()
        shards = [{k: torch.empty(n, dtype=torch.float32) for k in ("master", "exp_avg", "exp_avg_sq")}
                  for n in self._shard_numels]

        def work(j, ch, p, m, v, stats):
            d = shards[ch.shard]
            d["master"][ch.lo:ch.hi].copy_(p)
            d["exp_avg"][ch.lo:ch.hi].copy_(m)
            d["exp_avg_sq"][ch.lo:ch.hi].copy_(v)
        self._stream("state_dict", work, read=True, write=False)
        return {"step": self.step_count, "rule": repr(self.rule), "skipped": [list(c) for c in self.skipped],
                "pieces": [list(p) for p in self.pieces], "shards": shards}

    def load_state_dict(self, state: dict) -> None:
        """Write ``state`` (from :meth:`state_dict`, possibly of another NVMeAdamW with the same
        shard sizes and pieces but any chunk size) to NVMe. Transactional: written as the other
        generation and committed at the end, so a failed load leaves the previous state. Clears
        the unusable mark a failed non-transactional step leaves."""
        if self._closed:
            raise RuntimeError(f"NVMeAdamW({self.name}) is closed")
        shards = state["shards"]
        if len(shards) != self.num_shards:
            raise ValueError(f"state has {len(shards)} shards, this optimizer {self.num_shards}")
        for s, (d, n) in enumerate(zip(shards, self._shard_numels)):
            for key in ("master", "exp_avg", "exp_avg_sq"):
                t = d[key]
                if t.numel() != n or t.dtype != torch.float32:
                    raise ValueError(f"state shards[{s}][{key!r}] is {t.dtype} of {t.numel()} "
                                     f"elements; expected fp32 of {n}")
        if "pieces" in state and [[tuple(x) for x in p] for p in state["pieces"]] != \
                [list(p) for p in self.pieces]:
            raise ValueError("state was saved with different pieces (parameter ranges or weight "
                             "decay) than this optimizer's")
        flat = [{k: d[k].detach().reshape(-1) for k in ("master", "exp_avg", "exp_avg_sq")}
                for d in shards]

        def fill(j, ch, p, m, v, stats):
            d = flat[ch.shard]
            p.copy_(d["master"][ch.lo:ch.hi])
            m.copy_(d["exp_avg"][ch.lo:ch.hi])
            v.copy_(d["exp_avg_sq"][ch.lo:ch.hi])
        try:
            new_gens = self._stream("load_state_dict", fill, read=False, write=True)[1]
        except BaseException as e:
            if self.transactional and self._broken is None:
                e.add_note(f"NVMeAdamW({self.name}).load_state_dict failed; the previous state "
                           f"(step {self.step_count}) is unchanged")
            else:
                self._broken = f"load_state_dict failed with {type(e).__name__}: {e}"
                e.add_note(f"NVMeAdamW({self.name}) state is inconsistent; load a state again")
            raise
        self._commit(new_gens)
        self.step_count = int(state["step"])
        self.skipped = [list(c) for c in state.get("skipped", [[0] * len(p) for p in self.pieces])]
        self._broken = None

    def read_masters(self, shards: Optional[Sequence[int]] = None) -> List[Optional[torch.Tensor]]:
        """The fp32 master values of ``shards`` (default: all) as new CPU tensors (None for the
        others), e.g. for a full state dict. Reads only those shards' master records."""
        self._check_usable()
        wanted = set(range(self.num_shards) if shards is None else shards)
        out: List[Optional[torch.Tensor]] = [torch.empty(n, dtype=torch.float32) if s in wanted else None
                                             for s, n in enumerate(self._shard_numels)]
        for s in sorted(wanted):
            self.read_master(s, out[s]).wait(self.wait_timeout)
        return out

    # -- one shard's masters, for a parameter tier that keeps no copy of its own --------------
    def _master_keys(self, shard: int) -> List[Tuple[str, Chunk]]:
        return [(self._key(j, self._gens[j], "p"), self._chunks[j]) for j in self._positions({shard})]

    def _check_readable(self) -> None:
        """Not closed, not broken by a failure (a step may be in progress)."""
        if self._closed:
            raise RuntimeError(f"NVMeAdamW({self.name}) is closed")
        if self._broken is not None:
            raise RuntimeError(f"NVMeAdamW({self.name}) is unusable after a failure ({self._broken}); "
                               f"restore a state with load_state_dict() first")

    def read_master(self, shard: int, out: torch.Tensor, padded: bool = False) -> _Requests:
        """Start reading shard's committed fp32 master values into ``out`` (fp32, the shard's
        size): its chunks' master records alone, 4 bytes per element. A chunk that starts at a
        page boundary of ``out`` lands there with no copy through the swap pool (``padded``:
        ``out``'s storage runs on past its end to a page boundary, bytes the read may fill, as
        from tiertrain/io/buffers.py page_aligned_empty). Allowed while an overlapped step
        runs, for shards it has not reached (a stage-3 gather during backward reads units whose
        gradients are not final yet; the engine guarantees that)."""
        self._check_readable()
        if out.numel() != self._shard_numels[shard] or out.dtype != torch.float32:
            raise ValueError(f"out is {out.dtype} of {out.numel()} elements; shard {shard} is fp32 "
                             f"of {self._shard_numels[shard]}")

        def into(ch: Chunk):
            buf = tensor_range_buffer(out, ch.lo, ch.hi, owns_tail=padded and ch.hi == out.numel())
            return out[ch.lo:ch.hi] if buf is None else buf
        return _Requests([self.swapper.swap_in(key, into(ch)) for key, ch in self._master_keys(shard)])

    def write_master(self, shard: int, values: torch.Tensor) -> Optional[_Requests]:
        """Replace shard's master values (any dtype, the shard's size), keeping its moments. In
        place, only the master records are written (the requests are returned: the values may
        be reused at once); transactional, :meth:`write_masters` runs (atomic) and None is
        returned."""
        if self.transactional:
            edited: List[Optional[torch.Tensor]] = [None] * self.num_shards
            edited[shard] = values
            self.write_masters(edited)
            return None
        self._check_usable()
        src = self._check_out([values if s == shard else None for s in range(self.num_shards)])[shard]
        try:
            return _Requests([self.swapper.swap_out(key, src[ch.lo:ch.hi].to(torch.float32))
                              for key, ch in self._master_keys(shard)])
        except BaseException as e:
            self._broken = f"write_master failed with {type(e).__name__}: {e}"
            raise

    def write_masters(self, masters: Sequence[Optional[torch.Tensor]]) -> None:
        """Replace the master values of the shards given (one tensor of the shard's size, any
        dtype, or None to keep a shard) and keep their Adam moments — e.g. after parameters were
        edited outside training (Engine.gathered_parameters with a modifier rank). Atomic per
        call when transactional, like a step."""
        self._check_usable()
        if len(masters) != self.num_shards:
            raise ValueError(f"{len(masters)} master tensors for {self.num_shards} shards")
        src = self._check_out(masters)
        wanted = {s for s, t in enumerate(src) if t is not None}

        def work(j, ch, p, m, v, stats):
            p.copy_(src[ch.shard][ch.lo:ch.hi])
        try:
            new_gens = self._stream("write_masters", work, positions=self._positions(wanted),
                                    read=True, write=True)[1]
        except BaseException as e:
            if not self.transactional:
                self._broken = f"write_masters failed with {type(e).__name__}: {e}"
            raise
        self._commit(new_gens)

    # -- lifetime ---------------------------------------------------------------------------
    def close(self) -> None:
        """Delete the swap files (and the private swapper/AsyncIO), free the buffers. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._active is not None:
                self._active.cancel()
            self._cancel_prefetch()
        finally:
            self._release_resources()

    def _release_resources(self) -> None:
        sw = getattr(self, "swapper", None)
        try:
            if sw is not None and not self._own_swapper and not sw._closed and self._owns_keys:
                prefix = f"{self.name}."
                for key in [k for k in sw.keys() if str(k).startswith(prefix)]:
                    sw.release(key)
        finally:
            try:
                if sw is not None and self._own_swapper:
                    sw.close()
            finally:
                if self._aio is not None:
                    self._aio.close(self.wait_timeout)
                for b in getattr(self, "_slots", []):
                    b.release()

    def __enter__(self) -> "NVMeAdamW":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"NVMeAdamW({self.name}, shards={self.num_shards}, chunks={self.num_chunks}, "
                f"step={self.step_count}, resident={self.resident_bytes}, "
                f"transactional={self.transactional})")

    # -- internals --------------------------------------------------------------------------
    def _key(self, j: int, gen: int, part: str) -> str:
        """The key of chunk j's record ``part`` ("p": master, "mv": moments) of generation gen."""
        ch = self._chunks[j]
        return f"{self.name}.s{ch.shard}.c{ch.index}.g{gen}.{part}"

    def _positions(self, shards) -> List[int]:
        return [j for j, c in enumerate(self._chunks) if c.shard in shards]

    def _commit(self, new_gens: Dict[int, int]) -> None:
        for j, g in new_gens.items():
            self._gens[j] = g
        self._version += 1

    def _check_usable(self) -> None:
        self._check_readable()
        if self._active is not None:
            raise RuntimeError(f"NVMeAdamW({self.name}) has step {self.step_count + 1} in progress "
                               f"(begin_step); finish() or cancel() it first")

    def _check_space(self) -> None:
        """Fail now, naming the directory, when the disk cannot hold the swap files."""
        need = self.disk_bytes
        try:
            free = shutil.disk_usage(self.swapper.rank_dir).free
        except OSError:
            return
        if free < need:
            raise SwapSpaceError(f"out of swap space for the optimizer state in {self.swapper.rank_dir}: "
                                 f"{need} bytes needed ({'two generations of ' if self.transactional else ''}"
                                 f"{self.state_bytes} bytes of fp32 master + Adam moments), {free} free",
                                 self.swapper.rank_dir, need)

    def _check_grads(self, grads) -> List[torch.Tensor]:
        if len(grads) != self.num_shards:
            raise ValueError(f"{len(grads)} gradients for {self.num_shards} shards")
        out = []
        for s, (g, n) in enumerate(zip(grads, self._shard_numels)):
            if g.numel() != n or g.dtype != torch.float32 or g.device.type != "cpu":
                raise ValueError(f"grads[{s}] is {g.dtype} of {g.numel()} elements on {g.device}; "
                                 f"expected fp32 of {n} on the CPU")
            out.append(g.detach().view(-1))
        return out

    def _check_out(self, out: Destination):
        if out is None or callable(out):
            return out
        if len(out) != self.num_shards:
            raise ValueError(f"{len(out)} tensors for {self.num_shards} shards")
        dests = []
        for s, (t, n) in enumerate(zip(out, self._shard_numels)):
            if t is not None and t.numel() != n:
                raise ValueError(f"tensor {s} has {t.numel()} elements; shard {s} has {n}")
            dests.append(None if t is None else t.detach().view(-1))
        return dests

    def _new_update(self, grads, lr, out: Destination, rule: Optional[ElementwiseRule] = None,
                    skip: frozenset = frozenset()) -> ChunkUpdate:
        """The update of the next step, with ``grads`` and ``out`` checked against the shards;
        skip: (shard, piece start) of the pieces it leaves unchanged."""
        step_number = self.step_count + 1
        skipped = self.skipped

        def piece_step(shard: int, element: int) -> Optional[int]:
            k = bisect.bisect_right(self._piece_starts[shard], element) - 1
            if (shard, self._piece_starts[shard][k]) in skip:
                return None
            return step_number - skipped[shard][k]
        return ChunkUpdate(self._check_grads(grads), self._check_out(out), lr, step_number=step_number,
                           rule=rule or self.rule, piece_step=piece_step if skip or self._any_skipped() else None,
                           skip=skip)

    def _any_skipped(self) -> bool:
        return any(any(counts) for counts in self.skipped)

    def _views(self, i: int, ch: Chunk):
        n = ch.numel
        padded = self._slots[i % self.num_buffers].padded
        moments = padded[self._moments_at: self._moments_at + MOMENT_BYTES * n].view(torch.float32)
        return padded[: MASTER_BYTES * n].view(torch.float32), moments[:n], moments[n:]

    def _records(self, j: int, i: int):
        """(key part, buffer) of chunk j's two records in the buffer of pass position i."""
        slot, n = self._slots[i % self.num_buffers], self._chunks[j].numel
        return (("p", slot.slice(0, MASTER_BYTES * n)), ("mv", slot.slice(self._moments_at, MOMENT_BYTES * n)))

    def _read(self, j: int, i: int, master: bool = True) -> _Requests:
        """Read chunk j's committed records into the buffer of pass position i (without the
        master record: only the moments)."""
        return _Requests([self.swapper.swap_in(self._key(j, self._gens[j], part), buf)
                          for part, buf in self._records(j, i) if master or part != "p"])

    def _write(self, j: int, i: int, gen: int, master: Optional[Buffer] = None) -> _Requests:
        """Write the buffer of pass position i as chunk j's records of generation gen (the
        master record from ``master`` instead, when given)."""
        records = self._records(j, i)
        if master is not None:
            records = (("p", master), records[1])
        return _Requests([self.swapper.swap_out(self._key(j, gen, part), buf) for part, buf in records])

    def _note_write_from_ram(self, shard: int, h: _Requests) -> None:
        with self._lock:
            self._writes_from_ram.setdefault(shard, []).append(h)

    def when_written(self, shard: int, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once every write the step issued straight from ``shard``'s masters in
        RAM (:meth:`begin_step`'s ``masters_in_ram``) has completed, landed or failed (in the IO
        thread completing the last, or now if none is in flight): until then the tensor must
        stay as it is."""
        with self._lock:
            pending = self._writes_from_ram.pop(shard, [])
        if not pending:
            fn()
            return
        _Requests([h for requests in pending for h in requests.handles]).add_done_callback(lambda _r: fn())

    def _wait(self, h: _Requests, stats: StepStats) -> None:
        t0 = time.perf_counter()
        try:
            h.wait(self.wait_timeout)
        finally:
            stats.io_wait_seconds += time.perf_counter() - t0

    @staticmethod
    def _track(h: _Requests, stats: StepStats, t0: Optional[float] = None) -> None:
        t0 = time.perf_counter() if t0 is None else t0
        h.add_done_callback(lambda _h: stats.record_io(t0, time.perf_counter()))

    def _cancel_prefetch(self) -> None:
        with self._lock:
            handles, self._prefetched = [h for h, _ in self._prefetched.values()], {}
        self._drain(handles)

    def _drain(self, handles) -> None:
        """Wait (bounded) for IO that a failed pass leaves in flight; its errors were or will
        be reported by the pass itself. A request still running after the timeout may yet write
        into a buffer, so the optimizer is then marked unusable."""
        for h in handles:
            try:
                h.wait(self.wait_timeout)
            except TimeoutError as e:
                self._broken = f"IO still in flight after {self.wait_timeout} s: {e}"
            except KeyboardInterrupt:  # (Ctrl-C, SIGTERM: the run is stopping)
                raise
            except BaseException:  # noqa: BLE001 - reported by the pass that failed
                pass

    def _stream(self, op: str, work, positions: Optional[List[int]] = None, read: bool = True,
                write: bool = True, step: Optional[int] = None, set_threads: bool = True,
                masters_in_ram: Optional[Callable[[int], Optional[torch.Tensor]]] = None,
                ) -> Tuple[StepStats, Dict[int, int]]:
        """The pipeline over chunks ``positions`` (default: all, in order). Pass position i uses
        buffer i % B, free once the write of position i-B finished. The buffer is filled by a
        read of the chunk's committed record issued up to ``depth`` positions ahead (``read``),
        or by ``work`` alone; ``work(j, ch, p, m, v, stats)`` runs in this thread (a function it
        returns runs after the write was submitted); with ``write`` the buffer is then written
        to the chunk's other generation (transactional) or over its record (in place), and the
        write overlaps the next positions' work. With writes, depth = B-2, so that the write of
        position i-1 runs during the work on position i before its buffer is needed again.
        Returns the stats and the generations written (to commit when the caller is done).
        ``set_threads=False`` leaves torch's (process-wide) thread setting alone: a pass on a
        worker thread must not change it under the caller's compute. ``masters_in_ram``: see
        :meth:`begin_step` (a chunk read with it gets its master copied from RAM before work)."""
        in_order = positions is None or positions == list(range(len(self._chunks)))
        positions = list(range(len(self._chunks))) if positions is None else positions
        B = self.num_buffers
        depth = B - 2 if write else B - 1
        stats = StepStats(op=op, step=self.step_count if step is None else step,
                          chunks=len(positions))
        t_start = time.perf_counter()
        reads: Dict[int, _Requests] = {}
        writes: Dict[int, _Requests] = {}
        in_ram: Dict[int, torch.Tensor] = {}  # position -> the master values of its shard, in RAM
        new_gens: Dict[int, int] = {}
        with self._lock:
            prefetched = {}
            if op == "step" and in_order and self._prefetch_version == self._version:
                prefetched, self._prefetched = self._prefetched, {}
        self._cancel_prefetch()                 # anything else prefetched is stale now
        for i, (h, t0) in prefetched.items():
            reads[i] = h
            stats.bytes_read += self._chunks[positions[i]].nbytes
            self._track(h, stats, t0)
        next_read = max(reads, default=-1) + 1

        def free_buffer(i: int) -> None:
            h = writes.pop(i - B, None)
            if h is not None:
                self._wait(h, stats)

        try:
            with self._compute_threads() if set_threads else contextlib.nullcontext():
                for i, j in enumerate(positions):
                    ch = self._chunks[j]
                    if read:
                        while next_read < len(positions) and next_read <= i + depth:
                            free_buffer(next_read)
                            ahead = self._chunks[positions[next_read]]
                            master = None if masters_in_ram is None else masters_in_ram(ahead.shard)
                            h = self._read(positions[next_read], next_read, master=master is None)
                            self._track(h, stats)
                            reads[next_read] = h
                            if master is None:
                                stats.bytes_read += ahead.nbytes
                            else:
                                in_ram[next_read] = master
                                stats.bytes_read += MOMENT_BYTES * ahead.numel
                            next_read += 1
                        self._wait(reads.pop(i), stats)
                    else:
                        free_buffer(i)
                    p, m, v = self._views(i, ch)
                    master = in_ram.pop(i, None)
                    from_ram = None
                    if master is not None:
                        stats.masters_from_ram += 1
                        # Page-aligned in the RAM tensor: updated there and written from it,
                        # with no copy; else copied into the buffer first.
                        from_ram = tensor_range_buffer(master, ch.lo, ch.hi) if write else None
                        if from_ram is not None:
                            p = master[ch.lo:ch.hi]
                            stats.masters_updated_in_ram += 1
                        else:
                            t0 = time.thread_time()
                            p.copy_(master[ch.lo:ch.hi])
                            stats.master_copy_cpu_seconds += time.thread_time() - t0
                    after = work(j, ch, p, m, v, stats)
                    if write:
                        gen = self._gens[j]
                        if self.transactional and op != "init":
                            gen = 1 - gen           # the committed record stays intact
                        h = self._write(j, i, gen, master=from_ram)
                        if from_ram is not None:
                            self._note_write_from_ram(ch.shard, h)
                        self._track(h, stats)
                        writes[i] = h
                        new_gens[j] = gen
                        stats.bytes_written += ch.nbytes
                    if after is not None:
                        after(j, ch, p, m, v, stats)
                for i in sorted(writes):
                    self._wait(writes.pop(i), stats)
        except BaseException:
            self._drain(list(reads.values()) + list(writes.values()))
            raise
        finally:
            stats.seconds = time.perf_counter() - t_start
            stats.sum_io_time()
            self.last_stats = stats
        return stats, new_gens

    @contextlib.contextmanager
    def _compute_threads(self):
        """torch's intra-op threads for the pass (``compute_threads``; None leaves them). The
        setting is process-wide: the pass is synchronous, and it is restored when it ends."""
        n = self.compute_threads
        before = torch.get_num_threads()
        if n == "auto":
            n = max(1, before - 1)
        if n is None or n == before:
            yield
            return
        torch.set_num_threads(n)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def _after_failed_step(self, e: BaseException, k: int, dests, published: List[int]) -> None:
        where = f"NVMeAdamW({self.name}) step {k} failed ({type(e).__name__})"
        if not self.transactional:
            self._broken = f"step {k} failed with {type(e).__name__}: {e}"
            e.add_note(f"{where}: the optimizer state on NVMe (and the destinations, if any) is "
                       f"partly updated (chunks before the failure) and the optimizer refuses "
                       f"further steps; restore a checkpoint with load_state_dict()")
            return
        if self._broken is not None:
            e.add_note(f"{where} and left IO in flight; the optimizer is unusable: {self._broken}")
            return
        note = (f"{where}: not applied — the state on NVMe and the step count are those of step "
                f"{k - 1}")
        try:
            restored = self._restore_published(dests, published)
            if restored:
                note += f"; the {restored} chunk(s) already published were restored"
        except BaseException as e2:  # noqa: BLE001
            note += (f"; restoring the chunks already published failed too ({type(e2).__name__}: {e2}), "
                     f"so the destinations hold step-{k} values for some of them until the next "
                     f"successful step() or publish()")
        e.add_note(note + "; step() may be retried once the cause is fixed (a corrupt or "
                          "truncated state file needs load_state_dict from a checkpoint)")

    def _restore_published(self, dests, published: Sequence[int]) -> int:
        """Stream the committed (pre-step) masters back into the destinations of the chunks
        already published, in the order they were. Returns the chunks restored."""
        if dests is None or not published:
            return 0
        self._stream("restore", lambda j, ch, p, m, v, st: publish_chunk(dests, ch, p),
                     positions=list(published), read=True, write=False)
        return len(published)
