"""The engine's checkpoint and export operations, working through its parts.

``Engine.save_checkpoint``, ``load_checkpoint``, ``save_pretrained``, ``state_dict`` and
``load_state_dict`` keep their place in the engine's API, but the engine imports nothing of
tiertrain.state: ``tiertrain.wrap()`` hands it this module as its ``state_io`` (the
``StateIO`` protocol of tiertrain/engine_contract.py), and the methods call the functions here with the
engine after doing what is the engine's own part of the contract (entering the collective,
finishing what is in flight, keeping the background save). What they read of the engine is
narrow: its stateful parts (``checkpoint_parts``), its layout, topology, stage, dtype and
update form (the fingerprint and shard description), its flat parameters (the non-finite
check, the names an offline export needs) and its module (the Hugging Face config).
"""
from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any


from ..precision import first_nonfinite
from . import checkpoint
from . import dcp_checkpoint, deepspeed_checkpoint
from . import export_files, export_plan
from . import reshard as reshard_module
from . import shard_layout
from .checkpoint import PendingSave, rank_state, restore_rank_state
from .export import ExportReport, save_pretrained

if TYPE_CHECKING:
    from ..training_core import TrainingCore

__all__ = ["ExportReport", "PendingSave", "fingerprint", "load_checkpoint", "load_dcp_checkpoint",
           "load_deepspeed_checkpoint", "rank_state", "restore_rank_state", "save_checkpoint", "save_pretrained",
           "shard_description"]


def fingerprint(engine: "TrainingCore") -> dict:
    """What a checkpoint of this rank must match to load here (checkpoint.layout_fingerprint)."""
    return checkpoint.layout_fingerprint(engine.layout, engine.topology, engine.stage,
                                         engine.config.precision.dtype, engine.update.state_format)


def shard_description(engine: "TrainingCore") -> dict:
    """This rank's shard layout as a checkpoint records it (tiertrain/state/shard_layout.py describe)."""
    topology = engine.topology
    return shard_layout.describe(engine.flat, engine.update, (topology.coord("tp"), topology.size("tp")),
                                 engine.tied_copies())


def _files_for_export(engine: "TrainingCore") -> dict[str, Any]:
    """What an offline export (tiertrain/state/consolidate.py) needs beyond the shards: the
    names Hugging Face writes, what the module holds whole, the model's HF config (a
    tensor-parallel slice held outside the shards is not whole, so it is left out), and the
    files kept with the model. Rank 0 writes them: under pipeline parallelism each stage's
    names and whole tensors are gathered from the pipeline's ranks (collective over pp)."""
    files: dict[str, Any] = {}
    pipeline = engine.topology.size("pp") > 1
    modules = engine.named_modules_of_state() if pipeline else [engine.module]
    source = engine.source_model() if pipeline else None  # (its stages' names are this model's)
    names, held = {}, []
    for module in modules:
        found, whole = export_plan.checkpoint_names(module, engine.flat, like=source[0] if source else None)
        names.update(found)
        held += [(n, t) for n, t in whole
                 if export_plan.writable_dtype(t.dtype) and not getattr(t, "tp_sharded", False)]
    hf = export_files.hf_config_json(source[0] if source else modules[0])
    if pipeline:
        names, held = _over_the_pipeline(engine, names, held)
    files["export.json"] = json.dumps({"names": names, "held": [n for n, _ in held]}, indent=1).encode()
    if held:
        files["held_tensors.safetensors"] = lambda f: export_files.write_safetensors(f, held)
    if hf is not None:
        files["hf_config.json"] = json.dumps(hf, indent=1).encode()
    files.update({export_files.WITH_MODEL + name: data for name, data in engine.files_with_model.items()})
    return files


def _over_the_pipeline(engine: "TrainingCore", names: dict[str, str], held: list):
    """Every pipeline rank's export names and whole tensors (the last stage's copy of a tied
    embedding left out: the export writes the embedding once, as save_pretrained does)."""
    import torch.distributed as dist

    copies = set(engine.tied_copies())
    mine = ({k: v for k, v in names.items() if k not in copies}, [(n, t.detach().cpu()) for n, t in held])
    every: list[Any] = [None] * engine.topology.size("pp")
    dist.all_gather_object(every, mine, group=engine.topology.group("pp"))
    names, whole = {}, {}
    for stage_names, stage_held in every:
        names.update(stage_names)
        for name, tensor in stage_held:
            whole.setdefault(name, tensor)  # (a tensor every stage holds: written once)
    return names, list(whole.items())


def save_checkpoint(engine: "TrainingCore", directory: str, extra: dict | None, keep_last: int, run_id: str,
                    background: bool, background_group: Any) -> "str | PendingSave":
    """Save the engine's parts under directory/step_N (checkpoint.save), once the engine has
    settled what is in flight; returns the step directory, or the PendingSave of a background
    save. A CheckpointError on every rank, before anything is written, when the fp32 masters
    hold inf or NaN."""
    # A diverged run's masters are not worth a checkpoint, and one would displace (keep_last)
    # the good ones a resume needs. Each rank checks the masters of the state it is about to
    # write (no second read from NVMe); save() tells every rank every rank's problem, so all
    # refuse together before anything is written.
    def finite_masters(state: dict) -> str | None:
        culprit = first_nonfinite(engine.flat, state["update"]["masters"])
        if culprit is None:
            return None
        return (f"the fp32 master weights hold non-finite values (rank {engine.topology.rank}: first in "
                f"{culprit}); the run has diverged: resume from an earlier checkpoint with a lower optimizer.lr")
    files = _files_for_export(engine)
    return checkpoint.save(engine.checkpoint_parts(), directory, engine.steps, engine.topology,
                           engine.checkpoint_fingerprint(), extra, keep_last,
                           shards=engine.shard_description(), files=files, run_id=run_id, validate=finite_masters,
                           background_group=background_group, background=background)


def load_checkpoint(engine: "TrainingCore", directory: str, step: int | None, reshard: bool) -> dict:
    """Restore the newest intact committed checkpoint (all ranks the same one,
    checkpoint.agree_on_checkpoint), or the given step, into the engine's parts; returns the
    extras saved with it. A checkpoint of another layout is resharded (tiertrain/state/
    reshard.py) unless reshard is False."""
    fingerprint = engine.checkpoint_fingerprint()
    topology = engine.topology
    checkpoint.lock_directory(directory, topology, writing=False)  # (a second job must not resume the first's run)
    step_dir, marker = checkpoint.agree_on_checkpoint(directory, step, topology)
    with checkpoint.interpreting(step_dir):
        if reshard and checkpoint.layout_changed(marker, topology, fingerprint):
            return reshard_module.load_resharded(engine.checkpoint_parts(), step_dir, marker, topology.rank,
                                                 fingerprint, engine.shard_description(), engine.update)
        return checkpoint.load(engine.checkpoint_parts(), step_dir, marker, topology, fingerprint, engine.device)


def load_deepspeed_checkpoint(engine: "TrainingCore", directory: str, tag: str | None) -> dict:
    """Load a DeepSpeed ZeRO checkpoint into the engine's parts (tiertrain/state/deepspeed_checkpoint.py)."""
    return deepspeed_checkpoint.load_into(engine, directory, tag)


def load_dcp_checkpoint(engine: "TrainingCore", path: str) -> dict:
    """Load an FSDP2 run's torch.distributed.checkpoint into the engine's parts
    (tiertrain/state/dcp_checkpoint.py)."""
    return dcp_checkpoint.load_into(engine, path)
