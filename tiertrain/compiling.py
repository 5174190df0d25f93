"""``torch.compile`` for a model the engine wraps: each block's ``forward`` compiled, so the
engine's hooks (stage 3's gathering and release, the checks) run around the compiled code and
each block call runs one graph (docs/compile.md; tests/test_compile.py)."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn

from .offload.activations import checkpoint_blocks

__all__ = ["compile_blocks"]


def compile_blocks(model: nn.Module, blocks: Iterable[str | nn.Module] | None = None,
                   **compile_options: Any) -> list[str]:
    """Compile the ``forward`` of each block of ``model`` in place, with ``torch.compile``'s
    options (``backend``, ``mode``, ``dynamic``, ...); call before ``tiertrain.wrap``. ``blocks``:
    module names or modules (default: the children of every outermost ``nn.ModuleList``, as
    activation checkpointing takes them). The module tree and every parameter name stay as they
    were (a ``torch.compile(block)`` wrapper would add ``_orig_mod`` to them). Returns the names of
    the blocks compiled."""
    names = checkpoint_blocks(model, blocks)
    for name in names:
        block = model.get_submodule(name)
        block.forward = torch.compile(block.forward, **compile_options)
    return names
