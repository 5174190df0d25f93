"""Interleaved ZeRO benchmark: tiertrain stages 0-3, PyTorch DDP and FSDP2 built side by
side in the same two gloo processes, one step of each in turn, round after round.

Why interleaved: this machine's cores are shared with other tenants, whose load moves the
step time of the same configuration by up to 2× from one minute to the next; running one
framework after another (run_baselines.py) then measures the load as much as the
framework. Alternating single steps exposes every framework to the same load, so the
ratios are stable even when the absolute times are not.

    python bench/zero_interleaved.py --preset bench --rounds 6 --out bench/results/zero_interleaved.md

DeepSpeed cannot share a process with the others (it replaces the process group setup),
so it stays in run_baselines.py.

A/B of stage-3 variants in the same run (``--frameworks fsdp2,tiertrain3,tiertrain3_old``):

    tiertrain3        the library as it is (per-segment agreement + local trace check)
    tiertrain3_every  check="every": an agreement before every stage-3 collective
    tiertrain3_off    check="off": no agreement at all (lower bound)
    tiertrain3_old    check="every" and the 2-rank gloo collectives as before: all-gather
                      through a replicated send buffer (input.repeat), reduce-scatter
                      through a full all_to_all (self chunk included) + sum
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import types

import torch
import torch.distributed as dist

import tiertrain
from _common import machine_lines
from tiertrain.config import Config, from_dict
from tiertrain.models.gpt import GPT, GPTConfig
from tiertrain.testing import run_distributed


def _batch(cfgm: GPTConfig, micro: int, rank: int) -> dict:
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 256, (micro, cfgm.seq_len + 1), generator=g)
    return {"input_ids": x[:, :-1], "labels": x[:, 1:]}


def _model(cfgm: GPTConfig) -> GPT:
    torch.manual_seed(0)
    return GPT(cfgm)


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)


def _torch_step(model: torch.nn.Module, batch: dict):
    """One plain PyTorch training step of a (DDP- or FSDP2-wrapped) model with fused AdamW."""
    opt = _adamw(model.parameters())

    def step():
        model(**batch).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


DEFAULT_FRAMEWORKS = "ddp,fsdp2,tiertrain0,tiertrain1,tiertrain2,tiertrain3"
VARIANTS = {"tiertrain3_every": "every", "tiertrain3_off": "off", "tiertrain3_old": "every"}


def _old_all_gather(self, output, input, async_op=False):
    """Collectives.all_gather on gloo before the 2-rank fast path: replicate the shard."""
    from tiertrain.comm import Work, _nbytes
    self.counter.add("all_gather", _nbytes(output))
    handle = dist.all_to_all_single(output, input.repeat(self.size), group=self.group, async_op=True)
    work = Work(handle, timeout=self.timeout)
    if not async_op:
        work.wait()
    return work


def _old_reduce_scatter(self, output, input, async_op=False):
    """Collectives.reduce_scatter on gloo before the 2-rank fast path: full all_to_all + sum."""
    from tiertrain.comm import Work, _nbytes
    self.counter.add("reduce_scatter", _nbytes(input))
    received = torch.empty_like(input)
    handle = dist.all_to_all_single(received, input, group=self.group, async_op=True)
    work = Work(handle, timeout=self.timeout).then(
        lambda: torch.sum(received.view(self.size, -1), dim=0, out=output))
    if not async_op:
        work.wait()
    return work


def _steps(cfgm: GPTConfig, micro: int, rank: int, frameworks: list[str]) -> dict:
    """name → callable running one full training step (forward, backward, optimizer)."""
    batch = _batch(cfgm, micro, rank)
    steps = {}

    if "ddp" in frameworks:
        ddp = torch.nn.parallel.DistributedDataParallel(_model(cfgm))
        steps["ddp"] = _torch_step(ddp, batch)

    if "fsdp2" in frameworks:
        from torch.distributed.fsdp import fully_shard

        fsdp = _model(cfgm)
        for block in fsdp.blocks:
            fully_shard(block)
        fully_shard(fsdp)
        steps["fsdp2"] = _torch_step(fsdp, batch)

    for name in frameworks:
        if not name.startswith("tiertrain"):
            continue
        stage = int(name[len("tiertrain")])
        cfg = from_dict(Config, {"zero": {"stage": stage}, "batch": {"micro_batch_size": micro},
                                 "optimizer": {"lr": 3e-4, "weight_decay": 0.0, "grad_clip": 0.0},
                                 "schedule": {"warmup_steps": 0}}).validate()
        engine = tiertrain.wrap(_model(cfgm), cfg, tiertrain.Topology.build(cfg.parallel))
        if name in VARIANTS:
            engine.fetcher.check = VARIANTS[name]
        if name == "tiertrain3_old":
            engine.comm.all_gather = types.MethodType(_old_all_gather, engine.comm)
            engine.comm.reduce_scatter = types.MethodType(_old_reduce_scatter, engine.comm)

        def engine_step(engine=engine):
            engine.backward(engine(batch))
            engine.step()
        steps[name] = engine_step
    return steps


def _runqueue_s() -> float:
    """Seconds this thread was runnable but other processes had the CPU (schedstat)."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _rank(rank: int, world: int, preset: str, micro: int, rounds: int, warmup: int,
          frameworks: list[str]) -> dict:
    """name → per-round wall times, and "name:runq" → the main thread's run-queue wait in them."""
    cfgm = GPTConfig.preset(preset)
    steps = _steps(cfgm, micro, rank, frameworks)
    times = {name: [] for name in steps} | {f"{name}:runq": [] for name in steps}
    for r in range(warmup + rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]  # no fixed position in a round
        for name in order:
            dist.barrier()
            start, waited = time.perf_counter(), _runqueue_s()
            steps[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
                times[f"{name}:runq"].append(_runqueue_s() - waited)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="")
    ap.add_argument("--json", default="", help="also write every rank's per-round times (s) here")
    ap.add_argument("--frameworks", default=DEFAULT_FRAMEWORKS,
                    help="comma-separated, in round order: ddp, fsdp2, tiertrain0-3, and the stage-3 A/B variants "
                         + ", ".join(VARIANTS) + f" (default {DEFAULT_FRAMEWORKS})")
    args = ap.parse_args(argv)
    frameworks = args.frameworks.split(",")
    unknown = sorted(set(frameworks) - set(DEFAULT_FRAMEWORKS.split(",")) - set(VARIANTS))
    if unknown:
        ap.error(f"--frameworks: unknown {unknown}")
    load_before = os.getloadavg()
    per_rank = run_distributed(_rank, 2, args.preset, args.micro, args.rounds, args.warmup, frameworks,
                               timeout=3000)
    load_after = os.getloadavg()
    # A step is as slow as its slowest rank: take the max over ranks per round, then the median.
    names = [n for n in per_rank[0] if not n.endswith(":runq")]
    medians = {name: statistics.median(max(r[name][i] for r in per_rank) for i in range(args.rounds))
               for name in names}
    # Load-corrected: each rank's step minus the time other processes held its main thread.
    unloaded = {name: statistics.median(max(r[name][i] - r[f"{name}:runq"][i] for r in per_rank)
                                        for i in range(args.rounds)) for name in names}
    params = GPTConfig.preset(args.preset).num_parameters()
    lines = [
        "# Interleaved ZeRO benchmark (tiertrain vs DDP vs FSDP2, same processes, alternating steps)",
        "",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        f"Machine: {'; '.join(machine_lines())}; 2 gloo ranks, "
        f"1 thread each; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after.",
        f"Model: GPT preset `{args.preset}` ({params / 1e6:.1f}M parameters), fp32, micro-batch {args.micro} per rank; "
        f"AdamW fused, no clipping, constant LR; median over {args.rounds} rounds (after {args.warmup} warm-up) of "
        "the slower rank's step time.",
        "",
        "| framework | median step (ms) | median wall-runq (ms) |",
        "|---|---|---|",
    ] + [f"| {name} | {t * 1e3:.0f} | {unloaded[name] * 1e3:.0f} |" for name, t in medians.items()] + [
        "",
        "Ratio: of the medians (the target applies to it); paired: median over rounds of the ratio of the "
        "two steps of that round (both exposed to the same load); wall-runq: ratio of the medians of the step "
        "time minus the main thread's run-queue wait (the time other processes held its CPU).",
        "",
        "| ratio | value | paired | wall-runq | target |",
        "|---|---|---|---|---|",
    ]
    targets = [("tiertrain3", "fsdp2", 0.9), ("tiertrain0", "ddp", 1.05), ("tiertrain1", "ddp", 1.05),
               ("tiertrain2", "ddp", 1.05), ("tiertrain3", "ddp", None)]
    targets += [(v, "fsdp2", None) for v in VARIANTS] + [("tiertrain3", v, None) for v in VARIANTS]
    for a, b, target in targets:
        if a not in medians or b not in medians:
            continue
        ratio = medians[a] / medians[b]
        paired = statistics.median(max(r[a][i] for r in per_rank) / max(r[b][i] for r in per_rank)
                                   for i in range(args.rounds))
        verdict = "" if target is None else (f"≤ {target}: " + ("PASS" if ratio <= target else "FAIL"))
        lines.append(f"| {a} / {b} | {ratio:.3f} | {paired:.3f} | {unloaded[a] / unloaded[b]:.3f} | {verdict} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"command": sys.argv, "per_rank": per_rank}, f)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
