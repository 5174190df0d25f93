"""The all-gather of updated parameters after a step, overlapped with the next forward.

At stages 1 and 2 (and for stage 3's persistent parameters) every rank updates only its
shard, then all-gathers the updated parameters (ZeRO §5.1). Waiting for that gather at the
end of ``step()`` leaves the compute idle while it runs. With ``zero.overlap_param_gather``
the engine launches every unit's gather when the step ends and returns at once; the next
forward then waits for a unit only when an operation first touches one of its parameters
(the idea of Megatron-LM's ``overlap_param_gather``, which waits in module pre-hooks).

Waiting per operation rather than per module makes the overlap exact for any forward: a
parent module that reads a child's weight directly, a weight tied across modules, a
functional call — every torch operation passes through :class:`WaitForParameters`, which
looks up the unit of each parameter among its arguments and waits for that unit's gather
if it is still in flight. Every other entry point of the engine (backward, step, state
dicts, checkpoints, ``gathered_parameters``) first waits for all of them, and so does the
model's ``state_dict()``. Only code that reads a parameter outside the engine between
``step()`` and the next forward must call ``engine.wait_for_parameters()`` first.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from .flat import FlatParameters


def _tensors(values: Any):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


class WaitForParameters(TorchFunctionMode):
    """A torch function mode, active during a forward that runs while parameter gathers
    are in flight: an operation whose arguments include a parameter of a unit still being
    gathered first waits for that unit (FlatParameters.gather waits its pending work)."""

    def __init__(self, flat: FlatParameters):
        super().__init__()
        self.flat = flat

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.flat.gathers_in_flight:
            for t in _tensors((*args, *kwargs.values())):
                slot = self.flat.slot_of.get(t)  # (tensors hash by identity: only parameters match)
                if slot is not None and self.flat.units[slot[0]].pending is not None:
                    self.flat.gather(slot[0])
        return func(*args, **kwargs)
