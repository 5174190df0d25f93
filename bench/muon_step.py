"""Muon's whole-parameter step: what it adds to a ZeRO step in bytes and in time, beside
AdamW and beside DeepSpeed's own Muon.

An optimizer that needs whole tensors (torch.optim.Muon orthogonalises each hidden matrix)
cannot step the flat shards ZeRO gives each rank, so tiertrain gives every such parameter one
owning rank (tiertrain/update/whole.py): an all_to_all sends masters and gradients to the
owners (8 B per element that changes rank), the owners step, a second all_to_all sends the
new values back (4 B): 12 B × (n-1)/n per Muon element and step for n ranks, summed over
ranks, when the owners are balanced. This script measures that on 2 gloo ranks at ZeRO
stages 1, 2 and 3, on a tiertrain GPT whose 2-D block weights go to Muon and the rest
(embeddings, biases, norms) to AdamW, against AdamW alone on the same model:

* bytes: the engine's own counter (``engine.counter``, logical bytes per collective kind:
  the exchange is its "all_to_all"), and the bytes each rank puts on the wire, counted by
  wrapping torch.distributed's collectives in the worker processes (ring volumes: exact at
  2 ranks; see :class:`Wire`), which also counts DeepSpeed's collectives;
* time: median step (forward + backward + optimizer step; the slower rank's) and median
  optimizer step alone, over ``--steps`` rounds after ``--warmup``; all engines of a stage
  are built side by side in the same two processes and take one step each in turn, so
  machine load hits them alike;
* DeepSpeed (``--deepspeed``, default on): ``deepspeed.initialize`` with the config's
  ``{"type": "Muon"}`` optimizer (its MuonWithAuxAdam: use_muon on the >=2-D parameters not
  named embed/lm_head, here the same matrices) and with ``{"type": "AdamW"}``, both on
  torch's AdamW kernel (``torch_adam``); at stage 3 DeepSpeed refuses Muon with its default
  ``reduce_scatter``, so its Muon runs with ``reduce_scatter: false`` (all-reduced gradients).

    python bench/muon_step.py --out bench/results/muon.md
"""
from __future__ import annotations

import argparse
import inspect
import os
import statistics
import sys
import threading
import time
from collections import defaultdict

import torch
import torch.distributed as dist

import tiertrain
from _common import loadavg, machine_lines
from tiertrain.config import Config, from_dict
from tiertrain.models.gpt import GPT, GPTConfig
from tiertrain.spans import Timeline, start_recording, stop_recording
from tiertrain.testing import run_distributed

MUON_LR, ADAM_LR, BETAS, DECAY = 0.02, 1e-3, (0.9, 0.999), 0.01
"""The same in every engine: DeepSpeed's AdamW defaults, decay on every parameter."""
ENGINES = ("tiertrain AdamW", "tiertrain Muon+AdamW", "DeepSpeed AdamW", "DeepSpeed Muon")


# -- bytes on the wire ----------------------------------------------------------------------------


def _nbytes(t) -> int:
    return sum(_nbytes(x) for x in t) if isinstance(t, (list, tuple)) else t.numel() * t.element_size()


def _volume(name: str, a: dict, n: int, me: int) -> float:
    """Bytes this rank sends to the others in a ring implementation (the minimum at 2 ranks;
    for reduce and broadcast the sum over ranks is right, not each rank's share)."""
    if name in ("all_reduce", "all_reduce_coalesced"):
        return 2 * (n - 1) / n * _nbytes(a["tensor"] if "tensor" in a else a["tensors"])
    if name in ("reduce", "broadcast"):
        return (n - 1) / n * _nbytes(a["tensor"])
    if name in ("all_gather_into_tensor", "_all_gather_base"):
        return (n - 1) * _nbytes(a["input_tensor"])
    if name == "all_gather":
        return (n - 1) * _nbytes(a["tensor"])
    if name in ("reduce_scatter_tensor", "_reduce_scatter_base"):
        return (n - 1) / n * _nbytes(a["input"])
    if name == "reduce_scatter":
        return (n - 1) / n * _nbytes(a["input_list"])
    if name == "all_to_all_single":
        splits, t = a.get("input_split_sizes"), a["input"]
        if not splits:
            return (n - 1) / n * _nbytes(t)
        row = _nbytes(t) // max(t.shape[0], 1)
        return row * sum(s for r, s in enumerate(splits) if r != me)
    if name == "all_to_all":
        return sum(_nbytes(x) for r, x in enumerate(a["input_tensor_list"]) if r != me)
    if name in ("send", "isend"):
        return _nbytes(a["tensor"])
    raise KeyError(name)


class Wire:
    """torch.distributed's collectives wrapped (in both namespaces, torch.distributed and
    distributed_c10d, before DeepSpeed binds them) to add each call's volume (:func:`_volume`)
    to ``bytes``, by collective; nested calls (_all_gather_base → all_gather_into_tensor) count
    once."""

    NAMES = ("all_reduce", "all_reduce_coalesced", "reduce", "broadcast", "all_gather", "all_gather_into_tensor",
             "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
             "all_to_all_single", "all_to_all", "send", "isend")

    def __init__(self):
        self.bytes: dict[str, float] = defaultdict(float)
        self.local = threading.local()
        from torch.distributed import distributed_c10d as c10d
        for name in self.NAMES:
            original = getattr(c10d, name, None)
            if original is not None:
                wrapped = self._wrap(name, original)
                for namespace in (dist, c10d):
                    setattr(namespace, name, wrapped)

    def _wrap(self, name, original):
        signature = inspect.signature(original)

        def counted(*args, **kwargs):
            if getattr(self.local, "inside", False):
                return original(*args, **kwargs)
            a = signature.bind(*args, **kwargs).arguments
            group = a.get("group")
            self.bytes[name] += _volume(name, a, dist.get_world_size(group), dist.get_rank(group))
            self.local.inside = True
            try:
                return original(*args, **kwargs)
            finally:
                self.local.inside = False
        return counted


# -- the engines ----------------------------------------------------------------------------------


def _hidden(name: str, p: torch.Tensor) -> bool:
    """Muon's matrices: the 2-D weights of the blocks (DeepSpeed's rule, >= 2-D and not
    embed/lm_head, picks the same ones in this tied GPT)."""
    return p.ndim == 2 and name.startswith("blocks.")


def _model(a) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=a.vocab, seq_len=a.seq, n_layers=a.layers, hidden=a.hidden, n_heads=a.heads))


def _tiertrain(stage: int, muon: bool, a):
    cfg = from_dict(Config, {"zero": {"stage": stage}, "batch": {"micro_batch_size": a.micro},
                             "optimizer": {"lr": ADAM_LR, "betas": list(BETAS), "weight_decay": DECAY,
                                           "weight_decay_on": "all", "grad_clip": 0.0},
                             "schedule": {"warmup_steps": 0}}).validate()
    model = _model(a)
    optimizer = None
    if muon:
        named = list(model.named_parameters())
        optimizer = [torch.optim.Muon([p for n, p in named if _hidden(n, p)], lr=MUON_LR, weight_decay=DECAY),
                     torch.optim.AdamW([p for n, p in named if not _hidden(n, p)], lr=ADAM_LR, weight_decay=DECAY)]
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel), optimizer=optimizer)

    def forward_backward(batch):
        loss = engine(batch)
        engine.backward(loss)
        return loss
    return engine, forward_backward, engine.step, engine.close


def _deepspeed(stage: int, muon: bool, a):
    import deepspeed

    adam = {"betas": list(BETAS), "weight_decay": DECAY, "torch_adam": True}
    optimizer = ({"type": "Muon", "params": {"lr": ADAM_LR, "muon_lr": MUON_LR, "adam_lr": ADAM_LR, "momentum": 0.95,
                                             **adam}} if muon else {"type": "AdamW", "params": {"lr": ADAM_LR, **adam}})
    zero = {"stage": stage, **({"reduce_scatter": False} if muon and stage == 3 else {})}
    cfg = {"train_micro_batch_size_per_gpu": a.micro, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "zero_optimization": zero, "fp16": {"enabled": False}, "bf16": {"enabled": False},
           "steps_per_print": 10**9, "optimizer": optimizer}
    model = _model(a)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                           dist_init_required=False)
    if muon:
        assert sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in model.parameters()
                   if p.use_muon) == sum(p.numel() for n, p in _model(a).named_parameters() if _hidden(n, p))

    def forward_backward(batch):
        loss = engine(**batch)
        engine.backward(loss)
        return loss
    return engine, forward_backward, engine.step, engine.destroy


def _plan_figures(engine, rank: int, world: int) -> dict:
    """From tiertrain's exchange plan: the bytes this rank sends in the two all_to_alls (8 B per
    element it sends to owners, 4 B per element it sends back) and the Muon elements it owns;
    and (the same on every rank) the bytes, summed over ranks, and the owners' loads if each
    matrix were owned by the rank whose shards hold most of it."""
    plan = engine.update.plan
    others = [k for k in range(world) if k != rank]
    held = defaultdict(lambda: [0] * world)
    for u in engine.flat.units:
        for holder in range(world):
            for slot, start, end in u.unit.shard_pieces(holder):
                if slot.name in plan.owner_of:
                    held[slot.name][holder] += end - start
    loads = [0] * world
    for counts in held.values():
        loads[max(range(world), key=counts.__getitem__)] += sum(counts)
    sent = 8 * sum(plan.send_splits[k] for k in others) + 4 * sum(plan.receive_splits[k] for k in others)
    return dict(plan_bytes=sent, owned=plan.owned_numel, holder_loads=loads,
                holder_bytes=12 * sum(sum(c) - max(c) for c in held.values()))


def _rank(rank: int, world: int, a) -> dict:
    for k, v in dict(RANK=rank, LOCAL_RANK=rank, WORLD_SIZE=world, LOCAL_WORLD_SIZE=world, DS_ACCELERATOR="cpu",
                     MASTER_ADDR="127.0.0.1", MASTER_PORT=29500).items():
        os.environ.setdefault(k, str(v))
    wire = Wire()
    if a.deepspeed:
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(0, a.vocab, (a.micro, a.seq + 1), generator=g)
    batch = {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}
    out = {}
    for stage in a.stages:
        builders = [(ENGINES[0], _tiertrain, False), (ENGINES[1], _tiertrain, True)]
        if a.deepspeed:
            builders += [(ENGINES[2], _deepspeed, False), (ENGINES[3], _deepspeed, True)]
        engines = {name: build(stage, muon, a) for name, build, muon in builders}
        rec = {name: dict(step=[], opt=[], exchange=[], loss=[], wire=defaultdict(float)) for name in engines}
        for r in range(a.warmup + a.steps):
            if r == a.warmup:
                for name in engines:
                    if name.startswith("tiertrain"):
                        engines[name][0].counter.reset()
            order = list(engines) if r % 2 == 0 else list(engines)[::-1]
            for name in order:
                _, forward_backward, step, _ = engines[name]
                timeline = Timeline()  # (tiertrain's spans: the exchange's share of its step)
                dist.barrier()
                before = dict(wire.bytes)
                start = time.perf_counter()
                loss = forward_backward(batch)
                middle = time.perf_counter()
                start_recording(timeline)
                step()
                stop_recording(timeline)
                end = time.perf_counter()
                if r >= a.warmup:
                    rec[name]["step"].append(end - start)
                    rec[name]["opt"].append(end - middle)
                    rec[name]["exchange"].append(sum(e - b for *_, what, b, e in timeline.spans
                                                     if what in ("whole_gather", "whole_scatter")) / 1e9)
                    rec[name]["loss"].append(float(loss.detach()))
                    for kind, b in wire.bytes.items():
                        rec[name]["wire"][kind] += b - before.get(kind, 0.0)
        for name, (engine, _, _, close) in engines.items():
            rec[name]["wire"] = dict(rec[name]["wire"])
            if name.startswith("tiertrain"):
                rec[name]["counter"] = engine.counter.snapshot()
            if name == ENGINES[1]:
                rec[name].update(_plan_figures(engine, rank, world))
            close()
        out[stage] = rec
    return out


# -- the report -----------------------------------------------------------------------------------


def _median_max(per_rank, stage, name, key) -> float:
    """Median over rounds of the slower rank's time (ms)."""
    rounds = zip(*(r[stage][name][key] for r in per_rank))
    return statistics.median(max(t) for t in rounds) * 1e3


def _paired(per_rank, stage, name, base) -> float:
    """Median over rounds of the ratio of the two engines' steps in that round (slower rank's)."""
    rounds = zip(*(zip(r[stage][name]["step"], r[stage][base]["step"]) for r in per_rank))
    return statistics.median(max(x for x, _ in pair) / max(y for _, y in pair) for pair in rounds)


def _report(per_rank, a, muon_numel: int, params: int, command: str, load: tuple[str, str]) -> str:
    n, steps = len(per_rank), a.steps
    names = [x for x in ENGINES if x in per_rank[0][a.stages[0]]]

    def summed(stage, name, field, kind=None):
        values = [r[stage][name][field] for r in per_rank]
        return sum(v.get(kind, 0) if kind else (sum(v.values()) if isinstance(v, dict) else v) for v in values)

    lines = [
        "# Muon's whole-parameter step: bytes and time, beside AdamW and DeepSpeed's Muon",
        "",
        f"Command: `{command}`",
        "",
        "Machine: " + "; ".join(machine_lines(packages=("deepspeed",))) + f"; {n} gloo ranks, 1 torch thread each; "
        f"load average {load[0]} before, {load[1]} after.",
        "",
        f"Model: tiertrain GPT, hidden {a.hidden}, {a.layers} layers, {a.heads} heads, vocab {a.vocab} (tied head), "
        f"seq {a.seq}: {params / 1e6:.2f} M parameters, of which {muon_numel / 1e6:.2f} M in the {4 * a.layers} "
        f"block matrices that go to Muon (lr {MUON_LR}), the rest to AdamW (lr {ADAM_LR}); fp32, micro-batch "
        f"{a.micro} per rank, no clipping, one fixed batch per rank. {a.warmup} warm-up rounds, then {steps} "
        "timed rounds; in a round every engine of the stage takes one step, in alternating order.",
        "",
        "## 1. The exchange: tiertrain's all_to_all bytes per optimizer step (engine counter)",
        "",
        f"Summed over the {n} ranks, per step, per Muon element. Theory: 12 B × (n−1)/n = "
        f"{12 * (n - 1) / n:.2f} B with balanced owners; plan: the exact figure of this layout "
        "(8 B × the elements each rank sends to owners + 4 B × those it sends back, from "
        "`engine.update.plan`); owned: Muon elements per rank (rank 0 / rank 1); held: the B per element "
        "if each matrix were owned by the rank whose shards hold most of it, and the owners' loads then; "
        "exchange: the slower rank's median time in the two all_to_alls with their packing "
        "(tiertrain's spans whole_gather + whole_scatter).",
        "",
        "| stage | all_to_all MB/step | B per Muon element | plan | theory | owned (M) | held: B per element, loads (M) "
        "| exchange (ms) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s in a.stages:
        a2a = summed(s, ENGINES[1], "counter", "all_to_all") / steps
        plan = summed(s, ENGINES[1], "plan_bytes")
        owned = " / ".join(f"{r[s][ENGINES[1]]['owned'] / 1e6:.3f}" for r in per_rank)
        mine = per_rank[0][s][ENGINES[1]]
        held = " / ".join(f"{x / 1e6:.3f}" for x in mine["holder_loads"])
        lines.append(f"| {s} | {a2a / 1e6:.2f} | {a2a / muon_numel:.3f} | {plan / muon_numel:.3f} | "
                     f"{12 * (n - 1) / n:.2f} | {owned} | {mine['holder_bytes'] / muon_numel:.3f}, {held} | "
                     f"{_median_max(per_rank, s, ENGINES[1], 'exchange'):.1f} |")
    lines += [
        "",
        "## 2. All collectives per step, summed over ranks",
        "",
        "Engine counter: tiertrain's logical bytes (tiertrain/comm.py: an all-gather counts its output, a "
        "reduce-scatter its input, an all-reduce twice the tensor, an all_to_all what goes to other ranks; per "
        "rank, summed here). Wire: bytes the ranks sent, counted on torch.distributed's collectives "
        "(ring volumes, exact at 2 ranks), the same count for tiertrain and DeepSpeed. Extra = Muon run minus "
        "AdamW run of the same framework, per Muon element.",
        "",
        "| stage | engine | counter MB/step | wire MB/step | wire extra B per Muon element "
        "| wire by collective (MB/step) |",
        "|---|---|---|---|---|---|",
    ]
    for s in a.stages:
        for name in names:
            wire = summed(s, name, "wire") / steps
            base = ENGINES[0] if name.startswith("tiertrain") else ENGINES[2]
            extra = "" if name == base else f"{(wire - summed(s, base, 'wire') / steps) / muon_numel:+.2f}"
            counter = (f"{summed(s, name, 'counter') / steps / 1e6:.2f}" if name.startswith("tiertrain") else "")
            kinds = defaultdict(float)
            for r in per_rank:
                for k, b in r[s][name]["wire"].items():
                    kinds[k] += b / steps
            split = ", ".join(f"{k} {b / 1e6:.2f}" for k, b in sorted(kinds.items()) if b >= 5e3)
            lines.append(f"| {s} | {name} | {counter} | {wire / 1e6:.2f} | {extra} | {split} |")
    lines += [
        "",
        "## 3. Step time",
        "",
        "Median over the timed rounds of the slower rank's time: step = forward + backward + optimizer step; "
        "opt = the optimizer step call alone (engine.step(): tiertrain's exchange and Newton-Schulz run there, "
        "and DeepSpeed's at stage 3; DeepSpeed's stages 1-2 orthogonalise at the end of backward, in the "
        "gradient reduction's epilogue, so only the step column sees it). Losses: the first and last timed "
        "step's, rank 0 (one fixed batch, so they fall when the step learns). Ratios to the AdamW run of the "
        "same framework: of the medians, and paired (median over rounds of the ratio of the two steps of a "
        "round, which shared the machine's load of that moment).",
        "",
        "| stage | engine | step (ms) | opt (ms) | step / AdamW | paired | loss first → last |",
        "|---|---|---|---|---|---|---|",
    ]
    for s in a.stages:
        for name in names:
            step, opt = _median_max(per_rank, s, name, "step"), _median_max(per_rank, s, name, "opt")
            base = ENGINES[0] if name.startswith("tiertrain") else ENGINES[2]
            ratio = "" if name == base else f"**{step / _median_max(per_rank, s, base, 'step'):.3f}**"
            paired = "" if name == base else f"{_paired(per_rank, s, name, base):.3f}"
            losses = per_rank[0][s][name]["loss"]
            lines.append(f"| {s} | {name} | {step:.0f} | {opt:.0f} | {ratio} | {paired} | "
                         f"{losses[0]:.3f} → {losses[-1]:.3f} |")
    if ENGINES[3] in names:
        lines += ["", "| stage | DeepSpeed Muon / tiertrain Muon+AdamW: step | paired | opt |", "|---|---|---|---|"]
        for s in a.stages:
            ds, tt = ENGINES[3], ENGINES[1]
            lines.append(f"| {s} | {_median_max(per_rank, s, ds, 'step') / _median_max(per_rank, s, tt, 'step'):.3f} | "
                         f"{_paired(per_rank, s, ds, tt):.3f} | "
                         f"{_median_max(per_rank, s, ds, 'opt') / _median_max(per_rank, s, tt, 'opt'):.3f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--micro", type=int, default=4, help="micro-batch per rank")
    ap.add_argument("--stages", type=int, nargs="+", default=[1, 2, 3])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--deepspeed", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--timeout", type=float, default=900, help="seconds before the ranks are killed")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    model = _model(a)
    params = sum(p.numel() for p in model.parameters())
    muon_numel = sum(p.numel() for n, p in model.named_parameters() if _hidden(n, p))
    load_before = loadavg(1)
    per_rank = run_distributed(_rank, 2, a, timeout=a.timeout)
    text = _report(per_rank, a, muon_numel, params, "python " + " ".join(sys.argv), (load_before, loadavg(1)))
    print(text)
    if a.out:
        with open(a.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
