"""Building a model directly in partitioned form (ZeRO-Infinity §5.3 "ease of use": parameters
are partitioned as modules are constructed, so a model that would not fit in one rank's
memory whole can still be built). DeepSpeed's ``zero.Init`` is the analogue.

Inside ``partitioned_init(topology)``, each module's parameters are cut to this rank's
1/dp flat shard as soon as that module is attached to its parent (its own ``__init__``,
which initialises them, has returned by then); parameters of the outermost module are cut
when the context exits. Every constructor therefore runs on whole tensors and draws exactly
the random numbers of an ordinary construction.

Many models also initialise from the top *after* their modules exist: Hugging Face's
``post_init()`` applies ``_init_weights`` to every module (``module.weight.data.normal_()``,
``nn.init.normal_(module.weight)``, ``module.weight[padding_idx].zero_()``), LoRA-style
code calls ``kaiming_uniform_`` on an attached adapter. Run on 1-D shards, those would draw
the same numbers on every rank (rank 1's half a copy of rank 0's) or fail on shape checks.
So while the context is active a :class:`~torch.overrides.TorchFunctionMode` watches every
torch function, method and property getter (``.data``, ``.shape``, ``.dim()``,
``__getitem__``, ``nn.init.*``): one that receives a partitioned parameter first
*materialises* it — all-gathers its full value over the dp group (every rank runs the same
construction code, so the collectives line up), makes it whole again in place (same
Parameter object, so ties survive) and then lets the call proceed on the whole tensor. The
random draws are then those of an ordinary construction, element for element.

Materialised parameters are cut again lazily: when a parameter with none of their owning
modules is materialised (so ``w = module.weight.data; w.normal_()`` still writes into the
whole storage), when their module is attached, and at exit. At most about one module's
parameters are whole at a time: peak memory is the largest module plus the shards
(``peak_whole_numel`` counts it).

What cannot be exact raises instead of silently diverging:

* ``from_pretrained`` (and ``init_empty_weights``) create parameters on the meta device and
  load the checkpoint afterwards: build from the config under ``partitioned_init``, then
  load with ``tiertrain.load_pretrained(engine_or_model, path)``;
* ``nn.Parameter(partitioned_param)`` (a second Parameter object over the same storage,
  which torch creates without any torch function the mode could see): tie the Parameter
  object itself instead (``module.weight = other.weight``).

Not detectable, so documented: a plain tensor alias of a parameter's data (``w = p.data``,
``v = p[0]``) kept while a parameter of an unrelated module is materialised is stale once
``p`` is cut again; writes to it are lost. Initialisation code writes right after taking
such an alias (Hugging Face's does), which is exact.
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, Iterator

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode
from torch.nn.modules.module import (
    register_module_module_registration_hook,
    register_module_parameter_registration_hook,
)

from ..comm import Collectives
from ..errors import TiertrainError
from ..topology import Topology

FULL_SHAPE = "tiertrain_full_shape"


def full_shape(p: torch.Tensor) -> torch.Size:
    """A parameter's logical shape, also when it holds only its shard."""
    shape = getattr(p, FULL_SHAPE, None)
    return p.shape if shape is None else shape


def is_partitioned(p: torch.Tensor) -> bool:
    return hasattr(p, FULL_SHAPE)


def forget_partition(p: torch.Tensor) -> None:
    """Drop the partitioned_init mark once the engine's flat buffers hold the shard."""
    if is_partitioned(p):
        delattr(p, FULL_SHAPE)


class PartitionedInitError(TiertrainError, RuntimeError):
    """A construction under partitioned_init that would not give the weights of an ordinary one."""


# Torch functions that read only metadata independent of a parameter's shape and values:
# they need no all-gather (nn.Module.register_parameter reads grad_fn, requires_grad_(False)
# freezes a model, .device/.dtype pick where new tensors go).
_METADATA_ONLY: frozenset[Callable[..., Any]] = frozenset({
    torch.Tensor.requires_grad.__get__, torch.Tensor.requires_grad.__set__, torch.Tensor.requires_grad_,
    torch.Tensor.grad_fn.__get__, torch.Tensor.is_leaf.__get__, torch.Tensor.dtype.__get__,
    torch.Tensor.device.__get__, torch.Tensor.layout.__get__, torch.Tensor.is_meta.__get__,
    torch.Tensor.is_cuda.__get__, torch.Tensor.is_cpu.__get__, torch.Tensor.is_sparse.__get__,
    torch.Tensor.is_quantized.__get__, torch.Tensor.is_floating_point, torch.Tensor.is_complex,
    torch.Tensor.element_size, torch.Tensor.__hash__,
})

_ACTIVE = threading.local()


def _partitioned_in(obj: Any, found: dict[int, nn.Parameter]) -> None:
    """Collect the partitioned parameters among a torch call's arguments (nested containers too)."""
    if isinstance(obj, nn.Parameter):
        if hasattr(obj, FULL_SHAPE):
            found[id(obj)] = obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            _partitioned_in(x, found)
    elif isinstance(obj, dict):
        for x in obj.values():
            _partitioned_in(x, found)


class _MaterialiseOnUse(TorchFunctionMode):
    """Makes a partitioned parameter whole before any torch call that could read its shape or
    values. Torch pops the mode while its handler runs, so the gather inside does not recurse."""

    def __init__(self, owner: "partitioned_init"):
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Callable[..., Any], types: tuple[type, ...], args: tuple = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        owner = self.owner
        if not owner._internal and func not in _METADATA_ONLY:
            found: dict[int, nn.Parameter] = {}
            _partitioned_in(args, found)
            _partitioned_in(kwargs, found)
            for p in found.values():
                owner._materialise(p)
        return func(*args, **kwargs)


class partitioned_init:
    """Context manager: parameters created inside keep only this rank's shard, and the model
    gathered afterwards equals (``torch.equal``) the one the same code builds without it.

    Every rank of the dp group must run the same construction code (materialising is a
    collective). Wrap the model (``tiertrain.wrap``, zero.stage 3) after the context exits:
    inside it, the engine's own reads of the shards would be materialised too.

    ``peak_whole_numel`` is the largest number of parameter elements this context held whole
    at once (a module being attached, or parameters materialised for initialisation from the
    top); ``materialisations`` counts the all-gathers that made a parameter whole again.
    """

    def __init__(self, topology: Topology):
        self.comm = Collectives(topology.group("dp_cp"))
        self.peak_whole_numel = 0
        self.materialisations = 0
        self._created: list[nn.Parameter] = []
        """Every parameter registered inside (kept alive, so ids stay unique until exit)."""
        self._owners: dict[int, set[int]] = {}
        """id(parameter) -> ids of the modules it is registered on (several when tied)."""
        self._whole: dict[int, nn.Parameter] = {}
        """Parameters materialised by the mode and not cut again yet."""
        self._shards: dict[int, nn.Parameter] = {}
        """data_ptr of each live shard -> its parameter (to recognise nn.Parameter(shard))."""
        self._internal = 0
        self._handles: list[Any] = []
        self._mode = _MaterialiseOnUse(self)

    # -- context -----------------------------------------------------------------------------

    def __enter__(self) -> "partitioned_init":
        if getattr(_ACTIVE, "ctx", None) is not None:
            raise PartitionedInitError("partitioned_init is already active: nested contexts would cut "
                                       "parameters twice; build the whole model inside one context")
        _ACTIVE.ctx = self
        self._handles = [
            register_module_parameter_registration_hook(self._on_parameter),
            register_module_module_registration_hook(self._on_submodule),
        ]
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        try:
            self._mode.__exit__(*exc)
        finally:
            for h in self._handles:
                h.remove()
            self._handles = []
            _ACTIVE.ctx = None
        if exc[0] is None:
            for p in list(self._whole.values()) + self._created:
                self._partition(p)
        self._created, self._owners, self._whole, self._shards = [], {}, {}, {}

    @contextlib.contextmanager
    def _quiet(self) -> Iterator[None]:
        """Our own hooks run under the mode: let their torch calls through untouched."""
        self._internal += 1
        try:
            yield
        finally:
            self._internal -= 1

    # -- hooks -------------------------------------------------------------------------------

    def _on_parameter(self, module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        if param is None:
            return
        with self._quiet():
            if param.device.type == "meta":
                raise PartitionedInitError(
                    f"partitioned_init: parameter {type(module).__name__}.{name} is created on the meta "
                    f"device, which holds no values to partition. from_pretrained (and init_empty_weights) "
                    f"build the model there and load the checkpoint afterwards, bypassing partitioning. "
                    f"Build the model from its config under partitioned_init (e.g. "
                    f"AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))), then load the "
                    f"weights with tiertrain.load_pretrained(engine_or_model, path).")
            if not is_partitioned(param) and param.numel() > 0 and param.data_ptr() in self._shards:
                source = self._shards[param.data_ptr()]
                raise PartitionedInitError(
                    f"partitioned_init: parameter {type(module).__name__}.{name} was made from the data of "
                    f"a partitioned parameter of shape {tuple(full_shape(source))} (nn.Parameter(other) "
                    f"shares its storage without any torch call the context can see), so it holds only a "
                    f"shard. Tie the Parameter object itself (module.{name} = other_module.weight), or "
                    f"build this model without partitioned_init.")
            replaced = getattr(module, name, None)  # the hook runs before the assignment
            if isinstance(replaced, nn.Parameter) and replaced is not param:
                # Tying (lm_head.weight = embed.weight) drops the old parameter from this module:
                # once no module holds it, it need not stay whole.
                owners = self._owners.get(id(replaced), set())
                owners.discard(id(module))
                if not owners and id(replaced) in self._whole:
                    self._partition(replaced)
            self._created.append(param)
            self._owners.setdefault(id(param), set()).add(id(module))

    def _on_submodule(self, module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        if submodule is None:
            return
        with self._quiet():
            params = []
            for m in submodule.modules():
                for p in m.parameters(recurse=False):
                    self._owners.setdefault(id(p), set()).add(id(m))
                    params.append(p)
            fresh = {id(p): p for p in params if not is_partitioned(p) and id(p) not in self._whole}
            self._note_peak(sum(p.numel() for p in fresh.values()))
            for p in params:
                self._partition(p)

    # -- partition / materialise -------------------------------------------------------------

    def _note_peak(self, extra: int = 0) -> None:
        whole = extra + sum(p.numel() for p in self._whole.values())
        self.peak_whole_numel = max(self.peak_whole_numel, whole)

    def _partition(self, p: nn.Parameter) -> None:
        """Cut p to this rank's flat shard (zero-padded to ceil(numel/dp) elements)."""
        if is_partitioned(p):
            return
        self._whole.pop(id(p), None)
        dp, rank = self.comm.size, self.comm.rank
        flat = p.detach().reshape(-1)
        per_rank = -(-flat.numel() // dp)
        lo, hi = rank * per_rank, min((rank + 1) * per_rank, flat.numel())
        shard = torch.zeros(per_rank, dtype=p.dtype, device=p.device)
        if lo < hi:
            shard[: hi - lo].copy_(flat[lo:hi])
        setattr(p, FULL_SHAPE, p.shape)
        p.data = shard
        if per_rank > 0:
            self._shards[shard.data_ptr()] = p

    def _materialise(self, p: nn.Parameter) -> None:
        """Make a partitioned parameter whole again in place (one all-gather), after cutting
        the materialised parameters that share no owning module with it."""
        owners = self._owners.get(id(p), set())
        for q in list(self._whole.values()):
            if not (self._owners.get(id(q), set()) & owners):
                self._partition(q)
        shape: torch.Size = getattr(p, FULL_SHAPE)
        shard = p.detach()
        if shard.numel() > 0:
            self._shards.pop(shard.data_ptr(), None)
        full = torch.empty(shard.numel() * self.comm.size, dtype=shard.dtype, device=shard.device)
        if full.numel() > 0:
            self.comm.all_gather(full, shard)
        delattr(p, FULL_SHAPE)
        p.data = full[: shape.numel()].view(shape)
        self._whole[id(p)] = p
        self.materialisations += 1
        self._note_peak()


def check_no_partitioned_init(what: str) -> None:
    """Raise if a partitioned_init context is open: what (e.g. wrapping a model) reads the
    shards, which the open context would gather back whole."""
    if getattr(_ACTIVE, "ctx", None) is not None:
        raise PartitionedInitError(f"{what} inside `with tiertrain.partitioned_init(...)`: build the model "
                                   f"inside the context and call it after the context has exited")


def gather_partitioned(p: nn.Parameter, comm: Collectives) -> torch.Tensor:
    """The full value of a parameter built under partitioned_init (one all-gather)."""
    shape = full_shape(p)
    full = torch.empty(p.numel() * comm.size, dtype=p.dtype, device=p.device)
    comm.all_gather(full, p.detach())
    return full[: shape.numel()].view(shape)
