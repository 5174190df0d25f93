"""Quantised checkpoints for load_pretrained: block-FP8 weights dequantised as they are read,
every other quantisation refused by name.

A checkpoint such as DeepSeek-V3's or Qwen3-FP8's stores each linear weight as float8 values
with one fp32 scale per block of rows × columns beside it (``<name>.weight_scale_inv``; the
config's ``quantization_config`` is ``{"quant_method": "fp8", "weight_block_size": [128,
128]}``). Cast as a plain tensor into a bf16 model, such a weight holds its quantised values,
not the weights (hundreds where the weights are hundredths), so the reader below multiplies
each block by its scale, as transformers' ``FineGrainedFP8Config(dequantize=
True)`` does (the same fp32 product), also when only the rows a rank keeps are read. Integer
and other packed formats (bitsandbytes, GPTQ, AWQ, compressed-tensors, MXFP4 …) are refused
before anything is read, naming the method and how to dequantise with transformers.
"""
from __future__ import annotations

import json
import os

import torch

from ..errors import TiertrainError
from ..precision import stored_quantised
from .torch_weights import WeightReads

SCALE_SUFFIX = "_scale_inv"
"""What a block-FP8 weight's scale is called: ``<weight name>_scale_inv``."""

DEFAULT_BLOCK = (128, 128)
"""The block of DeepSeek-V3's format, assumed where no config gives weight_block_size."""


class QuantizedCheckpointError(TiertrainError, ValueError):
    """The checkpoint holds quantised weights in a form load_pretrained does not dequantise."""


def quantization_config(files: list[str]) -> dict | None:
    """The ``quantization_config`` of the config.json beside the weight files, if any."""
    path = os.path.join(os.path.dirname(files[0]), "config.json")
    try:
        with open(path) as f:
            config = json.load(f)
    except (OSError, ValueError):
        return None
    found = config.get("quantization_config") if isinstance(config, dict) else None
    return found if isinstance(found, dict) else None


def _refusal(where: str, method: str, examples: list[str]) -> QuantizedCheckpointError:
    return QuantizedCheckpointError(
        f"load_pretrained: {where} holds weights quantised by {method} ({', '.join(examples[:3])}"
        f"{', …' if len(examples) > 3 else ''}); their stored values are not the weights, and tiertrain trains "
        f"unquantised weights. It dequantises block-FP8 only (quant_method 'fp8', each weight beside its "
        f"weight_scale_inv). Dequantise with transformers first: from_pretrained(path, dtype=torch.bfloat16) with "
        f"the method's config set to dequantize=True where it has one (FineGrainedFP8Config, "
        f"CompressedTensorsConfig, Mxfp4Config), else model.dequantize(); then save_pretrained and load that")


def dequantized(raw, files: list[str]):
    """raw, or a :class:`BlockFP8` view of it where it holds block-FP8 weights; a
    QuantizedCheckpointError where it holds weights quantised otherwise: stored as fp8 or
    narrow integers, by its config's method or beside a scale. (A checkpoint whose config names
    a method but whose tensors are all stored unquantised, as some dequantised saves keep the
    config, loads as it is.)"""
    config = quantization_config(files)
    method = None if config is None else config.get("quant_method")
    where = repr(os.path.dirname(files[0]) or files[0])
    stored = {key: raw.stored_dtype(key) for key in raw.keys()}

    def a_scale(key: str) -> bool:
        return key.endswith(SCALE_SUFFIX) and key[:-len(SCALE_SUFFIX)] in stored
    quantized = {k: d for k, d in stored.items() if stored_quantised(d) and not a_scale(k)}
    fp8 = sorted(k for k, d in quantized.items() if k + SCALE_SUFFIX in stored and d.is_floating_point)
    listed = [f"{k}: {d}" for k, d in quantized.items()]
    if method not in (None, "fp8") and quantized:
        raise _refusal(f"{where} (config.json quantization_config)", repr(method), listed)
    beside_scales = [f"{k}: {d}" for k, d in quantized.items() if k not in fp8 and any(
        k[:k.rfind(".") + 1] + name in stored for name in _SCALE_NAMES)]
    if beside_scales:
        raise _refusal(where, "a method with scales beside the weights", beside_scales)
    if method == "fp8" and not fp8 and any(d.is_floating_point for d in quantized.values()):
        raise _refusal(f"{where} (config.json quantization_config)", "'fp8' without per-block scales", listed)
    if not fp8:
        return raw
    block = tuple(config.get("weight_block_size") or DEFAULT_BLOCK) if config else DEFAULT_BLOCK
    return BlockFP8(raw, fp8, block)


_SCALE_NAMES = ("weight_scale_inv", "weight_scale", "SCB", "scales", "weight_absmax", "absmax", "qzeros")
"""Tensors that quantisation formats store beside a quantised weight (FP8, bitsandbytes, GPTQ/AWQ)."""


class BlockFP8(WeightReads):
    """raw's tensors, each block-FP8 weight as the fp32 product of its values and their block's
    scale (ceil(rows / block) × ceil(columns / block) scales), the scales themselves hidden."""

    def __init__(self, raw, weights: list[str], block: tuple[int, int]):
        super().__init__(raw.report)
        self.raw = raw
        self.block = block
        self.weights = set(weights)
        for key in weights:
            shape, grid = raw.shape(key), raw.shape(key + SCALE_SUFFIX)
            expected = tuple(-(-n // b) for n, b in zip(shape, block)) if len(shape) == 2 else None
            if grid != expected and grid not in ((), (1,), (1, 1)):
                raise QuantizedCheckpointError(
                    f"load_pretrained: {key} is block-FP8 of shape {shape}, but its {SCALE_SUFFIX[1:]} has shape "
                    f"{grid}: blocks of {list(block)} give {expected} (one scale per block, 2-D weights; "
                    f"config.json quantization_config weight_block_size sets the block)")

    def keys(self) -> list[str]:
        return [k for k in self.raw.keys()
                if not k.endswith(SCALE_SUFFIX) or k[:-len(SCALE_SUFFIX)] not in self.weights]

    def shape(self, key: str) -> tuple[int, ...]:
        return self.raw.shape(key)

    def stored_dtype(self, key: str) -> torch.dtype:
        return torch.float32 if key in self.weights else self.raw.stored_dtype(key)

    def read(self, key: str) -> torch.Tensor:
        if key not in self.weights:
            return self.raw.read(key)
        return self._count(self._rows(key, 0, self.raw.shape(key)[0]), key)

    def _rows(self, key: str, r0: int, r1: int) -> torch.Tensor:
        if key not in self.weights:
            return self.raw._rows(key, r0, r1)
        values = self.raw._rows(key, r0, r1).to(torch.float32)
        scale = self.raw.read(key + SCALE_SUFFIX)
        scale = (scale.to(torch.float32) - 127.0).exp2() if scale.dtype == torch.uint8 else scale.to(torch.float32)
        if scale.numel() == 1:
            return values * scale.reshape(())
        rows, cols = self.block
        per_row = scale[r0 // rows:(r1 - 1) // rows + 1].repeat_interleave(rows, 0)[r0 % rows:r0 % rows + r1 - r0]
        return values * per_row.repeat_interleave(cols, 1)[:, :values.shape[1]]


__all__ = ["BlockFP8", "QuantizedCheckpointError", "dequantized", "quantization_config"]
