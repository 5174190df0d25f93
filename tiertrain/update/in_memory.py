"""The optimizer step in memory: torch's AdamW (or the client's optimizer, see
tiertrain/optim.py) over views of this rank's fp32 master shards, on the device or the CPU
tier (ZeRO stages 0-3; ZeRO-Offload with offload_optimizer=cpu)."""
from __future__ import annotations

from .protocol import (GroupSchedule, OptimizerUpdate, UpdateMemory, gradients_hidden, optimizer_state_bytes,
                       restore_masters, scale_gradients, shard_optimizer)


class InMemoryUpdate(OptimizerUpdate):
    """AdamW (torch, fused kernel by default), or the client's optimizer and lr_scheduler,
    stepping the flat masters in place."""

    def __init__(self, flat, config, lazy_zero: bool, client=None):
        super().__init__(flat, config, lazy_zero)
        self.optimizer = shard_optimizer(flat, [u.master for u in flat.units], [u.grad for u in flat.units],
                                         config, client)
        self.schedule = GroupSchedule() if client is None else GroupSchedule(self.optimizer, client.lr_scheduler)

    def own_learning_rate(self):
        return self.schedule.learning_rate()

    def step(self, grads, clip, lr, step):
        scale_gradients(grads, clip)
        self.schedule.apply(self.optimizer, lr)
        with gradients_hidden(self.optimizer, self.unchanged):
            self.optimizer.step()
        self.unchanged = frozenset()
        self.schedule.advance()
        self.publish_and_reset()

    def masters(self):
        return [u.master for u in self.flat.units]

    def memory(self):
        moments = optimizer_state_bytes(self.optimizer)
        return UpdateMemory(optimizer=moments, cpu_tier=moments if self.flat.placement.offload_optimizer else 0)

    def state_dict(self):
        # The live masters, as torch's optimizer.state_dict() hands out its live moments: a
        # checkpoint writes them at once, or copies them first (a background save).
        return {"masters": [u.master.detach() for u in self.flat.units],
                "optimizer": self.optimizer.state_dict(), "schedule": self.schedule.state_dict()}

    def load_state_dict(self, state):
        restore_masters(self.flat, self.optimizer, state)
        self.schedule.load_state_dict(state.get("schedule"))
