"""``tiertrain.wrap``: the one entry point that turns a model into an engine, above both
engines (tiertrain/engine.py for one model, tiertrain/pipeline/engine.py for pipeline
stages), so neither imports the other's module for it."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch.nn as nn
from torch.nn.parameter import UninitializedBuffer, UninitializedParameter

from .compiling import unwrap_compiled
from .config import Config, ConfigError
from .engine import Engine
from .engine_contract import LossFn
from .errors import TiertrainError, listing
from .offload.activations import apply_activation_checkpointing, checkpointing_of
from .optim import OptimizerArg, SchedulerFactory, client_optimizer
from .pipeline.engine import PipelineEngine, pipeline_stages
from .pipeline.materialize import has_meta, materialize_stages
from .precision import stored_quantised
from .shared_memory import check_no_shared_memory
from .state import engine_io
from .topology import Topology
from .tiling import apply_tiled_mlp, block_mlps, remove_tiled_mlp, tiled_mlp_tokens
from .update.factory import UpdateFactory, build_update
from .zero.released import held, let_go


class AlreadyWrappedError(TiertrainError, RuntimeError):
    """wrap() was given a model whose parameters an engine not yet closed holds."""

    exit_code = 1


def _stages(model: nn.Module | Sequence[nn.Module]) -> list[nn.Module]:
    """The modules wrap() was given: the model, or a pipeline rank's stage modules."""
    return [model] if isinstance(model, nn.Module) else list(model)


def _parameters(model: nn.Module | Sequence[nn.Module]) -> list[nn.Parameter]:
    return [p for m in _stages(model) for p in m.parameters()]


def _check_not_held(model: nn.Module | Sequence[nn.Module]) -> None:
    """A model wrapped twice would have two engines binding its parameters to their buffers
    and reducing its gradients (the second failed deep inside, or at stage 3 read freed memory)."""
    names = held(_parameters(model))
    if names:
        raise AlreadyWrappedError(
            f"the model is already wrapped by an engine that is not closed (it holds {len(names)} of its "
            f"parameters, {names[0]!r} first): call that engine's close(), which hands the model back with its "
            f"trained values, then wrap it again; or wrap a fresh model")


def _built_per_stage(model: nn.Module | Sequence[nn.Module], topology: Topology) -> bool:
    """A whole model on the meta device under pipeline parallelism: each rank gives values to
    its own stages only, after the cut (tiertrain/pipeline/materialize.py). Not with tensor
    parallelism: the slices would have no checkpoint to load from (load_pretrained reads whole
    tensors)."""
    if topology.size("pp") == 1 or not isinstance(model, nn.Module) or isinstance(model, nn.ModuleList) \
            or not has_meta(model):
        return False
    if topology.size("tp") > 1:
        raise ConfigError(f"the model is on the meta device and parallel.tp={topology.size('tp')}: a pipeline rank "
                          f"builds only its stages from a meta-device model without tensor parallelism "
                          f"(tiertrain.load_pretrained reads whole tensors, not tensor-parallel slices); build the "
                          f"model with its values before parallelize_module")
    return True


def _check_materialized(model: nn.Module | Sequence[nn.Module], built_per_stage: bool = False) -> None:
    """A parameter or buffer with a shape but no values failed deep inside with torch's
    "Cannot copy out of meta tensor" or "Can't access the shape of an uninitialized
    parameter", naming neither the tensor nor the way out. (built_per_stage: meta tensors are
    given values after the pipeline cut, on the rank that keeps them.)"""
    modules = _stages(model)
    named = [(n, t) for m in modules for n, t in [*m.named_parameters(), *m.named_buffers()]]
    lazy = [n for n, t in named if isinstance(t, (UninitializedParameter, UninitializedBuffer))]
    if lazy:
        raise ConfigError(f"the model's {listing(lazy)} {'is' if len(lazy) == 1 else 'are'} uninitialized (a lazy "
                          f"module, e.g. nn.LazyLinear, learns its shapes at its first call): call the model once "
                          f"on a sample batch before wrap()")
    meta = [n for n, t in named if t.is_meta]
    if meta and not built_per_stage:
        raise ConfigError(f"the model's {listing(meta)} {'is' if len(meta) == 1 else 'are'} on the meta device: "
                          f"shapes without values (a model built under torch.device('meta') or accelerate's "
                          f"init_empty_weights). Give it values before wrap(): build it from its config (e.g. "
                          f"AutoModelForCausalLM.from_config; under tiertrain.partitioned_init at zero.stage 3, "
                          f"each rank holds only its shard) and load its weights after wrap with "
                          f"tiertrain.load_pretrained(engine, path), or load it whole (from_pretrained on the CPU); "
                          f"with parallel.pp > 1 a model on the meta device is cut first and each rank builds only "
                          f"its own stages")


def _check_not_data_parallel(model: nn.Module | Sequence[nn.Module]) -> None:
    """A model already under another data-parallel wrapper (DistributedDataParallel, what
    accelerate's prepare(model) returns on several processes; DataParallel; FSDP; parameters that
    are DTensors, from fully_shard or parallelize_module): its hooks would run beside the
    engine's, its names ("module.") would be the checkpoints' and exports', and its shards would
    be taken for whole tensors."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel
    from torch.distributed.tensor import DTensor

    wrappers = (nn.parallel.DistributedDataParallel, nn.DataParallel, FullyShardedDataParallel, FSDPModule)
    modules = _stages(model)
    found = [f"{n or '<the model>'} ({type(m).__name__})" for root in modules for n, m in root.named_modules()
             if isinstance(m, wrappers)]
    found += [f"{n} (a DTensor)" for root in modules for n, p in root.named_parameters() if isinstance(p, DTensor)]
    if found:
        raise ConfigError(f"the model holds {listing(found)}: it is already under another data-parallel or "
                          f"sharding wrapper, whose hooks would reduce or reshard what the engine reduces and shards "
                          f"itself. Give wrap() the plain module: DistributedDataParallel's and DataParallel's "
                          f".module (with accelerate, wrap the model instead of accelerator.prepare(model); prepare "
                          f"the data loader alone), a model before fully_shard / FSDP; for tensor parallelism set "
                          f"parallel.tp instead of parallelize_module")


def _check_unquantised(model: nn.Module | Sequence[nn.Module]) -> None:
    """A trainable parameter stored quantised (fp8 beside its scale, integers): the engine
    trains fp32 masters of what it holds in precision.dtype, which for these would be the
    stored values, not the weights (transformers' FP8Linear computes with a weight wider than a
    byte as already dequantised). Frozen ones are held as stored (precision.held_as_stored)."""
    modules = _stages(model)
    found = [(f"{n} ({t.dtype}, in {type(m.get_submodule(n.rpartition('.')[0])).__name__})")
             for m in modules for n, t in m.named_parameters() if t.requires_grad and stored_quantised(t.dtype)]
    if found:
        raise ConfigError(f"the model's {listing(found)} {'is' if len(found) == 1 else 'are'} trainable and stored "
                          f"quantised: the engine would train the stored values as the weights, without their "
                          f"scales. Freeze them (adapters such as LoRA train beside a frozen quantised model), or "
                          f"train an unquantised model: load it with from_pretrained(path, quantization_config="
                          f"<the method's config>(dequantize=True)) (FineGrainedFP8Config for FP8), or build it "
                          f"from its config, wrap it and call tiertrain.load_pretrained(engine, path), which "
                          f"dequantises block-FP8 checkpoints")


def _check_real(model: nn.Module | Sequence[nn.Module]) -> None:
    """A trainable complex parameter (a Fourier layer's spectral weights): the engine's fp32
    masters and flat buffers are real, so it was cast to one, its imaginary part dropped in
    silence. Frozen ones (and complex buffers, such as rotary freqs_cis) are held as stored."""
    found = [f"{n} ({t.dtype})" for m in _stages(model) for n, t in m.named_parameters()
             if t.requires_grad and t.is_complex()]
    if found:
        raise ConfigError(f"the model's {listing(found)} {'is a' if len(found) == 1 else 'are'} trainable complex "
                          f"parameter{'' if len(found) == 1 else 's'}: the engine keeps real fp32 masters, which "
                          f"would drop the imaginary part. Hold each as a real parameter of shape (..., 2), "
                          f"nn.Parameter(torch.view_as_real(weight)), and use torch.view_as_complex(param) in "
                          f"forward: torch's optimizers step a complex parameter as exactly that real view, so it "
                          f"trains the same values; or freeze it")


def wrap(model: nn.Module | Sequence[nn.Module], config: Config, topology: Topology, loss_fn: LossFn | None = None,
         unit_modules: list[str] | None = None,
         activation_shape: tuple[int, ...] | Callable[[Any], tuple[int, ...]] | None = None,
         update_factory: UpdateFactory = build_update, optimizer: OptimizerArg | None = None,
         param_groups: list[dict] | None = None, lr_scheduler: SchedulerFactory | None = None) -> Engine | PipelineEngine:
    """Wrap any nn.Module for training under config on topology (no model changes needed).

    loss_fn(model, batch) → scalar loss; by default the model is called on the batch and
    its output (a tensor, a dict with 'loss', or an object with .loss) gives the loss.
    unit_modules: stage-3 gather units by module name (default: children of ModuleLists).

    With parallel.pp > 1 this returns a :class:`~tiertrain.pipeline.engine.PipelineEngine`:
    model is a tiertrain GPT or a Hugging Face model of a family tiertrain/pipeline/hf_split.py
    recognises (split into stages here), or this rank's list of stage modules, each called as
    stage(x, batch); activation_shape is the shape of the tensor passed
    between stages for a micro-batch (known for GPT stages), or a function of the batch.
    With activations.checkpoint_every = k > 0, every k-th block (children of ModuleLists)
    recomputes its activations in backward (tiertrain.offload.activations); apply it
    yourself before wrap() to choose other blocks. With activations.mlp_tile_tokens = T > 0,
    every block's MLP runs over tiles of T tokens (tiertrain.tiling.apply_tiled_mlp), undone
    by close(). update_factory builds the optimizer-step
    form from an UpdateContext (tiertrain/update/factory.py); by default the configured one.

    Your own optimizer and schedule (tiertrain/optim.py says which config settings then apply):
    optimizer is an Optimizer subclass (``torch.optim.SGD``), a factory
    ``callable(param_groups) -> Optimizer`` (``functools.partial(torch.optim.SGD, lr=0.1)``)
    or an instance built on the model's parameters (its class, defaults and param_groups are
    read; the engine builds the same optimizer over its flat shards). param_groups: dicts
    whose "params" are parameters or parameter names, plus the group's hyper-parameters
    (e.g. no weight decay for biases and norms). lr_scheduler: ``callable(optimizer) ->
    LRScheduler``, applied to the engine's optimizer and stepped once per update applied.
    With parallel.pp > 1 the groups name the whole model's parameters; each pipeline rank trains
    its stages' share (docs/optimizers.md, "Under pipeline parallelism").
    """
    if config.zero.offload == "auto":
        raise ConfigError("zero.offload='auto' is chosen before a model is built, which wrap() cannot do: train "
                          "with tiertrain.Trainer (it plans, then builds), or plan first with "
                          "tiertrain.trainer.resolve_auto_offload(config, dims, topology) and wrap with the "
                          "config it returns; or set zero.offload='manual'")
    if topology.size("pp") > 1 and (loss_fn is not None or unit_modules is not None):
        raise ConfigError(f"parallel.pp={topology.size('pp')}: loss_fn and unit_modules do not apply to a "
                          f"pipeline (the last stage returns the loss; at zero.stage 3 each stage's blocks are its units)")
    _check_not_held(model)
    _check_not_data_parallel(model)
    built_per_stage = _built_per_stage(model, topology)
    _check_materialized(model, built_per_stage)
    _check_unquantised(model)
    _check_real(model)
    if not built_per_stage:
        check_no_shared_memory(_stages(model))
    _check_context_parallel(model, config, topology)
    if topology.size("pp") == 1 and activation_shape is not None:
        raise ConfigError("activation_shape is for pipeline parallelism; parallel.pp is 1")
    if isinstance(model, nn.Module):
        model = unwrap_compiled(model)  # the model's own names, its hooks outside compiled code
    tiled = _tile_mlps(model, config)
    checkpointing = None
    if (config.activations.checkpoint_every > 0 and isinstance(model, nn.Module)
            and checkpointing_of(model) is None):
        # Before any pipeline split: the stages reuse the model's (now checkpointed) blocks.
        checkpointing = apply_activation_checkpointing(model, config.activations, device=topology.device)
    try:
        if topology.size("pp") > 1:
            # The user's groups name the whole model's parameters (a tied head by either name):
            # resolved before the cut, which gives the last stage a copy of a tied embedding.
            config.validate()
            client = client_optimizer(model if isinstance(model, nn.Module) else list(model), config, optimizer,
                                      param_groups, lr_scheduler)
            stages = pipeline_stages(model, topology, config.parallel.virtual_stages)
            unset = materialize_stages(model, stages, topology) if built_per_stage else None
            if built_per_stage:
                check_no_shared_memory(stages)
            engine = PipelineEngine(stages, config, topology, activation_shape=activation_shape,
                                    update_factory=update_factory, state_io=engine_io, client=client)
            engine.unset_tensors = unset
        else:
            engine = Engine(model, config, topology, loss_fn=loss_fn, unit_modules=unit_modules,
                            update_factory=update_factory, optimizer=optimizer, param_groups=param_groups,
                            lr_scheduler=lr_scheduler, state_io=engine_io)
    except BaseException:
        let_go(_parameters(model))  # (no engine holds them: a later wrap may)
        if checkpointing is not None:  # a failed wrap leaves the model as it found it
            checkpointing.remove()
        for stage in tiled:
            remove_tiled_mlp(stage)
        raise
    if checkpointing is not None:
        engine.undo_on_close(checkpointing.remove)  # close() hands the model back unchanged
    for stage in tiled:
        engine.undo_on_close(functools.partial(remove_tiled_mlp, stage))
    return engine


def _tile_mlps(model, config: Config) -> list[nn.Module]:
    """activations.mlp_tile_tokens: tile the blocks' MLPs of a model that has none tiled
    (returns the modules tiled here, which close() hands back untiled); a model already tiled
    must be tiled with the configured tokens."""
    tile = config.activations.mlp_tile_tokens
    stages = _stages(model)
    with_mlps = [stage for stage in stages if block_mlps(stage)] or stages[:1]  # (a head-only stage has none)
    found = {tiled_mlp_tokens(stage) for stage in with_mlps}
    if found <= {tile}:
        return []
    if found == {0}:
        return [apply_tiled_mlp(stage, tile) for stage in with_mlps]
    raise ConfigError(f"activations.mlp_tile_tokens={tile}, but the model's MLPs were tiled with "
                      f"{' and '.join(map(str, sorted(found)))} tokens: apply_tiled_mlp(model, {tile}) "
                      f"before wrap(), or leave the model untiled for wrap() to tile")


def _check_context_parallel(model, config: Config, topology: Topology) -> None:
    """A cp > 1 topology trains a model converted for it (each rank then holds its tokens'
    activations only); otherwise every rank would silently compute the whole sequence. With
    parallel.pp > 1 too, wrap() cuts the converted model into stages, every schedule: each
    stage's cp ranks run the same schedule, so their ring or all-to-all exchanges pair up in order."""
    cp = topology.size("cp")
    tile = config.activations.loss_tile_tokens
    if cp == 1:
        if tile:
            raise ConfigError(f"activations.loss_tile_tokens={tile} applies to context-parallel models "
                              f"(parallel.cp > 1); with parallel.cp=1 set it to 0")
        return
    if isinstance(model, (list, tuple, nn.ModuleList)) and len(model):
        # (pp > 1: this rank's stages, which carry their model's cp attributes as tiertrain's
        # GPT and Hugging Face stages do: tiertrain/pipeline/stage.py, hf_split.py)
        model = model[0]
    converted = getattr(model, "cp_size", 1)
    if converted != cp:
        raise ConfigError(f"parallel.cp={cp}, but the model {'was converted for cp=' + str(converted) if converted > 1 else 'is not context-parallel'}: "
                          f"convert it with tiertrain.parallel.apply_context_parallel(model, topology, "
                          f"algorithm=config.parallel.cp_algorithm) before wrap()")
    if getattr(model, "cp_loss_tile", 0) != tile:
        raise ConfigError(f"activations.loss_tile_tokens={tile}, but the model was converted with "
                          f"loss_tile_tokens={model.cp_loss_tile}: pass the same to apply_context_parallel")
    if getattr(model, "cp_algorithm", config.parallel.cp_algorithm) != config.parallel.cp_algorithm:
        raise ConfigError(f"parallel.cp_algorithm={config.parallel.cp_algorithm!r}, but the model was converted "
                          f"with {model.cp_algorithm!r}")
