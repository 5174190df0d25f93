"""ZeRO stage 3 inside a pipeline stage: parameters partitioned over dp, gathered per block
inside the schedule.

Each local chunk (pipeline stage module) is laid out like a stage-3 model of its own
(:func:`stage3_plan`): one partitioned unit per block (``blocks.5`` of a GPT stage,
``model.layers.5`` of a Hugging Face stage), one for the chunk's other parameters (its
*root*: embeddings, final norm, head) and, with ``zero.persistence_threshold``, one resident
unit of small parameters. Every data-parallel rank of a pipeline stage keeps only its 1/dp
shard of each partitioned unit between uses, on the parameter tier (device, CPU or NVMe).

:class:`PipelineFetcher` gathers and releases the units around each micro-batch's work, so
that the interleaving of forwards and backwards of different micro-batches (1F1B,
interleaved 1F1B) needs no trace of a global order:

* **forward** of a chunk: its root unit is gathered for the chunk's whole forward (the
  embedding runs first, the head last); each block's unit is gathered by the block's forward
  pre-hook and released by its forward hook, which also hangs a gradient hook on the
  tensors the block produced;
* **backward** of a chunk for one micro-batch (one executor action): the root unit is
  gathered when it begins; a block's unit is gathered again when the gradient of a tensor it
  produced arrives (its backward is about to run), and released as soon as every one of its
  parameters has received its gradient of this backward; whatever is still gathered when the
  action ends is released then.

Every event is a function of the schedule and of the model's graph, the same on every
data-parallel rank of a stage, so the all-gathers are issued in the same order everywhere.
Gradients are those of stage 2 in a pipeline: accumulated over the step's micro-batches in
fp32 buckets and reduce-scattered once per chunk when its last backward of the step is over
(:mod:`.engine`). Activation checkpointing works: a recomputation gathers its block, which
stays gathered until its backward is over.
"""
from __future__ import annotations

from typing import Sequence

import torch
import torch.nn as nn

from ..config import Config
from ..zero.flat import FlatParameters
from ..zero.layout import FlatLayout, Unit, module_layout
from ..zero.plan import GradientPlan, default_unit_modules, parameter_aliases
from ..offload.recompute import recomputing
from ..zero.stage3 import tensors_in
from .executor import PipelineExecutor

__all__ = ["block_prefixes", "stage3_plan", "PipelineFetcher", "Stage3Executor"]


def block_prefixes(stage: nn.Module) -> list[str]:
    """The module names of a stage's blocks (its stage-3 units besides the root): a Hugging
    Face stage's block paths (:mod:`.hf_split`), a GPT stage's ``blocks.<i>``, otherwise the
    children of every ``nn.ModuleList`` of the stage (as for one model)."""
    if hasattr(stage, "_blocks") and hasattr(stage, "layers"):  # hf_split.HFStage
        return [stage._blocks[i] for i in stage.layers]
    blocks = getattr(stage, "blocks", None)
    if isinstance(blocks, nn.ModuleDict):  # stage.GPTStage
        return [f"blocks.{key}" for key in blocks]
    return default_unit_modules(stage)


def _concatenate(layouts: Sequence[FlatLayout], labels: Sequence[str]) -> FlatLayout:
    units = []
    for layout, label in zip(layouts, labels, strict=True):
        for u in layout.units:
            units.append(Unit(len(units), f"{label}.{u.label}", u.slots, u.padded_numel, u.num_shards, u.resident))
    return FlatLayout(tuple(units), layouts[0].num_shards)


def stage3_plan(stages: Sequence[nn.Module], config: Config, dp: int,
                counts_in_norm) -> tuple[GradientPlan, list[list[int]], list[list[tuple[int, nn.Module]]]]:
    """The stage-3 layout of a rank's chunks, chunk after chunk: per chunk its root unit,
    one unit per block (:func:`block_prefixes`) and possibly a resident unit of small
    parameters. Frozen parameters are not partitioned (they stay whole). Returns the plan,
    each chunk's unit indices, and each chunk's (unit index, module) pairs to gather around
    (the root's module is the stage itself; empty units are left out)."""
    named, layouts, modules = [], [], []
    for stage in stages:
        own = [(n, p) for n, p in stage.named_parameters() if p.requires_grad]
        named += own
        prefixes = block_prefixes(stage)
        layouts.append(module_layout(own, prefixes, dp, config.zero.persistence_threshold,
                                     aliases=parameter_aliases(stage)))
    if not named:
        raise ValueError("the model has no trainable parameters")
    layout = _concatenate(layouts, [f"chunk{k}" for k in range(len(stages))])
    units_of_chunk, start = [], 0
    for stage, chunk_layout in zip(stages, layouts):
        units_of_chunk.append(list(range(start, start + len(chunk_layout.units))))
        pairs = []
        for u in chunk_layout.units:
            if u.resident or not u.slots:
                continue
            module = stage if u.label == "<root>" else stage.get_submodule(u.label)
            pairs.append((start + u.index, module))
        modules.append(pairs)
        start += len(chunk_layout.units)
    plan = GradientPlan(named, layout, launch_when_ready=False, counts_in_norm=counts_in_norm)
    return plan, units_of_chunk, modules


class PipelineFetcher:
    """Gathers and releases a pipeline rank's stage-3 units (see the module docstring).
    ``chunks``: per local chunk, its (unit index, module) pairs, the root (the stage module
    itself) first."""

    def __init__(self, flat: FlatParameters, stages: Sequence[nn.Module],
                 chunks: list[list[tuple[int, nn.Module]]]):
        self.flat = flat
        self.stages = list(stages)
        self.chunks = chunks
        self._roots = {}  # chunk → its root unit (None when the chunk has no root parameters)
        self._units = [[index for index, _ in pairs] for pairs in chunks]
        self._active: int | None = None  # the chunk whose backward action is running
        self._missing: dict[int, int] = {}
        self._handles = []
        self.gathers = 0
        """All-gathers issued so far (for tests and reports)."""
        for k, (stage, pairs) in enumerate(zip(self.stages, chunks)):
            self._roots[k] = next((index for index, module in pairs if module is stage), None)
            for index, module in pairs:
                # (eager inside a compiled module: see tiertrain/zero/stage3.py ParameterFetcher)
                self._handles.append(module.register_forward_pre_hook(torch.compiler.disable(self._pre_forward(index)),
                                                                     prepend=True))
                self._handles.append(module.register_forward_hook(
                    torch.compiler.disable(self._post_forward(index, module is stage)), with_kwargs=True))
        self._chunk_of = {index: k for k, units in enumerate(self._units) for index in units}
        for p, (index, _) in flat.slot_of.items():
            if index in self._chunk_of:
                self._handles.append(p.register_post_accumulate_grad_hook(self._on_grad))

    # -- gathering -----------------------------------------------------------------

    def _gather(self, index: int) -> None:
        if not self.flat.all_units[index].gathered:
            self.gathers += 1
        self.flat.gather(index)

    def _pre_forward(self, index: int):
        def hook(module, args):
            self._gather(index)
        return hook

    def _post_forward(self, index: int, is_root: bool):
        def hook(module, args, kwargs, output):
            if recomputing():  # backward's recomputation: kept until this backward is over
                return
            if not is_root and torch.is_grad_enabled():
                # The unit's backward begins when the gradient of a tensor it produced arrives
                # (not of one it passed through, whose gradient may come after its backward).
                passed = {id(t) for t in tensors_in((args, kwargs))}
                for t in tensors_in(output):
                    if t.requires_grad and id(t) not in passed:
                        t.register_hook(lambda grad, index=index: self._gather(index))
            self.flat.release(index)
        return hook

    def _on_grad(self, p: nn.Parameter) -> None:
        index = self.flat.slot_of[p][0]
        if self._active is None or self._chunk_of[index] != self._active:
            return
        self._missing[index] -= 1
        if self._missing[index] == 0:  # every use of the unit in this backward is over
            self.flat.release(index)

    def begin_backward(self, chunk: int) -> None:
        """Before the backward of one micro-batch through local chunk ``chunk``."""
        self._active = chunk
        self._missing = {index: len(self.flat.all_units[index].unit.slots) for index in self._units[chunk]}
        root = self._roots[chunk]
        if root is not None:
            self._gather(root)

    def end_backward(self, chunk: int) -> None:
        """After it: release what the backward left gathered (a unit with a parameter the
        backward did not reach, a recomputed block)."""
        self._active = None
        for index in self._units[chunk]:
            self.flat.release(index)

    def release_all(self) -> None:
        for units in self._units:
            for index in units:
                self.flat.release(index)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class Stage3Executor(PipelineExecutor):
    """The pipeline executor with each backward action bracketed by the fetcher's
    :meth:`~PipelineFetcher.begin_backward` / :meth:`~PipelineFetcher.end_backward`."""

    fetcher: PipelineFetcher | None = None

    def _backward(self, a) -> None:
        if self.fetcher is None:
            return super()._backward(a)
        chunk = self.stage_ids.index(a.chunk)
        self.fetcher.begin_backward(chunk)
        try:
            super()._backward(a)
        finally:
            self.fetcher.end_backward(chunk)
