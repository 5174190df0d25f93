"""Chooses the optimizer-step form once, from the configuration (tiertrain/update/protocol.py)."""
from __future__ import annotations

import torch.distributed as dist

from ..offload.delayed import DelayedUpdate
from ..offload.nvme_update import NVMeUpdate, OverlappedNVMeUpdate
from .in_memory import InMemoryUpdate
from .protocol import OptimizerUpdate


def build_update(flat, config, topology, reducer, swapper, *, lazy_zero: bool,
                 global_gradient_changes: bool) -> OptimizerUpdate:
    """The form for this configuration:

    * ``zero.offload_optimizer: nvme`` → the NVMe optimizer; overlapped with backward when
      ``zero.overlap_nvme_step`` is set, reductions launch as gradients arrive (lazy_zero) and
      nothing global changes the gradients after their reduction (global_gradient_changes:
      clipping, an fp16 unscale, a tensor-parallel sum of partial gradients);
    * ``zero.delayed_update`` → ZeRO-Offload's one-step delayed update;
    * otherwise torch AdamW in memory (device or CPU tier).
    """
    zc = config.zero
    if zc.offload_optimizer == "nvme":
        if zc.overlap_nvme_step and lazy_zero and not global_gradient_changes:
            return OverlappedNVMeUpdate(flat, config, lazy_zero, swapper, topology.rank, reducer)
        return NVMeUpdate(flat, config, lazy_zero, swapper, topology.rank)
    if zc.delayed_update:
        group = topology.world_group() if dist.is_initialized() else None
        return DelayedUpdate(flat, config, lazy_zero, group, topology.device)
    return InMemoryUpdate(flat, config, lazy_zero)
