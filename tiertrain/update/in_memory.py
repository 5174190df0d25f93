"""The optimizer step in memory: torch's AdamW (or the client's optimizer, see
tiertrain/optim.py) over views of this rank's fp32 master shards, on the device or the CPU
tier (ZeRO stages 0-3; ZeRO-Offload with offload_optimizer=cpu)."""
from __future__ import annotations

from typing import Callable

from .host_adamw import HostAdamW, KernelUnavailable, warn_unavailable
from .protocol import (SLOT_NAME, GroupSchedule, LandingNorms, OptimizerUpdate, UpdateMemory, gradients_hidden,
                       optimizer_state_bytes, piece_of, restore_masters, scale_gradients, shard_optimizer)
from .state_format import TorchOptimizerState

class InMemoryUpdate(OptimizerUpdate):
    """AdamW (torch, fused kernel by default), or the client's optimizer and lr_scheduler,
    stepping the flat masters in place."""

    state_format = TorchOptimizerState()

    def __init__(self, flat, config, lazy_zero: bool, client=None, landing_norms: LandingNorms | None = None):
        super().__init__(flat, config, lazy_zero)
        self.landing_norms = landing_norms
        self.optimizer = shard_optimizer(flat, [u.master for u in flat.units], [u.grad for u in flat.units],
                                         config, client)
        self.schedule = GroupSchedule.of(client, self.optimizer)
        self.host_pass = chosen_host_pass(config, client, flat.placement.offload_optimizer,
                                          lambda: host_pass(flat, self.optimizer, "optimizer.impl=compiled"))
        """The compiled AdamW + clip + cast pass, when optimizer.impl chose it; else None."""
        self.host_pass_writes = {} if self.host_pass is None else pass_writes(flat)
        """The units whose compute shards the compiled pass writes (or sends to the device), as
        publish_masters' sources (None: the shard holds its values already)."""

    def own_learning_rate(self):
        return self.schedule.learning_rate()

    def step(self, grads, clip, lr, step):
        self.schedule.apply(self.optimizer, lr)
        if self.host_pass is not None:
            self.flat.wait_gathers()  # (the pass may send into shards an all-gather still reads)
            unchanged = self.unchanged
            self.host_pass.step(clip, skip=lambda p: getattr(p, SLOT_NAME) in unchanged)
            sources = self.host_pass_writes
        else:
            scale_gradients(grads, clip)
            with gradients_hidden(self.optimizer, self.unchanged):
                self.optimizer.step()
            sources = {}
        self.unchanged = frozenset()
        self.norms_consumed()
        self.schedule.advance()
        self.publish_and_reset(sources)

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


def chosen_host_pass(config, client, cpu_tier: bool, build: Callable[[], HostAdamW]) -> HostAdamW | None:
    """The compiled pass (``build()``) where optimizer.impl asks for it (compiled), or where auto
    chooses it: the default AdamW on the CPU tier (``cpu_tier``; it builds in ~0.3 s once per
    host and beats torch's fused step with its separate clip and cast at every size:
    bench/results/cpu_step.md). Unavailable under auto: said, and torch's fused step runs instead."""
    impl = config.optimizer.impl
    if impl == "auto":
        if client is not None or not cpu_tier:
            return None
    elif impl != "compiled":
        return None
    if client is not None:
        raise ValueError("optimizer.impl=compiled is the default AdamW's kernel; a client optimizer "
                         "(wrap(optimizer=...)) steps itself: leave optimizer.impl at auto")
    try:
        return build()
    except KernelUnavailable as e:
        if impl == "compiled":
            raise
        warn_unavailable(e)
        return None


def pass_writes(flat) -> dict[int, None]:
    """publish_masters' sources for the units whose compute shards the pass writes in host
    memory or sends to the accelerator: None, the shard holds its values already."""
    return {u.unit.index: None for u in flat.units
            if flat.host_compute_shard(u.unit.index) is not None or flat.uploaded_shard(u.unit.index) is not None}


def host_pass(flat, optimizer, who: str) -> HostAdamW:
    """The compiled pass over the optimizer's pieces, each writing its unit's host compute
    shard where there is one, or sending its values to the unit's shard on the accelerator
    (who: the setting that asks for it, for errors)."""
    return HostAdamW(optimizer, lambda piece: piece_of(piece, flat.host_compute_shard), who,
                     upload=PieceUpload(flat))


class PieceUpload:
    """The pass's upload (update/host_adamw.py's Upload): a piece's target is its slice of the
    unit's shard on the accelerator (FlatParameters.uploaded_shard), sent by flat.upload."""

    def __init__(self, flat):
        self.flat = flat
        self.chunks, self.send, self.finish = flat.upload.chunks, flat.upload.send, flat.upload.finish

    def target_of(self, piece):
        return piece_of(piece, self.flat.uploaded_shard)
