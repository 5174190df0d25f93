"""A live run exported as a Hugging Face checkpoint, written by every rank in parallel:
``engine.save_pretrained(directory)``.

ZeRO-Infinity §6 trains models no rank can hold whole; such a model must also leave the run
without ever being whole on a rank. So the export goes one unit of the flat layout at a time
(tiertrain/zero/layout.py): the unit's fp32 master shards are all-gathered (a partitioned unit,
or a resident one whose compute copy is not the value wanted), its tensors are then whole for
that unit only, each is written by one rank, and the unit is dropped before the next one is
gathered. A rank's extra memory is one unit plus one tensor's cast copy, whatever the model's
size, and the bytes to write are spread over the ranks.

The file plan is decided up front, identically on every rank, from the layout and the module
alone (names, shapes, dtypes; no values): which rank writes each tensor (balanced by bytes), the
safetensors files each rank writes, every file's name, header and byte offsets. So no file list
needs exchanging, and each rank streams its files: the header first, then each tensor as soon
as its unit is gathered (the ``safetensors`` format is a JSON header of names, dtypes, shapes and
offsets, then the tensors' bytes back to back; the header can be written before any value is
known). Files are written under temporary names, fsynced and renamed into place; rank 0 writes
``model.safetensors.index.json`` last, after every rank has finished, so a directory with an
index is complete (a single file is ``model.safetensors``, with no index).

The output is what ``transformers``' ``save_pretrained`` writes for the same model: tensor names
are the model's ``state_dict()`` names (a tensor tied under several names once, under the name
Hugging Face keeps: not one its ``_tied_weights_keys`` declare as a tied copy), persistent
buffers included, plus ``config.json`` (and ``generation_config.json``) when the model has a
Hugging Face config. ``type(model).from_pretrained(directory)`` and
:func:`tiertrain.load_pretrained` both load it. The directory must be one every rank can write
(a shared file system when the ranks run on several machines). The plan is
tiertrain/state/export_plan.py's; the files are written by tiertrain/state/export_files.py.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import torch
import torch.distributed as dist

from ..io.fileio import atomic_write
from ..pipeline.materialize import ranks_with
from ..unit_values import MasterShards
from .export_files import _fsync_directory, _remove_stale, _StreamedFile, _write_config, write_files_with_model
from .export_groups import ConvertedValues, GroupMembers
from .export_plan import (DEFAULT_MAX_SHARD_BYTES, INDEX_FILE, SHARD_NAME, SINGLE_FILE, _File, _Item, _model_tensors,
                          _plan, _Plan, resolve_dtype)
from .peft_export import PeftExport, peft_items, peft_model, write_adapter_config

if TYPE_CHECKING:
    from ..engine import Engine
    from ..zero.flat import UnitBuffers


@dataclass
class ExportReport:
    """What one rank did. ``largest_gather`` and ``largest_write`` bound the memory the export
    needed on this rank: at most one unit, whatever the model's size."""

    directory: str
    dtype: torch.dtype
    """The dtype floating-point tensors were written in."""
    files: list[str] = field(default_factory=list)
    """Every file of the checkpoint (all ranks'), in order."""
    written: list[str] = field(default_factory=list)
    """The files this rank wrote."""
    weight_map: dict[str, str] = field(default_factory=dict)
    """Tensor name → file, for the whole checkpoint (as in the index)."""
    tensors: int = 0
    """Tensors this rank wrote."""
    bytes_written: int = 0
    """Tensor bytes this rank wrote (headers not counted)."""
    largest_write: int = 0
    """The largest single tensor this rank wrote, in bytes."""
    gathers: int = 0
    """Units this rank all-gathered (the others were whole here already)."""
    largest_gather: int = 0
    """The largest unit buffer this rank gathered, in bytes (padded, in the gathered dtype)."""
    total_size: int = 0
    """Tensor bytes of the whole checkpoint."""


# -- writing: this rank's files, streamed as the units are gathered --------------------------------


class _RankWriter:
    """This rank's files, written in plan order, one open at a time."""

    def __init__(self, directory: str, files: list[_File], report: ExportReport):
        self.directory = directory
        self.files = files
        self.report = report
        self.current: _StreamedFile | None = None
        self.opened = 0

    def _open_next(self) -> bool:
        if self.current is None and self.opened < len(self.files):
            self.current = _StreamedFile(self.directory, self.files[self.opened])
            self.opened += 1
        return self.current is not None

    def advance(self, unit: int | None, value_of: Callable[[_Item], torch.Tensor] | None) -> None:
        """Write every tensor of the open files that is available now: those of this unit (just
        gathered; value_of cuts them from it) and those the module holds, each at its offset.
        unit None: the end, when everything left must be written."""
        while self._open_next():
            for item in list(self.current.unwritten.values()):
                if item.unit is None or item.unit == unit:
                    value = value_of(item) if item.unit is not None else item.value
                    nbytes = self.current.write(item, value.detach().to(dtype=item.dtype))
                    self.report.tensors += 1
                    self.report.bytes_written += nbytes
                    self.report.largest_write = max(self.report.largest_write, nbytes)
            if self.current.pending is None:
                self.current.commit()
                self.report.written.append(self.current.spec.name)
                self.current = None
                continue
            late = next((i for i in self.current.unwritten.values() if unit is None or i.unit < unit), None)
            if late is not None:
                raise RuntimeError(f"save_pretrained: internal error: {late.name} of unit {late.unit} "
                                   f"was not written when its unit was gathered")
            return

    def abort(self) -> None:
        if self.current is not None:
            self.current.abort()
            self.current = None


# -- the export ------------------------------------------------------------------------------------


def _unit_values(engine: "Engine", u: "UnitBuffers", dtype: torch.dtype, masters: MasterShards,
                 report: ExportReport, failed: list[BaseException]) -> torch.Tensor:
    """Unit u's whole flat buffer. Trained: the fp32 masters, all-gathered from the ranks'
    shards; except where this rank already holds the value wanted (stage 0's whole masters;
    a resident unit's compute copy when the checkpoint is written in the compute dtype, the
    masters cast as the step cast them). Frozen: its compute-dtype shards, all-gathered.
    Collective whenever it gathers (every rank gathers the same units); a local failure (an
    NVMe read) contributes zeros and is recorded in failed, so no rank is left waiting."""
    unit, comm, flat = u.unit, engine.comm, engine.flat
    if u.trainable and unit.num_shards == 1:
        return masters.shard(unit.index)
    if unit.resident and (dtype == flat.dtype or not u.trainable):
        return u.full
    gathered = torch.float32 if u.trainable else flat.dtype
    full = torch.empty(unit.padded_numel, dtype=gathered, device=engine.device)
    try:
        shard = masters.shard(unit.index) if u.trainable else flat.read_shard(unit.index)
        shard = shard.to(device=engine.device, dtype=gathered)
    except Exception as e:  # (the gather must still happen: the other ranks are in it)
        failed.append(e)
        shard = torch.zeros(unit.shard_numel, dtype=gathered, device=engine.device)
    comm.all_gather(full, shard)
    report.gathers += 1
    report.largest_gather = max(report.largest_gather, full.numel() * full.element_size())
    return full


def _cutter(full: torch.Tensor) -> Callable[[_Item], torch.Tensor]:
    """A tensor of the unit, cut from the unit's whole flat buffer (a view: no copy)."""
    return lambda item: full[item.slot.offset:item.slot.end].view(item.slot.shape)


def _agree(engine: "Engine", failed: list[BaseException], what: str, plan: _Plan | None = None) -> None:
    """A barrier that also raises on every rank when any rank failed (its own error on that
    rank), so no rank returns while another has not finished, and none waits on one that gave
    up. With plan: also that every rank computed the same plan (the gathers that follow must
    match), from a digest of it. Under pipeline parallelism the data-parallel ranks of a stage
    compare their plans, and every rank of every stage learns of a failure."""
    size = engine.comm.size
    flags = torch.zeros(size + 2, dtype=torch.int64, device=engine.device)
    flags[engine.comm.rank] = int(bool(failed))
    digest = plan.digest if plan is not None else 0
    flags[size:] = torch.tensor([digest, -digest])
    engine.comm.all_reduce(flags, op=dist.ReduceOp.MAX, count=False)
    ranks = [r for r, flag in enumerate(flags[:size].tolist()) if flag]
    differ = int(flags[size]) != digest or -int(flags[size + 1]) != digest
    elsewhere = []
    if engine.topology.size("pp") > 1:
        elsewhere = ranks_with(bool(ranks) or differ, engine.topology)
    if failed:
        raise failed[0]
    if ranks:
        raise RuntimeError(f"save_pretrained: rank(s) {ranks} failed {what} (their errors are raised there); "
                           f"the checkpoint is incomplete")
    if differ:
        raise RuntimeError("save_pretrained: the ranks planned different files (their models' state_dict names, "
                           "shapes or layouts differ); nothing was written")
    if elsewhere:
        raise RuntimeError(f"save_pretrained: global rank(s) {elsewhere} of another pipeline stage failed {what} "
                           f"(their errors are raised there); the checkpoint is incomplete")


def _over_the_pipeline(engine: "Engine", plan: _Plan) -> tuple[_Plan, _Plan]:
    """This pipeline rank's plan with its files renamed into the whole checkpoint's numbering
    (each pipeline rank's files in turn, in pipeline order), and the whole checkpoint's plan
    (every rank's files; for the index and the report). Collective over the pipeline."""
    group, p = engine.topology.group("pp"), engine.topology.size("pp")
    counts: list = [None] * p
    dist.all_gather_object(counts, len(plan.files), group=group)
    offset, total = sum(counts[:engine.topology.coord("pp")]), sum(counts)
    mine = _Plan(tuple(dataclasses.replace(f, name=SHARD_NAME.format(k=offset + k + 1, n=total))
                       for k, f in enumerate(plan.files)), plan.units)
    every: list = [None] * p  # (each file's name and tensors' names, shapes and dtypes: no values)
    dist.all_gather_object(every, [(f.name, [(i.name, i.shape, i.dtype) for i in f.items]) for f in mine.files],
                           group=group)
    files = tuple(_File(name, -1, tuple(_Item(*item, position=-1, unit=None) for item in items))
                  for stage in every for name, items in stage)
    return mine, _Plan(files, ())


def save_pretrained(engine: "Engine", directory: str | os.PathLike, dtype: torch.dtype | str | None = None,
                    max_shard_bytes: int | None = None, peft: PeftExport | None = None) -> ExportReport:
    """Collective (every rank of the engine calls it): write the engine's current model as a
    Hugging Face checkpoint in directory, each rank writing its share of the files; returns
    what this rank did. See the module docstring, and :meth:`tiertrain.Engine.save_pretrained`."""
    target = resolve_dtype(dtype)
    max_shard_bytes = DEFAULT_MAX_SHARD_BYTES if max_shard_bytes is None else max_shard_bytes
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"save_pretrained: max_shard_bytes must be a positive number of bytes, "
                         f"got {max_shard_bytes!r}")
    pipeline = engine.topology.size("pp") > 1  # (a PipelineEngine: each pipeline rank writes its stages' tensors)
    source = engine.source_model() if pipeline else None
    if pipeline and source is None:
        raise NotImplementedError("save_pretrained: these pipeline stages were not cut from a Hugging Face model by "
                                  "wrap() (stage modules given as a list, or tiertrain's GPT), so no model names their "
                                  "tensors; save a checkpoint (engine.save_checkpoint(dir), every rank) and export it "
                                  "with `tiertrain export DIR OUT`")
    if engine.tp_comm.size > 1:
        raise NotImplementedError("save_pretrained: tensor-parallel parameters are slices; export is supported "
                                  "for parallel.tp=1")
    if engine.closed:
        raise ValueError("save_pretrained: the engine is closed; engine.module is a plain module now (use the "
                         "model's own save_pretrained)")
    if sys.byteorder != "little":
        raise NotImplementedError("save_pretrained: safetensors files are little-endian; this machine is not")
    directory = os.fspath(directory)

    # Every rank completes the update in flight and publishes it, so the masters and the
    # compute copies hold the same, newest step (collective, as for any engine operation).
    engine.quiesce()
    engine.update.flush()
    items, config_of, world, single = _model_tensors(engine, target), engine.module, engine.comm.size, SINGLE_FILE
    if pipeline:
        config_of = source[0]
    elif peft_model(engine.module):
        items, config_of, world, single = peft_items(engine.module, items, peft, world, SINGLE_FILE)
    elif peft is not None:
        raise ValueError(f"save_pretrained: peft={peft} is for a peft.PeftModel; this model is a "
                         f"{type(engine.module).__name__} (leave peft=None)")
    plan = _plan(items, world, max_shard_bytes, single)
    whole = plan
    if pipeline:
        plan, whole = _over_the_pipeline(engine, plan)
    rank = engine.comm.rank
    leader = engine.topology.rank == 0 if pipeline else rank == 0  # (prepares the directory, writes the index)
    report = ExportReport(directory, target, files=[f.name for f in whole.files], weight_map=whole.weight_map,
                          total_size=whole.total_size)
    failed: list[BaseException] = []
    _agree(engine, failed, "planning", plan)  # (the gathers below must be the same on every rank)

    # 1. The directory ready: created, an earlier export's index and stale files removed, the config.
    try:
        os.makedirs(directory, exist_ok=True)
        if leader:
            _remove_stale(directory, whole)
            if config_of is None:
                write_adapter_config(engine.module, directory)
            else:
                _write_config(config_of, directory, target)
            write_files_with_model(directory, engine.files_with_model)
    except Exception as e:
        failed.append(e)
    _agree(engine, failed, "preparing the directory")

    # 2. Unit by unit: gather, write this rank's tensors of it, drop it.
    mine = [f for f in plan.files if f.rank == rank]
    writer = _RankWriter(directory, mine, report)
    masters = MasterShards(engine)
    by_index = engine.flat.all_units
    members = GroupMembers([i for f in mine for i in f.items])
    converted = ConvertedValues(engine.module, [i for f in mine for i in f.items], members.take)
    # (a unit holding a tensor written in fp32 while the rest is not, what the model keeps in
    # fp32, is gathered from its fp32 masters)
    in_fp32 = {m.unit for f in plan.files for i in f.items for m in (i.members or (i,)) if i.dtype == torch.float32}
    with torch.no_grad():
        for index in plan.units:
            wanted = torch.float32 if index in in_fp32 else target
            full = _unit_values(engine, by_index[index], wanted, masters, report, failed)
            if not failed:
                try:
                    cut = _cutter(full)
                    members.collect(index, cut)
                    writer.advance(index, lambda item: cut(item) if item.group is None else converted(item))
                except Exception as e:
                    failed.append(e)
            del full  # (dropped before the next unit is gathered)
        if not failed:
            try:
                writer.advance(None, None)
            except Exception as e:
                failed.append(e)
    if failed:
        writer.abort()
    _agree(engine, failed, "writing their files")

    # 3. Rank 0 marks the checkpoint complete: the index, last.
    if leader and len(whole.files) > 1:
        try:
            index = {"metadata": {"total_size": whole.total_size}, "weight_map": dict(sorted(whole.weight_map.items()))}
            text = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            atomic_write(os.path.join(directory, INDEX_FILE), lambda f: f.write(text))
        except Exception as e:
            failed.append(e)
    if leader and not failed:
        _fsync_directory(directory)
    _agree(engine, failed, "writing the index")
    return report


__all__ = ["ExportReport", "save_pretrained"]
