"""Memory-centric tiling (ZeRO-Infinity §5.1.3), and the loss computed in tiles of tokens.

A large linear runs as a mathematically equal sequence of smaller linears over tiles of its
output features. Each tile is a child of an ``nn.ModuleList``, which is exactly what
ZeRO-3 takes as a gather unit (``engine.default_unit_modules``), so under stage 3 each
tile's parameters are gathered just before it runs and released right after: the working
memory of the operator (ZeRO-Infinity's MSWM, params + grads of the largest linear) falls
in proportion to the number of tiles, and hidden sizes that would not fit as one operator
train in pieces.
"""
from __future__ import annotations

import fnmatch
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint


class TiledLinear(nn.Module):
    """y = x Wᵀ + b computed as ``tiles`` linears over consecutive slices of the output
    features, concatenated; equal to the untiled layer."""

    def __init__(self, in_features: int, out_features: int, tiles: int, bias: bool = True,
                 device=None, dtype=None):
        super().__init__()
        if not 1 <= tiles <= out_features:
            raise ValueError(f"tiles={tiles} is invalid: expected 1 <= tiles <= out_features ({out_features})")
        self.in_features, self.out_features = in_features, out_features
        sizes = [out_features // tiles + (1 if i < out_features % tiles else 0) for i in range(tiles)]
        self.tiles = nn.ModuleList(nn.Linear(in_features, n, bias=bias, device=device, dtype=dtype) for n in sizes)

    @classmethod
    def from_linear(cls, linear: nn.Linear, tiles: int) -> "TiledLinear":
        """A tiled copy of linear holding exactly its weights."""
        tiled = cls(linear.in_features, linear.out_features, tiles, bias=linear.bias is not None,
                    device=linear.weight.device, dtype=linear.weight.dtype)
        start = 0
        with torch.no_grad():
            for tile in tiled.tiles:
                stop = start + tile.out_features
                tile.weight.copy_(linear.weight[start:stop])
                if linear.bias is not None:
                    tile.bias.copy_(linear.bias[start:stop])
                start = stop
        return tiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([tile(x) for tile in self.tiles], dim=-1)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, tiles={len(self.tiles)}"


def apply_tiling(model: nn.Module, plan: dict[str, int]) -> nn.Module:
    """Replace the nn.Linear modules whose names match a pattern of plan (fnmatch, e.g.
    ``"blocks.*.mlp.fc1"``) with TiledLinear of that many tiles, in place, keeping their
    weights. A pattern that matches no linear is an error (a typo would otherwise silently
    leave the memory unchanged)."""
    for pattern, tiles in plan.items():
        matched = [(name, m) for name, m in model.named_modules()
                   if fnmatch.fnmatchcase(name, pattern) and isinstance(m, nn.Linear)]
        if not matched:
            raise ValueError(f"tiling pattern {pattern!r} matches no nn.Linear in the model")
        for name, linear in matched:
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, TiledLinear.from_linear(linear, tiles))
    return model


def _tile_loss(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor:
    logits = logits_of(hidden)
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.to(dtype), labels, ignore_index=-100, reduction="sum")


def cross_entropy_in_tiles(hidden: torch.Tensor, logits_of: Callable[[torch.Tensor], torch.Tensor],
                           labels: torch.Tensor, tile_tokens: int) -> torch.Tensor:
    """The summed cross-entropy of ``logits_of(hidden)`` against ``labels`` (-100 ignored),
    computed over tiles of ``tile_tokens`` tokens whose logits are recomputed in backward
    (torch.utils.checkpoint), so that the logits of one tile exist at a time instead of all of
    them (ALST's tiled loss: a long sequence's logits, tokens × vocabulary in fp32, are often
    the largest activation). hidden: [..., tokens, h]; labels: [..., tokens]."""
    if tile_tokens <= 0:
        raise ValueError(f"tile_tokens={tile_tokens} is invalid: expected a positive number of tokens")
    flat, targets = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = None
    for start in range(0, flat.shape[0], tile_tokens):
        part = checkpoint(_tile_loss, logits_of, flat[start:start + tile_tokens], targets[start:start + tile_tokens],
                          use_reentrant=False)
        total = part if total is None else total + part
    return total
