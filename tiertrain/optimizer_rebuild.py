"""An optimizer instance given to ``wrap()`` as the engine rebuilds it: its class, the
constructor arguments among its ``defaults``, its param groups. The engine steps that rebuilt
optimizer over its own shards (tiertrain/optim.py), never the instance.

A constructor may keep settings outside ``defaults``: bitsandbytes' 8-bit optimizers keep
``optim_bits``, ``min_8bit_size`` and ``percentile_clipping`` in ``self.args``, and per-parameter
overrides (``GlobalOptimManager.override_config``) keyed by the parameters' ids (a setting
that names the instance's parameters is refused too: the rebuilt optimizer steps other tensors). Rebuilt from
the class and ``defaults`` alone these go back to their defaults: ``AdamW8bit(min_8bit_size=256)``
would step 32-bit states where the user asked for 8-bit ones, in silence. So the rebuilt optimizer
is built once on a stand-in tensor and its own attributes (those a bare ``torch.optim.Optimizer``
lacks) compared with the instance's; any that differ are refused by name, with the form that
keeps them (a factory of param groups).
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .config import ConfigError

__all__ = ["check_rebuilt"]

_MISSING = object()
_DEPTH = 4


def _base_attributes() -> frozenset[str]:
    return frozenset(vars(torch.optim.Optimizer([torch.zeros(1, requires_grad=True)], {})))


def _same(a: Any, b: Any, depth: int = 0) -> bool:
    """Whether two settings are the same, as far as can be told: values compared, containers
    and plain objects member by member; tensors that need gradients (parameters the instance
    holds, which the rebuilt optimizer holds its own of) and objects of unknown kind count as
    the same."""
    if a is b:
        return True
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        if a.requires_grad or b.requires_grad:
            return True
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.detach().cpu(), b.detach().cpu())
    if depth > _DEPTH:
        return True
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], depth + 1) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y, depth + 1) for x, y in zip(a, b))
    if isinstance(a, (set, frozenset, str, bytes, int, float, complex, bool, type(None))):
        return a == b or (isinstance(a, float) and a != a and b != b)
    if hasattr(a, "__dict__") and not callable(a):
        return _same(vars(a), vars(b), depth + 1)
    return True


def _refers_to(value: Any, ids: set[int], depth: int = 0) -> bool:
    """Whether a setting names the instance's parameters by identity: a dict keyed by their
    ids, or a module whose parameters they are (settings per parameter, which a rebuilt
    optimizer over other tensors cannot find)."""
    if depth > _DEPTH or isinstance(value, (torch.Tensor, str, bytes, int, float, bool, type(None))):
        return False
    if isinstance(value, torch.nn.Module):
        return any(id(p) in ids for p in value.parameters())
    if isinstance(value, dict):
        return any(isinstance(k, int) and k in ids for k in value) or \
            any(_refers_to(v, ids, depth + 1) for v in value.values())
    if isinstance(value, (list, tuple, set, frozenset)):
        return any(_refers_to(v, ids, depth + 1) for v in value)
    if hasattr(value, "__dict__") and not callable(value):
        return _refers_to(vars(value), ids, depth + 1)
    return False


def _shown(value: Any) -> str:
    if hasattr(value, "__dict__") and not isinstance(value, torch.Tensor):
        value = {k: v for k, v in vars(value).items() if not k.startswith("_")}
    text = repr(value)
    return text if len(text) <= 160 else text[:157] + "..."


def check_rebuilt(instance: torch.optim.Optimizer, build: Callable[[list], torch.optim.Optimizer]) -> None:
    """Raise ConfigError when ``build`` (the instance's class over its defaults) makes an
    optimizer whose own settings differ from the instance's (see the module docstring). A
    class that cannot be built on a small stand-in matrix is left to the probe that follows
    (tiertrain/optim_probe.py), which names what it needs."""
    try:
        rebuilt = build([{"params": [torch.zeros(2, 2, requires_grad=True)]}])
    except Exception:
        return
    base = _base_attributes()
    names = sorted(n for n in (set(vars(instance)) | set(vars(rebuilt))) - base  # (methods patched on: behaviour)
                   if not callable(getattr(instance, n, None)) and not callable(getattr(rebuilt, n, None)))
    ids = {id(p) for g in instance.param_groups for p in g["params"]}
    differ = [n for n in names if not _same(getattr(instance, n, _MISSING), getattr(rebuilt, n, _MISSING))
              or _refers_to(getattr(instance, n, None), ids)]
    if not differ:
        return
    cls = type(instance)
    shown = "; ".join(f"{n} = {_shown(getattr(instance, n, None))}" for n in differ)
    raise ConfigError(
        f"optimizer: the {cls.__name__} instance keeps settings outside its param groups and defaults ({shown}), "
        f"which the engine cannot rebuild: it steps a new {cls.__name__} over its own shards from the class, "
        f"the defaults and the param groups, and that one would differ in {', '.join(differ)}. Give the "
        f"optimizer as a factory of param groups instead, with the same arguments: "
        f"optimizer=functools.partial({cls.__module__}.{cls.__qualname__}, ...) (param_groups=[...] by "
        f"parameter name for groups of their own)")
