"""What a model's owner may change behind the engine's back and would silently stop training,
refused by name before the next forward (tests/test_user_loop.py):

* a parameter converted to another dtype or device (``model.half()``, ``model.to(...)``): it is
  no longer a view of the flat buffers;
* a parameter frozen at ``wrap()`` and unfrozen since (progressive unfreezing): nothing holds its
  gradient, master or optimizer state;
* a module replaced after ``wrap()`` (``model.norm = nn.LayerNorm(...)``): the engine's
  parameters leave the forward and the new ones train nothing;
* a parameter that joined the model after ``wrap()`` (built lazily in the first forward, a
  module or adapter added): the engine never steps it, and its gradients pile up in ``.grad``,
  as in plain PyTorch with an optimizer built before that forward; DDP and FSDP fix their
  parameters at wrapping too.
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.nn.modules.module import (register_module_module_registration_hook,
                                     register_module_parameter_registration_hook)

from .config import ConfigError
from .errors import parameters_named
from .zero.released import conversion_error

__all__ = ["ModelAtWrap"]


@dataclass
class ModelAtWrap:
    """The model's parameters as the engine bound them."""

    frozen: list[tuple[str, torch.Tensor]]
    """The parameters frozen at wrap(): they have no gradient, master or optimizer state."""
    known: frozenset[int]
    """id() of every parameter the model held at wrap()."""
    bound: list[tuple[str, torch.Tensor, torch.dtype, torch.device, int | None]] = field(default_factory=list)
    """Each parameter the engine binds, with its dtype, device and (where it stays a view of one
    flat buffer: stages 0-2) address then; filled once built."""

    registered: bool = True
    """A parameter or module was set on some module since check() last walked the model's
    parameters (the walk costs ~0.6 ms per forward for a 32-layer Llama; torch's registration
    hooks say when one is due)."""

    def watch(self) -> Callable[[], None]:
        """Note every registration of a parameter or module, on any module of the process (torch's
        global registration hooks); returns the undo. The hooks hold this record weakly, and go
        with it."""
        me = weakref.ref(self)

        def noted(*_) -> None:
            record = me()
            if record is not None:
                record.registered = True

        handles = [register_module_parameter_registration_hook(noted), register_module_module_registration_hook(noted)]

        def undo() -> None:
            for handle in handles:
                handle.remove()

        weakref.finalize(self, undo)  # (an engine never closed leaves no hook behind either)
        return undo

    @classmethod
    def of(cls, module: nn.Module) -> "ModelAtWrap":
        frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        return cls(frozen, frozenset(id(p) for p in module.parameters()))

    def check(self, module: nn.Module) -> None:
        """ConfigError naming what changed (see the module docstring)."""
        for name, p, dtype, device, address in self.bound:
            if p.dtype != dtype or p.device != device:
                raise ConfigError(conversion_error(name, f"converted to {p.dtype} on {p.device} from the engine's "
                                                         f"{dtype} on {device} (model.half(), model.to(...))"))
            if address is not None and p.data_ptr() != address:
                raise ConfigError(conversion_error(name, "given memory of its own (its .data replaced, as by "
                                                         "resize_token_embeddings, or model.half() then "
                                                         "model.float())"))
        thawed = [n for n, p in self.frozen if p.requires_grad]
        if thawed:
            shown, one = parameters_named(thawed)
            raise ConfigError(
                f"{shown} {'was' if one else 'were'} frozen (requires_grad=False) when the "
                f"model was wrapped and {'requires' if one else 'require'} grad now: the engine keeps no gradient, "
                f"fp32 master or optimizer state for {'it' if one else 'them'}, so {'it' if one else 'they'} would "
                f"not train. Set requires_grad before wrap(); to unfreeze during training, keep such parameters "
                f"trainable from the start in a param group of their own with lr 0 and raise its lr later "
                f"(wrap(optimizer=) with an instance: set param_groups[i]['lr'] on it), or close() the engine and "
                f"wrap the model again")
        if not self.registered:  # (nothing set on any module since the last walk)
            return
        current = {id(p) for p in module.parameters()}
        if current != self.known:
            self._check_same_parameters(module, current)
        self.registered = False  # (walked and found as wrapped: the next walk waits for a registration)

    def _check_same_parameters(self, module: nn.Module, current: set[int]) -> None:
        """ConfigError where a bound parameter left the model or a trainable one joined it (the
        check stays due until it passes: a loop that catches the error is refused again)."""
        gone = sorted(name for name, p, *_ in self.bound if id(p) not in current)
        joined = [n for n, p in module.named_parameters() if id(p) not in self.known and p.requires_grad]
        if gone:
            shown, one = parameters_named(gone)
            also = f", and {parameters_named(joined)[0]} joined it" if joined else ""
            raise ConfigError(
                f"{shown} of the wrapped model {'is' if one else 'are'} no longer in the model: "
                f"{'its' if one else 'their'} module was replaced after wrap() (model.x = nn.Linear(...)){also}, so "
                f"the engine's parameters are out of the forward and a new module's would never train. Change the "
                f"model before wrap(); after it, close() the engine (it hands the model back with the trained "
                f"values) and wrap the changed model")
        if joined:
            shown, one = parameters_named(joined)
            raise ConfigError(
                f"{shown} joined the model after wrap() (built in a forward, or a module added since): the engine "
                f"does not train {'it' if one else 'them'}; {'its' if one else 'their'} gradients would pile up in "
                f".grad. Build every parameter before wrap(): call a model that builds its parameters lazily once "
                f"on a sample batch first, add modules and adapters before wrap(), or close() the engine and wrap "
                f"the changed model")
