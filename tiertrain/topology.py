"""The process grid: named axes (pp, dp, tp) over the world, built on torch's DeviceMesh.

One Topology object is created per run and passed explicitly to everything that
communicates; nothing in tiertrain looks process groups up from module globals.

Rank order follows Megatron (§3 of the PTD-P paper): tp is the fastest-varying axis, so
tensor-parallel peers are adjacent ranks (the same server), then dp, then pp.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from .config import ConfigError, ParallelConfig

AXES = ("pp", "dp", "tp")


@dataclass(frozen=True)
class Topology:
    """Sizes and this rank's coordinates on each named axis, with one process group per axis."""

    sizes: dict[str, int]
    coords: dict[str, int]
    rank: int
    world_size: int
    device: torch.device
    mesh: object | None = None  # torch.distributed.device_mesh.DeviceMesh, None when single-process

    @staticmethod
    def build(parallel: ParallelConfig | None = None, device: torch.device | str | None = None) -> "Topology":
        """The grid for the current process group (or a 1-rank grid when none is initialised)."""
        parallel = parallel or ParallelConfig()
        parallel.validate()
        device = torch.device(device) if device is not None else default_device()
        if not dist.is_available() or not dist.is_initialized():
            pp, dp, tp = parallel.resolve(1)
            return Topology({"pp": pp, "dp": dp, "tp": tp}, {a: 0 for a in AXES}, 0, 1, device)
        world = dist.get_world_size()
        pp, dp, tp = parallel.resolve(world)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(device.type, (pp, dp, tp), mesh_dim_names=AXES)
        coords = {a: mesh.get_local_rank(a) for a in AXES}
        return Topology({"pp": pp, "dp": dp, "tp": tp}, coords, dist.get_rank(), world, device, mesh)

    def size(self, axis: str) -> int:
        """Number of ranks along axis."""
        return self.sizes[self._check(axis)]

    def coord(self, axis: str) -> int:
        """This rank's index along axis."""
        return self.coords[self._check(axis)]

    def group(self, axis: str) -> dist.ProcessGroup | None:
        """The process group of this rank's peers along axis; None when the run is single-process."""
        self._check(axis)
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
        if axis not in AXES:
            raise ConfigError(f"axis {axis!r} is unknown: valid axes are {', '.join(AXES)}")
        return axis

    def __repr__(self) -> str:
        grid = " × ".join(f"{a}={self.sizes[a]}" for a in AXES)
        here = ", ".join(f"{a}={self.coords[a]}" for a in AXES)
        return f"Topology({grid}; rank {self.rank} at {here})"


def default_device() -> torch.device:
    """The accelerator of LOCAL_RANK when there is one (cuda:LOCAL_RANK), else cpu."""
    import os

    from .device import default_device as accelerator_of

    return accelerator_of(int(os.environ.get("LOCAL_RANK", "0")))
