"""Stage-3 parameters read while their unit is released fail by name instead of crashing.

Between a unit's gathers (ZeRO §5.3: gather → use → release) its parameters keep their
shapes but their flat buffer has no memory. torch does not check a tensor's storage before
reading it, so ``p.norm()`` there reads freed memory (a segmentation fault), and
``torch.save(model.state_dict())`` writes a file that cannot be loaded. While a unit is
released its plain ``nn.Parameter`` objects therefore take the class :class:`ReleasedParameter`,
whose ``__torch_function__`` lets metadata through (shape, dtype, device, grad, hooks) and
refuses any read of values with an error naming the parameter and how to read it:
``engine.gathered_parameters()``, ``engine.full_state_dict()``, ``engine.save_pretrained()``.
Gathering gives the objects their class back; they stay the same objects (hooks, optimizer
references and dictionary keys are unaffected). A parameter of another class (a subclass of
``nn.Parameter``) keeps its class and is not guarded.

An engine records on each parameter it binds to its flat buffers, at every stage, the name the
error gives (:func:`hold`) and removes it on close (:func:`let_go`): ``wrap()`` refuses a model
that an engine not yet closed still holds.
"""
from __future__ import annotations

from typing import Iterable

import torch
import torch.nn as nn

from ..errors import ReleasedParameterError

__all__ = ["HOOK_AFTER_WRAP", "METADATA_READS", "ReleasedParameter",
           "ReleasedParameterError", "called", "conversion_error", "first_instance",
           "held", "hold", "let_go", "mark_gathered", "mark_released"]

NAME = "tiertrain_name"
"""The attribute holding a held parameter's name in the model (see the module docstring)."""


def _metadata_functions() -> frozenset:
    T = torch.Tensor
    getters = ("shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout", "names",
               "nbytes", "itemsize", "is_cuda", "is_meta", "is_sparse", "is_quantized", "grad_fn",
               "_backward_hooks", "_post_accumulate_grad_hooks")
    setters = ("grad", "requires_grad", "_backward_hooks", "_post_accumulate_grad_hooks")
    methods = ("size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "__len__",
               "register_hook", "register_post_accumulate_grad_hook", "requires_grad_", "get_device",
               "data_ptr", "untyped_storage", "storage_offset", "stride", "is_contiguous", "__hash__")
    found = [getattr(T, n).__get__ for n in getters if hasattr(T, n) and hasattr(getattr(T, n), "__get__")]
    found += [getattr(T, n).__set__ for n in setters if hasattr(getattr(T, n, None), "__set__")]
    found += [getattr(T, n) for n in methods if hasattr(T, n)]
    return frozenset(found)


METADATA_READS = _metadata_functions()
"""What a released parameter (and a held gradient, tiertrain/held_gradients.py) answers: its
metadata, its gradient and hooks, never its values."""


def first_instance(kind: type, args: tuple, kwargs: dict | None):
    """The first argument of a ``__torch_function__`` call (looking into lists and tuples, as
    torch's tensor lists) that is a ``kind``, or None: the tensor a refusal names."""
    given = [a for arg in (*args, *(kwargs or {}).values())
             for a in (arg if isinstance(arg, (list, tuple)) else (arg,))]
    return next((a for a in given if isinstance(a, kind)), None)


class ReleasedParameter(nn.Parameter):
    """An ``nn.Parameter`` of a released stage-3 unit (see the module docstring). Never
    constructed: a parameter takes this class at release and gives it back at gather."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func in METADATA_READS:
            return nn.Parameter.__torch_function__(func, types, args, kwargs or {})
        raise ReleasedParameterError(_explain(first_instance(ReleasedParameter, args, kwargs), called(func)))

    def __repr__(self) -> str:
        return f"ReleasedParameter({_name(self)!r}, shape={tuple(self.shape)}, dtype={self.dtype}: {_REMEDY})"

    __str__ = __repr__


_REMEDY = ("its stage-3 unit is released outside forward, its values live in the ranks' shards; read it "
           "inside `with engine.gathered_parameters():`, or use engine.full_state_dict() / "
           "engine.save_pretrained(dir) (collective: on every rank). A model that computes with it in backward "
           "outside its unit's forward (reversible layers that re-run a sublayer to recover their inputs, as "
           "Reformer's) trains at zero.stage 2 or lower")

HOOK_AFTER_WRAP = (
    "a hook on the unit's module read it outside the unit's forward: a forward hook registered after wrap() runs "
    "after the engine's own (registered at wrap()) has released the unit, so register it before wrap(); a "
    "backward hook runs after the unit's backward (read the parameter in a forward hook instead)")
"""The hooks that read a stage-3 parameter outside its unit's forward (both errors name them)."""


def _name(p) -> str:
    return p.__dict__.get(NAME, "?") if p is not None else "?"


def called(func) -> str:
    """How the read was written: ``.data`` for a property's getter, ``norm()`` for a function."""
    name = getattr(func, "__name__", repr(func))
    if name in ("__get__", "__set__"):
        return "." + getattr(getattr(func, "__self__", None), "__name__", "?")
    return name + "()"


_CONVERSIONS = frozenset({"to", "half", "float", "double", "bfloat16", "cuda", "cpu", "type"})
"""What Module.half(), .to(dtype or device), .cuda() call on each parameter."""

_CONVERSION_ADVICE = (
    "the engine owns its parameters' dtype and device (precision.dtype, the topology's device), and a converted "
    "parameter is no longer a view of the engine's buffers, so the updates would stop reaching the model. Convert "
    "or resize it before wrap() (or set precision.dtype); for a converted copy of the trained model, use "
    "engine.full_state_dict(), or engine.close(), which hands the model back")


def _explain(p, what: str) -> str:
    shape = f" of shape {tuple(p.shape)}" if p is not None else ""
    read = f"{what} read parameter {_name(p)!r}{shape}, but {_REMEDY}. If {HOOK_AFTER_WRAP}"
    if what.rstrip("()") in _CONVERSIONS:  # (a copy of one parameter, or the whole model converted)
        return f"{read}. If that was model.half() or model.to(...) of the wrapped model: {_CONVERSION_ADVICE}"
    return read


def conversion_error(name: str, how: str) -> str:
    """The error for a wrapped model's parameter found converted to another dtype or device
    (at stages 0-2, at the next forward; stage 3 refuses the conversion as it happens)."""
    return f"parameter {name!r} of a wrapped model was {how}: {_CONVERSION_ADVICE}"


class _Held(str):
    """A held parameter's name. Pickled or copied it becomes a plain str: a model saved whole
    with torch.save and loaded again is held by no engine."""

    def __reduce__(self):
        return str, (str(self),)


def hold(params: dict[str, nn.Parameter]) -> None:
    """An engine binds these parameters to its flat buffers: record each one's name in the
    model (for the error of a read while released, and wrap()'s refusal of a held model)."""
    for name, p in params.items():
        p.__dict__[NAME] = _Held(name)


def let_go(params: Iterable[nn.Parameter]) -> None:
    """The engine closed, or its wrap() failed: no engine holds these parameters any more."""
    for p in params:
        p.__dict__.pop(NAME, None)


def held(params: Iterable[nn.Parameter]) -> list[str]:
    """The names of those of params that an engine not yet closed holds."""
    return [str(p.__dict__[NAME]) for p in params if isinstance(p.__dict__.get(NAME), _Held)]


def mark_released(params: Iterable[nn.Parameter]) -> None:
    """The unit holding these parameters was released: reads of plain parameters now raise."""
    for p in params:
        if type(p) is nn.Parameter:
            p.__class__ = ReleasedParameter


def mark_gathered(params: Iterable[nn.Parameter]) -> None:
    """The unit was gathered: its parameters are plain parameters again."""
    for p in params:
        if type(p) is ReleasedParameter:
            p.__class__ = nn.Parameter
