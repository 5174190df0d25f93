"""Tensors that share a parameter's memory are refused at ``wrap()``, naming both.

The engine moves every parameter into its own flat buffers (tiertrain/zero/flat.py), as FSDP
does; DDP and plain PyTorch leave them where they are. So what relied on a parameter's memory
stops following its values, in silence:

* two parameters over the same memory (tied by ``b.weight.data = a.weight.data`` rather than
  ``b.weight = a.weight``): plain PyTorch steps the one memory with both gradients; here each
  became a parameter of its own and the tie was gone;
* a tensor a module keeps that views a parameter (``self.w_t = self.w.t()`` cached at build,
  a buffer made from a parameter's memory): the forward went on reading the initial values
  while the engine trained the parameter (measured: 4 steps, loss 2.81 against plain
  PyTorch's 2.49).

Only memory that overlaps counts: parameters cut from one tensor without overlapping
(``nn.Parameter(big[:10])``, ``nn.Parameter(big[10:])``) train alike either way.
"""
from __future__ import annotations

from typing import Iterator, Sequence

import torch
import torch.nn as nn

from .config import ConfigError

__all__ = ["check_no_shared_memory"]


def _span(t: torch.Tensor) -> tuple[int, int] | None:
    """[first, last) byte address t's elements occupy; None for a tensor with no elements or no
    plain memory (meta, a subclass that hides its storage)."""
    if t.numel() == 0 or t.is_meta:
        return None
    try:
        start = t.data_ptr()
    except RuntimeError:
        return None
    if start == 0:
        return None
    last = sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return start, start + (last + 1) * t.element_size()


_MODULE_REGISTERS = frozenset({"_parameters", "_buffers", "_modules"})
"""nn.Module's own dicts of what it registers (parameters and buffers are looked at as such)."""


def _kept_tensors(root: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(what, tensor) of every buffer, and of every plain tensor attribute a module keeps (directly
    or in a list, tuple or dict), named in full for a message ("attribute 'blocks.0.w_t'").
    An attribute ``X`` beside a parameter ``X_orig`` is left out: torch.nn.utils' old
    reparametrizations (spectral_norm, prune) set it anew from ``X_orig`` before each forward,
    and spectral_norm leaves it over ``X_orig``'s memory until then."""
    for prefix, module in root.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for name, buffer in module.named_buffers(recurse=False):
            yield f"buffer {dot + name!r}", buffer
        own = dict(module.named_parameters(recurse=False))
        for name, value in vars(module).items():
            if name in _MODULE_REGISTERS or f"{name}_orig" in own:
                continue
            values = value.items() if isinstance(value, dict) else enumerate(value) \
                if isinstance(value, (list, tuple)) else [(None, value)]
            for key, item in values:
                if isinstance(item, torch.Tensor) and not isinstance(item, nn.Parameter):
                    yield f"attribute {dot + name + ('' if key is None else f'[{key!r}]')!r}", item


def check_no_shared_memory(roots: Sequence[nn.Module]) -> None:
    """ConfigError naming every parameter of the modules wrap() was given (the model, or a
    pipeline rank's stages) whose memory another parameter, a buffer or a kept tensor overlaps
    (see the module docstring)."""
    params = [(n, p) for root in roots for n, p in root.named_parameters()]
    spans = sorted(((span, n) for n, p in params if (span := _span(p)) is not None))
    found = []
    for (a, name_a), (b, name_b) in zip(spans, spans[1:]):
        if b[0] < a[1]:
            found.append(f"parameters {name_a!r} and {name_b!r} share memory")
    if spans:
        param_ids = {id(p) for _, p in params}
        for root in roots:
            for name, t in _kept_tensors(root):
                span = _span(t)
                if span is None or id(t) in param_ids:
                    continue
                over = [n for (s, e), n in spans if s < span[1] and span[0] < e]
                if over:
                    found.append(f"{name} views the memory of parameter {over[0]!r}")
    if found:
        shown = "; ".join(found[:3]) + (f" (and {len(found) - 3} more)" if len(found) > 3 else "")
        raise ConfigError(f"{shown}: the engine moves each parameter "
                          f"into buffers of its own (as FSDP does), so a tie made through .data would come apart and a "
                          f"tensor kept over a parameter's memory would keep reading its initial values while the "
                          f"parameter trains. Tie parameters as one (b.weight = a.weight), and compute views of a "
                          f"parameter in forward (or keep an independent copy: .clone())")
