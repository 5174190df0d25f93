"""AdamW whose fp32 master weights and moments live on NVMe: ZeRO-Infinity's optimizer step
from NVMe (docs/concepts.md#optimizer-step-with-nvme; ZeRO-Offload §4 is the CPU-memory case).

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

The parts of :class:`NVMeAdamW` live beside this module, one concern each: the chunk plan and
why its cuts keep the step bit for bit torch's (``plan.py``, **Exactness**), a chunk's two
swap records and their generations (``records.py``, **Chunk records**), the read → update →
write pipeline and its threads (``pipeline.py``, **Threads**), and the whole state in and out
of the stream for checkpoints and edited masters (``state.py``); the update of one chunk is
``chunk_update.py``.

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
import shutil
import threading
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ...comm import run_timeout
from ...elementwise import AdamWRule, ElementwiseRule
from ...io.aio import DEFAULT_CHECKSUM, AsyncIO, SwapSpaceError
from ...io.buffers import AlignedBufferPool, Buffer, round_up
from ...io.swap import DEFAULT_WAIT_TIMEOUT, TensorSwapper
from .chunk_update import BYTES_PER_ELEM, MASTER_BYTES, MOMENT_BYTES, Chunk, ChunkUpdate, StepStats, publish_chunk
from .overlapped_step import OverlappedStep
from .pipeline import StreamingPipeline
from .plan import (ALIGN_ELEMS, DEFAULT_CHUNK_BYTES, PAGE_ELEMS, Destination, Piece, _check_pieces, _plan,
                   pieces_from_param_groups)
from .records import ChunkRecords, _Requests
from .state import OptimizerState

__all__ = ["ALIGN_ELEMS", "NVMeAdamW", "StepStats", "pieces_from_param_groups"]


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


class NVMeAdamW(ChunkRecords, StreamingPipeline, OptimizerState):
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
            **Threads** in tiertrain/update/nvme/pipeline.py).
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

    # -- checks and the update of a step ----------------------------------------------------
    def _check_readable(self) -> None:
        """Not closed, not broken by a failure (a step may be in progress)."""
        if self._closed:
            raise RuntimeError(f"NVMeAdamW({self.name}) is closed")
        if self._broken is not None:
            raise RuntimeError(f"NVMeAdamW({self.name}) is unusable after a failure ({self._broken}); "
                               f"restore a state with load_state_dict() first")

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
