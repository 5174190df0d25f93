"""Memory model of a training run: the papers' formulas and tiertrain's own accounting.

Two families of functions live here, and their names say which is which:

* ``zero_*`` and ``infinity_*`` reproduce the papers exactly (docs/concepts.md#zero and docs/concepts.md#zero-infinity):
  ZeRO §5 Table 1 / Table 2 (16 B per parameter of mixed-precision Adam) and the
  ZeRO-Infinity §3 memory requirements (model states, activation checkpoints, MSWM, AWM).
* ``engine_*`` and :func:`estimate` describe what *tiertrain's engine* keeps, byte for
  byte: params in the compute dtype, fp32 gradients, fp32 master weights only for 16-bit
  compute, fp32 Adam moments, and shards padded to ``ceil(n / dp)``. With a model given as
  ModelDims, HFModelDims (:mod:`tiertrain.estimate.modules`: any Hugging Face model of a
  modelled family) or a module (tp = pp = 1), :func:`estimate` goes further, through
  :mod:`tiertrain.estimate.peak`: the engine's own layout (bucket and unit padding), the
  activations of tiertrain's GPT (or of the Hugging Face model), the engine's transient
  buffers at the simulated peak of a step, and the process overhead — the per-rank peak,
  checked against real runs in bench/results/estimate_accuracy.md (and _hf.md).

Activation memory without checkpointing follows Korthikanti et al. 2022 ("Reducing
Activation Recomputation in Large Transformer Models", §4) and is an approximation.
GB in the papers' tables is 1e9 bytes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from .lines import PRECISION_BYTES, TIERS, EstimateLine, Tier, masters_are_param_shards, second_generation_lines
from .activations import gpt_activation_bytes
from .build_peak import engine_build_peak
from .peak import engine_estimate_lines
from .units import engine_grad_tier

__all__ = [
    "PRECISION_BYTES",
    "TIERS",
    "Tier",
    "ModelDims",
    "ZeroLayout",
    "Estimate",
    "EstimateLine",
    "estimate",
    "estimate_from_args",
    "padded_shard",
    "ModelStateBytes",
    "count_module_parameters",
    "module_parameter_sizes",
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
    "engine_model_state_bytes",
]


def _positive_int(owner: str, name: str, value: Any, minimum: int = 1) -> None:
    """Raise ValueError unless ``value`` is an int >= ``minimum`` (bools rejected)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{owner}.{name}={value!r} is invalid: must be an int >= {minimum}")


# --------------------------------------------------------------------------- model size


@dataclass
class ModelDims:
    """Shape of a GPT-style decoder (tiertrain.models.gpt.GPT's block structure)."""

    n_layers: int
    """Number of transformer blocks (nl)."""
    hidden: int
    """Model width (hd)."""
    n_heads: int
    """Attention heads (attn_heads); must divide ``hidden``."""
    vocab: int
    """Vocabulary size (V)."""
    seq_len: int
    """Sequence length (seq); also the size of the learned position table."""
    ffn_mult: int = 4
    """MLP inner width as a multiple of ``hidden``."""
    tie_embeddings: bool = True
    """Output head shares the token-embedding weight (then it adds no parameters)."""
    dropout: bool = False
    """Dropout is active in training, so its 1-byte masks are kept for backward."""
    stores_attention_scores: bool = False
    """Attention keeps the seq x seq score/softmax tensors (False for fused SDPA/flash)."""
    bias: bool = True
    """Linear layers carry biases (GPTConfig.bias)."""

    def validate(self) -> "ModelDims":
        """Raise ValueError naming the first invalid field; return self when valid."""
        for name in ("n_layers", "hidden", "n_heads", "vocab", "seq_len", "ffn_mult"):
            _positive_int("ModelDims", name, getattr(self, name))
        if self.hidden % self.n_heads:
            raise ValueError(
                f"ModelDims.n_heads={self.n_heads} is invalid: must divide "
                f"hidden={self.hidden}"
            )
        for name in ("tie_embeddings", "dropout", "stores_attention_scores", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"ModelDims.{name}={getattr(self, name)!r} is invalid: must be a bool"
                )
        return self

    @classmethod
    def from_gpt_config(cls, config: Any) -> "ModelDims":
        """Dims of ``tiertrain.models.gpt.GPTConfig`` (read by attribute, not imported)."""
        return cls(
            n_layers=config.n_layers, hidden=config.hidden, n_heads=config.n_heads,
            vocab=config.vocab_size, seq_len=config.seq_len, ffn_mult=config.ffn_mult,
            tie_embeddings=config.tie_embeddings, dropout=float(config.dropout) > 0.0,
            bias=bool(getattr(config, "bias", True)),
        ).validate()

    def block_parameters(self) -> int:
        """One block: ln1 2h, qkv h·3h+3h, proj h·h+h, ln2 2h, fc1 h·fh+fh, fc2 fh·h+h
        (the bias terms only with ``bias``)."""
        h, f = self.hidden, self.ffn_mult * self.hidden
        b = 1 if self.bias else 0
        return 2 * h + (3 * h * h + b * 3 * h) + (h * h + b * h) + 2 * h + (h * f + b * f) + (f * h + b * h)

    def num_parameters(self) -> int:
        """Exact count: nl blocks + token (V·h) and position (seq·h) embeddings + final
        LayerNorm (2h) + head h·V without bias (0 when tied to the embedding)."""
        self.validate()
        h = self.hidden
        head = 0 if self.tie_embeddings else h * self.vocab
        return self.n_layers * self.block_parameters() + (self.vocab + self.seq_len) * h + 2 * h + head

    def paper_parameters(self) -> int:
        """ZeRO-Infinity §3 approximation Ψ ≈ 12·nl·hd² (four linears per block)."""
        return infinity_parameters(self.n_layers, self.hidden)

    def largest_operator_elements(self) -> int:
        """Weight elements of the biggest single linear: max(h·ffn·h, V·h) (fc1 or head)."""
        return max(self.ffn_mult * self.hidden * self.hidden, self.vocab * self.hidden)


def count_module_parameters(module_or_factory: nn.Module | Callable[[], nn.Module]) -> int:
    """Distinct parameters of a module; a factory is built on the meta device (nothing
    allocated). Shared (tied) parameters are counted once (``Module.parameters`` dedups)."""
    return sum(module_parameter_sizes(module_or_factory))


def module_parameter_sizes(module_or_factory: nn.Module | Callable[[], nn.Module]) -> list[int]:
    """numel of each distinct parameter tensor, in registration order (meta device)."""
    if isinstance(module_or_factory, nn.Module):
        module = module_or_factory
    elif callable(module_or_factory):
        with torch.device("meta"):
            module = module_or_factory()
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"module_factory returned {type(module).__name__}: must return an nn.Module"
            )
    else:
        raise ValueError(
            f"module_or_factory={module_or_factory!r} is invalid: must be an nn.Module "
            "or a zero-argument callable returning one"
        )
    return [p.numel() for p in module.parameters()]


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


# --------------------------------------------------------------------------- engine


@dataclass
class ModelStateBytes:
    """Per-rank bytes of each model-state category as the engine stores it."""

    params: int
    """Parameters in the compute dtype (partitioned at stage 3)."""
    grads: int
    """fp32 gradient accumulators (partitioned at stage >= 2)."""
    master: int
    """fp32 master weights (partitioned at stage >= 1); 0 when not needed."""
    optimizer: int
    """Adam exp_avg + exp_avg_sq, fp32 (partitioned at stage >= 1)."""

    @property
    def total(self) -> int:
        """Sum of the four categories."""
        return self.params + self.grads + self.master + self.optimizer

    def to_dict(self) -> dict[str, int]:
        """Plain dict including ``total``."""
        return {**asdict(self), "total": self.total}


def engine_model_state_bytes(
    psi: int | Sequence[int], dp: int, stage: int, precision: str = "bf16",
    alignment: int = 1, separate_master: bool | None = None,
) -> ModelStateBytes:
    """Per-rank model states of tiertrain's engine (not the paper's 16 B/param):
    params P_B = 4 (fp32) or 2 (bf16/fp16); grads always fp32 (4 B); master fp32 (4 B) only
    when compute is 16-bit (an fp32 param shard is its own master) unless
    ``separate_master`` forces it (e.g. the optimizer runs on another tier than the
    params); Adam moments 8 B. Partitioned tensors hold ``padded_shard(n, dp, alignment)``
    = ceil(n / (dp·alignment))·alignment elements per rank: stage 1 partitions master +
    Adam, stage 2 also grads, stage 3 also params. ``psi`` is a total (padded as one flat
    buffer) or a list of per-tensor sizes (each padded separately)."""
    if precision not in PRECISION_BYTES:
        raise ValueError(
            f"engine_model_state_bytes.precision={precision!r} is invalid: "
            f"must be one of {sorted(PRECISION_BYTES)}"
        )
    _positive_int("engine_model_state_bytes", "dp", dp)
    _positive_int("engine_model_state_bytes", "alignment", alignment)
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"engine_model_state_bytes.stage={stage!r} is invalid: must be 0, 1, 2 or 3")
    sizes = [int(psi)] if isinstance(psi, (int, float)) else [int(n) for n in psi]
    if any(n < 0 for n in sizes):
        raise ValueError(f"engine_model_state_bytes.psi={psi!r} is invalid: sizes must be >= 0")
    full = sum(sizes)
    shard = sum(padded_shard(n, dp, alignment) for n in sizes)
    pb = PRECISION_BYTES[precision]
    master_needed = precision != "fp32" if separate_master is None else separate_master
    return ModelStateBytes(
        params=pb * (shard if stage >= 3 else full),
        grads=4 * (shard if stage >= 2 else full),
        master=(4 if master_needed else 0) * (shard if stage >= 1 else full),
        optimizer=8 * (shard if stage >= 1 else full),
    )


# --------------------------------------------------------------------------- layout


def padded_shard(n: int, dp: int, alignment: int = 1) -> int:
    """Elements one of ``dp`` ranks holds of an ``n``-element partitioned tensor padded to
    a multiple of dp·alignment: ceil(n / (dp·alignment))·alignment (ceil(n/dp) at 1)."""
    return -(-n // (dp * alignment)) * alignment


_TIER_FIELDS = ("optimizer_tier", "param_tier", "grad_tier", "checkpoint_tier")


@dataclass
class ZeroLayout:
    """How a model is laid out over ranks and memory tiers (the estimator's input)."""

    dp: int = 1
    """Data-parallel degree N_d (ZeRO partitions across these ranks)."""
    tp: int = 1
    """Tensor-parallel degree t (Megatron §2.3); divides params and the split activations."""
    pp: int = 1
    """Pipeline-parallel degree p (Megatron §2.2); divides params across stages."""
    stage: int = 0
    """ZeRO stage: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters (ZeRO §5)."""
    precision: str = "bf16"
    """Compute dtype of params and activations: "fp32", "bf16" or "fp16"."""
    optimizer_tier: Tier = Tier.DEVICE
    """Where fp32 master weights and Adam moments live: any :class:`~tiertrain.tiers.Tier`."""
    param_tier: Tier = Tier.DEVICE
    """Where the (stage-3 partitioned) parameters live; off-device requires stage 3."""
    grad_tier: Tier = Tier.DEVICE
    """Where the gradient partition lives between backward and the optimizer step."""
    checkpoint_tier: Tier = Tier.DEVICE
    """Where activation checkpoints live: Tier.DEVICE or Tier.CPU (ZeRO-R / ZeRO-Infinity §5)."""
    checkpoint_interval: int = 0
    """ci, transformer blocks between two activation checkpoints; 0 = no checkpointing.
    Engine accounting follows ``activations.checkpoint_every``: blocks 0, ci, 2ci, … are
    checkpointed (⌈nl/ci⌉ checkpoints, as in the paper) and recomputed in backward; the
    other blocks keep their activations."""
    micro_batch: int = 1
    """bsz, sequences per micro-batch per rank."""
    tile_factor: int = 1
    """Memory-centric tiling factor of the largest linear (ZeRO-Infinity §5.1.3)."""
    alignment: int = 1
    """Padding unit in elements: a partitioned tensor is padded to a multiple of dp·alignment."""
    accounting: str = "engine"
    """"engine" (tiertrain's dtypes) or "paper" (ZeRO's 2+2+K bytes per parameter)."""
    ranks_per_node: int = 0
    """Ranks sharing one node's CPU memory and NVMe; 0 = all dp·tp·pp ranks on one node."""
    bucket_mb: float = 25.0
    """zero.bucket_mb: stage 0–2 gradient buckets (units) in MiB of fp32 (engine accounting)."""
    nvme_in_place: bool = False
    """zero.nvme_in_place: the NVMe optimizer keeps one generation of its state on disk (else two:
    each step writes the other generation and commits it, tiertrain/update/nvme/optimizer.py)."""
    nvme_grads_in_ram_mb: float = 0.0
    """zero.nvme_grads_in_ram_mb: with nvme_in_place, the reduced gradient shards held for the
    step running in backward are capped at this many MiB plus one unit's (0: every shard)."""
    nvme_kept_units: int = 4
    """zero.nvme_kept_units: parameters on NVMe, read staging tensors kept with their values per
    shard size, and as many handed to the NVMe step when its masters are the shards (each one
    unit's shard of RAM; tiertrain/offload/shard_store.py NVMeShards, OptimizerMasterShards)."""
    prefetch_mb: float = 0.0
    """zero.prefetch_mb: stage-3 parameters gathered ahead of use, MiB (0 is the CPU default)."""
    persistence_threshold: int = 0
    """zero.persistence_threshold: stage-3 parameters this small stay whole on every rank."""
    backend: str = "gloo"
    """Collective backend: "gloo" (CPU; with more than 2 ranks its reduce-scatter and
    all-gather stage a full-size copy) or "nccl"."""
    recompute: str = "block"
    """activations.recompute: "block" (a checkpointed block keeps its input) or "selective"
    (also its matmul and fused-attention outputs; engine accounting only)."""

    def __post_init__(self) -> None:
        # A tier given by any spelling Tier accepts ("cpu", "none", a member) becomes the
        # member; anything else is left for validate() to name.
        for name in _TIER_FIELDS:
            try:
                setattr(self, name, Tier(getattr(self, name)))
            except (ValueError, TypeError):
                pass

    def validate(self) -> "ZeroLayout":
        """Raise ValueError naming the first invalid field; return self when valid."""
        self.__post_init__()  # (tier fields assigned after construction)
        for name in ("dp", "tp", "pp", "micro_batch", "tile_factor", "alignment"):
            _positive_int("ZeroLayout", name, getattr(self, name))
        for name in ("checkpoint_interval", "ranks_per_node"):
            _positive_int("ZeroLayout", name, getattr(self, name), minimum=0)
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeroLayout.stage={self.stage!r} is invalid: must be 0, 1, 2 or 3")
        if self.precision not in PRECISION_BYTES:
            raise ValueError(
                f"ZeroLayout.precision={self.precision!r} is invalid: "
                f"must be one of {sorted(PRECISION_BYTES)}"
            )
        for name in ("optimizer_tier", "param_tier", "grad_tier"):
            if not isinstance(getattr(self, name), Tier):
                raise ValueError(
                    f"ZeroLayout.{name}={getattr(self, name)!r} is invalid: must be one of "
                    f"{[t.value for t in TIERS]}"
                )
        if self.checkpoint_tier not in (Tier.DEVICE, Tier.CPU):
            shown = self.checkpoint_tier.value if isinstance(self.checkpoint_tier, Tier) else self.checkpoint_tier
            raise ValueError(
                f"ZeroLayout.checkpoint_tier={shown!r} is invalid: "
                "must be 'device' or 'cpu'"
            )
        if self.param_tier is not Tier.DEVICE and self.stage != 3:
            raise ValueError(
                f"ZeroLayout.param_tier={self.param_tier.value!r} is invalid with stage={self.stage}: "
                "parameters can leave the device only when partitioned (stage 3)"
            )
        if self.recompute not in ("block", "selective"):
            raise ValueError(f"ZeroLayout.recompute={self.recompute!r} is invalid: must be 'block' or 'selective'")
        if self.recompute == "selective" and (self.accounting == "paper" or not self.checkpoint_interval):
            raise ValueError("ZeroLayout.recompute='selective' is invalid with "
                             + ("accounting='paper' (the papers checkpoint whole blocks; use accounting='engine')"
                                if self.accounting == "paper" else
                                "checkpoint_interval=0 (no block is checkpointed; use 'block')"))
        if self.accounting not in ("engine", "paper"):
            raise ValueError(
                f"ZeroLayout.accounting={self.accounting!r} is invalid: must be 'engine' or 'paper'"
            )
        for name in ("bucket_mb", "prefetch_mb"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 \
                    or (name == "bucket_mb" and value == 0):
                raise ValueError(f"ZeroLayout.{name}={value!r} is invalid: must be a number "
                                 + ("> 0" if name == "bucket_mb" else ">= 0"))
        _positive_int("ZeroLayout", "persistence_threshold", self.persistence_threshold, minimum=0)
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"ZeroLayout.backend={self.backend!r} is invalid: must be 'gloo' or 'nccl'")
        return self

    @classmethod
    def from_config(cls, config: Any, world_size: int, backend: str = "gloo") -> "ZeroLayout":
        """The layout a ``tiertrain.config.Config`` (read by attribute, not imported) trains
        with on ``world_size`` ranks: stage, precision, micro-batch, buckets, prefetch,
        persistence, activation checkpointing, and the tiers, read with :class:`Tier` (a
        configuration may hold a member or a spelling such as "none"). The gradient tier is
        where the engine keeps gradients for that stage and optimizer tier; parameters leave
        the device only at stage 3. ``zero.prefetch_mb`` unset is 0 (the CPU default)."""
        z, acts = config.zero, config.activations
        pp, dp, tp = config.parallel.resolve(world_size)
        optimizer_tier = Tier(z.offload_optimizer)
        return cls(dp=dp, tp=tp, pp=pp, stage=z.stage, precision=config.precision.dtype,
                   optimizer_tier=optimizer_tier,
                   param_tier=Tier(z.offload_params) if z.stage == 3 else Tier.DEVICE,
                   grad_tier=engine_grad_tier(z.stage, optimizer_tier),
                   checkpoint_tier=Tier(acts.offload), checkpoint_interval=acts.checkpoint_every,
                   recompute=acts.recompute,
                   micro_batch=config.batch.micro_batch_size, bucket_mb=z.bucket_mb,
                   prefetch_mb=z.prefetch_mb or 0.0, persistence_threshold=z.persistence_threshold,
                   nvme_in_place=z.nvme_in_place, nvme_grads_in_ram_mb=z.nvme_grads_in_ram_mb,
                   nvme_kept_units=z.nvme_kept_units, backend=backend).validate()

    @property
    def world_size(self) -> int:
        """dp·tp·pp ranks."""
        return self.dp * self.tp * self.pp

    @property
    def node_ranks(self) -> int:
        """Ranks per node with the 0 default resolved."""
        return self.ranks_per_node or self.world_size


# --------------------------------------------------------------------------- estimate


@dataclass
class Estimate:
    """Result of :func:`estimate`: labelled per-rank lines plus totals per tier."""

    parameters: int
    """Ψ, parameters of the whole model."""
    layout: ZeroLayout
    """The layout estimated."""
    dims: ModelDims | None
    """Model shape when known (activation lines need it), else None."""
    lines: list[EstimateLine] = field(default_factory=list)
    """The labelled items, per rank."""
    notes: list[str] = field(default_factory=list)
    """Assumptions and omissions, in words."""
    peak_at: str = ""
    """Engine accounting: the point of the training step where the per-rank peak falls
    (the transient lines are what is live there); empty for the papers' accounting."""
    build: Any = None
    """Engine accounting: the per-rank peak of building the model and wrapping it, as
    ``tiertrain train`` does (:class:`~tiertrain.estimate.build_peak.BuildPeak`: whole in fp32 on
    every rank, or under partitioned_init at stage 3 untiled); None otherwise."""

    def build_by_tier(self) -> dict[Tier, int] | None:
        """Bytes per rank at the build's peak: {CPU: host RAM, DEVICE: accelerator, NVME: 0}
        (None when not estimated). On a machine without an accelerator all is CPU."""
        if self.build is None:
            return None
        return {Tier.DEVICE: self.build.device, Tier.CPU: self.build.host, Tier.NVME: 0}

    def by_tier(self) -> dict[Tier, int]:
        """Bytes per rank in each tier (every tier present, 0 when unused)."""
        out = {t: 0 for t in TIERS}
        for line in self.lines:
            out[line.tier] += line.bytes
        return out

    def per_node(self) -> dict[Tier, int]:
        """Bytes per node in each tier: per-rank bytes x ``layout.node_ranks``."""
        return {t: b * self.layout.node_ranks for t, b in self.by_tier().items()}

    def total(self, tier: Tier | str | None = None) -> int:
        """Bytes per rank, in one tier (a Tier, or a spelling it accepts) or (None) across all tiers."""
        tier = None if tier is None else Tier(tier)
        return sum(l.bytes for l in self.lines if tier is None or l.tier is tier)

    def line(self, name: str) -> EstimateLine:
        """The line called ``name``; ValueError listing the names when absent."""
        for l in self.lines:
            if l.name == name:
                return l
        raise ValueError(f"Estimate.line name={name!r} is unknown: lines are {[l.name for l in self.lines]}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: parameters, layout, dims, lines, per-rank and per-node tiers."""
        return {
            "parameters": self.parameters,
            "layout": asdict(self.layout),
            "dims": (self.dims.to_dict() if hasattr(self.dims, "to_dict") else asdict(self.dims))
            if self.dims else None,
            "lines": [asdict(l) for l in self.lines],
            "per_rank": self.by_tier(),
            "per_node": self.per_node(),
            "ranks_per_node": self.layout.node_ranks,
            "notes": list(self.notes),
            "peak_at": self.peak_at,
            "build_peak": None if self.build is None else {
                "partitioned": self.build.partitioned, "where": self.build.where,
                "per_rank": {"host": self.build.host, "device": self.build.device},
                "per_node": {"host": self.build.host * self.layout.node_ranks,
                             "device": self.build.device * self.layout.node_ranks},
                "items": dict(self.build.items)},
        }


ModelSpec = ModelDims | int | Sequence[int] | nn.Module | Callable[[], nn.Module]


def _resolve_model(model: ModelSpec) -> tuple[int, list[int], ModelDims | None, nn.Module | None]:
    """(Ψ, per-tensor sizes, dims or None, module or None) of any accepted model description."""
    if isinstance(model, ModelDims):
        psi = model.validate().num_parameters()
        return psi, [psi], model, None
    if hasattr(model, "activation_bytes") and hasattr(model, "meta_model"):  # modules.HFModelDims
        module = model.validate().meta_model()
        return model.num_parameters(), module_parameter_sizes(module), model, module
    if isinstance(model, int) and not isinstance(model, bool):
        if model <= 0:
            raise ValueError(f"estimate.model={model!r} is invalid: a parameter count must be > 0")
        return model, [model], None, None
    if isinstance(model, (list, tuple)):
        return sum(model), [int(n) for n in model], None, None
    if isinstance(model, nn.Module) or callable(model):
        if isinstance(model, nn.Module):
            module = model
        else:
            with torch.device("meta"):
                module = model()
        sizes = module_parameter_sizes(module)
        config = getattr(module, "config", None)
        dims = None
        if config is not None and all(hasattr(config, a) for a in ("n_layers", "hidden", "vocab_size")):
            dims = ModelDims.from_gpt_config(config)
        return sum(sizes), sizes, dims, module
    raise ValueError(
        f"estimate.model={model!r} is invalid: must be ModelDims, a parameter count, a list "
        "of tensor sizes, an nn.Module or a factory returning one"
    )


def _model_state_lines(psi: int, sizes: list[int], lay: ZeroLayout) -> list[EstimateLine]:
    """Params / grads / master / optimizer lines for ``lay.accounting``."""
    mp = lay.tp * lay.pp
    nd = lay.dp
    if lay.accounting == "paper":
        p = psi / mp
        return [
            EstimateLine("parameters", math.ceil(2 * p / (nd if lay.stage >= 3 else 1)), lay.param_tier,
                         "2Ψ/N_d (ZeRO §5.3, P_os+g+p)" if lay.stage >= 3 else "2Ψ (ZeRO §3.1, fp16 params)"),
            EstimateLine("gradients", math.ceil(2 * p / (nd if lay.stage >= 2 else 1)), lay.grad_tier,
                         "2Ψ/N_d (ZeRO §5.2, P_os+g)" if lay.stage >= 2 else "2Ψ (ZeRO §3.1, fp16 grads)"),
            EstimateLine("optimizer states", math.ceil(12 * p / (nd if lay.stage >= 1 else 1)),
                         lay.optimizer_tier,
                         "K·Ψ/N_d (ZeRO §5.1, P_os; K=12)" if lay.stage >= 1 else "K·Ψ (ZeRO §3.1, K=12)"),
        ]
    if mp > 1:  # Megatron: each model-parallel rank holds ~Ψ/(t·p) (replicated LNs ignored)
        sizes = [-(-psi // mp)]
    separate = lay.precision != "fp32" or lay.optimizer_tier != lay.param_tier
    ms = engine_model_state_bytes(sizes, nd, lay.stage, lay.precision, lay.alignment, separate)
    pb = PRECISION_BYTES[lay.precision]
    shard = "⌈Ψ'/N_d⌉" if lay.alignment == 1 else f"⌈Ψ'/(N_d·{lay.alignment})⌉·{lay.alignment}"

    def part(partitioned: bool) -> str:
        return shard if partitioned else "Ψ'"

    master = (f"4·{part(lay.stage >= 1)} (fp32 master"
              + (", ZeRO §5.1 P_os)" if lay.stage >= 1 else ", replicated)") if separate
              else "0 (fp32 params on the optimizer's tier are their own master)")
    return [
        EstimateLine("parameters", ms.params, lay.param_tier,
                     f"{pb}·{part(lay.stage >= 3)} ({lay.precision} params"
                     + (", ZeRO §5.3 P_p)" if lay.stage >= 3 else ", replicated)")),
        EstimateLine("gradients", ms.grads, lay.grad_tier,
                     f"4·{part(lay.stage >= 2)} (fp32 grads"
                     + (", ZeRO §5.2 P_g)" if lay.stage >= 2 else ", replicated)")),
        EstimateLine("master weights", ms.master, lay.optimizer_tier, master),
        EstimateLine("optimizer states", ms.optimizer, lay.optimizer_tier,
                     f"8·{part(lay.stage >= 1)} (Adam m+v fp32"
                     + (", ZeRO §5.1 P_os)" if lay.stage >= 1 else ", replicated)")),
        *second_generation_lines(lay, ms.master + ms.optimizer + (ms.params if masters_are_param_shards(lay) else 0)),
    ]



def _activation_lines(d: ModelDims, lay: ZeroLayout) -> list[EstimateLine]:
    """Activations (or checkpoints + AWM) and MSWM lines; all need the model's shape."""
    paper = lay.accounting == "paper"
    dt = 2 if paper else PRECISION_BYTES[lay.precision]
    drop = True if paper else d.dropout
    scores = True if paper else d.stores_attention_scores
    s, b, h, a, nl, ci = d.seq_len, lay.micro_batch, d.hidden, d.n_heads, d.n_layers, lay.checkpoint_interval
    layer = activation_bytes_per_layer(s, b, h, a, dt, lay.tp, drop, scores)
    m = 1 if drop else 0
    dense_c = f"{4 * dt + 2 * m + 12 * dt / lay.tp:g}"
    score_c = f"{((2 * dt + m) if drop else dt) / lay.tp:g}" if scores else "0"
    layer_f = f"s·b·h·{dense_c}" + (f" + a·s²·b·{score_c}" if scores else "")
    lines = [EstimateLine("activations (embedding, head, logits)",
                          math.ceil(activation_bytes_head(s, b, h, d.vocab, dt, drop)), Tier.DEVICE,
                          "s·b·h·(m+2D) + s·b·V·(D+4) (≈, Korthikanti 2022 §4.3)")]
    if ci == 0:
        lines.insert(0, EstimateLine("activations (blocks)", math.ceil(nl * layer), Tier.DEVICE,
                                     f"nl·({layer_f}) (≈ Korthikanti 2022 §4.1; D={dt} B)"))
    else:
        n_ckpt = math.ceil(nl / ci)
        lines.insert(0, EstimateLine("activation checkpoints", dt * b * s * h * n_ckpt, lay.checkpoint_tier,
                                     f"{dt}·bsz·seq·hd·⌈nl/ci⌉ (ZeRO-Infinity §3)"))
        if lay.recompute == "selective":  # the kept outputs: on the device, split like the linears (÷t)
            acts = (d.activation_bytes(b, dt) if hasattr(d, "activation_bytes")
                    else gpt_activation_bytes(d, b, dt))
            lines.insert(1, EstimateLine("activations kept by selective recompute",
                                         math.ceil(n_ckpt * acts.kept_at(0) / lay.tp),
                                         Tier.DEVICE, "⌈nl/ci⌉ × the matmul and fused-attention outputs of a "
                                         "block, ÷t (activations.recompute=selective)"))
        awm = (infinity_awm_bytes(b, s, ci, h, a) if paper else math.ceil(min(ci, nl) * layer))
        lines.insert(1, EstimateLine("activation working memory", awm, Tier.DEVICE,
                                     "bsz·seq·ci·(16·hd+2·attn_heads·seq) (ZeRO-Infinity §3 AWM)" if paper
                                     else f"ci·({layer_f}) (ZeRO-Infinity §3 AWM; layer ≈ Korthikanti 2022)"))
    if lay.stage == 3:
        if paper:
            mswm, f = infinity_mswm_bytes(h, lay.tile_factor), "4·hd·4hd/tile (ZeRO-Infinity §3 MSWM, §5.1.3 tiling)"
        else:
            pb = PRECISION_BYTES[lay.precision]
            mswm = (pb + 4) * d.largest_operator_elements() / (lay.tile_factor * lay.tp)
            f = f"({pb}+4)·max(f·hd², V·hd)/(tile·t) (ZeRO-Infinity §3 MSWM, engine dtypes)"
        lines.append(EstimateLine("model-state working memory", math.ceil(mswm), Tier.DEVICE, f))
    return lines


def estimate(model: ModelSpec, layout: ZeroLayout | None = None, overhead: Any = None, *,
             accelerator: bool = False) -> Estimate:
    """Per-rank memory of training ``model`` under ``layout``, one labelled line per item.

    ``model`` is ModelDims (all lines), a :class:`~tiertrain.estimate.modules.HFModelDims`
    (any Hugging Face model of a supported family: all lines, its activations modelled per
    block), a parameter count or list of tensor sizes (model states only), or an nn.Module /
    factory (counted on the meta device; a ``.config`` with GPTConfig's fields also yields
    dims). Model-parallel ranks hold Ψ/(t·p).

    With engine accounting, a model given as ModelDims or a module, and tp = pp = 1, the
    lines are tiertrain's engine buffer by buffer (:mod:`tiertrain.estimate.peak`): model
    states from the engine's own layout (padding, buckets, stage-3 units), and the
    activations and transient buffers live at the simulated per-rank peak (``peak_at``),
    plus the process overhead ``overhead`` (:class:`~tiertrain.estimate.overhead.HostOverhead`;
    None: the defaults measured on the reference machine; ``HostOverhead.none()``: 0).
    Then ``total()`` is the predicted peak per rank, and ``build`` the peak of building the
    model and wrapping it as ``tiertrain train`` does (``accelerator``: the flat buffers
    are on an accelerator, so only the construction and the host tiers count as host RAM).
    """
    lay = (layout or ZeroLayout()).validate()
    psi, sizes, dims, module = _resolve_model(model)
    est = Estimate(parameters=psi, layout=lay, dims=dims)
    if lay.accounting == "engine" and lay.tp * lay.pp == 1 and (module is not None or dims is not None):
        lines, notes, where = engine_estimate_lines(module, dims, lay, overhead)
        est.lines.extend(lines)
        est.notes.extend(notes)
        est.peak_at = where
        est.build = engine_build_peak(module, dims, lay, overhead, accelerator=accelerator)
        return est
    est.lines.extend(_model_state_lines(psi, sizes, lay))
    if dims is not None:
        est.lines.extend(_activation_lines(dims, lay))
    else:
        est.notes.append("activation and working-memory lines omitted: model dims unknown")
    if lay.tp * lay.pp > 1:
        est.notes.append("model-parallel ranks assumed to hold Ψ/(t·p) each (Megatron §2)")
    if lay.pp > 1 and dims is not None:
        est.notes.append("activations are for pipeline stage 0: under 1F1B it holds p in-flight "
                         "micro-batches of nl/p layers, i.e. nl layers' worth (Korthikanti 2022 §4.2.3)")
    if lay.accounting == "engine":
        est.notes.append("Ψ' = Ψ/(t·p), the parameters of one model-parallel rank; engine dtypes: "
                         "params in compute dtype, fp32 grads/master/Adam; "
                         "temporary buffers (buckets, gathered layers) and allocator overhead not included")
    return est


_ALIASES: Mapping[str, str] = MappingProxyType(
    {"ci": "checkpoint_interval", "bsz": "micro_batch", "seq": "seq_len", "layers": "n_layers",
     "heads": "n_heads", "vocab_size": "vocab", "tile": "tile_factor"}
)


def estimate_from_args(overhead: Any = None, accelerator: bool = False, **kwargs: Any) -> Estimate:
    """Keyword front end for a CLI: ModelDims fields (n_layers, hidden, n_heads, vocab,
    seq_len, ...) or ``params=`` a count or ``module=`` an nn.Module/factory, plus any
    ZeroLayout field. Aliases: ci, bsz, seq, layers, heads, vocab_size, tile. ``overhead``
    and ``accelerator`` as for :func:`estimate`."""
    args = {_ALIASES.get(k, k): v for k, v in kwargs.items() if v is not None}
    dim_names = {f.name for f in fields(ModelDims)}
    lay_names = {f.name for f in fields(ZeroLayout)}
    unknown = sorted(set(args) - dim_names - lay_names - {"params", "module"})
    if unknown:
        raise ValueError(
            f"estimate_from_args: unknown argument(s) {unknown}; valid are "
            f"{sorted(dim_names | lay_names | {'params', 'module'} | set(_ALIASES))}"
        )
    layout = ZeroLayout(**{k: v for k, v in args.items() if k in lay_names})
    dim_args = {k: v for k, v in args.items() if k in dim_names}
    if "module" in args:
        model: ModelSpec = args["module"]
    elif "params" in args:
        model = args["params"]
    elif dim_args:
        model = ModelDims(**dim_args)
    else:
        raise ValueError("estimate_from_args: give model dims (n_layers, hidden, ...), params= or module=")
    return estimate(model, layout, overhead, accelerator=accelerator)
