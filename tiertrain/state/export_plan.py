"""The plan of a Hugging Face checkpoint, decided on every rank from the layout and the module
alone (names, shapes, dtypes; no values): the tensors and the names they are written under
(the ones Hugging Face keeps), which rank writes each, and the safetensors files' names.
tiertrain/state/export.py (the live export) and tiertrain/state/consolidate.py (the offline
one) write what it plans, through tiertrain/state/export_files.py.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from ..precision import kept_in_fp32, written_dtype
from .export_groups import converted_items
from .hf_conversion import SaveGroup
from ..zero.layout import Slot

if TYPE_CHECKING:
    from ..engine import Engine

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
SHARD_NAME = "model-{k:05d}-of-{n:05d}.safetensors"

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


STORED_DTYPES = {**{name: dtype for dtype, name in _SAFETENSORS_DTYPE.items()}, "F8_E4M3": torch.float8_e4m3fn,
                 "F8_E5M2": torch.float8_e5m2, "F8_E8M0": torch.float8_e8m0fnu}
"""The dtypes of a safetensors header, by its names (those written, and the fp8 ones
quantised checkpoints hold)."""


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
    element size), then the model's order (written as the units are gathered, each at its offset)."""


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
    source = engine.source_model() if hasattr(engine, "source_model") else None
    model = engine.module if source is None else source[0]  # (a pipeline's: the model its stages were cut from)
    names, held = {}, []
    for module in ([engine.module] if source is None else engine.stages):
        found, whole = checkpoint_names(module, flat, like=model)
        names.update(found)
        held += whole
    if source is not None:  # the last stage's copy of a tied embedding: written once, as the embedding
        names = {k: v for k, v in names.items() if k not in source[1]}
    trained_outside = [name for name, t in held if isinstance(t, nn.Parameter) and t.requires_grad]
    if trained_outside:
        raise RuntimeError(f"save_pretrained: trained parameter {trained_outside[0]!r} is not in the engine's layout")
    # What the model keeps in fp32 (an MoE router's weight, trained from its fp32 master; its
    # correction bias, held) is written in fp32, as its own save_pretrained writes it.
    fp32 = kept_in_fp32(model, dtype)
    items: list[_Item] = []
    for u in flat.all_units:
        for slot in u.unit.slots:
            name = names.get(slot.name)
            if name is not None:
                items.append(_Item(name, slot.shape, written_dtype(fp32, slot.name, dtype), len(items), u.unit.index,
                                   slot=slot))
    for name, t in held:
        if t.dtype not in _SAFETENSORS_DTYPE:
            raise TypeError(f"save_pretrained: {name!r} is {t.dtype}, which this export does not write "
                            f"(supported: {sorted(str(d) for d in _SAFETENSORS_DTYPE)})")
        written = written_dtype(fp32, name, dtype) if t.is_floating_point() else t.dtype
        items.append(_Item(name, tuple(t.shape), written, len(items), None, value=t))
    return converted_items(model, items)


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


# -- reusable pieces (the offline export, tiertrain/state/consolidate.py) --------------------------------

TensorItem = _Item
"""One tensor of a checkpoint to write: name, shape, dtype as written, position in the model's
order; for an offline writer, unit=None and value=None (the value is handed to write())."""


def checkpoint_names(module: nn.Module, flat, like: nn.Module | None = None
                     ) -> tuple[dict[str, str], list[tuple[str, torch.Tensor]]]:
    """What a Hugging Face checkpoint of module holds, as save_pretrained (export.py) writes it:
    ({layout parameter name: the name it is written under} for every parameter of the engine's
    layout that state_dict() holds (a tied parameter once, under the name Hugging Face keeps),
    [(name, tensor)] for what the module holds whole (persistent buffers, frozen parameters
    outside the layout), in state_dict order). like: the model whose declared tied copies and
    names ignored on save apply (a pipeline stage's: the model it was cut from)."""
    groups: dict[int, tuple[list[str], torch.Tensor]] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        if isinstance(t, torch.Tensor):
            groups.setdefault(id(t), ([], t))[0].append(name)
    tied, ignored = _tied_copy_patterns(like or module), _ignored_on_save(like or module)
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


def writable_dtype(dtype: torch.dtype) -> bool:
    """Whether a safetensors file written here can hold this dtype."""
    return dtype in _SAFETENSORS_DTYPE


def plan_files(items: list[_Item], max_shard_bytes: int) -> _Plan:
    """The files one writer writes items into (the same naming and order as save_pretrained)."""
    return _plan(items, 1, max_shard_bytes)


__all__ = ["DEFAULT_MAX_SHARD_BYTES", "DTYPES", "INDEX_FILE", "SHARD_NAME", "SINGLE_FILE", "TensorItem",
           "checkpoint_names", "plan_files", "resolve_dtype", "writable_dtype"]
