"""ZeRO-Infinity §4 bandwidth model: arithmetic intensity (AIT) and predicted efficiency.

AIT is compute per iteration divided by bytes moved to or from a memory tier (§4.1):

* compute per iteration = 2·4·bsz·seq·Ψ FLOPs (forward 1x, backward 2x, recompute 1x);
* parameters and gradients: 4 moves of 16-bit data = 2·4·Ψ bytes   -> AIT = seq·bsz;
* optimizer states: read + written once, 2·16·Ψ bytes               -> AIT = seq·bsz/4;
* activation checkpoints: saved + fetched once, 4·(nl/ci)·hd·seq·bsz bytes, with
  Ψ = 12·nl·hd²                                                     -> AIT = 24·hd·ci.

With no overlap of compute and transfer (§4.2), efficiency = ait·bw / (ait·bw + peak).
The paper's Figure 3 uses peak = 70 TFLOP/s (measured average on a V100 DGX-2) and a
fixed sequence length of 1024 (seed notes 002 on ZeRO-Infinity Fig. 3).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

__all__ = [
    "iteration_flops",
    "ait_params_grads",
    "ait_optimizer_states",
    "ait_activation_checkpoints",
    "efficiency",
    "required_bandwidth",
    "combined_efficiency",
    "TierEfficiency",
    "BandwidthPrediction",
    "predict_efficiency",
]


def _positive(name: str, value: Any) -> float:
    """Return float(value) or raise ValueError naming ``name`` unless it is a number > 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{name}={value!r} is invalid: must be a number > 0")
    return float(value)


def iteration_flops(bsz: int, seq: int, psi: float) -> float:
    """Compute per iteration = 2·4·bsz·seq·Ψ FLOPs (ZeRO-Infinity §4.1)."""
    return 2 * 4 * bsz * seq * psi


def ait_params_grads(seq: int, bsz: int) -> float:
    """AIT w.r.t. parameters and gradients = seq·bsz (ZeRO-Infinity §4.1)."""
    return _positive("ait_params_grads.seq", seq) * _positive("ait_params_grads.bsz", bsz)


def ait_optimizer_states(seq: int, bsz: int) -> float:
    """AIT w.r.t. optimizer states = seq·bsz/4 (ZeRO-Infinity §4.1)."""
    return _positive("ait_optimizer_states.seq", seq) * _positive("ait_optimizer_states.bsz", bsz) / 4


def ait_activation_checkpoints(hd: int, ci: int) -> float:
    """AIT w.r.t. activation checkpoints = 24·hd·ci (ZeRO-Infinity §4.1)."""
    return 24 * _positive("ait_activation_checkpoints.hd", hd) * _positive("ait_activation_checkpoints.ci", ci)


def efficiency(ait: float, bw: float, peak: float) -> float:
    """ait·bw / (ait·bw + peak): compute time over compute + transfer time with no overlap
    (ZeRO-Infinity §4.2). ``bw`` in bytes/s, ``peak`` in FLOP/s."""
    ait, bw, peak = _positive("efficiency.ait", ait), _positive("efficiency.bw", bw), _positive("efficiency.peak", peak)
    return ait * bw / (ait * bw + peak)


def required_bandwidth(ait: float, peak: float, target_efficiency: float) -> float:
    """Bytes/s at which :func:`efficiency` reaches ``target_efficiency`` (in (0, 1)):
    bw = target·peak / (ait·(1 - target)), the inverse of ZeRO-Infinity §4.2's formula."""
    ait, peak = _positive("required_bandwidth.ait", ait), _positive("required_bandwidth.peak", peak)
    if isinstance(target_efficiency, bool) or not isinstance(target_efficiency, (int, float)) \
            or not 0 < target_efficiency < 1:
        raise ValueError(
            f"required_bandwidth.target_efficiency={target_efficiency!r} is invalid: must be in (0, 1)"
        )
    return target_efficiency * peak / (ait * (1 - target_efficiency))


def combined_efficiency(pairs: list[tuple[float, float]], peak: float) -> float:
    """Efficiency when several states move serially with compute, none overlapped:
    1 / (1 + Σ peak/(ait_i·bw_i)). Not in the paper; it reduces to §4.2's formula for
    one state and is the pessimistic bound the planner uses."""
    peak = _positive("combined_efficiency.peak", peak)
    return 1.0 / (1.0 + sum(peak / (_positive("ait", a) * _positive("bw", b)) for a, b in pairs))


@dataclass
class TierEfficiency:
    """Predicted efficiency for one kind of state moved over one link."""

    state: str
    """"params+grads", "optimizer states" or "activation checkpoints"."""
    ait: float
    """Arithmetic intensity, FLOPs per byte moved."""
    bandwidth: float
    """Bytes/s of the link the state moves over."""
    efficiency: float
    """ait·bw / (ait·bw + peak)."""
    formula: str
    """Where the AIT comes from."""


@dataclass
class BandwidthPrediction:
    """Per-state efficiencies and their no-overlap combination."""

    peak: float
    """Achievable compute peak, FLOP/s."""
    states: list[TierEfficiency]
    """One entry per state that moves off the device."""
    combined: float
    """combined_efficiency over all entries (1.0 when nothing moves)."""

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict."""
        return asdict(self)


def predict_efficiency(
    seq: int, bsz: int, hidden: int, peak: float, *, ci: int = 1,
    params_grads_bw: float | None = None, optimizer_bw: float | None = None,
    checkpoint_bw: float | None = None,
) -> BandwidthPrediction:
    """Efficiency of each offloaded state given the bandwidth of its link (None = the
    state stays on the device and costs nothing), ZeRO-Infinity §4."""
    peak = _positive("predict_efficiency.peak", peak)
    states = []
    for name, bw, ait, f in (
        ("params+grads", params_grads_bw, lambda: ait_params_grads(seq, bsz), "seq·bsz"),
        ("optimizer states", optimizer_bw, lambda: ait_optimizer_states(seq, bsz), "seq·bsz/4"),
        ("activation checkpoints", checkpoint_bw, lambda: ait_activation_checkpoints(hidden, ci), "24·hd·ci"),
    ):
        if bw is None:
            continue
        a = ait()
        states.append(TierEfficiency(name, a, float(bw), efficiency(a, bw, peak),
                                     f"AIT = {f} (ZeRO-Infinity §4.1)"))
    combined = combined_efficiency([(s.ait, s.bandwidth) for s in states], peak) if states else 1.0
    return BandwidthPrediction(peak=peak, states=states, combined=combined)
