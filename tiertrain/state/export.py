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
(a shared file system when the ranks run on several machines).
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import struct
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..io.fileio import atomic_write, temporary_beside
from .export_groups import ConvertedValues, GroupMembers, converted_items
from .hf_conversion import SaveGroup
from .peft_export import PeftExport, peft_items, peft_model, write_adapter_config
from ..zero.layout import Slot

if TYPE_CHECKING:
    from ..engine import Engine
    from ..zero.flat import UnitBuffers

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = "model-{k:05d}-of-{n:05d}.safetensors"
_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_TEMP_SUFFIX = ".export.tmp"

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
"""Tensor bytes per file at most (Hugging Face's long-standing "5GB"; a tensor larger than
this gets a file of its own). Every rank writes at least one file when it has tensors to
write, so files are smaller than this whenever the model is."""

DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32, "float32": torch.float32,
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16,
}
"""The dtypes a checkpoint can be written in (by torch dtype or by name)."""

_SAFETENSORS_DTYPE = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


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


def resolve_dtype(dtype: torch.dtype | str | None, what: str = "save_pretrained") -> torch.dtype:
    """The dtype to write floating-point tensors in: fp32 (the masters' own) by default; what
    names the caller in the error."""
    if dtype is None:
        return torch.float32
    if isinstance(dtype, str) and dtype.lower() in DTYPES:
        return DTYPES[dtype.lower()]
    if isinstance(dtype, torch.dtype) and dtype in DTYPES.values():
        return dtype
    raise ValueError(f"{what}: unknown dtype {dtype!r}; use None (fp32, the masters' values), "
                     f"torch.float32, torch.bfloat16 or torch.float16 (or one of {sorted(DTYPES)})")


# -- the plan: what each rank writes, decided on every rank from the layout alone ------------------


@dataclass(frozen=True, eq=False)
class _Item:
    """One tensor of the checkpoint."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    """As written."""
    position: int
    """Its place in the model's order: the layout's units first, then what the module holds."""
    unit: int | None
    """The index of the unit holding it; None for a tensor the module holds whole on every rank
    (a buffer, a frozen parameter outside the layout)."""
    slot: Slot | None = None
    value: torch.Tensor | None = None
    """The module's own tensor (unit is None)."""
    group: SaveGroup | None = None
    """A checkpoint tensor made by the model's checkpoint conversion (hf_conversion): the group
    of model tensors it is converted from; unit is then the last unit holding a member."""
    members: tuple["_Item", ...] = ()
    """That group's model tensors, as items (their own unit, slot or value); for a tensor only
    renamed by the conversion, the one model tensor it is."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class _File:
    name: str
    rank: int
    items: tuple[_Item, ...]
    """In offset order: descending element size (so each tensor starts aligned to its own
    element size), then the model's order, in which the units are gathered."""


@dataclass(frozen=True)
class _Plan:
    files: tuple[_File, ...]
    units: tuple[int, ...]
    """The units that hold an exported tensor, in index order: the gathers, on every rank."""

    @property
    def weight_map(self) -> dict[str, str]:
        return {item.name: f.name for f in self.files for item in f.items}

    @property
    def total_size(self) -> int:
        return sum(item.nbytes for f in self.files for item in f.items)

    @property
    def digest(self) -> int:
        """A hash of the plan (0 <= digest < 2**62), the same on ranks that planned alike."""
        text = json.dumps([[f.name, f.rank, [[i.name, list(i.shape), str(i.dtype), i.unit] for i in f.items]]
                           for f in self.files] + [list(self.units)])
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 2


def _tied_copy_patterns(module: nn.Module) -> list[re.Pattern]:
    """Names Hugging Face models declare as tied copies (``_tied_weights_keys`` of every
    submodule, prefixed by its path; a dict target → source in transformers 5, a list before):
    save_pretrained drops these and keeps the source."""
    patterns = []
    for prefix, sub in module.named_modules():
        declared = getattr(sub, "_tied_weights_keys", None) or ()
        for key in (declared.keys() if isinstance(declared, dict) else declared):
            if isinstance(key, str):
                patterns.append(re.compile(f"{re.escape(prefix)}\\.{key}" if prefix else key))
    return patterns


def _ignored_on_save(module: nn.Module) -> set[str]:
    """Names the model class asks save_pretrained to leave out (``_keys_to_ignore_on_save``)."""
    return {k for k in (getattr(module, "_keys_to_ignore_on_save", None) or ()) if isinstance(k, str)}


def _kept_name(names: list[str], tied: list[re.Pattern]) -> str:
    """The one name a tensor shared under several is written under: the first that is not a
    declared tied copy; if all are, the last in sorted order, as Hugging Face keeps."""
    for name in names:
        if not any(p.search(name) for p in tied):
            return name
    return sorted(names)[-1]


def _model_tensors(engine: "Engine", dtype: torch.dtype) -> list[_Item]:
    """The checkpoint's tensors in the model's order: each tensor of ``state_dict()`` once
    (grouped by identity: a tied parameter is one object under several names), the layout's
    parameters by unit and slot, then what the module holds whole."""
    flat = engine.flat
    names, held = checkpoint_names(engine.module, flat)
    trained_outside = [name for name, t in held if isinstance(t, nn.Parameter) and t.requires_grad]
    if trained_outside:
        raise RuntimeError(f"save_pretrained: trained parameter {trained_outside[0]!r} is not in the engine's layout")
    items: list[_Item] = []
    for u in flat.all_units:
        for slot in u.unit.slots:
            name = names.get(slot.name)
            if name is not None:
                items.append(_Item(name, slot.shape, dtype, len(items), u.unit.index, slot=slot))
    for name, t in held:
        if t.dtype not in _SAFETENSORS_DTYPE:
            raise TypeError(f"save_pretrained: {name!r} is {t.dtype}, which this export does not write "
                            f"(supported: {sorted(str(d) for d in _SAFETENSORS_DTYPE)})")
        items.append(_Item(name, tuple(t.shape), dtype if t.is_floating_point() else t.dtype, len(items), None,
                           value=t))
    return converted_items(engine.module, items)


def _plan(items: list[_Item], world: int, max_shard_bytes: int, single: str = SINGLE_FILE) -> _Plan:
    """Assign each tensor to a rank, largest first, to the rank with the fewest bytes so far
    (ties to the lower rank), then cut each rank's tensors, in the model's order, into files
    of at most max_shard_bytes. Deterministic: every rank computes the same plan."""
    load = [0] * world
    owner: dict[int, int] = {}
    for item in sorted(items, key=lambda i: (-i.nbytes, i.position)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[item.position] = rank
        load[rank] += item.nbytes
    chunks: list[tuple[int, list[_Item]]] = []
    for rank in range(world):
        current: list[_Item] = []
        size = 0
        for item in (i for i in items if owner[i.position] == rank):
            if current and size + item.nbytes > max_shard_bytes:
                chunks.append((rank, current))
                current, size = [], 0
            current.append(item)
            size += item.nbytes
        if current:
            chunks.append((rank, current))
    n = len(chunks)
    files = tuple(
        _File(single if n == 1 else SHARD_NAME.format(k=k + 1, n=n), rank,
              tuple(sorted(chunk, key=lambda i: (-i.dtype.itemsize, i.position))))
        for k, (rank, chunk) in enumerate(chunks))
    units = tuple(sorted({m.unit for i in items for m in (i.members or (i,)) if m.unit is not None}))
    return _Plan(files, units)


# -- writing: one safetensors file streamed tensor by tensor ----------------------------------------


def _header(items: tuple[_Item, ...]) -> bytes:
    """The safetensors header of a file holding items in this order: an 8-byte little-endian
    length, then JSON padded with spaces to a multiple of 8 bytes (so the data, and each tensor
    in descending element size, starts aligned)."""
    entries: dict[str, dict] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for item in items:
        entries[item.name] = {"dtype": _SAFETENSORS_DTYPE[item.dtype], "shape": list(item.shape),
                              "data_offsets": [offset, offset + item.nbytes]}
        offset += item.nbytes
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    return struct.pack("<Q", len(text)) + text


class _StreamedFile:
    """One safetensors file written as its tensors become available: the header at once, then
    each tensor in offset order. Complete or absent (fileio.atomic_write's protocol: a
    temporary file beside the target, fsynced, renamed over it; removed on failure), but kept
    open across the units' gathers, which atomic_write's single callback cannot be."""

    def __init__(self, directory: str, spec: _File):
        self.spec = spec
        self.path = os.path.join(directory, spec.name)
        fd, self.tmp = temporary_beside(directory, f".{spec.name}.", _TEMP_SUFFIX)
        self.f: BinaryIO = os.fdopen(fd, "wb")
        self.next = 0
        """The index in spec.items of the next tensor to write."""
        try:
            self.f.write(_header(spec.items))
        except BaseException:
            self.abort()
            raise

    @property
    def pending(self) -> _Item | None:
        return self.spec.items[self.next] if self.next < len(self.spec.items) else None

    def write(self, item: _Item, value: torch.Tensor) -> int:
        """Append item's value (in item.dtype, on the CPU); returns the bytes written."""
        if item is not self.pending:
            raise RuntimeError(f"save_pretrained: internal error: {item.name} written out of order in {self.spec.name}")
        if tuple(value.shape) != item.shape or value.dtype != item.dtype:
            raise RuntimeError(f"save_pretrained: internal error: {item.name} is {tuple(value.shape)} {value.dtype}, "
                               f"planned {item.shape} {item.dtype}")
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        self.f.write(memoryview(data.numpy()))
        self.next += 1
        return item.nbytes

    def commit(self) -> None:
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


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
        """Write every pending tensor that is available now: those of this unit (just
        gathered; value_of cuts them from it) and those the module holds. unit None: the end,
        when everything left must be written."""
        while self._open_next():
            item = self.current.pending
            if item is None:
                self.current.commit()
                self.report.written.append(self.current.spec.name)
                self.current = None
                continue
            if item.unit is not None and item.unit != unit:
                if unit is None or item.unit < unit:
                    raise RuntimeError(f"save_pretrained: internal error: {item.name} of unit {item.unit} "
                                       f"was not written when its unit was gathered")
                return
            value = value_of(item) if item.unit is not None else item.value
            nbytes = self.current.write(item, value.detach().to(dtype=item.dtype))
            self.report.tensors += 1
            self.report.bytes_written += nbytes
            self.report.largest_write = max(self.report.largest_write, nbytes)

    def abort(self) -> None:
        if self.current is not None:
            self.current.abort()
            self.current = None


# -- the export ------------------------------------------------------------------------------------


class _Masters:
    """This rank's fp32 master shard of each trained unit, one unit at a time: where the
    optimizer keeps them on NVMe, only that unit's are read (never the rank's whole shard)."""

    def __init__(self, engine: "Engine"):
        self.update = engine.update
        nvme = getattr(engine.update, "nvme", None)
        self._read_one = getattr(nvme, "read_masters", None)
        self._all: list[torch.Tensor] | None = None

    def shard(self, index: int) -> torch.Tensor:
        if self._read_one is not None:
            return self._read_one(shards=[index])[index]
        if self._all is None:
            self._all = self.update.masters()  # (in memory: the masters themselves, no copy)
        return self._all[index]


def _unit_values(engine: "Engine", u: "UnitBuffers", dtype: torch.dtype, masters: _Masters,
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
    match), from a digest of it."""
    size = engine.comm.size
    flags = torch.zeros(size + 2, dtype=torch.int64, device=engine.device)
    flags[engine.comm.rank] = int(bool(failed))
    digest = plan.digest if plan is not None else 0
    flags[size:] = torch.tensor([digest, -digest])
    engine.comm.all_reduce(flags, op=dist.ReduceOp.MAX, count=False)
    if failed:
        raise failed[0]
    if bool(flags[:size].any()):
        ranks = [r for r, flag in enumerate(flags[:size].tolist()) if flag]
        raise RuntimeError(f"save_pretrained: rank(s) {ranks} failed {what} (their errors are raised there); "
                           f"the checkpoint is incomplete")
    if int(flags[size]) != digest or -int(flags[size + 1]) != digest:
        raise RuntimeError("save_pretrained: the ranks planned different files (their models' state_dict names, "
                           "shapes or layouts differ); nothing was written")


def _write_config(module: nn.Module, directory: str, dtype: torch.dtype) -> None:
    """config.json (and generation_config.json for a model that generates) as Hugging Face's
    save_pretrained writes them: the dtype and architecture recorded on a copy, so the user's
    config is left as it was."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "save_pretrained", None)):
        return
    config = copy.deepcopy(config)
    config.dtype = str(dtype).removeprefix("torch.")
    config.architectures = [type(module).__name__]
    config.save_pretrained(directory)
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        generation.save_pretrained(directory)


def _remove_stale(directory: str, plan: _Plan) -> None:
    """Rank 0, before anyone writes: the index of an earlier export (so the directory reads as
    incomplete until the new one is written), its files that this export does not replace,
    and temporary files an interrupted export left."""
    planned = {f.name for f in plan.files}
    for name in os.listdir(directory):
        shard = name == SINGLE_FILE or _SHARD_PATTERN.fullmatch(name) is not None
        temporary = name.startswith(".model") and name.endswith(_TEMP_SUFFIX)
        stale = name == INDEX_FILE or (shard and name not in planned) or temporary
        if stale and os.path.isfile(os.path.join(directory, name)):
            os.unlink(os.path.join(directory, name))


def _fsync_directory(directory: str) -> None:
    """Make the renames durable (where the platform can open a directory)."""
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


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
    if engine.topology.size("pp") > 1:  # (a PipelineEngine)
        raise NotImplementedError("save_pretrained: a pipeline's stages hold different parameters under their own "
                                  "names; export is supported for parallel.pp=1")
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
    if peft_model(engine.module):
        items, config_of, world, single = peft_items(engine.module, items, peft, world, SINGLE_FILE)
    elif peft is not None:
        raise ValueError(f"save_pretrained: peft={peft} is for a peft.PeftModel; this model is a "
                         f"{type(engine.module).__name__} (leave peft=None)")
    plan = _plan(items, world, max_shard_bytes, single)
    rank = engine.comm.rank
    report = ExportReport(directory, target, files=[f.name for f in plan.files], weight_map=plan.weight_map,
                          total_size=plan.total_size)
    failed: list[BaseException] = []
    _agree(engine, failed, "planning", plan)  # (the gathers below must be the same on every rank)

    # 1. The directory ready: created, an earlier export's index and stale files removed, the config.
    try:
        os.makedirs(directory, exist_ok=True)
        if rank == 0:
            _remove_stale(directory, plan)
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
    masters = _Masters(engine)
    by_index = engine.flat.all_units
    members = GroupMembers([i for f in mine for i in f.items])
    converted = ConvertedValues(engine.module, [i for f in mine for i in f.items], members.take)
    with torch.no_grad():
        for index in plan.units:
            full = _unit_values(engine, by_index[index], target, masters, report, failed)
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
    if rank == 0 and len(plan.files) > 1:
        try:
            index = {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(plan.weight_map.items()))}
            text = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
            atomic_write(os.path.join(directory, INDEX_FILE), lambda f: f.write(text))
        except Exception as e:
            failed.append(e)
    if rank == 0 and not failed:
        _fsync_directory(directory)
    _agree(engine, failed, "writing the index")
    return report


# -- reusable pieces (the offline export, tiertrain/state/consolidate.py) --------------------------------

TensorItem = _Item
"""One tensor of a checkpoint to write: name, shape, dtype as written, position in the model's
order; for an offline writer, unit=None and value=None (the value is handed to write())."""
StreamedFile = _StreamedFile
"""A safetensors file written tensor by tensor, complete (renamed into place) or absent."""


def checkpoint_names(module: nn.Module, flat) -> tuple[dict[str, str], list[tuple[str, torch.Tensor]]]:
    """What a Hugging Face checkpoint of module holds, as save_pretrained (above) writes it:
    ({layout parameter name: the name it is written under} for every parameter of the engine's
    layout that state_dict() holds (a tied parameter once, under the name Hugging Face keeps),
    [(name, tensor)] for what the module holds whole (persistent buffers, frozen parameters
    outside the layout), in state_dict order)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor):
            groups.setdefault(id(t), ([], t))[0].append(name)
    tied, ignored = _tied_copy_patterns(module), _ignored_on_save(module)
    slot_names = {(u.unit.index, k): slot.name for u in flat.all_units for k, slot in enumerate(u.unit.slots)}
    in_units: dict[str, str] = {}
    held: list[tuple[str, torch.Tensor]] = []
    for names, t in groups.values():
        names = [n for n in names if n not in ignored]
        if not names:
            continue
        name = _kept_name(names, tied)
        place = flat.unit_of.get(t) if isinstance(t, nn.Parameter) else None
        if place is not None:
            in_units[slot_names[place]] = name
        else:
            held.append((name, t))
    return in_units, held


def write_safetensors(f: BinaryIO, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A whole safetensors file of these tensors (in their own dtypes) into the binary file f."""
    items = sorted((_Item(name, tuple(t.shape), t.dtype, k, None, value=t) for k, (name, t) in enumerate(tensors)),
                   key=lambda i: (-i.dtype.itemsize, i.position))
    f.write(_header(tuple(items)))
    for item in items:
        data = item.value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        f.write(memoryview(data.numpy()))


def writable_dtype(dtype: torch.dtype) -> bool:
    """Whether a safetensors file written here can hold this dtype."""
    return dtype in _SAFETENSORS_DTYPE


def plan_files(items: list[_Item], max_shard_bytes: int) -> _Plan:
    """The files one writer writes items into (the same naming and order as save_pretrained)."""
    return _plan(items, 1, max_shard_bytes)


def write_index(directory: str, plan: _Plan) -> None:
    """model.safetensors.index.json of a plan of several files (none for a single file)."""
    if len(plan.files) > 1:
        index = {"metadata": {"total_size": plan.total_size}, "weight_map": dict(sorted(plan.weight_map.items()))}
        text = (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()
        atomic_write(os.path.join(directory, INDEX_FILE), lambda f: f.write(text))
    _fsync_directory(directory)


def remove_stale(directory: str, plan: _Plan) -> None:
    """An earlier export's index, its files this plan does not replace, and leftover temporaries."""
    _remove_stale(directory, plan)


WITH_MODEL = "with_model--"
"""The prefix, in a checkpoint, of the files kept with the model (Engine.files_with_model)."""


def write_files_with_model(directory: str, files: dict[str, bytes]) -> list[str]:
    """The files kept with the model (its tokenizer), each written whole, beside the weights."""
    for name, data in files.items():
        atomic_write(os.path.join(directory, name), lambda f, data=data: f.write(data))
    return sorted(files)


def hf_config_json(module: nn.Module) -> dict | None:
    """{"config": ..., "generation_config": ...} of a Hugging Face model, as plain JSON (the
    config's architectures set to the model's class), so that it can be written as config.json
    without the model's code; None for a model without a Hugging Face config."""
    config = getattr(module, "config", None)
    if config is None or not callable(getattr(config, "to_dict", None)) or peft_model(module):
        return None  # (a PeftModel's names load into no class: it is exported live, peft_export.py)
    to_json = getattr(config, "to_json_string", None)
    try:
        data = json.loads(to_json(use_diff=False)) if callable(to_json) else json.loads(json.dumps(config.to_dict(),
                                                                                                    default=str))
    except (TypeError, ValueError):  # (a config that does not serialize: the checkpoint is saved without it)
        return None
    data["architectures"] = [type(module).__name__]
    out = {"config": data, "generation_config": None}
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", None)
    if generation is not None and callable(can_generate) and can_generate():
        gen_json = getattr(generation, "to_json_string", None)
        if callable(gen_json):
            out["generation_config"] = json.loads(gen_json(use_diff=True))
    return out


def write_hf_config(directory: str, saved: dict, dtype: torch.dtype) -> list[str]:
    """config.json (and generation_config.json) from hf_config_json's output, with the dtype
    written; returns the files written."""
    config = dict(saved["config"])
    config["dtype"] = str(dtype).removeprefix("torch.")
    config.pop("torch_dtype", None)
    written = []
    for name, data in (("config.json", config), ("generation_config.json", saved.get("generation_config"))):
        if data is None:
            continue
        text = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
        atomic_write(os.path.join(directory, name), lambda f, text=text: f.write(text))
        written.append(name)
    return written


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "ExportReport", "StreamedFile", "TensorItem", "checkpoint_names",
           "hf_config_json", "plan_files", "remove_stale", "resolve_dtype", "save_pretrained", "write_hf_config",
           "write_index", "write_safetensors", "writable_dtype"]
