"""The engine's layout of a model, computed without building it: the flat units
(``tiertrain.zero.layout``) the engine lays out for a model's parameter shapes (a GPT built on
the meta device, or any module), the tier the fp32 gradients live on, and the most stage-3
parameter bytes gathered at once. The peak simulations (:mod:`tiertrain.estimate.peak`,
:mod:`tiertrain.estimate.build_peak`) and the planner count their bytes on these units.

Flat units are padded to a multiple of ``num_shards·64`` elements; stage-0–2 units are cut
into ``zero.bucket_mb`` buckets, stage-3 units are one per transformer block plus the root.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
import torch.nn as nn

from ..zero.plan import default_unit_modules, frozen_for_units, parameter_aliases
from .lines import Tier

__all__ = ["gpt_meta_model", "tile_plan", "engine_units", "engine_grad_tier", "stage3_gathered_bytes"]


def gpt_meta_model(dims: Any, tile_factor: int = 1) -> nn.Module:
    """tiertrain's GPT with ``dims`` on the meta device (nothing allocated); with
    ``tile_factor`` > 1 each block's qkv, fc1 and fc2 become TiledLinear (tiertrain.tiling)."""
    from tiertrain.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=dims.vocab, seq_len=dims.seq_len, n_layers=dims.n_layers,
                       hidden=dims.hidden, n_heads=dims.n_heads, ffn_mult=dims.ffn_mult,
                       tie_embeddings=dims.tie_embeddings, dropout=0.1 if dims.dropout else 0.0,
                       bias=getattr(dims, "bias", True))
    with torch.device("meta"):
        model = GPT(config)
        if tile_factor > 1:
            from tiertrain.tiling import apply_tiling

            apply_tiling(model, tile_plan(tile_factor))
    model._tiertrain_tile_factor = tile_factor
    return model


def tile_plan(tile_factor: int) -> dict[str, int]:
    """The linears tiertrain tiles for a tile factor: each block's qkv, fc1 and fc2 (the
    (h→3h), (h→4h), (4h→h) operators, ZeRO-Infinity §5.1.3)."""
    return {"blocks.*.attn.qkv": tile_factor, "blocks.*.mlp.fc1": tile_factor,
            "blocks.*.mlp.fc2": tile_factor}


_LAYOUTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def engine_units(model: nn.Module, stage: int, dp: int, bucket_mb: float = 25.0,
                 persistence_threshold: int = 0, compute: torch.dtype = torch.float32):
    """The engine's FlatLayout for ``model`` (any device, meta included) computing in
    ``compute``: exactly what ``tiertrain.zero.plan.default_plan`` lays out for the engine
    (cached per module; the module must not change)."""
    from tiertrain.zero.layout import bucket_layout, module_layout

    key = (stage, dp if stage else 1, float(bucket_mb) if stage < 3 else 0.0,
           persistence_threshold if stage == 3 else 0, compute if stage == 3 else None)
    cache = _LAYOUTS.setdefault(model, {})
    if key not in cache:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if stage == 3:
            cache[key] = module_layout(named, default_unit_modules(model), dp, persistence_threshold,
                                       frozen_params=frozen_for_units(model, compute),
                                       aliases=parameter_aliases(model))
        else:
            bucket_numel = max(1, int(bucket_mb * 2**20) // 4)
            cache[key] = bucket_layout(named, 1 if stage == 0 else dp, bucket_numel)
    return cache[key]


def engine_grad_tier(stage: int, optimizer_tier: Tier) -> Tier:
    """Where the engine keeps the fp32 gradients: whole units on the device at stages 0–1;
    from stage 2 the gradient shards live with the optimizer (``zero.flat.Placement``), in
    RAM when the optimizer is on NVMe (its swap files hold masters and moments only)."""
    optimizer_tier = Tier(optimizer_tier)
    if stage < 2:
        return Tier.DEVICE
    return Tier.CPU if optimizer_tier is Tier.NVME else optimizer_tier


def stage3_gathered_bytes(module: nn.Module, precision_bytes: int, dp: int = 2,
                          persistence_threshold: int = 0) -> int:
    """Most stage-3 parameter bytes gathered at once in a step (compute dtype): the root unit
    (gathered from the start of forward to the end of backward) plus the largest block-level
    unit plus its largest nested unit (a tile). ZeRO-Infinity's MSWM for tiertrain's units;
    memory-centric tiling lowers it (tiertrain.tiling)."""
    layout = engine_units(module, 3, dp, persistence_threshold=persistence_threshold)
    root = sum(u.padded_numel for u in layout.units if not u.resident and u.label == "<root>")
    blocks: dict[str, int] = {}
    nested: dict[str, int] = {}
    for u in layout.units:
        if u.resident or u.label == "<root>":
            continue
        top = ".".join(u.label.split(".")[:2])
        if u.label.count(".") == 1:
            blocks[top] = blocks.get(top, 0) + u.padded_numel
        else:
            nested[top] = max(nested.get(top, 0), u.padded_numel)
    block = max((blocks.get(k, 0) + nested.get(k, 0) for k in set(blocks) | set(nested)), default=0)
    return precision_bytes * (root + block)
