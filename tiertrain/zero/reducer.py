"""Gradient reduction during backward (ZeRO §5.2, and DDP-style bucketing for stages 0-1).

A post-accumulate-grad hook on every parameter adds its gradient (cast to fp32) into its
unit's bucket and drops the parameter's own ``.grad``. When every parameter of a unit has
reported, the unit's collective is launched asynchronously:

* stage 0: all-reduce of the unit's full gradient (plain data parallelism);
* stage 1: gradients accumulate locally over micro-batches in the full buffer; at the
  accumulation boundary each unit is reduce-scattered into its owner's shard;
* stages 2-3: every micro-batch, each unit's bucket is reduce-scattered as soon as it
  fills and added into the persistent gradient shard; the bucket is then freed, so only
  the shard persists between micro-batches.

Units are launched in one fixed order on every rank (a unit that is ready early waits for
its predecessors), so ranks never issue collectives in different orders; parameters that
received no gradient are flushed, as zeros, when backward ends.

Under pipeline parallelism (``launch_when_ready=False``) one step's backward is spread over
many micro-batch backwards interleaved with forwards, so "the unit is complete" has no
meaning per backward: every micro-batch's gradient is added into the unit's fp32 bucket,
and the caller launches each pipeline chunk's units (:meth:`launch`) once that chunk's last
backward is over. Stage 2 then reduce-scatters each bucket once per step (not once per
micro-batch, which would multiply its traffic by the number of micro-batches) and frees it,
so between steps only the gradient shard persists.

Stages 2-3 with ``accumulate=True`` (zero.accumulate_on_device; tiertrain/zero/accumulation.py)
use the same buckets one model's way: each unit's bucket, zeroed at its first gradient of the
step, persists over the micro-batches (at stage 3 too, while its parameters are gathered and
released as usual) and every micro-batch adds into it; nothing is reduced, nor copied to the
CPU tier, until the accumulation boundary's backward, where each unit is reduce-scattered into
its shard as it completes, as without accumulation. The bucket is then freed.

Without it, with the optimizer on the CPU tier and an accelerator (or the emulated GPU host,
or the deferred-copy harness), a micro-batch that is not the accumulation boundary lands its
reduced shards on the host without blocking backward (``defer_landing``; ZeRO-Offload §4: the
gradient copy overlapped with backward): once a unit's collective is waited, the device→host
copy is issued on the copy stream into the unit's landing buffer (pinned host memory, one
gradient shard per unit: :attr:`GradientReducer.landing_bytes`) and left in flight. The host
waits for it, and adds it into the shard, only when that landing buffer is needed again (the
same unit's next landing) or in :meth:`GradientReducer.wait` before the step reads the
gradients, so the adds keep their order and the sums are bit-identical. The boundary's
reductions land during that backward, as subscribers of ``reduced`` (the landing norms, the
overlapped steps) expect: each copy is issued as its collective is launched and the host
waits for it when ``max_in_flight`` later reductions have been launched (or in ``wait()``).

On a CPU compute device, with ``keep_spares`` (zero.retain_host_memory), the reducer keeps the
fp32 buckets (and reduced shards) above 32 MiB that it frees, as many as the last step used at
once (3 for a step's buckets: one filling, ``max_in_flight`` reducing), and reuses them in the next
backward, as an accelerator's caching allocator does: glibc maps such a block afresh each time
(32 MiB is the most tiertrain/host_memory.py can raise its threshold to; smaller blocks reuse
the heap's pages), so a new bucket's pages are faulted in during backward and unmapped in the
step's wait, ~17 ms per 64 MiB bucket on the machine of bench/results/cpu_step.md.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn as nn

from ..comm import Collectives, Work
from ..config import ConfigError
from ..device import Copy, Transfer
from ..host_memory import MMAP_THRESHOLD
from ..tiers import Tier
from .flat import FlatParameters
from .stages import GradientReduction, ZeroStage


UnitHook = Callable[[int], None]
ValueHook = Callable[[int, torch.Tensor], None]


@dataclass(eq=False)
class _Landing:
    """A reduced shard's device→host copy in flight into a landing buffer, and what to do with it
    once it has landed: ``land`` (the shard's copy_ or add_) and the ``reduced`` hooks."""

    transfer: Transfer
    land: Callable[[torch.Tensor], torch.Tensor]
    notify: list[UnitHook]


@dataclass(eq=False)
class _Subscriber:
    unit_done: UnitHook | None
    before_collective: UnitHook | None
    reduced: UnitHook | None
    reduced_value: ValueHook | None = None


class Subscription:
    """One subscriber's hooks on a :class:`GradientReducer`; :meth:`remove` (or leaving the
    ``with`` block) unsubscribes them. Removing twice is harmless."""

    def __init__(self, subscribers: list[_Subscriber], subscriber: _Subscriber):
        self._subscribers = subscribers
        self._subscriber = subscriber

    def remove(self) -> None:
        if self._subscriber in self._subscribers:
            self._subscribers.remove(self._subscriber)

    @property
    def active(self) -> bool:
        return self._subscriber in self._subscribers

    def __enter__(self) -> "Subscription":
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


class GradientReducer:
    """Reduces each unit's gradient as backward completes it (ZeRO §5.2), and tells its
    subscribers (:meth:`subscribe`) when a unit's gradient is complete, just before its
    collective, and once its reduction has landed: the stage-3 fetcher releases a gathered unit
    on the first, the collective-order checker runs on the second, and an optimizer step
    overlapped with backward (ZeRO-Infinity §6) or norms taken at landing start on the third.
    The reducer knows none of them: each adds and removes its own hooks."""

    def __init__(self, flat: FlatParameters, comm: Collectives, stage: ZeroStage | int, launch_order: list[int],
                 max_in_flight: int = 2, launch_when_ready: bool = True, accumulate: bool = False,
                 defer_landing: bool = False, keep_spares: bool = False):
        self.flat = flat
        self.comm = comm
        self.stage = ZeroStage(stage)
        """The ZeRO stage (zero/stages.py; an int is the user's zero.stage)."""
        self.launch_order = launch_order
        self.max_in_flight = max_in_flight
        self.launch_when_ready = launch_when_ready
        self.accumulate = accumulate and launch_when_ready and self.stage.partitions_gradients
        """Stages 2-3: micro-batches accumulate in the units' buckets on the device, each reduced
        once, at the accumulation boundary (see the module docstring)."""
        streams = flat.streams
        self.defer_landing = (defer_landing and self.stage.partitions_gradients and launch_when_ready
                              and not self.accumulate and flat.placement.optimizer_tier is Tier.CPU
                              and (streams.pin or streams.defer))
        """Non-boundary micro-batches' reduced shards land on the CPU tier asynchronously, waited
        for only when their landing buffer is reused or in wait() (see the module docstring).
        Set to False before a backward (tests) to land every reduction at once, as before."""
        self._boundary = True
        self._landing: dict[int, torch.Tensor] = {}  # unit -> its pinned landing buffer
        self._pending: dict[int, _Landing] = {}  # unit -> its copy in flight, not yet added
        self._subscribers: list[_Subscriber] = []
        self.reduce_now = False
        self._accepting = False  # between begin() and end_backward() (a pipeline's: and wait())
        self.used: set[tuple[int, int]] = set()
        """(unit, slot) of the parameters that received a gradient since the last take_used()."""
        self._fresh: set[int] = set()  # stage 0-1 units whose stale full gradient this backward overwrites
        self._buckets: dict[int, torch.Tensor] = {}
        self._spare: list[torch.Tensor] = []  # freed buckets kept for reuse (see the module docstring)
        self._keeps_spares = keep_spares and flat.device.type == "cpu"
        self._live = self._peak_live = 0  # buckets in use now, and at most so far
        self._missing: dict[int, int] = {}
        self._next = 0
        self._in_flight: deque[Work] = deque()
        self._handles = []
        for p in flat.slot_of:
            self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))
        self._reset_counts()

    def _reset_counts(self) -> None:
        self._missing = {u.unit.index: len(u.unit.slots) for u in self.flat.units}
        self._arrived: dict[int, set[int]] = {u.unit.index: set() for u in self.flat.units}
        self._absent: set[tuple[int, int]] = set()
        self._next = 0

    def begin(self, reduce_now: bool, absent: Iterable[nn.Parameter] = ()) -> None:
        """Called before each backward: reduce_now is False for stage 0/1 micro-batches that
        only accumulate locally (not the accumulation boundary). absent: parameters this
        backward will give no gradient (not in the loss's graph; see unused_parameters): their
        units complete without them, when their last used parameter's gradient arrives, as on
        a rank that does use them (DDP's find_unused_parameters)."""
        self._accepting = True
        self.reduce_now = self.launch_when_ready and (
            reduce_now or (self.stage.partitions_gradients and not self.accumulate))
        self._boundary = reduce_now
        self._reset_counts()
        for p in absent:
            index, k = self.flat.slot_of[p]
            self._absent.add((index, k))
            self._missing[index] -= 1
        # A stale full gradient (zeroed lazily after the last step) is overwritten slot by
        # slot by this backward; the slots that receive nothing are zeroed when it ends.
        for u in self.flat.units:
            if u.grad_full is not None and u.stale_grad and self.launch_when_ready:
                self._fresh.add(u.unit.index)
                u.stale_grad = False

    def _bucket(self, index: int) -> torch.Tensor:
        u = self.flat.units[index]
        if u.grad_full is not None:
            return u.grad_full
        bucket = self._buckets.get(index)
        if bucket is None and (self.accumulate or not self.launch_when_ready):  # accumulates over micro-batches
            bucket = self._buckets[index] = self._new_bucket(u.unit.padded_numel).zero_()
        elif bucket is None:
            # Each slot is written exactly once per backward (copied, not added), so only the
            # padding needs zeros now; slots that never receive a gradient are zeroed at flush.
            bucket = self._buckets[index] = self._new_bucket(u.unit.padded_numel)
            for start, end in u.unit.padding:
                bucket[start:end].zero_()
        return bucket

    def _new_bucket(self, numel: int) -> torch.Tensor:
        """An fp32 buffer of numel elements, uninitialised: the front of the smallest spare that
        holds them, if one is kept."""
        self._live += 1
        self._peak_live = max(self._peak_live, self._live)
        fits = [i for i, spare in enumerate(self._spare) if spare.numel() >= numel]
        if fits:
            return self._spare.pop(min(fits, key=lambda i: self._spare[i].numel()))[:numel]
        return torch.empty(numel, dtype=torch.float32, device=self.flat.device)

    def _free_bucket(self, bucket: torch.Tensor, reuse: bool = True) -> None:
        """A bucket (or reduced shard) no collective or copy reads any more: its whole block kept
        as a spare if it is one glibc would map afresh (see the module docstring), as many as are
        in use at once at most this step (the smallest dropped beyond), else given back."""
        self._live -= 1
        if reuse and self._keeps_spares and bucket.untyped_storage().nbytes() > MMAP_THRESHOLD:
            whole = torch.empty(0, dtype=torch.float32, device=bucket.device).set_(bucket.untyped_storage())
            self._spare.append(whole)
            self._spare.sort(key=torch.Tensor.numel)
            self._drop_spares_beyond_peak()

    def _drop_spares_beyond_peak(self) -> None:
        """Keep at most as many spares as buckets were in use at once since the count began,
        the largest (the list is sorted by size)."""
        del self._spare[:max(0, len(self._spare) - self._peak_live)]

    def _trim_spares(self) -> None:
        """At the end of a step's reductions: keep only as many spares as this step used at
        once (the first step, which launches late, may have used more), and count afresh."""
        self._drop_spares_beyond_peak()
        self._peak_live = self._live

    @property
    def spare_bytes(self) -> int:
        """Bytes of the freed buckets kept for reuse (CPU device only; see the module docstring)."""
        return sum(b.numel() * b.element_size() for b in self._spare)

    def _on_grad(self, p: nn.Parameter) -> None:
        index, k = self.flat.slot_of[p]
        if not self._accepting:
            p.grad = None  # (a later backward would add into it)
            raise RuntimeError(
                f"a gradient reached parameter {self.flat.units[index].unit.slots[k].name!r} outside "
                f"engine.backward(loss): a backward of the model's own output (model(x) rather than engine(batch), "
                f"or loss.backward() rather than engine.backward(loss)) bypasses the engine, which scales the loss "
                f"for gradient accumulation and data parallelism, reduces the gradients and counts the micro-batch; "
                f"call loss = engine(batch) and engine.backward(loss)")
        if (index, k) in self._absent:
            raise RuntimeError(f"parameter {self.flat.units[index].unit.slots[k].name!r} received a gradient although "
                               f"it is not in the loss's autograd graph: a backward inside backward (reentrant "
                               f"activation checkpointing: use use_reentrant=False) hides parameters from it")
        self.used.add((index, k))
        unit = self.flat.units[index]
        target = self._bucket(index)[unit.unit.slots[k].offset:unit.unit.slots[k].end]
        if p.grad.layout != torch.strided:
            raise RuntimeError(f"parameter {unit.unit.slots[k].name!r} received a {p.grad.layout} gradient: the "
                               f"engine's flat gradient buffers hold dense ones only; make the operation that "
                               f"produces it give a dense gradient (an embedding: sparse=False)")
        grad = p.grad.reshape(-1)
        if (unit.grad_full is not None and index not in self._fresh) or not self.launch_when_ready or self.accumulate:
            target.add_(grad)  # micro-batches accumulate in the persistent buffer (stages 0-1) or bucket
        else:
            target.copy_(grad)
        p.grad = None
        self._arrived[index].add(k)
        self._missing[index] -= 1
        if self._missing[index] == 0:
            self._unit_done(index)
            if self.reduce_now:
                self._launch_ready()

    def subscribe(self, unit_done: UnitHook | None = None, before_collective: UnitHook | None = None,
                  reduced: UnitHook | None = None, reduced_value: ValueHook | None = None) -> Subscription:
        """Add hooks, each called with a unit's index: ``unit_done`` once every parameter of
        the unit has reported its gradient this backward (or backward ended without some);
        ``before_collective`` just before the unit's collective is issued; ``reduced`` once
        its reduction has landed in the gradient shard (when the collective is waited on, in
        this thread; only subscribers present when the collective was launched are called;
        with ``defer_landing``, a non-boundary micro-batch's reductions land later: when the
        unit's landing buffer is reused or in wait(), at the latest during the boundary's
        backward, before that unit's boundary reduction lands). ``reduced_value`` (index, value):
        where the shard's landing is a copy (its first reduction since the step), value holds
        exactly what it lands, readable on the current stream: the reduced shard on the compute
        device before its copy to the host (host code that needs only a function of it, a norm,
        need not wait for the copy), or the shard itself where it was reduced in place; called
        before ``reduced``. Subscribers are called in the order they subscribed."""
        subscriber = _Subscriber(unit_done, before_collective, reduced, reduced_value)
        self._subscribers.append(subscriber)
        return Subscription(self._subscribers, subscriber)

    @property
    def bucket_bytes(self) -> int:
        """Bytes of the fp32 buckets held now (between micro-batches: the accumulators of
        ``accumulate``, or a pipeline's; otherwise none once backward's reductions are waited)."""
        return sum(b.numel() * b.element_size() for b in self._buckets.values())

    @property
    def subscriber_count(self) -> int:
        """How many subscriptions are active (a leftover one is a leak: tests check it)."""
        return len(self._subscribers)

    def _unit_done(self, index: int) -> None:
        for s in list(self._subscribers):
            if s.unit_done is not None:
                s.unit_done(index)

    def _launch_ready(self, flush: bool = False) -> None:
        while self._next < len(self.launch_order):
            index = self.launch_order[self._next]
            if not flush and self._missing[index] > 0:
                return
            self._launch(index)
            self._next += 1

    def _zero_missing(self, index: int) -> None:
        """Zero the slots of unit `index` that this backward wrote no gradient into, where
        the buffer holds no other value for them (a fresh bucket, or a stale full gradient)."""
        u = self.flat.units[index]
        fresh = index in self._fresh
        self._fresh.discard(index)
        complete = len(self._arrived[index]) == len(u.unit.slots)
        if complete or not (fresh or (u.grad_full is None and self.launch_when_ready and not self.accumulate)):
            return
        bucket = self._bucket(index)
        for k, slot in enumerate(u.unit.slots):
            if k not in self._arrived[index]:
                bucket[slot.offset:slot.end].zero_()

    def _launch(self, index: int) -> None:
        """Reduce unit `index`. Gradients arrive already divided by the data-parallel size
        (the engine folds 1/dp into the loss scale, exact for powers of two), so the reduced
        sum is the mean and no pass over the result divides it."""
        u = self.flat.units[index]
        u.ensure_grad()  # (released after the last step's in-place NVMe update consumed it)
        bucket = self._bucket(index)
        self._zero_missing(index)
        for s in list(self._subscribers):
            if s.before_collective is not None:
                s.before_collective(index)
        reduction = self.stage.gradient_reduction
        deferred = False
        if reduction is GradientReduction.ALL_REDUCE:
            work = self.comm.all_reduce(bucket, async_op=True)
        elif reduction is GradientReduction.SCATTER_IN_PLACE:
            # The shard is this rank's chunk of the full gradient: reduced in place.
            work = self.comm.reduce_scatter(u.grad, bucket, async_op=True)
        elif u.stale_grad and u.grad.device == bucket.device and not self.flat.streams.defer:
            # The shard's first reduction since the step: reduce-scatter straight into it. (Not
            # under the deferred-copy harness, which stands the host shard for one a copy reaches.)
            u.stale_grad = False
            work = self.comm.reduce_scatter(u.grad, bucket, async_op=True)
            work.then(lambda hooks=self._value_hooks(): self._notify_value(index, u.grad, hooks))
        else:
            stale, u.stale_grad = u.stale_grad, False
            reduced = self._new_bucket(u.unit.shard_numel)
            work = self.comm.reduce_scatter(reduced, bucket, async_op=True)
            # "g offload": with the optimizer on the CPU tier, u.grad is host memory; the
            # reduced shard is copied there on the copy stream, and the host waits for the copy
            # before adding it (on a GPU an unwaited device→host copy is still in flight).
            land = u.grad.copy_ if stale else u.grad.add_
            if self.defer_landing and not self._boundary:
                notify = [s.reduced for s in self._subscribers if s.reduced is not None]
                work.then(lambda: self._land_later(index, reduced, land, notify))
                deferred = True
            elif stale and u.grad.device.type == "cpu":  # (an accelerator's, or the harness's)
                work = self._copy_at_launch(index, work, reduced)
            else:
                streams = self.flat.streams
                to_grad = streams.to_host if u.grad.device.type == "cpu" else streams.to_device
                work.then(lambda: (self._finish_landing(index),
                                   land(to_grad(reduced, Copy.GRAD_TO_HOST).synchronize()),
                                   self._free_bucket(reduced)))
        if self.stage.partitions_gradients:
            self._buckets.pop(index, None)
            work.then(lambda: self._free_bucket(bucket))  # (alive until its collective has completed)
        for notify in [] if deferred else [s.reduced for s in self._subscribers if s.reduced is not None]:
            work.then(lambda notify=notify: notify(index))
        self._in_flight.append(work)
        # (Pipeline buckets all exist already: capping them would only stall the pipeline.)
        while len(self._in_flight) > self.max_in_flight and self.stage.partitions_gradients and self.launch_when_ready:
            self._in_flight.popleft().wait()

    def _copy_at_launch(self, index: int, work: Work, reduced: torch.Tensor) -> Work:
        """Unit index's first reduction since the step, landing straight in its host shard (no
        pinned staging shard, no host pass copying that into the shard: ~9 ms per 53 M elements
        on an H100 host's autograd thread, bench/results/gpu_issue36.md), on an accelerator or
        under the deferred-copy harness (which stands the host shard for one a copy reaches): the
        device→host copy is issued now, behind the collective on the device (NCCL's wait orders
        the stream; the host goes on), and the host waits for it only when the window of
        reductions in flight moves past this unit, or in wait(). Issued at that
        later wait instead, the copy would queue behind all the backward work launched since
        and the host would wait for all of it, unit after unit, with nothing queued on the
        device meanwhile (bench/results/gpu_issue36.md: 96 ms of such waits in one backward).
        Returns what the window waits for."""
        hooks = self._value_hooks()
        work.wait()
        self._finish_landing(index)
        self._notify_value(index, reduced, hooks)  # (the device's shard: a kernel beside the copy)
        transfer = self.flat.streams.copy(self.flat.units[index].grad, reduced, Copy.GRAD_TO_HOST)
        return Work(None, on_done=lambda: (transfer.synchronize(), self._free_bucket(reduced)))

    def _value_hooks(self) -> list[ValueHook]:
        """The ``reduced_value`` hooks of the subscribers present now (at a collective's launch)."""
        return [s.reduced_value for s in self._subscribers if s.reduced_value is not None]

    @staticmethod
    def _notify_value(index: int, value: torch.Tensor, hooks: list[ValueHook]) -> None:
        for hook in hooks:
            hook(index, value)

    def _land_later(self, index: int, reduced: torch.Tensor, land, notify: list[UnitHook]) -> None:
        """Unit index's collective has been waited (its result is ordered on the compute stream):
        copy the reduced shard into the unit's landing buffer on the copy stream, without waiting.
        The buffer's previous copy is finished first: the one host wait this path has."""
        self._finish_landing(index)
        buffer = self._landing.get(index)
        if buffer is None:
            buffer = self._landing[index] = self.flat.streams.host_empty(reduced.shape, reduced.dtype)
        transfer = self.flat.streams.copy(buffer, reduced, Copy.GRAD_TO_HOST)
        # (No need to keep `reduced`: the copy recorded its use on the copy stream. Not a spare:
        # the copy may still read it.)
        self._free_bucket(reduced, reuse=False)
        self._pending[index] = _Landing(transfer, land, notify)

    def _finish_landing(self, index: int) -> None:
        """Wait for unit index's landing copy in flight, if any, add it into the shard and
        call the ``reduced`` hooks it was launched with."""
        pending = self._pending.pop(index, None)
        if pending is None:
            return
        pending.land(pending.transfer.synchronize())
        for notify in pending.notify:
            notify(index)

    def finish_landings(self) -> None:
        """Land every reduced shard whose copy is still in flight, in the order they were issued
        (wait() does; before anything reads the gradient shards)."""
        for index in list(self._pending):
            self._finish_landing(index)

    @property
    def landing_bytes(self) -> int:
        """Bytes of the CPU tier's landing buffers (one gradient shard per trained unit) that
        ``defer_landing`` needs (allocated at the first micro-batch that lands late)."""
        if not self.defer_landing:
            return 0
        return sum(u.unit.shard_numel * 4 for u in self.flat.units)

    def end_backward(self) -> None:
        """Launch every unit not yet launched (flushing unused parameters as zeros)."""
        self._accepting = False
        if self.reduce_now or self.accumulate:
            for index, missing in self._missing.items():
                if missing:  # (between boundaries too: stage 3 releases the unit's parameters)
                    self._unit_done(index)
        if self.reduce_now:
            self._launch_ready(flush=True)
        for index in list(self._fresh):  # units not reduced in this backward (accumulation)
            self._zero_missing(index)

    def take_used(self) -> set[tuple[int, int]]:
        """(unit, slot) of the parameters that received a gradient since the last call."""
        used, self.used = self.used, set()
        return used

    def accumulated_gradient(self, p: nn.Parameter) -> torch.Tensor:
        """The flat fp32 gradient accumulated so far for ``p``, before its reduction (a view:
        editing it edits what will be reduced; the pipeline's tied-weight exchange uses it)."""
        index, k = self.flat.slot_of[p]
        slot = self.flat.units[index].unit.slots[k]
        return self._bucket(index)[slot.offset:slot.end]

    def launch(self, indices: list[int]) -> None:
        """Launch the given units' collectives now (``launch_when_ready=False``: the caller
        knows when a pipeline chunk's gradients are final). Every rank of the data-parallel
        group must launch the same units in the same order."""
        for index in indices:
            self._launch(index)

    def wait(self) -> None:
        """Block until every launched collective has completed and landed in the shards."""
        self._accepting = False
        while self._in_flight:
            self._in_flight.popleft().wait()
        self.finish_landings()
        if not self.accumulate:  # (accumulating buckets not yet reduced are this step's gradients)
            for bucket in self._buckets.values():
                self._free_bucket(bucket)
            self._buckets.clear()
        self._trim_spares()

    def abandon(self) -> None:
        """A backward raised midway: complete the collectives it launched (every rank launched
        the same ones before it) and land them, then drop the window's accumulating buckets
        and counts (the caller marks the gradients stale: nothing of the window reaches a step)."""
        self.wait()
        for bucket in self._buckets.values():
            self._free_bucket(bucket)
        self._buckets.clear()
        self._reset_counts()
        self.used.clear()

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._spare.clear()


def unused_parameters(loss: torch.Tensor, params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    """Those of params that the loss's autograd graph does not reach (no gradient will flow to
    them in this backward): a walk from loss.grad_fn over next_functions to the gradient
    accumulators, whose .variable is the parameter. Empty when the graph holds a reentrant
    checkpoint, which hides the parameters inside it (they are then not reported absent)."""
    seen, reached, stack = set(), set(), [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        if type(fn).__name__ == "CheckpointFunctionBackward":
            return []
        variable = getattr(fn, "variable", None)
        if variable is not None:
            reached.add(id(variable))
        stack.extend(next_fn for next_fn, _ in fn.next_functions)
    return [p for p in params if id(p) not in reached]


def check_dense_gradients(module: nn.Module) -> None:
    """Refuse embeddings built with sparse=True: their gradients are sparse tensors, which no
    flat gradient buffer can hold (ZeRO reduces dense shards; FSDP refuses them too)."""
    sparse = [name or type(module).__name__ for name, m in module.named_modules()
              if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]
    if sparse:
        raise ConfigError(f"{', '.join(repr(n) for n in sparse)}: an embedding built with sparse=True gives sparse "
                          f"gradients, which the engine's flat gradient buffers cannot hold (ZeRO reduces dense "
                          f"shards); set sparse=False on it before wrap() (module.sparse = False), which trains the "
                          f"same values")
