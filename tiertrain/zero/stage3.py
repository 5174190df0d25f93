"""ZeRO stage 3 parameter fetching (ZeRO §5.3; ZeRO-Infinity's overlap-centric prefetcher).

Forward pre-hooks gather a unit's parameters just before its module runs; forward hooks
release them afterwards and hang a hook on the module's outputs, so that backward gathers
them again just before the module's backward; the gradient reducer reports when a unit's
gradients are complete, and the unit is released again. Frozen parameters of a module
(``requires_grad=False``) sit in a frozen unit beside its trained one (FlatLayout.frozen) and
are gathered with it; being needed by backward for the gradients of the module's inputs, not
for gradients of their own, they are released once the gradients of every input of every call
of the module are ready (and its trained parameters' gradients are done), or at the end of
backward when that cannot be known. The first forward and backward
record the order in which units run; later steps use that trace to prefetch the next units'
all-gathers (asynchronously, within a byte budget) while the current unit computes, in
forward order during forward and in the recorded backward order during backward.

A forward outside the engine (evaluation, generation) gathers each unit around its module,
and the root's unit around any submodule that holds its parameters, for the callers that
reach them without the root (an encoder-decoder's ``get_encoder()``, a peft model's base
model), and releases them when the module ends, by an exception too. Those hooks are present
only between the engine's forwards: the engine's own forward never needs them, and under
``torch.compile`` each hook would split the compiled graph.

Collective agreement (every rank issuing the same collectives in the same order) is checked
by tiertrain/zero/agreement.py: the fetcher reports each unit's events to it and asks it
before each collective. Prefetch needs no check of its own: it is a function of the trace
and of the checked events.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch.overrides import TorchFunctionMode

from ..comm import Collectives
from .agreement import CHECKS, CollectiveAgreement, Event
from .flat import COPY_AHEAD, NVME_READ_AHEAD, FlatParameters
from .released import HOOK_AFTER_WRAP
from ..offload.recompute import recomputing


def tensors_in(obj: Any):
    """Every tensor in obj, depth first: obj itself, or inside lists, tuples and dict values."""
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from tensors_in(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from tensors_in(x)


METADATA = frozenset({"size", "dim", "numel", "element_size", "is_floating_point", "is_complex", "__len__",
                      "__hash__", "__eq__", "__repr__", "__format__", "data_ptr", "untyped_storage"})
"""Tensor functions that read only a tensor's metadata (shape, dtype, device): harmless on a
released parameter (``PreTrainedModel.dtype`` reads the first parameter's dtype in forward)."""

VALUE_PROPERTIES = frozenset({"data", "T", "mT", "H", "mH", "real", "imag", "grad"})
"""Tensor properties that hand out the values (a view of them): checked like operations; the
other property getters (shape, dtype, device, requires_grad, ...) read metadata."""


def _reads_values(func) -> bool:
    """Whether a torch function given a tensor reads (or hands out a view of) its values."""
    name = getattr(func, "__name__", "")
    if name == "__get__":
        return getattr(getattr(func, "__self__", None), "__name__", "") in VALUE_PROPERTIES
    return name not in METADATA


class ReleasedParameterCheck(TorchFunctionMode):
    """While stage 3 records its first forward: a torch operation given a parameter whose unit
    is not gathered raises, naming the parameter and its unit, instead of reading freed memory.
    That happens when a module uses another unit's parameter without registering it (reading
    ``other_module.weight`` in its own forward): the layout cannot know that the two run
    together. Registered aliases (tied weights) are placed by the layout, see module_layout."""

    def __init__(self, flat: FlatParameters):
        super().__init__()
        self.flat = flat
        self._unit_of = {id(p): (index, k) for p, (index, k) in flat.unit_of.items()
                         if not flat.all_units[index].unit.resident}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _reads_values(func):
            for t in tensors_in((args, kwargs)):
                hit = self._unit_of.get(id(t))
                if hit is not None and not self.flat.all_units[hit[0]].gathered:
                    unit = self.flat.all_units[hit[0]].unit
                    raise RuntimeError(
                        f"zero.stage=3: {getattr(func, '__name__', func)} used parameter "
                        f"{unit.slots[hit[1]].name!r} while its unit {unit.label!r} was not gathered. Either a "
                        f"module read another unit's parameter without registering it: register it in the "
                        f"module that uses it (a tied alias), or pass unit_modules to wrap() so that both "
                        f"modules are one unit (e.g. their common parent). Or {HOOK_AFTER_WRAP}")
        return func(*args, **kwargs)


def _outside_backward(grad: torch.Tensor) -> None:
    raise RuntimeError("a forward run outside the engine at ZeRO stage 3 (model(x) rather than engine(batch)) has "
                       "released its parameters again, and its backward cannot run: train through "
                       "engine(batch) and engine.backward(loss); call the model directly under torch.no_grad() "
                       "(evaluation, generation)")


class ParameterFetcher:
    """Gathers, prefetches and releases stage-3 units around their modules, and keeps every
    rank's collectives in step (``check``: "traced", "every" or "off"; see the module
    docstring). Set ``check`` before the first forward."""

    def __init__(self, flat: FlatParameters, comm: Collectives, unit_modules: dict[int, nn.Module],
                 prefetch_bytes: int, max_live_bytes: int = 0, check: str | bool = "traced",
                 frozen_of: dict[int, list[int]] | None = None):
        self.flat = flat
        self.frozen_of = frozen_of or {}
        """unit_modules' unit → the frozen units gathered and released with it (a frozen-only
        module's unit is its own key: its list holds itself)."""
        self._gathered_with = {key: list(dict.fromkeys([key] + frozen)) for key, frozen in self.frozen_of.items()}
        self._open_calls: dict[int, int] = {}  # key unit → calls whose input gradients are pending
        self._grads_done: set[int] = set()  # key units whose trained gradients are complete
        self.comm = comm
        self.prefetch_bytes = prefetch_bytes
        self.max_live_bytes = max_live_bytes
        check = {True: "traced", False: "off", None: "off"}.get(check, check)
        if check not in CHECKS:
            raise ValueError(f"check={check!r} is invalid: expected one of {', '.join(CHECKS)}")
        self.agreement = CollectiveAgreement(comm, self._unit_label, check if comm.size > 1 else "off")
        self._check_uses = check  # (also on one rank, where there is nothing to agree)
        self.traces: dict[bool, list[int]] = {False: [], True: []}  # forward, backward unit order
        self.traced = False
        self._position = -1
        self._in_backward = False
        self.backward_reduces = True
        """Whether the next backward reduces gradients (set by the engine each micro-batch): with
        gradients accumulated on the device (zero.accumulate_on_device) only the boundary's
        does, so the two kinds of backward are traced apart."""
        self._depth = 0  # unit forwards in progress
        self._backward_begun: set[int] = set()  # units whose backward began, grads not yet done
        self._engine_forward = False  # inside the engine's own forward (begin_forward .. end_forward)
        self._outside: list[tuple[nn.Module, list[int]]] = []  # modules called outside, the units they gathered
        self.before_outside = None
        """Called when a forward outside the engine begins (the engine settles its update)."""
        self._handles = []
        for index, module in unit_modules.items():
            # Outside compiled code: a module compiled with its hooks (module.compile(), a compiled
            # model) runs them eagerly between its graphs (docs/compile.md). First of the module's
            # pre-hooks: the model's own may read its parameters (torch.nn.utils.weight_norm's).
            pre = torch.compiler.disable(self._make_pre_forward(index))
            self._handles.append(module.register_forward_pre_hook(pre, prepend=True))
            self._handles.append(module.register_forward_hook(torch.compiler.disable(self._make_post_forward(index)),
                                                              with_kwargs=True))
        self._entries = self._outside_entries(unit_modules)
        self._unit_modules = list(unit_modules.values())
        self._outside_handles: list = []
        self._install_outside_hooks()

    # -- forwards outside the engine ------------------------------------------------------

    def _outside_entries(self, unit_modules: dict[int, nn.Module]) -> dict[nn.Module, int]:
        """The submodules through which a forward outside the engine can reach a top unit's
        parameters without calling the unit's module (the model root, for the embeddings, final
        norm and head): those that hold such parameters, or hold modules that do, outside every
        other unit's module. transformers calls them so: generate() runs an encoder-decoder's
        ``get_encoder()``, a wrapper its base model, a script ``get_input_embeddings()``."""
        hooked = set(map(id, unit_modules.values()))
        contained = {id(sub) for m in unit_modules.values() for sub in m.modules() if sub is not m}
        entries: dict[nn.Module, int] = {}
        for key, top in unit_modules.items():
            if id(top) in contained:
                continue
            units = set(self._with_frozen(key))
            holds: dict[int, bool] = {}

            def reaches(module: nn.Module) -> bool:  # (memoised: a shared module is visited once)
                if id(module) not in holds:
                    holds[id(module)] = False
                    own = any(self.flat.unit_of.get(p, (None,))[0] in units for p in module.parameters(recurse=False))
                    inner = [reaches(c) for c in module.children() if id(c) not in hooked]
                    holds[id(module)] = own or any(inner)
                return holds[id(module)]

            reaches(top)
            entries.update({m: key for m in top.modules() if m is not top and id(m) not in hooked and holds.get(id(m))})
        return entries

    def _install_outside_hooks(self) -> None:
        """The hooks of forwards outside the engine: each entry module gathers its unit around
        itself, and every module called outside releases what it gathered when it ends, also by
        an exception (``always_call``: the next forward finds nothing left gathered)."""
        if self._outside_handles:
            return
        pre = torch.compiler.disable(self._entry_pre)
        post = torch.compiler.disable(self._outside_post)
        for module in self._entries:
            self._outside_handles.append(module.register_forward_pre_hook(pre, prepend=True))
        for module in [*self._entries, *self._unit_modules]:
            self._outside_handles.append(module.register_forward_hook(post, always_call=True))

    def _remove_outside_hooks(self) -> None:
        for h in self._outside_handles:
            h.remove()
        self._outside_handles.clear()

    def _entry_pre(self, module: nn.Module, args: Any) -> None:
        if not (self._engine_forward or self._in_backward or recomputing()):
            self._outside_pre(module, self._entries[module])

    def _outside_pre(self, module: nn.Module, index: int) -> None:
        """A forward outside the engine (the user's own evaluation, ``model(x)`` between steps),
        as DeepSpeed's ZeRO-3 inference: gather the unit (each gather agreed by every rank, as
        gathered_parameters' are), released after the module; nothing is traced."""
        if not self._outside and self.before_outside is not None:
            self.before_outside()
        gathered = []
        for i in self._with_frozen(index):
            if not self.flat.all_units[i].gathered:
                self.agreement.open(Event.OUTSIDE, i)
                self.flat.gather(i)
                gathered.append(i)
        self._outside.append((module, gathered))

    def _outside_post(self, module: nn.Module, args: Any, output: Any) -> None:
        if not self._outside or self._outside[-1][0] is not module:
            return  # (not called outside the engine)
        _, gathered = self._outside.pop()
        for i in gathered:
            self.flat.release(i)
        for t in tensors_in(output):
            if t.requires_grad:
                t.register_hook(_outside_backward)

    # -- collective agreement --------------------------------------------------------

    @property
    def check(self) -> str:
        """How collectives are agreed: "traced", "every" or "off" (tiertrain/zero/agreement.py)."""
        return self.agreement.check

    @check.setter
    def check(self, check: str) -> None:
        self.agreement.check = check
        self._check_uses = check

    def _unit_label(self, index: int) -> str:
        units = self.flat.all_units
        return units[index].unit.label if 0 <= index < len(units) else f"#{index}"

    def describe(self, code: int) -> str:
        """Words for an event code, as in mismatch errors (CollectiveAgreement.describe)."""
        return self.agreement.describe(code)

    def agree(self, kind: int, index: int = 0) -> None:
        """Called by the engine before the gradient reduce-scatter of unit `index` (REDUCE)
        and at the optimizer step (STEP)."""
        if kind == Event.STEP:
            self.agreement.open(Event.STEP)
            return
        if kind == Event.REDUCE:
            self._enter_backward()
        self.agreement.log(kind, index)
        self.agreement.before_collective(kind, index)

    def retrace(self) -> None:
        """Forget the traced orders; the next segments are recorded (and agreed collective by
        collective) again. Collective: every rank calls it at the same point, between steps,
        e.g. when the model's module order changes on purpose, alike on every rank."""
        self.agreement.open(Event.RETRACE)
        self.traces = {False: [], True: []}
        self.traced = False
        self.agreement.forget_recordings()

    def _enter_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            self._position = -1
            self.agreement.open(Event.BACKWARD, key=None if self.backward_reduces else (Event.BACKWARD, False))

    # -- fetching ----------------------------------------------------------------------

    def fetch(self, index: int) -> None:
        """Gather unit `index` outside its module's hooks (engine.gathered_parameters).
        Outside forward and backward this opens a segment of its own, agreed by every rank;
        inside them it is one more event of the pass."""
        if self._depth > 0 or self._in_backward:
            self.agreement.log(Event.GATHER, index)
            self._fetch(index)
        else:
            self.agreement.open(Event.OUTSIDE, index)
            self.flat.gather(index)

    def _with_frozen(self, index: int) -> list[int]:
        """The units a module's hooks gather for unit index: it and its frozen companions."""
        return self._gathered_with.get(index) or [index]

    def _fetch(self, index: int) -> None:
        """Gather unit `index` and its frozen companions now (no-op for those gathered). Every
        gather the hooks issue goes through here, so that it is agreed first while its segment
        is being recorded."""
        for i in self._with_frozen(index):
            if not self.flat.all_units[i].gathered:
                self.agreement.before_collective(Event.GATHER, i)
            self.flat.gather(i)

    def _release(self, index: int) -> None:
        """Release unit `index` and its frozen companions (after a forward)."""
        for i in self._with_frozen(index):
            self.flat.release(i)

    def _prefetch(self, order: list[int], position: int) -> None:
        budget = self.prefetch_bytes
        for index in [i for key in order[position + 1:] for i in self._with_frozen(key)]:
            if budget <= 0:
                break
            u = self.flat.all_units[index]
            nbytes = u.full.numel() * u.full.element_size()
            if self.max_live_bytes and self.flat.gathered_bytes() + nbytes > self.max_live_bytes:
                break
            if not u.gathered:
                self.agreement.before_collective(Event.GATHER, index)
                self.flat.gather(index, async_op=True)
            budget -= nbytes

    def use_check(self) -> TorchFunctionMode | None:
        """The check of parameter uses for this forward (``with`` it around the forward), or
        None: it runs while the first forward is recorded, and every forward with check
        "every" (not with "off")."""
        if self._check_uses == "off" or (self.traced and self._check_uses != "every"):
            return None
        return ReleasedParameterCheck(self.flat)

    def end_forward(self) -> None:
        """The engine's forward is over: a module called now runs outside it (see _outside_pre)."""
        self._engine_forward = False
        self._install_outside_hooks()

    def begin_forward(self) -> None:
        self._remove_outside_hooks()  # (the engine's forward needs none: see the module docstring)
        self._engine_forward = True
        self._position = -1
        self._in_backward = False
        self._depth = 0
        self._backward_begun.clear()
        self._open_calls.clear()
        self._grads_done.clear()
        grad = torch.is_grad_enabled()
        self.agreement.open(Event.FORWARD, int(grad), key=(Event.FORWARD, grad))

    def abandon(self) -> None:
        """The engine's forward or backward raised, alike on every rank (a batch every rank
        skips, an out-of-memory error every rank catches): wait for the gathers in flight,
        release every unit and close the pass, so that the next forward starts afresh. (An
        exception on some ranks only leaves the ranks out of step: the agreement, or the
        launcher, stops them.)"""
        for u in self.flat.all_units:
            self.flat.release(u.unit.index)  # (waits for its gather in flight, if any)
        self._engine_forward = self._in_backward = False
        self._depth = 0
        self._backward_begun.clear()
        self._open_calls.clear()
        self._grads_done.clear()
        if not self.traced:  # (the first pass's partial order: recorded again)
            self.traces = {False: [], True: []}
        self.agreement.abandon()
        self._install_outside_hooks()

    def end_backward(self) -> None:
        """The first forward+backward has been traced; later steps prefetch from the traces."""
        if self.traces[False]:
            self.traced = True
        if self._in_backward:
            self.agreement.expect_segment_end("the end of backward")
        self._in_backward = False
        for u in self.flat.frozen_units:  # those no rule released (see _note_call)
            self.flat.release(u.unit.index)
        self._open_calls.clear()
        self._grads_done.clear()

    def _visit(self, index: int, backward: bool) -> None:
        if backward:
            self._enter_backward()
            self.agreement.log(Event.BACKWARD_VISIT, index)
        order = self.traces[backward]
        if not self.traced:
            order.append(index)
            self._fetch(index)
            return
        self._position = self._locate(index, self._position, order)
        if self._position >= 0:  # NVMe reads first: they take longest (ZeRO-Infinity §6)
            ahead = order[self._position + 1:self._position + 1 + NVME_READ_AHEAD]
            self.flat.prefetch_shards([i for key in ahead for i in self._with_frozen(key)])
            # then the CPU → device copies of the next units, on the copy stream
            self.flat.stage_shards([i for key in ahead[:COPY_AHEAD] for i in self._with_frozen(key)])
        self._fetch(index)
        if self._position >= 0:
            self._prefetch(order, self._position)

    def prefetch_next_forward(self) -> None:
        """Start reading the first units of the next forward from NVMe (after the step has
        written their updated shards), so that its first gathers find them read."""
        if self.traced:
            ahead = self.traces[False][:NVME_READ_AHEAD]
            self.flat.prefetch_shards([i for key in ahead for i in self._with_frozen(key)])

    def _make_pre_forward(self, index: int):
        def hook(module, args):
            if recomputing():  # backward recomputes a checkpointed block: gather, trace nothing
                # No _depth here: checkpoint's early stop can end the recomputation inside
                # this unit, so its post-hook may never run (backward is the context anyway).
                self._enter_backward()
                self.agreement.log(Event.RECOMPUTE, index)
                self.fetch(index)
                return
            if not self._engine_forward and not self._in_backward:
                self._outside_pre(module, index)
                return
            self.agreement.log(Event.VISIT, index)  # first: every run is an event
            self._depth += 1
            self._visit(index, backward=False)
        return hook

    def _make_post_forward(self, index: int):
        def hook(module, args, kwargs, output):
            if self._outside and self._outside[-1][0] is module and not recomputing():
                return  # (a forward outside the engine: _outside_post)
            if not recomputing():
                self.agreement.log(Event.RELEASE, index)
                self._depth -= 1
            else:  # released as after a forward, unless its backward has begun
                self.agreement.log(Event.RECOMPUTE_END, index)
                if index not in self._backward_begun:
                    self._release(index)
                return
            if torch.is_grad_enabled():
                # The unit's backward begins when the gradient of a tensor it produced arrives.
                # A tensor it only passed through (an input returned as an output, as T5's
                # layers return the position bias they were given) says nothing about this
                # unit: its gradient may arrive after the unit's backward is over, and a
                # backward visit then would gather the unit again with nothing to release it.
                passed_through = {id(t) for t in tensors_in((args, kwargs))}
                produced = [t for t in tensors_in(output) if t.requires_grad and id(t) not in passed_through]
                for t in produced:
                    t.register_hook(lambda grad, index=index: self._visit_backward(index))
                if produced and index in self.frozen_of:
                    self._note_call(index, [t for t in tensors_in((args, kwargs)) if t.requires_grad])
            self._release(index)
        return hook

    def _note_call(self, index: int, inputs: list[torch.Tensor]) -> None:
        """A call of a module with frozen parameters, whose outputs will bring a backward: its
        frozen units may go once the gradients of all its inputs are ready (the frozen weights'
        last use in backward computes them). A leaf input (a parameter passed in) gives no such
        signal before its accumulation, nor does a call without inputs that need gradients
        while its unit trains nothing: those keep the frozen units until the end of backward."""
        if any(t.is_leaf for t in inputs) or (not inputs and self.frozen_of[index] == [index]):
            self._open_calls[index] = self._open_calls.get(index, 0) + 1  # never closed: until the end
            return
        if not inputs:
            return
        self._open_calls[index] = self._open_calls.get(index, 0) + 1
        pending = [len(inputs)]

        def input_grad_ready(grad, index=index, pending=pending):
            pending[0] -= 1
            if pending[0] == 0:
                self._open_calls[index] -= 1
                self._release_frozen_when_done(index)

        for t in inputs:
            t.register_hook(input_grad_ready)

    def _release_frozen_when_done(self, index: int) -> None:
        """Release unit index's frozen units once every call's input gradients are ready and
        (for a unit that also trains) its trained gradients are complete."""
        if self._open_calls.get(index, 0) > 0:
            return
        trains = self.frozen_of[index] != [index]
        if trains and index not in self._grads_done:
            return
        for i in self.frozen_of[index]:
            self.flat.release(i)

    def _visit_backward(self, index: int) -> None:
        self._backward_begun.add(index)
        self._visit(index, backward=True)

    @staticmethod
    def _locate(index: int, after: int, order: list[int]) -> int:
        """Position of index in order at or after `after` (the trace may repeat a unit)."""
        for pos in range(max(after, 0), len(order)):
            if order[pos] == index:
                return pos
        return -1

    def on_unit_grads_done(self, index: int) -> None:
        self._enter_backward()
        self.agreement.log(Event.GRADS_DONE, index)
        self._backward_begun.discard(index)
        self.flat.release(index)
        if index in self.frozen_of:
            self._grads_done.add(index)
            self._release_frozen_when_done(index)

    def release_all(self) -> None:
        for u in self.flat.all_units:
            self.flat.release(u.unit.index)

    def remove(self) -> None:
        self._remove_outside_hooks()
        for h in self._handles:
            h.remove()
