"""The optimizer state a checkpoint of another framework must hold for the engine loading it:
for each trained parameter, the keys the engine's optimizer keeps, the shape of each (one value
per element, read by range so that it reshards; or sized by some of the parameter's dimensions,
as Adafactor's row and column factors are; or a number) and the form of its step — Adam's
moments and step for the default AdamW, and for an optimizer the user brought
(``wrap(optimizer=...)``, TiertrainTrainer's ``optim``) whatever it keeps: SGD's momentum,
RMSprop's square average, Adafactor's factors. Found by doing, not by name: a copy of the
optimizer, with the parameter's group's hyper-parameters, steps once on a tensor of the
parameter's shape (up to PROBE_CAP elements; an optimizer may keep other state above a size, as
bitsandbytes keeps 8-bit states from ``min_8bit_size`` elements), and what it then keeps is the
expectation. A checkpoint of another optimizer
(or other settings of it: amsgrad, momentum) is refused naming both, before anything is loaded.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Callable

import torch

from .checkpoint import CheckpointError
from ..update.state_format import NVMeStreamState

if TYPE_CHECKING:
    from ..training_core import TrainingCore

PROBE_CAP = 1 << 22
"""The most elements the probe tensor has: a parameter up to this size is probed in its own
shape, a larger one in a shape of its rank with distinct sizes and at least this many elements
(the state then sized by neither is not checked: bitsandbytes' per-block absmax)."""
ANY_SHAPE = "any"
"""_shape_for's answer for a state sized by something other than the parameter's sizes, probed
on a smaller tensor: whatever the checkpoint holds."""


def probe_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The probe tensor's shape for a parameter of this shape (see PROBE_CAP)."""
    if math.prod(shape) <= PROBE_CAP:
        return tuple(shape)
    base = math.ceil(PROBE_CAP ** (1 / len(shape)))
    return tuple(base + i for i in range(len(shape)))


def _probed(build: Callable, options: list[dict], group: int, shape: tuple[int, ...]) -> dict[str, Any] | None:
    """What build's optimizer keeps for a parameter of this (probe) shape in group after one
    step: {key: the value}; None where it cannot step such a tensor (Muon: matrices only). Every
    group is built (a list of optimizers routes groups by their place), the others over an
    empty matrix without a gradient, as ClientOptimizer.stand_in builds them."""
    param = torch.randn(shape, generator=torch.Generator().manual_seed(5)).requires_grad_(True)
    groups = [{"params": [param if i == group else torch.empty(0, 0)], **o} for i, o in enumerate(options)]
    try:
        optimizer = build(groups)
        param.grad = torch.randn(shape, generator=torch.Generator().manual_seed(6))
        optimizer.step()
    except Exception:  # (this optimizer does not take such a tensor: the saved keys are taken as they are)
        return None
    return dict(optimizer.state.get(param, {}))


def _shape_for(value: Any, probed: tuple[int, ...], shape: tuple[int, ...]) -> tuple[int, ...] | str | None:
    """The shape the optimizer keeps this state in for a parameter of shape, from the value it
    kept for the probe of shape ``probed`` (None: a number). Probed in the parameter's own shape,
    it is the value's; else each of the value's sizes is one of the probe's (they are distinct:
    the parameter's size along that dimension, as Adafactor's row and column factors are) or 1,
    and any other size makes it ANY_SHAPE."""
    if not isinstance(value, torch.Tensor):
        return None
    if tuple(probed) == tuple(shape):
        return tuple(value.shape)
    if any(n not in probed and n != 1 for n in value.shape):
        return ANY_SHAPE
    return tuple(shape[probed.index(n)] if n in probed else n for n in value.shape)


class OptimizerStateKeys:
    """The state the engine's optimizer keeps for each trained parameter (see the module
    docstring), probed once per param group and parameter rank."""

    def __init__(self, engine: "TrainingCore"):
        client = engine.client_optimizer
        if client is None:  # (the default AdamW keeps torch AdamW's state, whatever its kernel)
            self.name = "AdamW (the default)"
            self._build: Callable = torch.optim.AdamW
            self._options: list[dict] = [{}]
            self._group_of: Callable[[str], int] = lambda name: 0
        else:
            self.name = client.name
            self._build, self._options = client.build, client.options()
            self._group_of = client.group_index().__getitem__
        self._probes: dict[tuple[int, int], dict | None] = {}
        fmt = engine.update.state_format
        self.stream_slots = tuple(fmt.state_names) if isinstance(fmt, NVMeStreamState) else None
        """The NVMe stream's state slots (by the optimizer's names), which the saved per-element
        state must fill; None for an optimizer in memory."""

    def expected(self, name: str, shape: tuple[int, ...]) -> dict[str, Any] | None:
        """{key: a value of the kind the optimizer keeps} for trained parameter name of this
        shape (probed in probe_shape(shape)), or None where the probe could not step it."""
        key = (self._group_of(name), probe_shape(tuple(shape)))
        if key not in self._probes:
            self._probes[key] = _probed(self._build, self._options, *key)
        return self._probes[key]

    def check(self, where: str, name: str, shape: tuple[int, ...], saved: dict[str, tuple[int, ...] | None]) -> None:
        """CheckpointError unless the saved state of trained parameter name (saved: {key: its
        tensor's shape, or None for a number}) is the state this optimizer keeps for it."""
        probe = self.expected(name, shape)
        if self.stream_slots is not None:
            kept = {key for key, value in saved.items() if saved_per_element(value, shape)}
            if not kept <= set(self.stream_slots):
                raise CheckpointError(f"{where}: the optimizer state of {name!r} holds {sorted(saved)}; this engine's "
                                      f"NVMe optimizer keeps {list(self.stream_slots)}")
        if probe is None:
            return
        if set(saved) != set(probe):
            raise CheckpointError(f"{where}: the optimizer state of {name!r} is {sorted(saved)}; this engine's "
                                  f"optimizer {self.name} keeps {sorted(probe)} for a {len(shape)}-D parameter with "
                                  f"its group's settings: resume with the optimizer and settings the checkpoint was "
                                  f"saved with")
        probed = probe_shape(tuple(shape))
        for key, value in probe.items():
            want = _shape_for(value, probed, tuple(shape))
            if key == "step" and want in (None, ()) and saved[key] in (None, ()):
                continue  # (a count either way: step_as_kept gives it the optimizer's form)
            if want == ANY_SHAPE and saved[key] is not None:
                continue
            if want != (None if saved[key] is None else tuple(saved[key])):
                form = "a number" if want is None else f"shape {want}"
                raise CheckpointError(f"{where}: the optimizer state {key!r} of {name!r} "
                                      f"{'is a number' if saved[key] is None else f'has shape {tuple(saved[key])}'}; "
                                      f"{self.name} keeps it for this {tuple(shape)} parameter with {form}")

    def dtype_of(self, name: str, shape: tuple[int, ...], key: str) -> torch.dtype:
        """The dtype the optimizer keeps state key of this parameter in (fp32 where unknown)."""
        like = (self.expected(name, shape) or {}).get(key)
        return like.dtype if isinstance(like, torch.Tensor) else torch.float32

    def step_as_kept(self, name: str, shape: tuple[int, ...], count: int) -> Any:
        """A saved step count in the form the optimizer keeps its own (a float tensor, an int)."""
        like = (self.expected(name, shape) or {}).get("step")
        if isinstance(like, torch.Tensor):
            return torch.tensor(float(count), dtype=like.dtype)
        return type(like)(count) if isinstance(like, (int, float)) else torch.tensor(float(count))


NESTED_BY_BITSANDBYTES = "__bnb_optimizer_quant_state__"
"""The key under which bitsandbytes' optimizers' ``state_dict()`` nests a parameter's quantisation
state (``state1``, ``state2``, ``qmap1``, ``absmax1``, ...), so that FSDP leaves it whole; their
``load_state_dict()`` takes it out again."""


def unnested(state: dict) -> dict:
    """A parameter's saved optimizer state as the optimizer keeps it: bitsandbytes' nesting
    (NESTED_BY_BITSANDBYTES) undone."""
    if not isinstance(state.get(NESTED_BY_BITSANDBYTES), dict):
        return state
    return {**{k: v for k, v in state.items() if k != NESTED_BY_BITSANDBYTES}, **state[NESTED_BY_BITSANDBYTES]}


def saved_per_element(saved: tuple[int, ...] | None, shape: tuple[int, ...]) -> bool:
    """Whether a saved state value of that shape (None: a number) is per element of a parameter
    of shape."""
    return saved is not None and len(shape) > 0 and tuple(saved) == tuple(shape)


def saved_count(value: Any, where: str, name: str) -> int:
    """A saved step (a tensor of one element, a number) as a count; CheckpointError otherwise."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value != int(value) or value < 0:
        raise CheckpointError(f"{where}: the optimizer step of {name!r} is {value!r}, not a count")
    return int(value)


__all__ = ["NESTED_BY_BITSANDBYTES", "OptimizerStateKeys", "saved_count", "saved_per_element", "unnested"]
