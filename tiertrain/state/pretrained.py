"""Pretrained weights from a Hugging Face safetensors checkpoint into any form of model, with
bounded memory: ``tiertrain.load_pretrained(target, path)``.

ZeRO-Infinity §5.3 ("ease of use") asks that a model too large for one rank can be built
partitioned (:func:`tiertrain.partitioned_init`) and trained without code changes; a model
that large must also be *loadable* without ever existing whole on a rank. So every rank reads
from the checkpoint only the part it keeps:

* an :class:`~tiertrain.Engine` (any ZeRO stage and tier): for each partitioned unit, only the
  rows of each tensor that overlap this rank's shard (``safe_open(...).get_slice(name)[a:b]``
  reads just those bytes of the memory-mapped file), written into the compute shard and,
  cast to fp32 from the checkpoint's own values, into the master copy; resident units (stages
  0-2, stage 3's persistent parameters), which every rank holds whole, read whole tensors,
  one at a time;
* a model built under :func:`tiertrain.partitioned_init` and not yet wrapped: each parameter's
  1/dp flat shard, from the rows that hold it;
* a plain module: whole tensors, one at a time;
* a :class:`~tiertrain.pipeline.engine.PipelineEngine` of a Hugging Face model: the tensors of
  this rank's stages, as an Engine's, by the names of the model they were cut from (every rank
  checks the checkpoint against the whole model; a tied head's copy on the last stage reads the
  embedding's tensor), the other stages' never read. With the model built on the meta device
  (tiertrain/pipeline/materialize.py) no rank holds more than its stages.

No rank ever holds more than one tensor's read on top of the model (one unit's shard more
when the shard or the master lives on NVMe, whose files are written whole), and the load
itself needs no communication: each rank reads its own slices from the shared files (an
engine first completes an update still in flight, as any engine operation does). Names are matched as Hugging
Face matches them: a parameter shared under several names (tied embeddings) is found under
any of them, a checkpoint of the base model loads into a model with a head (or the
reverse) through ``base_model_prefix``, and a family whose checkpoints transformers converts
(experts stored one tensor each, stacked in memory; renamed layers) is read through
transformers' own conversion (tiertrain/state/hf_conversion.py): a converted tensor is read whole
by each rank that keeps part of it, one conversion group at a time.
"""
from __future__ import annotations

import json
import math
import os
import re
import warnings
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..engine import Engine
from ..errors import TiertrainError
from ..io.fileio import unreadable_file
from .export_plan import STORED_DTYPES
from .hf_conversion import ConvertedCheckpoint, checkpoint_view
from .quantized import QuantizedCheckpointError, dequantized
from .torch_weights import (TORCH_INDEX, TORCH_SINGLE, TorchWeights, UnwrappedNames, WeightReads, is_torch_file,
                            unwrapped)
from ..topology import Topology, default_device
from ..unit_values import write_into_units
from ..zero.construct import full_shape, is_partitioned

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class PretrainedMismatchError(TiertrainError, ValueError):
    """The checkpoint does not fit the model: tensors missing, unexpected, or of another shape.
    Raised before anything is written, on every rank alike (each checks the same headers), so
    the model is left as it was and no rank is left waiting in a collective."""


class NonFiniteWeightsError(TiertrainError, ValueError):
    """The checkpoint's parameters hold inf or NaN: raised on every rank once the load is done
    (each rank reads its own part), naming the tensors on the rank that read them."""


class PretrainedMissingWarning(UserWarning):
    """load_pretrained(strict=False) left model tensors at their initial values (named)."""


@dataclass
class LoadReport:
    """What one rank read. Under an engine at stage 3 each rank reads about 1/dp of the
    checkpoint; ``largest_read`` bounds the extra memory the load needed."""

    loaded: list[str] = field(default_factory=list)
    """Model tensors (canonical parameter names, then buffers) given checkpoint values."""
    missing: list[str] = field(default_factory=list)
    """Model tensors the checkpoint has no value for (kept as they were; strict=True raises)."""
    unexpected: list[str] = field(default_factory=list)
    """Checkpoint tensors with no place in the model (strict=True raises)."""
    ignored: list[str] = field(default_factory=list)
    """Checkpoint or model names skipped by design: further aliases of a tied tensor, values of
    non-persistent buffers, names the model class declares ignorable
    (``_keys_to_ignore_on_load_unexpected`` / ``_missing``), and a head's tensors when the
    checkpoint of a model with a head is loaded into its base model."""
    name_mapping: str = "as is"
    """How model names map to checkpoint names: 'as is', 'with prefix P.' (a checkpoint of the
    model with a head, into its base model) or 'without prefix P.' (the reverse)."""
    conversion: str = "none"
    """The checkpoint conversion applied (transformers' mapping of the model's family: experts
    stacked, layers renamed), or 'none' when the checkpoint holds the model's own names."""
    files: list[str] = field(default_factory=list)
    """The weight files of the checkpoint (safetensors, or torch.save's: torch_weights.py)."""
    unwrapped: list[str] = field(default_factory=list)
    """The wrappers' parts taken off the checkpoint's names (``module. in front``, ``_orig_mod``,
    ...: torch_weights.UnwrappedNames), or none."""
    nonfinite: dict[str, int] = field(default_factory=dict)
    """Checkpoint tensors holding inf or NaN in what this rank read, with how many values
    (load_pretrained raises NonFiniteWeightsError naming those of parameters)."""
    bytes_read: int = 0
    """Bytes this rank read from the checkpoint (in the file's dtype)."""
    largest_read: int = 0
    """The largest single read, in bytes: at most one whole tensor, whatever the model's size."""
    reads: int = 0
    """How many reads (slices or whole tensors) this rank made."""


# -- the checkpoint --------------------------------------------------------------------------------


def _weight_file(path: str) -> bool:
    """Whether path is there; ValueError naming it when it is there but cannot be read."""
    if not os.path.lexists(path):
        return False
    problem = unreadable_file(path)
    if problem:
        raise ValueError(f"load_pretrained: {path!r} is {problem}; expected the safetensors weights "
                         f"save_pretrained writes")
    return True


def _indexed_files(path: str, index: str) -> list[str]:
    """The shard files a Hugging Face index (``{"weight_map": {tensor: file}}``) lists."""
    with open(index) as f:
        weight_map = json.load(f).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ValueError(f"load_pretrained: {index!r} has no 'weight_map' (expected {{tensor name: shard file}})")
    names = sorted(set(weight_map.values()))
    absent = [n for n in names if not _weight_file(os.path.join(path, n))]
    if absent:
        raise FileNotFoundError(f"load_pretrained: {index!r} lists shard files missing from {path!r}: "
                                f"{_listing(absent)}")
    return [os.path.join(path, n) for n in names]


def checkpoint_files(path: str | os.PathLike) -> list[str]:
    """The weight files of a checkpoint: ``path`` itself when it is a .safetensors file or a
    torch.save file (.bin, .pt, .pth: tiertrain/state/torch_weights.py); in a directory, the
    shards its ``model.safetensors.index.json`` lists, else ``model.safetensors``, else the
    same of ``pytorch_model.bin`` (safetensors first, as transformers prefers them)."""
    path = os.fspath(path)
    if os.path.isfile(path):
        if not path.endswith(".safetensors") and not is_torch_file(path):
            raise ValueError(f"load_pretrained: {path!r} is neither a .safetensors file nor a torch.save file (.bin, "
                             f".pt, .pth); give one, or a Hugging Face checkpoint directory (with {SINGLE_FILE}, "
                             f"{INDEX_FILE}, {TORCH_SINGLE} or {TORCH_INDEX})")
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"load_pretrained: {path!r} does not exist; expected a Hugging Face checkpoint "
                                f"directory (with {SINGLE_FILE}, or {INDEX_FILE} and its shards) or a weights file")
    for index, single in ((INDEX_FILE, SINGLE_FILE), (TORCH_INDEX, TORCH_SINGLE)):
        if _weight_file(os.path.join(path, index)):
            return _indexed_files(path, os.path.join(path, index))
        if _weight_file(os.path.join(path, single)):
            return [os.path.join(path, single)]
    present = sorted(os.listdir(path))
    raise FileNotFoundError(f"load_pretrained: no {SINGLE_FILE}, {INDEX_FILE}, {TORCH_SINGLE} or {TORCH_INDEX} in "
                            f"{path!r} (it holds {_listing(present) if present else 'nothing'}); expected a Hugging "
                            f"Face checkpoint saved with save_pretrained")


class _Checkpoint(WeightReads):
    """The open safetensors files (memory-mapped: only the bytes read are touched) and the
    accounting of what was read."""

    def __init__(self, files: list[str], stack: ExitStack, report: LoadReport):
        from safetensors import SafetensorError, safe_open

        super().__init__(report)
        self._handle: dict[str, Any] = {}
        for path in files:
            try:  # (the library checks the header against the file: offsets, dtypes, shapes)
                handle = stack.enter_context(safe_open(path, framework="pt", device="cpu"))
            except (SafetensorError, OSError) as e:
                raise ValueError(f"load_pretrained: {path!r} is not a valid safetensors file: {e}") from None
            for key in handle.keys():
                self._place(key, path)
                self._handle[key] = handle

    def keys(self) -> list[str]:
        return list(self._handle)

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle[key].get_slice(key).get_shape())

    def stored_dtype(self, key: str) -> torch.dtype:
        """The tensor's dtype in the file (uint8 for a packed type torch has no dtype of)."""
        return STORED_DTYPES.get(self._handle[key].get_slice(key).get_dtype(), torch.uint8)

    def read(self, key: str) -> torch.Tensor:
        """The whole tensor."""
        return self._count(self._handle[key].get_tensor(key), key)

    def _rows(self, key: str, r0: int, r1: int) -> torch.Tensor:
        return self._handle[key].get_slice(key)[r0:r1]


# -- the model's tensors and their checkpoint names ----------------------------------------------


@dataclass
class _Target:
    """One model tensor (a Parameter or a persistent buffer) under all its names."""

    aliases: tuple[str, ...]
    tensor: torch.Tensor
    shape: tuple[int, ...]
    is_param: bool
    key: str | None = None  # its checkpoint name, once matched

    @property
    def name(self) -> str:
        return self.aliases[0]  # the name named_parameters() (deduplicated) gives, as the layout's


def _targets(module: nn.Module, copies: dict[str, str] | None = None) -> tuple[list[_Target], set[str]]:
    """The model's parameters and persistent buffers, grouped by identity (a tied tensor once,
    under every name), and the names of its non-persistent buffers. copies: a pipeline's copy
    of a tied weight (its name → the weight's), grouped with the weight it copies."""
    groups: dict[int, _Target] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        if id(p) in groups:
            groups[id(p)].aliases += (name,)
        else:
            groups[id(p)] = _Target((name,), p, tuple(full_shape(p)), True)
    persistent = set(module.state_dict(keep_vars=True))
    transient = set()
    for name, b in module.named_buffers(remove_duplicate=False):
        if name not in persistent:
            transient.add(name)
        elif id(b) in groups:
            groups[id(b)].aliases += (name,)
        else:
            groups[id(b)] = _Target((name,), b, tuple(b.shape), False)
    by_name = {a: t for t in groups.values() for a in t.aliases}
    for copy, weight in (copies or {}).items():
        if by_name[copy] is not by_name[weight]:
            by_name[weight].aliases += by_name[copy].aliases
            del groups[id(by_name[copy].tensor)]
    return list(groups.values()), transient


def _patterns(module: nn.Module, attribute: str) -> list[re.Pattern]:
    """Hugging Face's per-class lists of names to ignore (regular expressions)."""
    value = getattr(module, attribute, None) or ()
    return [re.compile(p) for p in value if isinstance(p, str)]


def _name_maps(module: nn.Module) -> list[tuple[str, Callable[[str], str]]]:
    """Candidate maps from model names to checkpoint names: as is; and for a Hugging Face
    model, with its base_model_prefix added (the checkpoint is of the model with a head,
    loaded into the base model) or removed (a checkpoint of the base model, into a model with
    a head: the head's own names stay as they are)."""
    maps: list[tuple[str, Callable[[str], str]]] = [("as is", lambda n: n)]
    prefix = getattr(module, "base_model_prefix", "")
    if isinstance(prefix, str) and prefix:
        dot = prefix + "."
        maps.append((f"with prefix {dot}", lambda n: dot + n))
        maps.append((f"without prefix {dot}", lambda n: n[len(dot):] if n.startswith(dot) else n))
    return maps


def _match(module: nn.Module, ckpt: _Checkpoint, strict: bool, report: LoadReport,
           copies: dict[str, str] | None = None) -> list[_Target]:
    """Pair each model tensor with its checkpoint name; check shapes; raise (strict) on
    missing or unexpected tensors, always on a shape mismatch, before anything is read.
    copies: as for _targets."""
    targets, transient = _targets(module, copies)
    keys = set(ckpt.keys())
    maps = _name_maps(module)

    def found(to_key) -> int:
        return sum(any(to_key(a) in keys for a in t.aliases) for t in targets)

    label, to_key = max(maps, key=lambda m: found(m[1]))  # (max keeps the first of equals: as is)
    report.name_mapping = label
    consumed: set[str] = set()
    untied = []
    counted = dict(report.nonfinite)  # (the tied copies compared below are read again when loaded)
    for t in targets:
        matches = [to_key(a) for a in t.aliases if to_key(a) in keys]
        if matches:
            t.key = matches[0]
            consumed.update(matches)
            report.ignored += matches[1:]  # the same tensor again, under a tied name
            untied += [f"{t.key} and {other}" for other in matches[1:] if not _same_values(ckpt, t.key, other)]
    report.nonfinite = counted
    ignore_unexpected = _patterns(module, "_keys_to_ignore_on_load_unexpected")
    ignore_missing = _patterns(module, "_keys_to_ignore_on_load_missing")
    transient_keys = {to_key(n) for n in transient}
    outside_base = label.startswith("with prefix")  # a head's tensors, for a base model
    dot = label.rsplit(" ", 1)[-1]
    for key in sorted(keys - consumed):
        if key in transient_keys or any(p.search(key) for p in ignore_unexpected) or (
                outside_base and not key.startswith(dot)):
            report.ignored.append(key)
        else:
            report.unexpected.append(key)
    for t in targets:
        if t.key is None:
            if any(p.search(a) for p in ignore_missing for a in t.aliases):
                report.ignored.append(t.name)
            else:
                report.missing.append(t.name)
    problems = []
    if strict and report.missing:
        problems.append(f"missing from the checkpoint ({len(report.missing)}): {_listing(report.missing)}")
    if strict and report.unexpected:
        problems.append(f"in the checkpoint but not in the model ({len(report.unexpected)}): "
                        f"{_listing(report.unexpected)}")
    mismatched = [f"{t.name} (checkpoint {t.key!r}): checkpoint {ckpt.shape(t.key)}, model {t.shape}"
                  for t in targets if t.key is not None and ckpt.shape(t.key) != t.shape]
    if mismatched:
        problems.append(f"shapes differ ({len(mismatched)}): {_listing(mismatched)}")
    if untied:
        problems.append(f"tensors this model ties (one parameter under several names) hold different values in the "
                        f"checkpoint ({_listing(untied)}): it was trained untied; build the model untied (for a "
                        f"Hugging Face model, tie_word_embeddings=False in its config, as transformers unties it "
                        f"for this checkpoint)")
    if problems:
        hint = " (pass strict=False to load the tensors that do match)" if not (mismatched or untied) else ""
        raise PretrainedMismatchError(
            f"load_pretrained: the checkpoint {_listing(report.files, 3)} does not fit this "
            f"{type(module).__name__} (model names mapped to checkpoint names {label}): "
            + "; ".join(problems) + hint)
    return [t for t in targets if t.key is not None]


def _same_values(ckpt, a: str, b: str, chunk: int = 1 << 24) -> bool:
    """Whether checkpoint tensors a and b hold the same bits (a NaN in both copies is the same
    value, for the non-finite check to name), compared a chunk of elements at a time."""
    shape = ckpt.shape(a)
    if ckpt.shape(b) != shape:
        return False
    numel = math.prod(shape)

    def bits(key: str, lo: int) -> torch.Tensor:
        return ckpt.read_flat(key, shape, lo, min(lo + chunk, numel)).view(torch.uint8)
    return all(torch.equal(bits(a, lo), bits(b, lo)) for lo in range(0, numel, chunk))


def _listing(names: list[str], limit: int = 20) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", … and {len(names) - limit} more" if len(names) > limit else "")


# -- writing ---------------------------------------------------------------------------------------


def load_pretrained(target: Engine | nn.Module, path: str | os.PathLike, strict: bool = True, *,
                    topology: Topology | None = None) -> LoadReport:
    """Load a Hugging Face safetensors checkpoint (a directory with ``model.safetensors``, or
    sharded ``model-0000i-of-0000n.safetensors`` with ``model.safetensors.index.json``; or a
    single ``.safetensors`` file), or one torch.save wrote (``pytorch_model.bin``, sharded or
    not; a script's ``torch.save(model.state_dict(), path)``, also of a DDP-, compile- or
    FSDP1-wrapped model: tiertrain/state/torch_weights.py) into ``target``, reading on each rank only what that rank
    keeps (see the module docstring), and return what this rank read.

    target: an Engine or a PipelineEngine (tiertrain.wrap; every rank calls this, as for any
    engine operation: an update still in flight is completed first), a model built under
    :func:`tiertrain.partitioned_init` and not yet wrapped (``topology``: the one it was built
    with; default: all ranks of torch.distributed as the data-parallel group), or a plain
    module. After loading, an engine's compute shards hold the values in the compute dtype
    and its fp32 masters hold them cast from the checkpoint's own values; optimizer state is
    left as it was (load before training).

    strict: raise :class:`PretrainedMismatchError` when a model tensor has no checkpoint value
    or a checkpoint tensor has no place in the model (besides tied aliases and names the
    model declares ignorable); otherwise keep such model tensors unchanged and report them.
    A tensor of another shape always raises; another dtype is cast.

    Quantised checkpoints (tiertrain/state/quantized.py): block-FP8 weights (config.json's
    ``quantization_config`` ``quant_method: "fp8"``, each weight beside its
    ``weight_scale_inv``, as DeepSeek-V3 and Qwen3-FP8 ship) are read dequantised, the product
    of each block's values and scale; any other quantisation raises
    :class:`QuantizedCheckpointError` before anything is read, naming the method. Inf or NaN
    read into a parameter raises :class:`NonFiniteWeightsError` once the load is done, on every
    rank that shares it; tensors this model ties that the checkpoint holds with different
    values raise PretrainedMismatchError (build the model untied).
    """
    from ..pipeline.engine import PipelineEngine

    pipeline = isinstance(target, PipelineEngine)
    if (isinstance(target, Engine) or pipeline) and target.closed:
        raise ValueError("load_pretrained: the engine is closed; load into engine.module, now a plain module")
    if pipeline:
        module, copies = _whole_model(target)
    else:
        module, copies = (target.module if isinstance(target, Engine) else target), None
    if not isinstance(module, nn.Module):
        raise TypeError(f"load_pretrained: target must be a tiertrain Engine or an nn.Module, "
                        f"got {type(target).__name__}")
    report = LoadReport(files=checkpoint_files(path))
    with ExitStack() as stack, torch.no_grad():
        safetensors = all(f.endswith(".safetensors") for f in report.files)
        raw = _Checkpoint(report.files, stack, report) if safetensors else TorchWeights(report.files, report)
        raw = dequantized(raw, report.files)
        raw = unwrapped(raw, {n for n, _ in module.named_parameters(remove_duplicate=False)}
                        | set(module.state_dict(keep_vars=True)))
        if isinstance(raw, UnwrappedNames):
            report.unwrapped = raw.removed
        ckpt = checkpoint_view(raw, module)
        if isinstance(ckpt, ConvertedCheckpoint):
            report.conversion = (f"transformers' checkpoint conversion of {type(module).__name__}: "
                                 f"{ckpt.converted_count} tensors converted, {ckpt.renamed_count} renamed")
        matched = _match(module, ckpt, strict, report, copies)
        if report.missing:  # (strict=False: said, never silent)
            warnings.warn(f"load_pretrained: {len(report.missing)} tensors of this {type(module).__name__} have no "
                          f"value in {_listing(report.files, 3)} and keep their initial (random) values: "
                          f"{', '.join(report.missing)}", PretrainedMissingWarning, stacklevel=2)
        tp = [t.name for t in matched if getattr(t.tensor, "tp_sharded", False)]
        if tp:
            raise NotImplementedError(f"load_pretrained: {_listing(tp, 5)} are tensor-parallel slices; load the "
                                      f"checkpoint before tiertrain.parallel.apply_tensor_parallel")
        report.loaded = [t.name for t in matched]
        if pipeline:
            report.loaded = _into_pipeline(target, matched, ckpt)
        elif isinstance(target, Engine):
            _into_engine(target, matched, ckpt)
        else:
            _into_module(matched, ckpt, topology)
    buffers = {t.key for t in matched if not t.is_param}
    _refuse_nonfinite(target, topology, report, {k: n for k, n in report.nonfinite.items() if k not in buffers})
    if pipeline and target.unset_tensors is not None:
        target.unset_tensors.loaded(report.loaded)
    return report


def _whole_model(engine) -> tuple[nn.Module, dict[str, str]]:
    """The model a pipeline engine's stages were cut from and the tied copy (PipelineEngine.source_model)."""
    source = engine.source_model()
    if source is None:
        raise TypeError("load_pretrained: this PipelineEngine's stages were not cut from a Hugging Face model by "
                        "tiertrain.wrap (stage modules given as a list, or tiertrain's GPT), so no model names "
                        "the checkpoint's tensors: load the checkpoint into the model before tiertrain.wrap")
    return source


def _into_pipeline(engine, matched: list[_Target], ckpt: _Checkpoint) -> list[str]:
    """This pipeline rank's stages' tensors (by the whole model's names, which the stages
    keep), as _into_engine; the other stages' are not read. Returns the names loaded."""
    keys = {alias: t.key for t in matched for alias in t.aliases}
    held: dict[int, tuple[str, torch.Tensor]] = {}  # each tensor once, by the name the layout knows it by
    names: list[str] = []  # every name it has here (a tensor shared under two names: both loaded)
    for stage in engine.stages:
        persistent = set(stage.state_dict(keep_vars=True))
        for name, t in [*stage.named_parameters(remove_duplicate=False), *stage.named_buffers(remove_duplicate=False)]:
            if name in keys and name in persistent:
                held.setdefault(id(t), (name, t))
                names.append(name)
    placed = write_into_units(engine, {name: keys[name] for name, _ in held.values()}, ckpt)
    for name, t in held.values():
        if name not in placed:
            t.data.copy_(ckpt.read(keys[name]).reshape(t.shape))
    return list(dict.fromkeys(names))


def _refuse_nonfinite(target, topology: Topology | None, report: LoadReport, found: dict[str, int]) -> None:
    """NonFiniteWeightsError on every rank that shares the load when any read inf or NaN into
    a parameter (a rank reads only its part: they agree first, so none trains on alone)."""
    from ..pipeline.engine import PipelineEngine
    from ..pipeline.materialize import ranks_with

    ranks = [bool(found)]
    if isinstance(target, PipelineEngine):  # (its ranks read different stages: all of them agree)
        failing = ranks_with(bool(found), target.topology)
        ranks = [r in failing for r in range(target.topology.world_size)]
    elif isinstance(target, Engine) and target.comm.size > 1:
        flags = torch.zeros(target.comm.size, dtype=torch.int64, device=target.device)
        flags[target.comm.rank] = int(bool(found))
        target.comm.all_reduce(flags, op=dist.ReduceOp.MAX, count=False).wait()
        ranks = flags.tolist()
    elif not isinstance(target, Engine) and any(is_partitioned(p) for p in target.parameters()):
        rank, size = _dp_rank_and_size(topology)
        flags = torch.zeros(size, dtype=torch.int64, device=topology.device if topology else default_device())
        flags[rank] = int(bool(found))
        if size > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=topology.group("dp_cp") if topology else None)
        ranks = flags.tolist()
    if not any(ranks):
        return
    where = _listing(report.files, 3)
    if found:
        said = _listing([f"{k} ({n} value{'s' * (n > 1)})" for k, n in sorted(found.items())])
        raise NonFiniteWeightsError(f"load_pretrained: the checkpoint {where} holds inf or NaN in {said}: training "
                                    f"from it gives NaN losses; convert or download the checkpoint again")
    raise NonFiniteWeightsError(f"load_pretrained: rank(s) {[r for r, f in enumerate(ranks) if f]} of this load "
                                f"found inf or NaN in the checkpoint {where} (named there)")


def _into_module(matched: list[_Target], ckpt: _Checkpoint, topology: Topology | None) -> None:
    """Case (b) and (c): a partitioned_init parameter gets its shard, anything else its
    whole value, one tensor at a time."""
    rank = size = None
    for t in matched:
        if t.is_param and is_partitioned(t.tensor):
            if rank is None:
                rank, size = _dp_rank_and_size(topology)
            _into_partitioned_param(t, ckpt, rank, size)
        else:
            t.tensor.data.copy_(ckpt.read(t.key).reshape(t.shape))


def _dp_rank_and_size(topology: Topology | None) -> tuple[int, int]:
    if topology is not None:
        group = topology.group("dp_cp")
        return dist.get_rank(group), dist.get_world_size(group)
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _into_partitioned_param(t: _Target, ckpt: _Checkpoint, rank: int, dp: int) -> None:
    """partitioned_init's layout: rank r holds flat elements [r·n, (r+1)·n) of the
    parameter, n = ceil(numel / dp), zero-padded past the end."""
    numel = math.prod(t.shape)
    per_rank = -(-numel // dp)
    if t.tensor.numel() != per_rank:
        raise ValueError(f"load_pretrained: {t.name} holds {t.tensor.numel()} elements, but its shard of "
                         f"{numel} over dp={dp} ranks has {per_rank}: pass topology= (the one partitioned_init "
                         f"was given)")
    lo, hi = rank * per_rank, min((rank + 1) * per_rank, numel)
    if lo < hi:
        t.tensor.data[:hi - lo].copy_(ckpt.read_flat(t.key, t.shape, lo, hi))


def _into_engine(engine: Engine, matched: list[_Target], ckpt: _Checkpoint) -> None:
    """Case (a): each unit's slots on this rank (tiertrain/unit_values.py), then the tensors
    outside the layout (frozen parameters stages 0-2 leave whole, buffers) copied into the module."""
    placed = write_into_units(engine, {t.name: t.key for t in matched}, ckpt)
    for t in matched:
        if t.name not in placed:
            t.tensor.data.copy_(ckpt.read(t.key).reshape(t.shape))


__all__ = ["LoadReport", "NonFiniteWeightsError", "PretrainedMismatchError", "PretrainedMissingWarning",
           "QuantizedCheckpointError", "checkpoint_files", "load_pretrained"]
