"""The CPU tier's compiled AdamW pass (tiertrain/update/host_adamw.py) against torch's bare
fused AdamW, the kernels alone, timed interleaved (issue 36, item 1).

Four kernels step the same fp32 tensors (the pass also writes the bf16 copy):

* torch's fused AdamW, bare (``torch.optim.adamw.adamw(..., fused=True)``);
* the pass as tiertrain compiles it: every scalar factor computed outside the loop
  (``host_adamw.hyperparameters``), one division per element left;
* the same pass with torch's formula written out inside the loop (bias corrections and step
  size as tensors, the square root divided by the bias correction): the form it replaced;
* the pass without the bf16 copy (the kernel a compute copy in fp32 takes): what the copy's
  conversion costs inside the loop. ATen's vectorised fp32 → bf16 conversion, which inductor's
  loop calls, rounds to nearest-even in integer arithmetic (about eight instructions per
  vector), also on a CPU that has a bf16 conversion instruction (AVX512_BF16).

Each repetition runs the four one after another, so that this shared VM's drift reaches all
three alike; the table gives the median and the best.

    python bench/adamw_pass.py --elements 100e6 --reps 15 --out bench/results/adamw_pass.md
"""
from __future__ import annotations

import argparse
import functools
import math
import statistics
import time

import torch
from torch.optim.adamw import adamw

from _common import machine_lines, print_and_write
from tiertrain.update.host_adamw import _adamw, _adamw_cast, hyperparameters

LR, BETA1, BETA2, EPS, DECAY, STEP, CLIP = 1e-4, 0.9, 0.95, 1e-8, 0.1, 10, 0.5


def torch_formula(param, grad, exp_avg, exp_avg_sq, out, hyper):
    """The pass with torch AdamW's formula written out in the loop (the form it replaced)."""
    lr, beta1, beta2, eps, weight_decay, bias_correction1, bias_correction2_sqrt, grad_factor = hyper.unbind()
    g = grad * grad_factor
    param.mul_(1 - lr * weight_decay)
    exp_avg.lerp_(g, 1 - beta1)
    exp_avg_sq.mul_(beta2).add_((1 - beta2) * g * g)
    denom = exp_avg_sq.sqrt() / bias_correction2_sqrt + eps
    param.sub_((lr / bias_correction1) * exp_avg / denom)
    out.copy_(param)


def compiled(fn, hyper, cast: bool = True):
    kernel = torch.compile(fn, dynamic=True, fullgraph=True)
    scratch = [torch.zeros(1 << 20) for _ in range(4)] + [torch.zeros(1 << 20, dtype=torch.bfloat16)] * cast
    kernel(*scratch, hyper)  # (compiled on a large size: inductor keeps the loop it first chose)
    return kernel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=float, default=100e6)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    n = int(args.elements)
    torch.manual_seed(0)
    param, grad = torch.randn(n), torch.randn(n) * 1e-3
    exp_avg, exp_avg_sq = torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    out, step = torch.empty(n, dtype=torch.bfloat16), torch.tensor(float(STEP))
    hoisted = hyperparameters(LR, BETA1, BETA2, EPS, DECAY, STEP, CLIP)
    written_out = torch.tensor([LR, BETA1, BETA2, EPS, DECAY, 1 - BETA1 ** STEP, math.sqrt(1 - BETA2 ** STEP), CLIP])
    kernels = {
        "torch fused AdamW, bare": lambda: adamw([param], [grad], [exp_avg], [exp_avg_sq], [], [step], amsgrad=False,
                                                 beta1=BETA1, beta2=BETA2, lr=LR, weight_decay=DECAY, eps=EPS,
                                                 maximize=False, fused=True),
        "tiertrain's pass (AdamW + clip + bf16 copy), scalars hoisted": functools.partial(
            compiled(_adamw_cast, hoisted), param, grad, exp_avg, exp_avg_sq, out, hoisted),
        "the same pass, torch's formula in the loop": functools.partial(
            compiled(torch_formula, written_out), param, grad, exp_avg, exp_avg_sq, out, written_out),
        "tiertrain's pass without the bf16 copy": functools.partial(
            compiled(_adamw, hoisted, cast=False), param, grad, exp_avg, exp_avg_sq, hoisted),
    }
    load_before = _load()
    times = {name: [] for name in kernels}
    for fn in kernels.values():
        fn()  # (warm)
    for _ in range(args.reps):
        for name, fn in kernels.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    bare = statistics.median(times["torch fused AdamW, bare"])
    lines = ["# The compiled AdamW pass against the bare fused kernel, interleaved", "",
             f"Command: `python bench/adamw_pass.py --elements {args.elements:g} --reps {args.reps}"
             f"{' --out ' + args.out if args.out else ''}`", "",
             f"Machine: {'; '.join(machine_lines())}; {args.threads} torch threads; load average before "
             f"{load_before}, after {_load()}.",
             f"{n / 1e6:.0f} M fp32 elements; each repetition runs the {len(kernels)} kernels in turn; {args.reps} repetitions.",
             "", "| kernel | median (ms) | best (ms) | median × bare fused |", "|---|---|---|---|"]
    for name, ts in times.items():
        lines.append(f"| {name} | {statistics.median(ts) * 1e3:.1f} | {min(ts) * 1e3:.1f} | "
                     f"**{statistics.median(ts) / bare:.2f}** |")
    print_and_write("\n".join(lines) + "\n", args.out)


def _load() -> str:
    with open("/proc/loadavg") as f:
        return f.read().split()[0]


if __name__ == "__main__":
    main()
