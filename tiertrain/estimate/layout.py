"""How training lays a model out, as the engine stores it: :class:`ZeroLayout` (ranks,
ZeRO stage, precision, memory tiers and the engine's knobs — the estimator's input), the
per-rank model-state bytes of tiertrain's engine (:func:`engine_model_state_bytes`: params in
the compute dtype, fp32 grads, masters and Adam moments) and the padded shard of a
partitioned tensor.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Sequence

from .formulas import _positive_int
from .lines import PRECISION_BYTES, TIERS, Tier
from .units import engine_grad_tier

__all__ = ["ZeroLayout", "padded_shard", "ModelStateBytes", "engine_model_state_bytes"]


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
    """Data-parallel degree: ranks that train different samples (ZeRO partitions over dp × cp)."""
    cp: int = 1
    """Context-parallel degree: ranks that split each sequence (tiertrain.parallel.context); each
    holds the activations of seq/cp tokens, and ZeRO partitions the model states over dp × cp."""
    cp_algorithm: str = "ring"
    """Context-parallel attention, cp > 1: "ring" or "ulysses" (their transients differ)."""
    loss_tile_tokens: int = 0
    """activations.loss_tile_tokens, cp > 1: the loss over tiles of this many tokens (0: whole)."""
    mlp_tile_tokens: int = 0
    """activations.mlp_tile_tokens: every block's MLP over tiles of this many tokens (0: whole)."""
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
    accumulate_on_device: bool = False
    """Stages 2-3: gradients accumulate over the micro-batches in a full fp32 device buffer per
    trained unit (zero.accumulate_on_device, decided on; tiertrain/zero/accumulation.py)."""
    overlap_cpu_step: bool = False
    """zero.overlap_cpu_step: the CPU-tier step runs during backward into a second set of
    masters and moments (tiertrain/update/overlapped_host.py)."""
    landing_buffers: bool = False
    """Stages 2-3 with the optimizer on the CPU tier, reducing every micro-batch of several: one
    more fp32 gradient shard per unit in pinned host memory, where reduced gradients land
    without blocking backward (tiertrain/zero/reducer.py's defer_landing; on an accelerator)."""

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
        for name in ("dp", "cp", "tp", "pp", "micro_batch", "tile_factor", "alignment"):
            _positive_int("ZeroLayout", name, getattr(self, name))
        if self.cp_algorithm not in ("ring", "ulysses"):
            raise ValueError(f"ZeroLayout.cp_algorithm={self.cp_algorithm!r} is invalid: must be 'ring' or 'ulysses'")
        for name in ("checkpoint_interval", "ranks_per_node", "loss_tile_tokens", "mlp_tile_tokens"):
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
        if not isinstance(self.accumulate_on_device, bool):
            raise ValueError(f"ZeroLayout.accumulate_on_device={self.accumulate_on_device!r} is invalid: "
                             f"must be True or False")
        if self.accumulate_on_device and self.stage < 2:
            raise ValueError(f"ZeroLayout.accumulate_on_device=True is invalid with stage={self.stage}: stages 0-1 "
                             f"keep whole gradients already (only stages 2-3 accumulate on the device)")
        if not isinstance(self.overlap_cpu_step, bool):
            raise ValueError(f"ZeroLayout.overlap_cpu_step={self.overlap_cpu_step!r} is invalid: must be True or False")
        if self.overlap_cpu_step and self.optimizer_tier is not Tier.CPU:
            raise ValueError(f"ZeroLayout.overlap_cpu_step=True is invalid with optimizer_tier="
                             f"{self.optimizer_tier.value!r}: it overlaps the CPU tier's step (optimizer_tier='cpu')")
        if not isinstance(self.landing_buffers, bool):
            raise ValueError(f"ZeroLayout.landing_buffers={self.landing_buffers!r} is invalid: must be True or False")
        if self.landing_buffers and (self.stage < 2 or self.optimizer_tier is not Tier.CPU or self.accumulate_on_device):
            raise ValueError(f"ZeroLayout.landing_buffers=True is invalid with stage={self.stage}, optimizer_tier="
                             f"{self.optimizer_tier}, accumulate_on_device={self.accumulate_on_device}: only stages 2-3 "
                             f"with the optimizer on the CPU tier, reducing every micro-batch, land gradients late")
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
        the device only at stage 3. ``zero.prefetch_mb`` unset is 0 (the CPU default).
        ``zero.accumulate_on_device``: on counts the device accumulators (with stage 2-3,
        grad_accum_steps > 1 and no pipeline); auto counts as off here, since the engine decides
        it at start-up from the device's free memory (engine.plan says which). Without it, the
        CPU tier's landing buffers are counted (stages 2-3, optimizer on the CPU tier,
        grad_accum_steps > 1, no pipeline), as an accelerator host holds them."""
        from ..zero.accumulation import decide
        z, acts = config.zero, config.activations
        pp, dp, tp = config.parallel.resolve(world_size)
        optimizer_tier = Tier(z.offload_optimizer)
        accum = config.batch.grad_accum_steps
        on_device = decide(z.accumulate_on_device, stage=z.stage, accum=accum, launch_when_ready=pp == 1,
                           extra_bytes=0, accelerator=False, free_device_bytes=lambda: None).on
        return cls(dp=dp, cp=config.parallel.cp, cp_algorithm=config.parallel.cp_algorithm,
                   loss_tile_tokens=acts.loss_tile_tokens,
                   mlp_tile_tokens=acts.mlp_tile_tokens, tp=tp, pp=pp,
                   stage=z.stage, precision=config.precision.dtype,
                   optimizer_tier=optimizer_tier,
                   param_tier=Tier(z.offload_params) if z.stage == 3 else Tier.DEVICE,
                   grad_tier=engine_grad_tier(z.stage, optimizer_tier),
                   checkpoint_tier=Tier(acts.offload), checkpoint_interval=acts.checkpoint_every,
                   recompute=acts.recompute,
                   micro_batch=config.batch.micro_batch_size, bucket_mb=z.bucket_mb,
                   prefetch_mb=z.prefetch_mb or 0.0, persistence_threshold=z.persistence_threshold,
                   nvme_in_place=z.nvme_in_place, nvme_grads_in_ram_mb=z.nvme_grads_in_ram_mb,
                   nvme_kept_units=z.nvme_kept_units, backend=backend,
                   accumulate_on_device=on_device,
                   landing_buffers=(z.stage >= 2 and optimizer_tier is Tier.CPU and accum > 1 and pp == 1
                                    and not on_device),
                   overlap_cpu_step=z.overlap_cpu_step).validate()

    @property
    def world_size(self) -> int:
        """dp·cp·tp·pp ranks."""
        return self.dp * self.cp * self.tp * self.pp

    @property
    def zero_ranks(self) -> int:
        """The ranks ZeRO partitions the model states over: dp × cp (context-parallel ranks
        hold the same parameters)."""
        return self.dp * self.cp

    @property
    def node_ranks(self) -> int:
        """Ranks per node with the 0 default resolved."""
        return self.ranks_per_node or self.world_size
