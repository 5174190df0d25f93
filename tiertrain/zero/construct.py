"""Building a model directly in partitioned form (ZeRO-Infinity §6 "ease of use": parameters
are partitioned as modules are constructed, so a model that would not fit in one rank's
memory whole can still be built).

Inside ``partitioned_init(topology)``, each module's parameters are cut to this rank's
1/dp shard as soon as that module is attached to its parent (its own ``__init__``, which
initialises them, has returned by then); parameters of the outermost module are cut when
the context exits. Peak memory is therefore the largest single module's parameters plus
the shards, and the random draws are exactly those of an ordinary construction, so the
same seed gives the same weights. Models that initialise their parameters from the top
level after construction (``self.apply(init)`` at the end of ``__init__``) would
initialise shards instead: build those normally.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..comm import Collectives
from ..topology import Topology

FULL_SHAPE = "tiertrain_full_shape"


def full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's logical shape, also when it holds only its shard."""
    return getattr(p, FULL_SHAPE, p.shape)


def is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, FULL_SHAPE)


def forget_partition(p: torch.Tensor) -> None:
    """Drop the partitioned_init mark once the engine's flat buffers hold the shard."""
    if is_partitioned(p):
        delattr(p, FULL_SHAPE)


class partitioned_init:
    """Context manager: parameters created inside keep only this rank's shard."""

    def __init__(self, topology: Topology):
        self.comm = Collectives(topology.group("dp"))
        self._created: list[nn.Parameter] = []
        self._handles = []

    def __enter__(self) -> "partitioned_init":
        self._handles = [
            register_module_parameter_registration_hook(self._on_parameter),
            register_module_module_registration_hook(self._on_submodule),
        ]
        return self

    def __exit__(self, *exc) -> None:
        for h in self._handles:
            h.remove()
        if exc[0] is None:
            for p in self._created:
                self._partition(p)
        self._created = []

    def _on_parameter(self, module, name, param):
        if param is not None:
            self._created.append(param)

    def _on_submodule(self, module, name, submodule):
        if submodule is not None:
            for p in submodule.parameters():
                self._partition(p)

    def _partition(self, p: nn.Parameter) -> None:
        if is_partitioned(p):
            return
        dp, rank = self.comm.size, self.comm.rank
        flat = p.detach().reshape(-1)
        per_rank = -(-flat.numel() // dp)
        lo, hi = rank * per_rank, min((rank + 1) * per_rank, flat.numel())
        shard = torch.zeros(per_rank, dtype=p.dtype, device=p.device)
        if lo < hi:
            shard[: hi - lo].copy_(flat[lo:hi])
        setattr(p, FULL_SHAPE, p.shape)
        p.data = shard


def gather_partitioned(p: nn.Parameter, comm: Collectives) -> torch.Tensor:
    """The full value of a parameter built under partitioned_init (one all-gather)."""
    shape = full_shape(p)
    full = torch.empty(p.numel() * comm.size, dtype=p.dtype, device=p.device)
    comm.all_gather(full, p.detach())
    return full[: shape.numel()].view(shape)
