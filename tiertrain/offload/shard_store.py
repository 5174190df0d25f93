"""Where partitioned units' parameter shards live between uses: the parameter tier of
ZeRO-Infinity (§5), one store per tier, chosen once from the placement.

A stage-3 unit's compute-dtype shard is read by each all-gather (gather before use) and
rewritten after each optimizer step. The stores differ in where its values sit and how they
reach the all-gather:

* :class:`DeviceShards`: in device memory; the all-gather sends the shard itself;
* :class:`HostShards`: in (pinned) CPU memory; each gather first copies it to the device
  (ZeRO-Infinity's CPU→device step);
* :class:`NVMeShards`: in one swap file per unit (through a TensorSwapper); the shard tensor
  keeps no storage. Each gather reads the file into a host staging tensor (NVMe→CPU, started
  ahead of use by :meth:`prefetch`) and copies that to the device; a write ("p swap" of
  ZeRO-Infinity §6) goes out asynchronously until :meth:`wait_writes`.

Resident units (stages 0-2, stage-3 persistent parameters) never use a store: their shard is
a view of the unit's full buffer on the device.
"""
from __future__ import annotations

import torch

from ..tiers import Tier


class DeviceShards:
    """Shards in device memory."""

    tier = Tier.DEVICE

    def __init__(self, placement, dtype: torch.dtype):
        self.placement = placement
        self.dtype = dtype

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

    def gather_input(self, index: int, shard: torch.Tensor, device: torch.device) -> torch.Tensor:
        """Unit index's shard on the compute device, as the all-gather's input."""
        return shard

    def prefetch(self, indices) -> None:
        """Start bringing these units' shards closer (a hint)."""

    def wait_writes(self) -> None:
        """Complete the writes in flight."""


class HostShards(DeviceShards):
    """Shards in CPU memory, pinned when the device is a GPU; copied to the device per gather."""

    tier = Tier.CPU

    def gather_input(self, index, shard, device):
        staged = torch.empty(shard.numel(), dtype=shard.dtype, device=device)
        staged.copy_(shard, non_blocking=True)
        return staged


class NVMeShards(DeviceShards):
    """Shards in swap files, one per unit; the shard tensors hold no storage."""

    tier = Tier.NVME

    def __init__(self, placement, dtype, swapper):
        super().__init__(placement, dtype)
        self.swapper = swapper
        self._writes = []  # swap-outs in flight

    @staticmethod
    def _key(index: int) -> str:
        return f"param_shard{index}"

    def write(self, index, shard, values):
        self._writes.append(self.swapper.swap_out(self._key(index), values.to(self.dtype)))
        shard.untyped_storage().resize_(0)

    def read(self, index, shard):
        staged = self.placement.empty(shard.numel(), self.dtype, self.placement.host)
        return self.swapper.swap_in(self._key(index), staged).wait()

    def gather_input(self, index, shard, device):
        return self.read(index, shard).to(device, non_blocking=True)

    def prefetch(self, indices):
        keys = [self._key(i) for i in indices]
        if keys:
            self.swapper.prefetch(keys)

    def wait_writes(self):
        """Wait for the shard writes in flight; raises the first IO error (naming the file)."""
        writes, self._writes = self._writes, []
        for handle in writes:
            handle.wait()


def shard_store(placement, dtype: torch.dtype, swapper=None) -> DeviceShards:
    """The store of placement.param_tier."""
    if placement.param_tier == Tier.NVME:
        if swapper is None:
            raise ValueError("parameters on the nvme tier need a TensorSwapper")
        return NVMeShards(placement, dtype, swapper)
    return HostShards(placement, dtype) if placement.param_tier == Tier.CPU else DeviceShards(placement, dtype)
