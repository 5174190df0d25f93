"""Which parameters an engine trains and how: the flat layout they are packed into, whether
their gradient reductions launch as gradients arrive, and which gradients count in the
global norm. One model gets :func:`default_plan`; a pipeline builds its own
(tiertrain/pipeline/engine.py: per-chunk buckets, reductions launched by the schedule, the
tied embedding's copy left out of the norm)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from ..blocks import list_children
from ..config import Config, ConfigError
from ..precision import compute_dtype, held_as_stored, kept_in_fp32, named_in
from .construct import full_shape, is_partitioned
from .layout import FlatLayout, bucket_layout, module_layout
from .stages import ZeroStage


def default_unit_modules(model: nn.Module, min_params: int = 0) -> list[str]:
    """Stage-3 units: each child of every nn.ModuleList (transformer blocks: blocks.list_children),
    plus the root. A model without one (a CNN, a Sequential ResNet) is cut by size instead
    (:func:`size_based_unit_modules`, ``min_params``; 0: a sixteenth of the model): as one
    root unit it would be gathered whole, and stage 3 would save nothing."""
    prefixes = list_children(model)
    if prefixes:
        return prefixes
    total = sum(full_shape(p).numel() for p in model.parameters())
    return size_based_unit_modules(model, min_params or max(1, total // 16))


def size_based_unit_modules(model: nn.Module, min_params: int) -> list[str]:
    """FSDP's size_based_auto_wrap_policy as unit prefixes: children first, a module becomes a
    unit once the parameters it holds outside the units below it number ``min_params`` or
    more; what is left stays in the root unit. A parametrized module's parametrizations (the
    weight they compute, its originals) belong to it: never a unit of their own."""
    units: list[str] = []
    inside = {id(sub) for m in model.modules() if parametrize.is_parametrized(m)
              for sub in m.parametrizations.modules()}

    def visit(name: str, module: nn.Module) -> int:
        left = sum(full_shape(p).numel() for p in module.parameters(recurse=False))
        for child, sub in module.named_children():
            left += visit(f"{name}.{child}" if name else child, sub)
        if name and left >= min_params and id(module) not in inside:
            units.append(name)
            return 0
        return left
    visit("", model)
    return units


def parameter_aliases(model: nn.Module) -> dict[str, list[str]]:
    """For each parameter registered under several names (tied weights), by its first name
    (the one named_parameters() gives): all of its names."""
    names: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), []).append(name)
    return {group[0]: group for group in names.values() if len(group) > 1}


@dataclass(frozen=True)
class GradientPlan:
    """Which parameters the engine trains, in which flat layout, and how their gradients are
    reduced and counted. The default (:func:`default_plan`) serves one model; a pipeline
    passes its own (per-chunk buckets, reductions launched by the schedule, a tied copy left
    out of the norm)."""

    named: list[tuple[str, nn.Parameter]]
    """The trainable parameters, by name, in layout order."""
    layout: FlatLayout
    """How they are packed into flat units and sharded over dp."""
    launch_when_ready: bool = True
    """Reductions start as each unit's gradients arrive; False: the caller launches them."""
    counts_in_norm: Callable[[str], bool] = field(default=lambda name: True)
    """Whether a parameter's gradient counts in the global norm."""
    frozen: list[tuple[str, nn.Parameter]] = field(default_factory=list)
    """Frozen parameters partitioned in the layout's frozen units (stage 3), by name."""


def frozen_for_units(model: nn.Module, compute: torch.dtype) -> list[tuple[str, nn.Parameter]]:
    """The frozen parameters stage 3 partitions in frozen units (at a compute dtype). Not one
    held as stored (precision.held_as_stored: a quantised weight, an index table), which cannot
    live in the compute-dtype flat buffers: it stays whole on every rank in its own dtype, as
    buffers do; nor one the model keeps in fp32 (precision.kept_in_fp32: a frozen MoE router),
    which stays whole in fp32."""
    fp32 = kept_in_fp32(model, compute)
    return [(n, p) for n, p in model.named_parameters()
            if not p.requires_grad and not held_as_stored(p, compute) and not named_in(fp32, n)]


def default_plan(model: nn.Module, config: Config, dp: int, unit_modules: list[str] | None = None) -> GradientPlan:
    """Every trainable parameter of the model; stage 3: one unit per unit module (default:
    children of ModuleLists) plus the root; stages 0-2: buckets of zero.bucket_mb.

    Frozen parameters (requires_grad=False) are partitioned too at stage 3, in frozen units
    beside their module's trained unit (ZeRO-3 shards every parameter, not only those it
    trains: a frozen backbone under adapters is most of the model); at stages 0-2 they stay
    whole on every rank, as data parallelism keeps them."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if not named:
        raise ValueError("the model has no trainable parameters")
    frozen = frozen_for_units(model, compute_dtype(config.precision.dtype))
    zc, stage = config.zero, ZeroStage.of(config)
    if stage.partitions_parameters:
        prefixes = default_unit_modules(model, zc.unit_params) if unit_modules is None else list(unit_modules)
        for prefix in prefixes:
            model.get_submodule(prefix)  # raises AttributeError naming a bad prefix
        layout = module_layout(named, prefixes, dp, zc.persistence_threshold, shape_of=full_shape,
                               frozen_params=frozen, aliases=parameter_aliases(model))
        in_layout = {s.name for u in layout.frozen for s in u.slots}
        return GradientPlan(named, layout, frozen=[(n, p) for n, p in frozen if n in in_layout])
    if any(is_partitioned(p) for _, p in named + frozen):
        raise ConfigError(f"zero.stage={zc.stage}: a model built under partitioned_init needs zero.stage=3")
    bucket_numel = max(1, int(zc.bucket_mb * 2**20) // 4)
    return GradientPlan(named, bucket_layout(named, stage.shards_over(dp), bucket_numel))


Piece = tuple[int, int, int]
"""(trained unit index, start, end) of a piece of this rank's gradient shard, shard-local."""


@dataclass(frozen=True)
class GradientPieces:
    """The pieces of this rank's gradient shards the engine keeps views of, found from the
    plan before any buffer exists (tiertrain/run_plan.py reads what they imply)."""

    counted: tuple[Piece, ...] | None
    """The pieces counted in the global norm; None: all of every unit's shard."""
    partial: tuple[Piece, ...]
    """Sequence-parallel partial gradients, summed over tp at each step."""


def gradient_pieces(plan: GradientPlan, shard_rank: int, tp_rank0: bool) -> GradientPieces:
    """The plan's :class:`GradientPieces` on the rank owning shard ``shard_rank`` of each unit
    (tp_rank0: it is tensor-parallel rank 0)."""
    params = dict(plan.named + plan.frozen)
    partial, counted, all_counted = [], [], True
    for unit in plan.layout.units:
        for slot, a, b in unit.shard_pieces(shard_rank):
            param = params[slot.name]
            # Replicated parameters count once across tp (on tp rank 0), as in Megatron.
            if plan.counts_in_norm(slot.name) and (tp_rank0 or getattr(param, "tp_sharded", False)):
                counted.append((unit.index, a, b))
            else:
                all_counted = False
            if getattr(param, "tp_partial_grad", False):
                partial.append((unit.index, a, b))
    return GradientPieces(None if all_counted else tuple(counted), tuple(partial))
