"""The plain-state checker: what a checkpoint may hold, checked when it is saved.

A rank file is read with ``torch.load(weights_only=True)``, which rebuilds tensors and plain
values only (no code runs on load). So that every checkpoint tiertrain writes loads that way,
``plain_state`` checks a part's state at save time and converts what converts losslessly
(numpy scalars, IntEnum-like members, namedtuples, dict and set subclasses), and refuses
anything else with a CheckpointError naming its key path; ``json_like_extra`` checks the
caller's extras, which must be JSON-like values. Used by tiertrain/state/checkpoint.py's save.
"""
from __future__ import annotations

import enum
import sys
from collections import Counter, OrderedDict
from typing import Any, Mapping

import torch

from .files import CheckpointError


_PLAIN_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)
"""Leaf types torch's weights-only unpickler rebuilds (a subset of its allowlist, see
torch._weights_only_unpickler._get_allowed_globals); exact types, not subclasses: a subclass
is pickled by its own class, which that unpickler refuses."""
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)
_VALID = ("a checkpoint part's state may hold only tensors, None, bool, int, float, complex, str, bytes, "
          "torch.dtype, torch.device, torch.Size and dict/list/tuple/set of them (it is loaded with "
          "torch.load(weights_only=True), which rebuilds nothing else)")


def _describe(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__module__}.{type(value).__qualname__} ({text[:60]}{'...' if len(text) > 60 else ''})"


def _plain_scalar(value: Any) -> tuple[bool, Any]:
    """(True, the plain equivalent) for a scalar the weights-only unpickler would refuse but
    whose plain value compares equal (so load_state_dict sees the same thing): numpy scalars,
    IntEnum/StrEnum-like members, other int/float/str subclasses. (False, None) otherwise."""
    numpy = sys.modules.get("numpy")  # (never imported here: state holding numpy has it loaded)
    if numpy is not None and isinstance(value, numpy.generic):
        plain = value.item()  # (a longdouble or datetime64 stays non-plain: refused)
        return (True, plain) if type(plain) in _PLAIN_LEAVES else (False, None)
    for base in (int, float, str):
        if isinstance(value, base):  # (an Enum member here mixes in base: equal to its value)
            return True, getattr(base, f"__{base.__name__}__")(value)
    return False, None


def plain_state(value: Any, path: str = "state") -> Any:
    """``value`` with only the types torch.load(weights_only=True) rebuilds, so that a
    checkpoint saved from it loads without unpickling code. Lossless conversions are made
    (numpy scalars, int/float/str subclasses such as IntEnum, namedtuples to tuples, dict and
    frozenset subclasses to dict and set); anything else (an object, a plain Enum, a numpy
    array, a tensor subclass) is a CheckpointError naming its key path, e.g.
    ``state['update']['optimizer']['state'][0]['step']``. Tensors are kept as they are (not
    copied), so storage sharing survives torch.save."""
    return _plain(value, path, set())


def _plain(value: Any, path: str, open_containers: set[int]) -> Any:
    kind = type(value)
    if kind in _PLAIN_LEAVES:
        return value
    if isinstance(value, torch.Tensor):
        if kind not in _PLAIN_TENSORS:
            raise CheckpointError(f"checkpoint {path} is a tensor subclass {_describe(value)}: {_VALID}; "
                                  f"save a plain tensor (e.g. .as_subclass(torch.Tensor) or its local shard)")
        return value
    if isinstance(value, (dict, list, tuple, set, frozenset)):
        if id(value) in open_containers:
            raise CheckpointError(f"checkpoint {path} contains itself (a reference cycle): {_VALID}")
        open_containers.add(id(value))
        try:
            if isinstance(value, dict):
                items = {_plain_key(k, path): _plain(v, f"{path}[{k!r}]", open_containers) for k, v in value.items()}
                return kind(items) if kind in (OrderedDict, Counter) else items
            if isinstance(value, (set, frozenset)):
                return {_plain_key(v, f"{path} (a set)") for v in value}
            items = [_plain(v, f"{path}[{i}]", open_containers) for i, v in enumerate(value)]
            return items if isinstance(value, list) else tuple(items)  # (a namedtuple: a tuple)
        finally:
            open_containers.discard(id(value))
    converted, plain = _plain_scalar(value)
    if converted:
        return plain
    hint = ""
    if isinstance(value, enum.Enum):
        hint = "; save its .value and rebuild the member in load_state_dict"
    elif type(value).__module__ == "numpy":
        hint = "; save torch.from_numpy(...) or .tolist() instead"
    raise CheckpointError(f"checkpoint {path} is {_describe(value)}: {_VALID}{hint}")


def _plain_key(key: Any, path: str) -> Any:
    """A dict key or set element: a plain scalar, or a tuple of them."""
    if type(key) in _PLAIN_LEAVES:
        return key
    if isinstance(key, tuple):
        return tuple(_plain_key(k, path) for k in key)
    converted, plain = _plain_scalar(key)
    if converted:
        return plain
    raise CheckpointError(f"checkpoint {path} has the key {_describe(key)}: {_VALID}")


def json_like_extra(extra: Mapping[str, Any] | None) -> dict:
    """The caller's extras, checked: a dict of str keys whose values are None, bool, int,
    float, str, or lists/tuples/dicts (str keys) of them. What resumes a loop (a step, a data
    sampler's counters) fits; tensors and objects belong in a checkpoint part. Checked at save
    time, so a checkpoint that could not be loaded safely is never written."""
    if extra is None:
        return {}
    if type(extra) is not dict:
        raise CheckpointError(f"save_checkpoint(extra=) must be a dict of JSON-like values, "
                              f"got {_describe(extra)}")
    _check_json_like(extra, "extra")
    return extra


def _check_json_like(value: Any, path: str) -> None:
    kind = type(value)
    if kind in (type(None), bool, int, float, str):
        return
    if kind in (list, tuple):
        for i, v in enumerate(value):
            _check_json_like(v, f"{path}[{i}]")
        return
    if kind is dict:
        for k, v in value.items():
            if type(k) is not str:
                raise CheckpointError(f"save_checkpoint(extra=): {path} has the key {_describe(k)}; "
                                      f"extras are JSON-like: keys must be str")
            _check_json_like(v, f"{path}[{k!r}]")
        return
    raise CheckpointError(f"save_checkpoint(extra=): {path} is {_describe(value)}; extras are JSON-like: "
                          f"None, bool, int, float, str and lists/tuples/dicts (str keys) of them")
