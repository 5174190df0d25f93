"""``torch.compile`` for a model the engine wraps (docs/compile.md; tests/test_compile.py).

The engine's hooks (stage 3's gathering and release, the checks) run eagerly outside compiled
code, so what is compiled is each module's ``forward``: :func:`compile_blocks` compiles every
block's. A ``torch.compile(module)`` wrapper is taken apart by :func:`unwrap_compiled` (``wrap``
and activation checkpointing call it): the wrapped module goes back in its place with its
``forward`` compiled by the wrapper's own settings, so the module tree and every parameter
name stay the model's (the wrapper would add ``_orig_mod`` to each name below it, and with
them to checkpoints and exports)."""
from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
# Private: the type torch.compile(module) returns, its _orig_mod and dynamo_ctx (no public API
# names them); tests/test_private_apis.py fails, naming this module, if they change.
from torch._dynamo.eval_frame import OptimizedModule

from .blocks import model_blocks
from .config import ConfigError

__all__ = ["compile_blocks", "compile_checkpointed_block", "unwrap_compiled"]

_UNWRAPPED: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()
"""A wrapper already taken apart -> the module it wrapped (whose forward is compiled once)."""
_SETTINGS: "weakref.WeakKeyDictionary[nn.Module, Any]" = weakref.WeakKeyDictionary()
"""A module taken out of a wrapper -> the wrapper's compile settings (a callable compiling a function)."""


def unwrap_compiled(module: nn.Module) -> nn.Module:
    """``module`` with every ``torch.compile(m)`` wrapper in it replaced by ``m`` whose
    ``forward`` the wrapper's compile settings compile; the module itself when it is such a
    wrapper. The same code is compiled with the same backend and options; only the module
    call around it (hooks) runs eagerly, as the wrapper also runs it."""
    if isinstance(module, OptimizedModule):
        inner = _UNWRAPPED.get(module)
        if inner is None:
            inner = unwrap_compiled(module._orig_mod)
            inner.forward = module.dynamo_ctx(inner.forward)
            _UNWRAPPED[module] = inner
            _SETTINGS[inner] = module.dynamo_ctx
        return inner
    for name, child in list(module.named_children()):
        unwrapped = unwrap_compiled(child)
        if unwrapped is not child:
            module.register_module(name, unwrapped)
    return module


def compile_blocks(model: nn.Module, blocks: Iterable[str | nn.Module] | None = None,
                   **compile_options: Any) -> list[str]:
    """Compile the ``forward`` of each block of ``model`` in place, with ``torch.compile``'s
    options (``backend``, ``mode``, ``dynamic``, ...); call before ``tiertrain.wrap``. ``blocks``:
    module names or modules (default: the children of every outermost ``nn.ModuleList``,
    :func:`tiertrain.blocks.model_blocks`). The module tree and every parameter name stay as
    they were. Returns the names of the blocks compiled."""
    model = unwrap_compiled(model)
    names = model_blocks(model, blocks)
    for name in names:
        block = model.get_submodule(name)
        block.forward = torch.compile(block.forward, **compile_options)
    return names


def compile_checkpointed_block(model: nn.Module, name: str) -> None:
    """Before block ``name`` of ``model`` is checkpointed: torch's checkpoint runs the block
    outside compiled code, so a block inside a compiled module (``torch.compile(model)``) gets
    its own ``forward`` compiled with that module's settings. A module compiled with
    ``.compile()`` on the way is refused (its settings cannot be read back): under
    checkpointing its blocks would silently run eagerly."""
    parts = name.split(".")
    prefixes = [".".join(parts[:i]) for i in range(len(parts) + 1)]
    path = [(prefix or "the model", model.get_submodule(prefix)) for prefix in prefixes]
    for label, module in path:
        # Private: nn.Module.compile() keeps the compiled call in _compiled_call_impl (see above).
        if getattr(module, "_compiled_call_impl", None) is not None:
            raise ConfigError(
                f"activation checkpointing of block {name!r}: {label} was compiled with .compile(), whose compiled "
                f"call torch's checkpoint would bypass (the block would run eagerly); compile the blocks with "
                f"tiertrain.compile_blocks(model, **torch.compile options) instead, which works with checkpointing "
                f"(docs/compile.md)")
    block = path[-1][1]
    settings = next((_SETTINGS[m] for _, m in reversed(path[:-1]) if m in _SETTINGS), None)
    if settings is not None and block not in _SETTINGS and "forward" not in block.__dict__:
        block.forward = settings(block.forward)
