"""Where partitioned units' parameter shards live between uses: the parameter tier of
ZeRO-Infinity (§5), one store per tier, chosen once from the placement.

A stage-3 unit's compute-dtype shard is read by each all-gather (gather before use) and
rewritten after each optimizer step. The stores differ in where its values sit and how they
reach the all-gather:

* :class:`DeviceShards`: in device memory; the all-gather sends the shard itself;
* :class:`HostShards`: in (pinned) CPU memory; each gather first copies it to the device
  (ZeRO-Infinity's CPU→device step) on the device's copy stream, started ahead of use by
  :meth:`stage` so that the copy of unit i+2 overlaps the compute of unit i;
* :class:`NVMeShards`: in one swap file per unit (through a TensorSwapper); the shard tensor
  keeps no storage. Each gather reads the file into a host staging tensor (NVMe→CPU, started
  ahead of use by :meth:`prefetch`) and copies that to the device (CPU→device, when the
  gather needs it); a write ("p swap" of ZeRO-Infinity §6) goes out asynchronously until
  :meth:`wait_writes`.

:meth:`gather_input` returns a :class:`~tiertrain.device.Transfer`: the all-gather waits for
it before reading its input (tiertrain/device.py; on the CPU the wait is the deferred-copy
harness's check).

Resident units (stages 0-2, stage-3 persistent parameters) never use a store: their shard is
a view of the unit's full buffer on the device.
"""
from __future__ import annotations

import torch

from ..device import Copy, DeviceStreams, Transfer
from ..tiers import Tier


class DeviceShards:
    """Shards in device memory."""

    tier = Tier.DEVICE

    def __init__(self, placement, dtype: torch.dtype, streams: DeviceStreams):
        self.placement = placement
        self.dtype = dtype
        self.streams = streams

    def allocate(self, numel: int) -> torch.Tensor:
        """A new shard tensor on this tier."""
        return self.placement.empty(numel, self.dtype, self.placement.param_shards)

    def write(self, index: int, shard: torch.Tensor, values: torch.Tensor) -> None:
        """Store values as unit index's shard (shard: the unit's shard tensor)."""
        if values is not shard:
            shard.copy_(values)

    def read(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """A copy of unit index's stored shard values."""
        return shard.detach().clone()

    def gather_input(self, index: int, shard: torch.Tensor) -> Transfer:
        """Unit index's shard on the compute device, as the all-gather's input (wait for it)."""
        return Transfer(shard, Copy.PARAM_TO_DEVICE, self.streams)

    def prefetch(self, indices) -> None:
        """Start bringing these units' shards closer (a hint)."""

    def stage(self, indices, shards) -> None:
        """Start copying these units' shards (shards: index → shard tensor) to the device
        (a hint, for units gathered soon)."""

    def drop_staged(self) -> None:
        """Forget the copies stage() started (before the shards change)."""

    def done_with_input(self, tensor: torch.Tensor) -> None:
        """The all-gather that read gather_input's tensor has completed (the store may reuse it)."""

    def wait_writes(self) -> None:
        """Complete the writes in flight."""


class HostShards(DeviceShards):
    """Shards in CPU memory, pinned when the device is an accelerator; copied to the device per
    gather, on the copy stream, ahead of use when staged."""

    tier = Tier.CPU

    def __init__(self, placement, dtype, streams):
        super().__init__(placement, dtype, streams)
        self._staged: dict[int, Transfer] = {}  # copies to the device started by stage()

    def gather_input(self, index, shard):
        staged = self._staged.pop(index, None)
        return staged if staged is not None else self.streams.to_device(shard, Copy.PARAM_TO_DEVICE)

    def stage(self, indices, shards):
        for index in indices:
            if index not in self._staged:
                self._staged[index] = self.streams.to_device(shards[index], Copy.PARAM_TO_DEVICE)

    def drop_staged(self):
        self._staged.clear()

    def write(self, index, shard, values):
        self._staged.pop(index, None)  # (a copy of the values before this write)
        super().write(index, shard, values)


class NVMeShards(DeviceShards):
    """Shards in swap files, one per unit; the shard tensors hold no storage."""

    tier = Tier.NVME

    KEEP_STAGING = 2
    """Staging tensors of each size kept for reuse once their all-gather is done."""

    def __init__(self, placement, dtype, streams, swapper):
        super().__init__(placement, dtype, streams)
        self.swapper = swapper
        self._writes = []  # swap-outs in flight
        # Host staging tensors of the gathers' reads, reused: a shard is tens to hundreds of MB,
        # above what the allocator keeps, so a new tensor per read would fault in every page
        # again (a copy of 160 MB into fresh pages ran at 1.6 GB/s here, into reused ones at
        # 8.7: bench/results/scale.md, "CPU per byte").
        self._spare: dict[int, list[torch.Tensor]] = {}
        self._lent: set[int] = set()  # ids of staging tensors lent to an all-gather
        self.staging_reused = 0
        """Gathers whose read landed in a reused staging tensor (a counter for tests and benches)."""

    @staticmethod
    def _key(index: int) -> str:
        return f"param_shard{index}"

    def write(self, index, shard, values):
        self._writes.append(self.swapper.swap_out(self._key(index), values.to(self.dtype)))
        shard.untyped_storage().resize_(0)

    def read(self, index, shard):
        staged = self.placement.empty(shard.numel(), self.dtype, self.placement.host)
        return self.swapper.swap_in(self._key(index), staged).wait()

    def gather_input(self, index, shard):
        spare = self._spare.get(shard.numel())
        if spare:
            staged = spare.pop()
            self.staging_reused += 1
        else:
            staged = self.placement.empty(shard.numel(), self.dtype, self.placement.host)
        self.swapper.swap_in(self._key(index), staged).wait()
        transfer = self.streams.to_device(staged, Copy.PARAM_TO_DEVICE)
        if transfer.value is staged:  # (the compute device is the host: the gather reads it)
            self._lent.add(id(staged))
        return transfer

    def done_with_input(self, tensor):
        if id(tensor) in self._lent:
            self._lent.discard(id(tensor))
            spare = self._spare.setdefault(tensor.numel(), [])
            if len(spare) < self.KEEP_STAGING:
                spare.append(tensor)

    def prefetch(self, indices):
        keys = [self._key(i) for i in indices]
        if keys:
            self.swapper.prefetch(keys)

    def wait_writes(self):
        """Wait for the shard writes in flight; raises the first IO error (naming the file)."""
        writes, self._writes = self._writes, []
        for handle in writes:
            handle.wait()


def shard_store(placement, dtype: torch.dtype, streams: DeviceStreams, swapper=None) -> DeviceShards:
    """The store of placement.param_tier."""
    if placement.param_tier == Tier.NVME:
        if swapper is None:
            raise ValueError("parameters on the nvme tier need a TensorSwapper")
        return NVMeShards(placement, dtype, streams, swapper)
    kind = HostShards if placement.param_tier == Tier.CPU else DeviceShards
    return kind(placement, dtype, streams)
