"""A PEFT model exported as something that loads (issue 34, item 8): ``engine.save_pretrained(
directory, peft=PeftExport.ADAPTER)`` or ``PeftExport.MERGED``.

A ``peft.PeftModel`` wraps the base model (``base_model.model.…`` names, ``base_layer`` beside
``lora_A``/``lora_B``), so its tensors written as they are load into nothing: transformers
re-initialises every weight. Two forms load:

* ADAPTER: the directory ``PeftModel.save_pretrained`` writes: ``adapter_config.json`` (peft's
  own ``PeftConfig.save_pretrained``) and ``adapter_model.safetensors`` holding the adapter's
  tensors under the names peft's ``get_peft_model_state_dict`` gives them (the adapter's name
  removed). ``PeftModel.from_pretrained(base, directory)`` loads it.
* MERGED: the base model's own checkpoint with each LoRA adapter folded into its base weight,
  W + s·(B A) (transposed for ``fan_in_fan_out`` layers, GPT-2's Conv1D), as peft's
  ``merge_and_unload`` computes it, the base model's ``config.json``; ``from_pretrained`` of the
  base class loads it. The merge is a conversion group of the streaming export (base weight,
  A, B → the merged weight), so no rank holds more than one unit, as for any export.
"""
from __future__ import annotations

import dataclasses
import enum
import sys

import torch
import torch.nn as nn

from .export_groups import grouped_items
from .hf_conversion import SaveGroup, saving_groups


class PeftExport(enum.Enum):
    """How save_pretrained writes a peft model (module docstring)."""

    ADAPTER = "adapter"
    MERGED = "merged"


def peft_model(module: nn.Module) -> bool:
    """Whether module is a peft.PeftModel (peft is not imported for it: a process that never
    imported peft holds none)."""
    peft = sys.modules.get("peft")
    return peft is not None and isinstance(module, peft.PeftModel)


def _adapter(module: nn.Module) -> str:
    return module.active_adapter if isinstance(module.active_adapter, str) else module.active_adapters[0]


def base_model(module: nn.Module) -> nn.Module:
    """The model the adapters were applied to (its config and class are the checkpoint's)."""
    return module.get_base_model()


def adapter_names(module: nn.Module, names: dict[str, tuple[int, ...]]) -> dict[str, str]:
    """{model name: adapter file name} for the tensors the adapter directory holds, as peft's
    get_peft_model_state_dict selects and names them (run on stand-in tensors: no values)."""
    from peft import get_peft_model_state_dict

    stand_in = {n: torch.empty(0) for n in names}
    by_id = {id(t): n for n, t in stand_in.items()}
    selected = get_peft_model_state_dict(module, state_dict=stand_in, adapter_name=_adapter(module))
    return {by_id[id(t)]: out for out, t in selected.items()}


_BASE = "base_model.model."


def merge_groups(module: nn.Module, names: dict[str, tuple[int, ...]]) -> list[SaveGroup]:
    """The base model's checkpoint as groups of the PEFT model's tensors: each LoRA layer's
    base weight with its A and B (→ the merged weight), every other base tensor renamed (the
    peft prefix and ``base_layer`` removed); adapters other than the active one and the
    copies modules_to_save replaced are left out."""
    from peft.tuners.lora import LoraLayer

    adapter = _adapter(module)
    layers = {name: m for name, m in module.named_modules() if isinstance(m, LoraLayer)}
    taken: set[str] = set()
    groups: list[SaveGroup] = []
    for path, layer in layers.items():
        weight = f"{path}.base_layer.weight"
        a, b = f"{path}.lora_A.{adapter}.weight", f"{path}.lora_B.{adapter}.weight"
        if weight not in names or a not in names or b not in names:
            raise NotImplementedError(f"save_pretrained(peft=MERGED): {path} ({type(layer).__name__}) is not a LoRA "
                                      f"linear layer with adapter {adapter!r}; write PeftExport.ADAPTER instead")
        if getattr(layer, "use_dora", {}).get(adapter) or getattr(layer, "lora_bias", {}).get(adapter):
            raise NotImplementedError(f"save_pretrained(peft=MERGED): {path} uses DoRA or a LoRA bias, which this "
                                      f"merge does not fold; write PeftExport.ADAPTER instead")
        scale = float(layer.scaling[adapter])
        transpose = bool(getattr(layer, "fan_in_fan_out", False))
        out = _base_name(weight)

        def merge(values, weight=weight, a=a, b=b, out=out, scale=scale, transpose=transpose):
            delta = (values[b].double() @ values[a].double()) * scale  # (once, in float64, then rounded)
            delta = delta.T if transpose else delta
            return {out: (values[weight].double() + delta).to(values[weight].dtype)}

        groups.append(SaveGroup(out, [weight, a, b], {out: names[weight]}, merge=merge))
        taken.update((weight, a, b))
    for name, shape in names.items():
        if name in taken or _left_out(name):
            continue
        groups.append(SaveGroup(name, [name], {_base_name(name): shape}))
    return groups


def _left_out(name: str) -> bool:
    return ".lora_" in name or ".original_module." in name or not name.startswith(_BASE)


def _base_name(name: str) -> str:
    name = name.removeprefix(_BASE).replace(".base_layer.", ".")
    if ".modules_to_save." in name:  # (the trained copy replaces the module)
        head, _, tail = name.partition(".modules_to_save.")
        name = head + "." + tail.partition(".")[2]
    return name


def write_adapter_config(module: nn.Module, directory: str) -> list[str]:
    """adapter_config.json, by peft's own PeftConfig.save_pretrained (inference_mode set, as
    PeftModel.save_pretrained writes it)."""
    import copy

    config = copy.deepcopy(module.peft_config[_adapter(module)])
    config.inference_mode = True
    config.save_pretrained(directory)
    return ["adapter_config.json"]


ADAPTER_FILE = "adapter_model.safetensors"


def peft_items(module: nn.Module, items: list, peft: PeftExport | None, world: int, single: str):
    """(items, the module whose config.json is written (None: adapter_config.json), ranks that
    write, the single file's name) of a PEFT model's export: the adapter's tensors under peft's
    names, written by one rank into adapter_model.safetensors; or the merged base model, by
    every rank as any export (single: the name of a checkpoint of one file)."""
    if not isinstance(peft, PeftExport):
        raise ValueError(f"save_pretrained: this model is a peft.PeftModel, whose own tensor names load into "
                         f"nothing; pass peft=PeftExport.ADAPTER (adapter_config.json + adapter weights, for "
                         f"PeftModel.from_pretrained) or peft=PeftExport.MERGED (the base model with the adapters "
                         f"merged, for from_pretrained), got peft={peft!r}")
    shapes = {i.name: i.shape for i in items}
    if peft is PeftExport.ADAPTER:
        names = adapter_names(module, shapes)
        chosen = [dataclasses.replace(i, name=names[i.name], members=(i,)) for i in items if i.name in names]
        return [dataclasses.replace(i, position=n) for n, i in enumerate(chosen)], None, 1, ADAPTER_FILE
    merged = grouped_items(items, merge_groups(module, shapes))
    base = base_model(module)
    if saving_groups(base, {i.name: i.shape for i in merged}) is not None:
        raise NotImplementedError(f"save_pretrained(peft=PeftExport.MERGED): {type(base).__name__}'s checkpoints "
                                  f"are converted (tiertrain/state/hf_conversion.py) after the merge, which is not "
                                  f"supported; write PeftExport.ADAPTER")
    return merged, base, world, single


__all__ = ["ADAPTER_FILE", "PeftExport", "adapter_names", "base_model", "merge_groups", "peft_items", "peft_model",
           "write_adapter_config"]
