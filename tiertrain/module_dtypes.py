"""The dtype each buffer and frozen parameter of a wrapped model takes for the run, and the one
``close()`` gives back (docs/concepts.md, "Buffers and the compute dtype").

Persistent buffers and frozen parameters compute in the compute dtype; derived buffers keep
the dtype the model built them in (unless precision.cast_derived_buffers), and so does what a
Hugging Face model keeps in fp32 (precision.kept_in_fp32). Frozen parameters have no fp32
master: one given in a wider dtype is rounded for the run, and a warning says so. close()
returns every buffer and frozen parameter to the dtype it had when wrapped.
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from .errors import listing
from .precision import held_as_stored, kept_in_fp32, named_in
from .zero.construct import forget_partition

if TYPE_CHECKING:
    from .training_core import TrainingCore

__all__ = ["cast_buffers_and_frozen", "rounds"]


def rounds(given: torch.dtype, compute: torch.dtype) -> bool:
    """Whether values of floating dtype ``given`` may change when held in ``compute`` (fp32 holds
    every 16-bit value; bf16 and fp16 hold neither each other's nor fp32's). Asked only of what
    is cast: not of a tensor held as stored (precision.held_as_stored)."""
    if given == compute:
        return False
    return not (compute in (torch.float32, torch.float64) and torch.finfo(given).bits < torch.finfo(compute).bits)


def cast_buffers_and_frozen(engine: "TrainingCore", model: nn.Module, in_layout: set[str],
                            value_of: Callable[[nn.Parameter], torch.Tensor]) -> None:
    """Buffers and frozen parameters the flat units do not hold, in their run dtype on the
    device (``value_of``: a frozen parameter's value to start from, the same on every rank).
    Derived buffers (not in the state dict) keep the dtype the model built them in unless
    precision.cast_derived_buffers: rotary frequencies rounded to bf16 move the cosines of
    positions below 2048 by up to 1.9 at head dimension 128. Warns of frozen parameters whose
    values the compute dtype rounds (``in_layout``'s too: the stage-3 frozen units hold them
    in it), and of trained ones the model keeps in fp32 (read in the compute dtype)."""
    persistent = set(model.state_dict(keep_vars=True))
    cast_derived = engine.config.precision.cast_derived_buffers
    fp32 = kept_in_fp32(model, engine.dtype)
    engine.derived_buffers_kept = []
    """The floating derived buffers kept in a dtype other than the compute dtype (names)."""
    given: list[tuple[nn.Module, str, torch.dtype]] = []

    def dtype_of(full: str, value: torch.Tensor, held: torch.Tensor | None = None) -> torch.dtype:
        # (what the model keeps in fp32, precision.kept_in_fp32: an MoE router's correction bias,
        # whose values rounded to the compute dtype would route differently and be saved rounded;
        # held: the parameter the value is of, whose class may say it is held as stored)
        if held_as_stored(value if held is None else held, engine.dtype):
            return value.dtype
        return torch.promote_types(value.dtype, torch.float32) if named_in(fp32, full) else engine.dtype

    for prefix, module in model.named_modules():
        for name, buf in list(module.named_buffers(recurse=False)):
            full = f"{prefix}.{name}" if prefix else name
            kept = buf.is_floating_point() and full not in persistent and not cast_derived
            if kept and buf.dtype != engine.dtype:
                engine.derived_buffers_kept.append(full)
            given.append((module, name, buf.dtype))
            setattr(module, name, buf.to(device=engine.device, dtype=buf.dtype if kept else dtype_of(full, buf)))
    rounded: dict[str, torch.dtype] = {}
    engine.frozen_dtypes = {}
    """The dtypes the stage-3 frozen units' parameters had when wrapped (close() gives them back)."""
    for full, p in list(model.named_parameters()):  # (a tied parameter once, by its first name)
        if not p.requires_grad:
            prefix, _, name = full.rpartition(".")
            module = model.get_submodule(prefix)
            if not held_as_stored(p, engine.dtype) and rounds(p.dtype, engine.dtype) and not named_in(fp32, full):
                rounded[full] = p.dtype
            if full in in_layout:
                engine.frozen_dtypes[full] = p.dtype
                continue
            given.append((module, name, p.dtype))
            value = value_of(p)
            forget_partition(p)
            # (one held as stored, a quantised weight or an index table, keeps its dtype and values)
            p.data = value.to(device=engine.device, dtype=dtype_of(full, value, p))
    engine._on_close.append(lambda: _give_back(given))
    if rounded:
        dtypes = "/".join(sorted({str(d) for d in rounded.values()}))
        warnings.warn(f"the frozen parameters {listing(rounded)} are {dtypes} and have no fp32 master: this run "
                      f"holds them in {engine.dtype}, so full_state_dict(), save_pretrained() and the model close() "
                      f"hands back hold their rounded values; load the model in {engine.dtype} "
                      f"(from_pretrained(dtype=...)) to start from those values, or set precision.dtype: fp32",
                      RuntimeWarning, stacklevel=5)
    trained = [n for n, p in model.named_parameters() if p.requires_grad and named_in(fp32, n)]
    if trained:
        warnings.warn(f"this {type(model).__name__} keeps {listing(trained)} in fp32 (transformers' "
                      f"_keep_in_fp32_modules): tiertrain trains them from fp32 master weights, but its forward and "
                      f"backward read their {engine.dtype} copies, as DeepSpeed's bf16/fp16 and FSDP2's param_dtype "
                      f"do; set precision.dtype: fp32 to compute with the fp32 values", RuntimeWarning, stacklevel=5)


def _give_back(given: list[tuple[nn.Module, str, torch.dtype]]) -> None:
    """close(): every buffer and frozen parameter in the dtype it had when wrapped."""
    with torch.no_grad():
        for module, name, dtype in given:
            tensor = getattr(module, name)
            if isinstance(tensor, nn.Parameter):
                tensor.data = tensor.data.to(dtype)
            elif isinstance(tensor, torch.Tensor) and tensor.dtype != dtype:
                setattr(module, name, tensor.to(dtype))
