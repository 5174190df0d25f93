"""ZeRO-Offload's one-step delayed parameter update (DPU, docs/concepts.md#delayed-parameter-update), an opt-in mode:
``zero.delayed_update: true`` with ``zero.offload_optimizer: cpu`` (stages 2-3).

**Schedule.** Number the optimizer steps t = 0, 1, 2, … and write g_t for step t's reduced,
clipped gradients and θ_t for the fp32 masters after t updates, θ_{t+1} = AdamW(θ_t, g_t)
at the schedule's learning rate of update t. The synchronous engine computes g_t at θ_t.
With DPU and W = ``zero.delayed_update_warmup``:

* steps t < W are synchronous: g_t is computed at θ_t and applied before step() returns;
* from step W on, the update θ_t → θ_{t+1} runs in a background thread while step t+1's
  forward and backward run at θ_t, so **g_{t+1} is computed at θ_t** (t ≥ W): the
  parameters a forward sees at step s are θ_s for s ≤ W and θ_{s-1} for s > W.

Every gradient is still applied exactly once, in order, with its own learning rate (the
schedule steps once per update, as in the synchronous engine) and its own clip coefficient
(the global norm is that of g_t, the gradients being applied). A flush (below) after the
last step() leaves θ_N in the masters. ``tests/test_delayed_update.py`` holds the plain
PyTorch form of this schedule that the engine is checked against.

It is one form of the optimizer step (tiertrain/update/protocol.py), chosen by the factory.

**At each accumulation boundary** (:meth:`DelayedUpdate.step`, main thread, called by
Engine.step after the gradient norm): (1) wait for update t-1;
(2) agree with every rank that it succeeded (one 1-element all-reduce over the world);
(3) publish θ_t exactly as the synchronous path does (masters → compute-dtype shards,
all-gather of resident units); (4) swap g_t's buffers with the **gradient snapshot**'s: the
reduced shards become the snapshot the update reads (the worker multiplies them by the clip
coefficient) and the old snapshot the gradient shards the next backward overwrites, so the
main thread moves no gradient (where the engine keeps views of the gradient shards, for
tensor parallelism, g_t × clip coefficient is copied into the snapshot instead); (5) hand
update t (AdamW over this rank's master shard, reading the snapshot, at update t's rate of
the schedule) to the worker thread. Each unit's gradient norm was taken during backward as
its reduction landed (update/protocol.py LandingNorms).
During warmup the same five steps run and then the engine waits for the update at once.

**Buffers.** The snapshot is one persistent fp32 buffer per unit, the size of the gradient
shard, on the optimizer's tier (counted in ``memory_report().grads`` and ``cpu_tier``). A
master that is the compute shard itself (stage 3, fp32, parameters and optimizer both on
the CPU tier) gets a separate copy, so the update never writes what a forward reads.

**Errors.** An exception in the update is kept and raised at the next boundary (or flush)
on **every** rank, as :class:`DelayedUpdateError` naming the failed rank(s), the step and
the error: the agreement in (2) precedes the collectives of (3), so no rank is left waiting
in an all-gather for a peer that failed.

**Flushes.** ``save_checkpoint``/``state_dict``/``full_state_dict``/``masters()`` wait for
the in-flight update without publishing it, so they see θ_{t+1} and the run goes on exactly
as if they had not been called; a checkpoint also stores the published (one step older)
compute shards, so a resumed run continues bit-identically (``load_checkpoint`` first
finishes and discards an update in flight, then restores both). ``gathered_parameters``
flushes (waits and publishes): what is read or edited is the newest parameters, and the
next step's gradients are then fresh (staleness 0 for that step). ``memory_report()`` waits
too. ``Engine.close()`` waits and stops the thread (the worker is also joined at interpreter
exit, finishing its update). A checkpoint saved with DPU loads into an engine without it
(the saved masters are published) and vice versa.

**Not supported** (refused by Config.validate): ``offload_optimizer`` none or nvme (the
NVMe optimizer writes updated values straight into the compute shards the next forward
reads), ``zero.offload: auto``, fp16 loss scaling, pipeline parallelism.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch
import torch.distributed as dist

from ..comm import Collectives
from ..errors import TiertrainError
from ..spans import span
from .host_adamw import HostAdamW
from .in_memory import chosen_host_pass
from .protocol import (PIECE, SLOT_NAME, GroupSchedule, LandingNorms, OptimizerUpdate, UpdateMemory,
                       gradients_hidden, optimizer_state_bytes, piece_of, restore_masters, shard_optimizer)
from .state_format import TorchOptimizerState


class DelayedUpdateError(TiertrainError, RuntimeError):
    """The background optimizer update failed on some rank; raised on every rank."""


class DelayedUpdate(OptimizerUpdate):
    """Runs one rank's optimizer updates on a worker thread, one step behind; see the module
    docstring. group: the process group whose ranks agree on failures (the world; None for
    one process)."""

    publishes_in_step = False

    state_format = TorchOptimizerState(published=True)
    """torch's state_dict, and with an update not yet published the shards the next forward
    reads (state_dict's "published")."""

    def __init__(self, flat, config, lazy_zero: bool, group, device: torch.device, client=None,
                 landing_norms: LandingNorms | None = None, swap_gradients: bool = False):
        super().__init__(flat, config, lazy_zero)
        self.landing_norms = landing_norms
        self.swap_gradients = swap_gradients
        """Hand the reduced gradient shards themselves to the update, the snapshots becoming the
        next backward's gradient buffers: no copy on the main thread, the clip factor applied
        by the worker. (Not where the engine keeps views of the gradient shards.)"""
        self._clip: torch.Tensor | None = None
        self.staging = {u.unit.index: flat.placement.empty(u.shard.numel(), u.shard.dtype,
                                                           flat.placement.optimizer_tier).zero_()
                        for u in flat.units if u.shard.dtype != u.master.dtype}
        """Per unit whose compute dtype is not fp32: its updated masters cast by the worker (or
        written by the compiled pass, which leaves the padding as zeroed here), so that
        publishing them is a plain copy on the main thread, not a cast."""
        self.device = device
        self.warmup = config.zero.delayed_update_warmup
        self.group = group
        self.comm = Collectives(group) if group is not None else None
        self._untie_masters()
        # The optimizer reads its gradients from the snapshot, never from the live shard.
        self.snapshots = [flat.placement.empty(u.grad.numel(), u.grad.dtype, flat.placement.optimizer_tier).zero_()
                          for u in flat.units]
        self.optimizer = shard_optimizer(flat, [u.master for u in flat.units], self.snapshots, config, client)
        self.host_pass = chosen_host_pass(
            config, client, flat.placement.offload_optimizer,
            lambda: HostAdamW(self.optimizer, lambda piece: piece_of(piece, self.staging.get),
                              "optimizer.impl=compiled"))
        """The compiled AdamW + clip + cast pass, writing the staging buffers, when optimizer.impl
        chose it (auto: the default AdamW on the CPU tier); else torch's step and a cast."""
        # A client lr_scheduler steps a stand-in on this thread while the worker steps the
        # optimizer; its hyper-parameters reach the optimizer between updates (GroupSchedule).
        self.schedule = GroupSchedule.of(client)
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiertrain-delayed-update")
        self._future: Future | None = None
        self._in_flight_step = -1
        self._updating_without: frozenset[str] = frozenset()
        """Parameters the update in flight leaves unchanged (leave_unchanged)."""
        self.unpublished = False
        """The masters hold an update the compute shards do not have yet."""
        self.failed: str | None = None
        """The error message every rank raises, once an update has failed."""
        self._error: BaseException | None = None
        self._unagreed = False  # an update was started since the ranks last agreed
        self.overlapped_steps = 0
        """Updates that ran in the background (after the warmup)."""

    def _untie_masters(self) -> None:
        """Give a separate master to every unit whose master is its compute shard, so the
        update never writes what a forward reads."""
        for u in self.flat.units:
            if u.master is u.shard:
                u.master = u.master.clone()

    # -- the step -----------------------------------------------------------------------

    def own_learning_rate(self):
        return self.schedule.learning_rate()

    def step(self, grads, clip, lr, step):
        """At an accumulation boundary, after the gradient norm (collective on every rank):
        finish and publish the previous update, then start this step's."""
        self.norms_consumed()
        self.wait(agree=True)
        self.publish()
        if self.swap_gradients:
            self._swap(clip)
        else:
            with torch.no_grad():
                for g, snap in zip(grads, self.snapshots):
                    if clip is None:
                        snap.copy_(g)
                    else:
                        torch.mul(g, clip, out=snap)
        # The snapshot holds them now: the next reduction overwrites each gradient, as after a
        # synchronous step, so no pass zeroes them.
        self.flat.zero_grads(lazy=self.lazy_zero)
        self.schedule.apply(self.optimizer, lr)  # (no update in flight: waited above)
        self._in_flight_step = step
        self._updating_without, self.unchanged = self.unchanged, frozenset()  # (read by the worker)
        self._future = self._worker.submit(self._update)
        self.schedule.advance()
        self._unagreed = True
        if step < self.warmup:
            self.wait(agree=True)
            self.publish()
        else:
            self.overlapped_steps += 1

    def _swap(self, clip: torch.Tensor | None) -> None:
        """The reduced gradient shards become the snapshots (and the optimizer's gradients), the
        old snapshots the gradient shards; the worker scales them by clip."""
        for i, u in enumerate(self.flat.units):
            u.grad, self.snapshots[i] = self.snapshots[i], u.grad
        for group in self.optimizer.param_groups:
            for view in group["params"]:
                index, start, end = getattr(view, PIECE)
                view.grad = self.snapshots[index][start:end]
        self._clip = clip

    def _update(self) -> None:
        if self.host_pass is not None:  # (one pass: the clip factor, AdamW and the staging's cast)
            with span("delayed_update"):
                clip, self._clip, unchanged = self._clip, None, self._updating_without
                self.host_pass.step(clip, skip=lambda p: getattr(p, SLOT_NAME) in unchanged)
            return
        with span("delayed_update"), gradients_hidden(self.optimizer, self._updating_without):
            if self._clip is not None:
                for snapshot in self.snapshots:
                    snapshot.mul_(self._clip)
                self._clip = None
            self.optimizer.step()
            self._stage()

    def _stage(self) -> None:
        """The masters cast into the staging buffers (what publish() stores)."""
        for index, buffer in self.staging.items():
            buffer.copy_(self.flat.units[index].master)

    def wait(self, agree: bool) -> None:
        """Wait for the update in flight (if any). agree=True (every rank must call it): all
        ranks learn whether any rank's update failed since the last agreement, and all raise.
        agree=False raises a failure on this rank only."""
        future, self._future = self._future, None
        if future is not None:
            error = future.exception()
            if error is None:
                self.unpublished = True
            else:
                self._error = error
        if agree and self._unagreed:
            self._unagreed = False
            if self.group is not None:
                self._agree(self._error)  # raises on every rank when any rank failed
        if self._error is not None:
            if self.failed is None:
                self.failed = self._describe([(self._rank, self._why(self._error))])
            raise DelayedUpdateError(self.failed) from self._error

    def settle(self, collective: bool) -> None:
        self.wait(agree=collective)

    @property
    def _rank(self) -> int:
        return dist.get_rank() if dist.is_initialized() else 0

    @staticmethod
    def _why(error: BaseException) -> str:
        return f"{type(error).__name__}: {error}"

    def _describe(self, failures: list[tuple[int, str]]) -> str:
        where = "; ".join(f"rank {r}: {why}" for r, why in failures)
        return (f"the delayed optimizer update of step {self._in_flight_step} (zero.delayed_update) failed on "
                f"rank{'s' if len(failures) > 1 else ''} {', '.join(str(r) for r, _ in failures)}: {where}")

    def _agree(self, error: BaseException | None) -> None:
        flag = torch.tensor([0 if error is None else 1], dtype=torch.int32, device=self.device)
        self.comm.all_reduce(flag, count=False)  # (waited on with the process-group timeout)
        if int(flag.item()) == 0:
            return
        mine = None if error is None else (self._rank, self._why(error))
        every = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(every, mine, group=self.group)
        self.failed = self._describe([f for f in every if f is not None])
        if error is None:
            self._error = DelayedUpdateError(self.failed)
        raise DelayedUpdateError(self.failed) from error

    def publish(self) -> None:
        """Copy the updated masters into the compute shards and all-gather (collective)."""
        if self.unpublished:
            self.flat.publish_masters(sources=self.staging)
            self.unpublished = False

    def flush(self) -> None:
        """Collective: wait for the update in flight and publish it."""
        self.wait(agree=True)
        self.publish()

    # -- masters, accounting, checkpoints, shutdown ----------------------------------------

    def masters(self):
        self.wait(agree=False)
        return [u.master for u in self.flat.units]

    @property
    def snapshot_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.snapshots)

    @property
    def staging_bytes(self) -> int:
        return sum(s.numel() * s.element_size() for s in self.staging.values())

    def memory(self):
        self.wait(agree=False)  # (the first update creates the Adam moments)
        moments = optimizer_state_bytes(self.optimizer)
        # The snapshot the background update reads: one more fp32 gradient shard, CPU tier;
        # the staging buffers: one more compute-dtype shard, counted with the optimizer's.
        return UpdateMemory(optimizer=moments + self.staging_bytes,
                            cpu_tier=moments + self.staging_bytes + self.snapshot_bytes,
                            extra_grads=self.snapshot_bytes)

    def state_dict(self):
        """After the update in flight (if any): masters, optimizer and, with an update not yet
        published, this rank's compute-dtype shards (what the next forward reads), so a
        resumed run sees the same parameters."""
        self.wait(agree=False)
        published = None
        if self.unpublished:
            published = [self.flat.read_shard(u.unit.index) for u in self.flat.units]
        return {"masters": [u.master.detach().clone() for u in self.flat.units],
                "optimizer": self.optimizer.state_dict(), "published": published,
                "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state):
        """Finish and discard an update in flight, restore masters and optimizer, publish them;
        then put back the published shards of a checkpoint saved with an update not yet
        published (collective)."""
        self.discard()
        restore_masters(self.flat, self.optimizer, state)
        self.schedule.load_state_dict(state.get("schedule"))
        shards = state.get("published")
        if shards is None:
            return
        flat = self.flat
        masters = [u.master for u in flat.units]
        try:  # publish_masters copies "masters" into the shards: hand it the saved shards
            for u, shard in zip(flat.units, shards):
                u.master = shard.to(u.shard.device)
            flat.publish_masters()
        finally:
            for u, master in zip(flat.units, masters):
                u.master = master
        self._stage()  # (what the next publish() stores: the restored masters)
        self.unpublished = True

    def discard(self) -> None:
        """Before a checkpoint is loaded: finish the update in flight (its result is then
        overwritten) without raising for it."""
        future, self._future = self._future, None
        if future is not None:
            future.exception()
        self.unpublished = False
        self._unagreed = False

    def close(self) -> None:
        """Wait for the update in flight (raising its error, locally) and stop the thread."""
        try:
            self.wait(agree=False)
        finally:
            self._worker.shutdown(wait=True)

    @property
    def in_flight(self) -> bool:
        return self._future is not None
