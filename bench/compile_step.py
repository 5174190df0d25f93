"""Compiled against eager training steps (issue 37, item 3), on tiertrain's GPT, one process.

For each ZeRO stage given, the same model trains with its blocks eager and with each block's
forward compiled (``block.forward = torch.compile(block.forward)``, docs/compile.md; inductor,
the default backend) and reports the median step time after the warm-up steps (which include
the compilation, timed separately) and the ratio compiled / eager, measured in the same run.

    python bench/compile_step.py --out bench/results/compile.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tiertrain
from _common import machine_lines, print_and_write
from tiertrain.config import from_dict
from tiertrain.models.gpt import GPT, GPTConfig


def run(stage: int, compiled: bool, args) -> dict:
    torch.manual_seed(0)
    torch.compiler.reset()
    model = GPT(GPTConfig(vocab_size=8192, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                          n_heads=args.heads))
    if compiled:
        for block in model.blocks:
            block.forward = torch.compile(block.forward)
    cfg = from_dict(tiertrain.Config, {"zero": {"stage": stage}, "batch": {"micro_batch_size": args.batch},
                                       "optimizer": {"lr": 1e-4}, "schedule": {"warmup_steps": 0}}).validate()
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    ids = torch.randint(0, 8192, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        engine.train_batch(iter([{"input_ids": ids, "labels": ids}]))
        times.append(time.perf_counter() - start)
    engine.close()
    return {"step": statistics.median(times[args.warmup:]), "warmup": sum(times[:args.warmup])}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--stages", default="0,3")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=3, help="steps before timing (stage 3 compiles in its second)")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    load_before = os.getloadavg()
    rows = []
    for stage in (int(s) for s in args.stages.split(",")):
        eager, compiled = run(stage, False, args), run(stage, True, args)
        rows.append(f"| {stage} | {eager['step'] * 1e3:.0f} | {compiled['step'] * 1e3:.0f} | "
                    f"**{compiled['step'] / eager['step']:.2f}** | {compiled['warmup']:.1f} | {eager['warmup']:.1f} |")
    lines = ["# Compiled blocks against eager, one process", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             f"Machine: {'; '.join(machine_lines())}; torch at {torch.get_num_threads()} threads; load average "
             f"before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}.",
             f"Model: tiertrain GPT, {args.layers} blocks × hidden {args.hidden}, {args.heads} heads, sequence "
             f"{args.seq}, micro-batch {args.batch}, fp32, AdamW; each block's forward compiled with inductor; "
             f"median of {args.steps} steps after {args.warmup}.", "",
             "| ZeRO stage | eager step (ms) | compiled step (ms) | compiled / eager | compiled warm-up (s) "
             "| eager warm-up (s) |", "|---|---|---|---|---|---|", *rows]
    print_and_write("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
