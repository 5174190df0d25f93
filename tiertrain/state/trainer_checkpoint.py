"""The checkpoints transformers' Trainer saves without tiertrain (DeepSpeed's excepted:
tiertrain/state/deepspeed_checkpoint.py). On its own, ``checkpoint-N/`` holds the model's
weights (``model.safetensors``, sharded beside its index, or ``pytorch_model.bin``; a peft
model's adapter alone) and ``optimizer.pt``, torch's optimizer state dict, which keys each
parameter's state by its number in the optimizer's param groups and so names no parameter.
The Trainer builds those groups by a rule (``Trainer.create_optimizer``: the parameters it
decays, then the others, each in the model's order), so given the rule's groups the numbers
name parameters: checked against the saved groups' sizes and every state's shape, then loaded
as a DCP checkpoint is (tiertrain/state/dcp_checkpoint.py), at any stage, tier and layout.

The weights are as ``save_pretrained`` wrote them: a family transformers 5 keeps otherwise in
memory (a mixture of experts' stacked experts, one tensor per expert on disk) is converted back
by transformers' own mapping (tiertrain/state/hf_conversion.py), as ``from_pretrained`` would.
The Trainer's own resume does not (it calls ``load_state_dict(strict=False)`` on the disk's
names and logs the experts and router as missing); docs/hf_trainer.md.

The Trainer's checkpoints under FSDP are read here too: ``pytorch_model_fsdp_0/`` and
``optimizer_0/`` (SHARDED_STATE_DICT, DCP directories) and ``pytorch_model_fsdp.bin`` with
``optimizer.bin`` (FULL_STATE_DICT, the state dicts whole, keyed by name). In every layout the
Trainer's global step counts the fp16 steps its GradScaler skipped on overflow, which the optimizer's
step leaves out: they continue as the engine's skipped steps, and its loss scale from
``scaler.pt``.
"""
from __future__ import annotations

import json
import math
import os
import sys
from typing import TYPE_CHECKING

import torch

from .checkpoint import CheckpointError
from .dcp_checkpoint import load_items, open_checkpoints
from .dcp_files import NestedState
from .hf_conversion import checkpoint_view
from .optimizer_state import unnested
from ..errors import said
from ..unit_values import ValuesInMemory

if TYPE_CHECKING:
    from ..training_core import TrainingCore

OPTIMIZER_FILE = "optimizer.pt"
"""The Trainer's optimizer state file in checkpoint-N/."""
FSDP_FULL_FILES = ("pytorch_model_fsdp.bin", "optimizer.bin")
"""What the Trainer saves under FSDP with FULL_STATE_DICT (FSDP1's default; Accelerate's
save_fsdp_model and save_fsdp_optimizer, written by rank 0): the model's state dict and the
optimizer's, keyed by parameter name, each whole."""
FSDP_SHARDED_DIRECTORY = "pytorch_model_fsdp_0"
"""The model's DCP directory the Trainer saves under FSDP with SHARDED_STATE_DICT (beside optimizer_0/)."""
ADAPTER_FILES = ("adapter_model.safetensors", "adapter_model.bin")
"""What the Trainer saves of a peft model (PeftModel.save_pretrained) in place of the model's weights."""
SCALER_FILE = "scaler.pt"
"""The Trainer's GradScaler state (fp16 runs): torch.amp.GradScaler.state_dict()."""


def _loaded(path: str, load):
    """load(path), a regular file's; any error of reading it (pickle's, zip's, safetensors') a
    CheckpointError naming the file."""
    if not os.path.isfile(path):  # (a FIFO or a device in its place would block a read)
        raise CheckpointError(f"{path!r} does not exist or is not a regular file")
    try:
        return load(path)
    except Exception as e:  # (the file is no state dict read here)
        raise CheckpointError(f"{path!r} is not a weights or state file tiertrain reads ({said(e)})") from e


def _torch_load(path: str):
    return torch.load(path, map_location="cpu", weights_only=True, mmap=True)


def _load_weights(path: str) -> dict[str, torch.Tensor]:
    """A weights file by its kind: safetensors, else torch's."""
    if path.endswith(".safetensors"):
        from safetensors.torch import load_file

        return load_file(path)
    return _torch_load(path)


def _shard_files(index: str) -> list[str]:
    with open(index) as f:
        return sorted(set(json.load(f)["weight_map"].values()))


def weights(directory: str) -> dict[str, torch.Tensor]:
    """The model's saved weights by name: model.safetensors (or its shards, by its index), or
    pytorch_model.bin."""
    from safetensors.torch import load_file

    index = os.path.join(directory, "model.safetensors.index.json")
    if os.path.lexists(index):
        files = _loaded(index, _shard_files)
        if any(not isinstance(name, str) or os.path.basename(name) != name for name in files):
            raise CheckpointError(f"{index!r} names shard files outside its directory: {files}")
        return {k: v for name in files for k, v in _loaded(os.path.join(directory, name), load_file).items()}
    for name in ("model.safetensors", "pytorch_model.bin"):
        if os.path.lexists(os.path.join(directory, name)):
            return _loaded(os.path.join(directory, name), _load_weights)
    raise CheckpointError(f"{directory!r} holds no model weights (model.safetensors, its index, or "
                          f"pytorch_model.bin)")


def model_named(values: dict[str, torch.Tensor], module: torch.nn.Module, where: str) -> dict[str, torch.Tensor]:
    """The saved weights under the module's own names: converted as from_pretrained converts
    them where the module's family is kept otherwise in memory, else as they are."""
    raw = ValuesInMemory(values)
    try:
        view = checkpoint_view(raw, module, where)
    except ValueError as e:  # (tensors that do not fit the family's conversion)
        raise CheckpointError(str(e)) from None
    if view is raw:
        return values
    with torch.no_grad():
        return {name: view.read(name) for name in view.keys()}


def adapter_named(values: dict[str, torch.Tensor], module: torch.nn.Module, where: str) -> dict[str, torch.Tensor]:
    """A peft adapter's saved tensors under the module's own names. peft saves them under the
    names its get_peft_model_state_dict gives (the adapter's name taken out: ``lora_A.weight``
    for ``lora_A.default.weight``); that function itself, run over the module's names, says
    which is which."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(module, peft.PeftModel):
        raise CheckpointError(f"{where} holds a peft adapter ({ADAPTER_FILES[0]}) but the model is a "
                              f"{type(module).__name__}: apply the same peft config (peft.get_peft_model) as the "
                              f"saving run")
    from peft import get_peft_model_state_dict

    markers = {name: torch.empty(0) for name, _ in [*module.named_parameters(), *module.named_buffers()]}
    by_id = {id(t): name for name, t in markers.items()}
    saved_as = {saved: by_id[id(t)] for saved, t in get_peft_model_state_dict(module, state_dict=markers).items()
                if id(t) in by_id}
    unknown = sorted(set(values) - set(saved_as))
    if unknown:
        raise CheckpointError(f"{where}: the adapter's tensors {unknown[:5]} are none of this peft model's (it saves "
                              f"{sorted(saved_as)[:5]}...): a checkpoint of another adapter config")
    return {saved_as[k]: v for k, v in values.items()}


def named_state(saved: dict, groups: list[list[str]], where: str) -> dict[str, dict]:
    """{parameter name: its saved state}, the numbers of the saved param groups read as the
    names of the given groups (the Trainer's rule), in order."""
    sizes = [len(g.get("params", ())) for g in saved.get("param_groups", ())]
    if sizes != [len(g) for g in groups]:
        raise CheckpointError(f"{where}: the saved optimizer's param groups hold {sizes} parameters; the Trainer's "
                              f"rule gives this model groups of {[len(g) for g in groups]} (decayed, then not): a "
                              f"checkpoint of another model, optimizer grouping or weight-decay rule")
    names = {int(i): name for group, own in zip(saved["param_groups"], groups) for i, name in zip(group["params"], own)}
    unknown = sorted(i for i in saved.get("state", {}) if int(i) not in names)
    if unknown:
        raise CheckpointError(f"{where}: the saved optimizer state has parameter numbers {unknown[:10]} that no "
                              f"param group lists")
    return {names[int(i)]: unnested(state) for i, state in saved["state"].items()}


def loss_scale(directory: str) -> dict | None:
    """The GradScaler's state in scaler.pt as tiertrain's scaler keeps it (the scale, the good
    steps since it last changed), or None without one (bf16 and fp32 runs, a disabled scaler)."""
    path = os.path.join(directory, SCALER_FILE)
    if not os.path.lexists(path):
        return None
    state = _loaded(path, _torch_load)
    if state == {}:  # (a disabled GradScaler's)
        return None
    scale, good = (state.get(k) if isinstance(state, dict) else None for k in ("scale", "_growth_tracker"))
    if not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0 or \
            not isinstance(good, int) or good < 0:
        raise CheckpointError(f"{path!r} is not a GradScaler's state (a positive finite 'scale' and a count "
                              f"'_growth_tracker'): {state!r:.200}")
    return {"scale": float(scale), "good_steps": good, "consecutive_skips": 0}


def saved_by_trainer(directory: str) -> bool:
    """Whether directory holds a checkpoint this module reads: the Trainer's own, or its
    checkpoint under FSDP, sharded or whole."""
    return any(os.path.isfile(os.path.join(directory, *name)) for name in
               [(FSDP_SHARDED_DIRECTORY, ".metadata"), (FSDP_FULL_FILES[0],), (OPTIMIZER_FILE,)])


def load(engine: "TrainingCore", directory: str | os.PathLike, groups: list[list[str]], global_step: int) -> dict:
    """Load the Trainer's checkpoint-N/ (saved_by_trainer) into the engine's parts; groups: the
    parameter names of the Trainer's param groups, in order (what optimizer.pt's numbers name);
    global_step: trainer_state.json's. Returns {}."""
    directory = os.fspath(directory)
    counts = {"counted": global_step, "loss_scale": loss_scale(directory)}
    if os.path.isfile(os.path.join(directory, FSDP_SHARDED_DIRECTORY, ".metadata")):
        where = f"the Trainer checkpoint {directory!r} (FSDP, SHARDED_STATE_DICT)"
        return load_items(engine, directory, open_checkpoints(directory), where, **counts)
    if os.path.isfile(os.path.join(directory, FSDP_FULL_FILES[0])):
        return _load_full_state_dicts(engine, directory, counts)
    return _load_own(engine, directory, groups, counts)


def _load_own(engine: "TrainingCore", directory: str, groups: list[list[str]], counts: dict) -> dict:
    where = f"the Trainer checkpoint {directory!r}"
    path = os.path.join(directory, OPTIMIZER_FILE)
    if not os.path.lexists(path):
        raise CheckpointError(f"{where} holds no {OPTIMIZER_FILE} (the Trainer saves it unless save_only_model=True)")
    saved = _loaded(path, _torch_load)
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict):
        raise CheckpointError(f"{path!r} is not a torch optimizer's state dict (no 'state' and 'param_groups')")
    adapter = next((os.path.join(directory, n) for n in ADAPTER_FILES if os.path.lexists(os.path.join(directory, n))),
                   None)
    if adapter is None:
        model = model_named(weights(directory), engine.module, where)
    else:
        model = adapter_named(_loaded(adapter, _load_weights), engine.module, where)
    state = {"model": model, "optimizer": {"state": named_state(saved, groups, where)}}
    return load_items(engine, directory, [NestedState(directory, state)], where, **counts)


def _load_full_state_dicts(engine: "TrainingCore", directory: str, counts: dict) -> dict:
    where = f"the Trainer checkpoint {directory!r} (FSDP, FULL_STATE_DICT)"
    if not os.path.lexists(os.path.join(directory, FSDP_FULL_FILES[1])):
        raise CheckpointError(f"{where} holds no {FSDP_FULL_FILES[1]} (the Trainer saves it unless "
                              f"save_only_model=True)")
    model, optimizer = (_loaded(os.path.join(directory, name), _torch_load) for name in FSDP_FULL_FILES)
    for name, value in zip(FSDP_FULL_FILES, (model, optimizer)):
        if not isinstance(value, dict):
            raise CheckpointError(f"{where}: {name} holds a {type(value).__name__}, not a state dict")
    state = NestedState(directory, {"model": model, "optimizer": optimizer})
    return load_items(engine, directory, [state], where, **counts)


__all__ = ["ADAPTER_FILES", "FSDP_FULL_FILES", "FSDP_SHARDED_DIRECTORY", "OPTIMIZER_FILE", "SCALER_FILE",
           "adapter_named", "load", "loss_scale", "model_named", "named_state", "saved_by_trainer", "weights"]
