"""The run plan: every choice the configuration makes about how an engine trains, made once,
as types, before any of the engine's parts is built (tiertrain/engine_build.py reads it;
``engine.plan`` shows it).

What it decides, from the Config, the topology's collectives, the client optimizer and the
gradient plan (zero/plan.py):

* the ZeRO stage as a strategy (zero/stages.py: which of P_os, P_g, P_p of ZeRO §5 it
  partitions), asked by name instead of by comparing ``zero.stage`` to an int;
* where the parameter shards live: the ShardStore of the parameter tier (offload/
  shard_store.py: device memory, pinned host memory, swap files) and whether an NVMe swapper
  is needed (ZeRO-Infinity);
* what the gradients go through: reductions launched as gradients arrive (lazy zeroing) or
  by a pipeline schedule, fp16 loss scaling, tensor-parallel partial sums, which pieces count
  in the norm, and from these whether anything global changes a gradient after its reduction;
* the optimizer-step form (update/factory.py choose_form: whole-parameter, NVMe, overlapped
  NVMe, delayed, in memory), chosen from those facts in the factory's order;
* at stages 2-3 with gradient accumulation, whether gradients accumulate on the device and
  are reduced once per step, or are reduced into the shard every micro-batch
  (zero.accumulate_on_device; zero/accumulation.py decides ``auto`` and says why).

``config.zero.stage`` stays the user's int; the plan is what runtime code reads.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Callable

import torch

from .device import acts_as_accelerator
from .offload.shard_store import DeviceShards, store_for
from .tiers import Tier
from .update.factory import choose_form
from .update.protocol import OptimizerUpdate
from .zero.accumulation import DeviceAccumulation, accumulator_bytes, decide
from .zero.plan import GradientPieces, GradientPlan, gradient_pieces
from .zero.stages import ZeroStage

if TYPE_CHECKING:
    from .config import Config
    from .optim import ClientOptimizer


@dataclass(frozen=True)
class RunPlan:
    """How this rank's engine trains; made by :func:`resolve_run_plan`, read-only after."""

    stage: ZeroStage
    """The ZeRO stage: what is partitioned over the data-parallel ranks (ZeRO §5)."""
    optimizer_tier: Tier
    """Where masters, optimizer states and gradient shards live (zero.offload_optimizer)."""
    param_tier: Tier
    """Where the partitioned parameter shards live (zero.offload_params)."""
    store: type[DeviceShards]
    """The ShardStore of param_tier (offload/shard_store.py)."""
    needs_swapper: bool
    """A tier is on NVMe: the engine opens a swap directory (io/swap.py TensorSwapper)."""
    lazy_zero: bool
    """Reductions launch as gradients arrive (the gradient plan's launch_when_ready; a
    pipeline's schedule launches its own) and overwrite each gradient whole, so zeroing may
    only mark gradients stale."""
    scales_loss: bool
    """fp16: a dynamic loss scale, unscaled (a global change) before the step."""
    tp_partial_sums: bool
    """Sequence-parallel partial gradients on this rank are summed over tp at each step."""
    clips: bool
    """optimizer.grad_clip > 0: the global norm rescales every gradient before the step."""
    gradient_pieces: GradientPieces
    """Which pieces of this rank's gradient shards count in the norm and are tp partial sums."""
    update: type[OptimizerUpdate]
    """The optimizer-step form build_update builds (a custom update_factory may build another)."""
    accumulation: DeviceAccumulation = DeviceAccumulation(False, "not decided", applies=False)
    """Stages 2-3 with accumulation: gradients accumulate on the device and are reduced once per
    step, or are reduced every micro-batch (zero.accumulate_on_device), and why."""

    @property
    def global_gradient_changes(self) -> bool:
        """Something global (clipping, an fp16 unscale, a tensor-parallel sum of partial
        gradients) changes the gradients after their reduction: no unit may be updated before
        step()."""
        return self.clips or self.scales_loss or self.tp_partial_sums

    @property
    def gradients_final_at_landing(self) -> bool:
        """Nothing changes a gradient shard after its reduction has landed and the norm
        counts every shard whole: its squared norm may be taken then, during backward."""
        return not self.scales_loss and self.gradient_pieces.counted is None and not self.tp_partial_sums

    @property
    def gradient_views_held(self) -> bool:
        """The engine keeps views of the gradient shards across steps (a norm over a subset
        of them, tensor-parallel partial gradients): no form may replace their buffers."""
        return self.gradient_pieces.counted is not None or bool(self.gradient_pieces.partial)

    def describe(self) -> str:
        """One line for logs."""
        swap = ", NVMe swapper" if self.needs_swapper else ""
        launch = "as gradients arrive" if self.lazy_zero else "by the schedule"
        after = "changed after reduction" if self.global_gradient_changes else "final once reduced"
        return (f"zero {self.stage}; parameter shards on {self.param_tier.value} ({self.store.__name__}), "
                f"optimizer on {self.optimizer_tier.value}{swap}; reductions {launch}; gradients {after}; "
                f"update {self.update.__name__}; {self.accumulation.describe()}")

    __str__ = describe


def resolve_run_plan(config: "Config", client: "ClientOptimizer | None", gradient_plan: GradientPlan, *,
                     dp_rank: int, tp_rank: int, tp_size: int,
                     device: torch.device = torch.device("cpu"),
                     free_device_bytes: Callable[[], int | None] = lambda: None) -> RunPlan:
    """The plan of a validated config on one rank: dp_rank, tp_rank, tp_size are the engine's
    collectives' (its data-parallel × context-parallel group and its tensor-parallel group);
    device: the compute device; free_device_bytes: its free memory, asked only where
    zero.accumulate_on_device=auto needs it (zero/accumulation.py agreed_free_memory: the least
    over the data-parallel group, a collective every rank of it reaches alike).
    The whole-parameter form's limits are checked when it is built (update/factory.py)."""
    stage = ZeroStage.of(config)
    zc = config.zero
    optimizer_tier, param_tier = Tier(zc.offload_optimizer), Tier(zc.offload_params)
    shard_rank = dp_rank if gradient_plan.layout.num_shards > 1 else 0  # (as FlatParameters.shard_rank)
    pieces = gradient_pieces(gradient_plan, shard_rank, tp_rank0=tp_rank == 0)
    plan = RunPlan(
        stage=stage, optimizer_tier=optimizer_tier, param_tier=param_tier, store=store_for(param_tier),
        needs_swapper=Tier.NVME in (optimizer_tier, param_tier), lazy_zero=gradient_plan.launch_when_ready,
        scales_loss=config.precision.dtype == "fp16", tp_partial_sums=tp_size > 1 and bool(pieces.partial),
        clips=config.optimizer.grad_clip > 0, gradient_pieces=pieces, update=OptimizerUpdate,
        accumulation=decide(zc.accumulate_on_device, stage=stage.value, accum=config.batch.grad_accum_steps,
                            launch_when_ready=gradient_plan.launch_when_ready,
                            extra_bytes=accumulator_bytes(u.padded_numel for u in gradient_plan.layout.units),
                            accelerator=acts_as_accelerator(device), free_device_bytes=free_device_bytes))
    form = choose_form(config, whole_groups=client is not None and bool(client.whole_groups),
                       lazy_zero=plan.lazy_zero, global_gradient_changes=plan.global_gradient_changes,
                       tp_partial_sums=plan.tp_partial_sums)
    return replace(plan, update=form)  # (the form depends on the facts above: chosen from them)
