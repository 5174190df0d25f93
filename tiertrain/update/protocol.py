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

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..optim import decays

if TYPE_CHECKING:
    from ..config import Config
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
                       weight_decay: float) -> list[dict]:
    """AdamW groups over this rank's shard of every unit: one tensor per piece of a parameter
    (views of masters[unit], with .grad the same view of grads[unit]), so the update is in
    place on the flat buffers and weight decay follows the parameter (optim.decays)."""
    decay, no_decay = [], []
    for u, master, grad in zip(flat.units, masters, grads):
        for slot, a, b in u.unit.shard_pieces(flat.shard_rank):
            view = master[a:b]
            view.grad = grad[a:b]
            (decay if decays(slot.name, slot.shape) else no_decay).append(view)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]] or [{"params": [masters[0][:0]]}]


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


class OptimizerUpdate(ABC):
    """One form of the optimizer step over this rank's flat shards; see the module docstring."""

    state_format: str = "memory"
    """Recorded in checkpoint fingerprints: a checkpoint loads into a form of the same format."""

    publishes_in_step: bool = True
    """Whether the updated parameters are in the compute shards when step() returns (the
    engine may then start reading the next forward's shards)."""

    last_overlapped_step: dict | None = None
    """Progress of the last step that overlapped backward when step() began (NVMe); else None."""

    def __init__(self, flat: "FlatParameters", config: "Config", lazy_zero: bool):
        self.flat = flat
        self.config = config
        self.lazy_zero = lazy_zero
        """The reducer overwrites each gradient at its next reduction: zeroing only marks them."""

    # -- the step ------------------------------------------------------------------------

    def before_backward(self, boundary: bool, lr: float) -> None:
        """A micro-batch's backward starts; boundary: the last of this step, whose gradient
        reductions complete the gradients; lr: the rate this step's update will use."""

    def before_step(self) -> None:
        """step() begins (every rank), before the gradient reductions are waited on."""

    @abstractmethod
    def step(self, grads: list[torch.Tensor], clip: torch.Tensor | None, lr: float, step: int) -> None:
        """Apply update number `step` from the reduced gradient shards (scaled by clip when
        not None) at learning rate lr; leave the gradients zeroed (or marked stale)."""

    def cancel(self) -> None:
        """Undo work started ahead of step() that step() will not commit."""

    def publish_and_reset(self) -> None:
        """The updated masters into the compute shards (all-gather at stages 1-2, left running
        with zero.overlap_param_gather), then the gradients zeroed for the next step."""
        self.flat.publish_masters(in_background=self.config.zero.overlap_param_gather)
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
