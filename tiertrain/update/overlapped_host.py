"""The CPU tier's optimizer step overlapped with backward (``zero.overlap_cpu_step``): each
unit's shard is updated on a worker thread as soon as its gradient reduction has landed at the
accumulation boundary, while backward goes on computing the units before it
(docs/concepts.md#the-cpu-step-overlapped-with-backward).

ZeRO-Offload (§4) moves the optimizer to the CPU and hides its step behind GPU work; the
synchronous form's step starts only when step() is called, after backward. A unit's update needs
only that unit's final gradient, and the reducer says when that is (its ``reduced`` hook), so
the update can run beside backward, as the NVMe tier's does (update/nvme/overlapped_step.py).

**Speculative, and so transactional.** Before step() nothing is known for sure: the clip
coefficient needs the global norm, a non-finite norm skips the step, a forward or a checkpoint
save may come first, a parameter no rank used must stay unchanged. So the worker writes each
update *beside* the state, never over it: the compiled pass (update/host_adamw.py
``update_into``) reads a piece's master and moments and writes the new ones into a second set of
buffers (12 bytes per element of the shard, the price of this form). step() then decides:

* the speculation holds (no clip, or a clip coefficient of exactly 1: the norm is within
  ``grad_clip``; nothing non-finite) → each updated unit is committed by swapping its buffers
  in (no copy), and only the pieces the worker did not reach are updated, in place, now;
* otherwise → the second buffers are dropped, the compute-dtype copies the pass wrote get the
  masters' values back, and the synchronous step runs (clipped), as if nothing had overlapped.

A landed unit goes to the worker before its norm is taken (the norm is taken beside its update);
the worker adds the norms taken so far before each unit and stops speculating once this rank's
own share exceeds ``grad_clip`` (the global norm can only be larger). A piece no local backward
touched and whose reduced gradient is all zero, and the small pieces torch steps in one call,
wait for step(), which knows which parameters went unused. Either way the result is the
synchronous step's, bit for bit.

Threads: the worker runs the kernels; the caller's thread keeps computing backward and never
reads a unit whose gradient is final before step() (the unit is not used again in that
backward). A worker's error is agreed on by every rank at step() and raised on all of them.
"""
from __future__ import annotations

import math
import queue
import threading

import torch
import torch.distributed as dist

from ..comm import Collectives
from ..errors import TiertrainError
from ..spans import span
from .in_memory import InMemoryUpdate, host_pass, pass_writes
from .protocol import PIECE, SLOT_NAME, UpdateMemory

Pair = tuple[dict, torch.Tensor]
"""(param group, piece) of the optimizer."""


class OverlappedStepError(TiertrainError, RuntimeError):
    """The CPU-tier step overlapped with backward failed on some rank; raised on every rank."""


_DONE = object()
"""What the caller's thread puts in the worker's queue when no unit will land any more."""


class _StepInFlight:
    """One boundary's speculative step running beside backward: a queue of landed units and the
    worker that updates them into the second buffers."""

    def __init__(self, run):
        self.units: queue.SimpleQueue = queue.SimpleQueue()
        self.updated: dict[int, list[Pair]] = {}
        """Per unit: the pieces updated into the second buffers."""
        self.landed: list[int] = []
        """The units handed to the worker (their reductions landed) so far, in landing order."""
        self.local_squares = 0.0
        """This rank's squared gradient norm over the first ``squares_counted`` units landed."""
        self.squares_counted = 0
        self.stopped_at: str | None = None
        """Why the worker stopped speculating; None: it did not."""
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=run, args=(self,), name="tiertrain-overlapped-cpu-step", daemon=True)
        self.thread.start()

    def end(self, stop: str | None) -> None:
        """No more units: stop (saying why) before any unit still queued, or update them; wait."""
        if stop is not None and self.stopped_at is None:
            self.stopped_at = stop
        self.units.put(_DONE)
        self.thread.join()


class OverlappedHostUpdate(InMemoryUpdate):
    """The compiled CPU-tier AdamW, updating each unit's pieces speculatively during the
    boundary backward; see the module docstring. group: the process group whose ranks agree on
    a worker's failure (the world; None for one process)."""

    def __init__(self, flat, config, lazy_zero: bool, reducer, group, device: torch.device, landing_norms=None):
        for u in flat.units:  # (a master that is the shard a forward reads gets its own buffer)
            if u.master is u.shard:
                u.master = u.master.clone()
        super().__init__(flat, config, lazy_zero, None, landing_norms)
        if self.host_pass is None:  # (auto leaves small shards to torch's kernel, which has no second buffers)
            self.host_pass = host_pass(flat, self.optimizer, "zero.overlap_cpu_step")
            self.host_pass_writes = pass_writes(flat)
        self.reducer = reducer
        self.comm = Collectives(group) if group is not None else None
        self.device = device
        self.max_norm = float(config.optimizer.grad_clip)
        self._pieces: dict[int, list[Pair]] = {}
        """Per unit index: its (param group, piece) pairs in the optimizer."""
        for group_ in self.optimizer.param_groups:
            for view in group_["params"]:
                if view.numel():
                    self._pieces.setdefault(getattr(view, PIECE)[0], []).append((group_, view))
        self._slots = {u.unit.index: [(k, s.name) for k, s in enumerate(u.unit.slots)] for u in flat.units}
        self._next_master: dict[int, torch.Tensor] = {}
        """Per unit: the master buffer the worker writes into (zeroed once: its padding stays zero)."""
        self._next_moments: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        """Per piece (by id): the exp_avg and exp_avg_sq buffers the worker writes into."""
        self._in_flight: _StepInFlight | None = None
        self._subscription = None
        self.last_overlapped_step: dict | None = None
        self.speculation = {"committed": 0, "discarded": 0}
        """Steps whose speculative updates were committed, and discarded (a clip below 1, a cancel)."""

    # -- during the boundary backward -------------------------------------------------------
    def before_backward(self, boundary, lr):
        if boundary and self._in_flight is None:
            self.schedule.apply(self.optimizer, lr)  # (the rate step() would set: the same step number)
            flight = self._in_flight = _StepInFlight(self._run)
            # (subscribed before the landing norms: the worker starts on a unit while this thread
            # takes its norm, instead of after)
            self._subscription = self.reducer.subscribe(reduced=lambda index: self._landed(flight, index))
        super().before_backward(boundary, lr)

    def _landed(self, flight: _StepInFlight, index: int) -> None:
        """Unit index's reduced gradient shard is final: hand it to the worker, with the
        parameters this rank's backwards gave a gradient (used for sure). Its squared norm is
        taken next, on this thread, while the worker updates it.
        (A reduction launched before a cancel may land after it: that step is over.)"""
        if flight is not self._in_flight:
            return
        used = self.reducer.used
        used_here = frozenset(name for k, name in self._slots[index] if (index, k) in used)
        flight.landed.append(index)
        flight.units.put((index, used_here))

    def _run(self, flight: _StepInFlight) -> None:
        try:
            while True:
                item = flight.units.get()
                if item is _DONE:
                    return
                if flight.stopped_at is None:
                    self._speculate(flight, *item)
        except BaseException as e:  # noqa: BLE001 - raised on every rank by step()
            flight.error = e

    def _count_squares(self, flight: _StepInFlight) -> None:
        """Add the squared norms taken since (in landing order; a unit whose norm the training
        thread has not taken yet waits for the next count). Only to stop early: step() decides."""
        if self.landing_norms is None:
            return
        while flight.squares_counted < len(flight.landed):
            square = self.landing_norms.square(flight.landed[flight.squares_counted])
            if square is None:
                return
            flight.local_squares += float(square)
            flight.squares_counted += 1

    def _speculate(self, flight: _StepInFlight, index: int, used_here: frozenset) -> None:
        self._count_squares(flight)
        if not math.isfinite(flight.local_squares):
            flight.stopped_at = "a gradient landed so far is not finite"
            return
        if self.max_norm > 0 and math.sqrt(flight.local_squares) > self.max_norm:
            flight.stopped_at = "this rank's share of the gradient norm exceeds optimizer.grad_clip"
            return
        chosen = [(g, v) for g, v in self._pieces.get(index, ()) if self.host_pass.steps_alone(v)
                  and (getattr(v, SLOT_NAME) in used_here or bool(v.grad.any()))]
        if not chosen:
            return
        master = self.flat.units[index].master
        if index not in self._next_master:  # (where the masters live: pinned on a GPU host, for their copies)
            placement = self.flat.placement
            self._next_master[index] = placement.empty(master.numel(), master.dtype, placement.optimizer_tier).zero_()
        nxt = self._next_master[index]
        with span("overlapped_cpu_step"):
            for g, v in chosen:
                _, a, b = getattr(v, PIECE)
                if id(v) not in self._next_moments:
                    self._next_moments[id(v)] = (torch.empty_like(v), torch.empty_like(v))
                self.host_pass.update_into(g, v, nxt[a:b], *self._next_moments[id(v)])
        flight.updated[index] = chosen

    # -- the step -----------------------------------------------------------------------------
    def before_step(self):
        flight = self._in_flight
        if flight is not None:
            self.last_overlapped_step = {"units_ready": len(flight.landed), "units_updated": len(flight.updated),
                                         "units": len(self.flat.units)}

    def step(self, grads, clip, lr, step):
        flight = self._end(stop=None)
        self._agree(None if flight is None else flight.error)
        if flight is None or not flight.updated or not (clip is None or float(clip) == 1.0):
            if flight is not None and flight.updated:
                self._discard(flight)
            super().step(grads, clip, lr, step)  # (the synchronous step, clipped)
            return
        with span("overlapped_cpu_step/commit"):
            for index, pieces in flight.updated.items():
                self._commit(index, pieces)
            # (a shard on an accelerator gets the committed values now: the worker sent none)
            self.host_pass.send([v for pieces in flight.updated.values() for _, v in pieces])
        self.speculation["committed"] += 1
        done = {id(v) for pieces in flight.updated.values() for _, v in pieces}
        unchanged = self.unchanged
        rest = [(g, v) for pieces in self._pieces.values() for g, v in pieces
                if id(v) not in done and getattr(v, SLOT_NAME) not in unchanged]
        self.host_pass.step_pieces(rest, clip)
        self.host_pass.copy_out([v for pieces in self._pieces.values() for _, v in pieces
                                 if getattr(v, SLOT_NAME) in unchanged])
        self.unchanged = frozenset()
        self.norms_consumed()
        self.schedule.advance()
        self.publish_and_reset(self.host_pass_writes)

    def _commit(self, index: int, pieces: list[Pair]) -> None:
        """Unit index's second master buffer becomes its master (the pieces the worker did not
        update copied in first), and each updated piece's second moments its moments; the
        buffers given up are the next step's second buffers."""
        u = self.flat.units[index]
        nxt = self._next_master[index]
        updated = {id(v) for _, v in pieces}
        for _, v in self._pieces[index]:
            if id(v) not in updated:
                _, a, b = getattr(v, PIECE)
                nxt[a:b].copy_(v)
        given_up = u.master.view_as(u.master)
        u.master.set_(nxt)  # (in place: every holder of u.master sees the new values)
        for _, v in self._pieces[index]:
            _, a, b = getattr(v, PIECE)
            v.set_(nxt.untyped_storage(), nxt.storage_offset() + a, v.size(), v.stride())
        self._next_master[index] = given_up
        for _, v in pieces:
            state = self.host_pass.state_of(v)
            m, s = self._next_moments[id(v)]
            self._next_moments[id(v)] = (state["exp_avg"], state["exp_avg_sq"])
            state["exp_avg"], state["exp_avg_sq"] = m, s
            state["step"] += 1

    def _discard(self, flight: _StepInFlight) -> None:
        """Drop the speculative updates: the compute-dtype copies they wrote get the masters' values back."""
        self.host_pass.copy_out([v for pieces in flight.updated.values() for _, v in pieces])
        self.speculation["discarded"] += 1

    def _end(self, stop: str | None) -> _StepInFlight | None:
        flight, self._in_flight = self._in_flight, None
        if self._subscription is not None:
            self._subscription.remove()
            self._subscription = None
        if flight is not None:
            flight.end(stop)
        return flight

    def _agree(self, error: BaseException | None) -> None:
        """Every rank learns whether any rank's worker failed, and all raise (collective)."""
        failed = error is not None
        if self.comm is not None:
            flag = torch.tensor([int(failed)], dtype=torch.int32, device=self.device)
            self.comm.all_reduce(flag, count=False)
            failed = bool(flag.item())
        if failed:
            rank = dist.get_rank() if dist.is_initialized() else 0
            why = f"rank {rank}: {type(error).__name__}: {error}" if error is not None else "on another rank"
            raise OverlappedStepError(f"the CPU-tier step overlapped with backward (zero.overlap_cpu_step) failed "
                                      f"{why}; nothing of it was applied: the state is the last step's") from error

    def cancel(self):
        """Drop the step running since the boundary backward (a forward, a save, a failure or a
        skipped step came before step()): nothing of it is kept."""
        super().cancel()
        flight = self._end(stop="cancelled")
        if flight is not None and flight.updated:
            self._discard(flight)

    # -- outside the step -----------------------------------------------------------------------
    def memory(self):
        base = super().memory()
        second = sum(t.numel() * t.element_size() for t in self._next_master.values()) + \
            sum(2 * m.numel() * m.element_size() for m, _ in self._next_moments.values())
        return UpdateMemory(optimizer=base.optimizer + second, cpu_tier=base.cpu_tier + second)

    def load_state_dict(self, state):
        self.cancel()
        super().load_state_dict(state)

    def close(self):
        self._end(stop="closed")
        super().close()
