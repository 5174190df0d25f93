"""Typed configuration: one dataclass per concern, validated, loadable from YAML/TOML,
overridable from the command line (``--zero.stage 3``).

Every field carries a one-line docstring (the string literal right after it). Every
invalid value raises :class:`ConfigError` naming the dotted field, the value and what
would be valid.
"""
from __future__ import annotations

import dataclasses
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, get_origin

import yaml

from .errors import TiertrainError
from .tiers import Tier


class ConfigError(TiertrainError, ValueError):
    """A configuration value is invalid; the message names field, value and what is valid."""

    exit_code = 2


def _fail(path: str, value: Any, valid: str) -> None:
    raise ConfigError(f"{path}={value!r} is invalid: expected {valid}")


class _NonFinite(ConfigError):
    """A number field given inf or NaN (kept apart so that a union such as ``float | None``
    reports it as such rather than as "a number or null")."""


def check_finite(obj: Any, path: str = "") -> None:
    """ConfigError naming the first float field of dataclass obj (nested dataclasses and
    tuples included) that is inf or NaN. Every range check below compares with ``<`` or
    ``>``, which inf passes and NaN slips through (a comparison with NaN is always false),
    so a config built in code is checked here as the loader checks what it parses."""
    for f in dataclasses.fields(obj):
        _check_finite_value(f"{path}.{f.name}" if path else f.name, getattr(obj, f.name))


def _check_finite_value(path: str, value: Any) -> None:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        check_finite(value, path)
    elif isinstance(value, tuple):
        for i, v in enumerate(value):
            _check_finite_value(f"{path}[{i}]", v)
    elif isinstance(value, float) and not math.isfinite(value):
        _fail(path, value, "a finite number")


def parse_tier(path: str, value: Any, allowed: tuple[Tier, ...] = tuple(Tier)) -> Tier:
    """value as a Tier ("none" is the device), or a ConfigError naming what is valid."""
    try:
        tier = Tier(value)
    except ValueError:
        tier = None
    if tier not in allowed:
        shown = value.config_name if isinstance(value, Tier) else value
        _fail(path, shown, "one of " + ", ".join(repr(t.config_name) for t in allowed)
              + (" ('device' is the same as 'none')" if Tier.DEVICE in allowed else ""))
    return tier


def _check_positive(path: str, value: int | float, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        _fail(path, value, "a value >= 0" if allow_zero else "a value > 0")


ACCUMULATE_ON_DEVICE = ("auto", "on", "off")
"""The values of zero.accumulate_on_device (tiertrain/zero/accumulation.py decides auto)."""
PipelineSchedule = Literal["gpipe", "1f1b", "interleaved"]
ContextAlgorithm = Literal["ring", "ulysses"]
Dtype = Literal["fp32", "bf16", "fp16"]


@dataclass
class LossScaleConfig:
    initial_scale: float = 2.0**16
    """Starting fp16 loss scale."""
    growth_interval: int = 1000
    """Good steps in a row after which the scale is multiplied by growth_factor."""
    growth_factor: float = 2.0
    """Factor applied to the scale after growth_interval good steps."""
    backoff_factor: float = 0.5
    """Factor applied to the scale when an overflow uses up the hysteresis."""
    hysteresis: int = 2
    """Overflowing steps tolerated (each skipped) before the scale is lowered; 1 lowers at once."""
    min_scale: float = 1.0
    """The scale never falls below this."""
    dynamic: bool = True
    """Whether the scale moves (grows, backs off); false keeps initial_scale for the whole run, also after a resume (DeepSpeed's static fp16.loss_scale), and a step whose gradients overflow is still skipped."""

    def validate(self, path: str = "precision.loss_scale") -> None:
        _check_positive(f"{path}.initial_scale", self.initial_scale)
        _check_positive(f"{path}.growth_interval", self.growth_interval)
        _check_positive(f"{path}.hysteresis", self.hysteresis)
        _check_positive(f"{path}.min_scale", self.min_scale)
        if self.growth_factor <= 1.0:
            _fail(f"{path}.growth_factor", self.growth_factor, "a factor > 1")
        if not 0.0 < self.backoff_factor < 1.0:
            _fail(f"{path}.backoff_factor", self.backoff_factor, "a factor in (0, 1)")


@dataclass
class PrecisionConfig:
    dtype: Dtype = "fp32"
    """Compute dtype of parameters and activations; master weights and Adam state are always fp32."""
    loss_scale: LossScaleConfig = field(default_factory=LossScaleConfig)
    """Dynamic loss scaling, used only when dtype is fp16."""
    max_consecutive_skips: int = 20
    """Steps skipped in a row for non-finite gradients (any dtype) after which the run stops with an error naming the step, the loss scale and the first non-finite gradient."""
    cast_derived_buffers: bool = False
    """Give non-persistent floating buffers (derived tables such as rotary frequencies) the compute dtype too, as DeepSpeed's module.bfloat16() does; by default they keep the dtype the model built them in, as transformers' from_pretrained(dtype=) and FSDP2 keep rotary frequencies in fp32 (persistent buffers always take the compute dtype)."""

    def validate(self, path: str = "precision") -> None:
        self.loss_scale.validate(f"{path}.loss_scale")
        _check_positive(f"{path}.max_consecutive_skips", self.max_consecutive_skips)


@dataclass
class OptimizerConfig:
    lr: float = 3e-4
    """Peak learning rate of AdamW."""
    betas: tuple[float, float] = (0.9, 0.95)
    """AdamW (beta1, beta2)."""
    eps: float = 1e-8
    """AdamW epsilon."""
    weight_decay: float = 0.1
    """Decoupled weight decay of the default AdamW, on the parameters weight_decay_on names."""
    weight_decay_on: Literal["matrices", "all"] = "matrices"
    """Parameters weight decay applies to: matrices (2+ dims: not biases or norm gains), or all."""
    grad_clip: float = 1.0
    """Clip gradients to this global L2 norm across all shards; 0 disables clipping."""
    impl: Literal["auto", "fused", "foreach", "single", "compiled"] = "auto"
    """AdamW kernel: torch's fused, foreach or single-tensor; compiled (AdamW, clip and the cast to the compute dtype in one pass of C built for this host, for the optimizer in host memory); auto (compiled for the default AdamW on the CPU tier, else fused)."""

    def validate(self, path: str = "optimizer") -> None:
        _check_positive(f"{path}.lr", self.lr)
        for i, b in enumerate(self.betas):
            if not 0.0 <= b < 1.0:
                _fail(f"{path}.betas[{i}]", b, "a value in [0, 1)")
        _check_positive(f"{path}.eps", self.eps)
        _check_positive(f"{path}.weight_decay", self.weight_decay, allow_zero=True)
        if self.weight_decay_on not in ("matrices", "all"):
            _fail(f"{path}.weight_decay_on", self.weight_decay_on, "'matrices' or 'all'")
        _check_positive(f"{path}.grad_clip", self.grad_clip, allow_zero=True)


@dataclass
class ScheduleConfig:
    warmup_steps: int = 20
    """Optimizer steps of warmup from warmup_start_ratio to the peak learning rate."""
    decay_steps: int = 0
    """Optimizer steps over which the rate decays (decay_shape) to min_lr_ratio; 0 keeps it constant after warmup."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    warmup_shape: Literal["linear", "log"] = "linear"
    """Warmup ramp: linear in the step, or log (DeepSpeed WarmupLR's default, log(s+1)/log(warmup_steps))."""
    warmup_start_ratio: float = 0.0
    """Rate the warmup starts from, as a fraction of the peak (DeepSpeed's warmup_min_lr / warmup_max_lr)."""
    decay_shape: Literal["cosine", "linear"] = "cosine"
    """Decay after warmup: a half cosine, or linear (DeepSpeed's WarmupDecayLR) to min_lr_ratio."""
    deepspeed_scheduler: Literal["none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"] = "none"
    """The DeepSpeed scheduler whose rates the schedule reproduces update for update (what a DeepSpeed config translates to: its scheduler steps after each update, its log warmup is log(i+1)/log(warmup_steps)); none: tiertrain's curve, whose warmup takes its first increment at the first update."""

    def validate(self, path: str = "schedule") -> None:
        _check_positive(f"{path}.warmup_steps", self.warmup_steps, allow_zero=True)
        _check_positive(f"{path}.decay_steps", self.decay_steps, allow_zero=True)
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail(f"{path}.min_lr_ratio", self.min_lr_ratio, "a value in [0, 1]")
        if not 0.0 <= self.warmup_start_ratio <= 1.0:
            _fail(f"{path}.warmup_start_ratio", self.warmup_start_ratio, "a value in [0, 1]")
        if self.warmup_shape not in ("linear", "log"):
            _fail(f"{path}.warmup_shape", self.warmup_shape, "'linear' or 'log'")
        if self.decay_shape not in ("cosine", "linear"):
            _fail(f"{path}.decay_shape", self.decay_shape, "'cosine' or 'linear'")
        if self.deepspeed_scheduler not in ("none", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
            _fail(f"{path}.deepspeed_scheduler", self.deepspeed_scheduler,
                  "'none', 'WarmupLR', 'WarmupDecayLR' or 'WarmupCosineLR'")


@dataclass
class BatchConfig:
    micro_batch_size: int = 8
    """Samples per rank per forward/backward."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step."""
    global_batch_size: int = 0
    """Samples per optimizer step across all data-parallel ranks; 0 derives micro × accum × dp."""

    def validate(self, path: str = "batch") -> None:
        _check_positive(f"{path}.micro_batch_size", self.micro_batch_size)
        _check_positive(f"{path}.grad_accum_steps", self.grad_accum_steps)
        _check_positive(f"{path}.global_batch_size", self.global_batch_size, allow_zero=True)

    def resolve(self, dp: int, path: str = "batch") -> int:
        """The global batch size, checked for consistency with dp."""
        derived = self.micro_batch_size * self.grad_accum_steps * dp
        if self.global_batch_size not in (0, derived):
            raise ConfigError(
                f"{path}.global_batch_size={self.global_batch_size} is inconsistent: "
                f"micro_batch_size ({self.micro_batch_size}) × grad_accum_steps "
                f"({self.grad_accum_steps}) × dp ({dp}) = {derived}; set it to {derived} or 0"
            )
        return derived


@dataclass
class ParallelConfig:
    dp: int = 0
    """Data-parallel size; 0 means world_size / (tp × pp × cp)."""
    tp: int = 1
    """Tensor-parallel size."""
    cp: int = 1
    """Context-parallel size: each sequence's tokens split over this many ranks, which are also data-parallel for the model states (ZeRO over dp × cp)."""
    cp_algorithm: ContextAlgorithm = "ring"
    """Context-parallel attention (cp > 1): ring (key/value blocks passed around, zig-zag split of causal sequences) or ulysses (all-to-all to head-split; cp must divide the heads)."""
    pp: int = 1
    """Pipeline-parallel size."""
    schedule: PipelineSchedule = "1f1b"
    """Pipeline schedule (pp > 1): gpipe, 1f1b, or interleaved (1F1B over virtual_stages chunks per rank)."""
    virtual_stages: int = 1
    """Model chunks per pipeline rank (v of Megatron's interleaved schedule); > 1 needs schedule=interleaved."""

    def validate(self, path: str = "parallel") -> None:
        _check_positive(f"{path}.dp", self.dp, allow_zero=True)
        _check_positive(f"{path}.tp", self.tp)
        _check_positive(f"{path}.pp", self.pp)
        _check_positive(f"{path}.cp", self.cp)
        _check_positive(f"{path}.virtual_stages", self.virtual_stages)
        if self.virtual_stages > 1 and self.schedule != "interleaved":
            _fail(f"{path}.virtual_stages", self.virtual_stages,
                  f"1 with schedule={self.schedule!r} (more chunks per rank need schedule='interleaved')")

    def resolve(self, world_size: int, path: str = "parallel") -> tuple[int, int, int]:
        """(pp, dp, tp) for this world size (cp is as set), or ConfigError when the sizes do
        not multiply to it."""
        model = self.tp * self.pp * self.cp
        named = "tp × pp" + (" × cp" if self.cp > 1 else "")
        sizes = f"{self.tp} × {self.pp}" + (f" × {self.cp}" if self.cp > 1 else "")
        if self.dp == 0:
            if world_size % model:
                raise ConfigError(
                    f"{path}: world size {world_size} is not divisible by {named} = "
                    f"{sizes}; choose sizes whose product divides {world_size}"
                )
            return self.pp, world_size // model, self.tp
        if self.dp * model != world_size:
            raise ConfigError(
                f"{path}: dp × {named} = {self.dp} × {sizes} = "
                f"{self.dp * model} but the world size is {world_size}; "
                f"valid layouts multiply to {world_size} (or set dp=0 to derive it)"
            )
        return self.pp, self.dp, self.tp


@dataclass
class ZeroConfig:
    stage: int = 0
    """ZeRO stage: 0 plain data parallel, 1 optimizer states, 2 + gradients, 3 + parameters partitioned."""
    bucket_mb: float = 25.0
    """Size of a gradient-reduction bucket (stages 0-2) in MiB of fp32 gradients."""
    prefetch_mb: float | None = None
    """Stage 3: MiB of parameters gathered ahead of use; None = 64 on CUDA, 0 on CPU (where collectives share the compute cores)."""
    max_live_mb: float = 0.0
    """Stage 3: cap on gathered parameter MiB resident at once; 0 means no cap beyond what is in use."""
    persistence_threshold: int = 0
    """Stage 3: parameters with at most this many elements stay whole on every rank."""
    unit_params: int = 0
    """Stage 3, a model without nn.ModuleList: a module becomes a unit once its parameters outside smaller units number this many (FSDP's size_based_auto_wrap_policy min_num_params); 0: a sixteenth of the model."""
    offload_optimizer: Tier = Tier.DEVICE
    """Tier holding fp32 master weights and optimizer state: none (the device), cpu or nvme."""
    offload_params: Tier = Tier.DEVICE
    """Tier holding parameter shards (stage 3): none (the device), cpu or nvme."""
    nvme_path: str = ""
    """Swap directory for the nvme tier; with tiertrain train it must exist (or nvme_create)."""
    nvme_create: bool = False
    """tiertrain train: create zero.nvme_path when it does not exist; by default that is an error, so that a mistyped mount point does not put swap on another disk."""
    stage3_check: Literal["traced", "every", "off"] = "traced"
    """Stage 3: ranks agree at the start of each pass and check later passes against the first (traced); every: agree before each collective (modules whose order changes between steps), and check every forward's parameter uses, which runs compiled blocks eagerly (docs/compile.md); off."""
    nvme_chunk_mb: float = 24.0
    """NVMe optimizer: MiB per streamed chunk (fp32 master and both Adam moments of its parameters)."""
    nvme_buffers: int = 4
    """NVMe optimizer: chunk buffers (reads ahead, the update, the write back); their RAM is buffers × chunk."""
    overlap_param_gather: bool = False
    """Stages 1-2 (pp=1): the all-gather of updated parameters runs on after step() returns; the next forward waits per unit, at the first operation touching it (call engine.wait_for_parameters() before reading parameters outside the engine in between)."""
    nvme_in_place: bool = False
    """NVMe optimizer: update each chunk's state in place (12 bytes per parameter on disk) instead of writing a second generation and committing it (24): half the disk, but a step that fails or is cancelled part-way leaves the state partly updated, to be restored from a checkpoint."""
    nvme_grads_in_ram_mb: float = 0.0
    """With nvme_in_place: most MiB of reduced gradient shards a rank holds for the optimizer step running in backward; a reduction that would hold more waits until the step has consumed (and freed) earlier ones. 0: no limit."""
    nvme_kept_units: int = 4
    """Parameters on NVMe: read staging tensors kept, with their values, per unit shard size once their gather is done, so that the units forward gathered last are not read again when backward gathers them first; each costs one unit's shard of RAM (0: none kept, every gather reads the disk). With fp32 parameters and the optimizer on NVMe, as many again may be handed to the step running in backward, which then takes each unit's masters from the gather that read them instead of reading them again."""
    broadcast_buffers: bool = True
    """Before each training forward, data-parallel rank 0's persistent buffers (BatchNorm's running statistics) are copied to the other ranks, as DDP's broadcast_buffers, so they stay equal (under pipeline parallelism once per step, before the first micro-batch's forward, over each stage's data-parallel ranks); false: each rank keeps its own."""
    overlap_nvme_step: bool = True
    """NVMe optimizer: update each unit's state during the boundary backward, once its gradient is reduced (not with grad_clip > 0 or fp16, whose global norm gates the step)."""
    offload: Literal["manual", "auto"] = "manual"
    """manual: use stage and offload_* as given; auto: the planner (tiertrain plan) chooses them at start-up."""
    retain_host_memory: bool = True
    """Keep freed host blocks up to 32 MiB for reuse (glibc mallopt, process-wide), and on a CPU compute device the gradient buckets above 32 MiB that backward frees (as many as it used at once): per-step buffers then reuse pages instead of faulting in new ones (tiertrain/host_memory.py)."""
    delayed_update: bool = False
    """ZeRO-Offload's one-step delayed update (needs offload_optimizer=cpu): step t's CPU update overlaps step t+1's forward/backward, whose gradients are then computed at parameters one update old."""
    delayed_update_warmup: int = 40
    """With delayed_update: the first this-many optimizer steps run synchronously (the paper starts DPU after a few tens)."""
    overlap_cpu_step: bool = False
    """offload_optimizer=cpu: update each unit's shard during the boundary backward, once its gradient is reduced, into a second set of buffers (12 more bytes per parameter of the shard, CPU tier) that step() swaps in, or drops when the clip coefficient is below 1 or the step is skipped; the result is the synchronous step's."""
    accumulate_on_device: Literal["auto", "on", "off"] | bool = "auto"
    """Stages 2-3 with grad_accum_steps > 1: on: each unit's gradient accumulates over the micro-batches in a full fp32 buffer on the device and is reduce-scattered (and copied to the CPU tier) once per step, at the boundary's backward; off: every micro-batch's gradient is reduced into the shard; auto: on when the buffers fit half the device memory free at start-up, off on a CPU-only host (engine.plan says which and why; true/false mean on/off)."""

    def __post_init__(self) -> None:
        self.offload_optimizer = parse_tier("zero.offload_optimizer", self.offload_optimizer)
        self.offload_params = parse_tier("zero.offload_params", self.offload_params)
        if isinstance(self.accumulate_on_device, bool):  # (YAML 1.1 reads an unquoted on/off as a bool)
            self.accumulate_on_device = "on" if self.accumulate_on_device else "off"

    def validate(self, path: str = "zero") -> None:
        self.__post_init__()  # (fields assigned after construction)
        if self.stage not in (0, 1, 2, 3):
            _fail(f"{path}.stage", self.stage, "one of 0, 1, 2, 3")
        _check_positive(f"{path}.bucket_mb", self.bucket_mb)
        if self.prefetch_mb is not None:
            _check_positive(f"{path}.prefetch_mb", self.prefetch_mb, allow_zero=True)
        _check_positive(f"{path}.max_live_mb", self.max_live_mb, allow_zero=True)
        _check_positive(f"{path}.persistence_threshold", self.persistence_threshold, allow_zero=True)
        _check_positive(f"{path}.unit_params", self.unit_params, allow_zero=True)
        _check_positive(f"{path}.nvme_chunk_mb", self.nvme_chunk_mb)
        _check_positive(f"{path}.nvme_grads_in_ram_mb", self.nvme_grads_in_ram_mb, allow_zero=True)
        if isinstance(self.nvme_kept_units, bool) or not isinstance(self.nvme_kept_units, int) or self.nvme_kept_units < 0:
            _fail(f"{path}.nvme_kept_units", self.nvme_kept_units, "an integer >= 0")
        if self.nvme_grads_in_ram_mb and not self.nvme_in_place:
            raise ConfigError(f"{path}.nvme_grads_in_ram_mb={self.nvme_grads_in_ram_mb} needs {path}.nvme_in_place=true: "
                              f"only the in-place step frees the gradient shards it consumed (a transactional "
                              f"step keeps them to redo a cancelled step)")
        if self.nvme_buffers < 3:
            _fail(f"{path}.nvme_buffers", self.nvme_buffers, "at least 3 (read ahead, update, write back)")
        if "nvme" in (self.offload_optimizer, self.offload_params) and not self.nvme_path:
            raise ConfigError(f"{path}.nvme_path='' is invalid with an nvme tier: give a directory on the "
                              f"NVMe device (one subdirectory per rank is created in it)")
        if self.offload_optimizer.offloaded and self.stage < 2:
            raise ConfigError(f"{path}.offload_optimizer='{self.offload_optimizer.config_name}' needs {path}.stage "
                              f"2 or 3 (ZeRO-Offload builds on stage 2), got stage={self.stage}")
        if self.offload_params.offloaded and self.stage != 3:
            raise ConfigError(f"{path}.offload_params='{self.offload_params.config_name}' needs {path}.stage=3 "
                              f"(only stage 3 partitions parameters), got stage={self.stage}")
        _check_positive(f"{path}.delayed_update_warmup", self.delayed_update_warmup, allow_zero=True)
        if self.overlap_cpu_step and self.offload != "manual":  # (auto may move the optimizer off the CPU tier)
            raise ConfigError(f"{path}.overlap_cpu_step=True is invalid with {path}.offload={self.offload!r}: "
                              f"set {path}.offload='manual' and {path}.offload_optimizer='cpu'")
        if self.overlap_cpu_step and self.offload_optimizer != "cpu":
            raise ConfigError(f"{path}.overlap_cpu_step=True is invalid with {path}.offload_optimizer="
                              f"'{self.offload_optimizer.config_name}': it overlaps the CPU tier's step with backward; "
                              f"expected offload_optimizer='cpu' (the NVMe tier's overlap is {path}.overlap_nvme_step)")
        if self.overlap_cpu_step and self.delayed_update:
            raise ConfigError(f"{path}.overlap_cpu_step=True is invalid with {path}.delayed_update=True: the delayed "
                              f"update already runs the step beside the next forward and backward; choose one")
        if self.accumulate_on_device not in ACCUMULATE_ON_DEVICE:
            _fail(f"{path}.accumulate_on_device", self.accumulate_on_device,
                  "one of " + ", ".join(repr(v) for v in ACCUMULATE_ON_DEVICE) + " (or true/false for on/off)")
        if self.delayed_update and self.offload != "manual":
            raise ConfigError(f"{path}.delayed_update=True is invalid with {path}.offload={self.offload!r}: "
                              f"set {path}.offload='manual' and {path}.offload_optimizer='cpu'")
        if self.delayed_update and self.offload_optimizer != "cpu":
            why = ("the NVMe optimizer writes updated parameters straight into the shards the next forward "
                   "reads" if self.offload_optimizer == "nvme" else "it delays the CPU optimizer's update")
            raise ConfigError(f"{path}.delayed_update=True is invalid with {path}.offload_optimizer="
                              f"'{self.offload_optimizer.config_name}': expected offload_optimizer='cpu' ({why})")


ACTIVATION_TIERS = (Tier.DEVICE, Tier.CPU)
"""Where activation checkpoints may live."""


@dataclass
class ActivationConfig:
    checkpoint_every: int = 0
    """Recompute activations in backward for every k-th transformer block (full-block checkpointing); 0 disables."""
    offload: Tier = Tier.DEVICE
    """Tier holding the checkpointed block inputs between forward and backward: none (the device) or cpu."""
    recompute: Literal["block", "selective"] = "block"
    """What a checkpointed block recomputes in backward: block (all of it) or selective (keep the outputs of its matrix multiplications and attention kernels, recompute the rest; docs/concepts.md#selective-activation-checkpointing)."""
    loss_tile_tokens: int = 0
    """A context-parallel model's loss over tiles of this many tokens, each tile's logits recomputed in backward, so one tile's logits exist at a time (ALST's tiled loss); 0: all of a rank's tokens at once."""
    mlp_tile_tokens: int = 0
    """Every block's MLP over tiles of this many tokens of each sequence, each tile's intermediate recomputed in backward, so one tile's 4×hidden intermediate exists at a time (ALST's tiled MLP); 0: the whole sequence at once."""

    def __post_init__(self) -> None:
        # Any tier parses here; activation checkpointing names the ones it supports (device, cpu).
        self.offload = parse_tier("activations.offload", self.offload)

    def validate(self, path: str = "activations") -> None:
        self.__post_init__()
        _check_positive(f"{path}.checkpoint_every", self.checkpoint_every, allow_zero=True)
        _check_positive(f"{path}.loss_tile_tokens", self.loss_tile_tokens, allow_zero=True)
        _check_positive(f"{path}.mlp_tile_tokens", self.mlp_tile_tokens, allow_zero=True)
        if self.offload not in ACTIVATION_TIERS:
            parse_tier(f"{path}.offload", self.offload, ACTIVATION_TIERS)
        if self.offload.offloaded and self.checkpoint_every == 0:
            _fail(f"{path}.offload", self.offload.config_name,
                  f"'none' while {path}.checkpoint_every=0 (there are no checkpoints to offload)")
        if self.recompute not in ("block", "selective"):
            _fail(f"{path}.recompute", self.recompute, "'block' or 'selective'")
        if self.recompute == "selective" and self.checkpoint_every == 0:
            _fail(f"{path}.recompute", self.recompute,
                  f"'block' while {path}.checkpoint_every=0 (no block is checkpointed; set checkpoint_every=1 "
                  f"to checkpoint every block selectively)")


@dataclass
class CheckpointConfig:
    dir: str = ""
    """Directory for checkpoints; empty disables checkpointing."""
    interval: int = 0
    """Save every this many optimizer steps; 0 saves only at the end."""
    keep_last: int = 2
    """Number of most recent checkpoints kept."""
    resume: bool = True
    """Resume from the newest complete checkpoint in dir when one exists."""
    overwrite: bool = False
    """With resume=false: delete the checkpoints already in dir before the first step (without it such a run is refused, so that an older run's checkpoints are never lost or resumed by mistake)."""
    from_deepspeed: str = ""
    """A DeepSpeed ZeRO checkpoint directory (the tag its 'latest' names; or a universal checkpoint, ds_to_universal's: the tag its 'latest_universal' names) that a run not resuming starts from: fp32 masters, Adam's moments and step, the step count (engine.load_deepspeed_checkpoint). A checkpoint in dir to resume comes first; the data stream starts at its beginning."""
    from_dcp: str = ""
    """A torch.distributed.checkpoint directory of an FSDP2 run (or one holding such directories: a Trainer's checkpoint-N) that a run not resuming starts from: each parameter's value, Adam's moments and step, the step count (engine.load_dcp_checkpoint). A checkpoint in dir to resume comes first; the data stream starts at its beginning."""
    async_save: bool = False
    """Return from a save once the state is copied, and write and commit it in the background while training goes on (the final save is waited for; bench/results/checkpoint.md measures the stall)."""
    loss_spike_factor: float = 10.0
    """A checkpoint saved at a step whose loss (mean over data-parallel ranks) exceeds this many times the largest of the previous spike_window steps' is marked diverged, and a resume passes over it (tiertrain/trainer/divergence.py); 0 disables."""
    grad_norm_spike_factor: float = 100.0
    """The same for the step's gradient norm (an update that explodes); 0 disables."""
    spike_window: int = 20
    """Healthy steps whose largest loss and gradient norm a step is compared with."""

    def validate(self, path: str = "checkpoint") -> None:
        _check_positive(f"{path}.interval", self.interval, allow_zero=True)
        _check_positive(f"{path}.keep_last", self.keep_last)
        for name in ("loss_spike_factor", "grad_norm_spike_factor"):
            value = getattr(self, name)
            if not (value == 0 or value > 1):
                _fail(f"{path}.{name}", value, "0 (off) or a factor > 1")
        _check_positive(f"{path}.spike_window", self.spike_window)
        if self.from_deepspeed and self.from_dcp:
            _fail(f"{path}.from_dcp", self.from_dcp, f"empty when {path}.from_deepspeed is set (a run starts from "
                  f"one checkpoint)")


@dataclass
class LoggingConfig:
    metrics_file: str = "runs/metrics.jsonl"
    """JSONL file receiving one record per logged step (rank 0 writes it); empty disables it."""
    log_interval: int = 10
    """Optimizer steps between metric records."""
    progress: bool = True
    """Show a progress bar on rank 0."""
    tensorboard_dir: str = ""
    """Directory receiving TensorBoard event files of every record (needs the tensorboard package); empty: none."""
    wandb_project: str = ""
    """Weights & Biases project receiving every record (needs the wandb package); empty: none."""
    wandb_mode: Literal["online", "offline"] = "online"
    """Weights & Biases mode: offline writes the run under wandb/ for a later `wandb sync`."""
    peak_tflops: float = 0.0
    """One rank's peak TFLOP/s at the compute dtype, for MFU; 0: the probe file's measured matmul peak, else MFU is not reported."""
    trace_steps: int = 0
    """Optimizer steps to record as a Chrome/Perfetto trace (trace-rank<r>.json beside the metrics file), from the run's second step; 0: none."""

    def validate(self, path: str = "logging") -> None:
        _check_positive(f"{path}.log_interval", self.log_interval)
        if not (isinstance(self.trace_steps, int) and not isinstance(self.trace_steps, bool) and self.trace_steps >= 0):
            _fail(f"{path}.trace_steps", self.trace_steps, "a whole number of steps >= 0 (0: no trace)")
        if self.wandb_mode not in ("online", "offline"):
            _fail(f"{path}.wandb_mode", self.wandb_mode, "'online' or 'offline'")
        if not (isinstance(self.peak_tflops, (int, float)) and self.peak_tflops >= 0):
            _fail(f"{path}.peak_tflops", self.peak_tflops, "a number of TFLOP/s >= 0 (0: from the probe file)")


@dataclass
class Config:
    """Everything the engine needs besides the model and the topology."""

    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    """Compute dtype and loss scaling."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW hyper-parameters and gradient clipping."""
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    """Learning-rate warmup and cosine decay."""
    batch: BatchConfig = field(default_factory=BatchConfig)
    """Micro-batch, accumulation and global batch."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """Process grid dp × tp × pp."""
    zero: ZeroConfig = field(default_factory=ZeroConfig)
    """ZeRO stage and its buffers."""
    activations: ActivationConfig = field(default_factory=ActivationConfig)
    """Activation checkpointing and where checkpoints live."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Where and how often to save."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics and progress output."""

    def validate(self) -> "Config":
        check_finite(self)
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate(f.name)
        if self.zero.delayed_update and (self.precision.dtype == "fp16" or self.parallel.pp > 1):
            what = ("precision.dtype='fp16' (loss scaling with overflow skips)" if self.precision.dtype == "fp16"
                    else f"parallel.pp={self.parallel.pp} (pipeline parallelism)")
            raise ConfigError(f"zero.delayed_update=True is not supported with {what}: valid with fp32 or bf16, "
                              f"parallel.pp=1")
        if self.optimizer.impl == "compiled" and self.zero.offload_optimizer == Tier.NVME:
            raise ConfigError("optimizer.impl='compiled' is not used with zero.offload_optimizer='nvme' (the NVMe "
                              "optimizer streams its own chunks): valid with the optimizer in memory; use "
                              "optimizer.impl='auto' or 'fused'")
        if self.zero.overlap_cpu_step and (self.optimizer.impl == "fused" or self.precision.dtype == "fp16"
                                           or self.parallel.pp > 1):
            what = ("optimizer.impl='fused' (torch's kernel updates in place; the overlapped step writes its "
                    "updates beside the state with the compiled pass: use optimizer.impl='auto' or 'compiled')"
                    if self.optimizer.impl == "fused" else
                    "precision.dtype='fp16' (the loss scale's unscale changes every gradient after its reduction)"
                    if self.precision.dtype == "fp16" else
                    f"parallel.pp={self.parallel.pp} (the pipeline launches its own reductions)")
            raise ConfigError(f"zero.overlap_cpu_step=True is not supported with {what}")
        if self.zero.overlap_param_gather and self.parallel.pp > 1:
            raise ConfigError(f"zero.overlap_param_gather=True is not supported with parallel.pp={self.parallel.pp}: "
                              f"the pipeline runs its stages' forwards itself; valid with parallel.pp=1")
        return self


# ---------------------------------------------------------------------------
# Generic loading: dicts, YAML/TOML files and --dotted.key overrides.


def field_docs(cls: type) -> dict[str, str]:
    """The one-line docstring of each dataclass field, read from the class source."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return {}
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for stmt, nxt in zip(body, body[1:]):
        if (
            isinstance(stmt, ast.AnnAssign)
            and isinstance(stmt.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[stmt.target.id] = nxt.value.value.strip()
    return docs


def _describe(tp: Any) -> str:
    if tp is Tier:
        return "one of " + ", ".join(repr(t.config_name) for t in Tier)
    origin = get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in get_args(tp))
    if origin is tuple:
        return "a list of " + ", ".join(_describe(a) for a in get_args(tp))
    if tp is type(None):
        return "null"
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string"}.get(
        tp, getattr(tp, "__name__", str(tp))
    )


_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_NON_FINITE = re.compile(r"[-+]?\.?(nan|inf|infinity)", re.IGNORECASE)
"""inf/NaN spelled as YAML 1.2 reads them as strings (``nan``, ``inf``), or as Python does."""


def _coerce(path: str, tp: Any, value: Any) -> Any:
    """Check value against the annotation tp, converting where it is lossless."""
    origin = get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            _fail(path, value, f"a table of {tp.__name__} fields")
        return from_dict(tp, value, path)
    if tp is Tier:
        return parse_tier(path, value)
    if origin is Literal:
        if value in get_args(tp) and type(value) is type(get_args(tp)[0]):
            return value
        _fail(path, value, _describe(tp))
    if origin in (typing.Union, types.UnionType):
        non_finite = None
        for arg in get_args(tp):
            try:
                return _coerce(path, arg, value)
            except _NonFinite as e:
                non_finite = e
            except ConfigError:
                continue
        if non_finite is not None:
            raise non_finite
        _fail(path, value, _describe(tp))
    if origin is tuple:
        args = get_args(tp)
        if not isinstance(value, (list, tuple)) or len(value) != len(args):
            _fail(path, value, _describe(tp))
        return tuple(_coerce(f"{path}[{i}]", a, v) for i, (a, v) in enumerate(zip(args, value)))
    if tp is type(None):
        if value is None:
            return None
        _fail(path, value, "null")
    if tp is bool:
        if isinstance(value, bool):
            return value
        _fail(path, value, "true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        _fail(path, value, "an integer")
    if tp is float:
        number = None
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            number = float(value)
        elif isinstance(value, str) and _FLOAT.fullmatch(value.strip()):
            number = float(value)  # YAML 1.1 reads "1e-3" (no dot) as a string
        elif isinstance(value, str) and _NON_FINITE.fullmatch(value.strip()):
            number = float(value.strip().lstrip(".").replace("+.", "+").replace("-.", "-"))
        if number is None:
            _fail(path, value, "a number")
        if not math.isfinite(number):  # inf passes every `> 0` check; NaN passes every check
            raise _NonFinite(f"{path}={number!r} is invalid: expected a finite number")
        return number
    if tp is str:
        if isinstance(value, str):
            return value
        _fail(path, value, "a string")
    if isinstance(value, tp):
        return value
    _fail(path, value, _describe(tp))


T = typing.TypeVar("T")


def from_dict(cls: type[T], data: dict, path: str = "") -> T:
    """Build dataclass cls from a nested dict; unknown keys and wrong types raise ConfigError."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    names = list(fields)
    kwargs = {}
    for key, value in data.items():
        full = f"{path}.{key}" if path else str(key)
        if key not in names:
            raise ConfigError(f"unknown key {full!r}: valid keys here are {', '.join(names)}")
        if isinstance(value, dict):
            # A partial table fills its missing keys from this field's own default, which may
            # differ from the table class's defaults (the train job's model is 192 wide with 6
            # heads, GPTConfig's 128 and 4): `--model.n_layers 2` changes one field of it.
            default = _field_default(fields[key])
            if dataclasses.is_dataclass(default) and not isinstance(default, type):
                value = merge(to_dict(default), value)
        kwargs[key] = _coerce(full, hints[key], value)
    obj = cls(**kwargs)
    return obj


def _field_default(f: dataclasses.Field) -> Any:
    """The value a dataclass field takes when it is not given (None when it has none)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def to_dict(obj: Any) -> dict:
    """A dataclass as a plain nested dict (tuples become lists), ready for YAML/JSON."""
    def plain(v: Any) -> Any:
        if isinstance(v, Tier):
            return v.config_name
        if isinstance(v, tuple):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        return v
    return plain(dataclasses.asdict(obj))


def read_file(path: str) -> dict:
    """A config file as a dict: .yaml/.yml or .toml."""
    if not os.path.exists(path):
        raise ConfigError(f"config file {path!r} does not exist")
    if os.path.isdir(path):
        raise ConfigError(f"config file {path!r} is a directory: expected a .yaml, .yml or .toml file")
    ext = os.path.splitext(path)[1].lower()
    import tomllib

    try:
        if ext in (".yaml", ".yml"):
            with open(path) as f:
                data = yaml.safe_load(f) or {}
        elif ext == ".toml":
            with open(path, "rb") as f:
                data = tomllib.load(f)
        else:
            raise ConfigError(f"config file {path!r}: unknown extension {ext!r}; valid: .yaml, .yml, .toml")
    except OSError as e:
        raise ConfigError(f"config file {path!r} cannot be read: {e.strerror or e}") from None
    except (yaml.YAMLError, tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        kind = "TOML" if ext == ".toml" else "YAML"
        raise ConfigError(f"config file {path!r} is not valid {kind}: {' '.join(str(e).split())}") from None
    except RecursionError:
        raise ConfigError(f"config file {path!r} nests its values deeper than a config's few levels") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path!r} must hold a table at the top level")
    return data


def parse_overrides(args: list[str]) -> dict:
    """``['--zero.stage', '3', '--precision.dtype=bf16']`` → nested dict; values parsed as YAML scalars."""
    out: dict = {}
    i = 0
    while i < len(args):
        arg = args[i]
        if not arg.startswith("--") or len(arg) < 3:
            raise ConfigError(f"override {arg!r} is invalid: expected --section.key VALUE or --section.key=VALUE")
        if "=" in arg:
            key, raw = arg[2:].split("=", 1)
            i += 1
        else:
            if i + 1 >= len(args):
                raise ConfigError(f"override {arg!r} has no value: expected --{arg[2:]} VALUE")
            key, raw = arg[2:], args[i + 1]
            i += 2
        value = yaml.safe_load(raw) if raw != "" else ""
        node = out
        parts = key.split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override --{key} conflicts with an earlier override of {part!r}")
        node[parts[-1]] = value
    return out


def merge(base: dict, extra: dict) -> dict:
    """Deep merge: values of extra win; nested tables merge key by key."""
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = v
    return out


def load(cls: type[T], path: str | None = None, overrides: list[str] | None = None) -> T:
    """cls built from an optional file and command-line overrides, then validated."""
    data = read_file(path) if path else {}
    data = merge(data, parse_overrides(overrides or []))
    obj = from_dict(cls, data)
    obj.validate()  # type: ignore[attr-defined]
    return obj
