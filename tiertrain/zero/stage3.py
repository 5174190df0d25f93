"""ZeRO stage 3 parameter fetching (ZeRO §5.3; ZeRO-Infinity's overlap-centric prefetcher).

Forward pre-hooks gather a unit's parameters just before its module runs; forward hooks
release them afterwards and hang a hook on the module's outputs, so that backward gathers
them again just before the module's backward; the gradient reducer reports when a unit's
gradients are complete, and the unit is released again. The first forward and backward
record the order in which units run; later steps use that trace to prefetch the next units'
all-gathers (asynchronously, within a byte budget) while the current unit computes, in
forward order during forward and in the recorded backward order during backward.

Collective agreement. Ranks must issue the same collectives in the same order; when they do
not (a module run on some ranks only), gloo exchanges mismatched buffers or aborts and NCCL
hangs. With ``check="traced"`` (the default) each rank's work is a sequence of *segments* —
a forward pass, a backward pass, an optimizer step, a ``gathered_parameters`` fetch outside
them — and

* every segment opens with one small agreement (Collectives.check_same) on what opens,
  which also compares a digest of the segment just recorded, if one was;
* the first segment of each kind (forward with or without gradients, backward, ...) is
  *recorded*: its events — each unit's forward, end of forward, backward, last gradient,
  reduce-scatter — are logged, and each of its collectives is agreed first, as before;
* later segments of that kind are *checked locally* against the recording, event by event
  (no communication). A rank whose event differs (a skipped, extra or reordered module), or
  that opens a segment before the previous one reached its end, raises
  CollectiveMismatchError before issuing its next collective, and its Collectives refuses
  every later one. Its peers wait in the collective it skipped until it exits: then gloo
  fails their collective ("Connection closed by peer") and the launcher stops them, naming
  the deviating rank (tiertrain.launch, run_distributed; torchrun stops the job too). With
  NCCL the peers wait until the launcher stops them or the process-group timeout.

So a step costs three small agreements (forward, backward, step) instead of one before each
of its collectives (about three per unit), and none stands between the asynchronous
reduce-scatters of a backward, which each used to wait for. Prefetch needs no check of its
own: it is a function of the trace and of the checked events. A model whose module order
changes between steps *alike on every rank* fails with the same error; call ``retrace()``
(collective) whenever the order changes, or use ``check="every"`` (an agreement before every
collective, as in the first step; "off": none).
"""
from __future__ import annotations

import array
import contextlib
import hashlib
import threading
from collections import Counter
from typing import Any

import torch
import torch.nn as nn

from ..comm import CollectiveMismatchError, Collectives
from .flat import NVME_READ_AHEAD, FlatParameters

GATHER, REDUCE, STEP = 1, 2, 3  # collectives agreed one by one (codes shared with the engine)
FORWARD, BACKWARD, OUTSIDE, RETRACE = 4, 5, 6, 7  # what opens a segment (agreed by every rank)
VISIT, RELEASE, BACKWARD_VISIT, GRADS_DONE, RECOMPUTE, RECOMPUTE_END = 8, 9, 10, 11, 12, 13  # local events
CHECKS = ("traced", "every", "off")
_KIND = {GATHER: "the all-gather of", REDUCE: "the gradient reduce-scatter of", VISIT: "the forward of",
         RELEASE: "the end of the forward of", BACKWARD_VISIT: "the backward of",
         GRADS_DONE: "the last gradient of", RECOMPUTE: "the recomputed forward of",
         RECOMPUTE_END: "the end of the recomputed forward of"}
_SEGMENT = {0: "start", FORWARD: "forward pass", BACKWARD: "backward pass", STEP: "optimizer step",
            OUTSIDE: "gathered_parameters() fetch", RETRACE: "retrace()"}


def _code(kind: int, index: int = 0) -> int:
    return (kind << 20) + index


def _digest(trace: list[int]) -> int:
    """A 56-bit hash of a trace, the same in every process."""
    return int.from_bytes(hashlib.blake2b(array.array("q", trace).tobytes(), digest_size=7).digest(), "little")


_recompute = threading.local()


@contextlib.contextmanager
def recomputation():
    """Marks backward's recomputation of a checkpointed block (tiertrain.offload.activations).
    The forward hooks of stage-3 units inside the block fire again: under this context they
    gather without recording the unit in the traced order or prefetching from it, and release
    afterwards only units whose backward has not begun (the unit whose backward asked for the
    recomputation keeps its parameters; the others are gathered again by their own backward)."""
    _recompute.depth = getattr(_recompute, "depth", 0) + 1
    try:
        yield
    finally:
        _recompute.depth -= 1


def recomputing() -> bool:
    return getattr(_recompute, "depth", 0) > 0


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _tensors(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _tensors(x)


class ParameterFetcher:
    """Gathers, prefetches and releases stage-3 units around their modules, and keeps every
    rank's collectives in step (``check``: "traced", "every" or "off"; see the module
    docstring). Set ``check`` before the first forward."""

    def __init__(self, flat: FlatParameters, comm: Collectives, unit_modules: dict[int, nn.Module],
                 prefetch_bytes: int, max_live_bytes: int = 0, check: str | bool = "traced"):
        self.flat = flat
        self.comm = comm
        self.prefetch_bytes = prefetch_bytes
        self.max_live_bytes = max_live_bytes
        check = {True: "traced", False: "off", None: "off"}.get(check, check)
        if check not in CHECKS:
            raise ValueError(f"check={check!r} is invalid: expected one of {', '.join(CHECKS)}")
        self.check = check if comm.size > 1 else "off"
        self.traces: dict[bool, list[int]] = {False: [], True: []}  # forward, backward unit order
        self.traced = False
        self._position = -1
        self._in_backward = False
        self._depth = 0  # unit forwards in progress
        self._backward_begun: set[int] = set()  # units whose backward began, grads not yet done
        # check="traced": the open segment, its events' trace, where this rank is in it
        self._event_traces: dict[tuple, list[int]] = {}
        self._segment: tuple = (0,)
        self._trace: list[int] = []
        self._recording = True
        self._pos = 0
        self._opened: Counter = Counter()
        self._handles = []
        for index, module in unit_modules.items():
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(index)))
            self._handles.append(module.register_forward_hook(self._make_post_forward(index)))

    # -- collective agreement --------------------------------------------------------

    def describe(self, code: int) -> str:
        kind, index = divmod(code, 1 << 20)
        if kind == STEP:
            return "the optimizer step"
        if kind == FORWARD:
            return "the start of a forward pass" + ("" if index else " without gradients")
        if kind == BACKWARD:
            return "the start of a backward pass"
        if kind == RETRACE:
            return "retrace()"
        label = self.flat.units[index].unit.label if 0 <= index < len(self.flat.units) else f"#{index}"
        if kind == OUTSIDE:
            return f"gathered_parameters() of unit '{label}'"
        return f"{_KIND.get(kind, 'collective')} unit '{label}'"

    def agree(self, kind: int, index: int = 0) -> None:
        """Called by the engine before the gradient reduce-scatter of unit `index` (REDUCE)
        and at the optimizer step (STEP)."""
        if kind == STEP:
            self._open(STEP)
            return
        if kind == REDUCE:
            self._enter_backward()
        self._log(kind, index)
        self._before_collective(kind, index)

    def retrace(self) -> None:
        """Forget the traced orders; the next segments are recorded (and agreed collective by
        collective) again. Collective: every rank calls it at the same point, between steps,
        e.g. when the model's module order changes on purpose, alike on every rank."""
        self._open(RETRACE)
        self.traces = {False: [], True: []}
        self.traced = False
        self._event_traces = {self._segment: self._trace}

    def _open(self, kind: int, index: int = 0, key: tuple | None = None) -> None:
        """Open a segment: a forward pass, a backward pass, an optimizer step, a fetch
        outside them. The previous segment must have run to the end of its trace; all ranks
        agree on what opens, and on the digest of the segment just recorded, if one was."""
        if self.check != "traced":
            if self.check == "every" and kind in (STEP, OUTSIDE):
                self.comm.check_same(_code(STEP if kind == STEP else GATHER, index), self.describe)
            return
        if not self._recording and self._pos != len(self._trace):
            self._deviate(self.describe(_code(kind, index)))
        digest = _digest(self._trace) if self._recording else 0
        self.comm.check_same(_code(kind, index), self.describe, digest)
        key = key or (kind,)
        self._segment = key
        self._opened[key] += 1
        trace = self._event_traces.get(key)
        self._recording = trace is None
        self._trace = self._event_traces.setdefault(key, [])
        self._pos = 0

    def _log(self, kind: int, index: int) -> None:
        """One event of this rank's segment: recorded, or checked against the recording."""
        if self.check != "traced":
            return
        code = _code(kind, index)
        if self._recording:
            self._trace.append(code)
            return
        pos = self._pos
        if pos >= len(self._trace) or self._trace[pos] != code:
            self._deviate(self.describe(code))
        self._pos = pos + 1

    def _before_collective(self, kind: int, index: int) -> None:
        if self.check == "every" or (self.check == "traced" and self._recording):
            self.comm.check_same(_code(kind, index), self.describe)

    def _deviate(self, happened: str) -> None:
        """This rank left the trace every rank agreed on: stop before its next collective."""
        kind = self._segment[0]
        name = _SEGMENT.get(kind, "segment") + (" without gradients" if self._segment == (FORWARD, False) else "")
        expected = (self.describe(self._trace[self._pos]) if self._pos < len(self._trace)
                    else f"the end of the {name}")
        message = (
            f"rank {self.comm.rank} reached {happened} as event {self._pos + 1} of its {name} "
            f"#{self._opened[self._segment]}, where the trace of every {name} (recorded on the first one and "
            f"identical on every rank) has {expected}: ranks executed different modules, or a module order "
            f"that changes between steps. This rank stops before issuing another collective; the other ranks "
            f"wait in the collective it skips until the launcher stops them (tiertrain.launch and torchrun do). "
            f"Under ZeRO-3 every rank must run the same partitioned modules in the same order; if the order "
            f"changes on purpose, alike on every rank, call engine.fetcher.retrace() on every rank when it "
            f"changes, or construct the fetcher with check='every' (an agreement before every collective).")
        self.comm.fail(message)
        raise CollectiveMismatchError(message)

    def _enter_backward(self) -> None:
        if not self._in_backward:
            self._in_backward = True
            self._position = -1
            self._open(BACKWARD)

    # -- fetching ----------------------------------------------------------------------

    def fetch(self, index: int) -> None:
        """Gather unit `index` outside its module's hooks (engine.gathered_parameters).
        Outside forward and backward this opens a segment of its own, agreed by every rank;
        inside them it is one more event of the pass."""
        if self._depth > 0 or self._in_backward:
            self._log(GATHER, index)
            self._fetch(index)
        else:
            self._open(OUTSIDE, index)
            self.flat.gather(index)

    def _fetch(self, index: int) -> None:
        """Gather unit `index` now (no-op if gathered). Every gather the hooks issue goes
        through here, so that it is agreed first while its segment is being recorded."""
        if not self.flat.units[index].gathered:
            self._before_collective(GATHER, index)
        self.flat.gather(index)

    def _prefetch(self, order: list[int], position: int) -> None:
        budget = self.prefetch_bytes
        for index in order[position + 1:]:
            if budget <= 0:
                break
            u = self.flat.units[index]
            nbytes = u.full.numel() * u.full.element_size()
            if self.max_live_bytes and self.flat.gathered_bytes() + nbytes > self.max_live_bytes:
                break
            if not u.gathered:
                self._before_collective(GATHER, index)
                self.flat.gather(index, async_op=True)
            budget -= nbytes

    def begin_forward(self) -> None:
        self._position = -1
        self._in_backward = False
        self._depth = 0
        self._backward_begun.clear()
        grad = torch.is_grad_enabled()
        self._open(FORWARD, int(grad), key=(FORWARD, grad))

    def end_backward(self) -> None:
        """The first forward+backward has been traced; later steps prefetch from the traces."""
        if self.traces[False]:
            self.traced = True
        if self._in_backward and self.check == "traced" and not self._recording and self._pos != len(self._trace):
            self._deviate("the end of backward")
        self._in_backward = False

    def _visit(self, index: int, backward: bool) -> None:
        if backward:
            self._enter_backward()
            self._log(BACKWARD_VISIT, index)
        order = self.traces[backward]
        if not self.traced:
            order.append(index)
            self._fetch(index)
            return
        self._position = self._locate(index, self._position, order)
        if self._position >= 0:  # NVMe reads first: they take longest (ZeRO-Infinity §6)
            self.flat.prefetch_shards(order[self._position + 1:self._position + 1 + NVME_READ_AHEAD])
        self._fetch(index)
        if self._position >= 0:
            self._prefetch(order, self._position)

    def prefetch_next_forward(self) -> None:
        """Start reading the first units of the next forward from NVMe (after the step has
        written their updated shards), so that its first gathers find them read."""
        if self.traced:
            self.flat.prefetch_shards(self.traces[False][:NVME_READ_AHEAD])

    def _make_pre_forward(self, index: int):
        def hook(module, args):
            if recomputing():  # backward recomputes a checkpointed block: gather, trace nothing
                # No _depth here: checkpoint's early stop can end the recomputation inside
                # this unit, so its post-hook may never run (backward is the context anyway).
                self._enter_backward()
                self._log(RECOMPUTE, index)
                self.fetch(index)
                return
            self._log(VISIT, index)  # first: every run is an event
            self._depth += 1
            self._visit(index, backward=False)
        return hook

    def _make_post_forward(self, index: int):
        def hook(module, args, output):
            if not recomputing():
                self._log(RELEASE, index)
                self._depth -= 1
            else:  # released as after a forward, unless its backward has begun
                self._log(RECOMPUTE_END, index)
                if index not in self._backward_begun:
                    self.flat.release(index)
                return
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(lambda grad, index=index: self._visit_backward(index))
            self.flat.release(index)
        return hook

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
        self._log(GRADS_DONE, index)
        self._backward_begun.discard(index)
        self.flat.release(index)

    def release_all(self) -> None:
        for u in self.flat.units:
            self.flat.release(u.unit.index)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
