"""What both memory accountings of tiertrain.estimate are written in: the element size of each
compute precision, the memory tiers and one labelled line of an estimate.

The papers' formulas (:mod:`tiertrain.estimate.memory`) and the engine's buffer-by-buffer
accounting (:mod:`tiertrain.estimate.peak`) both produce :class:`EstimateLine` items; memory.py
also calls into peak.py for engine accounting, so these shared pieces live here, below both,
and each of the two imports them from this module (memory.py re-exports them, their public
home).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

PRECISION_BYTES: Mapping[str, int] = MappingProxyType({"fp32": 4, "bf16": 2, "fp16": 2})
"""Bytes per element of each compute precision (read-only)."""

TIERS: tuple[str, ...] = ("device", "cpu", "nvme")
"""Memory tiers, fastest first (ZeRO-Infinity §5 offload engine)."""

__all__ = ["PRECISION_BYTES", "TIERS", "EstimateLine"]


@dataclass(frozen=True)
class EstimateLine:
    """One labelled per-rank memory item."""

    name: str
    """What the bytes hold (e.g. "optimizer states")."""
    bytes: int
    """Bytes per rank."""
    tier: str
    """Tier holding them: "device", "cpu" or "nvme"."""
    formula: str
    """The formula and its source (e.g. "K·Ψ/N_d (ZeRO §5.1, P_os)")."""
