"""Writing a Hugging Face checkpoint's files: a safetensors file streamed tensor by tensor
(complete or absent), a whole one, the index, config.json and the files kept with the model,
and an earlier export's leftovers removed; for the live export (tiertrain/state/export.py) and
the offline one (tiertrain/state/consolidate.py), as tiertrain/state/export_plan.py plans them.
"""
from __future__ import annotations

import copy
import json
import os
import re
import struct
from typing import BinaryIO

import torch
import torch.nn as nn

from ..io.fileio import atomic_write, temporary_beside
from .export_plan import _SAFETENSORS_DTYPE, INDEX_FILE, SINGLE_FILE, _File, _Item, _Plan
from .peft_export import peft_model

_SHARD_PATTERN = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_TEMP_SUFFIX = ".export.tmp"


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
    each tensor at its own offset, in whatever order the values come (a file may hold units'
    tensors of two dtypes: the model's fp32 router weights among bf16 ones, each dtype in the
    units' order). Complete or absent (fileio.atomic_write's protocol: a temporary file beside
    the target, fsynced, renamed over it; removed on failure), but kept open across the units'
    gathers, which atomic_write's single callback cannot be."""

    def __init__(self, directory: str, spec: _File):
        self.spec = spec
        self.path = os.path.join(directory, spec.name)
        fd, self.tmp = temporary_beside(directory, f".{spec.name}.", _TEMP_SUFFIX)
        self.f: BinaryIO = os.fdopen(fd, "wb")
        header = _header(spec.items)
        self.offsets: dict[int, int] = {}
        """Where each item's bytes start in the file, by id(item)."""
        offset = len(header)
        for item in spec.items:
            self.offsets[id(item)] = offset
            offset += item.nbytes
        self.unwritten: dict[int, _Item] = {id(item): item for item in spec.items}
        """By id(item), in offset order."""
        try:
            self.f.write(header)
        except BaseException:
            self.abort()
            raise

    @property
    def pending(self) -> _Item | None:
        """The first tensor (in offset order) not written yet; None once the file is complete."""
        return next(iter(self.unwritten.values()), None)

    def write(self, item: _Item, value: torch.Tensor) -> int:
        """Write item's value (in item.dtype, on the CPU) at its offset; returns the bytes written."""
        if self.unwritten.get(id(item)) is not item:
            raise RuntimeError(f"save_pretrained: internal error: {item.name} is not a tensor still to write in "
                               f"{self.spec.name}")
        if tuple(value.shape) != item.shape or value.dtype != item.dtype:
            raise RuntimeError(f"save_pretrained: internal error: {item.name} is {tuple(value.shape)} {value.dtype}, "
                               f"planned {item.shape} {item.dtype}")
        data = value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        if self.f.tell() != self.offsets[id(item)]:  # (in order, the writes stay buffered)
            self.f.seek(self.offsets[id(item)])
        self.f.write(memoryview(data.numpy()))
        del self.unwritten[id(item)]
        return item.nbytes

    def commit(self) -> None:
        if self.unwritten:
            raise RuntimeError(f"save_pretrained: internal error: {self.spec.name} committed without "
                               f"{self.pending.name}")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        self.f.close()
        if os.path.exists(self.tmp):
            os.unlink(self.tmp)


# -- the directory: config, leftovers of an earlier export, durable renames -------------------------


UNQUANTISED = "quantization_config"
"""The config entry an export leaves out: it writes the weights unquantised, in the dtype asked
(a model loaded from a block-FP8 checkpoint, tiertrain/state/quantized.py, keeps its
quantization_config, and from_pretrained on a GPU would read bf16 weights as FP8 ones)."""


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
    if hasattr(config, UNQUANTISED):
        delattr(config, UNQUANTISED)
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


# -- reusable pieces (the offline export, tiertrain/state/consolidate.py) --------------------------------

StreamedFile = _StreamedFile
"""A safetensors file written tensor by tensor, complete (renamed into place) or absent."""


def write_safetensors(f: BinaryIO, tensors: list[tuple[str, torch.Tensor]]) -> None:
    """A whole safetensors file of these tensors (in their own dtypes) into the binary file f."""
    items = sorted((_Item(name, tuple(t.shape), t.dtype, k, None, value=t) for k, (name, t) in enumerate(tensors)),
                   key=lambda i: (-i.dtype.itemsize, i.position))
    f.write(_header(tuple(items)))
    for item in items:
        data = item.value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
        f.write(memoryview(data.numpy()))


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
    config.pop(UNQUANTISED, None)
    written = []
    for name, data in (("config.json", config), ("generation_config.json", saved.get("generation_config"))):
        if data is None:
            continue
        text = (json.dumps(data, indent=2, sort_keys=True) + "\n").encode()
        atomic_write(os.path.join(directory, name), lambda f, text=text: f.write(text))
        written.append(name)
    return written


__all__ = ["StreamedFile", "WITH_MODEL", "hf_config_json", "remove_stale", "write_files_with_model",
           "write_hf_config", "write_index", "write_safetensors"]
