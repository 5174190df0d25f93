"""The engine's optimizer step at the CPU tier against torch's bare fused AdamW (issue 36, item 1).

The bare step: ``torch.optim.AdamW(fused=True)`` over one fp32 tensor of N elements whose
gradient is set, nothing else. The engine's step phase: ``engine.step()`` of a model of N
parameters (a stack of bias-free d × d linear layers, bf16 compute, AdamW, clip 1.0) after a
backward, which includes the global norm, the clip, the update, the copy of the new values
into the bf16 compute shards and the rest of the step's bookkeeping. Two placements: stage 2
with the optimizer on the CPU, stage 3 with parameters and optimizer on the CPU. Each is run
with ``optimizer.impl`` compiled (AdamW + clip + cast in one pass: tiertrain/update/host_adamw.py)
and fused (torch's kernel, then a separate cast), so the table shows what the pass changes.
Both placements once more with the step overlapped with backward (zero.overlap_cpu_step,
compiled): when the clip coefficient is 1 the step phase holds only what backward left, the
last units' updates (the profile lines say how many steps committed their speculation).

Same threads; at 100 M elements, in one process, the bare step and each engine alternate in
rounds (load drifts hit all alike); above 300 M only one of them fits in memory at a time, so
each engine runs in a process of its own and the bare step is timed in that same process once
the engine is closed, and each engine's ratio is to its own process's bare step: on a 2-vCPU VM
the same kernel measured 160 ms in some processes and 255 ms in others.
A profile of one engine step names where its time goes.

    python bench/cpu_step.py --elements 100e6 5e8 --out bench/results/cpu_step.md
    python bench/cpu_step.py --trace docs/traces/cpu_tier_step     # the traces of docs/traces/
"""
from __future__ import annotations

import argparse
import gc
import gzip
import multiprocessing
import os
import shlex
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tiertrain
from _common import machine_lines, print_and_write
from tiertrain.config import from_dict

PLACEMENTS = {
    "stage 2, optimizer on CPU": {"stage": 2, "offload_optimizer": "cpu"},
    "stage 3, parameters and optimizer on CPU": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
    "stage 2, optimizer on CPU, overlapped with backward":
        {"stage": 2, "offload_optimizer": "cpu", "overlap_cpu_step": True},
    "stage 3, parameters and optimizer on CPU, overlapped with backward":
        {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu", "overlap_cpu_step": True},
}
"""The engines timed. Those overlapped with backward (zero.overlap_cpu_step) run only with the
compiled pass, which writes their speculative updates beside the state."""


class Linears(torch.nn.Module):
    """layers × (d × d) bias-free linear layers, made in bf16 (the compute dtype: at 1 B elements
    an fp32 model would not fit beside the engine); the loss is the mean square of the output."""

    def __init__(self, d: int, layers: int):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(d, d, bias=False, dtype=torch.bfloat16)
                                          for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.float().pow(2).mean()


def shape_for(elements: float) -> tuple[int, int]:
    d = 2048 if elements <= 5e7 else 4096 if elements <= 4e8 else 8192
    return d, max(1, round(elements / (d * d)))


def bare_step(numel: int):
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=True)
    opt.step()
    return opt.step


def engine_step(d: int, layers: int, zero: dict, impl: str):
    cfg = from_dict(tiertrain.Config, {
        "zero": zero, "precision": {"dtype": "bf16"}, "batch": {"micro_batch_size": 1},
        "optimizer": {"lr": 1e-4, "grad_clip": 1.0, "impl": impl},
        "schedule": {"warmup_steps": 0}}).validate()
    torch.manual_seed(0)
    engine = tiertrain.wrap(Linears(d, layers), cfg, tiertrain.Topology.build(cfg.parallel))
    x = torch.randn(4, d)

    def backward():
        engine.backward(engine(x))

    def step():
        backward()
        start = time.perf_counter()
        engine.step()
        return time.perf_counter() - start
    step()  # (the first step creates the moments)
    return engine, backward, step


def timed(fn, reps: int) -> list[float]:
    out = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        out.append(time.perf_counter() - start)
    return out


def profile_rows(engine, backward, top: int = 6) -> str:
    from torch.profiler import ProfilerActivity, profile

    backward()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        engine.step()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:top]
    return "; ".join(f"{e.key[:40]} {e.self_cpu_time_total / 1e3:.1f} ms ×{e.count}" for e in rows)


def _in_own_process(fn, *fn_args):
    with multiprocessing.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, fn_args)


def engine_times(d, layers, zero, impl, args, bare=None, bare_times=None) -> tuple[list[float], str, list[float]]:
    """The engine's step times (rounds × reps), a profile of one step, and the bare step's times
    in this process: with bare, timed after each round (into bare_times too); without, timed
    once the engine is closed, over as many elements."""
    torch.set_num_threads(args.threads)
    engine, backward, step = engine_step(d, layers, zero, impl)
    times = []
    for _ in range(args.rounds):
        times += [step() for _ in range(args.reps)]
        if bare is not None:
            bare_times += timed(bare, args.reps)
    profile = profile_rows(engine, backward)
    speculation = getattr(engine.update, "speculation", None)
    if speculation is not None:
        profile = (f"speculation committed at {speculation['committed']} of "
                   f"{sum(speculation.values())} steps (gradient norm {engine.last_grad_norm:.3g}); " + profile)
    engine.close()  # (its hooks and registrations go: the next engine gets the memory back)
    del engine, backward, step
    gc.collect()
    if bare is not None:
        return times, profile, bare_times
    return times, profile, timed(bare_step(d * d * layers), args.rounds * args.reps)


def measure(elements: float, args) -> list[str]:
    d, layers = shape_for(elements)
    numel = d * d * layers
    results: dict[str, list[float]] = {}
    profiles: dict[str, str] = {}
    bares: dict[str, list[float]] = {}
    """Per engine, the bare step's times in its process (above 300 M: each engine's own)."""
    fits_together = numel <= 3e8
    bare, all_bare = (bare_step(numel), []) if fits_together else (None, None)
    if fits_together:
        all_bare += timed(bare, args.reps)
    for name, zero in PLACEMENTS.items():
        if args.only and name not in args.only:
            continue
        for impl in [i for i in args.impls if i == "compiled" or not zero.get("overlap_cpu_step")]:
            key = f"{name}, {impl}"
            if fits_together:
                results[key], profiles[key], _ = engine_times(d, layers, zero, impl, args, bare, all_bare)
            else:  # (a process of its own: all of its memory is given back when it ends)
                results[key], profiles[key], bares[key] = _in_own_process(engine_times, d, layers, zero, impl, args)
    if fits_together:
        bares = {key: all_bare for key in results}
    base = statistics.median(all_bare if fits_together else [t for v in bares.values() for t in v])
    lines = [f"### {numel / 1e6:.0f} M elements ({layers} × Linear({d}, {d}))", "",
             "| step | median (ms) | bare fused AdamW, same process (ms) | × bare fused AdamW |", "|---|---|---|---|",
             f"| torch fused AdamW, bare ({'one process' if fits_together else 'median over the processes'}) | "
             f"{base * 1e3:.1f} | | 1.00 |"]
    for key, values in results.items():
        t, own = statistics.median(values), statistics.median(bares[key])
        lines.append(f"| engine.step(): {key} | {t * 1e3:.1f} | {own * 1e3:.1f} | **{t / own:.2f}** |")
    lines += ["", "Where one engine step's time goes (torch profiler, self CPU time):", ""]
    lines += [f"- {key}: {text}" for key, text in profiles.items()]
    return lines + [""]


def write_traces(prefix: str, elements: float, threads: int) -> list[str]:
    """Two steps (forward, backward, step) of the stage-2 CPU-tier engine, synchronous, with the
    delayed update and overlapped with backward, recorded as Chrome traces
    (prefix-sync.json.gz, prefix-delayed.json.gz, prefix-overlapped.json.gz) and drawn beside
    them; returns the files written."""
    from tiertrain.observe.trace import StepTrace, plot_trace

    d, layers = shape_for(elements)
    written = []
    for name, extra in (("sync", {}), ("delayed", {"delayed_update": True, "delayed_update_warmup": 1}),
                        ("overlapped", {"overlap_cpu_step": True})):
        zero = {**PLACEMENTS["stage 2, optimizer on CPU"], **extra}
        engine, _, step = engine_step(d, layers, zero, "fused" if "delayed_update" in extra else "compiled")
        for _ in range(2):
            step()
        trace = StepTrace(f"{prefix}-{name}.json", steps=2, first_step=0)
        for i in range(2):
            trace.before_step(i)
            step()
            trace.after_step(i)
        engine.update.flush()
        written.append(plot_trace(trace.path, f"{prefix}-{name}.png"))
        with open(trace.path, "rb") as raw, gzip.open(trace.path + ".gz", "wb") as packed:
            packed.write(raw.read())  # (Perfetto opens .json.gz; a tenth of the size)
        os.remove(trace.path)
        written.append(trace.path + ".gz")
        engine.close()
        del engine, step
        gc.collect()
    return written


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=float, nargs="+", default=[100e6, 5e8])
    ap.add_argument("--impls", nargs="+", default=["compiled", "fused"], choices=["compiled", "fused"])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", nargs="+", default=[], choices=list(PLACEMENTS), metavar="PLACEMENT",
                    help="time only these placements (at 1 B elements one synchronous engine is what fits in "
                         f"this VM's memory): {'; '.join(PLACEMENTS)}")
    ap.add_argument("--out", default="")
    ap.add_argument("--trace", default="", metavar="PREFIX",
                    help="write two-step traces of the stage-2 CPU-tier engine (synchronous, delayed update, "
                         "overlapped with backward) as PREFIX-{sync,delayed,overlapped}.json.gz with their plots, "
                         "and stop")
    ap.add_argument("--trace-elements", type=float, default=25e6)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.trace:
        for path in write_traces(args.trace, args.trace_elements, args.threads):
            print(path)
        return
    load_before = os.getloadavg()
    body = []
    for elements in args.elements:
        body += measure(elements, args)
        print("\n".join(body[-12:]), flush=True)
    lines = ["# The CPU-tier optimizer step against the bare fused AdamW", "",
             f"Command: `python {shlex.join(sys.argv)}`", "",
             f"Machine: {'; '.join(machine_lines())}; {args.threads} torch threads; "
             f"load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}.",
             "One process; bf16 compute, AdamW (lr 1e-4, weight decay 0.1), clip 1.0; engine step timed from "
             "after backward to the return of engine.step().", ""] + body
    print_and_write("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
