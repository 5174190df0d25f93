"""What both memory accountings of tiertrain.estimate are written in: the element size of each
compute precision, the memory tiers and one labelled line of an estimate.

The papers' formulas (:mod:`tiertrain.estimate.formulas`) and the engine's buffer-by-buffer
accounting (:mod:`tiertrain.estimate.peak`) both produce :class:`EstimateLine` items; memory.py
also calls into peak.py for engine accounting, so these shared pieces live here, below both,
and each of the two imports them from this module (memory.py re-exports them, their public
home).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from ..tiers import Tier

PRECISION_BYTES: Mapping[str, int] = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2})
"""Bytes per element of each compute precision (read-only)."""

TIERS: tuple[Tier, ...] = (Tier.DEVICE, Tier.CPU, Tier.NVME)
"""Memory tiers, fastest first (ZeRO-Infinity §5 offload engine): the members of
:class:`tiertrain.tiers.Tier` (str-valued, so they also compare equal to "device" etc.)."""

__all__ = ["PRECISION_BYTES", "TIERS", "Tier", "EstimateLine", "accumulator_line", "landing_line", "masters_are_param_shards",
           "second_generation_lines"]


@dataclass(frozen=True)
class EstimateLine:
    """One labelled per-rank memory item."""

    name: str
    """What the bytes hold (e.g. "optimizer states")."""
    bytes: int
    """Bytes per rank."""
    tier: Tier
    """Tier holding them (a spelling Tier accepts, e.g. "cpu", is converted to the member)."""
    formula: str
    """The formula and its source (e.g. "K·Ψ/N_d (ZeRO §5.1, P_os)")."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "tier", Tier(self.tier))


def masters_are_param_shards(lay) -> bool:
    """Whether ``lay`` (a ZeroLayout) keeps fp32 parameter shards and the optimizer both on
    NVMe: the optimizer's master records are then the shards (one copy, counted with the
    parameters; tiertrain/offload/shard_store.py OptimizerMasterShards)."""
    return (lay.stage == 3 and lay.precision == "fp32" and Tier(lay.param_tier) is Tier.NVME
            and Tier(lay.optimizer_tier) is Tier.NVME)


def second_generation_lines(lay, state_bytes: int) -> list[EstimateLine]:
    """The NVMe optimizer's second generation of its state (master + moments, state_bytes per
    rank) under ``lay`` (a ZeroLayout): a transactional step writes the other generation; none
    with zero.nvme_in_place or with the optimizer on another tier."""
    if Tier(lay.optimizer_tier) is not Tier.NVME or lay.nvme_in_place:
        return []
    return [EstimateLine("optimizer state, second generation", state_bytes, Tier.NVME,
                         "master + moments again: a transactional NVMe step writes the other "
                         "generation (0 with zero.nvme_in_place)")]


def overlap_second_set_lines(lay, masters: int, moments: int, shard_elements: int) -> list[EstimateLine]:
    """The second set of masters and moments the CPU-tier step overlapped with backward writes
    into (zero.overlap_cpu_step, tiertrain/update/overlapped_host.py), under ``lay`` (a
    ZeroLayout): masters + moments again; where the fp32 shards are their own masters
    (masters == 0), the step gives them masters of their own, and a second set of those."""
    if not lay.overlap_cpu_step:
        return []
    second_masters = masters if masters else 8 * shard_elements
    return [EstimateLine("optimizer state, second set (overlap_cpu_step)", second_masters + moments, Tier.CPU,
                         "master + moments again, written by the step running in backward and swapped in by "
                         "step() (zero.overlap_cpu_step)" + ("" if masters else "; with masters of their own for "
                                                             "the fp32 shards: 8·shard"))]


ACCUMULATOR_LINE = "gradient accumulators (accumulate_on_device)"
"""The name of the line of :func:`accumulator_line`."""


def accumulator_line(nbytes: int, detail: str = "") -> EstimateLine:
    """The device buffers of zero.accumulate_on_device (stages 2-3): every trained unit's whole
    gradient in fp32, kept over the micro-batches of a step and reduced once, at its boundary
    (tiertrain/zero/accumulation.py)."""
    return EstimateLine(ACCUMULATOR_LINE, nbytes, Tier.DEVICE,
                        "4·Ψ' (whole fp32 gradient of every trained unit on the device, reduced once per "
                        "step; zero.accumulate_on_device)" + detail)


LANDING_LINE = "gradient landing buffers (reduced every micro-batch)"
"""The name of the line of :func:`landing_line`."""


def landing_line(nbytes: int, detail: str = "") -> EstimateLine:
    """The CPU tier's landing buffers (stages 2-3, optimizer on the CPU tier, gradients reduced
    every micro-batch of several): one more fp32 gradient shard per unit in pinned host memory,
    into which each non-boundary reduction is copied without blocking backward
    (tiertrain/zero/reducer.py's defer_landing)."""
    return EstimateLine(LANDING_LINE, nbytes, Tier.CPU,
                        "4·Ψ/N_d (one more fp32 gradient shard per unit, pinned: the copy of each "
                        "micro-batch's reduced gradient overlaps backward)" + detail)
