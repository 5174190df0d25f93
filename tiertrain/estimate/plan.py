"""Choose a training layout that fits: ZeRO stage, memory tiers, activation checkpointing
and tiling, by ZeRO-Infinity's placement policy (docs/concepts.md#placement-policy), with the memory of every
candidate predicted by :func:`tiertrain.estimate.estimate` (tiertrain's own buffers) and its
efficiency by the bandwidth model (:mod:`tiertrain.estimate.bandwidth`).

The policy, as a ladder of rungs tried in order; the first rung with a candidate that fits
wins:

1. **no offload** ("offload only when aggregate device memory is not enough"): the lowest
   ZeRO stage that fits (stages 0–2 move the same 2Ψ per step and fewer collectives the
   lower the stage; stage 3 moves 3Ψ), first without activation checkpointing, then every
   block checkpointed selectively (no matrix multiplication recomputed,
   docs/concepts.md#selective-activation-checkpointing), then checkpointing as few blocks
   whole as fits (blocks 0, k, 2k, …: the largest k); the same order wherever checkpointing
   is searched below;
2. **optimizer states and gradients offloaded** to the fastest tier with room (CPU memory,
   then NVMe), at stage 2 then 3 (ZeRO-Offload builds on stage 2);
3. **parameters or activation checkpoints** (stage 3): if moving one of them suffices, the
   one with the better predicted efficiency — parameters to the fastest tier with room, or
   checkpoints to CPU memory;
4. **both**: checkpoints to CPU memory and parameters to the fastest tier with room.

Tiling (ZeRO-Infinity §5.1.3) is tried at stage 3 when the gathered block itself is what
does not fit (tile factors 2, 4, 8, 16 of each block's qkv, fc1 and fc2).

On a machine without an accelerator the "device" is host memory: the device and CPU tiers
are one pool, so only the NVMe tier relieves it (CPU offload of anything is never chosen
there). When nothing fits, :attr:`Plan.short` says which tier is short, per rank and per
node, and by how many bytes, for the most memory-frugal layout the policy allows.

This ladder plans data parallelism over every rank (t = p = 1). With accelerators, `tiertrain
plan` first chooses the tensor/pipeline/data layout by Megatron PTD-P's rules
(:mod:`tiertrain.estimate.layout3d`), which comes back here only when no 3D layout fits the
devices.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from tiertrain.errors import TiertrainError
from tiertrain.estimate.bandwidth import (
    ait_activation_checkpoints,
    ait_optimizer_states,
    ait_params_grads,
)
from tiertrain.estimate.memory import Estimate, ModelDims, ZeroLayout, estimate
from tiertrain.estimate.overhead import HostOverhead
from tiertrain.estimate.units import engine_grad_tier, gpt_meta_model
from tiertrain.tiers import Tier

if False:  # typing only
    from tiertrain.estimate.modules import HFModelDims  # noqa: F401

__all__ = ["Hardware", "Plan", "Shortfall", "plan", "evaluate", "PlanError", "render_plan", "plan_to_json", "RAM"]

RAM = "ram"
"""The budget key of host RAM on a machine without an accelerator, where the device and CPU
tiers are one pool (not a :class:`~tiertrain.tiers.Tier`: a budget, not a placement)."""


class PlanError(TiertrainError, ValueError):
    """Nothing fits; the message names the tiers that are short and by how much."""

    def __init__(self, message: str, plan: "Plan"):
        super().__init__(message)
        self.plan = plan


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


@dataclass
class Candidate:
    layout: ZeroLayout
    estimate: Estimate
    usage: dict[str, int]
    short: list[Shortfall]
    efficiency: dict[str, Any] | None
    rung: str
    rejected: str | None = None
    """Why the engine cannot run this layout (the ``allowed`` check), else None."""
    build_usage: dict[str, int] | None = None
    """Bytes per rank by tier at the peak of building the model (Estimate.build)."""
    model: Any = None
    """The meta-device model estimated (set by :func:`evaluate`)."""

    @property
    def fits(self) -> bool:
        """Fits while training and while being built (``short`` holds both phases)."""
        return not self.short and self.rejected is None

    def summary(self) -> dict[str, Any]:
        lay = self.layout
        return {"rung": self.rung, "stage": lay.stage, "optimizer_tier": lay.optimizer_tier,
                "param_tier": lay.param_tier, "checkpoint_every": lay.checkpoint_interval,
                "recompute": lay.recompute, "checkpoint_tier": lay.checkpoint_tier, "tile_factor": lay.tile_factor,
                "usage_per_rank": dict(self.usage),
                "build_peak_per_rank": None if self.build_usage is None else dict(self.build_usage),
                "built_partitioned": None if self.estimate.build is None else self.estimate.build.partitioned,
                "fits": self.fits,
                "short": [asdict(s) | {"short_per_rank": s.short_per_rank} for s in self.short],
                "rejected": self.rejected,
                "efficiency": None if self.efficiency is None else self.efficiency["combined"]}


@dataclass
class Plan:
    """The chosen layout (or, when nothing fits, the most frugal one and what is short)."""

    fits: bool
    dims: ModelDims
    layout: ZeroLayout
    estimate: Estimate
    hardware: Hardware
    budget: dict[str, int]
    usage: dict[str, int]
    efficiency: dict[str, Any] | None
    rung: str
    short: list[Shortfall] = field(default_factory=list)
    tried: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    build_usage: dict[str, int] | None = None
    """Bytes per rank by tier at the peak of building the model and wrapping it."""

    # -- the engine's configuration -----------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        """The sections of a ``tiertrain train`` config (TrainConfig) this plan sets."""
        lay, d = self.layout, self.dims
        # Plain strings (YAML cannot write an enum), in the configuration's spelling ("none"
        # for the device), which every version of the config parser reads.
        zero: dict[str, Any] = {"stage": lay.stage, "offload": "manual",
                                "offload_optimizer": Tier(lay.optimizer_tier).config_name,
                                "offload_params": Tier(lay.param_tier).config_name, "bucket_mb": lay.bucket_mb}
        if Tier.NVME in (lay.optimizer_tier, lay.param_tier):
            zero["nvme_path"] = self.hardware.swap_dir or ""
        if lay.nvme_in_place:
            zero["nvme_in_place"] = True
        if lay.nvme_grads_in_ram_mb:
            zero["nvme_grads_in_ram_mb"] = lay.nvme_grads_in_ram_mb
        # a Hugging Face model (HFModelDims) has no GPT model section: only the training layout
        model = {} if hasattr(d, "model_section") else {
            "model": {"n_layers": d.n_layers, "hidden": d.hidden, "n_heads": d.n_heads, "vocab_size": d.vocab,
                      "seq_len": d.seq_len, "ffn_mult": d.ffn_mult, "tie_embeddings": d.tie_embeddings,
                      "bias": d.bias}}
        return {
            **model,
            "precision": {"dtype": lay.precision},
            "batch": {"micro_batch_size": lay.micro_batch},
            "zero": zero,
            "activations": {"checkpoint_every": lay.checkpoint_interval,
                            "offload": _checkpoint_offload(lay).config_name, "recompute": lay.recompute},
            "tile_factor": lay.tile_factor,
        }

    def to_yaml(self) -> str:
        """A config file for ``tiertrain train --config`` (fields not given keep their defaults)."""
        import yaml

        from tiertrain.estimate.report import human_bytes

        head = [f"# tiertrain plan: {self.dims.num_parameters():,} parameters on {self.hardware.ranks} rank(s) "
                f"({self.hardware.source})",
                "# predicted per rank: " + ", ".join(f"{t} {human_bytes(b)}" for t, b in self.usage.items() if b)
                + (f"; efficiency {self.efficiency['combined']:.0%}" if self.efficiency else ""),
                f"# rung: {self.rung}" + ("" if self.fits else " — DOES NOT FIT: "
                                           + "; ".join(s.describe() for s in self.short)),
                "# use with: tiertrain train --config THIS_FILE [--nproc N]"]
        return "\n".join(head) + "\n" + yaml.safe_dump(self.config_dict(), sort_keys=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the choice, its predicted memory and efficiency, the config, the ladder."""
        lay = self.layout
        return {
            "fits": self.fits,
            "rung": self.rung,
            "parameters": self.dims.num_parameters(),
            "plan": {"stage": lay.stage, "dp": lay.dp, "precision": lay.precision, "micro_batch": lay.micro_batch,
                     "optimizer_tier": lay.optimizer_tier, "grad_tier": lay.grad_tier, "param_tier": lay.param_tier,
                     "checkpoint_every": lay.checkpoint_interval, "checkpoint_tier": lay.checkpoint_tier,
                     "recompute": lay.recompute, "tile_factor": lay.tile_factor},
            "memory_per_rank": dict(self.usage),
            "budget_per_rank": dict(self.budget),
            "peak_at": self.estimate.peak_at,
            "build_peak_per_rank": None if self.build_usage is None else dict(self.build_usage),
            "build_peak_per_node": None if self.build_usage is None else
            {t: b * self.hardware.ranks_per_node for t, b in self.build_usage.items()},
            "build": None if self.estimate.build is None else {
                "partitioned": self.estimate.build.partitioned, "where": self.estimate.build.where,
                "items": dict(self.estimate.build.items)},
            "lines": [asdict(l) for l in self.estimate.lines],
            "efficiency": self.efficiency,
            "short": [asdict(s) | {"short_per_rank": s.short_per_rank, "message": s.describe()} for s in self.short],
            "config": self.config_dict(),
            "hardware": {k: v for k, v in asdict(self.hardware).items() if k != "overhead"}
            | {"overhead": asdict(self.hardware.overhead), "shared_device_and_cpu": self.hardware.shared},
            "tried": list(self.tried),
            "notes": list(self.notes),
        }


# --------------------------------------------------------------------------- evaluation


def _checkpoint_offload(lay: ZeroLayout) -> Tier:
    """The tier activation checkpoints are offloaded to (activations.offload): the layout's
    checkpoint tier when it checkpoints at all, else the device."""
    return Tier(lay.checkpoint_tier) if lay.checkpoint_interval else Tier.DEVICE


def _usage(est: Estimate, hw: Hardware) -> dict[Tier | str, int]:
    tiers = est.by_tier()
    if hw.shared:
        return {RAM: tiers[Tier.DEVICE] + tiers[Tier.CPU], Tier.NVME: tiers[Tier.NVME]}
    return {Tier.DEVICE: tiers[Tier.DEVICE], Tier.CPU: tiers[Tier.CPU], Tier.NVME: tiers[Tier.NVME]}


def _shortfalls(usage: dict[Tier | str, int], hw: Hardware, phase: str = "training") -> list[Shortfall]:
    budget = hw.budget()
    return [Shortfall(t, usage[t], budget[t], hw.ranks_per_node, phase) for t in usage if usage[t] > budget[t]]


def _build_usage(est: Estimate, hw: Hardware) -> dict[Tier | str, int] | None:
    """Bytes per rank by tier at the build's peak (the ranks of a node build at once)."""
    tiers = est.build_by_tier()
    if tiers is None:
        return None
    if hw.shared:
        return {RAM: tiers[Tier.DEVICE] + tiers[Tier.CPU], Tier.NVME: 0}
    return {Tier.DEVICE: tiers[Tier.DEVICE], Tier.CPU: tiers[Tier.CPU], Tier.NVME: 0}


def predicted_efficiency(lay: ZeroLayout, dims: ModelDims, hw: Hardware) -> dict[str, Any] | None:
    """ZeRO-Infinity §4 for the states this layout moves off the device, no overlap, times
    the recomputation factor 3/(3 + c/nl) of c checkpointed blocks (a step is 3 forwards'
    worth of compute; each recomputed block adds one). None without a compute peak. On a
    machine without an accelerator CPU-tier states do not move (they are already in host
    memory); NVMe traffic is shared by the node's ranks, and parameters read by every rank
    in 1/dp shards (bandwidth-centric partitioning) count dp× the per-rank bandwidth."""
    if not hw.peak_flops:
        return None
    s, b, h = dims.seq_len, lay.micro_batch, dims.hidden
    per_rank_nvme = hw.nvme_bw / hw.ranks_per_node if hw.nvme_bw else None
    states = []

    def link(tier: Tier, partitioned: bool) -> float | None:
        if tier is Tier.DEVICE:
            return None
        if tier is Tier.CPU:
            bw = None if hw.shared else hw.host_device_bw
        else:
            bw = per_rank_nvme
        return None if bw is None else bw * (lay.dp if partitioned else 1)

    for name, tier, ait, f, part in (
        ("optimizer states", Tier(lay.optimizer_tier), ait_optimizer_states(s, b), "seq·bsz/4", False),
        ("params+grads", Tier(lay.param_tier), ait_params_grads(s, b), "seq·bsz", True),
        ("activation checkpoints", _checkpoint_offload(lay),
         ait_activation_checkpoints(h, max(1, lay.checkpoint_interval)), "24·hd·ci", False),
    ):
        bw = link(tier, part)
        if tier is Tier.DEVICE:
            continue
        if bw is None:
            if not (hw.shared and tier is Tier.CPU):
                states.append({"state": name, "tier": tier, "ait": ait, "bandwidth": None, "efficiency": None,
                               "formula": f"AIT = {f} (ZeRO-Infinity §4.1); link bandwidth unknown"})
            continue
        eff = ait * bw / (ait * bw + hw.peak_flops)
        states.append({"state": name, "tier": tier, "ait": ait, "bandwidth": bw, "efficiency": eff,
                       "formula": f"AIT = {f} (ZeRO-Infinity §4.1)" + (f", ×dp={lay.dp} (bandwidth-centric)" if part else "")})
    recompute = 3 / (3 + recomputed_blocks(lay, dims.n_layers) / dims.n_layers)
    transfer = 1.0 / (1.0 + sum(hw.peak_flops / (x["ait"] * x["bandwidth"]) for x in states if x["bandwidth"]))
    return {"peak_flops": hw.peak_flops, "states": states, "recompute_factor": recompute,
            "transfer": transfer, "combined": transfer * recompute}


GRADS_IN_RAM_MB = (2048.0, 1024.0, 512.0)
"""Caps on the gradient shards held for the in-place NVMe step the planner tries, largest first."""


class _Evaluator:
    def __init__(self, dims: ModelDims, hw: Hardware, base: ZeroLayout, allowed=None):
        self.dims, self.hw, self.base, self.allowed = dims, hw, base, allowed
        self._models: dict[int, Any] = {}
        self.count = 0

    def model(self, tile: int):
        if tile not in self._models:  # HFModelDims: its own (meta) model, untiled
            self._models[tile] = (self.dims.meta_model() if hasattr(self.dims, "meta_model")
                                  else gpt_meta_model(self.dims, tile))
        return self._models[tile]

    def __call__(self, rung: str, **changes: Any) -> Candidate:
        lay = dataclasses.replace(self.base, **changes)
        # the engine keeps gradient shards with the optimizer (NVMe: in RAM)
        lay = dataclasses.replace(lay, grad_tier=engine_grad_tier(lay.stage, lay.optimizer_tier))
        lay.validate()
        c = self._candidate(rung, lay)
        if Tier(lay.optimizer_tier) is not Tier.NVME or lay.nvme_in_place or not c.short:
            return c
        # Two generations of the optimizer state do not fit the disk, or the gradient shards do
        # not fit the RAM: one generation updated in place (zero.nvme_in_place, trading the
        # retryable step for half the disk) may; in place, the step running in backward also
        # frees each gradient shard it consumed, so a cap on those held
        # (zero.nvme_grads_in_ram_mb) may fit the RAM.
        ram_short = lay.stage >= 2 and any(s.tier is not Tier.NVME for s in c.short)
        for cap in (0.0, *(GRADS_IN_RAM_MB if ram_short else ())):
            option = self._candidate(rung, dataclasses.replace(lay, nvme_in_place=True, nvme_grads_in_ram_mb=cap))
            if not option.short:
                return option
        return c

    def _candidate(self, rung: str, lay: ZeroLayout) -> Candidate:
        self.count += 1
        # A Hugging Face model's dims carry its activation model (estimate.modules): given as
        # dims, as `tiertrain estimate` gives them, not as the bare meta module, whose
        # activations the estimate cannot see (issue 35, item 3: plan and estimate disagreed).
        spec = self.dims if hasattr(self.dims, "activation_bytes") else self.model(lay.tile_factor)
        est = estimate(spec, lay, self.hw.overhead, accelerator=not self.hw.shared)
        est.dims = self.dims
        usage = _usage(est, self.hw)
        build = _build_usage(est, self.hw)
        short = _shortfalls(usage, self.hw) + (_shortfalls(build, self.hw, "build") if build else [])
        return Candidate(lay, est, usage, short, predicted_efficiency(lay, self.dims, self.hw), rung,
                         self.allowed(lay) if self.allowed is not None else None, build)


def evaluate(dims: "ModelDims | HFModelDims", hardware: Hardware, layout: ZeroLayout) -> Candidate:
    """One layout as given (no rung, no alternatives): its estimate, the usage per tier while
    training and while building, and what is short on ``hardware``; ``model`` is the meta
    model it was estimated on."""
    evaluator = _Evaluator(dims, hardware, layout)
    candidate = evaluator._candidate("given", layout)
    candidate.model = evaluator.model(layout.tile_factor)
    return candidate


def recomputed_blocks(lay: ZeroLayout, n_layers: int) -> int:
    """Blocks whose whole forward backward runs again: those checkpointed, unless selectively
    (which recomputes only elementwise ops: counted as none, as the FLOPs are)."""
    if not lay.checkpoint_interval or lay.recompute == "selective":
        return 0
    return len(range(0, n_layers, lay.checkpoint_interval))


def _checkpoint_options(n_layers: int) -> list[int]:
    """checkpoint_every values from fewest checkpointed blocks to most (distinct counts):
    k = nl checkpoints block 0 only; k = 1 every block."""
    out, seen = [], set()
    for k in range(n_layers, 0, -1):
        c = len(range(0, n_layers, k))
        if c not in seen:
            seen.add(c)
            out.append(k)
    return out


def _score(c: Candidate) -> float:
    """Predicted efficiency; without a compute peak, the recomputation factor alone."""
    if c.efficiency is not None:
        return c.efficiency["combined"]
    nl = c.estimate.dims.n_layers if c.estimate.dims else 1
    return 3 / (3 + recomputed_blocks(c.layout, nl) / nl)


def _tiling_can_help(c: Candidate) -> bool:
    """Whether smaller stage-3 units could close the gap: tiling shrinks the gathered units
    and the per-unit gradient buckets (and the allocator's share of them), nothing else."""
    if any(s.phase == "build" for s in c.short):
        return False  # a tiled model is built whole (not partitioned): tiling only adds to the build
    lines = {l.name: l.bytes for l in c.estimate.lines}
    shrinkable = lines.get("model-state working memory", 0) + lines.get("gradient buckets and reductions in flight", 0)
    shrinkable = int(shrinkable * 2)  # and the allocator's retention of them (≤ 1× measured)
    return all(s.short_per_rank < shrinkable for s in c.short)


def _first_fit(evaluate, rung: str, tried: list, ks: list[int], tiles: list[int], **fixed: Any) -> Candidate | None:
    """The first fitting candidate over tile factors (stage 3 only; fewest first) and, for
    the first tile factor where any fits, the checkpoint interval with the least
    checkpointing that fits. ``ks`` runs from most memory to least (0 = none, then fewest
    checkpointed blocks); memory falls along it, so it is searched by bisection. Where
    checkpointing is needed, every block checkpointed selectively is taken instead when it
    fits: it recomputes no matrix multiplication, so it is as fast as none."""
    if not ks:
        return None
    tile_list = tiles if fixed.get("stage") == 3 else [1]
    for tile in tile_list:
        last = evaluate(rung, checkpoint_interval=ks[-1], tile_factor=tile, **fixed)
        tried.append(last.summary())
        if last.rejected is None and not last.fits and tile == tile_list[0] and not _tiling_can_help(last):
            break  # short by more than all the per-unit working memory tiling could shrink
        if not last.fits:
            continue
        lo, hi, best = 0, len(ks) - 1, last  # ks[hi] fits; find the smallest index that fits
        while lo < hi:
            mid = (lo + hi) // 2
            c = evaluate(rung, checkpoint_interval=ks[mid], tile_factor=tile, **fixed)
            tried.append(c.summary())
            if c.fits:
                hi, best = mid, c
            else:
                lo = mid + 1
        if best.layout.checkpoint_interval:  # checkpointing is needed: selectively, if that fits
            selective = evaluate(rung, checkpoint_interval=1, recompute="selective", tile_factor=tile, **fixed)
            tried.append(selective.summary())
            if selective.fits:
                return selective
        return best
    return None


def plan(dims: "ModelDims | HFModelDims", hardware: Hardware, *, micro_batch: int = 1, precision: str = "bf16",
         stages: Iterable[int] = (0, 1, 2, 3), tiers: Iterable[Tier | str] = (Tier.CPU, Tier.NVME),
         checkpointing: bool = True, tile_factors: Iterable[int] = (1, 2, 4, 8, 16),
         bucket_mb: float = 25.0, backend: str | None = None, raise_if_short: bool = False,
         allowed=None) -> Plan:
    """Choose stage, tiers, checkpoint interval and tile factor for training ``dims`` on
    ``hardware`` (see the module docstring for the policy). ``tiers``: offload tiers the
    engine may use (Tier.CPU, Tier.NVME or their spellings; NVMe also needs ``hardware.nvme_bytes``). Returns the
    :class:`Plan`; when nothing fits, ``plan.fits`` is False and ``plan.short`` says what is
    short (``raise_if_short``: raise :class:`PlanError` instead). ``allowed(layout)``: None
    when the engine can run the layout, else the reason (such layouts are skipped).
    ``dims``: tiertrain's GPT (:class:`ModelDims`) or any Hugging Face model of a supported
    family (:class:`~tiertrain.estimate.modules.HFModelDims`, from ``dims_of_hf_config`` or
    ``dims_of_module``; planned untiled)."""
    dims = dims.validate()
    hw = hardware.validate()
    stages = sorted(set(stages))
    wanted = {Tier(t) for t in tiers}
    tiers = [t for t in (Tier.CPU, Tier.NVME) if t in wanted]
    if not hw.nvme_bytes:
        tiers = [t for t in tiers if t is not Tier.NVME]
    fast_tiers = [t for t in tiers if not (hw.shared and t is Tier.CPU)]  # CPU tier = device pool on CPU
    base = ZeroLayout(dp=hw.ranks, stage=0, precision=precision, micro_batch=micro_batch,
                      ranks_per_node=hw.ranks_per_node, bucket_mb=bucket_mb,
                      backend=backend or ("gloo" if hw.shared else "nccl"))
    evaluate = _Evaluator(dims, hw, base, allowed)
    ks = _checkpoint_options(dims.n_layers) if checkpointing else []
    tiles = [t for t in tile_factors if t >= 1]
    tiles = sorted(set(tiles)) or [1]
    if hasattr(dims, "meta_model"):
        tiles = [1]  # a Hugging Face model is planned untiled (tiertrain.tiling names GPT's linears)
    tried: list[dict[str, Any]] = []
    notes: list[str] = []
    if hw.shared:
        notes.append("no accelerator: the device is host memory, so CPU offload frees nothing; only the NVMe "
                     "tier can relieve it")
    chosen: Candidate | None = None

    with_none = [0] + ks
    # 1. no offload: the lowest stage without checkpointing; else the stage whose least
    #    checkpointing that fits recomputes least (the best predicted efficiency), lowest first
    for stage in stages:
        c = _first_fit(evaluate, "no offload", tried, [0], tiles, stage=stage)
        if c is not None:
            chosen = c
            break
    if chosen is None and ks:
        fits = [c for c in (_first_fit(evaluate, "no offload", tried, ks, tiles, stage=stage) for stage in stages)
                if c is not None]
        if fits:
            chosen = max(fits, key=lambda c: (_score(c), -c.layout.stage))
    # 2. optimizer states + gradients to the fastest tier with room
    if chosen is None:
        for tier in fast_tiers:
            for stage in [s for s in stages if s >= 2]:
                c = _first_fit(evaluate, f"optimizer states and gradients to {tier}", tried, with_none, tiles,
                               stage=stage, optimizer_tier=tier)
                if c is not None:
                    chosen = c
                    break
            if chosen:
                break
    # 3. parameters or checkpoints (stage 3), optimizer on the fastest tier with room (or on
    #    the device when no offload tier may hold it, e.g. an engine without an NVMe optimizer)
    opt_options = fast_tiers + [Tier.DEVICE]
    if chosen is None and 3 in stages:
        for opt in opt_options:
            options = []
            for ptier in fast_tiers:
                c = _first_fit(evaluate, f"optimizer to {opt}, parameters to {ptier}", tried, with_none, tiles,
                               stage=3, optimizer_tier=opt, param_tier=ptier)
                if c is not None:
                    options.append(c)
                    break
            if ks and not hw.shared:
                c = _first_fit(evaluate, f"optimizer to {opt}, activation checkpoints to cpu", tried, ks, tiles,
                               stage=3, optimizer_tier=opt, checkpoint_tier=Tier.CPU)
                if c is not None:
                    options.append(c)
            if options:
                chosen = max(options, key=lambda c: (c.efficiency or {}).get("combined", 0.0))
                if len(options) > 1:
                    notes.append("both moving parameters and moving activation checkpoints fit; chose the one with "
                                 "the higher predicted efficiency (ZeRO-Infinity §3 policy)")
                break
    # 4. both: checkpoints to CPU, parameters to the fastest tier with room
    if chosen is None and 3 in stages and ks and not hw.shared:
        for opt in opt_options:
            for ptier in fast_tiers:
                c = _first_fit(evaluate, f"optimizer to {opt}, parameters to {ptier}, checkpoints to cpu", tried,
                               ks, tiles, stage=3, optimizer_tier=opt, param_tier=ptier, checkpoint_tier=Tier.CPU)
                if c is not None:
                    chosen = c
                    break
            if chosen:
                break

    if chosen is None:
        # the most frugal layout allowed, to say what is short
        big = fast_tiers[-1] if fast_tiers else Tier.DEVICE
        frugal = dict(stage=max(stages), checkpoint_interval=ks[-1] if ks else 0, tile_factor=1)
        if max(stages) >= 2 and big is not Tier.DEVICE:
            frugal["optimizer_tier"] = big
        if max(stages) == 3 and big is not Tier.DEVICE:
            frugal["param_tier"] = big
        if ks and not hw.shared and Tier.CPU in tiers:
            frugal["checkpoint_tier"] = Tier.CPU
        c = evaluate("nothing fits", **frugal)
        if max(stages) == 3 and max(tiles) > 1 and _tiling_can_help(c):
            c = evaluate("nothing fits", **{**frugal, "tile_factor": max(tiles)})
        tried.append(c.summary())
        result = Plan(False, dims, c.layout, c.estimate, hw, hw.budget(), c.usage, c.efficiency, c.rung,
                      c.short, tried, notes, c.build_usage)
        if not hw.nvme_bytes:
            notes.append("no NVMe tier was given (a probe with --swap-dir, or --nvme-bytes): with one, optimizer "
                         "states and parameters could leave host memory")
        if raise_if_short:
            raise PlanError(short_message(result), result)
        return result
    if any(t.get("stage", 3) < 3 and any(x.get("phase") == "build" for x in t["short"])
           and not any(x.get("phase") != "build" for x in t["short"]) for t in tried) and chosen.layout.stage == 3:
        notes.append("a layout below stage 3 would fit while training but not while the model is built (every "
                      "rank builds it whole in fp32 below stage 3): stage 3 builds it partitioned "
                      "(tiertrain.zero.partitioned_init)")
    return Plan(True, dims, chosen.layout, chosen.estimate, hw, hw.budget(), chosen.usage, chosen.efficiency,
                chosen.rung, [], tried, notes, chosen.build_usage)


def short_message(p: Plan) -> str:
    """One line: nothing fits, and what is short by how much."""
    lay = p.layout
    what = (f"stage {lay.stage}, optimizer on {lay.optimizer_tier}, parameters on {lay.param_tier}, "
            f"checkpoint_every={lay.checkpoint_interval} ({lay.checkpoint_tier}), tile {lay.tile_factor}")
    return (f"no layout fits {p.dims.num_parameters():,} parameters (micro-batch {lay.micro_batch}, {lay.precision}) "
            f"on {p.hardware.ranks} rank(s); even the most frugal one ({what}): "
            + "; ".join(s.describe() for s in p.short))


# --------------------------------------------------------------------------- output


def render_plan(p: Plan) -> str:
    """The plan as a table a person reads: the choice, memory per tier against the budget,
    the estimate's lines, the predicted efficiency, and the ladder tried."""
    from tiertrain.estimate.report import _table, human_bytes

    lay, hw = p.layout, p.hardware
    kind = f"{p.dims.model_type} {p.dims.kind}, " if hasattr(p.dims, "model_type") else ""
    out = [f"model: {p.dims.num_parameters():,} parameters ({kind}{p.dims.n_layers} × {p.dims.hidden}, "
           f"{p.dims.n_heads} heads, vocab {p.dims.vocab}, seq {p.dims.seq_len}) | {hw.ranks} rank(s) "
           f"({hw.nodes} node × {hw.ranks_per_node}) | {lay.precision} | micro-batch {lay.micro_batch}",
           f"hardware: {hw.source}; " + ("no accelerator (device = host RAM)" if hw.shared
                                         else f"device {human_bytes(hw.device_memory)}")
           + f", host RAM {human_bytes(hw.host_memory)}/node"
           + (f", NVMe {human_bytes(hw.nvme_bytes)}/node at {hw.swap_dir}" if hw.nvme_bytes else ", no NVMe tier")
           + f"; {hw.reserve:.0%} of each tier kept free", ""]
    status = "FITS" if p.fits else "DOES NOT FIT"
    out.append(f"plan ({status}; rung: {p.rung})")
    rows = [["setting", "value"],
            ["zero.stage", str(lay.stage)],
            ["zero.offload_optimizer", Tier(lay.optimizer_tier).config_name],
            ["zero.offload_params", Tier(lay.param_tier).config_name],
            ["activations.checkpoint_every", str(lay.checkpoint_interval)],
            ["activations.recompute", lay.recompute],
            ["activations.offload", _checkpoint_offload(lay).config_name],
            ["tile_factor", str(lay.tile_factor)]]
    out += _table(rows, right=set()) + [""]
    mem = [["tier", "predicted per rank", "build peak per rank", "budget per rank", "use"]]
    build = p.build_usage or {}
    for t, used in p.usage.items():
        have = p.budget.get(t, 0)
        built = build.get(t, 0)
        if not used and not have and not built:
            continue
        worst = max(used, built)
        share = f"{worst / have:.0%}" if have else ("-" if not worst else "no tier")
        mem.append([str(t), human_bytes(used), human_bytes(built) if t in build and t != Tier.NVME else "-",
                    human_bytes(have), share])
    out += _table(mem, right={1, 2, 3, 4}) + [f"peak at: {p.estimate.peak_at}"]
    b = p.estimate.build
    if b is not None:
        n = hw.ranks_per_node
        how = ("partitioned (partitioned_init: fp32 shards, one module whole at a time)" if b.partitioned
               else "whole in fp32 on every rank, then flattened")
        out.append(f"build peak: model built {how}; {human_bytes(b.host)} host RAM per rank, "
                   f"{human_bytes(b.host * n)} per node ({n} ranks), at {b.where}")
    out.append("")
    lines = [["item", "bytes", "tier"]] + [[l.name, human_bytes(l.bytes), l.tier] for l in p.estimate.lines if l.bytes]
    out += _table(lines, right={1}) + [""]
    if p.efficiency:
        eff = [["state moved", "tier", "AIT (FLOP/B)", "bandwidth", "efficiency"]]
        for s in p.efficiency["states"]:
            eff.append([s["state"], s["tier"], f"{s['ait']:,.0f}",
                        "-" if s["bandwidth"] is None else f"{s['bandwidth'] / 1e9:.2f} GB/s",
                        "-" if s["efficiency"] is None else f"{s['efficiency']:.1%}"])
        if len(eff) > 1:
            out += _table(eff, right={2, 3, 4})
        out.append(f"predicted efficiency {p.efficiency['combined']:.1%} of {p.efficiency['peak_flops'] / 1e9:,.1f} "
                   f"GFLOP/s per rank (transfers {p.efficiency['transfer']:.1%} × recomputation "
                   f"{p.efficiency['recompute_factor']:.1%}; ZeRO-Infinity §4, no overlap)")
    else:
        out.append("predicted efficiency: no compute peak known (probe this machine, or give --peak-tflops)")
    if not p.fits:
        out += ["", "error: " + short_message(p)]
    out += [f"note: {n}" for n in p.notes]
    out.append(f"tried {len(p.tried)} layout(s); `--json` lists them")
    return "\n".join(out) + "\n"


def plan_to_json(p: Plan, indent: int | None = 2) -> str:
    return json.dumps(p.to_dict(), indent=indent, ensure_ascii=False, default=str)
