"""Side-by-side trainers for benchmarks: PyTorch DDP, FSDP2, DeepSpeed ZeRO and tiertrain.

These run on the *current rank* of an already-initialised (gloo) process group
and are benchmark-only: the tiertrain library never imports this module nor
DeepSpeed.  ``run_tiertrain(stage, ...)`` runs tiertrain's own engine the same
way, so its rows are comparable with the baselines.  Each ``run_*`` function

* builds the model with ``torch.manual_seed(seed); model_factory()`` (so every
  framework starts from the same weights),
* wraps it (DDP / ``fully_shard`` / ``deepspeed.initialize`` / ``tiertrain.wrap``),
* builds AdamW from an :class:`OptimConfig`,
* runs ``warmup`` untimed + ``steps`` timed full steps (forward + backward +
  optimizer step + zero_grad), each timed with ``time.perf_counter`` (wall) and
  ``time.process_time`` (CPU time of all the process's threads, less
  sensitive to other load on a shared machine) and the main thread's
  run-queue wait from ``/proc/self/task/TID/schedstat`` (time it was
  runnable but other processes had the CPU),
* returns a :class:`RunResult` (per-step times, median, losses, memory).

The model contract: ``model(input_ids, labels)`` returns a scalar loss (e.g.
``tiertrain.models.gpt.GPT``).  ``batch`` is ``(input_ids, labels)`` for this
rank, or a callable ``batch(step) -> (input_ids, labels)``.

Memory: ``peak_rss_mib`` is ``getrusage(RUSAGE_SELF).ru_maxrss`` (whole-process
high-water mark since process start, so run one framework per process for a
clean number: ``bench/run_baselines.py`` does); ``rss_start_mib`` /
``rss_end_mib`` are the current RSS from ``/proc/self/statm`` before the model
is built and after the last step, ``rss_delta_mib`` their difference, and
``peak_over_start_mib = peak_rss_mib - rss_start_mib`` (an upper bound on what
the run itself added at its peak).

DeepSpeed needs ``DS_ACCELERATOR=cpu`` (set here if unset, before deepspeed is
imported) and the env vars RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT (filled in from the process group if missing).  With no
``oneccl_bindings_for_pytorch`` installed, DeepSpeed's CPU accelerator uses
gloo; ``run_deepspeed`` reuses the existing torch process group.
"""

from __future__ import annotations

import dataclasses
import gc
import os
import resource
import statistics
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, Union

import torch
import torch.distributed as dist
import torch.nn as nn

Batch = tuple[torch.Tensor, torch.Tensor]
BatchArg = Union[Batch, Callable[[int], Batch]]

_PAGE = os.sysconf("SC_PAGE_SIZE")
MiB = 1 << 20


# ----------------------------------------------------------------------------- config / result


@dataclass
class OptimConfig:
    """AdamW hyper-parameters shared by every framework.

    ``impl`` picks torch's AdamW implementation where the framework uses a
    torch optimizer: "default" (torch's choice: the single-tensor for-loop on
    CPU), "foreach", "fused" or "forloop".  For DeepSpeed with
    ``ds_optimizer="config"`` (and always with optimizer offload) DeepSpeed
    builds its own optimizer from lr/betas/eps/weight_decay and ``impl`` is
    ignored.  tiertrain gets the same kernel (see :meth:`tiertrain_impl`).

    ``decay`` says which parameters get weight decay: "all" (one group), or
    "matrices" (only parameters with >= 2 dims; biases and norm gains get 0),
    which is tiertrain's fixed rule (``tiertrain.optim.decays``) -- use it when
    tiertrain rows are compared, so every framework does the same update.
    """

    lr: float = 3e-4
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    weight_decay: float = 0.1
    impl: str = "default"
    decay: str = "all"

    def torch_kwargs(self) -> dict[str, Any]:
        kw: dict[str, Any] = dict(lr=self.lr, betas=tuple(self.betas), eps=self.eps,
                                  weight_decay=self.weight_decay)
        if self.impl == "foreach":
            kw["foreach"] = True
        elif self.impl == "fused":
            kw["fused"] = True
        elif self.impl == "forloop":
            kw["foreach"] = False
        elif self.impl != "default":
            raise ValueError(f"OptimConfig.impl={self.impl!r} is invalid: "
                             "expected default|foreach|fused|forloop")
        return kw

    def tiertrain_impl(self) -> str:
        """tiertrain's ``optimizer.impl`` for the same torch kernel."""
        return {"fused": "fused", "foreach": "foreach", "forloop": "single",
                "default": "single"}[self.impl]  # torch's CPU default is the for-loop kernel

    def groups(self, params) -> list[Any]:
        """``params`` (tensors, or (name, tensor) pairs) as AdamW parameter groups."""
        params = [p[1] if isinstance(p, tuple) else p for p in params]
        if self.decay == "all":
            return params
        if self.decay != "matrices":
            raise ValueError(f"OptimConfig.decay={self.decay!r} is invalid: expected all|matrices")
        decay = [p for p in params if p.dim() >= 2]
        no_decay = [p for p in params if p.dim() < 2]
        groups = [{"params": decay, "weight_decay": self.weight_decay}]
        if no_decay:
            groups.append({"params": no_decay, "weight_decay": 0.0})
        return groups

    def make(self, params) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.groups(params), **self.torch_kwargs())


@dataclass
class RunResult:
    name: str
    rank: int
    world_size: int
    step_times_s: list[float]
    losses: list[float]  # every step, warmup included
    n_params: int
    rss_start_mib: float
    rss_end_mib: float
    peak_rss_mib: float
    setup_s: float = 0.0  # model build + wrap + optimizer construction
    extra: dict[str, Any] = field(default_factory=dict)
    step_cpu_s: list[float] = field(default_factory=list)  # process CPU time (all threads) per timed step
    step_runq_s: list[float] = field(default_factory=list)  # main thread's run-queue wait per timed step

    @property
    def median_step_s(self) -> float:
        return statistics.median(self.step_times_s) if self.step_times_s else float("nan")

    @property
    def median_cpu_s(self) -> float:
        return statistics.median(self.step_cpu_s) if self.step_cpu_s else float("nan")

    @property
    def step_unqueued_s(self) -> list[float]:
        """Wall time minus the main thread's run-queue wait, per timed step: the step as it
        would have taken had this rank's main thread never waited for a CPU (waits on the
        other rank, which may itself have been descheduled, are still included)."""
        return [t - q for t, q in zip(self.step_times_s, self.step_runq_s)] if self.step_runq_s else []

    @property
    def median_unqueued_s(self) -> float:
        v = self.step_unqueued_s
        return statistics.median(v) if v else float("nan")

    @property
    def rss_delta_mib(self) -> float:
        return self.rss_end_mib - self.rss_start_mib

    @property
    def peak_over_start_mib(self) -> float:
        return self.peak_rss_mib - self.rss_start_mib

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.update(median_step_s=self.median_step_s, median_cpu_s=self.median_cpu_s,
                 step_unqueued_s=self.step_unqueued_s, median_unqueued_s=self.median_unqueued_s,
                 rss_delta_mib=self.rss_delta_mib,
                 peak_over_start_mib=self.peak_over_start_mib)
        return d


# ----------------------------------------------------------------------------- helpers


def current_rss_mib() -> float:
    """Current resident set size from /proc/self/statm."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE / MiB


def peak_rss_mib() -> float:
    """Process high-water RSS (ru_maxrss is KiB on Linux)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def thread_runqueue_s() -> float:
    """Seconds the calling thread has spent runnable but waiting for a CPU (2nd field of
    /proc/self/task/TID/schedstat; needs schedstats, 0.0 where unavailable). On a shared
    machine this is the time other processes took from this rank's main thread."""
    import threading

    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _get_batch(batch: BatchArg, step: int) -> Batch:
    return batch(step) if callable(batch) else batch


def count_params(model: nn.Module) -> int:
    """Distinct parameters (tied weights once), counted before wrapping."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _rank_world() -> tuple[int, int]:
    if not dist.is_initialized():
        raise RuntimeError("initialise a torch.distributed process group (gloo) first")
    return dist.get_rank(), dist.get_world_size()


def _train_loop(name: str, step_fn: Callable[[Batch], torch.Tensor], batch: BatchArg,
                steps: int, warmup: int, barrier: bool) -> tuple[list[float], list[float], dict[str, list[float]]]:
    """Returns (wall seconds per timed step, loss of every step, per-timed-step dict of
    ``cpu`` = process CPU seconds (all threads) and ``runq`` = seconds the main thread
    waited for a CPU while runnable)."""
    times, losses, cpu = [], [], {"cpu": [], "runq": []}
    for i in range(warmup + steps):
        b = _get_batch(batch, i)
        if barrier:
            dist.barrier()
        q0 = thread_runqueue_s()
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = step_fn(b)
        t1 = time.perf_counter()
        c1 = time.process_time()
        q1 = thread_runqueue_s()
        losses.append(float(loss))
        if i >= warmup:
            times.append(t1 - t0)
            cpu["cpu"].append(c1 - c0)
            cpu["runq"].append(q1 - q0)
    return times, losses, cpu


def _build(model_factory: Callable[[], nn.Module], seed: int) -> tuple[nn.Module, int]:
    torch.manual_seed(seed)
    model = model_factory()
    return model, count_params(model)


# ----------------------------------------------------------------------------- DDP


def run_ddp(model_factory: Callable[[], nn.Module], optim: OptimConfig, batch: BatchArg, *,
            steps: int = 5, warmup: int = 2, seed: int = 0, barrier: bool = False,
            ddp_kwargs: dict[str, Any] | None = None) -> RunResult:
    """torch.nn.parallel.DistributedDataParallel, full replica per rank."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    rank, world = _rank_world()
    gc.collect()
    rss0 = current_rss_mib()
    t0 = time.perf_counter()
    model, n_params = _build(model_factory, seed)
    ddp = DDP(model, **(ddp_kwargs or {}))
    opt = optim.make(ddp.parameters())
    setup = time.perf_counter() - t0

    def step(b: Batch) -> torch.Tensor:
        loss = ddp(*b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    times, losses, cpu = _train_loop("ddp", step, batch, steps, warmup, barrier)
    return RunResult("ddp", rank, world, times, losses, n_params, rss0, current_rss_mib(),
                     peak_rss_mib(), setup, {"ddp_kwargs": {k: str(v) for k, v in (ddp_kwargs or {}).items()}},
                     step_cpu_s=cpu["cpu"], step_runq_s=cpu["runq"])


# ----------------------------------------------------------------------------- FSDP2


def run_fsdp2(model_factory: Callable[[], nn.Module], optim: OptimConfig, batch: BatchArg, *,
              block_modules: Callable[[nn.Module], Sequence[nn.Module]] = lambda m: m.blocks,
              reshard_after_forward: bool = True, steps: int = 5, warmup: int = 2, seed: int = 0,
              barrier: bool = False) -> RunResult:
    """FSDP2: ``fully_shard`` on every block of ``block_modules(model)``, then on the root.

    ``reshard_after_forward=True`` is ZeRO-3-like (params re-gathered in
    backward); False keeps the unsharded params between forward and backward
    (ZeRO-2-like memory for params).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank, world = _rank_world()
    gc.collect()
    rss0 = current_rss_mib()
    t0 = time.perf_counter()
    model, n_params = _build(model_factory, seed)
    mesh = init_device_mesh("cpu", (world,))
    for blk in block_modules(model):
        fully_shard(blk, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard_after_forward)
    opt = optim.make(model.parameters())
    setup = time.perf_counter() - t0

    def step(b: Batch) -> torch.Tensor:
        loss = model(*b)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    times, losses, cpu = _train_loop("fsdp2", step, batch, steps, warmup, barrier)
    return RunResult("fsdp2", rank, world, times, losses, n_params, rss0, current_rss_mib(),
                     peak_rss_mib(), setup, {"reshard_after_forward": reshard_after_forward},
                     step_cpu_s=cpu["cpu"], step_runq_s=cpu["runq"])


# ----------------------------------------------------------------------------- DeepSpeed


def deepspeed_config(stage: int, micro_batch_size: int, optim: OptimConfig, *,
                     offload_optimizer: bool = False, offload_param: bool = False,
                     ds_optimizer: str = "client",
                     zero_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The DeepSpeed config used by :func:`run_deepspeed` (fp32, no clipping, 1 micro-batch).

    ``ds_optimizer="client"`` passes a torch AdamW (same code as DDP/FSDP2);
    "config" lets DeepSpeed build its own AdamW (DeepSpeedCPUAdam under offload,
    its CPU FusedAdam op otherwise).  Optimizer offload needs "config"
    (DeepSpeed refuses a torch optimizer with offload unless
    zero_force_ds_cpu_optimizer=false).
    """
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage} is invalid: expected 0..3")
    zero: dict[str, Any] = {"stage": stage}
    if offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": False}
    if offload_param:
        if stage != 3:
            raise ValueError("offload_param needs stage 3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": False}
    zero.update(zero_overrides or {})
    cfg: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 0.0,
        "zero_optimization": zero,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "zero_allow_untested_optimizer": True,
    }
    if ds_optimizer == "config":
        cfg["optimizer"] = {"type": "AdamW", "params": {
            "lr": optim.lr, "betas": list(optim.betas), "eps": optim.eps,
            "weight_decay": optim.weight_decay}}
    elif ds_optimizer != "client":
        raise ValueError(f"ds_optimizer={ds_optimizer!r} is invalid: expected client|config")
    return cfg


def _import_deepspeed():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed  # benchmark-only dependency
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    if acc.device_name() != "cpu":
        raise RuntimeError(f"DeepSpeed picked accelerator {acc.device_name()!r}; "
                           "set DS_ACCELERATOR=cpu before importing deepspeed")
    return deepspeed


def run_deepspeed(stage: int, model_factory: Callable[[], nn.Module], optim: OptimConfig,
                  batch: BatchArg, *, steps: int = 5, warmup: int = 2, seed: int = 0,
                  barrier: bool = False, offload_optimizer: bool = False,
                  offload_param: bool = False, ds_optimizer: str = "client",
                  zero_overrides: dict[str, Any] | None = None,
                  config_overrides: dict[str, Any] | None = None) -> RunResult:
    """DeepSpeed ZeRO stage 0/1/2/3 on the CPU accelerator over the existing gloo group."""
    rank, world = _rank_world()
    env_defaults = dict(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    for k, v in env_defaults.items():
        os.environ.setdefault(k, v)
    if offload_optimizer or offload_param:
        ds_optimizer = "config"
    deepspeed = _import_deepspeed()
    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)

    b0 = _get_batch(batch, 0)
    cfg = deepspeed_config(stage, int(b0[0].shape[0]), optim, offload_optimizer=offload_optimizer,
                           offload_param=offload_param, ds_optimizer=ds_optimizer,
                           zero_overrides=zero_overrides)
    cfg.update(config_overrides or {})

    gc.collect()
    rss0 = current_rss_mib()
    t0 = time.perf_counter()
    model, n_params = _build(model_factory, seed)
    client_opt = optim.make(model.parameters()) if ds_optimizer == "client" else None
    engine, ds_opt, _, _ = deepspeed.initialize(model=model, optimizer=client_opt, config=cfg,
                                                 dist_init_required=False)
    setup = time.perf_counter() - t0

    def step(b: Batch) -> torch.Tensor:
        loss = engine(*b)
        engine.backward(loss)
        engine.step()  # also zeroes grads
        return loss.detach()

    times, losses, cpu = _train_loop(f"ds{stage}", step, batch, steps, warmup, barrier)
    inner = getattr(ds_opt, "optimizer", None)
    name = f"deepspeed_z{stage}" + ("_offopt" if offload_optimizer else "") + ("_offparam" if offload_param else "")
    res = RunResult(name, rank, world, times, losses, n_params, rss0, current_rss_mib(),
                    peak_rss_mib(), setup,
                    {"config": cfg, "optimizer": type(ds_opt).__name__ + (
                        f"({type(inner).__name__})" if inner is not None else "")},
                    step_cpu_s=cpu["cpu"], step_runq_s=cpu["runq"])
    if hasattr(engine, "destroy"):
        engine.destroy()
    return res


# ----------------------------------------------------------------------------- tiertrain


def tiertrain_config_dict(stage: int, micro_batch_size: int, optim: OptimConfig, *,
                          grad_clip: float = 0.0,
                          zero_overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """The tiertrain config used by :func:`run_tiertrain`, as the dict given to
    ``tiertrain.config.from_dict(Config, ...)``: fp32, the baselines' AdamW
    (same torch kernel), no clipping (the baselines do not clip), constant LR
    (no warmup, no decay, like the baselines), one micro-batch per step."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"stage={stage} is invalid: expected 0..3")
    if optim.decay != "matrices":
        # tiertrain always decays only >= 2-D parameters; the other frameworks must
        # do the same for the loss cross-check to be exact (warn, still run).
        import warnings
        warnings.warn("tiertrain decays only >= 2-D parameters but OptimConfig.decay="
                      f"{optim.decay!r}: losses will differ slightly from the baselines")
    return {
        "precision": {"dtype": "fp32"},
        "optimizer": {"lr": optim.lr, "betas": list(optim.betas), "eps": optim.eps,
                      "weight_decay": optim.weight_decay, "grad_clip": grad_clip,
                      "impl": optim.tiertrain_impl()},
        "schedule": {"warmup_steps": 0, "decay_steps": 0},
        "batch": {"micro_batch_size": micro_batch_size, "grad_accum_steps": 1},
        "zero": {"stage": stage, **(zero_overrides or {})},
        "checkpoint": {"dir": ""},
        "logging": {"metrics_file": "", "progress": False},
    }


def run_tiertrain(stage: int, model_factory: Callable[[], nn.Module], optim: OptimConfig,
                  batch: BatchArg, *, steps: int = 5, warmup: int = 2, seed: int = 0,
                  barrier: bool = False, grad_clip: float = 0.0,
                  zero_overrides: dict[str, Any] | None = None,
                  unit_modules: list[str] | None = None) -> RunResult:
    """tiertrain's engine at ZeRO ``stage`` (0-3) over the existing process group.

    One step is ``loss = engine(batch); engine.backward(loss); engine.step()``
    (the engine zeroes its gradients inside ``step``).  ``zero_overrides`` are
    merged into the ``zero`` section (e.g. ``{"prefetch_mb": 0}``).
    """
    import tiertrain
    from tiertrain.config import Config, from_dict

    rank, world = _rank_world()
    b0 = _get_batch(batch, 0)
    cfg_dict = tiertrain_config_dict(stage, int(b0[0].shape[0]), optim, grad_clip=grad_clip,
                                     zero_overrides=zero_overrides)
    cfg = from_dict(Config, cfg_dict)
    cfg.validate()

    gc.collect()
    rss0 = current_rss_mib()
    t0 = time.perf_counter()
    model, n_params = _build(model_factory, seed)
    topology = tiertrain.Topology.build(cfg.parallel)
    engine = tiertrain.wrap(model, cfg, topology, unit_modules=unit_modules)
    setup = time.perf_counter() - t0

    def step(b: Batch) -> torch.Tensor:
        loss = engine(b)
        engine.backward(loss)
        engine.step()
        return loss.detach()

    engine.counter.reset()
    times, losses, cpu = _train_loop(f"tiertrain{stage}", step, batch, steps, warmup, barrier)
    mem = engine.memory_report()
    n_steps = max(1, warmup + steps)
    extra = {"config": cfg_dict, "optimizer": f"tiertrain AdamW(impl={cfg.optimizer.impl})",
             "memory_report_mib": {k: getattr(mem, k) / MiB for k in
                                   ("params", "gathered_params", "grads", "optimizer", "total")},
             "comm_mib_per_step": {k: v / MiB / n_steps for k, v in engine.counter.bytes.items()},
             "comm_calls_per_step": {k: v / n_steps for k, v in engine.counter.calls.items()},
             "units": len(engine.layout.units), "topology": repr(topology)}
    return RunResult(f"tiertrain_z{stage}", rank, world, times, losses, n_params, rss0,
                     current_rss_mib(), peak_rss_mib(), setup, extra,
                     step_cpu_s=cpu["cpu"], step_runq_s=cpu["runq"])


# ----------------------------------------------------------------------------- dispatch


FRAMEWORKS = ("ddp", "fsdp2", "fsdp2_noreshard", "ds0", "ds1", "ds2", "ds3", "ds3_p0",
              "ds2_offload", "ds3_offload", "tiertrain0", "tiertrain1", "tiertrain2", "tiertrain3")


def run_framework(name: str, model_factory: Callable[[], nn.Module], optim: OptimConfig,
                  batch: BatchArg, *, block_modules=lambda m: m.blocks, **kw) -> RunResult:
    """Dispatch by short name (see FRAMEWORKS).

    ``ds3_p0`` is ZeRO-3 with ``stage3_param_persistence_threshold=0`` (every
    parameter partitioned, like tiertrain's default); ``tiertrainN`` is
    :func:`run_tiertrain` at stage N.
    """
    if name == "ddp":
        return run_ddp(model_factory, optim, batch, **kw)
    if name == "fsdp2":
        return run_fsdp2(model_factory, optim, batch, block_modules=block_modules, **kw)
    if name == "fsdp2_noreshard":
        r = run_fsdp2(model_factory, optim, batch, block_modules=block_modules,
                      reshard_after_forward=False, **kw)
        r.name = name
        return r
    if name in ("ds0", "ds1", "ds2", "ds3"):
        return run_deepspeed(int(name[2]), model_factory, optim, batch, **kw)
    if name == "ds3_p0":
        zo = {"stage3_param_persistence_threshold": 0, **(kw.pop("zero_overrides", None) or {})}
        r = run_deepspeed(3, model_factory, optim, batch, zero_overrides=zo, **kw)
        r.name = "deepspeed_z3_p0"
        return r
    if name in ("tiertrain0", "tiertrain1", "tiertrain2", "tiertrain3"):
        return run_tiertrain(int(name[-1]), model_factory, optim, batch, **kw)
    if name in ("ds2_offload", "ds3_offload"):
        return run_deepspeed(int(name[2]), model_factory, optim, batch, offload_optimizer=True, **kw)
    raise ValueError(f"unknown framework {name!r}: expected one of {FRAMEWORKS}")
