"""AdamW over (sharded) fp32 master tensors, warmup + cosine schedule, the weight-decay
grouping shared by the engine and by single-process references, and the optimizer and
schedule a user brings (``tiertrain.wrap(..., optimizer=, param_groups=, lr_scheduler=)``),
resolved here against the model's parameter names before the engine builds the same
optimizer over its flat shards (tiertrain/update/protocol.py).

**Which settings apply.** ``config.optimizer`` (lr, betas, eps, weight_decay,
weight_decay_on, impl) and ``config.schedule`` describe the *default* optimizer, torch AdamW:

* nothing given: AdamW from config, decay split by ``optimizer.weight_decay_on``, the rate of
  ``config.schedule`` set into every group at each update (the engine's original path);
* ``param_groups=`` and/or ``lr_scheduler=`` without ``optimizer=``: AdamW from config over
  those groups (a group's own keys win; weight_decay defaults to config's), scheduled by
  ``lr_scheduler`` or else by ``config.schedule`` as a LambdaLR, which scales each group's own
  lr (the same float the default path computes for one group);
* ``optimizer=``: config.optimizer's hyper-parameters and config.schedule do not apply. The
  groups' own hyper-parameters are used, changed only by ``lr_scheduler`` (none: constant).

``optimizer.grad_clip`` applies in every case. Schedulers step once per update applied (an
fp16 step skipped on overflow steps nothing), as DeepSpeed does.

An elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...) is stepped over *pieces*
of parameters (each rank's slice of a flat shard). One that reads a whole tensor at once
(Muon, Adafactor, a user's own) is found by what it does (tiertrain/optim_probe.py), and its
groups take the whole-parameter path (tiertrain/update/whole.py): each parameter updated whole
by one rank. Several optimizers over disjoint parameters (``optimizer=[Muon(hidden),
AdamW(rest)]``) step as one (tiertrain/optimizer_list.py). One that needs more than gradients
(LBFGS's closure, SparseAdam's sparse gradients) is refused. Every ZeRO stage and the CPU tier
run any of these; the NVMe tier streams AdamW, Adam and SGD over the flat shards
(tiertrain/elementwise.py: one lr and one set of rule hyper-parameters for every group,
per-group weight decay) and any optimizer with whole-parameter groups per parameter.
"""
from __future__ import annotations

import dataclasses
import difflib
import inspect
import math
from dataclasses import dataclass
from functools import partial
from typing import Any, Callable, Iterable, Sequence, Union

import torch
import torch.nn as nn

from .config import Config, ConfigError, OptimizerConfig, ScheduleConfig
from .elementwise import streamed_update
from .optimizer_list import build_parts
from .optimizer_rebuild import check_rebuilt
from .tiers import Tier
from .zero.construct import full_shape

SchedulerFactory = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]
"""Builds the learning-rate scheduler of the optimizer it is given (the engine's own)."""
OptimizerFactory = Callable[[list[dict]], torch.optim.Optimizer]
"""Builds an optimizer over torch-style param groups."""
OptimizerArg = Union[torch.optim.Optimizer, type, OptimizerFactory, list]
"""wrap(optimizer=...): an Optimizer subclass, a factory of param groups, an instance, or a
list over disjoint parameters (stepped as one: tiertrain/optimizer_list.py) of instances or
(class or factory, param_groups) pairs."""

KNOWN_WHOLE_TENSOR = {
    "LBFGS": "it minimises over all parameters at once with a closure",
    "SparseAdam": "it needs sparse gradients",
}
"""Why some torch optimizers need more than gradients, added to the message when the probe
(tiertrain/optim_probe.py, which decides for every optimizer by what it does) refuses them."""

_NOT_OPTIONS = ("params", "initial_lr", "param_names")
"""Group keys that are not hyper-parameters: the tensors, what a scheduler built on the user's
instance recorded, the names torch may keep."""


def decays(name: str, shape: tuple[int, ...] | torch.Size, on: str = "matrices") -> bool:
    """Whether weight decay applies (OptimizerConfig.weight_decay_on): to every parameter
    ("all"), or to matrices (weights, embeddings) and not to biases or norm gains."""
    return on == "all" or len(shape) >= 2


def param_groups(named_params: Iterable[tuple[str, torch.Tensor]], config: OptimizerConfig) -> list[dict]:
    """Two AdamW groups: decayed and not; the reference and the engine both use this split."""
    decay, no_decay = [], []
    for name, p in named_params:
        if p.requires_grad:
            (decay if decays(name, p.shape, config.weight_decay_on) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": config.weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def _kernel_flags(impl: str) -> dict:
    if impl == "fused":
        return {"fused": True}
    if impl == "foreach":
        return {"foreach": True}
    if impl == "single":
        return {"foreach": False}
    # auto: torch's fused CPU/CUDA AdamW is the fastest correct kernel; compiled: it holds the
    # state and steps the pieces too small for the compiled pass (update/host_adamw.py)
    return {"fused": True}


def build_adamw(groups: list[dict], config: OptimizerConfig) -> torch.optim.AdamW:
    """torch AdamW with the configured kernel; groups as from param_groups (or their shards)."""
    return torch.optim.AdamW(groups, lr=config.lr, betas=config.betas, eps=config.eps,
                             weight_decay=config.weight_decay, **_kernel_flags(config.impl))


def lr_factor(step: int, schedule: ScheduleConfig) -> float:
    """Multiplier of the peak rate at optimizer step `step` (0-based): warmup (linear or log,
    from warmup_start_ratio; its first increment taken at step 0), then a cosine or linear decay;
    or the rate of schedule.deepspeed_scheduler (deepspeed_factor)."""
    if schedule.deepspeed_scheduler != "none":
        return deepspeed_factor(step, schedule)
    if schedule.warmup_steps and step < schedule.warmup_steps:
        if schedule.warmup_shape == "log":
            ramp = math.log(step + 2) / math.log(schedule.warmup_steps + 1)
        else:
            ramp = (step + 1) / schedule.warmup_steps
        start = schedule.warmup_start_ratio
        return ramp if start == 0.0 else start + (1.0 - start) * ramp
    if not schedule.decay_steps:
        return 1.0
    progress = min(1.0, (step - schedule.warmup_steps) / schedule.decay_steps)
    floor = schedule.min_lr_ratio
    if schedule.decay_shape == "linear":
        return floor + (1.0 - floor) * (1.0 - progress)
    return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def deepspeed_factor(step: int, schedule: ScheduleConfig) -> float:
    """DeepSpeed's WarmupLR, WarmupDecayLR or WarmupCosineLR (deepspeed/runtime/lr_schedules.py,
    0.19) at update `step`, as a multiple of the peak. DeepSpeed steps its scheduler after each
    update, so update n runs at its iteration n - 1 and the first at the rate its constructor
    set (the start rate; 0 for WarmupCosineLR). Its warmup counts at least 2 steps; the ratios
    are tiertrain's fields (warmup_start_ratio: warmup_min_lr / peak or warmup_min_ratio;
    min_lr_ratio: cos_min_ratio), the total its total_num_steps."""
    kind, start = schedule.deepspeed_scheduler, schedule.warmup_start_ratio
    warmup = max(2, schedule.warmup_steps)
    total = schedule.warmup_steps + schedule.decay_steps
    iteration = step - 1
    if iteration < 0:
        return 0.0 if kind == "WarmupCosineLR" else start
    if iteration < warmup:
        gamma = math.log(iteration + 1) / math.log(warmup) if schedule.warmup_shape == "log" else iteration / warmup
        return start + (1.0 - start) * gamma
    if kind == "WarmupLR":
        return 1.0
    if kind == "WarmupDecayLR":  # (back down to warmup_min_lr at total_num_steps)
        return start + (1.0 - start) * max(0.0, (total - iteration) / max(1, total - warmup))
    progress = min(1.0, (iteration - warmup + 1) / max(1, total - warmup))
    floor = schedule.min_lr_ratio
    return max(0.0, floor + (1.0 - floor) * (1 + math.cos(math.pi * progress)) / 2)


def scheduled_lr(optimizer: OptimizerConfig, schedule: ScheduleConfig, step: int) -> float:
    """The learning rate of update number `step` (0-based): the peak rate times lr_factor, the
    product torch's LambdaLR forms (so both give the same float)."""
    return optimizer.lr * lr_factor(step, schedule)


def build_schedule(optimizer: torch.optim.Optimizer, schedule: ScheduleConfig) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, schedule))


NORM_CHUNK = 1 << 16
"""Elements per partial sum of squared_norm on the CPU."""


def squared_norm(grad: torch.Tensor) -> torch.Tensor:
    """The sum of squares of a gradient, as an fp32 scalar, in one read of it.

    ``grad.pow(2).sum()`` writes and reads a temporary as large as the gradient (on the CPU
    tier, 4.5× the time of the read alone: bench/results/cpu_step.md), and a single fp32
    accumulation over 10^8 elements (``vector_norm``, one ``dot``) loses up to 2 % of the sum.
    On the CPU: the norms of 64 Ki-element rows in one call (ATen's reduction, on every
    intra-op thread), squared and summed in fp64 (relative error ~3e-7). A loop of one ``dot``
    per chunk was as exact but single-threaded: ~70 ms per 53 M elements on a 16-core GPU
    host's landing thread, which held the gradient copies behind it and made backward 4× as
    long (bench/results/gpu_issue36.md). On an accelerator its tree reduction."""
    flat = grad.detach().reshape(-1)
    if flat.device.type != "cpu" or flat.dtype != torch.float32 or flat.numel() <= NORM_CHUNK:
        return flat.float().pow(2).sum()
    rows = flat.numel() // NORM_CHUNK
    square = torch.linalg.vector_norm(flat[:rows * NORM_CHUNK].view(rows, NORM_CHUNK), dim=1).double().pow(2).sum()
    tail = flat[rows * NORM_CHUNK:]
    if tail.numel():
        square = square + torch.dot(tail, tail).double()
    return square.float()


def clip_coefficient(total_norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The factor torch.nn.utils.clip_grad_norm_ applies: min(1, max_norm / (norm + 1e-6))."""
    return torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)


# -- the client's optimizer and schedule -------------------------------------------------------


@dataclass(frozen=True)
class ParamGroup:
    """One group of the client's optimizer: its parameters by name, its hyper-parameters."""

    names: tuple[str, ...]
    options: dict[str, Any]
    """Every key of the group but "params" (lr, weight_decay, betas, momentum, ...)."""
    whole: bool = False
    """Its optimizer needs whole tensors (tiertrain/optim_probe.py): each of its parameters is
    updated whole by one owning rank (tiertrain/update/whole.py)."""


@dataclass(frozen=True)
class ClientOptimizer:
    """The optimizer and schedule a user brought, resolved against the model's parameter
    names (:func:`client_optimizer`): an update form builds ``build`` over the pieces of its
    flat shards, one group per entry of ``groups``, and applies ``lr_scheduler`` to it."""

    build: OptimizerFactory
    """Builds the optimizer over param groups (each: "params" and the group's options)."""
    groups: tuple[ParamGroup, ...]
    """Every trainable parameter in exactly one group, in the user's group order."""
    lr_scheduler: SchedulerFactory | None
    """Applied to the optimizer the engine builds; None: each group keeps its rate."""
    name: str
    """The optimizer's class name, for messages."""
    why_whole: str | None = None
    """Why some groups need whole tensors (the probe's finding), or None: all are elementwise."""
    instance_groups: Sequence[dict] | None = None
    """The param_groups of the optimizer instance(s) given (the user's own dicts, one for each
    entry of ``groups``), which show the engine's hyper-parameters; None when none was given."""
    instances: tuple[torch.optim.Optimizer, ...] = ()
    """The optimizer instances given, which the engine guards (update/instance_view.py guard)."""

    @property
    def whole_groups(self) -> tuple[int, ...]:
        """Indices of the groups stepped whole (ParamGroup.whole)."""
        return tuple(i for i, g in enumerate(self.groups) if g.whole)

    def group_index(self) -> dict[str, int]:
        """Parameter name → index of its group."""
        return {name: i for i, g in enumerate(self.groups) for name in g.names}

    def options(self) -> list[dict]:
        """Each group's hyper-parameters, in group order (copies)."""
        return [dict(g.options) for g in self.groups]

    def stand_in(self) -> torch.optim.Optimizer:
        """The optimizer built over one zero-size tensor per group: its class and every group's
        hyper-parameters with the defaults filled in, never stepped on data. Forms whose
        update runs elsewhere (a worker thread, the NVMe stream) schedule this one. (A 0×0
        matrix: optimizers of matrices only, such as Muon, take it too.)"""
        return self.build([{"params": [torch.empty(0, 0)], **g.options} for g in self.groups])


def client_optimizer(model: nn.Module | Sequence[nn.Module], config: Config, optimizer: OptimizerArg | None = None,
                     param_groups: Sequence[dict] | None = None,
                     lr_scheduler: SchedulerFactory | None = None) -> ClientOptimizer | None:
    """What ``wrap(optimizer=, param_groups=, lr_scheduler=)`` asks for, checked against the
    model before anything is built; None when none is given (the default AdamW path). model:
    the model, or a pipeline rank's stage modules (by their own parameter names, distinct).

    optimizer: an Optimizer subclass (called as cls(groups)), a factory callable(groups),
    or an instance built on the model's parameters (its class, constructor defaults and
    param_groups with their hyper-parameters are read; the instance itself is never
    stepped). param_groups: dicts whose "params" are parameters or parameter names, the
    other keys the group's hyper-parameters. Without either, one group holds every trainable
    parameter (the default AdamW: the weight_decay_on split). See the module docstring for
    which of config.optimizer and config.schedule apply.
    """
    if optimizer is None and param_groups is None and lr_scheduler is None:
        return None
    if lr_scheduler is not None and not callable(lr_scheduler):
        raise TypeError(f"lr_scheduler={lr_scheduler!r}: expected a factory callable(optimizer) -> LRScheduler, "
                        f"e.g. functools.partial(torch.optim.lr_scheduler.StepLR, step_size=10)")
    named = _named_parameters(model)
    canonical = {id(p): n for n, p in named}  # (a tied parameter: its first name)
    aliases = {n: canonical[id(p)] for n, p in _named_parameters(model, remove_duplicate=False)}
    instance_groups = None
    instances: tuple[torch.optim.Optimizer, ...] = ()
    parts: list[int] | None = None  # (a list of instances: the instance of each group)
    if isinstance(optimizer, list) and len(optimizer) == 1 and isinstance(optimizer[0], torch.optim.Optimizer):
        optimizer = optimizer[0]
    if isinstance(optimizer, list):
        if param_groups is not None or not optimizer or not all(_is_part(o) for o in optimizer):
            raise ConfigError(f"optimizer={_short(optimizer)}: a list of optimizers over disjoint parameters of the "
                              f"model holds torch.optim.Optimizer instances (e.g. [torch.optim.Muon(hidden "
                              f"matrices), torch.optim.AdamW(the rest)]) or (class or factory, param_groups) pairs "
                              f"(groups by parameter name: under partitioned_init a parameter holds only its shard, "
                              f"which Muon's constructor refuses); param_groups= does not apply")
        pairs = [(_rebuild_instance(o), o.param_groups) if isinstance(o, torch.optim.Optimizer) else o
                 for o in optimizer]
        builds = [b for b, _ in pairs]
        parts = [k for k, (_, groups) in enumerate(pairs) for _ in groups]
        build = partial(build_parts, builds=tuple(builds), parts=tuple(parts))
        instance_groups = [g for _, groups in pairs for g in groups]
        instances = tuple(o for o in optimizer if isinstance(o, torch.optim.Optimizer))
    elif isinstance(optimizer, torch.optim.Optimizer):
        if param_groups is not None:
            raise ConfigError(f"param_groups= was given with a {type(optimizer).__name__} instance, whose own "
                              f"param_groups define the groups: give one or the other")
        build = _rebuild_instance(optimizer)
        instance_groups = optimizer.param_groups
        instances = (optimizer,)
    elif optimizer is None:
        build = partial(build_adamw, config=config.optimizer)
    elif isinstance(optimizer, type):
        if not issubclass(optimizer, torch.optim.Optimizer):
            raise TypeError(f"optimizer={optimizer.__name__}: expected a torch.optim.Optimizer subclass, a "
                            f"factory callable(param_groups) -> Optimizer, or an Optimizer instance")
        build = optimizer
    elif callable(optimizer):
        build = optimizer
    else:
        raise TypeError(f"optimizer={optimizer!r}: expected a torch.optim.Optimizer subclass, a factory "
                        f"callable(param_groups) -> Optimizer, or an Optimizer instance")
    if instance_groups is not None:
        _check_no_scheduler_on(instance_groups, _optimizer_name(optimizer), lr_scheduler)
        groups = _resolve_groups(named, aliases, instance_groups,
                                 f"the {_optimizer_name(optimizer)} instance's param_groups")
    elif param_groups is not None:
        groups = _resolve_groups(named, aliases, param_groups, "param_groups")
    elif optimizer is None:
        groups = _decay_split(named, config.optimizer)
    else:
        groups = (ParamGroup(tuple(n for n, p in named if p.requires_grad), {}),)
    if optimizer is None and lr_scheduler is None:
        lr_scheduler = partial(build_schedule, schedule=config.schedule)
    why_whole = None
    part_builds, group_parts = (builds, parts) if parts is not None else ([build], [0] * len(groups))
    if optimizer is not None:  # (the default AdamW is elementwise)
        groups, why_whole = _classify(part_builds, group_parts, groups, _optimizer_name(optimizer))
    stand_in = ClientOptimizer(build, groups, lr_scheduler, "").stand_in()
    if not isinstance(stand_in, torch.optim.Optimizer):
        raise TypeError(f"optimizer={optimizer!r} built a {type(stand_in).__name__}, not a torch.optim.Optimizer")
    name = _optimizer_name(optimizer) if parts is not None else type(stand_in).__name__
    if config.zero.offload_optimizer == Tier.NVME and why_whole is None:
        streamed_update(stand_in)  # refused before the engine makes swap files
    elif config.zero.offload_optimizer == Tier.NVME:
        _check_one_at_a_time(part_builds, group_parts, groups, name)
    return ClientOptimizer(build, groups, lr_scheduler, name, why_whole, instance_groups, instances)


def _named_parameters(model: nn.Module | Sequence[nn.Module],
                      remove_duplicate: bool = True) -> list[tuple[str, nn.Parameter]]:
    if isinstance(model, nn.Module):
        return list(model.named_parameters(remove_duplicate=remove_duplicate))
    return [pair for stage in model for pair in stage.named_parameters(remove_duplicate=remove_duplicate)]


def for_pipeline_rank(client: ClientOptimizer, names: set[str], copies: dict[str, str]) -> ClientOptimizer:
    """The client's optimizer on one pipeline rank, resolved against the whole model before it
    was cut into stages: each group holds the parameters this rank's stages hold (``names``),
    plus the last stage's copy of a tied embedding (``copies``: copy → the embedding's name) in
    the embedding's group, so that both get the same update and stay equal. Every group is kept,
    empty where the rank holds none of its parameters: group k is the user's k-th group on every
    rank (a scheduler's per-group rates, the instance's param_groups)."""
    groups = tuple(ParamGroup(tuple(n for n in g.names if n in names)
                              + tuple(copy for copy, first in copies.items() if first in g.names), g.options, g.whole)
                   for g in client.groups)
    return dataclasses.replace(client, groups=groups)


def _check_no_scheduler_on(groups: Sequence[dict], name: str, lr_scheduler: SchedulerFactory | None) -> None:
    """An LRScheduler built on the user's instance records 'initial_lr' in its groups. The
    engine never steps that scheduler: without lr_scheduler= its first rate (0 under a warmup)
    would stand for the whole run unless the loop stepped it, which nothing can check."""
    if lr_scheduler is None and any("initial_lr" in g for g in groups):
        raise ConfigError(
            f"the {name} instance given as optimizer= has a learning-rate scheduler built on it (its param_groups "
            f"hold 'initial_lr', lr={groups[0].get('lr')!r} now): the engine does not step that scheduler, so its "
            f"first rate would stand for the whole run unless the loop stepped it. Pass the scheduler as a factory, "
            f"e.g. lr_scheduler=lambda opt: transformers.get_cosine_schedule_with_warmup(opt, 100, 1000) (the "
            f"engine builds it on its own {name}, from the groups' rates before any scheduler, steps it once per "
            f"update, and the instance shows its rates); do not step yours")


def _is_part(o: Any) -> bool:
    """An element of wrap(optimizer=[...]): an instance, or a (class or factory, groups) pair."""
    return isinstance(o, torch.optim.Optimizer) or (
        isinstance(o, tuple) and len(o) == 2 and callable(o[0]) and isinstance(o[1], list)
        and all(isinstance(g, dict) for g in o[1]))


def _optimizer_name(optimizer: OptimizerArg) -> str:
    if isinstance(optimizer, list):
        return "+".join(_optimizer_name(o if isinstance(o, torch.optim.Optimizer) else o[0]) for o in optimizer)
    if isinstance(optimizer, torch.optim.Optimizer):
        return type(optimizer).__name__
    target = optimizer.func if isinstance(optimizer, partial) else optimizer
    return getattr(target, "__name__", repr(target))


def _classify(builds: Sequence[OptimizerFactory], parts: Sequence[int], groups: Sequence[ParamGroup],
              name: str) -> tuple[tuple[ParamGroup, ...], str | None]:
    """The groups, each marked whole where its optimizer does not step flat pieces as it steps
    whole tensors (tiertrain/optim_probe.py, with the group's hyper-parameters), and the first
    such finding; a ConfigError for an optimizer that cannot step whole tensors from their
    gradients either (LBFGS's closure, SparseAdam's sparse gradients)."""
    from .optim_probe import probe

    out, why = [], None
    for group, part in zip(groups, parts):
        build = builds[part]
        found = probe(build, dict(group.options), name)
        if not found.steps_whole:
            part_name = _optimizer_name(build) if len(builds) > 1 else name
            known = f" ({KNOWN_WHOLE_TENSOR[part_name]})" if part_name in KNOWN_WHOLE_TENSOR else ""
            raise ConfigError(f"optimizer {part_name}{known} cannot train under tiertrain: {found.problem}. "
                              f"The engine hands an optimizer parameters and their gradients and calls step(): "
                              f"give one that needs nothing more (no closure, dense gradients)")
        if not found.elementwise:
            why = why or found.problem
        out.append(ParamGroup(group.names, group.options, whole=not found.elementwise))
    return tuple(out), why


def _check_one_at_a_time(builds: Sequence[OptimizerFactory], parts: Sequence[int], groups: Sequence[ParamGroup],
                         name: str) -> None:
    """ConfigError unless each group's optimizer steps tensors one at a time as it steps them
    together: the NVMe tier streams each tensor's state around its own step()."""
    from .optim_probe import one_at_a_time_problem

    for group, part in zip(groups, parts):
        problem = one_at_a_time_problem(builds[part], dict(group.options), name)
        if problem is not None:
            raise ConfigError(f"zero.offload_optimizer=nvme: {problem}. With groups that need whole tensors, the "
                              f"NVMe tier reads each tensor's optimizer state, steps that tensor alone and writes "
                              f"the state back; use offload_optimizer=cpu (the state in CPU memory) for this "
                              f"optimizer")


def _rebuild_instance(instance: torch.optim.Optimizer) -> OptimizerFactory:
    """The factory that builds the instance again over new groups, checked to build it with the
    same settings (tiertrain/optimizer_rebuild.py)."""
    build = _rebuild(type(instance), instance.defaults)
    check_rebuilt(instance, build)
    return build


def _rebuild(cls: type, defaults: dict) -> OptimizerFactory:
    """cls over new groups with the constructor arguments among an instance's defaults (the
    groups carry every hyper-parameter; this only satisfies a constructor that requires some)."""
    try:
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return cls
    any_keyword = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values())
    return partial(cls, **{k: v for k, v in defaults.items() if any_keyword or k in accepted})


def _decay_split(named: list[tuple[str, torch.Tensor]], config: OptimizerConfig) -> tuple[ParamGroup, ...]:
    """The default AdamW's groups (param_groups above) by name: decayed, then not (by the
    logical shape: under partitioned_init a parameter holds only its shard)."""
    trainable = [(n, full_shape(p)) for n, p in named if p.requires_grad]
    decay = tuple(n for n, shape in trainable if decays(n, shape, config.weight_decay_on))
    no_decay = tuple(n for n, shape in trainable if not decays(n, shape, config.weight_decay_on))
    groups = (ParamGroup(decay, {"weight_decay": config.weight_decay}), ParamGroup(no_decay, {"weight_decay": 0.0}))
    return tuple(g for g in groups if g.names)


def _resolve_groups(named: list[tuple[str, torch.Tensor]], aliases: dict[str, str], groups: Sequence[dict],
                    source: str) -> tuple[ParamGroup, ...]:
    """The groups by parameter name, checked: every name or tensor is a parameter of the
    model, trainable, in one group only, and every trainable parameter is in a group.
    aliases: every name of a parameter (tied ones have several) → its named_parameters() name."""
    if isinstance(groups, dict) or not isinstance(groups, Sequence):
        raise ConfigError(f"{source}: expected a list of dicts, got {type(groups).__name__}")
    by_id = {id(p): n for n, p in named}
    frozen = {n for n, p in named if not p.requires_grad}
    seen: dict[str, int] = {}
    out = []
    for i, group in enumerate(groups):
        if not isinstance(group, dict) or "params" not in group:
            raise ConfigError(f"{source}[{i}]={_short(group)}: expected a dict with 'params' (parameters or "
                              f"parameter names) and the group's hyper-parameters")
        params = group["params"]
        params = [params] if isinstance(params, (str, torch.Tensor)) else list(params)
        names = []
        for p in params:
            name = _name_of(p, by_id, aliases, f"{source}[{i}]")
            if seen.get(name) == i:
                continue  # (listed twice, or under two names of a tied parameter)
            if name in frozen:
                raise ConfigError(f"{source}[{i}] lists {name!r}, which is frozen (requires_grad=False): frozen "
                                  f"parameters are not trained and hold no optimizer state; leave it out of "
                                  f"every group")
            if name in seen:
                shown = f"{p!r} (tied to {name!r})" if isinstance(p, str) and p != name else repr(name)
                raise ConfigError(f"{shown} is in {source}[{seen[name]}] and in {source}[{i}]: a parameter "
                                  f"belongs to one group")
            seen[name] = i
            names.append(name)
        options = {k: v for k, v in group.items() if k not in _NOT_OPTIONS}
        if "initial_lr" in group:  # the rate before a scheduler built on the user's instance scaled
            options["lr"] = group["initial_lr"]  # it (a warmup's LambdaLR sets lr to 0 at once)
        out.append(ParamGroup(tuple(names), options))
    missing = [n for n, p in named if p.requires_grad and n not in seen]
    if missing:
        more = f" and {len(missing) - 8} more" if len(missing) > 8 else ""
        shown = ", ".join(repr(n) for n in missing[:8]) + more
        plural = len(missing) > 1
        raise ConfigError(f"trainable parameter{'s' if plural else ''} {shown} {'are' if plural else 'is'} in no "
                          f"group of {source}: put every parameter with requires_grad=True in one group (or set "
                          f"requires_grad=False to freeze it)")
    return tuple(out)


def _name_of(p: Any, by_id: dict[int, str], aliases: dict[str, str], where: str) -> str:
    """The model's name of a group entry (a parameter or a parameter name), or a ConfigError."""
    if isinstance(p, str):
        if p in aliases:
            return aliases[p]
        known = list(aliases)
        close = difflib.get_close_matches(p, known, n=5, cutoff=0.5)
        hint = f"close names: {', '.join(map(repr, close))}" if close else \
            f"its parameters are named like {', '.join(map(repr, known[:5]))}"
        raise ConfigError(f"{where} names {p!r}, which is not a parameter of the model; {hint}")
    if isinstance(p, torch.Tensor):
        if id(p) in by_id:
            return by_id[id(p)]
        raise ConfigError(f"{where} holds a tensor of shape {tuple(p.shape)} that is not a parameter of the "
                          f"model: build groups from model.named_parameters(), or by parameter name")
    raise ConfigError(f"{where} holds {_short(p)}: expected parameters or parameter names")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
