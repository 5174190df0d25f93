"""CPU optimizer step throughput: torch AdamW (single-tensor, foreach, fused) against
DeepSpeedCPUAdam and against the memory-bandwidth floor measured in the same run.

tiertrain's offloaded optimizer is torch's fused AdamW on the CPU tier (engine
optimizer.impl=auto); this benchmark is the measurement behind that choice (issue 4 (a)).

Floor: an Adam step reads param, grad, exp_avg, exp_avg_sq and writes param, exp_avg,
exp_avg_sq: 7 × 4 = 28 bytes per fp32 parameter. floor = 28·N / bandwidth, with bandwidth
the best of STREAM copy and triad timed here on tensors of the same size and threads.

    python bench/cpu_adam.py --params 100e6 --threads 2 --out bench/results/cpu_adam.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

from _common import machine_lines


def _time(fn, warmup: int, steps: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def memory_bandwidth(numel: int, warmup: int, steps: int) -> float:
    """Best bytes per second of two STREAM kernels: copy (c = a: 8 B/elem moved) and triad
    (c = a + s·b: 12 B/elem); Adam's seven streams behave more like triad than copy."""
    a, b, c = torch.randn(numel), torch.randn(numel), torch.empty(numel)
    copy = 8 * numel / _time(lambda: c.copy_(a), warmup, steps)
    triad = 12 * numel / _time(lambda: torch.add(a, b, alpha=0.5, out=c), warmup, steps)
    return max(copy, triad)


def torch_adamw(numel: int, impl: str):
    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    flags = {"fused": {"fused": True}, "foreach": {"foreach": True}, "single": {"foreach": False}}[impl]
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.1, **flags)
    return opt.step


def deepspeed_cpu_adam(numel: int):
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    p = torch.nn.Parameter(torch.randn(numel))
    p.grad = torch.randn(numel)
    opt = DeepSpeedCPUAdam([p], lr=1e-3, weight_decay=0.1, adamw_mode=True)
    return opt.step


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=100e6, help="fp32 parameters updated per step")
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--skip-deepspeed", action="store_true")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    numel = int(args.params)
    load_before = os.getloadavg()
    bandwidth = memory_bandwidth(numel, args.warmup, args.steps)
    floor = 28 * numel / bandwidth
    rows = [("memory-bandwidth floor (28 B/param)", floor)]
    for impl in ("fused", "foreach", "single"):
        rows.append((f"torch AdamW {impl}", _time(torch_adamw(numel, impl), args.warmup, args.steps)))
    if not args.skip_deepspeed:
        try:
            rows.append(("DeepSpeedCPUAdam", _time(deepspeed_cpu_adam(numel), args.warmup, args.steps)))
        except Exception as e:  # benchmark-only dependency
            rows.append((f"DeepSpeedCPUAdam unavailable: {type(e).__name__}: {str(e)[:80]}", float("nan")))
    load_after = os.getloadavg()

    per100m = 100e6 / numel
    lines = [
        "# CPU AdamW step throughput",
        "",
        f"Command: `python {' '.join(sys.argv)}`",
        "",
        f"Machine: {'; '.join(machine_lines())}; "
        f"{args.threads} threads; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}.",
        f"Memory bandwidth (best of STREAM copy/triad): {bandwidth / 1e9:.2f} GB/s. {numel / 1e6:.0f}M fp32 parameters, "
        f"median of {args.steps} steps after {args.warmup} warm-up.",
        "",
        "| method | step (ms) | ms per 100M params | effective GB/s (28 B/param) | × floor | × torch fused |",
        "|---|---|---|---|---|---|",
    ]
    fused = dict(rows)["torch AdamW fused"]
    for name, t in rows:
        lines.append(f"| {name} | {t * 1e3:.1f} | {t * 1e3 * per100m:.1f} | {28 * numel / t / 1e9:.1f} | "
                     f"{t / floor:.2f} | {t / fused:.2f} |")
    fastest = min(t for name, t in rows[1:] if t == t)
    if fastest < floor:
        lines += ["", f"Note: the fastest optimizer ({28 * numel / fastest / 1e9:.1f} GB/s effective) beats the "
                  f"STREAM-proxy floor, so torch's copy/add kernels do not reach this machine's bandwidth and the "
                  f"floor row is not a valid lower bound here; compare the optimizers with each other."]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
