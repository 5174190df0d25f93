"""The blocks of a model: what activation checkpointing recomputes and ``compile_blocks``
compiles, one at a time (by default the children of every outermost ``nn.ModuleList``, the
rule stage 3's default units follow too)."""
from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn

__all__ = ["model_blocks"]


def model_blocks(model: nn.Module, blocks: Iterable[str | nn.Module] | None = None) -> list[str]:
    """Names of the blocks to consider, in model order. Default: the children of every
    nn.ModuleList (engine.default_unit_modules' rule), keeping only the outermost ones (a
    TiledLinear's tiles inside a block are part of that block). Given blocks may be module
    names or modules of the model; they must be distinct, proper submodules and disjoint."""
    names = {m: n for n, m in model.named_modules(remove_duplicate=False)}
    if blocks is None:
        found = []
        for name, module in model.named_modules():
            if isinstance(module, nn.ModuleList):
                found += [f"{name}.{c}" if name else c for c, _ in module.named_children()]
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
