"""Per-rank peak memory of building the model and wrapping it, before the first step, the
way ``tiertrain train`` does: construction in fp32 (whole, or under ``partitioned_init``),
then ``FlatParameters`` unit by unit on the engine's layout (:mod:`tiertrain.estimate.units`),
then the NVMe optimizer's setup, with glibc's freed heap blocks counted as still resident.
:func:`simulate_build_peak` walks those phases; :func:`engine_build_peak` runs it for a layout.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch.nn as nn

from ..zero.flat import swap_pool_bytes
from .lines import PRECISION_BYTES, Tier
from .overhead import HostOverhead
from .units import engine_units, gpt_meta_model

__all__ = ["BuildPeak", "simulate_build_peak", "builds_partitioned", "MMAP_THRESHOLD_MAX", "engine_build_peak"]

MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit Linux: a block larger than this is always
mmapped and goes back to the OS when freed; smaller ones may come from the heap, whose freed
holes stay resident (before wrap() glibc's dynamic threshold rises to the largest block
freed; from wrap() on ``zero.retain_host_memory`` fixes it at this value, so every block up
to it comes from the heap)."""


def builds_partitioned(stage: int, tile_factor: int = 1, tp: int = 1) -> bool:
    """Whether ``tiertrain train`` builds the model under ``tiertrain.zero.partitioned_init``
    (tiertrain.train.build_model): at ZeRO stage 3, untiled, without tensor parallelism.
    Otherwise every rank builds the whole model in fp32 before wrap() flattens it."""
    return stage == 3 and tile_factor == 1 and tp == 1


@dataclass
class BuildPeak:
    """What one rank holds at the peak of building the model and wrapping it (before step 1)."""

    partitioned: bool
    """Built under partitioned_init (each rank materialises one module at a time)."""
    host: int
    """Bytes of host RAM at the build's peak (the whole rank on a machine without an
    accelerator), including the framework bytes of the process."""
    device: int
    """Most bytes on the accelerator during the build (0 without one: they are in ``host``)."""
    where: str
    """The phase of the build where host RAM peaks."""
    items: dict[str, int] = field(default_factory=dict)
    """What is live at the peak, by item (bytes)."""

    @property
    def total(self) -> int:
        return self.host + self.device


def simulate_build_peak(model: nn.Module, *, dp: int, stage: int, precision_bytes: int,
                        param_tier: Tier = Tier.DEVICE, optimizer_tier: Tier = Tier.DEVICE, bucket_mb: float = 25.0,
                        persistence_threshold: int = 0, partitioned: bool | None = None,
                        accelerator: bool = False, framework_bytes: int = 0,
                        nvme_chunk_bytes: int = 24 << 20, nvme_buffers: int = 4,
                        grads_released: bool = False) -> BuildPeak:
    """Per-rank peak of building ``model`` (meta is fine) the way ``tiertrain train`` does
    and wrapping it with the engine, before the first step:

    1. **construction** in fp32 on the host: the whole model on every rank
       (``partitioned=False``), or under ``partitioned_init``: the fp32 shards
       (⌈n/dp⌉ per parameter) plus the module being initialised, whole;
    2. **wrap** (``tiertrain.zero.flat.FlatParameters``), unit by unit in layout order: the
       unit's full flat buffer (compute dtype), a gathered parameter (partitioned builds),
       its shard on the parameter tier, its fp32 master (where separate) and its fp32
       gradient (zeroed at once, except with the optimizer on NVMe, whose gradient pages
       are first written after the masters leave); then the unit's original fp32 tensors
       are freed;
    3. the NVMe optimizer's setup: its ring of ``nvme_buffers`` chunk buffers; the masters
       are dropped and the gradient shards zeroed (``grads_released``: left without memory
       until their first reduction, as the in-place step running in backward does).

    Freed blocks: a block of at most :data:`MMAP_THRESHOLD_MAX` (32 MiB) may sit in glibc's
    heap, whose holes stay resident, so such freed originals and masters are counted as
    still held until the end of the build (an upper bound: later allocations can reuse
    some of them); larger blocks are mmapped and return to the OS when freed. Buffer pools
    (NVMe staging) are counted whole. The accelerator's bytes go to ``device`` when
    ``accelerator``; otherwise every byte is host RAM."""
    if partitioned is None:
        partitioned = builds_partitioned(stage, getattr(model, "_tiertrain_tile_factor", 1))
    param_tier, optimizer_tier = Tier(param_tier), Tier(optimizer_tier)
    D = precision_bytes
    layout = engine_units(model, stage, dp, bucket_mb, persistence_threshold)
    units = layout.units
    numel = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    HOLES = "freed heap blocks still resident (glibc, < 32 MiB)"
    host: dict[str, int] = {}
    dev: dict[str, int] = {}

    def alloc(tier: Tier, name: str, nbytes: int, touched: bool = True) -> int:
        """Allocate (host blocks ≤ 32 MiB reuse freed heap holes first); returns the bytes
        that became resident later when the block is touched (0 if touched now)."""
        nbytes = int(nbytes)
        if accelerator and tier is Tier.DEVICE:
            dev[name] = dev.get(name, 0) + nbytes
            return 0
        reused = min(host.get(HOLES, 0), nbytes) if nbytes <= MMAP_THRESHOLD_MAX else 0
        host[HOLES] = host.get(HOLES, 0) - reused
        host[name] = host.get(name, 0) + (nbytes if touched else reused)
        return 0 if touched else nbytes - reused

    def free(tier: Tier, name: str, nbytes: int) -> None:
        nbytes = int(nbytes)
        if accelerator and tier is Tier.DEVICE:
            dev[name] -= nbytes
            return
        host[name] -= nbytes
        if nbytes <= MMAP_THRESHOLD_MAX:
            host[HOLES] = host.get(HOLES, 0) + nbytes

    best: tuple[int, str, dict[str, int]] = (-1, "", {})  # host RAM's peak
    best_dev: tuple[int, dict[str, int]] = (0, {})  # the accelerator's (its own moment)

    def point(where: str, extra_host: dict[str, int] | None = None, extra_dev: dict[str, int] | None = None):
        nonlocal best, best_dev
        h = {k: v for k, v in host.items() if v}
        d = {k: v for k, v in dev.items() if v}
        for k, v in (extra_host or {}).items():
            h[k] = h.get(k, 0) + v
        for k, v in (extra_dev or {}).items():
            d[k] = d.get(k, 0) + v
        if sum(h.values()) > best[0]:
            best = (sum(h.values()), where, h)
        if sum(d.values()) > best_dev[0]:
            best_dev = (sum(d.values()), d)

    if framework_bytes:
        alloc(Tier.CPU, "framework overhead", framework_bytes)
    # ---- 1. construction (fp32, host)
    ORIG = "model parameters as built (fp32)" if not partitioned else "fp32 parameter shards (partitioned_init)"
    if partitioned:
        original = {n: 4 * -(-k // dp) for n, k in numel.items()}
        leaves: dict[str, int] = {}
        for n, k in numel.items():
            leaf = n.rsplit(".", 1)[0] if "." in n else ""
            leaves[leaf] = leaves.get(leaf, 0) + 4 * k
        for n in original:
            alloc(Tier.CPU, ORIG, original[n])
        point("construction (partitioned_init)", {"module being initialised (fp32, whole)": max(leaves.values())})
    else:
        original = {n: 4 * k for n, k in numel.items()}
        for n in original:
            alloc(Tier.CPU, ORIG, original[n])
        point("construction (whole model, fp32)")
    # ---- 2. wrap: the engine's swap pool, then FlatParameters unit by unit
    opt_tier = Tier.DEVICE if optimizer_tier is Tier.DEVICE else Tier.CPU
    if stage == 3 and param_tier is Tier.NVME:  # the parameter swapper's pool, used by the shard writes
        pool_bytes = swap_pool_bytes(max(u.shard_numel for u in units) * D)
        written = sum(D * u.shard_numel for u in units if not u.resident)
        alloc(Tier.CPU, "NVMe staging buffers", min(pool_bytes, written))
    masters: list[int] = []
    untouched_grads = 0
    for u in units:
        shard_tier = Tier.DEVICE if u.resident else param_tier
        th: dict[str, int] = {}
        td: dict[str, int] = {}
        if u.resident:
            alloc(Tier.DEVICE, "flat parameters", D * u.padded_numel)
        else:
            (td if accelerator else th)["unit being flattened (compute dtype)"] = D * u.padded_numel
            if shard_tier is Tier.NVME:
                th["shard being written to NVMe"] = D * u.shard_numel
            else:
                alloc(shard_tier, "flat parameters", D * u.shard_numel)
        if partitioned:
            th["parameter gathered from its shards (fp32)"] = max(4 * numel[s.name] for s in u.slots)
        if not (D == 4 and optimizer_tier == shard_tier):
            alloc(opt_tier, "master weights (fp32)", 4 * u.shard_numel)
            masters.append(4 * u.shard_numel)
        if stage <= 1:
            alloc(Tier.DEVICE, "gradients (fp32)", 4 * u.padded_numel)
        else:
            untouched_grads += alloc(opt_tier, "gradients (fp32)", 4 * u.shard_numel,
                                     touched=optimizer_tier is not Tier.NVME)
        point(f"wrap: flattening unit {u.label}", th, td)
        for s_ in u.slots:  # the unit's original tensors are freed
            free(Tier.CPU, ORIG, original.pop(s_.name, 0))
    point("wrap: units flattened")
    # ---- 3. the NVMe optimizer: its ring; the masters leave, the gradient shards are zeroed
    if optimizer_tier is Tier.NVME:
        from tiertrain.update.nvme.chunk_update import BYTES_PER_ELEM

        chunk = min(max(1024, nvme_chunk_bytes // BYTES_PER_ELEM), max(u.shard_numel for u in units))
        alloc(Tier.CPU, "NVMe optimizer chunk buffers", nvme_buffers * BYTES_PER_ELEM * chunk)
        # fp32 shards on NVMe are their own masters: the optimizer's first records are read
        # from their files, one unit's shard at a time, instead of from masters in RAM
        read_back = max((4 * u.shard_numel for u in units if not u.resident), default=0) \
            if D == 4 and param_tier is Tier.NVME and stage == 3 else 0
        point("wrap: NVMe optimizer set up (the masters in RAM, if any, still there)",
              {"shard read back for the optimizer's records": read_back} if read_back else None)
        for m in masters:
            free(opt_tier, "master weights (fp32)", m)
        if not grads_released:
            host["gradients (fp32)"] = host.get("gradients (fp32)", 0) + untouched_grads
        point("wrap: masters dropped, gradient shards " + ("released" if grads_released else "zeroed"))
    _, where, h = best
    items = dict(h)
    for k, v in best_dev[1].items():
        items[f"{k} (device, at its own peak)"] = v
    return BuildPeak(partitioned=partitioned, host=sum(h.values()), device=best_dev[0], where=where,
                     items=items)


def engine_build_peak(module: nn.Module | None, dims: Any, lay: Any, overhead: HostOverhead | None = None,
                      accelerator: bool = False) -> BuildPeak:
    """:func:`simulate_build_peak` of a layout (:class:`~tiertrain.estimate.layout.ZeroLayout`),
    built as ``tiertrain train`` builds it (partitioned at stage 3 untiled with tp = 1)."""
    if module is None:
        module = dims.meta_model() if hasattr(dims, "meta_model") else gpt_meta_model(dims, lay.tile_factor)
    ov = overhead if overhead is not None else HostOverhead()
    return simulate_build_peak(
        module, dp=lay.zero_ranks, stage=lay.stage, precision_bytes=PRECISION_BYTES[lay.precision],
        param_tier=lay.param_tier if lay.stage == 3 else Tier.DEVICE, optimizer_tier=lay.optimizer_tier,
        bucket_mb=lay.bucket_mb, persistence_threshold=lay.persistence_threshold,
        # a Hugging Face model is built by its owner (from_config / from_pretrained): whole
        partitioned=builds_partitioned(lay.stage, getattr(module, "_tiertrain_tile_factor", lay.tile_factor), lay.tp)
        and not hasattr(dims, "activation_bytes"),
        accelerator=accelerator, framework_bytes=int(ov.framework_bytes),
        # (the in-place NVMe step running in backward frees each gradient shard it consumed,
        # so the engine gives them memory only at their first reduction)
        grads_released=Tier(lay.optimizer_tier) is Tier.NVME and lay.nvme_in_place and lay.stage >= 2)
