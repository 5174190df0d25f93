"""Memory-centric tiling (ZeRO-Infinity §5.1.3), and the loss computed in tiles of tokens.

A large linear runs as a mathematically equal sequence of smaller linears over tiles of its
output features. Each tile is a child of an ``nn.ModuleList``, which is exactly what
ZeRO-3 takes as a gather unit (``engine.default_unit_modules``), so under stage 3 each
tile's parameters are gathered just before it runs and released right after: the working
memory of the operator (ZeRO-Infinity's MSWM, params + grads of the largest linear) falls
in proportion to the number of tiles, and hidden sizes that would not fit as one operator
train in pieces.

Tiles of tokens (DeepSpeed ALST, "Arctic Long Sequence Training", §3): the loss
(:func:`cross_entropy_in_tiles`) and the MLP (:func:`mlp_in_tiles`, applied to a model's
blocks by :func:`apply_tiled_mlp`) run over tiles of a long sequence, each tile recomputed in
backward, so the largest per-token intermediates (the logits, the MLP's 4×hidden) exist for
one tile at a time instead of the whole sequence.
"""
from __future__ import annotations

import contextlib
import fnmatch
import functools
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from .config import ConfigError
from .offload.recompute import recomputation


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


def summed_cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The cross-entropy of ``logits`` [..., V] against ``labels`` [...], summed over the
    labelled tokens (-100 ignored), in fp32 at least: the numerator of a token mean that a
    context-parallel rank shares with its group (tiertrain/parallel/context.py exact_token_mean)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(dtype), labels.reshape(-1).to(logits.device),
                           ignore_index=-100, reduction="sum")


def _tile_loss(logits_of: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
               labels: torch.Tensor) -> torch.Tensor:
    return summed_cross_entropy(logits_of(hidden), labels)


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


def _check_tile_tokens(tile_tokens) -> None:
    if isinstance(tile_tokens, bool) or not isinstance(tile_tokens, int) or tile_tokens < 0:
        raise ConfigError(f"activations.mlp_tile_tokens={tile_tokens!r} is invalid: expected a number of tokens "
                          f">= 0 (0: no tiles)")


def mlp_in_tiles(mlp: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor,
                 tile_tokens: int) -> torch.Tensor:
    """``mlp(hidden)`` for a position-wise ``mlp``, computed over tiles of ``tile_tokens``
    tokens of each sequence (hidden: [..., tokens, h]; the last tile may be shorter), each tile
    under non-reentrant torch.utils.checkpoint: forward keeps a tile's input only, backward
    recomputes its intermediate just before its gradient, so one tile's intermediate (4·h per
    token in a GPT MLP) exists at a time instead of the whole sequence's (ALST's tiled MLP). A
    tile covering the sequence runs ``mlp`` once, as it is (nothing to save by recomputing)."""
    _check_tile_tokens(tile_tokens)
    tokens = hidden.shape[-2]
    if tile_tokens == 0 or tile_tokens >= tokens:
        return mlp(hidden)
    outs = []
    for start in range(0, tokens, tile_tokens):
        # contiguous: MLPs that view their input (GPT-2's Conv1D, MoE blocks) need it when batch > 1;
        # the copies replace the whole input, which only the tiles keep
        out = checkpoint(mlp, hidden[..., start:start + tile_tokens, :].contiguous(), use_reentrant=False,
                         context_fn=_recomputation_marked)
        if not isinstance(out, torch.Tensor):
            raise ConfigError(f"mlp_in_tiles tiles a position-wise MLP returning one tensor; {type(mlp).__name__} "
                            f"returned a {type(out).__name__} (a mixture of experts' router output?): set "
                            f"activations.mlp_tile_tokens=0 for this model")
        outs.append(out)
    return torch.cat(outs, dim=-2)


def _recomputation_marked():
    """Backward's recomputation of a tile is marked as a checkpointed block's is, so that ZeRO-3
    units inside the MLP (TiledLinear's tiles) gather for it without entering the traced order."""
    return contextlib.nullcontext(), recomputation()


def _tiled_forward(self, hidden: torch.Tensor) -> torch.Tensor:
    return mlp_in_tiles(functools.partial(self.mlp_untiled.forward, self), hidden, self.mlp_tile_tokens)


@functools.cache
def _tiled_class(base: type) -> type:
    """The subclass of an MLP class whose forward runs in tiles (one per class, shared)."""
    return type(f"Tiled{base.__name__}", (base,), {"forward": _tiled_forward, "mlp_untiled": base,
                                                   "__module__": __name__})


def block_mlps(model: nn.Module) -> list[nn.Module]:
    """The MLPs of a model's transformer blocks: every submodule registered as ``mlp`` (the
    name tiertrain's GPT blocks and Hugging Face decoder layers give their feed-forward
    network)."""
    return [child for module in model.modules() for name, child in module.named_children() if name == "mlp"]


def apply_tiled_mlp(model: nn.Module, tile_tokens: int) -> nn.Module:
    """Run every block's MLP (:func:`block_mlps`) over tiles of ``tile_tokens`` tokens
    (:func:`mlp_in_tiles`), in place, by swapping each MLP's class for a subclass whose forward
    calls the class's own forward per tile (no modeling code copied; parameters, names and
    state dict unchanged); returns the model. 0 restores the untiled MLPs (also
    :func:`remove_tiled_mlp`). Under ZeRO-3 a tile's recomputation runs inside its block's
    backward, when the block's parameters are gathered (tiertrain/zero/stage3.py gathers a
    unit when the gradient of its output arrives)."""
    _check_tile_tokens(tile_tokens)
    mlps = block_mlps(model)
    if not mlps and tile_tokens:
        raise ConfigError(f"activations.mlp_tile_tokens={tile_tokens}: {type(model).__name__} has no block MLP (a "
                          f"submodule named 'mlp') to tile; set it to 0")
    if tile_tokens:
        _check_routing(model, mlps, tile_tokens)
    for mlp in mlps:
        base = getattr(type(mlp), "mlp_untiled", type(mlp))
        if tile_tokens:
            mlp.__class__, mlp.mlp_tile_tokens = _tiled_class(base), tile_tokens
        else:
            mlp.__class__ = base
            mlp.__dict__.pop("mlp_tile_tokens", None)
    return model


def _check_routing(model: nn.Module, mlps: list[nn.Module], tile_tokens: int) -> None:
    """A mixture of experts is tiled only where a tile routes its tokens as the whole sequence
    would: per token (Mixtral, Qwen-MoE), its router's outputs not collected per call."""
    why = None
    for mlp in mlps:
        capacity = next((m for m in mlp.modules() if getattr(m, "expert_capacity", None)), None)
        if capacity is not None:
            why = (f"{type(mlp).__name__} routes with an expert capacity ({type(capacity).__name__}.expert_capacity="
                   f"{capacity.expert_capacity}): which tokens an expert drops depends on the tokens routed "
                   f"together, so tiles would train a different model")
            break
    config = getattr(model, "config", None)
    if why is None and getattr(config, "output_router_logits", False) and any(
            "experts" in dict(mlp.named_children()) for mlp in mlps):
        why = ("the model collects its routers' logits (config.output_router_logits=True) once per MLP call: "
               "tiles would hand the load-balancing loss one entry per tile instead of one per layer")
    if why is not None:
        raise ConfigError(f"activations.mlp_tile_tokens={tile_tokens}: {why}; set activations.mlp_tile_tokens=0 "
                          f"for this model")


def remove_tiled_mlp(model: nn.Module) -> nn.Module:
    """Undo :func:`apply_tiled_mlp`."""
    return apply_tiled_mlp(model, 0)


def tiled_mlp_tokens(model: nn.Module) -> int:
    """The tile of a model's tiled MLPs (0: untiled); an error if its MLPs differ."""
    tiles = {getattr(mlp, "mlp_tile_tokens", 0) for mlp in block_mlps(model)}
    if len(tiles) > 1:
        raise ConfigError(f"the model's block MLPs run in different tiles {sorted(tiles)}: apply "
                          f"tiertrain.tiling.apply_tiled_mlp(model, tile_tokens) to all of them")
    return tiles.pop() if tiles else 0
