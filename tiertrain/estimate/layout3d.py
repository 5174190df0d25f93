"""Choose the 3D layout (t, p, d), the micro-batches m and the virtual stages v of a
Megatron PTD-P run (docs/concepts.md#megatron-ptd-p), with the per-rank memory of the estimator's formulas and
a simple communication model.

Symbols: K nodes of G ranks (one per accelerator), N = K·G; t tensor-, p pipeline-, d
data-parallel sizes with t·p·d = N; b the micro-batch per rank, B the global batch,
m = B/(d·b) micro-batches per pipeline flush, v model chunks per pipeline rank.

**Rules**, each tied to Megatron PTD-P §3 ("Performance analysis of parallelization
configurations"); :func:`plan3d` applies them in this order:

1. *Tensor parallelism stays within a node* (takeaway #1: t up to the g GPUs of a server;
   its all-reduces run on every layer, twice forward and twice backward, and need the
   intra-node links): t must divide G. ``tp across nodes`` rejects the others.
2. *Divisibility* (what the engine splits evenly): t divides the heads, the width, the
   vocabulary (vocab-parallel embedding, §2.3) and the MLP width; p divides the layers;
   d divides B/b (every data-parallel rank runs m whole micro-batches).
3. *Fit*: per-rank memory (below) within the device budget (``Hardware.budget``: device
   memory less the reserve); ``does not fit`` says by how much.
4. *Smallest model parallelism, tensor first* (takeaway #2: t·p just large enough to fit;
   takeaway #1: t up to G before p): candidates are ordered by p, then t, both ascending;
   the first that fits wins, and d = N/(t·p) takes what is left (takeaway #2: data
   parallelism scales further). Pipeline parallelism is therefore used only when no t ≤ G
   fits at p = 1, and since rank order puts pp outermost (tiertrain/topology.py, as
   Megatron) it is the axis that crosses nodes.
5. *Micro-batches and interleaving* (§2.2, takeaway #3): m = B/(d·b); the bubble of GPipe
   and 1F1B is (p−1)/m. When it exceeds ``Policy3D.interleave_above`` (10 %) and
   interleaving is possible (p > 1, m a multiple of p, v dividing the layers per stage
   nl/p), the smallest v with (p−1)/(m·v) within the threshold (else the largest v) is
   used: interleaving costs v× the p2p messages and holds 1 + (p−1)/(p·v) of the layers'
   activations on the first stage (Korthikanti et al. 2022 §4.2.3), so no more v than
   needed. A layout whose smallest bubble still exceeds ``Policy3D.max_bubble`` (50 %: m
   not ≫ p) is rejected as ``bubble``.
6. *Recomputation only when needed* (§3.5: it costs throughput at a fixed batch): all
   layouts are first evaluated without activation recomputation; only when none fits,
   again with every block checkpointed (``activations.checkpoint_every = 1``).
7. *ZeRO stage 1 across d* (Megatron's distributed optimizer): it partitions the fp32
   master weights and Adam moments over d for the same 2Ψ of traffic as plain data
   parallelism (ZeRO §7, docs/concepts.md#zero-communication-volume), so it is used whenever d > 1 (stage 0 at d = 1,
   where there is nothing to partition). Stage 2 is not used: with m > 1 both engines
   accumulate the step's micro-batches in whole fp32 gradient buffers and reduce them at
   the last one (``Engine.backward``: ``reduce_now=boundary``; the pipeline engine per
   chunk), so stage 2 lowers no peak; stage 3 is refused by the pipeline engine (pp > 1)
   and moves 3Ψ (1.5× the traffic).
8. *Offload only when no 3D layout fits the devices* (ZeRO-Infinity's placement policy, docs/concepts.md#placement-policy, "offload
   only when aggregate GPU memory is not enough"): then the ZeRO-Infinity placement ladder
   of :func:`tiertrain.estimate.plan.plan` (stages 0-3, CPU/NVMe tiers, checkpointing,
   tiling) runs for t = p = 1, d = N, where the engine supports every tier; when it does
   not fit either, the model is refused, naming what is short for both.

**Memory per rank** and **communication and time** of a layout are
:mod:`tiertrain.estimate.cost3d`'s.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from tiertrain.estimate.cost3d import (
    GiB,
    Interconnect,
    Layout3D,
    Policy3D,
    _stage_parameters,
    rank_memory,
    step_time,
)
from tiertrain.estimate.dims import ModelDims
from tiertrain.estimate.hardware import Hardware
from tiertrain.estimate.lines import PRECISION_BYTES
from tiertrain.estimate.plan import Plan, PlanError, plan, short_message
from tiertrain.tiers import Tier

__all__ = ["Plan3D", "plan3d", "render_plan3d", "plan3d_to_json", "refusal_message",
           "DIVISIBILITY", "TP_ACROSS_NODES", "DOES_NOT_FIT", "BUBBLE"]

DIVISIBILITY = "divisibility"
"""Rejection kind: a size does not split evenly (heads, width, vocabulary, layers, batch)."""
TP_ACROSS_NODES = "tp across nodes"
"""Rejection kind: t does not divide the ranks of a node (rule 1)."""
DOES_NOT_FIT = "does not fit"
"""Rejection kind: the per-rank peak exceeds the device budget."""
BUBBLE = "bubble"
"""Rejection kind: the smallest achievable bubble exceeds Policy3D.max_bubble."""


# --------------------------------------------------------------------------- the search


def _divisors(n: int) -> list[int]:
    return [x for x in range(1, n + 1) if n % x == 0]


def _structural_rejection(dims: ModelDims, hw: Hardware, t: int, p: int, d: int, samples: int) -> tuple[str, str]:
    """(kind, reason) of rules 1-2, or ("", "") when the layout splits evenly."""
    G = hw.ranks_per_node
    if t > G or G % t:
        where = f"t={t} > {G} ranks per node" if t > G else f"t={t} does not divide the {G} ranks of a node"
        return TP_ACROSS_NODES, f"{where}: tensor-parallel all-reduces would cross node boundaries"
    ffn = dims.ffn_mult * dims.hidden
    for what, value in (("heads", dims.n_heads), ("hidden", dims.hidden), ("vocab", dims.vocab), ("ffn width", ffn)):
        if value % t:
            return DIVISIBILITY, f"t={t} does not divide {what}={value}"
    if dims.n_layers % p:
        return DIVISIBILITY, f"p={p} does not divide layers={dims.n_layers}"
    if samples % d:
        return DIVISIBILITY, f"d={d} does not divide global batch / micro-batch = {samples}"
    return "", ""


def _virtual_stage_options(dims: ModelDims, p: int, m: int, policy: Policy3D) -> list[int]:
    """v > 1 the interleaved schedule allows: p > 1, m a multiple of p, v | nl/p."""
    if p == 1 or m % p:
        return []
    return [v for v in _divisors(dims.n_layers // p) if 1 < v <= policy.max_virtual_stages]


def _evaluate(dims: ModelDims, hw: Hardware, net: Interconnect, policy: Policy3D, t: int, p: int, d: int,
              global_batch: int, micro_batch: int, precision: str, checkpoint_every: int) -> Layout3D:
    samples = global_batch // micro_batch
    lay = Layout3D(t, p, d, stage=1 if d > 1 else 0, checkpoint_every=checkpoint_every,
                   budget=hw.budget()[Tier.DEVICE])
    kind, reason = _structural_rejection(dims, hw, t, p, d, samples)
    if kind:
        lay.kind, lay.reason = kind, reason
        return lay
    m = samples // d
    lay.m = m
    base = (p - 1) / m

    def memory(v: int) -> dict[str, int]:
        return rank_memory(dims, t, p, d, m, v, micro_batch, precision, lay.stage, checkpoint_every, policy)

    options = _virtual_stage_options(dims, p, m, policy)
    v, note = 1, ""
    if base > policy.interleave_above and p > 1:
        fitting = [x for x in options if sum(memory(x).values()) <= lay.budget]
        good = [x for x in fitting if base / x <= policy.interleave_above]
        if good:
            v = good[0]
            note = f"; bubble {base:.1%} > {policy.interleave_above:.0%} at v=1, interleaved v={v}"
        elif fitting:
            v = fitting[-1]
            note = f"; bubble {base:.1%} at v=1, interleaved v={v} (largest that fits)"
        elif options:
            note = f"; bubble {base:.1%} > {policy.interleave_above:.0%} but no v > 1 fits in memory"
        else:
            why = (f"m={m} is not a multiple of p={p}" if m % p else
                   f"layers/p={dims.n_layers // p} has no divisor in 2..{policy.max_virtual_stages}")
            note = f"; bubble {base:.1%} > {policy.interleave_above:.0%} but interleaving is impossible ({why})"
    lay.v = v
    lay.bubble = base / v
    lay.memory = memory(v)
    psi_rank = max(_stage_parameters(dims, t, p))
    lay.time = step_time(dims, hw, net, lay, global_batch, micro_batch, precision, psi_rank)
    from tiertrain.estimate.report import human_bytes

    if lay.bubble > policy.max_bubble:
        lay.kind = BUBBLE
        lay.reason = (f"bubble (p-1)/(m·v) = {p - 1}/({m}·{v}) = {lay.bubble:.0%} > {policy.max_bubble:.0%} "
                      f"(m={m} micro-batches is not ≫ p={p})")
    elif lay.peak > lay.budget:
        lay.kind = DOES_NOT_FIT
        lay.reason = (f"needs {human_bytes(lay.peak)} per rank of {human_bytes(lay.budget)}: short by "
                      f"{human_bytes(lay.peak - lay.budget)}")
    else:
        lay.status = "fits"
        lay.reason = f"fits ({human_bytes(lay.peak)} of {human_bytes(lay.budget)})" + note
    return lay


@dataclass
class Plan3D:
    """The chosen 3D layout (or the offload fallback), and every candidate with its verdict."""

    fits: bool
    """True when a layout (3D, or the offload fallback) fits."""
    dims: ModelDims
    """The model."""
    hardware: Hardware
    """The machine planned for."""
    interconnect: Interconnect
    """The bandwidth assumptions."""
    policy: Policy3D
    """The thresholds used."""
    global_batch: int
    """B, samples per optimizer step."""
    micro_batch: int
    """b, samples per micro-batch per rank."""
    precision: str
    """Compute dtype."""
    chosen: Layout3D | None
    """The chosen 3D layout; None when none fits (see ``fallback``)."""
    candidates: list[Layout3D] = field(default_factory=list)
    """Every (t, p, d) evaluated, in rule order (the pass that decided: with or without recomputation)."""
    fallback: Plan | None = None
    """The ZeRO-Infinity ladder's plan at t = p = 1 when no 3D layout fits the devices (rule 8)."""
    notes: list[str] = field(default_factory=list)
    """Assumptions and decisions, in words."""

    @property
    def reference(self) -> Layout3D | None:
        """The chosen layout; when none fits and there is no fallback plan, the most frugal 3D
        layout evaluated (what the written config holds, for reference)."""
        if self.chosen is not None or self.fallback is not None:
            return self.chosen
        short = [c for c in self.candidates if c.memory]
        return min(short, key=lambda c: c.peak) if short else None

    @property
    def cp(self) -> int:
        """The context-parallel degree: the fallback ladder's (it splits a long sequence over cp
        ranks when the activations are what does not fit); 1 for a 3D layout."""
        return self.fallback.layout.cp if self.reference is None and self.fallback is not None else 1

    @property
    def layout(self) -> tuple[int, int, int]:
        """(t, p, d) of the plan (the fallback's is (1, 1, N / cp))."""
        ref = self.reference
        if ref is not None:
            return ref.t, ref.p, ref.d
        return 1, 1, self.hardware.ranks // self.cp

    def config_dict(self) -> dict[str, Any]:
        """The sections of a ``tiertrain train`` config (TrainConfig) this plan sets."""
        t, p, d = self.layout
        m = self.global_batch // (self.micro_batch * d)
        c = self.reference
        if c is None and self.fallback is not None:
            out = self.fallback.config_dict()  # (its parallel section: cp and cp_algorithm, when it splits)
            out["parallel"] = {**out.get("parallel", {}), "dp": d, "tp": 1, "pp": 1, "schedule": "1f1b",
                               "virtual_stages": 1}
        elif c is None:
            raise ValueError("Plan3D.config_dict: no (t, p, d) splits this model and batch evenly "
                             f"({sorted({x.kind for x in self.candidates})}): there is no config to write")
        else:
            dd = self.dims
            out = {
                "model": {"n_layers": dd.n_layers, "hidden": dd.hidden, "n_heads": dd.n_heads, "vocab_size": dd.vocab,
                          "seq_len": dd.seq_len, "ffn_mult": dd.ffn_mult, "tie_embeddings": dd.tie_embeddings,
                          "bias": dd.bias},
                "precision": {"dtype": self.precision},
                "parallel": {"dp": d, "tp": t, "pp": p, "schedule": c.schedule, "virtual_stages": c.v},
                "zero": {"stage": c.stage, "offload": "manual", "offload_optimizer": Tier.DEVICE.config_name,
                         "offload_params": Tier.DEVICE.config_name, "bucket_mb": self.policy.bucket_mb},
                "activations": {"checkpoint_every": c.checkpoint_every, "offload": Tier.DEVICE.config_name},
                "tile_factor": 1,
            }
        out["batch"] = {"micro_batch_size": self.micro_batch, "grad_accum_steps": m,
                        "global_batch_size": self.global_batch}
        return out

    def to_yaml(self) -> str:
        """A config file for ``tiertrain train --config`` (torchrun over the stated nodes)."""
        import yaml

        t, p, d = self.layout
        hw, ref = self.hardware, self.reference
        head = [f"# tiertrain plan (3D): {self.dims.num_parameters():,} parameters on {hw.nodes} node(s) × "
                f"{hw.ranks_per_node} rank(s) ({hw.source})",
                f"# t={t} p={p} d={d}" + (f" cp={self.cp}" if self.cp > 1 else "") + (f" m={ref.m} v={ref.v}, predicted {ref.peak / GiB:.1f} GiB per rank, "
                                          f"bubble {ref.bubble:.1%}" if ref else " (ZeRO-Infinity offload ladder)")
                + ("" if self.fits else " — DOES NOT FIT"),
                f"# use with: torchrun --nnodes {hw.nodes} --nproc-per-node {hw.ranks_per_node} ... "
                f"-m tiertrain.cli train --config THIS_FILE"]
        return "\n".join(head) + "\n" + yaml.safe_dump(self.config_dict(), sort_keys=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: the choice, every candidate with its verdict, the config, the assumptions."""
        t, p, d = self.layout
        c = self.chosen
        return {
            "fits": self.fits,
            "parameters": self.dims.num_parameters(),
            "plan": {"tp": t, "pp": p, "dp": d, "cp": self.cp, "micro_batches": self.global_batch // (self.micro_batch * d),
                     "virtual_stages": c.v if c else 1, "schedule": c.schedule if c else "1f1b",
                     "zero_stage": c.stage if c else (self.fallback.layout.stage if self.fallback else None),
                     "checkpoint_every": c.checkpoint_every if c else (
                         self.fallback.layout.checkpoint_interval if self.fallback else None),
                     "bubble": c.bubble if c else 0.0, "memory_per_rank": c.peak if c else None,
                     "source": "3d" if c else "offload ladder"},
            "chosen": c.to_dict() if c else None,
            "candidates": [x.to_dict() for x in self.candidates],
            "fallback": None if self.fallback is None else self.fallback.to_dict(),
            "global_batch": self.global_batch, "micro_batch": self.micro_batch, "precision": self.precision,
            "interconnect": dataclasses.asdict(self.interconnect), "policy": dataclasses.asdict(self.policy),
            "config": self.config_dict(),
            "notes": list(self.notes),
        }


def _order(lay: Layout3D) -> tuple[int, int]:
    """Rule 4: pipeline size first, then tensor size, both ascending."""
    return lay.p, lay.t


def plan3d(dims: ModelDims, hardware: Hardware, *, global_batch: int, micro_batch: int = 1,
           precision: str = "bf16", interconnect: Interconnect | None = None, policy: Policy3D | None = None,
           ladder: dict[str, Any] | None = None, raise_if_short: bool = False) -> Plan3D:
    """Choose (t, p, d), m, v, the ZeRO stage and tiers for ``dims`` on ``hardware`` (which
    needs ``device_memory``: a stated accelerator) by the rules of the module docstring.
    ``ladder``: keyword arguments of :func:`~tiertrain.estimate.plan.plan` for the offload
    fallback (stages, tiers, checkpointing, tile_factors). ``raise_if_short``: raise
    :class:`~tiertrain.estimate.plan.PlanError` when nothing fits, instead of returning a plan
    with ``fits`` False."""
    dims = dims.validate()
    hw = hardware.validate()
    net = (interconnect or Interconnect()).validate()
    pol = (policy or Policy3D()).validate()
    if hw.device_memory is None:
        raise ValueError("plan3d: hardware.device_memory=None is invalid: the 3D planner needs the memory of an "
                         "accelerator (give --gpu-memory SIZE for a stated machine)")
    for name, value in (("global_batch", global_batch), ("micro_batch", micro_batch)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"plan3d: {name}={value!r} is invalid: must be an int >= 1")
    if global_batch % micro_batch:
        raise ValueError(f"plan3d: global_batch={global_batch} is invalid with micro_batch={micro_batch}: "
                         f"expected a multiple of {micro_batch}")
    if precision not in PRECISION_BYTES:
        raise ValueError(f"plan3d: precision={precision!r} is invalid: expected one of {sorted(PRECISION_BYTES)}")
    N = hw.ranks
    pairs = sorted(((t, p) for t in _divisors(N) for p in _divisors(N // t)), key=lambda tp: (tp[1], tp[0]))
    notes: list[str] = []
    passes = [0] + ([1] if pol.recompute else [])
    candidates: list[Layout3D] = []
    chosen: Layout3D | None = None
    for ci in passes:
        candidates = [_evaluate(dims, hw, net, pol, t, p, N // (t * p), global_batch, micro_batch, precision, ci)
                      for t, p in pairs]
        fitting = [c for c in candidates if c.status == "fits"]
        if fitting:
            chosen = min(fitting, key=_order)
            chosen.status = "chosen"
            chosen.reason = "the smallest p, then t, that " + chosen.reason
            for c in fitting:
                if c is not chosen:
                    more = "larger t" if c.p == chosen.p else "larger p"
                    c.reason += f"; not chosen: {more} than needed (rule 4)"
            if ci:
                notes.append("no layout fits without activation recomputation: every block is checkpointed "
                             "(activations.checkpoint_every=1; Megatron §3.5)")
            break
    result = Plan3D(chosen is not None, dims, hw, net, pol, global_batch, micro_batch, precision, chosen,
                    candidates, None, notes)
    if chosen is not None:
        if chosen.d > 1:
            notes.append(f"ZeRO stage 1 over d={chosen.d} (Megatron's distributed optimizer): fp32 master weights "
                         f"and Adam moments partitioned for the same traffic as plain data parallelism")
        if chosen.p > 1 and hw.nodes > 1:
            notes.append("pp is the outermost rank axis (tiertrain/topology.py): pipeline stages span the nodes")
        notes.append("host memory is not checked for 3D layouts (each rank builds its own stages); "
                     "the communication times assume no overlap (an upper bound)")
        return result
    if pol.offload_fallback:
        fb = plan(dims, dataclasses.replace(hw), micro_batch=micro_batch, precision=precision, bucket_mb=pol.bucket_mb,
                  **(ladder or {}))
        result.fallback = fb
        if fb.fits:
            result.fits = True
            notes.append(f"no 3D layout fits the devices: the ZeRO-Infinity ladder at t=p=1, d={N // fb.layout.cp}"
                         + (f", cp={fb.layout.cp}" if fb.layout.cp > 1 else "")
                         + f" chose stage {fb.layout.stage} ({fb.rung}) (rule 8)")
            return result
    if raise_if_short:
        raise PlanError(refusal_message(result), result.fallback)  # type: ignore[arg-type]
    return result


def refusal_message(p: Plan3D) -> str:
    """One line: why no layout fits (the most frugal 3D layout's shortfall, and the ladder's)."""
    from tiertrain.estimate.report import human_bytes

    short = [c for c in p.candidates if c.kind == DOES_NOT_FIT]
    text = (f"no layout fits {p.dims.num_parameters():,} parameters on {p.hardware.nodes} node(s) × "
            f"{p.hardware.ranks_per_node} rank(s) of {human_bytes(p.hardware.device_memory)}")
    if short:
        best = min(short, key=lambda c: c.peak)
        text += (f": the most frugal 3D layout ({best.label()}, ZeRO stage {best.stage}"
                 + (", every block recomputed" if best.checkpoint_every else "")
                 + f") needs {human_bytes(best.peak)} per rank, short by {human_bytes(best.peak - best.budget)}")
    else:
        kinds = sorted({c.kind for c in p.candidates})
        text += f": every (t, p, d) is rejected ({', '.join(kinds)})"
    if p.fallback is not None and not p.fallback.fits:
        text += "; with offload (t=p=1): " + short_message(p.fallback)
    return text


# --------------------------------------------------------------------------- output


def render_plan3d(p: Plan3D) -> str:
    """The plan as text: the choice, its memory by item, and every alternative with its verdict."""
    from tiertrain.estimate.plan import render_plan
    from tiertrain.estimate.report import _table, human_bytes

    hw, d = p.hardware, p.dims
    out = [f"model: {d.num_parameters():,} parameters ({d.n_layers} × {d.hidden}, {d.n_heads} heads, vocab {d.vocab}, "
           f"seq {d.seq_len}) | {hw.nodes} node(s) × {hw.ranks_per_node} = {hw.ranks} rank(s) of "
           f"{human_bytes(hw.device_memory)} | {p.precision} | global batch {p.global_batch}, "
           f"micro-batch {p.micro_batch}",
           f"hardware: {hw.source}; {hw.reserve:.0%} of device memory kept free; links "
           f"{p.interconnect.intra_node_bw / 1e9:g} GB/s intra-node, {p.interconnect.inter_node_bw / 1e9:g} GB/s "
           f"inter-node per rank; {(hw.peak_flops or p.interconnect.default_flops) / 1e12:g} TFLOP/s per rank", ""]
    c = p.chosen
    if c is not None:
        out.append(f"plan (FITS): t={c.t} p={c.p} d={c.d}, m={c.m} micro-batches, v={c.v} ({c.schedule}), "
                   f"ZeRO stage {c.stage}, tiers: all on the device, "
                   f"checkpoint_every={c.checkpoint_every}")
        out.append(f"predicted per rank: {human_bytes(c.peak)} of {human_bytes(c.budget)}; bubble "
                   f"{c.bubble:.1%}; step ≈ {c.time['total']:.2f} s (compute {c.time['compute']:.2f}, tp "
                   f"{c.time['tp']:.2f}, pp {c.time['pp']:.2f}, dp {c.time['dp']:.2f})")
        out += _table([["item (heaviest stage)", "bytes per rank"]]
                      + [[k, human_bytes(v)] for k, v in c.memory.items() if v], right={1})
    elif p.fallback is not None and p.fallback.fits:
        cp = f" cp={p.cp}" if p.cp > 1 else ""
        out.append(f"plan (FITS, offload): no 3D layout fits the devices; t=1 p=1 d={hw.ranks // p.cp}{cp} with "
                   f"the ZeRO-Infinity ladder:")
        out.append(render_plan(p.fallback).rstrip())
    else:
        out.append("plan: DOES NOT FIT")
    out.append("")
    rows = [["t", "p", "d", "m", "v", "ckpt", "per rank", "bubble", "step s", "verdict"]]
    for x in p.candidates:
        rows.append([str(x.t), str(x.p), str(x.d), "-" if x.m is None else str(x.m), str(x.v),
                     str(x.checkpoint_every), human_bytes(x.peak) if x.memory else "-",
                     "-" if x.bubble is None else f"{x.bubble:.1%}",
                     f"{x.time['total']:.2f}" if x.time else "-",
                     (x.status.upper() + ": " if x.status == "chosen" else f"{x.kind}: " if x.kind else "") + x.reason])
    out.append("alternatives (rule order: p, then t, ascending; the first that fits is chosen)")
    out += _table(rows, right={0, 1, 2, 3, 4, 5, 6, 7, 8})
    if not p.fits:
        out += ["", "error: " + refusal_message(p)]
    out += [f"note: {n}" for n in p.notes]
    return "\n".join(out) + "\n"


def plan3d_to_json(p: Plan3D, indent: int | None = 2) -> str:
    return json.dumps(p.to_dict(), indent=indent, ensure_ascii=False, default=str)
