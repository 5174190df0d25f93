"""The CPU pass called a chunk at a time, as on an accelerator host (tiertrain/zero/upload.py),
against one call over the whole tensor: what sets upload.CHUNK.

Each variant is timed right after a bare fused AdamW step over the same 100 M fp32 elements,
its ratio taken to that step (bench/adamw_pass.py says why): one call writing the bf16 copy
into one buffer; calls of 8, 16 and 32 Mi elements writing it into a ring of upload.SLOTS
buffers; calls of 8 Mi writing it into the one large buffer (so the ring and the calls can be
told apart).

    python bench/adamw_chunks.py --rounds 30 --threads 1 2 --out bench/results/adamw_chunks.md
"""
from __future__ import annotations

import argparse
import functools
import shlex
import statistics
import sys
import time

import torch
from torch.optim.adamw import adamw

from _common import machine_lines, print_and_write
from adamw_pass import BETA1, BETA2, CLIP, DECAY, EPS, LR, STEP
from tiertrain.update import native_adamw
from tiertrain.update.host_adamw import hyperparameters
from tiertrain.zero.upload import CHUNK, SLOTS


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def run(n: int, rounds: int) -> dict[str, float]:
    """Median ratio to the bare step just before, per variant."""
    param, grad = torch.randn(n), torch.randn(n) * 1e-3
    exp_avg, exp_avg_sq = torch.randn(n) * 1e-3, torch.rand(n) * 1e-6
    out, step = torch.empty(n, dtype=torch.bfloat16), torch.tensor(float(STEP))
    hyper = hyperparameters(LR, BETA1, BETA2, EPS, DECAY, STEP, CLIP)
    kernel = native_adamw.Kernel(native_adamw.build(), torch.bfloat16, into=False)
    tensors = (param, grad, exp_avg, exp_avg_sq)
    bare = functools.partial(adamw, [param], [grad], [exp_avg], [exp_avg_sq], [], [step], amsgrad=False,
                             beta1=BETA1, beta2=BETA2, lr=LR, weight_decay=DECAY, eps=EPS, maximize=False, fused=True)

    def chunked(chunk: int, buffers: list[torch.Tensor] | None):
        def call():
            for k, start in enumerate(range(0, n, chunk)):
                end = min(n, start + chunk)
                copy = out[start:end] if buffers is None else buffers[k % len(buffers)][:end - start]
                kernel(*(t[start:end] for t in tensors), copy, hyper)
        return call
    variants = {"one call": functools.partial(kernel, *tensors, out, hyper)}
    for mi in (8, 16, 32):
        ring = [torch.empty(mi << 20, dtype=torch.bfloat16) for _ in range(SLOTS)]
        variants[f"chunks of {mi} Mi, ring of {SLOTS}"] = chunked(mi << 20, ring)
    variants["chunks of 8 Mi, one large buffer"] = chunked(8 << 20, None)
    ratios = {name: [] for name in variants}
    bare()
    for fn in variants.values():
        fn()
    for _ in range(rounds):
        for name, fn in variants.items():
            before = _timed(bare)
            ratios[name].append(_timed(fn) / before)
    return {name: statistics.median(r) for name, r in ratios.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--elements", type=float, default=100e6)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--threads", type=int, nargs="+", default=[torch.get_num_threads()])
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    results = {}
    for threads in args.threads:
        torch.set_num_threads(threads)
        results[threads] = run(int(args.elements), args.rounds)
    names = list(next(iter(results.values())))
    lines = ["# The CPU pass called a chunk at a time, against one call", "",
             f"Command: `python {shlex.join(sys.argv)}`", "",
             f"Machine: {'; '.join(machine_lines())}.",
             f"{args.elements / 1e6:.0f} M fp32 elements; {args.rounds} rounds, each variant right after a bare fused "
             f"AdamW step; median of its time over that step's. upload.CHUNK is {CHUNK >> 20} Mi elements.", "",
             "| variant | " + " | ".join(f"× bare fused, {t} thread{'s' if t > 1 else ''}" for t in results) + " |",
             "|---|" + "---|" * len(results)]
    for name in names:
        lines.append(f"| {name} | " + " | ".join(f"{results[t][name]:.3f}" for t in results) + " |")
    print_and_write("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
