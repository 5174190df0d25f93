"""One candidate layout for the planner, evaluated: its estimate (:func:`tiertrain.estimate.estimate`),
the bytes per tier while training and while building the model against the hardware's
budget, what is short, and its predicted efficiency by ZeRO-Infinity §4's bandwidth model
with the recomputation it adds.
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

from tiertrain.estimate.bandwidth import (
    ait_activation_checkpoints,
    ait_optimizer_states,
    ait_params_grads,
)
from tiertrain.estimate.dims import ModelDims
from tiertrain.estimate.hardware import RAM, Hardware, Shortfall
from tiertrain.estimate.layout import ZeroLayout
from tiertrain.estimate.memory import Estimate, estimate
from tiertrain.estimate.own_checkpointing import with_own_checkpointing
from tiertrain.estimate.units import engine_grad_tier, gpt_meta_model
from tiertrain.tiers import Tier

if False:  # typing only
    from tiertrain.estimate.modules import HFModelDims  # noqa: F401

__all__ = ["Candidate", "evaluate", "predicted_efficiency", "recomputed_blocks", "GRADS_IN_RAM_MB"]


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
        return None if bw is None else bw * (lay.zero_ranks if partitioned else 1)

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
                       "formula": f"AIT = {f} (ZeRO-Infinity §4.1)" + (f", ×{lay.zero_ranks} ranks (bandwidth-centric)" if part else "")})
    counted, _ = with_own_checkpointing(lay, dims)  # (a model's own checkpoints recompute as the engine's)
    recompute = 3 / (3 + recomputed_blocks(counted, dims.n_layers) / dims.n_layers)
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
