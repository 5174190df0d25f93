"""The NVMe optimizer step overlapped with backward (ZeRO-Infinity §6, "overlap-centric design").

A synchronous step streams the whole optimizer state through the disk after backward, and its
step phase is then mostly waiting for that IO (the nvme_opt_io_wait column of
bench/results/zero3_nvme.md, measured by bench/zero3_nvme.py). Nothing forces it to wait for the end of
backward: a unit's chunks need only that unit's final gradient, and under ZeRO the reducer
knows exactly when that is — when the unit's reduce-scatter at the accumulation boundary has
landed in the gradient shard. So :meth:`NVMeAdamW.begin_step` starts, at the start of the
boundary backward, a worker thread that runs the usual read → update → write pipeline over the
chunks in the order their units' reductions land; each chunk's update waits only for
:meth:`OverlappedStep.shard_ready` of its shard. The disk works while backward computes, and
what is left for the step is the last units to be reduced.

What makes it the same step, bit for bit:

* the chunks, the fused kernel on each piece and the step number are those of
  :meth:`NVMeAdamW.step`; only the order in which chunks are visited changes, and no chunk
  depends on another;
* it is valid only when nothing global gates the update: no clipping by the global gradient
  norm and no fp16 loss scaling (the engine checks, and otherwise runs the synchronous step);
* the engine still computes the global norm at the step, and when it is not finite (a step
  the engine skips) :meth:`cancel` restores the published parameters from the committed
  generation and commits nothing. The same happens when backward raises or anything outside
  the step needs the state (a checkpoint, a forward before the step);
* in place (``zero.nvme_in_place``, one generation on disk) the same overlap runs, but a
  cancel after chunks were written cannot restore them: the optimizer is then unusable until
  a checkpoint is loaded, as after a failed in-place step;
* the transactional commit (generation switch, step count) happens in :meth:`finish`, on the
  caller's thread, only after every write landed; a failed IO raises there with the note of a
  failed synchronous step (the state on NVMe is the previous step's, published chunks restored).

Threads: the worker does the IO waits, the AdamW kernels and the copies into the
destinations; the caller's thread keeps computing backward. It does not change torch's
(process-wide) thread setting, which belongs to the caller. A destination must not be read by
the caller between ``shard_ready`` and ``finish``: the engine guarantees it, since a unit whose
gradients are final is not used again in that backward.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Dict, List, Optional, Protocol, Tuple

from ...errors import TiertrainError
from ...spans import span
from .chunk_update import ChunkUpdate, StepStats


class SteppedOptimizer(Protocol):
    """What an OverlappedStep needs of the optimizer whose step it runs: NVMeAdamW, whose
    methods of the same names document them. Declared here so that this module needs nothing
    from optimizer.py, which imports it to build OverlappedSteps."""

    name: str
    transactional: bool

    @property
    def num_shards(self) -> int: ...

    def stream_step(self, update: ChunkUpdate, positions: Optional[List[int]] = None, *,
                    set_threads: bool = True) -> Tuple[StepStats, Dict[int, int]]: ...

    def commit_step(self, update: ChunkUpdate, stats: StepStats, new_gens: Dict[int, int]) -> StepStats: ...

    def recover_failed_step(self, error: BaseException, update: ChunkUpdate) -> None: ...

    def restore_published(self, update: ChunkUpdate) -> int: ...

    def end_overlapped_step(self) -> None: ...


class StepCancelled(TiertrainError):
    """Raised inside the worker when the step is cancelled while it waits for a gradient."""


class OverlappedStep:
    """One NVMe optimizer step whose chunks are updated as their shards' gradients become final;
    created by :meth:`NVMeAdamW.begin_step`. Call :meth:`shard_ready` for each shard (any
    thread, any order; earlier is better), then exactly one of :meth:`finish` or :meth:`cancel`."""

    def __init__(self, optimizer: SteppedOptimizer, update: ChunkUpdate, positions: List[int]):
        self._opt = optimizer
        self._update = update
        self._positions = positions
        self._ready = [threading.Event() for _ in range(optimizer.num_shards)]
        self._cancelled = False
        self._stats: Optional[StepStats] = None
        self._new_gens = None
        self._error: Optional[BaseException] = None
        self._ended = False
        self.on_shard_updated: Optional[Callable[[int], None]] = None
        """Called on the worker thread with each shard once every chunk of it is updated (its
        gradient is no longer read), in the order the shards were updated."""
        self._current: Optional[int] = None
        self.on_progress: Optional[Callable[[], None]] = None
        """Called on the worker thread whenever :meth:`stalled` may have become true (it waits
        for a gradient, or it is done)."""
        self._waiting_on: Optional[int] = None
        self._over = False
        update.gate = self._gate
        self._thread = threading.Thread(target=self._run, name=f"{optimizer.name}-overlapped-step",
                                        daemon=True)
        self._thread.start()

    @property
    def chunks_done(self) -> int:
        """Chunks updated (and published to the destinations) so far."""
        return self._update.updated

    def progress(self) -> dict:
        """How far the step got: shards declared ready and chunks updated, of the totals."""
        return {"shards_ready": sum(e.is_set() for e in self._ready), "shards": len(self._ready),
                "chunks_done": self.chunks_done, "chunks": len(self._positions)}

    def shard_ready(self, shard: int) -> None:
        """Shard ``shard``'s gradient is final: its chunks may be updated now."""
        self._ready[shard].set()

    def finish(self) -> StepStats:
        """Let every remaining shard go, wait for the worker, and commit the step (as
        :meth:`NVMeAdamW.step` returns). Raises the worker's error, with the state restored as
        after a failed synchronous step."""
        self._end()
        if self._error is not None:
            self._opt.recover_failed_step(self._error, self._update)
            raise self._error
        return self._opt.commit_step(self._update, self._stats, self._new_gens)

    def cancel(self) -> int:
        """Stop the step: nothing is committed, and every chunk already published gets its
        committed (pre-step) master values back. Returns the chunks restored.

        An optimizer that updates in place (``transactional=False``) has no pre-step state to
        go back to once a chunk was written: it is then left unusable, as after a failed step,
        and its next step raises until a checkpoint is loaded."""
        self._cancelled = True
        self._end()
        if not self._opt.transactional and self._update.updated:
            self._opt.recover_failed_step(StepCancelled(
                f"step {self._update.step_number} was cancelled after {self._update.updated} chunk(s) "
                f"were updated in place (zero.nvme_in_place)"), self._update)
            return 0
        return self._opt.restore_published(self._update)

    # -- internals --------------------------------------------------------------------------
    def _end(self) -> None:
        if self._ended:
            raise RuntimeError(f"step {self._update.step_number} of NVMeAdamW({self._opt.name}) already ended")
        self._ended = True
        for event in self._ready:
            event.set()
        self._thread.join()
        self._opt.end_overlapped_step()

    def stalled(self) -> bool:
        """Whether the worker can make no progress now: it waits for a shard not declared ready,
        or it is done."""
        waiting = self._waiting_on
        return self._over or (waiting is not None and not self._ready[waiting].is_set())

    def _progress(self) -> None:
        if self.on_progress is not None:
            self.on_progress()

    def _shard_updated(self, shard: Optional[int]) -> None:
        if shard is not None and self.on_shard_updated is not None:
            self.on_shard_updated(shard)

    def _gate(self, shard: int, stats: StepStats) -> None:
        if shard != self._current:  # the chunks are visited shard by shard: the last one is done
            self._shard_updated(self._current)
            self._current = shard
        t0 = time.perf_counter()
        if not self._ready[shard].is_set():
            self._waiting_on = shard
            self._progress()
            self._ready[shard].wait()
            self._waiting_on = None
        stats.ready_wait_seconds += time.perf_counter() - t0
        if self._cancelled:
            raise StepCancelled(f"step {self._update.step_number} cancelled")

    def _run(self) -> None:
        try:
            with span("nvme_step"):
                self._stats, self._new_gens = self._opt.stream_step(self._update, self._positions,
                                                                    set_threads=False)
            self._shard_updated(self._current)
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread by finish()
            self._error = e
        finally:
            self._over = True
            self._progress()
