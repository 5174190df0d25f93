"""The delayed update's worker (zero.delayed_update, tiertrain/update/delayed.py): how long its
update still runs after ``engine.step()`` returns, with the CPU tier's one-pass AdamW (the clip
factor, the update and the cast into the staging buffers: optimizer.impl auto) against torch's
fused AdamW with its separate clip and cast passes (optimizer.impl fused).

Two engines in one process (stage 2, optimizer on the CPU, bf16 compute, clip 1.0, no warmup:
every update runs in the background), stepped in turn, each step right after a bare fused step
over as many elements; the time is from step()'s return to the worker's end.

    python bench/delayed_worker.py --elements 100e6 --rounds 10 --out bench/results/delayed_worker.md
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import machine_lines, print_and_write
from cpu_step import bare_step, engine_step, shape_for

ZERO = {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True, "delayed_update_warmup": 0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=float, default=100e6)
    ap.add_argument("--rounds", type=int, default=10)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    d, layers = shape_for(args.elements)
    engines = {impl: engine_step(d, layers, ZERO, impl) for impl in ("auto", "fused")}
    bare = bare_step(d * d * layers)
    remaining = {impl: [] for impl in engines}
    for _ in range(args.rounds):
        for impl, (engine, _, step) in engines.items():
            bare()
            step()
            start = time.perf_counter()
            engine.update.wait(agree=False)
            remaining[impl].append(time.perf_counter() - start)
    lines = ["# The delayed update's worker: the one-pass AdamW against torch's fused step", "",
             f"Command: `python {shlex.join(sys.argv)}`", "",
             f"Machine: {'; '.join(machine_lines())}; {torch.get_num_threads()} torch threads.",
             f"{d * d * layers / 1e6:.0f} M elements ({layers} × Linear({d}, {d})), stage 2, optimizer on the CPU, "
             f"bf16 compute, clip 1.0; {args.rounds} rounds, each step right after a bare fused step.", "",
             "| optimizer.impl | compiled pass used | update still running after step() returns, median (ms) |",
             "|---|---|---|"]
    for impl, (engine, _, _) in engines.items():
        lines.append(f"| {impl} | {engine.update.host_pass is not None} | "
                     f"{statistics.median(remaining[impl]) * 1e3:.1f} |")
    print_and_write("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
