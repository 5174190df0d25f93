"""What the flat buffers need of the parameter tier: the :class:`ShardStore` protocol.

Stage 3 keeps each partitioned unit's compute-dtype shard between uses in one tier (ZeRO-
Infinity §5: device memory, CPU memory, or NVMe): each all-gather reads it, each optimizer step
rewrites it ("p swap", ZeRO-Infinity §6). The ZeRO core (tiertrain/zero/flat.py) speaks only
this protocol; the concrete stores live in the tier package below it
(tiertrain/offload/shard_store.py), and the engine builder picks one for the parameter tier and
hands it to :class:`~tiertrain.zero.flat.FlatParameters` (the core does not choose its tier).
"""
from __future__ import annotations

from typing import Callable, Iterable, Mapping, Protocol

import torch

from ..device import DeviceStreams, Transfer
from ..tiers import Tier


class ShardStore(Protocol):
    """Where partitioned units' shards live between uses (one store per parameter tier)."""

    tier: Tier
    """The tier the shards live in."""
    streams: DeviceStreams
    """The compute device's streams and tier transfers the store copies on."""
    kept_units: int
    """Shard staging tensors kept with their values (NVMe; 0 elsewhere)."""

    def allocate(self, numel: int) -> torch.Tensor:
        """A new shard tensor on this tier (on NVMe: one without storage)."""

    def write(self, index: int, shard: torch.Tensor, values: torch.Tensor) -> None:
        """Store values as unit index's shard (shard: the unit's shard tensor)."""

    def read(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """A copy of unit index's stored shard values."""

    def gather_input(self, index: int, shard: torch.Tensor) -> Transfer:
        """Unit index's shard on the compute device, as the all-gather's input (wait for it)."""

    def prefetch(self, indices: Iterable[int], shard_numel: Callable[[int], int]) -> None:
        """Start bringing these units' shards closer (a hint)."""

    def stage(self, indices: Iterable[int], shards: Mapping[int, torch.Tensor]) -> None:
        """Start copying these units' shards to the device (a hint, for units gathered soon)."""

    def drop_staged(self) -> None:
        """Forget the copies stage() started (before the shards change)."""

    def done_with_input(self, tensor: torch.Tensor) -> None:
        """The all-gather that read gather_input's tensor has completed."""

    def holds_masters(self, index: int) -> bool:
        """Whether unit index's stored shard is an update form's fp32 master itself (fp32
        parameters with the optimizer on NVMe: nothing to publish into it after a step)."""

    def forget_values(self) -> None:
        """The stored shards may have changed outside write(): copies kept for reuse are stale."""

    def wait_writes(self) -> None:
        """Complete the writes in flight."""
