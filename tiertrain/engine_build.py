"""Building an engine's parts (tiertrain/engine.py): from the gradient plan, the flat layout's
buffers (zero/flat.py) on the tiers the config places them (and the NVMe swapper when a tier
is NVMe), stage 3's parameter fetcher (zero/stage3.py), the gradient reducer
(zero/reducer.py), the loss scaler and the optimizer-step form (update/factory.py), each
with what close() undoes registered on the engine. The engine then only trains with them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from .buffers import ModuleBuffers
from .config import Config
from .device import DeviceStreams, acts_as_accelerator, pins_host
from .module_dtypes import cast_buffers_and_frozen
from .offload.shard_store import shard_store
from .precision import DynamicLossScaler
from .update.factory import UpdateContext, UpdateFactory
from .zero.agreement import Event
from .zero.construct import forget_partition, gather_partitioned, is_partitioned
from .zero.flat import NVME_READ_AHEAD, SWAP_BLOCK_BYTES, FlatParameters, Placement, swap_pool_bytes
from .zero.layout import ROOT, FlatLayout
from .zero.lockstep import generate_in_lockstep, refuse_layerdrop
from .zero.plan import GradientPieces, GradientPlan
from .zero.reducer import GradientReducer
from .zero.stage3 import ParameterFetcher

if TYPE_CHECKING:
    from .engine import Engine
    from .training_core import TrainingCore


def build_parts(engine: "TrainingCore", model: nn.Module, plan: GradientPlan, update_factory: UpdateFactory,
                client: Any, one_model_fetcher: bool) -> None:
    """Set engine's parts, in this order: layout and launch_when_ready (from plan), buffers,
    placement, swapper, flat, fetcher, reducer, the gradient views of the norm and of tp's
    partial sums, scaler and update. The fetcher is stage 3's one-model ParameterFetcher,
    built only when one_model_fetcher (tiertrain.Engine) and None otherwise: a pipeline engine
    gathers inside its schedule with its own (pipeline/zero3.py). What to build is the run
    plan's choice (engine.plan: tiertrain/run_plan.py)."""
    config, topology, run = engine.config, engine.topology, engine.plan
    stage = run.stage
    in_lockstep = stage.partitions_parameters and engine.comm.size > 1  # (zero/lockstep.py)
    if in_lockstep:
        refuse_layerdrop(model, engine.comm.size)
    named, engine.layout, engine.launch_when_ready = plan.named, plan.layout, plan.launch_when_ready
    cast_buffers_and_frozen(engine, model, {n for n, _ in plan.frozen}, lambda p: initial_value(p, engine))
    engine.buffers = ModuleBuffers(engine.named_modules_of_state())
    """The model's persistent buffers: checkpointed, in full_state_dict, broadcast (zero.broadcast_buffers)."""
    if engine.comm.size > 1:  # (rank 0's, as DDP syncs module states at construction: see initial_value)
        engine.buffers.broadcast(engine.comm)
    engine.placement = Placement(engine.device, optimizer_tier=run.optimizer_tier, param_tier=run.param_tier)
    engine.swapper = build_swapper(engine) if run.needs_swapper else None
    shards = shard_store(engine.placement, engine.dtype, DeviceStreams(engine.placement.compute), engine.swapper,
                         kept_units=config.zero.nvme_kept_units,
                         read_ahead=NVME_READ_AHEAD + 1, kind=run.store)  # (+ the unit being gathered)
    engine.flat = FlatParameters(
        engine.layout, dict(named + plan.frozen), engine.comm, engine.dtype, keep_full_grads=stage.keeps_full_gradients,
        shards=shards, rebuild_param=lambda p: initial_value(p, engine),
        placement=engine.placement)
    engine._waits_per_operation = False
    if config.zero.overlap_param_gather:
        # Parameter gathers left running by a step are completed before model.state_dict()
        # hands out the parameters' storage, and before a forward called on the model
        # directly, not through the engine (which waits per operation).
        engine._on_close += [
            model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: engine.flat.wait_gathers()).remove,
            model.register_forward_pre_hook(torch.compiler.disable(
                lambda module, args: None if engine._waits_per_operation else engine.flat.wait_gathers()),
                prepend=True).remove]
    for _, p in named + plan.frozen:
        forget_partition(p)  # the flat buffers own the shard now

    engine.fetcher = None
    if stage.partitions_parameters and one_model_fetcher:
        modules, frozen_of = stage3_unit_modules(model, engine.layout)
        engine.fetcher = ParameterFetcher(
            engine.flat, engine.comm, modules, prefetch_bytes=int(prefetch_mb(config, engine.device) * 2**20),
            max_live_bytes=int(config.zero.max_live_mb * 2**20), check=config.zero.stage3_check,
            frozen_of=frozen_of)
        engine.fetcher.before_outside = engine._before_outside_forward
    if in_lockstep:
        engine._on_close.append(generate_in_lockstep(model))
    if stage.partitions_parameters:
        # Backward completes blocks last-first, then the root (embeddings are used first
        # in forward, so their gradients come last), then the persistent small parameters.
        partitioned = [u.index for u in engine.layout.units if not u.resident]
        resident = [u.index for u in engine.layout.units if u.resident]
        launch_order = partitioned[1:][::-1] + partitioned[:1] + resident
    else:
        launch_order = list(range(len(engine.layout.units)))
    engine.reducer = GradientReducer(
        engine.flat, engine.comm, stage, launch_order,
        launch_when_ready=engine.launch_when_ready, accumulate=run.accumulation.on,
        defer_landing=config.batch.grad_accum_steps > 1, keep_spares=config.zero.retain_host_memory)
    engine.fetcher_subscription = None
    if engine.fetcher is not None:  # (subscribed first: it runs before any update form's hooks)
        fetcher = engine.fetcher
        engine.fetcher_subscription = engine.reducer.subscribe(
            unit_done=fetcher.on_unit_grads_done, before_collective=lambda i: fetcher.agree(Event.REDUCE, i))
    engine._on_close.append(engine.reducer.remove)
    if engine.fetcher is not None:
        engine._on_close.append(engine.fetcher.remove)
    if engine.swapper is not None:
        engine._on_close.append(engine.swapper.close)  # (removes this rank's swap directory)

    engine._norm_grads, engine._partial_grads = gradient_views(engine.flat, run.gradient_pieces)
    engine.scaler = DynamicLossScaler(config.precision.loss_scale, enabled=run.scales_loss)
    engine.client_optimizer = client
    """The optimizer the user brought (tiertrain/optim.py ClientOptimizer); None: the default AdamW."""
    engine.update = update_factory(UpdateContext(
        engine.flat, config, topology, engine.reducer, engine.swapper, lazy_zero=run.lazy_zero,
        global_gradient_changes=run.global_gradient_changes,
        gradients_final_at_landing=run.gradients_final_at_landing, gradient_views_held=run.gradient_views_held,
        optimizer=client, form=run.update))
    """The optimizer step, in the form the configuration asks for (tiertrain/update/)."""
    engine._on_close.append(engine.update.close)  # (first undone: its thread, its swap files)


def stage3_unit_modules(model: nn.Module, layout: FlatLayout) -> tuple[dict[int, nn.Module], dict[int, list[int]]]:
    """Stage 3: the module whose hooks gather each partitioned unit (by the unit's index;
    a module with trained parameters is keyed by its trained unit), and the frozen units
    gathered with each."""
    def module(label: str) -> nn.Module:
        return model if label == ROOT else model.get_submodule(label)

    keys = {u.label: u.index for u in layout.units if not u.resident}
    frozen_of: dict[int, list[int]] = {}
    for u in layout.frozen:
        key = keys.setdefault(u.label, u.index)
        frozen_of.setdefault(key, []).append(u.index)
    return {index: module(label) for label, index in keys.items()}, frozen_of


def initial_value(p: nn.Parameter, engine: "TrainingCore") -> torch.Tensor:
    """A parameter's value to train from, the same on every rank of the engine's data-parallel
    group: one built partitioned gathered from its shards; any other rank 0's, broadcast as DDP
    and DeepSpeed do at construction. Ranks seeded differently, or a checkpoint loaded on rank 0
    only, then start from one model, instead of training replicas that drift apart (stage 0) or
    one cut from several models (each rank's shard from its own: stages 1-3)."""
    if is_partitioned(p):
        return gather_partitioned(p, engine.comm)
    value = p.detach()
    if engine.comm.size > 1:
        value = value.to(engine.device).contiguous()  # (the backend's device; in place where it is already)
        engine.comm.broadcast(value, 0)
    return value


def build_swapper(engine: "Engine"):
    """This rank's swap directory under zero.nvme_path, with a buffer pool large enough
    for the prefetch depth of ZeRO-Infinity (reads of 3 units ahead, in the half of the
    pool prefetches may hold) and as much again for writes."""
    from .io import AlignedBufferPool, AsyncIO, TensorSwapper

    block = SWAP_BLOCK_BYTES
    largest = max(u.shard_numel for u in engine.layout.all_units) * torch.finfo(engine.dtype).bits // 8
    pin = pins_host(engine.device)
    aio = AsyncIO(num_threads=4, block_bytes=block)
    engine._on_close.append(aio.close)  # the swapper does not own its IO threads
    return TensorSwapper(engine.config.zero.nvme_path, aio,
                         AlignedBufferPool(swap_pool_bytes(largest), block, pin=pin), rank=engine.topology.rank,
                         create=True)


def prefetch_mb(config: Config, device: torch.device) -> float:
    """zero.prefetch_mb, or its default for this device. On CPU, gloo's collectives run on
    the same cores as the compute they would overlap: asynchronous prefetch measured 10%
    slower than none at stage 3 (bench/results/zero_interleaved.md); on an accelerator the
    copy and communication engines run beside the compute, and prefetch hides them."""
    if config.zero.prefetch_mb is not None:
        return config.zero.prefetch_mb
    return 64.0 if acts_as_accelerator(device) else 0.0


def gradient_views(flat: FlatParameters, pieces: GradientPieces):
    """(gradient pieces counted in the global norm, None meaning all of every unit's
    shard; sequence-parallel partial gradients, summed over tp at each step): views of the
    flat gradient shards at the run plan's pieces (zero/plan.py gradient_pieces)."""
    def views(found):
        return [flat.units[index].grad[a:b] for index, a, b in found]
    return (None if pieces.counted is None else views(pieces.counted)), views(pieces.partial)
