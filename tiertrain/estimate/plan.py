"""Choose a training layout that fits: ZeRO stage, memory tiers, activation checkpointing
and tiling, by ZeRO-Infinity's placement policy (docs/concepts.md#placement-policy), with the memory of every
candidate predicted by :func:`tiertrain.estimate.estimate` (tiertrain's own buffers) and its
efficiency by the bandwidth model (:mod:`tiertrain.estimate.bandwidth`).

The policy, as a ladder of rungs tried in order; the first rung with a candidate that fits
wins:

1. **no offload** ("offload only when aggregate device memory is not enough"): the lowest
   ZeRO stage that fits (stages 0–2 move the same 2Ψ per step and fewer collectives the
   lower the stage; stage 3 moves 3Ψ), first without activation checkpointing, then every
   block checkpointed selectively (no matrix multiplication recomputed,
   docs/concepts.md#selective-activation-checkpointing), then checkpointing as few blocks
   whole as fits (blocks 0, k, 2k, …: the largest k); the same order wherever checkpointing
   is searched below;
2. **optimizer states and gradients offloaded** to the fastest tier with room (CPU memory,
   then NVMe), at stage 2 then 3 (ZeRO-Offload builds on stage 2);
3. **parameters or activation checkpoints** (stage 3): if moving one of them suffices, the
   one with the better predicted efficiency — parameters to the fastest tier with room, or
   checkpoints to CPU memory;
4. **both**: checkpoints to CPU memory and parameters to the fastest tier with room.

Tiling (ZeRO-Infinity §5.1.3) is tried at stage 3 when the gathered block itself is what
does not fit (tile factors 2, 4, 8, 16 of each block's qkv, fc1 and fc2).

On a machine without an accelerator the "device" is host memory: the device and CPU tiers
are one pool, so only the NVMe tier relieves it (CPU offload of anything is never chosen
there). When nothing fits, :attr:`Plan.short` says which tier is short, per rank and per
node, and by how many bytes, for the most memory-frugal layout the policy allows.

This ladder plans data parallelism over every rank (t = p = 1). With accelerators, `tiertrain
plan` first chooses the tensor/pipeline/data layout by Megatron PTD-P's rules
(:mod:`tiertrain.estimate.layout3d`), which comes back here only when no 3D layout fits the
devices.

The machines are :mod:`tiertrain.estimate.hardware`'s; each candidate layout is evaluated by
:mod:`tiertrain.estimate.candidates`.
"""


from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Iterable

from tiertrain.errors import TiertrainError
from tiertrain.estimate.candidates import Candidate, _Evaluator, _checkpoint_offload, recomputed_blocks
from tiertrain.estimate.dims import ModelDims
from tiertrain.estimate.hardware import Hardware, Shortfall
from tiertrain.estimate.layout import ZeroLayout
from tiertrain.estimate.memory import Estimate
from tiertrain.tiers import Tier

if False:  # typing only
    from tiertrain.estimate.modules import HFModelDims  # noqa: F401

__all__ = ["Plan", "plan", "PlanError", "render_plan", "plan_to_json"]


class PlanError(TiertrainError, ValueError):
    """Nothing fits; the message names the tiers that are short and by how much."""

    def __init__(self, message: str, plan: "Plan"):
        super().__init__(message)
        self.plan = plan


@dataclass
class Plan:
    """The chosen layout (or, when nothing fits, the most frugal one and what is short)."""

    fits: bool
    dims: ModelDims
    layout: ZeroLayout
    estimate: Estimate
    hardware: Hardware
    budget: dict[str, int]
    usage: dict[str, int]
    efficiency: dict[str, Any] | None
    rung: str
    short: list[Shortfall] = field(default_factory=list)
    tried: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    build_usage: dict[str, int] | None = None
    """Bytes per rank by tier at the peak of building the model and wrapping it."""

    # -- the engine's configuration -----------------------------------------------------

    def config_dict(self) -> dict[str, Any]:
        """The sections of a ``tiertrain train`` config (TrainConfig) this plan sets."""
        lay, d = self.layout, self.dims
        # Plain strings (YAML cannot write an enum), in the configuration's spelling ("none"
        # for the device), which every version of the config parser reads.
        zero: dict[str, Any] = {"stage": lay.stage, "offload": "manual",
                                "offload_optimizer": Tier(lay.optimizer_tier).config_name,
                                "offload_params": Tier(lay.param_tier).config_name, "bucket_mb": lay.bucket_mb}
        if Tier.NVME in (lay.optimizer_tier, lay.param_tier):
            zero["nvme_path"] = self.hardware.swap_dir or ""
        if lay.nvme_in_place:
            zero["nvme_in_place"] = True
        if lay.nvme_grads_in_ram_mb:
            zero["nvme_grads_in_ram_mb"] = lay.nvme_grads_in_ram_mb
        # a Hugging Face model (HFModelDims) has no GPT model section: only the training layout
        model = {} if hasattr(d, "model_section") else {
            "model": {"n_layers": d.n_layers, "hidden": d.hidden, "n_heads": d.n_heads, "vocab_size": d.vocab,
                      "seq_len": d.seq_len, "ffn_mult": d.ffn_mult, "tie_embeddings": d.tie_embeddings,
                      "bias": d.bias}}
        parallel = {"parallel": {"cp": lay.cp, "cp_algorithm": lay.cp_algorithm}} if lay.cp > 1 else {}
        return {
            **model,
            **parallel,
            "precision": {"dtype": lay.precision},
            "batch": {"micro_batch_size": lay.micro_batch},
            "zero": zero,
            "activations": {"checkpoint_every": lay.checkpoint_interval,
                            "offload": _checkpoint_offload(lay).config_name, "recompute": lay.recompute},
            "tile_factor": lay.tile_factor,
        }

    def to_yaml(self) -> str:
        """A config file for ``tiertrain train --config`` (fields not given keep their defaults)."""
        import yaml

        from tiertrain.estimate.report import human_bytes

        head = [f"# tiertrain plan: {self.dims.num_parameters():,} parameters on {self.hardware.ranks} rank(s) "
                f"({self.hardware.source})",
                "# predicted per rank: " + ", ".join(f"{t} {human_bytes(b)}" for t, b in self.usage.items() if b)
                + (f"; efficiency {self.efficiency['combined']:.0%}" if self.efficiency else ""),
                f"# rung: {self.rung}" + ("" if self.fits else " — DOES NOT FIT: "
                                           + "; ".join(s.describe() for s in self.short)),
                "# use with: tiertrain train --config THIS_FILE [--nproc N]"]
        return "\n".join(head) + "\n" + yaml.safe_dump(self.config_dict(), sort_keys=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the choice, its predicted memory and efficiency, the config, the ladder."""
        lay = self.layout
        return {
            "fits": self.fits,
            "rung": self.rung,
            "parameters": self.dims.num_parameters(),
            "plan": {"stage": lay.stage, "dp": lay.dp, "cp": lay.cp, "precision": lay.precision, "micro_batch": lay.micro_batch,
                     "optimizer_tier": lay.optimizer_tier, "grad_tier": lay.grad_tier, "param_tier": lay.param_tier,
                     "checkpoint_every": lay.checkpoint_interval, "checkpoint_tier": lay.checkpoint_tier,
                     "recompute": lay.recompute, "tile_factor": lay.tile_factor},
            "memory_per_rank": dict(self.usage),
            "budget_per_rank": dict(self.budget),
            "peak_at": self.estimate.peak_at,
            "build_peak_per_rank": None if self.build_usage is None else dict(self.build_usage),
            "build_peak_per_node": None if self.build_usage is None else
            {t: b * self.hardware.ranks_per_node for t, b in self.build_usage.items()},
            "build": None if self.estimate.build is None else {
                "partitioned": self.estimate.build.partitioned, "where": self.estimate.build.where,
                "items": dict(self.estimate.build.items)},
            "lines": [asdict(l) for l in self.estimate.lines],
            "efficiency": self.efficiency,
            "short": [asdict(s) | {"short_per_rank": s.short_per_rank, "message": s.describe()} for s in self.short],
            "config": self.config_dict(),
            "hardware": {k: v for k, v in asdict(self.hardware).items() if k != "overhead"}
            | {"overhead": asdict(self.hardware.overhead), "shared_device_and_cpu": self.hardware.shared},
            "tried": list(self.tried),
            "notes": list(self.notes),
        }


def _checkpoint_options(n_layers: int) -> list[int]:
    """checkpoint_every values from fewest checkpointed blocks to most (distinct counts):
    k = nl checkpoints block 0 only; k = 1 every block."""
    out, seen = [], set()
    for k in range(n_layers, 0, -1):
        c = len(range(0, n_layers, k))
        if c not in seen:
            seen.add(c)
            out.append(k)
    return out


def _score(c: Candidate) -> float:
    """Predicted efficiency; without a compute peak, the recomputation factor alone."""
    if c.efficiency is not None:
        return c.efficiency["combined"]
    nl = c.estimate.dims.n_layers if c.estimate.dims else 1
    return 3 / (3 + recomputed_blocks(c.layout, nl) / nl)


def _tiling_can_help(c: Candidate) -> bool:
    """Whether smaller stage-3 units could close the gap: tiling shrinks the gathered units
    and the per-unit gradient buckets (and the allocator's share of them), nothing else."""
    if any(s.phase == "build" for s in c.short):
        return False  # a tiled model is built whole (not partitioned): tiling only adds to the build
    lines = {l.name: l.bytes for l in c.estimate.lines}
    shrinkable = lines.get("model-state working memory", 0) + lines.get("gradient buckets and reductions in flight", 0)
    shrinkable = int(shrinkable * 2)  # and the allocator's retention of them (≤ 1× measured)
    return all(s.short_per_rank < shrinkable for s in c.short)


def _first_fit(evaluate, rung: str, tried: list, ks: list[int], tiles: list[int], **fixed: Any) -> Candidate | None:
    """The first fitting candidate over tile factors (stage 3 only; fewest first) and, for
    the first tile factor where any fits, the checkpoint interval with the least
    checkpointing that fits. ``ks`` runs from most memory to least (0 = none, then fewest
    checkpointed blocks); memory falls along it, so it is searched by bisection. Where
    checkpointing is needed, every block checkpointed selectively is taken instead when it
    fits: it recomputes no matrix multiplication, so it is as fast as none."""
    if not ks:
        return None
    tile_list = tiles if fixed.get("stage") == 3 else [1]
    for tile in tile_list:
        last = evaluate(rung, checkpoint_interval=ks[-1], tile_factor=tile, **fixed)
        tried.append(last.summary())
        if last.rejected is None and not last.fits and tile == tile_list[0] and not _tiling_can_help(last):
            break  # short by more than all the per-unit working memory tiling could shrink
        if not last.fits:
            continue
        lo, hi, best = 0, len(ks) - 1, last  # ks[hi] fits; find the smallest index that fits
        while lo < hi:
            mid = (lo + hi) // 2
            c = evaluate(rung, checkpoint_interval=ks[mid], tile_factor=tile, **fixed)
            tried.append(c.summary())
            if c.fits:
                hi, best = mid, c
            else:
                lo = mid + 1
        if best.layout.checkpoint_interval:  # checkpointing is needed: selectively, if that fits
            selective = evaluate(rung, checkpoint_interval=1, recompute="selective", tile_factor=tile, **fixed)
            tried.append(selective.summary())
            if selective.fits:
                return selective
        return best
    return None


def plan(dims: "ModelDims | HFModelDims", hardware: Hardware, *, micro_batch: int = 1, precision: str = "bf16",
         stages: Iterable[int] = (0, 1, 2, 3), tiers: Iterable[Tier | str] = (Tier.CPU, Tier.NVME),
         checkpointing: bool = True, tile_factors: Iterable[int] = (1, 2, 4, 8, 16),
         bucket_mb: float = 25.0, backend: str | None = None, raise_if_short: bool = False,
         allowed=None, context_parallel: bool = True) -> Plan:
    """Choose stage, tiers, checkpoint interval and tile factor for training ``dims`` on
    ``hardware`` (see the module docstring for the policy). ``tiers``: offload tiers the
    engine may use (Tier.CPU, Tier.NVME or their spellings; NVMe also needs ``hardware.nvme_bytes``). Returns the
    :class:`Plan`; when nothing fits, ``plan.fits`` is False and ``plan.short`` says what is
    short (``raise_if_short``: raise :class:`PlanError` instead). ``allowed(layout)``: None
    when the engine can run the layout, else the reason (such layouts are skipped).
    ``dims``: tiertrain's GPT (:class:`ModelDims`) or any Hugging Face model of a supported
    family (:class:`~tiertrain.estimate.modules.HFModelDims`, from ``dims_of_hf_config`` or
    ``dims_of_module``; planned untiled). ``context_parallel``: the sequence may be split over
    ranks (parallel.cp) when activations are what does not fit."""
    dims = dims.validate()
    hw = hardware.validate()
    stages = sorted(set(stages))
    wanted = {Tier(t) for t in tiers}
    tiers = [t for t in (Tier.CPU, Tier.NVME) if t in wanted]
    if not hw.nvme_bytes:
        tiers = [t for t in tiers if t is not Tier.NVME]
    fast_tiers = [t for t in tiers if not (hw.shared and t is Tier.CPU)]  # CPU tier = device pool on CPU
    base = ZeroLayout(dp=hw.ranks, stage=0, precision=precision, micro_batch=micro_batch,
                      ranks_per_node=hw.ranks_per_node, bucket_mb=bucket_mb,
                      backend=backend or ("gloo" if hw.shared else "nccl"))
    evaluate = _Evaluator(dims, hw, base, allowed)
    own = getattr(dims, "own_checkpointing", 0)
    ks = _checkpoint_options(dims.n_layers) if checkpointing and not own else []
    tiles = [t for t in tile_factors if t >= 1]
    tiles = sorted(set(tiles)) or [1]
    if hasattr(dims, "meta_model"):
        tiles = [1]  # a Hugging Face model is planned untiled (tiertrain.tiling names GPT's linears)
    tried: list[dict[str, Any]] = []
    notes: list[str] = []
    if hw.shared:
        notes.append("no accelerator: the device is host memory, so CPU offload frees nothing; only the NVMe "
                     "tier can relieve it")
    if own:
        notes.append(f"the model checkpoints every {own}-th block itself (transformers' gradient_checkpointing_enable):"
                     f" planned with its checkpoints; the engine adds none (activations.checkpoint_every stays 0)")
    chosen: Candidate | None = None

    with_none = [0] + ks
    # 1. no offload: the lowest stage without checkpointing; else the stage whose least
    #    checkpointing that fits recomputes least (the best predicted efficiency), lowest first
    for stage in stages:
        c = _first_fit(evaluate, "no offload", tried, [0], tiles, stage=stage)
        if c is not None:
            chosen = c
            break
    if chosen is None and ks:
        fits = [c for c in (_first_fit(evaluate, "no offload", tried, ks, tiles, stage=stage) for stage in stages)
                if c is not None]
        if fits:
            chosen = max(fits, key=lambda c: (_score(c), -c.layout.stage))
    # 1b. context parallelism: the sequence split over cp ranks when the activations are what
    #     does not fit; the model states stay partitioned over all ranks (ZeRO over dp × cp)
    if chosen is None and context_parallel:
        chosen = _context_parallel_fit(evaluate, tried, stages, with_none, tiles, dims, hw.ranks, notes)
    # 2. optimizer states + gradients to the fastest tier with room
    if chosen is None:
        for tier in fast_tiers:
            for stage in [s for s in stages if s >= 2]:
                c = _first_fit(evaluate, f"optimizer states and gradients to {tier}", tried, with_none, tiles,
                               stage=stage, optimizer_tier=tier)
                if c is not None:
                    chosen = c
                    break
            if chosen:
                break
    # 3. parameters or checkpoints (stage 3), optimizer on the fastest tier with room (or on
    #    the device when no offload tier may hold it, e.g. an engine without an NVMe optimizer)
    opt_options = fast_tiers + [Tier.DEVICE]
    if chosen is None and 3 in stages:
        for opt in opt_options:
            options = []
            for ptier in fast_tiers:
                c = _first_fit(evaluate, f"optimizer to {opt}, parameters to {ptier}", tried, with_none, tiles,
                               stage=3, optimizer_tier=opt, param_tier=ptier)
                if c is not None:
                    options.append(c)
                    break
            if ks and not hw.shared:
                c = _first_fit(evaluate, f"optimizer to {opt}, activation checkpoints to cpu", tried, ks, tiles,
                               stage=3, optimizer_tier=opt, checkpoint_tier=Tier.CPU)
                if c is not None:
                    options.append(c)
            if options:
                chosen = max(options, key=lambda c: (c.efficiency or {}).get("combined", 0.0))
                if len(options) > 1:
                    notes.append("both moving parameters and moving activation checkpoints fit; chose the one with "
                                 "the higher predicted efficiency (ZeRO-Infinity's placement policy, docs/concepts.md#placement-policy)")
                break
    # 4. both: checkpoints to CPU, parameters to the fastest tier with room
    if chosen is None and 3 in stages and ks and not hw.shared:
        for opt in opt_options:
            for ptier in fast_tiers:
                c = _first_fit(evaluate, f"optimizer to {opt}, parameters to {ptier}, checkpoints to cpu", tried,
                               ks, tiles, stage=3, optimizer_tier=opt, param_tier=ptier, checkpoint_tier=Tier.CPU)
                if c is not None:
                    chosen = c
                    break
            if chosen:
                break

    if chosen is None:
        # the most frugal layout allowed, to say what is short
        big = fast_tiers[-1] if fast_tiers else Tier.DEVICE
        frugal = dict(stage=max(stages), checkpoint_interval=ks[-1] if ks else 0, tile_factor=1)
        if max(stages) >= 2 and big is not Tier.DEVICE:
            frugal["optimizer_tier"] = big
        if max(stages) == 3 and big is not Tier.DEVICE:
            frugal["param_tier"] = big
        if ks and not hw.shared and Tier.CPU in tiers:
            frugal["checkpoint_tier"] = Tier.CPU
        c = evaluate("nothing fits", **frugal)
        if max(stages) == 3 and max(tiles) > 1 and _tiling_can_help(c):
            c = evaluate("nothing fits", **{**frugal, "tile_factor": max(tiles)})
        tried.append(c.summary())
        result = Plan(False, dims, c.layout, c.estimate, hw, hw.budget(), c.usage, c.efficiency, c.rung,
                      c.short, tried, notes, c.build_usage)
        if not hw.nvme_bytes:
            notes.append("no NVMe tier was given (a probe with --swap-dir, or --nvme-bytes): with one, optimizer "
                         "states and parameters could leave host memory")
        if raise_if_short:
            raise PlanError(short_message(result), result)
        return result
    if any(t.get("stage", 3) < 3 and any(x.get("phase") == "build" for x in t["short"])
           and not any(x.get("phase") != "build" for x in t["short"]) for t in tried) and chosen.layout.stage == 3:
        notes.append("a layout below stage 3 would fit while training but not while the model is built (every "
                      "rank builds it whole in fp32 below stage 3): stage 3 builds it partitioned "
                      "(tiertrain.zero.partitioned_init)")
    return Plan(True, dims, chosen.layout, chosen.estimate, hw, hw.budget(), chosen.usage, chosen.efficiency,
                chosen.rung, [], tried, notes, chosen.build_usage)


def _context_parallel_sizes(dims, ranks: int) -> list[int]:
    """cp sizes the engine can run for this model on ``ranks`` ranks, smallest first: dividing
    the ranks and (ring attention's zig-zag split) half the sequence, for tiertrain's GPT and
    the Hugging Face decoders tiertrain.parallel.apply_context_parallel converts."""
    from tiertrain.models.hf import ROTARY_DECODERS
    from tiertrain.parallel.context import tokens_multiple

    if hasattr(dims, "model_type") and dims.model_type not in ROTARY_DECODERS:
        return []
    return [c for c in range(2, ranks + 1) if ranks % c == 0 and dims.seq_len % tokens_multiple(c, "ring") == 0]


def _context_parallel_fit(evaluate, tried: list, stages: list[int], ks: list[int], tiles: list[int], dims,
                          ranks: int, notes: list[str]) -> Candidate | None:
    """The smallest cp with which a layout fits without offload (the lowest stage, the least
    checkpointing), and a note saying why it was needed."""
    for c in _context_parallel_sizes(dims, ranks):
        for stage in stages:
            found = _first_fit(evaluate, f"context parallelism cp={c}", tried, ks, tiles, stage=stage,
                               dp=ranks // c, cp=c)
            if found is not None:
                notes.append(f"parallel.cp={c}: at seq_len {dims.seq_len} no layout fits without offload while each "
                             f"rank holds whole sequences; split over {c} ranks (ring attention), each holds the "
                             f"activations of {dims.seq_len // c} tokens, and the model states stay partitioned "
                             f"over all {ranks} ranks (ZeRO over dp × cp): cheaper than offloading, which frees no "
                             f"activation memory")
                return found
    return None


def short_message(p: Plan) -> str:
    """One line: nothing fits, and what is short by how much."""
    lay = p.layout
    what = (f"stage {lay.stage}, optimizer on {lay.optimizer_tier}, parameters on {lay.param_tier}, "
            f"checkpoint_every={lay.checkpoint_interval} ({lay.checkpoint_tier}), tile {lay.tile_factor}")
    return (f"no layout fits {p.dims.num_parameters():,} parameters (micro-batch {lay.micro_batch}, {lay.precision}) "
            f"on {p.hardware.ranks} rank(s); even the most frugal one ({what}): "
            + "; ".join(s.describe() for s in p.short))


# --------------------------------------------------------------------------- output


def render_plan(p: Plan) -> str:
    """The plan as a table a person reads: the choice, memory per tier against the budget,
    the estimate's lines, the predicted efficiency, and the ladder tried."""
    from tiertrain.estimate.report import _table, human_bytes

    lay, hw = p.layout, p.hardware
    kind = f"{p.dims.model_type} {p.dims.kind}, " if hasattr(p.dims, "model_type") else ""
    out = [f"model: {p.dims.num_parameters():,} parameters ({kind}{p.dims.n_layers} × {p.dims.hidden}, "
           f"{p.dims.n_heads} heads, vocab {p.dims.vocab}, seq {p.dims.seq_len}) | {hw.ranks} rank(s) "
           f"({hw.nodes} node × {hw.ranks_per_node}) | {lay.precision} | micro-batch {lay.micro_batch}",
           f"hardware: {hw.source}; " + ("no accelerator (device = host RAM)" if hw.shared
                                         else f"device {human_bytes(hw.device_memory)}")
           + f", host RAM {human_bytes(hw.host_memory)}/node"
           + (f", NVMe {human_bytes(hw.nvme_bytes)}/node at {hw.swap_dir}" if hw.nvme_bytes else ", no NVMe tier")
           + f"; {hw.reserve:.0%} of each tier kept free", ""]
    status = "FITS" if p.fits else "DOES NOT FIT"
    out.append(f"plan ({status}; rung: {p.rung})")
    rows = [["setting", "value"],
            ["zero.stage", str(lay.stage)],
            ["zero.offload_optimizer", Tier(lay.optimizer_tier).config_name],
            ["zero.offload_params", Tier(lay.param_tier).config_name],
            ["activations.checkpoint_every", str(lay.checkpoint_interval)],
            ["activations.recompute", lay.recompute],
            ["activations.offload", _checkpoint_offload(lay).config_name],
            ["tile_factor", str(lay.tile_factor)]]
    if lay.cp > 1:
        rows[1:1] = [["parallel.cp", str(lay.cp)], ["parallel.cp_algorithm", lay.cp_algorithm]]
    out += _table(rows, right=set()) + [""]
    mem = [["tier", "predicted per rank", "build peak per rank", "budget per rank", "use"]]
    build = p.build_usage or {}
    for t, used in p.usage.items():
        have = p.budget.get(t, 0)
        built = build.get(t, 0)
        if not used and not have and not built:
            continue
        worst = max(used, built)
        share = f"{worst / have:.0%}" if have else ("-" if not worst else "no tier")
        mem.append([str(t), human_bytes(used), human_bytes(built) if t in build and t != Tier.NVME else "-",
                    human_bytes(have), share])
    out += _table(mem, right={1, 2, 3, 4}) + [f"peak at: {p.estimate.peak_at}"]
    b = p.estimate.build
    if b is not None:
        n = hw.ranks_per_node
        how = ("partitioned (partitioned_init: fp32 shards, one module whole at a time)" if b.partitioned
               else "whole in fp32 on every rank, then flattened")
        out.append(f"build peak: model built {how}; {human_bytes(b.host)} host RAM per rank, "
                   f"{human_bytes(b.host * n)} per node ({n} ranks), at {b.where}")
    out.append("")
    lines = [["item", "bytes", "tier"]] + [[l.name, human_bytes(l.bytes), l.tier] for l in p.estimate.lines if l.bytes]
    out += _table(lines, right={1}) + [""]
    if p.efficiency:
        eff = [["state moved", "tier", "AIT (FLOP/B)", "bandwidth", "efficiency"]]
        for s in p.efficiency["states"]:
            eff.append([s["state"], s["tier"], f"{s['ait']:,.0f}",
                        "-" if s["bandwidth"] is None else f"{s['bandwidth'] / 1e9:.2f} GB/s",
                        "-" if s["efficiency"] is None else f"{s['efficiency']:.1%}"])
        if len(eff) > 1:
            out += _table(eff, right={2, 3, 4})
        out.append(f"predicted efficiency {p.efficiency['combined']:.1%} of {p.efficiency['peak_flops'] / 1e9:,.1f} "
                   f"GFLOP/s per rank (transfers {p.efficiency['transfer']:.1%} × recomputation "
                   f"{p.efficiency['recompute_factor']:.1%}; ZeRO-Infinity §4, no overlap)")
    else:
        out.append("predicted efficiency: no compute peak known (probe this machine, or give --peak-tflops)")
    if not p.fits:
        out += ["", "error: " + short_message(p)]
    out += [f"note: {n}" for n in p.notes]
    out.append(f"tried {len(p.tried)} layout(s); `--json` lists them")
    return "\n".join(out) + "\n"


def plan_to_json(p: Plan, indent: int | None = 2) -> str:
    return json.dumps(p.to_dict(), indent=indent, ensure_ascii=False, default=str)
