"""A wrapped model's ``p.grad`` between ``engine.backward()`` and ``engine.step()`` fails by name
instead of reading as "no gradient".

The engine takes each gradient out of ``p.grad`` as autograd produces it (the reducer's
post-accumulate hooks) and reduces it into its own flat buffers (ZeRO §5.2: at stages 2-3
only this rank's shard is ever kept). ``p.grad`` is then None, so a loop written for DDP or
FSDP2 that calls ``torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)`` gets a norm of 0
and clips nothing, and a per-layer gradient log skips every layer, both silently. Between a
backward and the next step each trainable parameter's ``.grad`` is therefore a
:class:`HeldGradient`: a tensor of the parameter's shape, dtype and device (one element of
memory, expanded) whose metadata reads pass, and whose every read of values raises
:class:`HeldGradientError` naming the parameter and what does the same inside the engine
(``optimizer.grad_clip``, ``engine.last_grad_norm``). The engine removes them before the
next backward (autograd would add into them) and at ``step()``, which leaves ``.grad`` None,
as ``optimizer.zero_grad()`` does. A ``zero_grad()`` in that window (a loop dropping a batch)
is refused there too: torch would drop the gradients so far, the engine cannot.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from .errors import TiertrainError, parameters_named
from .zero.released import METADATA_READS, called, first_instance

__all__ = ["HeldGradient", "HeldGradientError", "HeldGradients"]


class HeldGradientError(TiertrainError, RuntimeError):
    """A wrapped model's ``p.grad`` was read for its values between ``engine.backward()`` and
    ``engine.step()``: the gradient lives in the engine's reduced shards."""

    exit_code = 1


_REMEDY = ("a wrapped model's gradients live in the engine's flat buffers, reduced across the data-parallel ranks "
           "(at zero.stage 2-3 as this rank's shard only), not in p.grad. For "
           "torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) set optimizer.grad_clip: max_norm instead: "
           "engine.step() clips at the global norm over every shard, as clip_grad_norm_ does, and "
           "engine.last_grad_norm is that norm after the step (the value clip_grad_norm_ returns)")
_ZERO_GRAD_REMEDY = ("in torch that drops the gradients of the backwards so far, but the engine holds them in its flat "
                     "buffers, reduced across the ranks, and would apply them at the next step; it cannot drop them. "
                     "Decide whether a batch counts before engine.backward(loss) (do not call backward on a loss you "
                     "drop), and call zero_grad() only after engine.step(), or not at all: engine.step() leaves every "
                     ".grad None, as zero_grad() does")


class HeldGradient(torch.Tensor):
    """The ``.grad`` of a wrapped model's parameter while the engine holds its gradient (see the
    module docstring). Built by :class:`HeldGradients`, never by the user."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in METADATA_READS:
            return super().__torch_function__(func, types, args, kwargs or {})
        held = first_instance(HeldGradient, args, kwargs)
        name = held.__dict__.get("parameter", "?") if held is not None else "?"
        if func is torch.Tensor.zero_:  # (zero_grad(set_to_none=False))
            raise HeldGradientError(f"zero_() of the gradient (.grad) of parameter {name!r} between engine.backward() "
                                    f"and engine.step() (zero_grad(set_to_none=False) there?): {_ZERO_GRAD_REMEDY}")
        raise HeldGradientError(f"{called(func)} read the gradient (.grad) of parameter {name!r} between "
                                f"engine.backward() and engine.step(), but {_REMEDY}")

    def __repr__(self, *, tensor_contents=None) -> str:
        return (f"HeldGradient({self.__dict__.get('parameter', '?')!r}, shape={tuple(self.shape)}, "
                f"dtype={self.dtype}: held by the engine until engine.step())")

    __str__ = __repr__


class HeldGradients:
    """The held gradients of one engine's trainable parameters ({name: parameter}): put in
    place after each backward (:meth:`install`), taken out before the next and at the step
    (:meth:`remove`)."""

    def __init__(self, params: dict[str, nn.Parameter]):
        self._params = {name: p for name, p in params.items() if p.requires_grad}
        bases: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}
        self._gradients: dict[str, HeldGradient] = {}
        """Each one's placeholder, made once (the engine owns its parameters' shape, dtype and device)."""
        for name, p in self._params.items():
            if (p.dtype, p.device) not in bases:  # (one element per dtype and device, shared: nothing writes it)
                bases[p.dtype, p.device] = torch.zeros((), dtype=p.dtype, device=p.device)
            g = bases[p.dtype, p.device].expand(p.shape).as_subclass(HeldGradient)
            g.__dict__["parameter"] = name
            self._gradients[name] = g
        self.installed = False

    def install(self) -> None:
        """After a backward: every trainable parameter's .grad is its held gradient."""
        for name, p in self._params.items():
            p.grad = self._gradients[name]
        self.installed = True

    def remove(self, check: bool = True) -> None:
        """Before a backward and at the step, and at close (no check): every .grad is None
        again. check: a .grad the loop changed since the backward raises, naming the parameter,
        where the engine would silently do otherwise than torch: set to a tensor of its own (the
        engine never reads .grad: the update would ignore it, and autograd would add the next
        gradient into it), or to None (``optimizer.zero_grad()``, ``model.zero_grad()``: torch
        would drop the gradients so far; the engine holds them in its flat buffers and applies
        them at the next step)."""
        if not self.installed:
            return
        foreign = [name for name, p in self._params.items()
                   if p.grad is not None and not isinstance(p.grad, HeldGradient)]
        if check and foreign:
            raise HeldGradientError(f".grad of {parameters_named(foreign)[0]} was set to a tensor of the loop's own "
                                    f"between engine.backward() and engine.step(), but the engine's update never "
                                    f"reads it: {_REMEDY}")
        cleared = [name for name, p in self._params.items() if p.grad is None]
        if check and cleared:
            raise HeldGradientError(f".grad of {parameters_named(cleared)[0]} was set to None between "
                                    f"engine.backward() and engine.step() (optimizer.zero_grad() or model.zero_grad() "
                                    f"there?): {_ZERO_GRAD_REMEDY}")
        for p in self._params.values():
            p.grad = None
        self.installed = False

