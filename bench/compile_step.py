"""Compiled against eager training steps (issue 37, item 3), on tiertrain's GPT, one process.

For each ZeRO stage given, the same model trains eagerly, with each block's forward compiled
(``tiertrain.compile_blocks``) and compiled whole (``torch.compile(model)``; docs/compile.md;
inductor, the default backend), and reports the median step time after the warm-up steps
(which include the compilation, timed separately) and its ratio to eager, measured in the
same run.

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


FORMS = ("eager", "compile_blocks", "torch.compile(model)")


def run(stage: int, form: str, args) -> dict:
    torch.manual_seed(0)
    torch.compiler.reset()
    model = GPT(GPTConfig(vocab_size=8192, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                          n_heads=args.heads))
    if form == "compile_blocks":
        tiertrain.compile_blocks(model)
    elif form == "torch.compile(model)":
        model = torch.compile(model)
    cfg = from_dict(tiertrain.Config, {"zero": {"stage": stage}, "batch": {"micro_batch_size": args.batch},
                                       "optimizer": {"lr": 1e-4}, "schedule": {"warmup_steps": 0}}).validate()
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    ids = torch.randint(0, 8192, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    times = []
    for _ in range(args.warmup + args.steps):
        start = time.perf_counter()
        engine.train_batch(iter([{"input_ids": ids, "labels": ids.roll(-1, 1)}]))  # (next-token labels)
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
        results = {form: run(stage, form, args) for form in FORMS}
        eager = results["eager"]
        for form, r in results.items():
            rows.append(f"| {stage} | {form} | {r['step'] * 1e3:.0f} | **{r['step'] / eager['step']:.2f}** | "
                        f"{r['warmup']:.1f} |")
    lines = ["# Compiled blocks against eager, one process", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             f"Machine: {'; '.join(machine_lines())}; torch at {torch.get_num_threads()} threads; load average "
             f"before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}.",
             f"Model: tiertrain GPT, {args.layers} blocks × hidden {args.hidden}, {args.heads} heads, sequence "
             f"{args.seq}, micro-batch {args.batch}, fp32, AdamW; inductor; "
             f"median of {args.steps} steps after {args.warmup}.", "",
             "| ZeRO stage | form | step (ms) | / eager | warm-up (s) |", "|---|---|---|---|---|", *rows]
    print_and_write("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
