"""The blocks of a model: what activation checkpointing recomputes and ``compile_blocks``
compiles, one at a time (by default the children of every outermost ``nn.ModuleList``, the
rule stage 3's default units follow too), and which of them the model checkpoints itself."""
from __future__ import annotations

import sys
from collections.abc import Iterable

import torch.nn as nn
from torch.nn.utils.parametrize import ParametrizationList

__all__ = ["list_children", "model_blocks", "own_checkpoint_interval"]


def list_children(model: nn.Module) -> list[str]:
    """Names of the children of every nn.ModuleList of the model, in model order: the blocks of
    a transformer. A parametrization's list (``nn.utils.parametrizations.weight_norm``,
    ``spectral_norm``, ``orthogonal``: the transforms of one weight) is not a list of blocks."""
    names = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and not isinstance(module, ParametrizationList):
            names += [f"{name}.{child}" if name else child for child, _ in module.named_children()]
    return names


def model_blocks(model: nn.Module, blocks: Iterable[str | nn.Module] | None = None) -> list[str]:
    """Names of the blocks to consider, in model order. Default: ``list_children`` (the rule
    stage 3's default units follow too), keeping only the outermost ones (a
    TiledLinear's tiles inside a block are part of that block). Given blocks may be module
    names or modules of the model; they must be distinct, proper submodules and disjoint."""
    names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    if blocks is None:
        found = list_children(model)
        if not found:
            raise ValueError(
                f"{type(model).__name__} has no nn.ModuleList, so it has no default blocks; pass "
                f"blocks=[...] (submodule names such as 'layers.0', or the modules themselves)")
        chosen = [n for n in found if not any(n.startswith(o + ".") for o in found if o != n)]
    else:
        chosen = []
        for b in list(blocks):
            if isinstance(b, nn.Module):
                if b not in names:
                    raise ValueError(f"blocks: a {type(b).__name__} that is not a submodule of "
                                     f"{type(model).__name__}; valid: its submodules or their names")
                b = names[b]
            if not isinstance(b, str) or b == "":
                raise ValueError(f"blocks: {b!r} is invalid: expected the name of a proper submodule of "
                                 f"{type(model).__name__} (not the model itself), e.g. 'layers.0'")
            try:
                model.get_submodule(b)
            except AttributeError:
                some = [n for n, _ in model.named_children()]
                raise ValueError(f"blocks: {b!r} is not a submodule of {type(model).__name__}; "
                                 f"valid names start with one of {some}") from None
            if b in chosen:
                raise ValueError(f"blocks: {b!r} is given twice; name each block once")
            chosen.append(b)
        if not chosen:
            raise ValueError("blocks=[] is invalid: expected at least one block name (or None for the default)")
        for a in chosen:
            for b in chosen:
                if b.startswith(a + "."):
                    raise ValueError(f"blocks {a!r} and {b!r} are nested; blocks must be disjoint (name the "
                                     f"outer one only)")
        order = {n: i for i, (n, _) in enumerate(model.named_modules(remove_duplicate=False))}
        chosen.sort(key=lambda n: order.get(n, len(order)))
    return chosen


def own_checkpoint_interval(module: nn.Module) -> int:
    """k when the model checkpoints blocks 0, k, 2k, … itself, 0 when it checkpoints none.
    transformers marks each block it checkpoints (``gradient_checkpointing`` on every
    ``GradientCheckpointingLayer``, its ``every_n_layers`` counting those blocks in order);
    a pattern that is not every k-th block is counted as evenly spread checkpoints no more
    numerous than its own (never fewer activations kept than the model keeps)."""
    # (a model of transformers >= 4.52 has imported the class: nothing to import for any other)
    layer = getattr(sys.modules.get("transformers.modeling_layers"), "GradientCheckpointingLayer", None)
    flags = [m.gradient_checkpointing is True for m in module.modules() if layer is not None and isinstance(m, layer)]
    if not flags:  # transformers < 4.52 checkpoints every layer of a model that says it checkpoints
        return 1 if getattr(module, "is_gradient_checkpointing", False) is True else 0
    on = [i for i, flag in enumerate(flags) if flag]
    if not on:
        return 0
    n = len(flags)
    regular = next((k for k in range(1, n + 1) if on == list(range(0, n, k))), None)
    return regular if regular is not None else -(-n // len(on))
