"""The papers' memory formulas, reproduced exactly: ZeRO §5 Table 1 / Table 2 (16 B per
parameter of mixed-precision Adam), the ZeRO-Infinity §3 memory requirements (model states,
activation checkpoints, MSWM, AWM), and per-layer activation memory after Korthikanti et al.
2022 §4 (an approximation). GB in the papers' tables is 1e9 bytes.
"""

from __future__ import annotations

from typing import Any

__all__ = [
    "zero_model_state_bytes",
    "model_state_bytes",
    "zero_max_parameters",
    "infinity_parameters",
    "infinity_model_state_bytes",
    "infinity_activation_checkpoint_bytes",
    "infinity_mswm_bytes",
    "infinity_awm_bytes",
    "zero_activation_bytes",
    "activation_bytes_per_layer",
    "activation_bytes_head",
]


def _positive_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    """Raise ValueError unless ``value`` is an int >= ``minimum`` (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name}={value!r} is invalid: must be an int >= {minimum}")


# --------------------------------------------------------------------------- ZeRO (paper)


def zero_model_state_bytes(
    psi: float, dp: int, stage: int, K: float = 12, param_bytes: float = 2, grad_bytes: float = 2
) -> float:
    """Per-device model-state bytes, ZeRO §5 Fig. 1 / Table 1 (mixed-precision Adam, K=12):
    stage 0: (2+2+K)Ψ; 1 (P_os): 2Ψ+2Ψ+KΨ/N_d; 2 (P_os+g): 2Ψ+(2+K)Ψ/N_d;
    3 (P_os+g+p): (2+2+K)Ψ/N_d."""
    _positive_int("zero_model_state_bytes", "dp", dp)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_model_state_bytes.stage={stage!r} is invalid: must be 0, 1, 2 or 3")
    if psi < 0:
        raise ValueError(f"zero_model_state_bytes.psi={psi!r} is invalid: must be >= 0")
    p = param_bytes * psi / (dp if stage >= 3 else 1)
    g = grad_bytes * psi / (dp if stage >= 2 else 1)
    o = K * psi / (dp if stage >= 1 else 1)
    return p + g + o


model_state_bytes = zero_model_state_bytes
"""Alias: the name the ZeRO table is usually asked for by."""


def zero_max_parameters(
    device_bytes: float, dp: int, stage: int, K: float = 12, param_bytes: float = 2,
    grad_bytes: float = 2,
) -> float:
    """Largest Ψ whose model states fit ``device_bytes`` per device: ZeRO Table 2's
    "theoretical" column assumes the whole device memory holds model states (no
    activations, buffers or fragmentation): 32 GB V100, N_d=64 -> 7.6B / 14.4B / 128B."""
    return device_bytes / zero_model_state_bytes(1.0, dp, stage, K, param_bytes, grad_bytes)


# --------------------------------------------------------------------------- ZeRO-Infinity §3


def infinity_parameters(nl: int, hd: int) -> int:
    """Ψ ≈ 12·nl·hd² (ZeRO-Infinity §3: (hd,3hd)+(hd,hd)+(hd,4hd)+(4hd,hd) per block)."""
    return 12 * nl * hd * hd


def infinity_model_state_bytes(nl: int, hd: int) -> int:
    """Model states ≈ 240·nl·hd² bytes = 20 B/param (ZeRO-Infinity §3)."""
    return 240 * nl * hd * hd


def infinity_activation_checkpoint_bytes(
    bsz: int, seq: int, hd: int, nl: int, ci: int, dtype_bytes: int = 2
) -> float:
    """Activation checkpoints ≈ 2·bsz·seq·hd·nl/ci bytes (ZeRO-Infinity §3; the 2 is a
    16-bit element, ``dtype_bytes`` generalises it)."""
    _positive_int("infinity_activation_checkpoint_bytes", "ci", ci)
    return dtype_bytes * bsz * seq * hd * nl / ci


def infinity_mswm_bytes(hd: int, tile_factor: int = 1) -> float:
    """Model-state working memory = 4·hd·4hd bytes: 16-bit params + grads of the
    (hd -> 4hd) linear (ZeRO-Infinity §3 MSWM); memory-centric tiling (§5.1.3) divides it
    by the tile factor."""
    _positive_int("infinity_mswm_bytes", "tile_factor", tile_factor)
    return 4 * hd * 4 * hd / tile_factor


def infinity_awm_bytes(bsz: int, seq: int, ci: int, hd: int, attn_heads: int) -> int:
    """Activation working memory = bsz·seq·ci·(16·hd + 2·attn_heads·seq) bytes
    (ZeRO-Infinity §3 AWM: activations recomputed between two checkpoints)."""
    return bsz * seq * ci * (16 * hd + 2 * attn_heads * seq)


# --------------------------------------------------------------------------- activations


def zero_activation_bytes(hd: int, bsz: int, seq: int, nl: int, dtype_bytes: int = 2) -> int:
    """ZeRO §3.2's rough GPT-2 activation size: 12·hd·bsz·seq·nl elements of 16-bit
    (1.5B GPT-2, seq 1K, batch 32: ~60 GB). Coarser than :func:`activation_bytes_per_layer`."""
    return dtype_bytes * 12 * hd * bsz * seq * nl


def activation_bytes_per_layer(
    seq: int, bsz: int, hidden: int, heads: int, dtype_bytes: int = 2, tp: int = 1,
    dropout: bool = True, stores_attention_scores: bool = True,
) -> float:
    """APPROXIMATE activation bytes one transformer layer keeps for backward, after
    Korthikanti et al. 2022 §4.1 (no sequence parallelism): with 16-bit tensors, 1-byte
    dropout masks and stored scores it is s·b·h·(10 + 24/t) + 5·a·s²·b/t, i.e. the familiar
    s·b·h·(34 + 5·a·s/h) at t=1. Elements counted: replicated LN inputs (2), attention and
    MLP inputs (2) + 2 masks; split across t: Q,K,V, proj input (4) and GELU in/out (8);
    scores: softmax (+ dropout output and mask). ``dtype_bytes`` scales the non-mask terms.
    """
    sbh = seq * bsz * hidden
    mask = 1 if dropout else 0
    dense = sbh * (4 * dtype_bytes + 2 * mask) + sbh * 12 * dtype_bytes / tp
    scores = 0.0
    if stores_attention_scores:
        per_score = (2 * dtype_bytes + mask) if dropout else dtype_bytes
        scores = heads * seq * seq * bsz * per_score / tp
    return dense + scores


def activation_bytes_head(
    seq: int, bsz: int, hidden: int, vocab: int, dtype_bytes: int = 2, dropout: bool = True
) -> float:
    """APPROXIMATE activations outside the blocks (Korthikanti et al. 2022 §4.3): embedding
    dropout mask s·b·h, final LN and head inputs 2·s·b·h elements, logits s·b·V in the
    compute dtype plus the fp32 cross-entropy copy 4·s·b·V."""
    sbh = seq * bsz * hidden
    return sbh * (1 if dropout else 0) + 2 * sbh * dtype_bytes + seq * bsz * vocab * (dtype_bytes + 4)
