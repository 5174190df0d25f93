"""Chooses the optimizer-step form once, from the configuration (tiertrain/update/protocol.py).

The engine takes any factory with this signature (``Engine(..., update_factory=...)``,
``tiertrain.wrap(..., update_factory=...)``): a form of one's own plugs in without an edit to
the engine."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import torch.distributed as dist

from ..config import ConfigError
from ..tiers import Tier
from .delayed import DelayedUpdate
from .in_memory import InMemoryUpdate
from .nvme.form import NVMeUpdate, OverlappedNVMeUpdate
from .overlapped_host import OverlappedHostUpdate
from .protocol import LandingNorms, OptimizerUpdate
from .whole import WholeParameterUpdate

if TYPE_CHECKING:
    from ..config import Config
    from ..optim import ClientOptimizer
    from ..topology import Topology
    from ..zero.flat import FlatParameters
    from ..zero.reducer import GradientReducer


@dataclass(frozen=True)
class UpdateContext:
    """What the engine offers an update form to be built from."""

    flat: "FlatParameters"
    """The flat units: masters, gradient shards, compute shards of this rank."""
    config: "Config"
    """The whole configuration (optimizer, schedule, zero sections)."""
    topology: "Topology"
    """This rank's place in the process grid."""
    reducer: "GradientReducer"
    """Gradient reduction: update forms subscribe to it (GradientReducer.subscribe) for units whose reduction landed."""
    swapper: Any
    """The NVMe swapper (TensorSwapper) when a tier is on NVMe, else None."""
    lazy_zero: bool
    """Reductions launch as gradients arrive and overwrite each gradient whole: zeroing may
    only mark gradients stale."""
    global_gradient_changes: bool
    """Something global (clipping, an fp16 unscale, a tensor-parallel sum of partial gradients)
    changes the gradients after their reduction, so no unit may be updated before step()."""
    gradients_final_at_landing: bool = False
    """Nothing changes a gradient shard after its reduction at the accumulation boundary has
    landed (no fp16 unscale, no tensor-parallel sum of partial gradients): its squared norm may
    be taken then, during backward."""
    gradient_views_held: bool = True
    """The engine keeps views of the gradient shards across steps (tensor-parallel partial
    gradients, a norm over a subset of them): no form may replace the shards' buffers."""
    optimizer: "ClientOptimizer | None" = None
    """The optimizer, param groups and lr_scheduler the user brought (tiertrain/optim.py
    client_optimizer); None: the default AdamW with config.schedule."""
    form: "type[OptimizerUpdate] | None" = None
    """The form the run plan chose (tiertrain/run_plan.py, by :func:`choose_form`); None: chosen
    here from the fields above, the same way."""


UpdateFactory = Callable[[UpdateContext], OptimizerUpdate]


def choose_form(config: "Config", *, whole_groups: bool, lazy_zero: bool,
                global_gradient_changes: bool, tp_partial_sums: bool | None = None) -> type[OptimizerUpdate]:
    """The form for this configuration, decided in this order:

    * a client optimizer with groups that need whole tensors (Muon, Adafactor: found by
      tiertrain/optim_probe.py; ``whole_groups``) → each of their parameters updated whole by
      one owning rank, its state in memory or, on the NVMe tier, streamed per tensor
      (update/whole.py);
    * ``zero.offload_optimizer: nvme`` → the NVMe optimizer; overlapped with backward when
      ``zero.overlap_nvme_step`` is set, reductions launch as gradients arrive (``lazy_zero``)
      and nothing global changes the gradients after their reduction;
    * ``zero.delayed_update`` → ZeRO-Offload's one-step delayed update;
    * ``zero.overlap_cpu_step`` → the CPU tier's step during the boundary backward, unit by
      unit, speculative (update/overlapped_host.py); refused where an fp16 unscale or a
      tensor-parallel sum changes the gradients after their reduction;
    * otherwise torch AdamW in memory (device or CPU tier).

    Each form builds the client's optimizer instead of the default AdamW when there is one;
    the NVMe form streams only Adam/AdamW (update/nvme/form.py)."""
    zc = config.zero
    if whole_groups:
        return WholeParameterUpdate
    if zc.offload_optimizer == Tier.NVME:
        if zc.overlap_nvme_step and lazy_zero and not global_gradient_changes:
            return OverlappedNVMeUpdate
        return NVMeUpdate
    if zc.delayed_update:
        return DelayedUpdate
    if zc.overlap_cpu_step:
        if tp_partial_sums is None:  # (not given: whatever global change neither a clip nor fp16 explains)
            tp_partial_sums = global_gradient_changes and not (config.optimizer.grad_clip > 0
                                                               or config.precision.dtype == "fp16")
        if tp_partial_sums or not lazy_zero:
            why = ("the reductions are launched by a schedule, not as gradients arrive" if not lazy_zero else
                   "a tensor-parallel sum of partial gradients (sequence parallelism) changes them after their "
                   "reduction")
            raise ConfigError(f"zero.overlap_cpu_step=True updates each unit as its gradient reduction lands, but "
                              f"here {why}: set zero.overlap_cpu_step=false")
        return OverlappedHostUpdate
    return InMemoryUpdate


def build_update(context: UpdateContext) -> OptimizerUpdate:
    """The form the run plan chose (context.form), or :func:`choose_form`'s for this context,
    built from the context."""
    c = context
    form = c.form or choose_form(c.config, whole_groups=c.optimizer is not None and bool(c.optimizer.whole_groups),
                                 lazy_zero=c.lazy_zero, global_gradient_changes=c.global_gradient_changes)
    if form not in _BUILDERS:
        raise ValueError(f"UpdateContext.form={form!r} is not a form build_update builds: one of "
                         f"{', '.join(f.__name__ for f in _BUILDERS)} (or give update_factory= a factory of your own)")
    return _BUILDERS[form](c)


def _whole(c: UpdateContext) -> OptimizerUpdate:
    _check_whole(c)
    return WholeParameterUpdate(c.flat, c.config, c.lazy_zero, c.optimizer,
                                swapper=c.swapper if c.config.zero.offload_optimizer == Tier.NVME else None)


def _overlapped_nvme(c: UpdateContext) -> OptimizerUpdate:
    return OverlappedNVMeUpdate(c.flat, c.config, c.lazy_zero, c.swapper, c.topology.rank, c.reducer, c.optimizer)


def _nvme(c: UpdateContext) -> OptimizerUpdate:
    return NVMeUpdate(c.flat, c.config, c.lazy_zero, c.swapper, c.topology.rank, c.optimizer)


def _landing_norms(c: UpdateContext) -> LandingNorms | None:
    """On the CPU tier each unit's gradient norm is taken as its reduction lands (protocol.LandingNorms)."""
    return LandingNorms(c.flat, c.reducer) if (c.gradients_final_at_landing and c.lazy_zero
                                               and c.flat.placement.offload_optimizer) else None


def _delayed(c: UpdateContext) -> OptimizerUpdate:
    norms = _landing_norms(c)
    group = c.topology.world_group() if dist.is_initialized() else None
    return DelayedUpdate(c.flat, c.config, c.lazy_zero, group, c.topology.device, c.optimizer, norms,
                         swap_gradients=not c.gradient_views_held)


def _overlapped_host(c: UpdateContext) -> OptimizerUpdate:
    if c.optimizer is not None:
        raise ConfigError(f"zero.overlap_cpu_step=True updates with the compiled AdamW pass, writing beside the "
                          f"state; the optimizer brought to wrap() ({c.optimizer.name}) steps itself, in place: "
                          f"set zero.overlap_cpu_step=false, or train with the configured AdamW")
    group = c.topology.world_group() if dist.is_initialized() else None
    return OverlappedHostUpdate(c.flat, c.config, c.lazy_zero, c.reducer, group, c.topology.device,
                                _landing_norms(c))


def _in_memory(c: UpdateContext) -> OptimizerUpdate:
    return InMemoryUpdate(c.flat, c.config, c.lazy_zero, c.optimizer, _landing_norms(c))


_BUILDERS: dict[type, Callable[[UpdateContext], OptimizerUpdate]] = {
    WholeParameterUpdate: _whole, OverlappedNVMeUpdate: _overlapped_nvme, NVMeUpdate: _nvme,
    DelayedUpdate: _delayed, OverlappedHostUpdate: _overlapped_host, InMemoryUpdate: _in_memory}
"""How each form chosen by choose_form is built from the context."""


def _check_whole(c: UpdateContext) -> None:
    """What the whole-parameter form cannot do, refused naming why."""
    why = (f"optimizer {c.optimizer.name} needs whole tensors ({c.optimizer.why_whole}), so each of its "
           f"parameters is updated whole by one data-parallel rank")
    tp = c.topology.size("tp")
    if tp > 1:
        raise ConfigError(f"{why}; with parallel.tp={tp} each matrix is split over the tensor-parallel ranks, and "
                          f"its slices would be stepped as if each were the whole matrix: use parallel.tp=1 with "
                          f"this optimizer, or an elementwise one (AdamW, SGD, ...)")
    if c.config.optimizer.impl == "compiled":
        raise ConfigError(f"{why}; optimizer.impl=compiled is the default AdamW's kernel: leave optimizer.impl "
                          f"at auto")
    if c.config.zero.overlap_cpu_step:
        raise ConfigError(f"{why}; zero.overlap_cpu_step (the flat shards stepped unit by unit during backward) "
                          f"does not run it: set zero.overlap_cpu_step=false")
    if c.config.zero.delayed_update:
        raise ConfigError(f"{why}; zero.delayed_update (ZeRO-Offload's one-step delayed update over the flat "
                          f"shards) does not run it: set zero.delayed_update: false")
