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
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

import tiertrain
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


def _steps(cfgm: GPTConfig, micro: int, rank: int) -> dict:
    """name → callable running one full training step (forward, backward, optimizer)."""
    batch = _batch(cfgm, micro, rank)
    steps = {}

    ddp = torch.nn.parallel.DistributedDataParallel(_model(cfgm))
    steps["ddp"] = _torch_step(ddp, batch)

    from torch.distributed.fsdp import fully_shard

    fsdp = _model(cfgm)
    for block in fsdp.blocks:
        fully_shard(block)
    fully_shard(fsdp)
    steps["fsdp2"] = _torch_step(fsdp, batch)

    for stage in (0, 1, 2, 3):
        cfg = from_dict(Config, {"zero": {"stage": stage}, "batch": {"micro_batch_size": micro},
                                 "optimizer": {"lr": 3e-4, "weight_decay": 0.0, "grad_clip": 0.0},
                                 "schedule": {"warmup_steps": 0}}).validate()
        engine = tiertrain.wrap(_model(cfgm), cfg, tiertrain.Topology.build(cfg.parallel))

        def engine_step(engine=engine):
            engine.backward(engine(batch))
            engine.step()
        steps[f"tiertrain{stage}"] = engine_step
    return steps


def _rank(rank: int, world: int, preset: str, micro: int, rounds: int, warmup: int) -> dict:
    cfgm = GPTConfig.preset(preset)
    steps = _steps(cfgm, micro, rank)
    times = {name: [] for name in steps}
    for r in range(warmup + rounds):
        order = list(steps) if r % 2 == 0 else list(steps)[::-1]  # no fixed position in a round
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            steps[name]()
            if r >= warmup:
                times[name].append(time.perf_counter() - start)
    return times


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    per_rank = run_distributed(_rank, 2, args.preset, args.micro, args.rounds, args.warmup, timeout=3000)
    load_after = os.getloadavg()
    # A step is as slow as its slowest rank: take the max over ranks per round, then the median.
    medians = {name: statistics.median(max(r[name][i] for r in per_rank) for i in range(args.rounds))
               for name in per_rank[0]}
    params = GPTConfig.preset(args.preset).num_parameters()
    lines = [
        "# Interleaved ZeRO benchmark (tiertrain vs DDP vs FSDP2, same processes, alternating steps)",
        "",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        f"Machine: {os.cpu_count()} cores ({' '.join(os.uname()[2:3])}), torch {torch.__version__}, 2 gloo ranks, "
        f"1 thread each; load average {load_before[0]:.2f} before, {load_after[0]:.2f} after.",
        f"Model: GPT preset `{args.preset}` ({params / 1e6:.1f}M parameters), fp32, micro-batch {args.micro} per rank; "
        f"AdamW fused, no clipping, constant LR; median over {args.rounds} rounds (after {args.warmup} warm-up) of "
        "the slower rank's step time.",
        "",
        "| framework | median step (ms) |",
        "|---|---|",
    ] + [f"| {name} | {t * 1e3:.0f} |" for name, t in medians.items()] + [
        "",
        "| ratio | value | target |",
        "|---|---|---|",
    ]
    targets = [("tiertrain3", "fsdp2", 0.9), ("tiertrain0", "ddp", 1.05), ("tiertrain1", "ddp", 1.05),
               ("tiertrain2", "ddp", 1.05), ("tiertrain3", "ddp", None)]
    for a, b, target in targets:
        ratio = medians[a] / medians[b]
        verdict = "" if target is None else (f"≤ {target}: " + ("PASS" if ratio <= target else "FAIL"))
        lines.append(f"| {a} / {b} | {ratio:.3f} | {verdict} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
