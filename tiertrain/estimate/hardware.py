"""The machines a plan is made for: :class:`Hardware` (ranks, nodes, memory of every tier, link
bandwidths and the process overhead, stated or from a probe), the bytes per rank each tier may
hold (:meth:`Hardware.budget`), and a :class:`Shortfall`, one tier that cannot hold what a
layout needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tiertrain.estimate.overhead import HostOverhead
from tiertrain.tiers import Tier

__all__ = ["Hardware", "Shortfall", "RAM"]

RAM = "ram"
"""The budget key of host RAM on a machine without an accelerator, where the device and CPU
tiers are one pool (not a :class:`~tiertrain.tiers.Tier`: a budget, not a placement)."""


@dataclass
class Hardware:
    """What the planner needs to know about the machines (per node unless stated)."""

    ranks_per_node: int
    """Training processes per node (one per accelerator; on CPU, ``--nproc``)."""
    host_memory: int
    """Bytes of host RAM per node the job may use (MemAvailable, or a stated figure)."""
    device_memory: int | None = None
    """Bytes of memory per accelerator; None: no accelerator, the device is host RAM."""
    nodes: int = 1
    """Nodes in the job (data-parallel ranks = nodes × ranks_per_node)."""
    nvme_bytes: int | None = None
    """Free bytes of the swap directory per node; None: no NVMe tier."""
    swap_dir: str | None = None
    """The NVMe tier's directory (zero.nvme_path of the written config)."""
    peak_flops: float | None = None
    """Achievable compute per rank, FLOP/s (efficiency predictions need it)."""
    host_device_bw: float | None = None
    """Host↔device bytes/s per rank (one accelerator's link)."""
    nvme_bw: float | None = None
    """NVMe bytes/s per node (the lower of read and write)."""
    reserve: float = 0.10
    """Fraction of every tier left free (fragmentation, other processes, the OS)."""
    overhead: HostOverhead | None = None
    """Process overhead per rank (framework bytes, allocator retention), from the probe;
    None: the defaults for the device (HostOverhead.for_device)."""
    source: str = "stated"
    """Where the figures come from (a probe file, or stated on the command line)."""

    def __post_init__(self) -> None:
        if self.overhead is None:
            self.overhead = HostOverhead.for_device("cpu" if self.device_memory is None else "cuda")

    def validate(self) -> "Hardware":
        if isinstance(self.ranks_per_node, bool) or not isinstance(self.ranks_per_node, int) or self.ranks_per_node < 1:
            raise ValueError(f"Hardware.ranks_per_node={self.ranks_per_node!r} is invalid: must be an int >= 1")
        if isinstance(self.nodes, bool) or not isinstance(self.nodes, int) or self.nodes < 1:
            raise ValueError(f"Hardware.nodes={self.nodes!r} is invalid: must be an int >= 1")
        for name in ("host_memory", "device_memory", "nvme_bytes"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0):
                raise ValueError(f"Hardware.{name}={v!r} is invalid: must be a number of bytes >= 0")
        if not 0 <= self.reserve < 1:
            raise ValueError(f"Hardware.reserve={self.reserve!r} is invalid: must be in [0, 1)")
        if self.device_memory is not None and self.overhead.retention:
            # the transient bytes live in the accelerator's allocator, not in the host heap
            self.overhead = HostOverhead(self.overhead.framework_bytes, 0.0,
                                         self.overhead.source + "; no host-allocator retention with an accelerator")
        return self

    @property
    def shared(self) -> bool:
        """True without an accelerator: device and CPU tiers are the same host memory."""
        return self.device_memory is None

    @property
    def ranks(self) -> int:
        return self.nodes * self.ranks_per_node

    def budget(self) -> dict[Tier | str, int]:
        """Bytes per rank each tier may hold (:data:`RAM` for the shared device+CPU pool)."""
        keep = 1 - self.reserve
        out: dict[Tier | str, int] = {}
        if self.shared:
            out[RAM] = int(self.host_memory * keep / self.ranks_per_node)
        else:
            out[Tier.DEVICE] = int(self.device_memory * keep)
            out[Tier.CPU] = int(self.host_memory * keep / self.ranks_per_node)
        out[Tier.NVME] = int(self.nvme_bytes * keep / self.ranks_per_node) if self.nvme_bytes else 0
        return out

    @classmethod
    def from_probe(cls, probe: Any, ranks_per_node: int, nodes: int = 1, reserve: float = 0.10) -> "Hardware":
        """Hardware from a :class:`~tiertrain.estimate.probe.HardwareProbe` (or its dict)."""
        p = probe if isinstance(probe, dict) else probe.to_dict()
        gpu = p.get("cuda_memory_bytes")
        peak = None
        if p.get("bf16_matmul_tflops"):
            peak = p["bf16_matmul_tflops"] * 1e12
        elif p.get("cpu_matmul_gflops"):
            peak = p["cpu_matmul_gflops"] * 1e9 / ranks_per_node  # the ranks share the cores
        h2d = [p.get("h2d_gbps"), p.get("d2h_gbps")]
        io = [x for x in (p.get("swap_read_gbps"), p.get("swap_write_gbps")) if x]
        overhead = HostOverhead.for_device("cuda" if gpu else "cpu")
        if p.get("framework_overhead_bytes") is not None:
            retention = p.get("allocator_retention")
            overhead = HostOverhead(int(p["framework_overhead_bytes"]),
                                    0.0 if gpu else (overhead.retention if retention is None else float(retention)),
                                    "measured by tiertrain probe")
        return cls(ranks_per_node=ranks_per_node, nodes=nodes, host_memory=int(p["ram_available_bytes"]),
                   device_memory=int(gpu) if gpu else None,
                   nvme_bytes=int(p["swap_free_bytes"]) if p.get("swap_free_bytes") else None,
                   swap_dir=p.get("swap_dir"), peak_flops=peak,
                   host_device_bw=min(h2d) * 1e9 if all(h2d) else None,
                   nvme_bw=min(io) * 1e9 if io else None, reserve=reserve, overhead=overhead,
                   source=f"probe of {p.get('host') or 'this machine'}").validate()


@dataclass
class Shortfall:
    """One tier that cannot hold what the layout needs."""

    tier: Tier | str
    """A Tier, or :data:`RAM` (the shared device+CPU pool of a machine without an accelerator)."""
    need_per_rank: int
    have_per_rank: int
    ranks_per_node: int
    phase: str = "training"
    """"training" (the step's peak) or "build" (building the model and wrapping it)."""

    @property
    def short_per_rank(self) -> int:
        return self.need_per_rank - self.have_per_rank

    def describe(self) -> str:
        from tiertrain.estimate.report import human_bytes

        node = ""
        if self.tier != Tier.DEVICE and self.ranks_per_node > 1:
            node = (f" ({human_bytes(self.need_per_rank * self.ranks_per_node)} per node of "
                    f"{human_bytes(self.have_per_rank * self.ranks_per_node)})")
        what = {RAM: "host RAM (device and CPU tiers)", Tier.CPU: "CPU memory", Tier.DEVICE: "device memory",
                Tier.NVME: "NVMe"}[self.tier]
        have = "no NVMe tier (give a swap directory)" if self.tier == Tier.NVME and self.have_per_rank == 0 \
            else f"{human_bytes(self.have_per_rank)} available"
        when = " while the model is built" if self.phase == "build" else ""
        return (f"{what} short by {human_bytes(self.short_per_rank)} per rank{when}: needs "
                f"{human_bytes(self.need_per_rank)}, {have}{node}")
