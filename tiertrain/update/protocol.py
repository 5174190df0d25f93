"""The optimizer-step protocol every update form implements.

Megatron-LM's optimizers share one protocol: prepare the gradients, clip them, step with
ready gradients. Here the engine does the shared part of each step (reduce, unscale, norm,
clip coefficient, the learning rate of the step) and hands the ready gradients to the
update form, which owns everything that differs between forms: where the fp32 masters and
Adam moments live, when the update runs (before step() returns, during backward, one step
behind) and when the new parameters reach the compute shards.

A form sees the engine's events, in this order within a step::

    before_backward(boundary, lr)   each micro-batch's backward (boundary: the step's last)
    before_step()                   step() begins, before gradient reductions are waited on
    step(grads, clip, lr, step)     gradients are final: apply the update
    cancel()                        instead of step(): the step is skipped (fp16 overflow),
                                    or a forward/failure comes before it

and outside steps: ``settle`` (wait for an update in flight), ``flush`` (settle and publish),
``masters``/``write_masters``, ``memory``, ``state_dict``/``load_state_dict`` (a checkpoint
part) and ``close``.
"""
from __future__ import annotations

import contextlib
import warnings

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from ..errors import CheckpointError
from ..optim import build_adamw, decays, squared_norm
from ..spans import span
from .instance_view import InstanceView, group_options
from .state_format import FormOwnState, StateFormat

if TYPE_CHECKING:
    from ..config import Config
    from ..optim import ClientOptimizer, SchedulerFactory
    from ..zero.flat import FlatParameters


@dataclass(frozen=True)
class UpdateMemory:
    """Bytes an update form holds beyond the flat buffers' own accounting."""

    optimizer: int
    """Adam moments (and masters an optimizer keeps itself, e.g. on NVMe)."""
    cpu_tier: int = 0
    """Of all the bytes above and extra_grads, those in the CPU tier."""
    nvme_tier: int = 0
    """Of all the bytes above, those in the NVMe tier."""
    extra_grads: int = 0
    """Gradient copies the form keeps (the delayed update's snapshot)."""


def shard_param_groups(flat: "FlatParameters", masters: list[torch.Tensor], grads: list[torch.Tensor],
                       weight_decay: float = 0.0, *, weight_decay_on: str = "matrices",
                       group_of: Callable[[str], int] | None = None,
                       options: Sequence[dict] | None = None) -> list[dict]:
    """Optimizer groups over this rank's shard of every unit: one tensor per piece of a
    parameter (views of masters[unit], with .grad the same view of grads[unit]), so the update
    is in place on the flat buffers.

    By default the AdamW split: weight decay follows the parameter (optim.decays with
    weight_decay_on); empty groups are dropped. With group_of (parameter name → index into
    options) there is one group per entry of options, holding that group's hyper-parameters,
    kept even where this rank holds no piece of it: every rank's optimizer then has the same
    groups, so a schedule, the reported rate (group 0) and checkpoints agree across ranks."""
    if group_of is None:
        shapes = {s.name: s.shape for u in flat.units for s in u.unit.slots}

        def decay_group(name: str) -> int:
            return 0 if decays(name, shapes[name], weight_decay_on) else 1
        group_of, keep_empty = decay_group, False
        options = [{"weight_decay": weight_decay}, {"weight_decay": 0.0}]
    else:
        keep_empty = True
    groups = [{**o, "params": []} for o in options]
    for u, master, grad in zip(flat.units, masters, grads):
        for slot, a, b in u.unit.shard_pieces(flat.shard_rank):
            view = master[a:b]
            view.grad = grad[a:b]
            setattr(view, SLOT_NAME, slot.name)  # (see gradients_hidden)
            setattr(view, PIECE, (u.unit.index, a, b))
            try:
                index = group_of(slot.name)
            except KeyError:
                raise ValueError(f"parameter {slot.name!r} of the flat layout is in no optimizer group") from None
            groups[index]["params"].append(view)
    if keep_empty:
        return groups
    return [g for g in groups if g["params"]] or [{"params": [masters[0][:0]]}]


def shard_optimizer(flat: "FlatParameters", masters: list[torch.Tensor], grads: list[torch.Tensor],
                    config: "Config", client: "ClientOptimizer | None") -> torch.optim.Optimizer:
    """The optimizer an in-memory form steps: the default AdamW from config.optimizer, or the
    client's optimizer built over its groups' pieces (see shard_param_groups)."""
    if client is None:
        groups = shard_param_groups(flat, masters, grads, config.optimizer.weight_decay,
                                    weight_decay_on=config.optimizer.weight_decay_on)
        return build_adamw(groups, config.optimizer)
    return client.build(shard_param_groups(flat, masters, grads, group_of=client.group_index().__getitem__,
                                           options=client.options()))


SLOT_NAME = "tiertrain_parameter"
"""The attribute naming the parameter a piece of an optimizer group belongs to."""

PIECE = "tiertrain_piece"
"""The attribute holding a piece's place: (unit index, start, end) in that unit's shard."""


def piece_of(piece: torch.Tensor, per_unit: Callable[[int], torch.Tensor | None]) -> torch.Tensor | None:
    """A piece's slice of its unit's tensor ``per_unit(unit index)`` (None where that is None)."""
    index, start, end = getattr(piece, PIECE)
    whole = per_unit(index)
    return None if whole is None else whole[start:end]


def gradients_hidden(optimizer: torch.optim.Optimizer, names: frozenset[str]):
    """Within: the pieces of the named parameters have no .grad, so torch's optimizer leaves
    them and their state unchanged, as it does for a parameter whose .grad is None in one
    process (a parameter no rank used this step: an expert no token was routed to)."""
    return gradients_hidden_where(optimizer, lambda view: getattr(view, SLOT_NAME, None) in names)


@contextlib.contextmanager
def gradients_hidden_where(optimizer: torch.optim.Optimizer, hide: Callable[[torch.Tensor], bool]):
    """Within: the optimizer's pieces for which hide(piece) holds have no .grad (torch's step
    leaves them and their state unchanged)."""
    hidden = []
    for group in optimizer.param_groups:
        for view in group["params"]:
            if view.grad is not None and hide(view):
                hidden.append((view, view.grad))
                view.grad = None
    try:
        yield
    finally:
        for view, grad in hidden:
            view.grad = grad


class LandingNorms:
    """Each unit's squared gradient norm, taken as its reduction lands at the accumulation
    boundary (a subscription to the reducer, during backward), instead of in the step: on the CPU
    tier the host would otherwise read every gradient once more inside the step. Where the
    landing is a copy, the norm is taken of the value the reducer offers (``reduced_value``):
    on an accelerator the reduced shard still on the device, a kernel beside its copy instead of
    a host pass over the landed shard on backward's thread (bench/results/gpu_issue36.md);
    otherwise of the landed host shard. Valid only where nothing changes a gradient shard after
    it landed (UpdateContext.gradients_final_at_landing)."""

    def __init__(self, flat: "FlatParameters", reducer):
        self.flat = flat
        self.reducer = reducer
        self._squares: dict[int, torch.Tensor] = {}
        self._subscription = None

    def begin(self, boundary: bool) -> None:
        """A micro-batch's backward starts: at the boundary, take the squares as units land."""
        if boundary:
            self._squares = {}
            self._unsubscribe()
            self._subscription = self.reducer.subscribe(reduced_value=self._value, reduced=self._landed)

    def _unsubscribe(self) -> None:
        if self._subscription is not None:
            self._subscription.remove()
            self._subscription = None

    def _value(self, index: int, value: torch.Tensor) -> None:
        with span("grad_norm_at_landing"):
            self._squares[index] = squared_norm(value)

    def _landed(self, index: int) -> None:
        if index not in self._squares:  # (a landing that added into the shard: its sum is on the host)
            with span("grad_norm_at_landing"):
                self._squares[index] = squared_norm(self.flat.units[index].grad)

    def square(self, index: int) -> torch.Tensor | None:
        """Unit index's squared norm, if its reduction landed at this boundary."""
        return self._squares.get(index)

    def squares(self) -> list[torch.Tensor] | None:
        """Per unit its squared norm (units no reduction reached this step, zeroed since, are
        read now); None when this boundary took none."""
        if not self._squares:
            return None
        device = self.flat.device  # (taken on the compute device or the host: one device to sum on)
        return [(self._squares[i] if i in self._squares else squared_norm(u.grad)).to(device)
                for i, u in enumerate(self.flat.units)]

    def stop(self) -> None:
        """The step consumed them (or was cancelled): none is taken until the next boundary."""
        self._unsubscribe()
        self._squares = {}


def scale_gradients(grads: list[torch.Tensor], clip: torch.Tensor | None) -> None:
    """Multiply by the clip coefficient (clip_grad_norm_'s factor), if clipping is on."""
    if clip is not None:
        for g in grads:
            g.mul_(clip)


def restore_masters(flat: "FlatParameters", optimizer: torch.optim.Optimizer, state: dict) -> None:
    """A checkpoint's masters copied in place (the optimizer holds views of them) and its
    optimizer state loaded; then the masters published and the gradients zeroed."""
    with torch.no_grad():
        for u, master in zip(flat.units, state["masters"]):
            u.master.copy_(master)
    optimizer.load_state_dict(state["optimizer"])
    flat.publish_masters()
    flat.zero_grads()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of a torch optimizer's per-element state (Adam's moments; scalar step counts not
    included)."""
    return sum(t.numel() * t.element_size() for state in optimizer.state.values()
               for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """The schedule's rate for this update, in every group (as LambdaLR would set it)."""
    for group in optimizer.param_groups:
        group["lr"] = lr


class GroupSchedule:
    """Who sets each update's hyper-parameters on the optimizer a form steps.

    * Default path (holder None): the engine's rate of config.schedule, passed to step(), is
      set into every group (set_learning_rate).
    * Client path: the groups keep their own hyper-parameters, changed only by the client's
      lr_scheduler, applied to ``holder`` and stepped once after each update applied (never
      for an fp16 step skipped on overflow: step() is not called then). The holder is the
      optimizer the form steps, or a stand-in (ClientOptimizer.stand_in) for forms whose
      update runs on another thread or outside torch: apply() copies its hyper-parameters
      onto the stepped optimizer before each update, so a scheduler never writes what a
      running update reads. An optimizer instance the user gave shows the holder's groups
      and, without an lr_scheduler, passes on what the user sets on it (InstanceView).
    """

    def __init__(self, holder: torch.optim.Optimizer | None = None,
                 lr_scheduler: "SchedulerFactory | None" = None, stand_in: bool = False,
                 instance: InstanceView | None = None):
        self.holder = holder
        self.stand_in = stand_in
        """The holder is a stand-in, not the optimizer the form steps."""
        self.scheduler = None
        if holder is not None and lr_scheduler is not None:
            self.scheduler = lr_scheduler(holder)
            if not (callable(getattr(self.scheduler, "step", None))
                    and callable(getattr(self.scheduler, "state_dict", None))):
                raise TypeError(f"lr_scheduler built a {type(self.scheduler).__name__}; expected a "
                                f"torch.optim.lr_scheduler.LRScheduler (step(), state_dict())")
        self.instance = instance
        """The optimizer instance the user gave wrap(), which shows the holder's groups and
        whose changes the holder takes (update/instance_view.py); None without one."""
        self.changes_taken = 0
        """How many times the holder took changes the user made on their instance: a form whose
        update began before step() compares it to know that update's rates are stale."""
        self._show()

    @classmethod
    def of(cls, client: "ClientOptimizer | None", optimizer: torch.optim.Optimizer | None = None) -> "GroupSchedule":
        """The default path's (client None), or the client's on the optimizer the form steps
        on this thread, or with none given on a stand-in (ClientOptimizer.stand_in)."""
        if client is None:
            return cls()
        stand_in = optimizer is None
        instance = None if client.instance_groups is None else InstanceView(client.instance_groups, client.name)
        return cls(client.stand_in() if stand_in else optimizer, client.lr_scheduler, stand_in=stand_in,
                   instance=instance)

    def current(self) -> torch.optim.Optimizer | None:
        """The holder, once it took what the user changed on their instance (None on the default path)."""
        if self.instance is not None and self.instance.take(self.holder.param_groups,
                                                            scheduled=self.scheduler is not None):
            self.changes_taken += 1
        return self.holder

    def _show(self) -> None:
        if self.instance is not None:
            self.instance.show(self.holder.param_groups)

    def learning_rate(self) -> float | None:
        """The rate of the next update (first group); None on the default path."""
        holder = self.current()
        return None if holder is None else float(holder.param_groups[0]["lr"])

    def apply(self, optimizer: torch.optim.Optimizer, lr: float) -> None:
        """Before an update: the default path's rate into every group, or the stand-in's
        hyper-parameters onto the optimizer (nothing when the holder is that optimizer)."""
        holder = self.current()
        if holder is None:
            set_learning_rate(optimizer, lr)
        elif self.stand_in:
            for group, scheduled in zip(optimizer.param_groups, holder.param_groups, strict=True):
                group.update(group_options(scheduled))

    def advance(self) -> None:
        """After an update was applied: the scheduler's next rates."""
        if self.scheduler is None:
            return
        if self.stand_in:
            # The stand-in holds only zero-size tensors without gradients, so its step()
            # changes nothing; it tells torch's scheduler that the optimizer stepped first.
            self.holder.step()
        self.scheduler.step()
        self._show()

    def fast_forward(self, updates: int) -> None:
        """Where the scheduler would be after ``updates`` updates applied since it was built: a
        run moved from another framework (tiertrain/state/foreign.py) continues its schedule
        where that run's left it, not from its first step."""
        if self.scheduler is None:
            return
        with warnings.catch_warnings():  # (torch's, when the holder itself never stepped yet)
            warnings.filterwarnings("ignore", message=r"Detected call of `lr_scheduler.step\(\)` before")
            for _ in range(updates):
                self.advance()

    def state_dict(self) -> dict | None:
        """Each group's hyper-parameters and the scheduler's state (None on the default path)."""
        if self.holder is None:
            return None
        return {"groups": [group_options(g) for g in self.holder.param_groups],
                "scheduler": None if self.scheduler is None else self.scheduler.state_dict()}

    def load_state_dict(self, state: dict | None) -> None:
        """Restore what state_dict saved; a checkpoint of the other path is refused (its
        rates would silently differ from the ones this run schedules)."""
        if (state is None) != (self.holder is None):
            raise CheckpointError("the checkpoint was saved " + ("without" if state is None else "with")
                             + " a client optimizer or lr_scheduler (wrap(optimizer=, param_groups=, lr_scheduler=)) "
                             + "and this engine " + ("has one" if state is None else "has none") + ": build it as "
                             + "the saving run did")
        if state is None:
            return
        if len(state["groups"]) != len(self.holder.param_groups):
            raise CheckpointError(f"the checkpoint's optimizer has {len(state['groups'])} param groups, this one "
                             f"{len(self.holder.param_groups)}: give the same param_groups as the saving run")
        for group, saved in zip(self.holder.param_groups, state["groups"]):
            group.update(saved)
        if (state["scheduler"] is None) != (self.scheduler is None):
            raise CheckpointError("the checkpoint was saved " + ("without" if state["scheduler"] is None else "with")
                             + " an lr_scheduler and this engine " + ("has one" if self.scheduler else "has none"))
        if self.scheduler is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._show()


class OptimizerUpdate(ABC):
    """One form of the optimizer step over this rank's flat shards; see the module docstring."""

    state_format: StateFormat = FormOwnState()
    """The format of this form's state_dict in a checkpoint (update/state_format.py), which
    tiertrain/state/ reads and reshards by; a checkpoint loads as it is into a form of the
    same format. The default, the form's own state, loads only at the layout it was saved at."""

    publishes_in_step: bool = True
    """Whether the updated parameters are in the compute shards when step() returns (the
    engine may then start reading the next forward's shards)."""

    last_overlapped_step: dict | None = None
    """Progress of the last step that overlapped backward when step() began (NVMe); else None."""

    unpublished: bool = False
    """Whether the masters hold an update the compute shards do not hold yet, by design (the
    delayed update between its landing and its publish): only then do they differ."""

    def __init__(self, flat: "FlatParameters", config: "Config", lazy_zero: bool):
        self.flat = flat
        self.config = config
        self.lazy_zero = lazy_zero
        """The reducer overwrites each gradient at its next reduction: zeroing only marks them."""

    def own_learning_rate(self) -> float | None:
        """The rate of the next update when the form's own schedule sets it (a client
        optimizer or lr_scheduler: its first group's); None: the engine's config.schedule
        does, and passes it to before_backward() and step()."""
        return None

    # -- the step ------------------------------------------------------------------------

    landing_norms: LandingNorms | None = None
    """The gradient norms taken during backward as each unit's reduction lands (a form that
    takes them sets it; the factory builds it where valid), or None: in the step."""

    def before_backward(self, boundary: bool, lr: float) -> None:
        """A micro-batch's backward starts; boundary: the last of this step, whose gradient
        reductions complete the gradients; lr: the rate this step's update will use."""
        if self.landing_norms is not None:
            self.landing_norms.begin(boundary)

    def before_step(self) -> None:
        """step() begins (every rank), before the gradient reductions are waited on."""

    @abstractmethod
    def step(self, grads: list[torch.Tensor], clip: torch.Tensor | None, lr: float, step: int) -> None:
        """Apply update number `step` from the reduced gradient shards (scaled by clip when
        not None) at learning rate lr; leave the gradients zeroed (or marked stale)."""

    def cancel(self) -> None:
        """Undo work started ahead of step() that step() will not commit."""
        self.norms_consumed()

    def norms_consumed(self) -> None:
        """The landing norms of this boundary were used (or will not be): stop taking them."""
        if self.landing_norms is not None:
            self.landing_norms.stop()

    def grad_squares(self) -> list[torch.Tensor] | None:
        """Per unit (in flat.units order) the squared L2 norm of its reduced gradient shard,
        taken before the form freed the shard (the NVMe step in place) or as it landed
        (landing_norms); None: the gradients are all there to read."""
        return None if self.landing_norms is None else self.landing_norms.squares()

    unchanged: frozenset[str] = frozenset()
    """Parameters the next step() leaves unchanged, optimizer state included (see
    leave_unchanged)."""

    def leave_unchanged(self, names: frozenset[str]) -> None:
        """Before step(): these parameters had no gradient on any rank in this step (an expert
        no token was routed to). torch's optimizers skip a parameter whose .grad is None: no
        update, no weight decay, no moment decay, no step count; the next step() must too."""
        self.unchanged = names

    def publish_and_reset(self, sources: dict | None = None) -> None:
        """The updated masters into the compute shards (all-gather at stages 1-2, left running
        with zero.overlap_param_gather), then the gradients zeroed for the next step.
        sources: as FlatParameters.publish_masters takes them."""
        self.flat.publish_masters(in_background=self.config.zero.overlap_param_gather, sources=sources or {})
        self.flat.zero_grads(lazy=self.lazy_zero)

    # -- outside the step ----------------------------------------------------------------

    def settle(self, collective: bool) -> None:
        """Wait for an update still running; collective=True (every rank calls it): a failure
        on any rank is raised on all."""

    def flush(self) -> None:
        """Collective: settle and publish, so the compute shards hold the newest parameters."""

    @abstractmethod
    def masters(self) -> list[torch.Tensor]:
        """This rank's fp32 master shard of every unit (after settle())."""

    def write_masters(self, edited: list[torch.Tensor | None]) -> None:
        """Edited shard values (None: unit unchanged) that flat.write_shard could not reach."""

    @abstractmethod
    def memory(self) -> UpdateMemory:
        """What this form holds (optimizer state, gradient copies), by tier."""

    @abstractmethod
    def state_dict(self) -> dict:
        """Masters and optimizer state of this rank: a checkpoint part."""

    @abstractmethod
    def load_state_dict(self, state: dict) -> None:
        """Restore masters and optimizer state, then publish the masters (collective)."""

    def close(self) -> None:
        """Finish and stop whatever runs in the background."""
