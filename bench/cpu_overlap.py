"""A CPU proxy of ZeRO-Offload's overlap (issue 36, item 5): the model's compute on one core,
the CPU-tier optimizer step on the other.

On a GPU host the forward and backward run on the accelerator while the host's cores are free
for the optimizer; here one thread computes the model (torch at one intra-op thread) and the
update, when it runs on a thread of its own, has the other core. Reported per configuration:
the median wall time of a whole step (forward, backward, step), its forward + backward, the
optimizer update's own time, and **step / max(forward + backward, update)**: 1.0 is perfect
overlap, (f + b + u) / max(f + b, u) is none at all. The configurations: stage 2 with the
optimizer on the CPU, synchronous (no overlap, the baseline) and with ZeRO-Offload's delayed
update (the update of step t during step t+1's forward and backward).

    python bench/cpu_overlap.py --out bench/results/cpu_overlap.md
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
from cpu_step import Linears
from tiertrain.config import from_dict

MODES = {"synchronous": ({}, "fused"), "delayed update": ({"delayed_update": True, "delayed_update_warmup": 1}, "fused"),
         "synchronous, compiled pass": ({}, "compiled"),
         "overlapped with backward (compiled pass)": ({"overlap_cpu_step": True}, "compiled")}
"""mode → (zero section, optimizer.impl): the overlapped step needs the compiled pass, against
which its synchronous form is timed too."""


def build(mode: str, args):
    zero, impl = MODES[mode]
    cfg = from_dict(tiertrain.Config, {
        "zero": {"stage": 2, "offload_optimizer": "cpu", **zero}, "precision": {"dtype": "bf16"},
        "batch": {"micro_batch_size": args.batch}, "optimizer": {"lr": 1e-4, "grad_clip": 1.0, "impl": impl},
        "schedule": {"warmup_steps": 0}}).validate()
    torch.manual_seed(0)
    engine = tiertrain.wrap(Linears(args.d, args.layers), cfg, tiertrain.Topology.build(cfg.parallel))
    update_times = []

    def timing(owner, name: str) -> None:
        fn = getattr(owner, name)

        def timed(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            update_times.append(time.perf_counter() - start)  # (from the worker thread too)
            return out
        setattr(owner, name, timed)
    passes = getattr(engine.update, "host_pass", None)
    if passes is None:  # torch's kernel
        timing(engine.update.optimizer, "step")
    else:  # the compiled pass: synchronous, the pieces step() is left with, the worker's pieces
        for name in ("step", "step_pieces", "update_into"):
            timing(passes, name)
    return engine, update_times


def run(mode: str, args) -> dict:
    engine, update_times = build(mode, args)
    x = torch.randn(args.batch, args.d)
    walls, compute, updates = [], [], []
    for i in range(args.warmup + args.steps):
        calls = len(update_times)
        start = time.perf_counter()
        engine.backward(engine(x))
        fb = time.perf_counter() - start
        engine.step()
        if i >= args.warmup:
            walls.append(time.perf_counter() - start)
            compute.append(fb)
        updates.append(sum(update_times[calls:]))  # (the overlapped step: one call per unit)
    engine.update.flush()
    if mode == "delayed update":  # (step t's update runs during step t+1: counted where it ran)
        updates = update_times
    update = statistics.median(updates[args.warmup:])
    wall, fb = statistics.median(walls), statistics.median(compute)
    speculation = getattr(engine.update, "speculation", None)
    return {"wall": wall, "fb": fb, "update": update, "ratio": wall / max(fb, update),
            "none": (fb + update) / max(fb, update), "norm": engine.last_grad_norm,
            "committed": "" if speculation is None else
            f"{speculation['committed']} of {args.warmup + args.steps} steps"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--d", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batch", type=int, default=96, help="rows per micro-batch (sets forward + backward time)")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(1)
    load_before = os.getloadavg()
    results = {mode: run(mode, args) for mode in MODES}
    lines = ["# CPU proxy of the offload overlap: compute on one core, the optimizer on the other", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             f"Machine: {'; '.join(machine_lines())}; torch at 1 intra-op thread per Python thread; "
             f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}.",
             f"Model: {args.layers} × Linear({args.d}, {args.d}) ({args.layers * args.d ** 2 / 1e6:.0f} M parameters), "
             f"micro-batch {args.batch} rows, bf16 compute, one process, stage 2, optimizer on the CPU tier, "
             f"clip 1.0; median of {args.steps} steps after {args.warmup}. The update column is the optimizer "
             f"kernels' own time per step, summed over the calls of that step (the overlapped step's worker makes "
             f"one per piece, beside backward).", "",
             "| mode | step (ms) | forward + backward (ms) | update (ms) | step / max(f+b, update) | no overlap would be "
             "| speculation committed | last gradient norm |",
             "|---|---|---|---|---|---|---|---|"]
    for mode, r in results.items():
        lines.append(f"| {mode} | {r['wall'] * 1e3:.0f} | {r['fb'] * 1e3:.0f} | {r['update'] * 1e3:.0f} | "
                     f"**{r['ratio']:.2f}** | {r['none']:.2f} | {r['committed']} | {r['norm']:.3g} |")
    print_and_write("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
