"""The NVMe optimizer's streaming pipeline: every pass over the chunks (the first write, a step,
a publish, a state dict gathered or loaded, edited masters) runs them through a ring of
aligned buffers, each chunk's read issued ahead and its write behind the work on the current
one (:meth:`StreamingPipeline._stream`); a failed pass drains the IO it left in flight, and a
failed step says what state it left (tiertrain/update/nvme/optimizer.py, **Failures**).

**Threads.** The update runs on ``compute_threads`` torch threads during a pass ("auto": one
fewer than torch's setting), so that a core stays free for the IO workers' copies and
checksums: OpenMP threads on every core contend with the IO workers, which slows the update, the
publish copies and the whole step (bench/results/nvme_optimizer.md, the "2 compute thread(s)"
row against the "auto" rows, on 2 cores).
"""
from __future__ import annotations

import contextlib
import time
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ...io.buffers import tensor_range_buffer
from .chunk_update import MOMENT_BYTES, StepStats, publish_chunk
from .records import _Requests

__all__ = ["StreamingPipeline"]


class StreamingPipeline:
    """The pipeline part of :class:`~tiertrain.update.nvme.optimizer.NVMeAdamW` (a base class of
    it, working on its attributes and records)."""

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
