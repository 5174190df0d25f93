"""``model.load_state_dict(sd)`` on a wrapped model loads as it did before ``wrap()``.

torch's load copies each value into the parameter, which after ``wrap()`` is the engine's
compute copy only: at bf16/fp16, or with the masters on another tier, the next step rewrote
the parameters from the fp32 masters it had, and the loaded weights were gone without a word;
at stage 3 the copy met a released parameter. So the engine hooks every module of the model
(public ``register_load_state_dict_pre_hook`` / ``_post_hook``): the values of the parameters
it holds are taken out of the load and, once the load has passed the last of its modules,
written where the engine keeps them (tiertrain/unit_values.py: compute copy, shard and fp32
master, from the values themselves), as ``load_pretrained`` does from files. Buffers and
parameters the engine leaves whole load as torch loads them; missing, unexpected and
mis-shaped keys are torch's to report, as before. Inside ``engine.gathered_parameters()`` the
gathered copies load as torch loads them (the context's modifier rank writes them back).

Every data-parallel rank must load, and load the same values: each writes its own shards from
what it was given, so a load on some ranks only, or of different values, would leave the ranks
training different models; both fail on every rank, naming the parameters (docs/migrate-fsdp2.md).
"""
from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable

import torch
import torch.nn as nn

from .errors import TiertrainError, listing
from .unit_values import ValuesInMemory, write_into_units
from .zero.construct import full_shape

if TYPE_CHECKING:
    from .training_core import TrainingCore

OPERATION = "model.load_state_dict()"


class LoadedValuesDifferError(TiertrainError, RuntimeError):
    """Data-parallel ranks gave model.load_state_dict() different parameters or values."""

    exit_code = 1


def _digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 2  # < 2**62


def _value_digest(name: str, value: torch.Tensor) -> int:
    """A digest of the value's bits (an exact integer sum of them, with its name, shape and dtype)."""
    bits = value.detach().contiguous().reshape(-1)
    integer = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[bits.element_size()]
    total = int(bits.view(integer).sum(dtype=torch.int64)) if bits.numel() else 0
    return _digest(f"{name}|{tuple(value.shape)}|{value.dtype}|{total}")


class _Hook:
    """A hook held by the model's modules. A model pickled or deep-copied while wrapped
    (``torch.save(model)``, an EMA's ``copy.deepcopy``) takes an inert one: the copy is a
    plain module, which no engine holds."""

    def __init__(self, method=None):
        self.method = method

    def __call__(self, *args) -> None:
        if self.method is not None:
            self.method(*args)

    def __reduce__(self):
        return _Hook, ()


class ModuleLoad:
    """The hooks on one engine's model (see the module docstring)."""

    def __init__(self, engine: "TrainingCore"):
        self.engine = engine
        self.name_of = {id(p): name for name, p in engine.flat.params.items()}
        """The engine's parameters (every one is in one of its units) → their names in its layout."""
        self._load: list | None = None  # the error_msgs list of the load under way: one per load_state_dict call
        self._depth = 0
        self._taken: dict[int, tuple[str, str, torch.Tensor]] = {}  # id(param) → (layout name, key, value)
        self._keys: set[str] = set()  # every key taken (a tied parameter's under each of its names)

    def attach(self, model: nn.Module) -> Callable[[], None]:
        """Hook every module of model; returns what removes the hooks."""
        handles = []
        before, after = _Hook(self._before), _Hook(self._after)
        for module in model.modules():
            handles.append(module.register_load_state_dict_pre_hook(before))
            handles.append(module.register_load_state_dict_post_hook(after))
        return lambda: [h.remove() for h in handles]

    def _before(self, module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                error_msgs) -> None:
        if self._load is not error_msgs:  # a new load (one that raised may have left a depth behind)
            self._load, self._depth, self._taken, self._keys = error_msgs, 0, {}, set()
        self._depth += 1
        if self.engine.gathered_open:  # (torch loads the gathered copies)
            return
        for name, p in module.named_parameters(recurse=False, remove_duplicate=False):
            key = prefix + name
            value = state_dict.get(key)
            if id(p) not in self.name_of or not isinstance(value, torch.Tensor):
                continue
            shape = tuple(full_shape(p))
            if len(shape) == 0 and tuple(value.shape) == (1,):  # (torch loads a 1-element value into a scalar)
                value = value.reshape(())
            if tuple(value.shape) != shape:
                continue  # (torch names the mismatch)
            del state_dict[key]  # (torch's own copy: the load's dict, not the caller's)
            self._keys.add(key)
            self._taken[id(p)] = (self.name_of[id(p)], key, value)  # (a tied parameter: the last, as torch)

    def _after(self, module, incompatible_keys) -> None:
        self._depth -= 1
        if self._depth > 0 or not self._taken:
            return
        taken, keys, self._taken, self._keys = self._taken, self._keys, {}, set()
        incompatible_keys.missing_keys[:] = [k for k in incompatible_keys.missing_keys if k not in keys]
        self._write(sorted(taken.values()))

    def _write(self, taken: list[tuple[str, str, torch.Tensor]]) -> None:
        engine = self.engine
        engine.comm.meet(OPERATION)  # (a rank alone in the load fails, naming the ranks that did not come)
        self._check_same_on_every_rank(taken)
        with torch.no_grad():
            write_into_units(engine, {name: key for name, key, _ in taken},
                             ValuesInMemory({key: value for _, key, value in taken}))

    def _check_same_on_every_rank(self, taken: list[tuple[str, str, torch.Tensor]]) -> None:
        """Raise LoadedValuesDifferError on every rank unless every data-parallel rank loads
        the same parameters with the same values."""
        comm = self.engine.comm
        if comm.size == 1:
            return
        names = _digest("\n".join(name for name, _, _ in taken))
        (most, largest_count), (least, _) = comm.extremes([names, len(taken)])
        if most != names or least != names:
            raise LoadedValuesDifferError(
                f"{OPERATION} on data-parallel rank {comm.rank} loads {len(taken)} of the engine's parameters, "
                f"another rank a different set (up to {largest_count}): every rank must load the same state dict "
                f"(each writes its own shards from it); the engine's parameters are left as they were")
        digests = [_value_digest(name, value) for name, _, value in taken]
        most, least = comm.extremes(digests)
        differ = [name for (name, _, _), d, hi, lo in zip(taken, digests, most, least) if hi != d or lo != d]
        if differ:
            raise LoadedValuesDifferError(
                f"{OPERATION}: the data-parallel ranks load different values for {len(differ)} of the {len(taken)} "
                f"parameters loaded ({listing(differ)}); every rank must load the same state dict (each writes its own shards "
                f"from it), or the ranks would train different models; the engine's parameters are left as they were")


__all__ = ["LoadedValuesDifferError", "ModuleLoad"]
