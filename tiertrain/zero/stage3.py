"""ZeRO stage 3 parameter fetching (ZeRO §5.3; ZeRO-Infinity's overlap-centric prefetcher).

Forward pre-hooks gather a unit's parameters just before its module runs; forward hooks
release them afterwards and hang a hook on the module's outputs, so that backward gathers
them again just before the module's backward; the gradient reducer reports when a unit's
gradients are complete, and the unit is released again. The first forward and backward
record the order in which units run; later steps use that trace to prefetch the next units'
all-gathers (asynchronously, within a byte budget) while the current unit computes, in
forward order during forward and in the recorded backward order during backward.

Every collective of stage 3 is preceded by a 2-element agreement check (see
Collectives.check_same), so ranks that run different modules stop together with a
CollectiveMismatchError instead of hanging or exchanging mismatched buffers.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from ..comm import Collectives
from .flat import FlatParameters

GATHER, REDUCE, STEP = 1, 2, 3
_KIND = {GATHER: "the all-gather of", REDUCE: "the gradient reduce-scatter of"}


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
    def __init__(self, flat: FlatParameters, comm: Collectives, unit_modules: dict[int, nn.Module],
                 prefetch_bytes: int, max_live_bytes: int = 0, check: bool = True):
        self.flat = flat
        self.comm = comm
        self.prefetch_bytes = prefetch_bytes
        self.max_live_bytes = max_live_bytes
        self.check = check and comm.size > 1
        self.traces: dict[bool, list[int]] = {False: [], True: []}  # forward, backward unit order
        self.traced = False
        self._position = -1
        self._in_backward = False
        self._handles = []
        for index, module in unit_modules.items():
            self._handles.append(module.register_forward_pre_hook(self._make_pre_forward(index)))
            self._handles.append(module.register_forward_hook(self._make_post_forward(index)))

    # -- collective agreement --------------------------------------------------------

    def describe(self, code: int) -> str:
        kind, index = divmod(code, 1 << 20)
        if kind == STEP:
            return "the optimizer step"
        label = self.flat.units[index].unit.label if 0 <= index < len(self.flat.units) else f"#{index}"
        return f"{_KIND.get(kind, 'collective')} unit '{label}'"

    def agree(self, kind: int, index: int = 0) -> None:
        if self.check:
            self.comm.check_same((kind << 20) + index, self.describe)

    # -- fetching ----------------------------------------------------------------------

    def fetch(self, index: int) -> None:
        u = self.flat.units[index]
        if not u.gathered:
            self.agree(GATHER, index)
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
                self.agree(GATHER, index)
                self.flat.gather(index, async_op=True)
            budget -= nbytes

    def begin_forward(self) -> None:
        self._position = -1
        self._in_backward = False

    def end_backward(self) -> None:
        """The first forward+backward has been traced; later steps prefetch from the traces."""
        if self.traces[False]:
            self.traced = True

    def _visit(self, index: int, backward: bool) -> None:
        if backward and not self._in_backward:
            self._in_backward = True
            self._position = -1
        order = self.traces[backward]
        if not self.traced:
            order.append(index)
            self.fetch(index)
            return
        self._position = self._locate(index, self._position, order)
        self.fetch(index)
        if self._position >= 0:
            self._prefetch(order, self._position)

    def _make_pre_forward(self, index: int):
        def hook(module, args):
            self._visit(index, backward=False)
        return hook

    def _make_post_forward(self, index: int):
        def hook(module, args, output):
            if torch.is_grad_enabled():
                for t in _tensors(output):
                    if t.requires_grad:
                        t.register_hook(lambda grad, index=index: self._visit(index, backward=True))
            self.flat.release(index)
        return hook

    @staticmethod
    def _locate(index: int, after: int, order: list[int]) -> int:
        """Position of index in order at or after `after` (the trace may repeat a unit)."""
        for pos in range(max(after, 0), len(order)):
            if order[pos] == index:
                return pos
        return -1

    def on_unit_grads_done(self, index: int) -> None:
        self.flat.release(index)

    def release_all(self) -> None:
        for u in self.flat.units:
            self.flat.release(u.unit.index)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
