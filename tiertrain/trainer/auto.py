"""``zero.offload: auto`` for any model: rank 0 plans (tiertrain.estimate.plan) from the
model's dimensions and this machine's memory now, every rank applies the same plan (or
raises the same ConfigError naming the short tier), and predicted model-state bytes per
tier, which the metrics print beside the measured ones."""
from __future__ import annotations

import dataclasses
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

from ..config import Config, ConfigError
from ..tiers import Tier
from .records import local_ranks

__all__ = ["apply_plan", "plan_for", "resolve_auto_offload", "predicted_tier_bytes", "check_fits"]


def apply_plan(cfg: Config, plan) -> Config:
    """cfg (any Config subclass) with the plan's stage, tiers, checkpointing and tiling
    (zero.offload becomes "manual": the choice is made); ConfigError when cfg's type cannot
    run it (tiling a model that is not tiertrain's GPT)."""
    from ..config import from_dict, merge, to_dict

    chosen = plan.config_dict()
    chosen.pop("model", None)  # the job's own model (the plan was made for it)
    chosen["zero"]["offload"] = "manual"
    if "nvme_path" in chosen["zero"] and not chosen["zero"]["nvme_path"]:
        chosen["zero"]["nvme_path"] = cfg.zero.nvme_path
    fields = {f.name for f in dataclasses.fields(cfg)}
    if "tile_factor" in chosen and "tile_factor" not in fields:
        if chosen.pop("tile_factor") != 1:
            raise ConfigError("the plan tiles the model's linear layers, which only tiertrain's GPT supports")
    result = from_dict(type(cfg), merge(to_dict(cfg), chosen))
    return result.validate()


def plan_for(cfg: Config, dims: Any, world_size: int, device: torch.device | None = None,
             probe_path: str | None = None):
    """The planner's choice for a model of these dims under cfg on this machine now: host
    RAM available (MemAvailable, capped by a cgroup limit), free device memory with an
    accelerator, the free space of zero.nvme_path as the NVMe tier (none when it is empty),
    and the bandwidths, compute peak and process overhead of a probe file when one exists
    (``probe_path``, default $TIERTRAIN_PROBE or runs/hardware_probe.json). Only layouts
    cfg's type accepts are chosen."""
    from ..estimate.hardware import Hardware
    from ..estimate.plan import Plan, plan
    from ..estimate.probe import HardwareProbe, ram_available

    local = local_ranks(world_size)
    nodes = max(1, world_size // local)
    path = probe_path or os.environ.get("TIERTRAIN_PROBE") or "runs/hardware_probe.json"
    available = ram_available()
    if os.path.isfile(path):
        hw = Hardware.from_probe(HardwareProbe.load(path), ranks_per_node=local, nodes=nodes)
        hw.source = f"probe file {path}, RAM available now"
    else:
        hw = Hardware(ranks_per_node=local, nodes=nodes, host_memory=available, source="this machine now")
    hw.host_memory = available
    if device is not None:
        from ..device import free_memory
        hw.device_memory = free_memory(device)  # (None on the CPU)
    hw.swap_dir = cfg.zero.nvme_path or None
    hw.nvme_bytes = _swap_free(cfg)

    def allowed(layout) -> str | None:
        stub = Plan(True, dims, layout, None, hw, {}, {}, None, "")
        try:
            apply_plan(cfg, stub)
        except (ConfigError, ValueError) as e:
            return str(e)
        return None

    return plan(dims, hw, micro_batch=cfg.batch.micro_batch_size, precision=cfg.precision.dtype,
                bucket_mb=cfg.zero.bucket_mb, allowed=allowed)


def _swap_free(cfg: Config) -> int | None:
    """Free bytes of zero.nvme_path's file system (of its nearest existing ancestor: the run
    creates it), or None without a swap directory."""
    from ..io.fileio import nearest_existing

    if not cfg.zero.nvme_path:
        return None
    return shutil.disk_usage(nearest_existing(os.path.abspath(cfg.zero.nvme_path))).free


def check_fits(cfg: Config, dims: Any, world_size: int, accelerator: bool = False) -> None:
    """ConfigError, before anything is allocated, when the layout cfg asks for cannot fit this
    machine now: the estimator's peaks per rank (building the model, and the training step)
    against the host RAM available and the swap directory's free space, with no reserve, so
    only a job predicted to need more than there is is refused. With an accelerator only the
    host tiers are checked (the device's own allocator names a device shortfall). The line
    names the short tier, the model's size and its largest tensor (a vocabulary of 1e9 would
    otherwise be a 256 GB allocation that fails, or swaps, minutes later)."""
    from ..estimate import ZeroLayout
    from ..estimate.candidates import evaluate
    from ..estimate.hardware import Hardware
    from ..estimate.probe import ram_available
    from ..estimate.report import human_bytes

    local = local_ranks(world_size)
    hw = Hardware(ranks_per_node=local, nodes=max(1, world_size // local), host_memory=ram_available(),
                  device_memory=(1 << 62) if accelerator else None, nvme_bytes=_swap_free(cfg),
                  swap_dir=cfg.zero.nvme_path or None, reserve=0.0, source="this machine now")
    layout = dataclasses.replace(ZeroLayout.from_config(cfg, world_size), tile_factor=getattr(cfg, "tile_factor", 1))
    candidate = evaluate(dims, hw.validate(), layout)
    short = [s for s in candidate.short if s.tier is not Tier.DEVICE]
    if not short:
        return
    name, p = max(candidate.model.named_parameters(), key=lambda item: item[1].numel())
    raise ConfigError(
        f"this job does not fit this machine: {'; '.join(s.describe() for s in short)} (a model of "
        f"{dims.num_parameters():,} parameters, its largest tensor {name} {list(p.shape)}; stage "
        f"{cfg.zero.stage}, parameters on {Tier(cfg.zero.offload_params).value}, optimizer on "
        f"{Tier(cfg.zero.offload_optimizer).value}; {world_size} rank(s), {human_bytes(hw.host_memory)} of RAM "
        f"available). Check the model's config (vocab_size, hidden size), move states to NVMe "
        f"(zero.offload_params / zero.offload_optimizer with zero.nvme_path), or see what fits with `tiertrain plan`")


def resolve_auto_offload(cfg: Config, dims: Any, topology) -> Config:
    """zero.offload=auto: rank 0 plans for a model of these dims, every rank returns the same
    planned cfg (or raises the same ConfigError naming what is short); rank 0 prints the
    plan. Collective over the topology's ranks."""
    from ..estimate.plan import render_plan, short_message

    message: list[Any] = [None]
    if topology.rank == 0:
        try:
            chosen = plan_for(cfg, dims, topology.world_size, topology.device)
            if chosen.fits:
                message[0] = ("ok", apply_plan(cfg, chosen), render_plan(chosen))
            else:
                message[0] = ("error", "zero.offload='auto': " + short_message(chosen), render_plan(chosen))
        except (ConfigError, ValueError) as e:
            message[0] = ("error", f"zero.offload='auto': {e}", "")
    if dist.is_initialized() and topology.world_size > 1:
        dist.broadcast_object_list(message, src=0)
    kind, value, table = message[0]
    if topology.rank == 0 and table:
        print("tiertrain: zero.offload=auto, the planner's choice:\n" + table.rstrip(), flush=True)
    if kind == "error":
        raise ConfigError(value)
    return value


MODEL_STATE_LINES = ("parameters", "gradients", "master weights", "optimizer states")


def predicted_tier_bytes(model: torch.nn.Module, cfg: Config, world_size: int) -> dict[str, int]:
    """The estimator's model-state bytes per rank in each tier ("device", "cpu", "nvme") for
    a whole (or meta-device) model, or its tensor-parallel slice, trained under cfg: what
    ``Engine.memory_report`` should show (its parameters, gradients, master weights and
    optimizer states)."""
    from ..estimate import ZeroLayout, estimate

    layout = ZeroLayout.from_config(cfg, world_size)
    if any(getattr(p, "tp_sharded", False) for p in model.parameters()):
        # The model holds this rank's tensor-parallel slices already: the layout must not
        # divide them by tp again (replicated parameters are whole on every tp rank).
        layout = dataclasses.replace(layout, tp=1)
    sizes = [p.numel() for p in model.parameters() if p.requires_grad]
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
    out = {"device": 0, "cpu": 0, "nvme": 0}
    if sizes:
        for line in estimate(sizes, layout).lines:
            if line.name in MODEL_STATE_LINES:
                out[_tier_key(line.tier)] += line.bytes
    if frozen:  # compute-dtype, partitioned with the parameters at stage 3, no other state
        from ..estimate.lines import PRECISION_BYTES

        per_rank = frozen // layout.dp if layout.stage == 3 else frozen
        out[_tier_key(layout.param_tier)] += per_rank * PRECISION_BYTES[layout.precision]
    return out


def _tier_key(tier: Tier) -> str:
    return {Tier.DEVICE: "device", Tier.CPU: "cpu", Tier.NVME: "nvme"}[Tier(tier)]
