"""What an engine holds on its rank, by kind (``engine.memory_report()``): the bytes of its
parameters, gradients and optimizer state from the flat buffers (zero/flat.py) and the update
form (update/), on which tier they live, the activation checkpoints' peak
(offload/activations.py), frozen parameters, and at stage 3 how the model is cut into units.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .offload.activations import checkpoint_memory

if TYPE_CHECKING:
    from .training_core import TrainingCore


@dataclass
class MemoryReport:
    """Bytes of model state held by this rank, by kind."""

    params: int
    gathered_params: int
    grads: int
    """Gradient shards, with the CPU tier's landing buffers and the device accumulators (zero.accumulate_on_device)."""
    optimizer: int
    cpu_tier: int = 0
    """How many of the bytes above live in the CPU tier (offloaded)."""
    nvme_tier: int = 0
    """How many of the bytes above live in the NVMe tier (swap files)."""
    activation_checkpoints: int = 0
    """Peak bytes of activation checkpoints (saved block inputs) between a forward and its backward; not model state."""
    activation_checkpoints_cpu: int = 0
    """Of activation_checkpoints, the bytes held in the CPU tier (activations.offload=cpu)."""
    frozen_params: int = 0
    """Of params, the bytes of frozen parameters (requires_grad=False): their shards at stage 3."""
    units: int = 0
    """Stage 3: the partitioned units the parameters are gathered by (0 at stages 0-2)."""
    largest_unit_share: float = 0.0
    """Stage 3: the fraction of the model's parameters in the largest unit, gathered whole at once."""
    upload_buffers: int = 0
    """Pinned host chunks through which the CPU tier's step sends updated shards to an accelerator
    (zero/upload.py; allocated at the first step); not model state."""

    @property
    def total(self) -> int:
        return self.params + self.gathered_params + self.grads + self.optimizer


def memory_report_of(engine: "TrainingCore") -> MemoryReport:
    """Bytes of parameters, gradients and optimizer state (fp32 master + Adam moments) on engine's rank."""
    flat = engine.flat.memory()
    extra = engine.update.memory()
    ckpt = checkpoint_memory(engine.module)
    # Frozen parameters outside the flat units (stages 0-2, and small ones at stage 3) are
    # whole on every rank.
    whole_frozen = sum(p.numel() * p.element_size() for p in engine.module.parameters()
                       if not p.requires_grad and p not in engine.flat.unit_of)
    frozen_shards = sum(u.unit.shard_numel * u.full.element_size() for u in engine.flat.frozen_units)
    # The CPU tier's landing buffers for reduced gradients copied without blocking backward
    # (zero/reducer.py's defer_landing): one more gradient shard per unit.
    landing = engine.reducer.landing_bytes
    # zero.accumulate_on_device: every trained unit's whole fp32 gradient on the device, held
    # from a step's first micro-batch to its last (zero/accumulation.py).
    accumulation = engine.plan.accumulation
    accumulators = accumulation.device_bytes if accumulation.on else 0
    return MemoryReport(flat["params"] + whole_frozen, flat["gathered_params"],
                        flat["grads"] + extra.extra_grads + landing + accumulators,
                        flat["master"] + extra.optimizer, cpu_tier=flat["cpu_tier"] + extra.cpu_tier + landing,
                        nvme_tier=flat["nvme_tier"] + extra.nvme_tier,
                        activation_checkpoints=ckpt.peak_bytes, activation_checkpoints_cpu=ckpt.host_peak_bytes,
                        frozen_params=whole_frozen + frozen_shards, upload_buffers=engine.flat.upload.nbytes,
                        **unit_summary(engine))


def unit_summary(engine: "TrainingCore") -> dict:
    """Stage 3's units and the share of the model in the largest (a model cut badly gathers
    most of itself at once, and stage 3 then saves little)."""
    units = [u.unit for u in engine.flat.all_units if not u.unit.resident]
    if not engine.plan.stage.partitions_parameters or not units:
        return {}
    total = sum(u.unit.numel for u in engine.flat.all_units)
    return {"units": len(units), "largest_unit_share": max(u.numel for u in units) / max(total, 1)}
