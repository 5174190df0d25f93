"""The process grid: named axes (pp, dp, cp, tp) over the world, built on torch's DeviceMesh.

One Topology object is created per run and passed explicitly to everything that
communicates; nothing in tiertrain looks process groups up from module globals.

Rank order follows Megatron (Megatron §3: tensor parallelism inside a server): tp is the
fastest-varying axis, so tensor-parallel peers are adjacent ranks, then cp (the ranks that
split one sequence's tokens, Megatron-Core's order), then dp, then pp.

Context-parallel ranks hold the same parameters and see different tokens of the same
sequences, so for the model states they are data-parallel ranks too (as in DeepSpeed and
torchtitan): ZeRO partitions and reduces over the derived axis ``dp_cp`` (dp × cp ranks),
while the data is distributed over ``dp`` alone.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError, ParallelConfig

AXES = ("pp", "dp", "cp", "tp")

REPLICAS = "dp_cp"
"""The derived axis of the ranks that hold the same parameters: dp × cp (the ZeRO group)."""


@dataclass(frozen=True)
class Topology:
    """Sizes and this rank's coordinates on each named axis, with one process group per axis."""

    sizes: dict[str, int]
    coords: dict[str, int]
    rank: int
    world_size: int
    device: torch.device
    mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh, None when single-process
    replica_mesh: object | None = None
    """A second DeviceMesh (pp, dp_cp, tp) over the same ranks when cp > 1, whose dp_cp groups
    are the flattened dp × cp ones (the rank order makes dp_cp = dp·cp + cp coordinate)."""

    @staticmethod
    def build(parallel: ParallelConfig | None = None, device: torch.device | str | None = None) -> "Topology":
        """The grid for the current process group (or a 1-rank grid when none is initialised)."""
        parallel = parallel or ParallelConfig()
        parallel.validate()
        device = torch.device(device) if device is not None else default_device()
        cp = parallel.cp
        if not dist.is_available() or not dist.is_initialized():
            pp, dp, tp = parallel.resolve(1)
            return Topology({"pp": pp, "dp": dp, "cp": cp, "tp": tp}, {a: 0 for a in AXES}, 0, 1, device)
        world = dist.get_world_size()
        pp, dp, tp = parallel.resolve(world)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (pp, dp, cp, tp), mesh_dim_names=AXES)
        replica_mesh = None
        if cp > 1:
            replica_mesh = init_device_mesh(device.type, (pp, dp * cp, tp), mesh_dim_names=("pp", REPLICAS, "tp"))
        coords = {a: mesh.get_local_rank(a) for a in AXES}
        return Topology({"pp": pp, "dp": dp, "cp": cp, "tp": tp}, coords, dist.get_rank(), world, device, mesh,
                        replica_mesh)

    def size(self, axis: str) -> int:
        """Number of ranks along axis (dp_cp: dp × cp)."""
        if self._check(axis) == REPLICAS:
            return self.size("dp") * self.size("cp")
        return self.sizes.get(axis, 1)

    def coord(self, axis: str) -> int:
        """This rank's index along axis (dp_cp: dp coordinate × cp + cp coordinate)."""
        if self._check(axis) == REPLICAS:
            return self.coord("dp") * self.size("cp") + self.coord("cp")
        return self.coords.get(axis, 0)

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of this rank's peers along axis; None when the run is single-process."""
        if self._check(axis) == REPLICAS:
            return self.group("dp") if self.replica_mesh is None else self.replica_mesh.get_group(REPLICAS)
        return None if self.mesh is None else self.mesh.get_group(axis)

    def world_group(self) -> dist.ProcessGroup | None:
        """All ranks of the run (None when single-process)."""
        return None if self.mesh is None else dist.group.WORLD

    def ranks(self, axis: str) -> list[int]:
        """Global ranks of this rank's peers along axis, in axis order."""
        self._check(axis)
        if self.mesh is None:
            return [0]
        return dist.get_process_group_ranks(self.group(axis))

    @property
    def is_distributed(self) -> bool:
        return self.mesh is not None and self.world_size > 1

    def _check(self, axis: str) -> str:
        if axis not in AXES and axis != REPLICAS:
            raise ConfigError(f"axis {axis!r} is unknown: valid axes are {', '.join(AXES)} and {REPLICAS}")
        return axis

    def __repr__(self) -> str:
        grid = " × ".join(f"{a}={self.size(a)}" for a in AXES)
        here = ", ".join(f"{a}={self.coord(a)}" for a in AXES)
        return f"Topology({grid}; rank {self.rank} at {here})"


def default_device() -> torch.device:
    """The accelerator of LOCAL_RANK when there is one (cuda:LOCAL_RANK), else cpu."""
    import os

    from .device import default_device as accelerator_of

    return accelerator_of(int(os.environ.get("LOCAL_RANK", "0")))
