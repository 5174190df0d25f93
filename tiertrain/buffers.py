"""A module's persistent buffers (BatchNorm's running statistics, a step counter) as model
state (issue 34, item 1): a checkpoint part restored on resume and resharded by name, part of
``full_state_dict``, and kept equal over the data-parallel ranks as DDP keeps them
(``broadcast_buffers=True``: rank 0's values before each training forward; under pipeline
parallelism, over each stage's data-parallel ranks before the first forward of each step).

Persistent buffers are those ``module.state_dict()`` holds. Non-persistent ones (rotary
frequencies, cached masks) are derived, never trained, and neither saved nor broadcast.
"""
from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.nn as nn

__all__ = ["ModuleBuffers"]


def _persistent_names(module: nn.Module) -> list[str]:
    """The buffers ``module.state_dict()`` holds, by its names."""
    saved = set(module.state_dict(keep_vars=True))
    return [name for name, _ in module.named_buffers() if name in saved]


class ModuleBuffers:
    """The persistent buffers of this rank's module (or of its pipeline stages, whose names are
    the whole model's), as a checkpoint part (the same on every data-parallel rank while they
    are broadcast). Which buffers is found once; their tensors are looked up at each use (a
    module may replace a buffer's tensor)."""

    def __init__(self, module: nn.Module | list[nn.Module]):
        modules = module if isinstance(module, list) else [module]
        self._where = [(m, name) for m in modules for name in _persistent_names(m)]

    def __bool__(self) -> bool:
        return bool(self._where)

    def named(self) -> dict[str, torch.Tensor]:
        """Every persistent buffer by its state_dict name."""
        return {name: m.get_buffer(name) for m, name in self._where}

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {name: b.detach().clone() for name, b in self.named().items()}

    def load_state_dict(self, state: Any) -> None:
        """ValueError naming the buffers missing from ``state`` or of another shape."""
        own = self.named()
        if not isinstance(state, dict):
            raise ValueError(f"the checkpoint's buffers are {type(state).__name__}, expected {{name: tensor}}")
        missing = sorted(set(own) - set(state))
        if missing:
            raise ValueError(f"the checkpoint holds no value for the buffers {missing[:10]} of this model "
                             f"(it has {sorted(state)[:10]})")
        for name, b in own.items():
            value = state[name]
            if not isinstance(value, torch.Tensor) or tuple(value.shape) != tuple(b.shape):
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
                raise ValueError(f"the checkpoint's buffer {name!r} is {shape}, this model's is {tuple(b.shape)}")
            with torch.no_grad():
                b.copy_(value)

    def absent_from_checkpoint(self, source: str) -> None:
        """A checkpoint saved before buffers were part of it: they keep their current values."""
        if self:
            warnings.warn(f"{source} holds no buffers (saved before tiertrain checkpointed them): "
                          f"{sorted(self.named())[:5]} keep their current values", stacklevel=3)

    def broadcast(self, comm, src_local_rank: int = 0) -> None:
        """Every rank takes rank src_local_rank's values (collective over comm's group), one
        broadcast per dtype of the buffers flattened together."""
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for b in self.named().values():
            by_dtype.setdefault(b.dtype, []).append(b)
        for dtype in sorted(by_dtype, key=str):  # (the same order on every rank)
            tensors = by_dtype[dtype]
            flat = torch.cat([t.detach().reshape(-1) for t in tensors])
            comm.broadcast(flat, src_local_rank)
            offset = 0
            with torch.no_grad():
                for t in tensors:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
