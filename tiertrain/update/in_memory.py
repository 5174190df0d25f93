"""The optimizer step in memory: torch's AdamW over views of this rank's fp32 master shards,
on the device or the CPU tier (ZeRO stages 0-3; ZeRO-Offload with offload_optimizer=cpu)."""
from __future__ import annotations

from ..optim import build_adamw
from .protocol import (OptimizerUpdate, UpdateMemory, optimizer_state_bytes, restore_masters, scale_gradients,
                       set_learning_rate, shard_param_groups)


class InMemoryUpdate(OptimizerUpdate):
    """AdamW (torch, fused kernel by default) stepping the flat masters in place."""

    def __init__(self, flat, config, lazy_zero: bool):
        super().__init__(flat, config, lazy_zero)
        groups = shard_param_groups(flat, [u.master for u in flat.units], [u.grad for u in flat.units],
                                    config.optimizer.weight_decay)
        self.optimizer = build_adamw(groups, config.optimizer)

    def step(self, grads, clip, lr, step):
        scale_gradients(grads, clip)
        set_learning_rate(self.optimizer, lr)
        self.optimizer.step()
        self.publish_and_reset()

    def masters(self):
        return [u.master for u in self.flat.units]

    def memory(self):
        moments = optimizer_state_bytes(self.optimizer)
        return UpdateMemory(optimizer=moments, cpu_tier=moments if self.flat.placement.offload_optimizer else 0)

    def state_dict(self):
        return {"masters": [u.master.detach().clone() for u in self.flat.units],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        restore_masters(self.flat, self.optimizer, state)
