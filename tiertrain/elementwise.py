"""Optimizer updates a chunk stream can apply: those whose new value of each element depends
only on that element's value, gradient and at most two state values. ZeRO-Infinity's NVMe
optimizer step (update/nvme/optimizer.py) keeps exactly that per element on disk (the fp32
master and two state slots) and streams it through a few buffers, so any such rule runs from
NVMe; an optimizer that looks across elements (LBFGS, Adafactor's factored moments, Muon's
orthogonalisation) cannot.

Each rule calls torch's own functional update (``torch.optim.adamw.adamw``,
``torch.optim.sgd.sgd``, public since torch 2.0), so an update from NVMe is bit for bit the
in-memory torch optimizer's on the same pieces. :func:`streamed_update` reads the rule, the
rate and the weight decays from a client optimizer (tiertrain/optim.py ClientOptimizer's
stand-in, which its lr_scheduler drives), so a scheduler that changes betas or momentum
during training changes the streamed rule too.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.optim.adamw import adamw as functional_adamw
from torch.optim.sgd import sgd as functional_sgd

from .config import ConfigError

Tensors = Sequence[torch.Tensor]


class ElementwiseRule(ABC):
    """One optimizer's update of pieces of parameters, in place, with its per-element state in
    two slots (``first``, ``second``: fp32, the pieces' sizes, zero before the first step)."""

    @abstractmethod
    def apply(self, params: Tensors, grads: Tensors, first: Tensors, second: Tensors, steps: Sequence[int],
              lr: float, weight_decay: float) -> None:
        """Update params from grads; steps: each tensor's update number (1 for its first: a
        parameter skipped in a step, having no gradient on any rank, is one update behind)."""

    @property
    @abstractmethod
    def state_names(self) -> tuple[str, ...]:
        """What the state slots it uses hold, in slot order, by torch's optimizer's names: a
        checkpoint records them (update/state_format.py NVMeStreamState)."""


@dataclass(frozen=True)
class AdamWRule(ElementwiseRule):
    """torch's fused CPU AdamW (decoupled weight decay): exp_avg and exp_avg_sq in the slots.
    Pieces cut inside a parameter must be cut at multiples of the kernel's vector width from
    the parameter's start to round as the whole would (update/nvme/plan.py ALIGN_ELEMS)."""

    betas: tuple[float, float]
    eps: float

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("exp_avg", "exp_avg_sq")

    def apply(self, params, grads, first, second, steps, lr, weight_decay):
        functional_adamw(list(params), list(grads), list(first), list(second), [],
                         [torch.tensor(float(step - 1)) for step in steps], fused=True, amsgrad=False,
                         beta1=self.betas[0], beta2=self.betas[1], lr=lr, weight_decay=weight_decay, eps=self.eps,
                         maximize=False)


@dataclass(frozen=True)
class SGDRule(ElementwiseRule):
    """torch's SGD (single-tensor kernel, as torch.optim.SGD runs on CPU), momentum buffer in
    the first slot; the second is unused. torch starts the buffer as a copy of the first
    gradient (not momentum·0 + (1 - dampening)·g), so step 1 builds it that way."""

    momentum: float
    dampening: float
    nesterov: bool

    @property
    def state_names(self) -> tuple[str, ...]:
        return ("momentum_buffer",)  # (the second slot is unused)

    def apply(self, params, grads, first, second, steps, lr, weight_decay):
        buffers = [slot if step > 1 else None for slot, step in zip(first, steps)]
        functional_sgd(list(params), list(grads), buffers, foreach=False, weight_decay=weight_decay,
                       momentum=self.momentum, lr=lr, dampening=self.dampening, nesterov=self.nesterov,
                       maximize=False)
        if self.momentum:
            for slot, buffer, step in zip(first, buffers, steps):
                if step == 1:  # (torch made a new buffer)
                    slot.copy_(buffer)


@dataclass(frozen=True)
class StreamedUpdate:
    """What the NVMe tier streams for one update of a client optimizer."""

    rule: ElementwiseRule
    lr: float
    """The rate of every group (the stream steps all pieces at one rate)."""
    weight_decays: tuple[float, ...]
    """Each param group's weight decay, in group order."""


STREAMED = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
"""The client optimizers the NVMe tier streams: exactly these classes (a subclass may change
the update)."""


def _shared(optimizer: torch.optim.Optimizer, keys: tuple[str, ...]) -> dict:
    """The values of keys, which every param group must share (a ConfigError names the groups
    that differ)."""
    groups = optimizer.param_groups
    first = groups[0]
    for i, group in enumerate(groups[1:], 1):
        for key in keys:
            if group.get(key) != first.get(key):
                raise ConfigError(f"zero.offload_optimizer=nvme steps every param group with one {key}; "
                                  f"{type(optimizer).__name__} group 0 has {key}={first.get(key)!r}, group {i} "
                                  f"{key}={group.get(key)!r}: give every group the same {key}, or use "
                                  f"zero.offload_optimizer: device or cpu")
    return {key: first.get(key) for key in keys}


def streamed_update(optimizer: torch.optim.Optimizer) -> StreamedUpdate:
    """The rule, rate and weight decays of optimizer's next update, once it is checked to be
    one the NVMe tier streams: Adam/AdamW (no amsgrad; Adam's decay only decoupled or zero) or
    SGD; no maximize; one lr and one set of rule hyper-parameters in every group. A ConfigError
    names what is not and the tiers that run it."""
    name = type(optimizer).__name__
    if type(optimizer) not in STREAMED:
        raise ConfigError(f"zero.offload_optimizer=nvme streams elementwise optimizers it knows (AdamW, Adam, SGD); "
                          f"{name} runs with zero.offload_optimizer: device or cpu")
    if type(optimizer) is torch.optim.SGD:
        shared = _shared(optimizer, ("lr", "momentum", "dampening", "nesterov"))
        rule: ElementwiseRule = SGDRule(float(shared["momentum"]), float(shared["dampening"]),
                                        bool(shared["nesterov"]))
    else:
        shared = _shared(optimizer, ("lr", "betas", "eps"))
        rule = AdamWRule(tuple(float(b) for b in shared["betas"]), float(shared["eps"]))
    decays = []
    for i, group in enumerate(optimizer.param_groups):
        for flag in ("amsgrad", "maximize"):
            if group.get(flag, False):
                raise ConfigError(f"zero.offload_optimizer=nvme does not stream {flag}; {name} param group {i} has "
                                  f"{flag}=True: set it False, or use zero.offload_optimizer: device or cpu")
        decay = float(group.get("weight_decay", 0.0))
        if (decay and type(optimizer) is torch.optim.Adam
                and not group.get("decoupled_weight_decay", False)):
            raise ConfigError(f"zero.offload_optimizer=nvme decays Adam's weights decoupled (AdamW); {name} param "
                              f"group {i} has weight_decay={decay} as an L2 penalty: use torch.optim.AdamW or "
                              f"weight_decay=0, or zero.offload_optimizer: device or cpu")
        decays.append(decay)
    return StreamedUpdate(rule, float(shared["lr"]), tuple(decays))
