"""ZeRO-Infinity's optimizer step from NVMe as an update form (tiertrain/update/protocol.py):
the fp32 masters and Adam moments live in swap files and stream through a few chunk buffers
at each step (:class:`~.optimizer.NVMeAdamW`); updated values go straight into the
compute shards through the flat parameters' ShardWriter.

:class:`NVMeUpdate` runs the step when step() is called, after reading the first chunks
during the step's last backward (ZeRO-Infinity §6: the read does not depend on the
gradients). :class:`OverlappedNVMeUpdate` goes further: each unit's chunks are updated as
soon as its gradient reduction lands (tiertrain/update/nvme/overlapped_step.py), which the
factory chooses only when nothing global (clipping, an fp16 unscale, a tensor-parallel sum of
partial gradients) changes the gradients between their reduction and the update.
"""
from __future__ import annotations

import threading
import time
import warnings

import torch

from ...comm import run_timeout
from ...config import ConfigError
from ...elementwise import AdamWRule, ElementwiseRule, streamed_update
from ...optim import squared_norm
from ..protocol import GroupSchedule, OptimizerUpdate, UpdateMemory, scale_gradients, shard_param_groups
from ..state_format import NVMeStreamState
from .masters import ShardWriter, WriteStaging, master_shards, optimizer_holds_masters
from .optimizer import NVMeAdamW, pieces_from_param_groups

class NVMeUpdate(OptimizerUpdate):
    """The NVMe optimizer stepped synchronously in step(). A client AdamW, Adam or SGD (see
    tiertrain/elementwise.py streamed_update) is streamed with its groups' weight decays; its
    lr_scheduler runs on a stand-in whose rate and rule hyper-parameters (betas, momentum)
    each step reads."""

    @property
    def state_format(self) -> NVMeStreamState:  # type: ignore[override]
        """The stream's records, its state slots named by its rule."""
        return NVMeStreamState.of_rule(self.nvme.rule)

    def __init__(self, flat, config, lazy_zero: bool, swapper, rank: int, client=None):
        super().__init__(flat, config, lazy_zero)
        zc = config.zero
        masters = [u.master for u in flat.units]
        grads = [u.grad for u in flat.units]
        # The pieces are found from views of these tensors; a master whose values are in its
        # NVMe shard file has no storage to point into, so the gradient shards (same sizes)
        # stand in for every master.
        bases = grads
        if client is None:
            groups = shard_param_groups(flat, bases, grads, config.optimizer.weight_decay,
                                        weight_decay_on=config.optimizer.weight_decay_on)
            rule: ElementwiseRule = AdamWRule(tuple(config.optimizer.betas), config.optimizer.eps)
            self.schedule = GroupSchedule()
        else:
            self.schedule = GroupSchedule.of(client)  # (on a stand-in: the stream steps the pieces)
            streamed = streamed_update(self.schedule.holder)
            groups = shard_param_groups(flat, bases, grads, group_of=client.group_index().__getitem__,
                                        options=[{"weight_decay": d} for d in streamed.weight_decays])
            rule = streamed.rule
            self._weight_decays = streamed.weight_decays
        pieces = pieces_from_param_groups(bases, groups)
        del groups

        def initial(s: int) -> torch.Tensor:  # (a master in RAM, or read from its shard file)
            u = flat.units[s]
            return flat.read_shard(u.unit.index) if u.master is u.shard and flat.on_nvme(u.unit.index) else u.master
        self.nvme = NVMeAdamW(masters, pieces, config.optimizer, swapper, rank=rank,
                              chunk_bytes=int(zc.nvme_chunk_mb * 2**20), num_buffers=zc.nvme_buffers, rule=rule,
                              transactional=not zc.nvme_in_place, initial=initial)
        del masters
        # fp32 shards on NVMe: the optimizer's master records are the shards from now on.
        optimizer_holds_masters(flat, self.nvme)
        # The RAM copies of the masters go before the gradient shards are first touched.
        flat.hold_masters_elsewhere(release_grads=self.releases_grads(config))
        self.write_staging = WriteStaging()
        """Where ShardWriter assembles a unit's shard for NVMe, kept across steps."""

    @staticmethod
    def releases_grads(config) -> bool:
        """Whether this form frees each gradient shard once its step consumed it (so none
        needs memory before its first reduction)."""
        return False

    def _pieces_of(self, names: frozenset[str]) -> frozenset[tuple[int, int]]:
        """(unit, start in the shard) of this rank's pieces of the named parameters: the
        pieces the NVMe optimizer leaves unchanged."""
        return frozenset((u.unit.index, a) for u in self.flat.units
                         for slot, a, b in u.unit.shard_pieces(self.flat.shard_rank) if slot.name in names and a < b)

    def own_learning_rate(self):
        return self.schedule.learning_rate()

    def _rate(self, lr: float) -> tuple[float, ElementwiseRule | None]:
        """The rate and rule of this update: the engine's rate (config.schedule) with the
        optimizer's rule, or the client stand-in's rate and rule, which its scheduler may
        have changed (OneCycleLR cycles momentum or beta1). Its weight decays are fixed in the
        stream's pieces."""
        holder = self.schedule.current()
        if holder is None:
            return lr, None
        streamed = streamed_update(holder)
        if streamed.weight_decays != self._weight_decays:
            raise ConfigError(f"zero.offload_optimizer=nvme keeps each group's weight decay fixed; the lr_scheduler "
                              f"changed them from {self._weight_decays} to {streamed.weight_decays}")
        return streamed.lr, streamed.rule

    def before_backward(self, boundary, lr):
        if boundary:
            self.nvme.prefetch()

    def before_step(self):
        self.nvme.prefetch()  # (no-op when backward started it; a state load drops it)

    def step(self, grads, clip, lr, step):
        scale_gradients(grads, clip)
        lr, rule = self._rate(lr)
        skip, self.unchanged = self._pieces_of(self.unchanged), frozenset()
        with ShardWriter.open(self.flat, self.write_staging) as updated_shards:
            self.nvme.step(grads, lr, out=updated_shards, rule=rule, skip=skip)
        self.schedule.advance()
        self.publish_and_reset()

    def masters(self):
        return self.nvme.read_masters()

    def write_masters(self, edited):
        self.nvme.write_masters(edited)

    def memory(self):
        # (a master that is its unit's parameter shard is counted once, with the parameters)
        shared = sum(4 * u.unit.shard_numel for u in self.flat.units if self.flat.shards.holds_masters(u.unit.index))
        own = self.nvme.state_bytes - shared
        return UpdateMemory(optimizer=own, nvme_tier=own)

    def close(self):
        """Delete the optimizer's swap files and free its buffers."""
        self.nvme.close()

    def state_dict(self):
        optimizer = self.nvme.state_dict()
        masters = [shard.pop("master") for shard in optimizer["shards"]]
        return {"masters": masters, "optimizer": optimizer, "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state):
        optimizer = state["optimizer"]
        for shard, master in zip(optimizer["shards"], state["masters"]):
            shard["master"] = master.cpu()
        self.nvme.load_state_dict(optimizer)
        self.schedule.load_state_dict(state.get("schedule"))
        with ShardWriter.open(self.flat, self.write_staging) as write:
            for index, master in enumerate(state["masters"]):
                write(index, 0, master.numel(), master)
        self.flat.publish_masters()
        self.flat.zero_grads()


class OverlappedNVMeUpdate(NVMeUpdate):
    """The NVMe optimizer step running during the step's last backward, unit by unit."""

    def __init__(self, flat, config, lazy_zero: bool, swapper, rank: int, reducer, client=None):
        super().__init__(flat, config, lazy_zero, swapper, rank, client)
        self.reducer = reducer
        self._in_flight = None
        """(OverlappedStep, ShardWriter) of the step running during this boundary's backward."""
        self._rates_taken = 0
        """GroupSchedule.changes_taken when the step in flight read its rates."""
        self._subscription = None  # the in-flight step's hooks on the reducer
        self.release_grads = self.releases_grads(config)
        """In place (zero.nvme_in_place), each unit's gradient shard gives its memory back once
        the step running during backward has updated the unit, so that the gradients held at
        the end of backward are only those not yet consumed (with the optimizer state on NVMe,
        the gradient shards are the model state left in RAM: 4 bytes per parameter of the
        shard). Their squared norms are taken as each reduction lands, for the engine's global
        norm (:meth:`grad_squares`). Transactional steps keep them: a cancelled step is redone
        synchronously from them."""
        self._squares: dict[int, torch.Tensor] = {}
        self.grads_budget = int(config.zero.nvme_grads_in_ram_mb * 2**20)
        """Most bytes of reduced gradient shards held for the step (0: no limit; see
        zero.nvme_grads_in_ram_mb)."""
        self._held: dict[int, int] = {}  # unit -> bytes of its reduced shard not yet freed
        self._progress = threading.Condition()
        self.grads_wait_seconds = 0.0
        """Seconds backward waited for the step to consume gradients (cumulative)."""
        self.peak_held_bytes = 0
        """Most bytes of reduced gradient shards held at once for the step (since built)."""

    @staticmethod
    def releases_grads(config) -> bool:
        return bool(config.zero.nvme_in_place)  # (one generation: nothing redoes a step from them)

    def before_backward(self, boundary, lr):
        if boundary and self._in_flight is None:
            lr, rule = self._rate(lr)
            self._rates_taken = self.schedule.changes_taken
            writer = ShardWriter.open(self.flat, self.write_staging)
            store = master_shards(self.flat)
            step = self.nvme.begin_step([u.grad for u in self.flat.units], lr, out=writer,
                                        shard_order=self.reducer.launch_order, rule=rule,
                                        masters_in_ram=None if store is None else store.master_in_ram)
            self._in_flight = (step, writer)
            self._squares = {}
            # A unit's gradient is complete just after backward gathered it: the step takes the
            # masters that gather read instead of reading them again (OptimizerMasterShards).
            # The units whose gradients complete last are the next forward's first: the step
            # leaves their updated masters in RAM for it.
            # (The engine's fetcher subscribed when the engine was built, so its hook runs
            # first: it releases the gather, whose staging then is a spare.)
            unit_done = None if store is None else self._keeper(store)  # (masters are the shards)
            step.on_shard_updated = self._consumed
            if self.release_grads:
                self._held = {}
                step.on_progress = self._notify
                reduced = lambda index: self._reduced(step, index)  # noqa: E731
            else:
                reduced = step.shard_ready
            self._subscription = self.reducer.subscribe(unit_done=unit_done, reduced=reduced)

    def _keeper(self, store):
        """The hook handing each unit's gathered masters to the step as its gradient completes
        (OptimizerMasterShards.keep_for_step), the last kept_units in RAM for the next forward."""
        order = self.reducer.launch_order
        carried = frozenset(order[len(order) - store.kept_units:])

        def unit_done(index: int) -> None:
            store.keep_for_step(index, carry_over=index in carried)
        return unit_done

    def _reduced(self, step, index: int) -> None:
        """Unit index's gradient shard is final: its squared norm is kept, then the step may
        update (and release) it."""
        u = self.flat.units[index]
        self._squares[index] = squared_norm(u.grad)
        with self._progress:
            self._held[index] = u.grad.numel() * u.grad.element_size()
            self.peak_held_bytes = max(self.peak_held_bytes, sum(self._held.values()))
        step.shard_ready(index)
        if self.grads_budget:
            t0 = time.perf_counter()
            with self._progress:  # (the step consumes shards in reduction order, so it can catch up)
                self._progress.wait_for(lambda: sum(self._held.values()) <= self.grads_budget or step.stalled(),
                                        timeout=run_timeout())
            self.grads_wait_seconds += time.perf_counter() - t0

    def _consumed(self, index: int) -> None:
        """On the step's worker: unit index is updated; the masters handed to the step and (in
        place) its gradient shard's memory go back."""
        store = master_shards(self.flat)
        if store is not None:
            store.step_done_with(index)
        if not self.release_grads:
            return
        self.flat.units[index].release_grad()
        with self._progress:
            self._held.pop(index, None)
            self._progress.notify_all()

    def _notify(self) -> None:
        with self._progress:
            self._progress.notify_all()

    def grad_squares(self):
        if self.release_grads and len(self._squares) == len(self.flat.units):
            return [self._squares[i] for i in range(len(self.flat.units))]
        return None

    def before_step(self):
        if self._in_flight is None:
            super().before_step()
        else:
            self.last_overlapped_step = self._in_flight[0].progress()

    def step(self, grads, clip, lr, step):
        self.schedule.current()
        if self._in_flight is not None and self.schedule.changes_taken != self._rates_taken:
            self._restart_with_new_rates()
        if self._in_flight is None:  # cancelled since (a forward came first, new rates): run it now
            super().step(grads, clip, lr, step)
            return
        self._end(commit=True)  # most units were updated during backward
        self.schedule.advance()
        self.publish_and_reset()

    def leave_unchanged(self, names):
        super().leave_unchanged(names)
        if names:  # the step running since backward updated them too: step() redoes it without
            self.cancel()

    def cancel(self):
        """The parameters an uncommitted step published return to their pre-step values (the
        step then runs synchronously, if step() follows)."""
        if self._in_flight is not None:
            self._end(commit=False)

    def _restart_with_new_rates(self) -> None:
        """The user set hyper-parameters on their optimizer instance after this step's update
        began in backward: a transactional step is cancelled and runs again with them; one in
        place cannot go back, so it keeps the rates it began with, and says so."""
        if self.nvme.transactional:
            self.cancel()
            return
        warnings.warn(f"the hyper-parameters set on the optimizer instance after this step's last backward began "
                      f"(now {self.schedule.holder.param_groups[0]['lr']!r} for group 0's lr) apply from the next "
                      f"update: this one began during backward, in place on NVMe (zero.nvme_in_place), and cannot "
                      f"be redone; set them before the step's last engine.backward()", RuntimeWarning, stacklevel=2)
        self._rates_taken = self.schedule.changes_taken

    @property
    def in_flight(self):
        """The OverlappedStep running now, or None."""
        return None if self._in_flight is None else self._in_flight[0]

    def _end(self, commit: bool) -> None:
        step, writer = self._in_flight
        self._in_flight = None
        self._subscription.remove()
        self._subscription = None
        committed = False
        try:
            with writer:  # writes the last unit's shard to NVMe, after a cancel's restore too
                if commit:
                    step.finish()
                    committed = True
                else:
                    step.cancel()
        finally:
            store = master_shards(self.flat)
            if store is not None:
                store.step_done(committed)
