"""Mixed precision: compute dtypes and the dynamic loss scaler for fp16.

Master weights and Adam state are always fp32 (ZeRO §3.1's K = 12 bytes per parameter);
gradients are accumulated and reduced in fp32 (as Megatron does for bf16), so only the
forward/backward arithmetic runs in the compute dtype.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import torch

from .config import LossScaleConfig
from .errors import TiertrainError, listing

if TYPE_CHECKING:
    from .zero.flat import FlatParameters

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def compute_dtype(name: str) -> torch.dtype:
    return DTYPES[name]


def kept_in_fp32(model: torch.nn.Module, compute: torch.dtype) -> "re.Pattern[str] | None":
    """The names (parameters, buffers) a Hugging Face model keeps in fp32 when it computes in
    ``compute``, matched as transformers' from_pretrained(dtype=) matches them: its
    ``_keep_in_fp32_modules_strict`` at fp16 and bf16 (MoE routers' ``gate.weight`` and
    ``e_score_correction_bias``), its ``_keep_in_fp32_modules`` at fp16 only (T5's ``wo``),
    each a pattern searched in the name (``*`` any text), declared by the model or any module in
    it. None at fp32 or for any other model."""
    if compute not in (torch.float16, torch.bfloat16):
        return None
    names = ["_keep_in_fp32_modules_strict"] + (["_keep_in_fp32_modules"] if compute is torch.float16 else [])
    # (on the model or any module in it: a pipeline's stages carry their model's)
    declared = [getattr(m, name, None) for m in model.modules() for name in names]
    patterns = sorted({p for d in declared if isinstance(d, (list, tuple, set, frozenset)) for p in d
                       if isinstance(p, str) and p})
    return re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in patterns)) if patterns else None


def stored_quantised(dtype: torch.dtype) -> bool:
    """Whether a weight of this dtype holds quantised values, not the weights: fp8 (beside its
    scale, as transformers' FP8Linear holds it, computing with a weight wider than a byte as
    already dequantised) and integers narrower than the int64 of index tables (bitsandbytes'
    packed 4-bit, int8, GPTQ's packed int32)."""
    if dtype.is_floating_point:
        return dtype.itemsize == 1
    return not dtype.is_complex and dtype not in (torch.bool, torch.int64)


def held_as_stored(tensor: torch.Tensor, compute: torch.dtype) -> bool:
    """Whether the engine holds a frozen tensor or buffer as it is stored, never cast to the
    compute dtype: every dtype that is not floating point (integers, bool, complex), one stored
    quantised, and a parameter of a class of its own in another dtype than the compute one
    (a quantisation library's packed weight, whose values only its class reads: bitsandbytes'
    Params4bit holds 4-bit codes in the bytes of its quant_storage dtype, bf16 included)."""
    dtype = tensor.dtype
    return not dtype.is_floating_point or stored_quantised(dtype) or (_own_class(tensor) and dtype != compute)


def _own_class(tensor: torch.Tensor) -> bool:
    from .zero.released import ReleasedParameter  # (the engine's own: a released stage-3 parameter)

    return isinstance(tensor, torch.nn.Parameter) and type(tensor) not in (torch.nn.Parameter, ReleasedParameter)


def named_in(kept: "re.Pattern[str] | None", name: str) -> bool:
    """Whether name is one that kept (kept_in_fp32's pattern; None: no name) matches."""
    return kept is not None and kept.search(name) is not None


def written_dtype(kept: "re.Pattern[str] | None", name: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype an export writes a floating-point tensor in when asked for dtype: fp32 for
    what the model keeps in fp32 (kept: kept_in_fp32's pattern), as its own save_pretrained."""
    return torch.float32 if named_in(kept, name) else dtype


_DTYPE_WORDS = ("dtype", "scalar type", "Float", "BFloat16", "Half")
"""What torch's dtype-mismatch errors say ("mat1 and mat2 must have the same dtype", "expected
scalar type BFloat16 but found Float", "Input type (float) and bias type (c10::BFloat16)")."""


def note_kept_buffers(error: RuntimeError, kept: Sequence[str], dtype: torch.dtype) -> None:
    """A forward failed: where it reads like a dtype mismatch and derived buffers kept their
    own dtype (engine_build.cast_buffers_and_frozen), add a note naming them and the switch."""
    if kept and any(word in str(error) for word in _DTYPE_WORDS):
        error.add_note(f"tiertrain: the derived (non-persistent) buffers {listing(kept)} keep the dtype the model "
                       f"built them in, not the compute dtype {dtype}, as transformers' from_pretrained(dtype=) and "
                       f"FSDP2 keep rotary frequencies in fp32; if the model mixes one into activations without "
                       f"casting it (.to(x.dtype)), set precision.cast_derived_buffers: true")


@dataclass
class ScalerState:
    scale: float
    good_steps: int = 0
    hysteresis_left: int = 1
    overflows: int = 0
    consecutive_skips: int = 0
    """Steps skipped in a row for non-finite gradients (counted with or without scaling)."""


class DynamicLossScaler:
    """fp16 loss scaling (Micikevicius et al.; DeepSpeed's hysteresis variant).

    The loss is multiplied by ``scale`` before backward; gradients are divided by it before
    the step. A step whose gradients hold inf/NaN anywhere (on any rank: the caller reduces
    the overflow flag first) is skipped, and after ``hysteresis`` such steps the scale is
    multiplied by ``backoff_factor``. ``growth_interval`` good steps in a row multiply it by
    ``growth_factor``. A static scale (``config.dynamic`` false, DeepSpeed's fp16.loss_scale)
    never moves; overflowing steps are skipped all the same, as DeepSpeed's ZeRO does.
    """

    def __init__(self, config: LossScaleConfig, enabled: bool = True):
        self.config = config
        self.enabled = enabled
        self.state = ScalerState(scale=config.initial_scale if enabled else 1.0,
                                 hysteresis_left=config.hysteresis)

    @property
    def scale(self) -> float:
        return self.state.scale

    def update(self, overflow: bool) -> None:
        """Advance after a step: lower the scale on overflow, grow it after a good run."""
        s, c = self.state, self.config
        # Counted in every dtype: a bf16/fp32 run whose gradients stay non-finite skips its
        # steps as well, and precision.max_consecutive_skips must be able to stop it.
        s.consecutive_skips = s.consecutive_skips + 1 if overflow else 0
        if not self.enabled or not c.dynamic:
            return
        if overflow:
            s.overflows += 1
            s.good_steps = 0
            s.hysteresis_left -= 1
            if s.hysteresis_left <= 0:
                s.scale = max(s.scale * c.backoff_factor, c.min_scale)
                s.hysteresis_left = c.hysteresis
            return
        s.good_steps += 1
        if s.good_steps % c.growth_interval == 0:
            s.scale *= c.growth_factor
            s.hysteresis_left = c.hysteresis

    def state_dict(self) -> dict:
        return dict(vars(self.state))

    def load_state_dict(self, state: dict) -> None:
        self.state = ScalerState(**state)
        if self.enabled and not self.config.dynamic:
            self.state.scale = self.config.initial_scale  # (a static scale is the config's, whatever the run's was)


class NonFiniteError(TiertrainError, RuntimeError):
    """Training stopped: too many steps in a row had non-finite gradients
    (precision.max_consecutive_skips); the message names the step, the loss scale and the
    first non-finite gradient found on the raising rank."""

    exit_code = 1


def first_nonfinite(flat: "FlatParameters", grads: Sequence[torch.Tensor]) -> str | None:
    """The name of the first parameter whose piece of this rank's gradient shard holds inf or
    NaN (units in layout order, parameters in unit order), or None when this rank's pieces are
    all finite (the non-finite values are in another rank's shard). grads: each unit's shard
    gradient (UnitBuffers.grad). Reads every gradient once: only for the error path."""
    for u, grad in zip(flat.units, grads):
        # One pass, no temporary: a finite sum means every element is finite (a non-finite sum
        # may also be an overflow of finite values: the pieces are then checked one by one).
        if bool(torch.isfinite(grad.sum())):
            continue
        for slot, a, b in u.unit.shard_pieces(flat.shard_rank):
            if not bool(torch.isfinite(grad[a:b]).all()):
                return slot.name
    return None
