"""Offline export of a sharded checkpoint as a Hugging Face checkpoint: ``tiertrain export``.

One process, no model code, no torch.distributed: the committed step's rank files (every
checksum verified first) are opened memory-mapped with ``torch.load(weights_only=True,
mmap=True)`` and each parameter, in the layout's order, is assembled from its pieces across the
rank files (tiertrain/state/reshard.py finds them from the shard layouts in COMMITTED.json, and joins
the slices of a tensor-parallel one and the stages of a pipeline): trained parameters from the
fp32 masters, frozen ones from their compute-dtype shards. It is cast to
the dtype asked for, written into the safetensors file streaming at that moment (the writer of
tiertrain/state/export.py: same file names, headers, order and index as ``engine.save_pretrained``),
and dropped before the next; the pages of the rank files it was read from are released too
(Linux), so the memory held is about one parameter whatever the model's size.

What the shards do not hold was recorded by ``Engine.save_checkpoint`` beside them:
``export.json`` (the names Hugging Face writes, a tied parameter once; what the module holds
whole), ``held_tensors.safetensors`` (persistent buffers, frozen parameters outside the layout)
and ``hf_config.json`` (the model's Hugging Face config, written out as ``config.json`` so that
``transformers.AutoModel*.from_pretrained(OUT_DIR)`` loads the result). A checkpoint saved
before these existed exports its layout's parameters under their own names, with no config.
"""
from __future__ import annotations

import ctypes
import json
import os
import sys
from dataclasses import dataclass, field

import torch

from ..precision import kept_in_fp32, written_dtype
from . import checkpoint
from .checkpoint import MARKER, CheckpointError, rank_file_name, verified_file
from .export_files import WITH_MODEL, StreamedFile, remove_stale, write_files_with_model, write_hf_config, write_index
from .export_groups import ConvertedValues, converted_items
from .export_plan import DEFAULT_MAX_SHARD_BYTES, STORED_DTYPES, TensorItem, plan_files, resolve_dtype
from .files import _STEP_DIR
from .hf_conversion import meta_model
from .saved_run import global_value, open_saved, opened_files, saved_parameters

EXPORT_INFO = "export.json"
HELD_TENSORS = "held_tensors.safetensors"
HF_CONFIG = "hf_config.json"


@dataclass
class ConsolidateReport:
    """What export_checkpoint wrote."""

    directory: str
    step: int
    dtype: torch.dtype
    files: list[str] = field(default_factory=list)
    """The safetensors files, in order."""
    config_files: list[str] = field(default_factory=list)
    """config.json (and generation_config.json) when the run's model had a Hugging Face config."""
    weight_map: dict[str, str] = field(default_factory=dict)
    tensors: int = 0
    bytes_written: int = 0
    """Tensor bytes written (headers not counted)."""
    total_size: int = 0
    largest_tensor: int = 0
    """The largest tensor written, in bytes (as written)."""
    peak_assembled: int = 0
    """The most bytes of tensors this export allocated at once (one tensor being assembled)."""
    notes: list[str] = field(default_factory=list)


def _step_dir(checkpoint_dir: str, step: int | None) -> tuple[str, dict]:
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointError(f"{checkpoint_dir!r} is not a checkpoint directory: it does not exist "
                              f"or is not a directory")
    if os.path.exists(os.path.join(checkpoint_dir, MARKER)):  # a step directory itself
        with open(os.path.join(checkpoint_dir, MARKER)) as f:
            marker = json.load(f)
        if step is not None and marker["step"] != step:
            raise CheckpointError(f"{checkpoint_dir!r} is the checkpoint of step {marker['step']}, not {step}")
        return checkpoint_dir, marker
    names = os.listdir(checkpoint_dir)
    if not any(_STEP_DIR.match(n) for n in names):
        raise CheckpointError(f"{checkpoint_dir!r} is not a checkpoint directory: it holds no step_NNNNNNNN "
                              f"directory (Engine.save_checkpoint writes them)")
    return checkpoint.find_committed(checkpoint_dir, step)


def _verify(step_dir: str, marker: dict) -> None:
    """Every rank file and every extra file, against the sha256 committed."""
    expected = {rank_file_name(r): d for r, d in enumerate(marker["sha256"])}
    expected.update(marker.get("files") or {})
    for name, digest in expected.items():
        verified_file(step_dir, name, digest)


_libc = None


def _release_file_pages(paths: set[str]) -> None:
    """Drop this process's mapped pages of these files (memory-mapped by torch.load, only ever
    read: clean pages, read again from the file if touched again), so that what was read for
    one tensor (and what the kernel mapped around it) does not stay resident. Linux only (the
    mappings are found in /proc/self/maps); elsewhere a no-op."""
    global _libc
    if not paths or not sys.platform.startswith("linux"):
        return
    try:
        with open("/proc/self/maps") as f:
            lines = f.read().splitlines()
        if _libc is None:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    except OSError:
        return
    for line in lines:
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] in paths:
            lo, hi = (int(x, 16) for x in fields[0].split("-"))
            _libc.madvise(lo, hi - lo, 4)  # MADV_DONTNEED


class _HeldTensors:
    """The checkpoint's held_tensors.safetensors, read through the safetensors library, which
    checks the header against the file (offsets inside the data, each tensor's bytes matching
    its dtype and shape) before anything is read: a header claiming more bytes than the file
    holds would otherwise hand back whatever memory follows."""

    def __init__(self, path: str):
        from safetensors import SafetensorError, safe_open

        self.path = path
        self._error = SafetensorError
        try:
            self._file = safe_open(path, framework="pt", device="cpu")
            self.names = set(self._file.keys())
        except (SafetensorError, OSError) as e:
            raise CheckpointError(f"{path!r} is not a valid safetensors file: {e}") from None

    def entry(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if name not in self.names:
            raise CheckpointError(f"{self.path!r} does not hold {name!r}, which the checkpoint's export names list")
        piece = self._file.get_slice(name)
        dtype = STORED_DTYPES.get(piece.get_dtype())
        if dtype is None:
            raise CheckpointError(f"{self.path!r}: {name!r} has dtype {piece.get_dtype()!r}; expected one of "
                                  f"{sorted(STORED_DTYPES)}")
        return dtype, tuple(piece.get_shape())

    def read(self, name: str) -> torch.Tensor:
        try:
            return self._file.get_tensor(name)
        except self._error as e:
            raise CheckpointError(f"{self.path!r}: {name!r} cannot be read: {e}") from None


FORMATS = ("hf", "safetensors")
"""What export_checkpoint writes: "hf", a directory from_pretrained loads (the safetensors files,
the index, config.json; the run's model must have had a Hugging Face config), or "safetensors",
the tensors alone (files and index, no config)."""


def export_checkpoint(checkpoint_dir: str | os.PathLike, out_dir: str | os.PathLike, step: int | None = None,
                      dtype: torch.dtype | str | None = None,
                      max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES, format: str | None = None) -> ConsolidateReport:
    """Write the newest (or the given) committed checkpoint in checkpoint_dir as a Hugging Face
    checkpoint in out_dir (safetensors files, the index when there are several, config.json when
    the run's model had a Hugging Face config), floating-point tensors in dtype (fp32 default).
    format: one of FORMATS (default: "hf" when the run's model had a Hugging Face config, else
    "safetensors"). See the module docstring. Errors: CheckpointError (no checkpoint, a corrupt
    or missing file, a layout it cannot export, "hf" without a config), ValueError (dtype,
    max_shard_bytes, format)."""
    if format is not None and format not in FORMATS:
        raise ValueError(f"format={format!r} is invalid: expected one of {list(FORMATS)}")
    target = resolve_dtype(dtype, what="tiertrain export")
    if isinstance(max_shard_bytes, bool) or not isinstance(max_shard_bytes, int) or max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes must be a positive number of bytes, got {max_shard_bytes!r}")
    if sys.byteorder != "little":
        raise NotImplementedError("safetensors files are little-endian; this machine is not")
    checkpoint_dir, out_dir = os.fspath(checkpoint_dir), os.fspath(out_dir)
    step_dir, marker = _step_dir(checkpoint_dir, step)
    with checkpoint.interpreting(step_dir):  # (a marker or file changed after it was written: named)
        return _export(step_dir, marker, out_dir, target, max_shard_bytes, format)


def _export(step_dir: str, marker: dict, out_dir: str, target: torch.dtype, max_shard_bytes: int,
            format: str | None) -> ConsolidateReport:
    if marker.get("shards") is None:
        raise CheckpointError(f"{step_dir!r} records no shard layout (saved before resharding existed); "
                              f"it cannot be exported offline")
    _verify(step_dir, marker)
    run = open_saved(step_dir, marker, verified=True)
    has_config = HF_CONFIG in (marker.get("files") or {})
    if format == "hf" and not has_config:
        raise CheckpointError(f"{step_dir!r} holds no Hugging Face config (the run's model had none), so it "
                              f"cannot be exported as a from_pretrained directory; use format 'safetensors'")
    report = ConsolidateReport(out_dir, marker["step"], target)
    extra_files = marker.get("files") or {}

    info = None
    if EXPORT_INFO in extra_files:
        with open(os.path.join(step_dir, EXPORT_INFO)) as f:
            info = json.load(f)
    else:
        report.notes.append("the checkpoint records no export names (saved by an older version): parameters are "
                            "written under their own names, without buffers or config")

    # What to write, in the model's order: the layout's parameters (trained, then frozen
    # units; at any tensor- or pipeline-parallel layout, whole: saved_run.global_value), then
    # what the module held whole.
    hf_model = None
    if HF_CONFIG in extra_files and info is not None:  # (the run's names are the model's: convert as it saves)
        with open(os.path.join(step_dir, HF_CONFIG)) as f:
            hf_model = meta_model(json.load(f))
    # (what the model keeps in fp32 in fp32, as save_pretrained writes it: a router's weight, its bias)
    fp32 = kept_in_fp32(hf_model, target) if hf_model is not None else None
    items: list[TensorItem] = []
    sources: dict[str, tuple] = {}
    for kind, layout_name, shape in saved_parameters(run):
        name = layout_name if info is None else info["names"].get(layout_name)
        if name is None:
            continue
        item = TensorItem(name, tuple(shape), written_dtype(fp32, layout_name, target), len(items), None)
        sources[item.name] = ("param", kind, layout_name)
        items.append(item)
    held = None
    if info is not None and info.get("held") and HELD_TENSORS in extra_files:
        held = _HeldTensors(os.path.join(step_dir, HELD_TENSORS))
        for name in info["held"]:
            saved, shape = held.entry(name)
            dtype = written_dtype(fp32, name, target) if saved.is_floating_point else saved
            item = TensorItem(name, shape, dtype, len(items), None)
            sources[item.name] = ("held", name)
            items.append(item)

    def assemble_one(item: TensorItem) -> torch.Tensor:
        source = sources[(item.members[0] if item.members else item).name]  # (by the model's name)
        if source[0] == "held":
            return held.read(source[1]).to(item.dtype)
        _, kind, layout_name = source
        value = global_value(run, kind, layout_name)
        report.peak_assembled = max(report.peak_assembled, value.numel() * value.element_size())
        out = value.to(item.dtype)
        del value
        _release_file_pages({os.path.realpath(path) for path in opened_files(run)})
        return out.view(item.shape)

    if hf_model is not None:
        items = converted_items(hf_model, items)
        converted = ConvertedValues(hf_model, items, assemble_one)
    assemble = (lambda item: assemble_one(item) if item.group is None else converted(item).to(item.dtype))

    plan = plan_files(items, max_shard_bytes)
    report.files = [f.name for f in plan.files]
    report.weight_map = plan.weight_map
    report.total_size = plan.total_size
    os.makedirs(out_dir, exist_ok=True)
    remove_stale(out_dir, plan)
    if HF_CONFIG in extra_files and format != "safetensors":
        with open(os.path.join(step_dir, HF_CONFIG)) as f:
            report.config_files = write_hf_config(out_dir, json.load(f), target)
        kept = {}
        for name in sorted(n for n in extra_files if n.startswith(WITH_MODEL)):
            with open(os.path.join(step_dir, name), "rb") as f:
                kept[name.removeprefix(WITH_MODEL)] = f.read()
        report.config_files += write_files_with_model(out_dir, kept)
    with torch.no_grad():
        for spec in plan.files:
            writer = StreamedFile(out_dir, spec)
            try:
                for item in spec.items:
                    value = assemble(item)
                    if item.dtype.is_floating_point:
                        report.peak_assembled = max(report.peak_assembled, value.numel() * value.element_size())
                    report.bytes_written += writer.write(item, value)
                    report.tensors += 1
                    report.largest_tensor = max(report.largest_tensor, item.nbytes)
                    del value  # (dropped before the next tensor is assembled)
                writer.commit()
            except BaseException:
                writer.abort()
                raise
    write_index(out_dir, plan)
    run.states.clear()
    return report


__all__ = ["ConsolidateReport", "export_checkpoint", "FORMATS"]
