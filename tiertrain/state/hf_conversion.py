"""Hugging Face checkpoint conversion, applied by transformers' own mapping (issue 34, item 7).

transformers 5 keeps some families in memory in another form than on disk: a mixture of
experts stacks its experts into one tensor per layer (``mlp.experts.gate_up_proj``) where the
checkpoint holds one tensor per expert and projection (``block_sparse_moe.experts.3.w1.weight``);
ViT renames its layers (``vit.layers.0.attention.q_proj`` in memory, ``vit.encoder.layer.0.
attention.attention.query`` on disk); old checkpoints say ``LayerNorm.gamma``. ``from_pretrained``
converts on load and ``save_pretrained`` reverts on save, with the model's list of
``WeightRenaming``/``WeightConverter`` transforms (``transformers.conversion_mapping``).

This module uses those transforms, never a copy of them:

* :class:`ConvertedCheckpoint` shows a checkpoint under the model's in-memory names, with the
  interface of the raw one (``keys``, ``shape``, ``read``, ``read_flat``): a renamed tensor is
  read as before (only the rows a rank keeps); a converted one (several checkpoint tensors into
  one model tensor, or one into several) is read whole, converted by its transform, and its
  outputs kept until each is taken, so a load holds at most one conversion group beyond the
  model. Shapes are known before anything is read: the transform runs first on meta tensors.
* :func:`saving_groups` is the reverse for a writer: which model tensors go together into which
  checkpoint tensors, with their names and shapes (again from meta tensors), checked against
  transformers' ``revert_weight_conversion`` of the whole model's shapes; :meth:`SaveGroup.convert`
  turns the members' values into the checkpoint's tensors.
"""
from __future__ import annotations

import copy
import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn


def _transformers_model(module: nn.Module) -> bool:
    """Whether module is a transformers model (transformers' modeling code is not imported for it,
    which takes seconds: a process that never imported it holds no such model)."""
    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(module, modeling.PreTrainedModel)


def _load_transforms(module: nn.Module) -> list | None:
    """The transforms from_pretrained applies to module's checkpoints (None: names as they are,
    as in transformers before 5, which kept every family on disk as in memory)."""
    if not _transformers_model(module):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
    except ImportError:
        return None

    transforms = get_model_conversion_mapping(module)
    return transforms or None


def _save_transforms(module: nn.Module) -> list | None:
    """The transforms save_pretrained reverts, chosen as transformers' revert_weight_conversion
    chooses them: those the model was loaded with, else the family's own (no legacy renames,
    no prefix changes, which only a load can decide)."""
    if not _transformers_model(module):
        return None
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange
    except ImportError:
        return None

    transforms = getattr(module, "_weight_conversions", None)
    if transforms is None:
        transforms = [t for t in get_model_conversion_mapping(module, add_legacy=False)
                      if not isinstance(t, PrefixChange)]
    return transforms or None


def _split(transforms: list) -> tuple[list, list, dict]:
    from transformers.core_model_loading import WeightConverter, WeightRenaming

    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    return renamings, converters, {p: c for c in converters for p in c.source_patterns}


def _run(converter, first_name: str, sources: list[tuple[str, str, Callable[[], torch.Tensor]]],
         module: nn.Module) -> dict[str, torch.Tensor]:
    """One conversion group through its transform: sources are (name, pattern, value thunk)."""
    conv = copy.deepcopy(converter)
    for name, pattern, value in sources:
        conv.add_tensor(first_name, name, pattern, value)
    out = conv.convert(first_name, model=module, config=getattr(module, "config", None))
    return {k: (v[0] if isinstance(v, list) else v) for k, v in out.items()}


def _meta(shape: tuple[int, ...], dtype: torch.dtype) -> Callable[[], torch.Tensor]:
    return lambda: torch.empty(shape, dtype=dtype, device="meta")


# -- loading ---------------------------------------------------------------------------------------


@dataclass
class _Group:
    first: str  # the name transformers converts the group under
    converter: Any
    sources: list[tuple[str, str]]  # (checkpoint name, the converter's pattern it matched)
    outputs: dict[str, tuple[int, ...]] = field(default_factory=dict)


class ConvertedCheckpoint:
    """A checkpoint (tiertrain.state.pretrained's reader) under the model's in-memory names;
    operation names the caller in its errors."""

    def __init__(self, raw, module: nn.Module, transforms: list, operation: str = "load_pretrained"):
        from transformers.core_model_loading import dot_natural_key, rename_source_key

        self.raw = raw
        self.module = module
        renamings, converters, by_pattern = _split(transforms)
        self._direct: dict[str, str] = {}  # model name → checkpoint name (renamed, or as is)
        self._group_of: dict[str, _Group] = {}
        groups: dict[str, _Group] = {}
        for key in sorted(raw.keys(), key=dot_natural_key):  # (the order from_pretrained stacks experts in)
            renamed, pattern = rename_source_key(key, renamings, converters)
            if pattern is None:
                if renamed in self._direct:
                    raise ValueError(f"{operation}: checkpoint tensors {self._direct[renamed]!r} and {key!r} "
                                     f"both become {renamed!r} under {type(module).__name__}'s checkpoint "
                                     f"conversion")
                self._direct[renamed] = key
            else:
                groups.setdefault(renamed, _Group(renamed, by_pattern[pattern], [])).sources.append((key, pattern))
        for first, group in groups.items():
            metas = [(k, p, _meta(raw.shape(k), torch.float32)) for k, p in group.sources]
            try:
                out = _run(group.converter, first, metas, module)
            except Exception as e:  # (the checkpoint's tensors do not fit the transform)
                raise ValueError(f"{operation}: {type(module).__name__}'s checkpoint conversion of "
                                 f"{[k for k, _ in group.sources][:4]} into {first!r} failed: "
                                 f"{type(e).__name__}: {e}") from None
            for name, t in out.items():
                group.outputs[name] = tuple(t.shape)
                self._group_of[name] = group
        self._converted: dict[str, torch.Tensor] = {}  # outputs of groups read, not yet taken
        self.converted_count = len(self._group_of)
        self.renamed_count = sum(k != v for k, v in self._direct.items())

    def keys(self) -> list[str]:
        return list(self._direct) + list(self._group_of)

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self._direct:
            return self.raw.shape(self._direct[key])
        return self._group_of[key].outputs[key]

    def read(self, key: str) -> torch.Tensor:
        if key in self._direct:
            return self.raw.read(self._direct[key])
        if key not in self._converted:
            group = self._group_of[key]
            values = [(k, p, (lambda k=k: self.raw.read(k))) for k, p in group.sources]
            self._converted.update(_run(group.converter, group.first, values, self.module))
        return self._converted.pop(key)

    def read_flat(self, key: str, shape: tuple[int, ...], start: int, end: int) -> torch.Tensor:
        if key in self._direct:
            return self.raw.read_flat(self._direct[key], shape, start, end)
        return self.read(key).reshape(-1)[start:end]  # (a converted tensor exists only whole)


def checkpoint_view(raw, module: nn.Module, operation: str = "load_pretrained"):
    """raw itself when module's checkpoints are stored as it holds them, else a
    :class:`ConvertedCheckpoint` of raw through the model's transforms."""
    transforms = _load_transforms(module)
    if transforms is None:
        return raw
    view = ConvertedCheckpoint(raw, module, transforms, operation)
    return view if (view.converted_count or view.renamed_count) else raw


# -- saving ----------------------------------------------------------------------------------------


def meta_model(saved: dict) -> nn.Module | None:
    """The run's Hugging Face model rebuilt on the meta device (no memory, no values) from the
    config a checkpoint recorded (export_files.hf_config_json's {"config": ...}), for an offline export
    to convert as the model saves; None when transformers or the class is not available (its
    names are then written as they are)."""
    config = (saved or {}).get("config") or {}
    architectures = config.get("architectures") or []
    try:
        import transformers
    except ImportError:
        return None
    cls = getattr(transformers, architectures[0], None) if architectures else None
    if cls is None or not hasattr(cls, "config_class"):
        return None
    with torch.device("meta"):
        return cls(cls.config_class.from_dict(config))


@dataclass
class SaveGroup:
    """Model tensors written together as one or more checkpoint tensors."""

    first: str
    """The name transformers converts the group under."""
    members: list[str]
    """Model names (state_dict names), in transformers' order."""
    outputs: dict[str, tuple[int, ...]]
    """Checkpoint name → shape."""
    converter: Any = None
    """The reversed transform (None, and merge None: its one member under its renamed name)."""
    renamings: list = field(default_factory=list)
    patterns: list[tuple[str, str]] = field(default_factory=list, repr=False)
    """(member, the reversed converter's pattern it matched)."""
    merge: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    """Another writer's conversion of the members' values (tiertrain/state/peft_export.py's merge)."""

    @property
    def renames_only(self) -> bool:
        return self.converter is None and self.merge is None

    def convert(self, values: dict[str, torch.Tensor], module: nn.Module) -> dict[str, torch.Tensor]:
        """Checkpoint tensors from the members' values (model name → tensor)."""
        if self.merge is not None:
            return self.merge(values)
        if self.converter is None:
            (member,), (out,) = self.members, self.outputs
            return {out: values[member]}
        from transformers.core_model_loading import apply_renamings

        result = _run(self.converter, self.first, [(m, p, (lambda m=m: values[m])) for m, p in self.patterns],
                      module)
        return {apply_renamings(k, self.renamings): v.contiguous() for k, v in result.items()}


def saving_groups(module: nn.Module, shapes: dict[str, tuple[int, ...]]) -> list[SaveGroup] | None:
    """How save_pretrained would write these model tensors (name → shape, state_dict names):
    None when the model has no conversion (each under its own name); else the groups, whose
    checkpoint names and shapes are checked against transformers' own revert_weight_conversion
    of the same (meta) tensors."""
    transforms = _save_transforms(module)
    if transforms is None:
        return None
    from transformers.core_model_loading import (apply_converters, apply_renamings, dot_natural_key,
                                                 revert_weight_conversion)

    reverse = [t.reverse_transform() for t in transforms[::-1]]
    renamings, converters, by_pattern = _split(reverse)
    groups: dict[str, SaveGroup] = {}
    for name in sorted(shapes, key=dot_natural_key):
        first, pattern = apply_converters(name, converters)
        if pattern is None:
            out = apply_renamings(name, renamings)
            groups[f"\0{name}"] = SaveGroup(name, [name], {out: shapes[name]})
        else:
            group = groups.setdefault(first, SaveGroup(first, [], {}, by_pattern[pattern], renamings))
            group.members.append(name)
            group.patterns.append((name, pattern))
    for first, group in groups.items():
        if group.converter is not None:
            metas = {m: torch.empty(shapes[m], device="meta") for m in group.members}
            group.outputs = {k: tuple(v.shape) for k, v in group.convert(metas, module).items()}
    ours = {k: v for g in groups.values() for k, v in g.outputs.items()}
    if sum(len(g.outputs) for g in groups.values()) != len(ours):
        raise RuntimeError(f"save_pretrained: {type(module).__name__}'s checkpoint conversion writes two tensors "
                           f"under one name")
    theirs = revert_weight_conversion(module, {k: torch.empty(s, device="meta") for k, s in shapes.items()})
    theirs = {k: tuple(v.shape) for k, v in theirs.items()}
    if ours != theirs:
        differ = sorted(set(ours.items()) ^ set(theirs.items()))[:6]
        raise RuntimeError(f"save_pretrained: the checkpoint conversion of {type(module).__name__} planned here "
                           f"differs from transformers' revert_weight_conversion (this transformers version "
                           f"groups its transforms otherwise): {differ}")
    if all(g.renames_only and list(g.outputs) == g.members for g in groups.values()):
        return None
    return list(groups.values())


__all__ = ["ConvertedCheckpoint", "SaveGroup", "checkpoint_view", "meta_model", "saving_groups"]
