"""Peak memory per rank against sequence length under context parallelism (issue 38): measured
engine runs against the estimator's prediction of the same runs.

Each row: 4 gloo ranks (as `tiertrain train` starts them) train a 2-block GPT whose activations
dominate its memory (hidden 64, vocabulary 256) at ZeRO stage 3 for 3 steps, one sequence per
micro-batch, with `parallel.cp` = 1, 2 or 4 (ring attention), in a fresh process
(tiertrain.estimate.measure), with glibc returning freed blocks at once (MALLOC_MMAP_THRESHOLD_
=131072, zero.retain_host_memory=false) so that resident memory follows the live tensors. The
prediction is tiertrain.estimate.estimate (engine accounting) of the same run: tensor bytes at
the simulated peak plus the per-process framework constant, no allocator retention.

Columns: the measured peak (VmHWM during training less VmRSS before the model is built, the
largest rank), the prediction, and the same two less the model states (engine.memory_report()
against the estimate's lines): what grows with the sequence.

    python bench/cp_memory.py --out bench/results/cp_memory.md
"""
from __future__ import annotations

import argparse
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _common import machine_lines  # noqa: E402
from tiertrain.estimate.measure import RunSpec, measure, predict  # noqa: E402
from tiertrain.estimate.overhead import DEFAULT_OVERHEAD_BYTES, HostOverhead  # noqa: E402

MODEL = dict(n_layers=2, hidden=64, n_heads=4, vocab_size=256, bias=False)
FIXED = {"MALLOC_MMAP_THRESHOLD_": "131072"}


def spec(seq: int, cp: int) -> RunSpec:
    return RunSpec({**MODEL, "seq_len": seq}, ["--zero.stage=3", f"--parallel.cp={cp}", "--zero.retain_host_memory=false"],
                   micro_batch=1, steps=3, ranks=4, env=FIXED, partitioned=True)


def row(seq: int, cp: int) -> dict:
    s = spec(seq, cp)
    ranks = measure(s)
    est = predict(s, HostOverhead(DEFAULT_OVERHEAD_BYTES, 0.0, "framework constant only (fixed mmap threshold)"))
    lines = {l.name: l.bytes for l in est.lines}
    states_pred = sum(lines[k] for k in ("parameters", "gradients", "master weights", "optimizer states"))
    worst = max(ranks, key=lambda r: r["peak"])
    return {"seq": seq, "cp": cp, "measured": worst["peak"], "predicted": est.total(),
            "measured_less_states": worst["peak"] - worst["report"]["total"],
            "predicted_less_states": est.total() - states_pred, "peak_at": est.peak_at}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", default="1024,2048,4096")
    ap.add_argument("--cps", default="1,2,4")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    rows = []
    for seq in map(int, a.seqs.split(",")):
        for cp in map(int, a.cps.split(",")):
            t0 = time.time()
            r = row(seq, cp)
            rows.append(r)
            print(f"seq {seq:6d} cp {cp}: measured {r['measured'] / 2**20:7.1f} MiB, predicted "
                  f"{r['predicted'] / 2**20:7.1f} MiB ({r['predicted'] / r['measured'] - 1:+.1%}); less states: "
                  f"{r['measured_less_states'] / 2**20:7.1f} vs {r['predicted_less_states'] / 2**20:7.1f} MiB "
                  f"({r['predicted_less_states'] / r['measured_less_states'] - 1:+.1%}) [{time.time() - t0:.0f} s]",
                  flush=True)
    if a.out:
        L = ["# Peak memory per rank against sequence length, by context-parallel size\n",
             f"Machine: {'; '.join(machine_lines())}.\n",
             f"Command: `python bench/cp_memory.py --seqs {a.seqs} --cps {a.cps} --out {a.out}` "
             f"({time.strftime('%Y-%m-%d')}).\n",
             "4 gloo ranks, GPT 2 × 64 (4 heads, vocabulary 256), ZeRO stage 3 built partitioned, one sequence "
             "per micro-batch, ring attention, 3 steps; glibc's mmap threshold fixed at 128 KiB. Measured: the "
             "largest rank's VmHWM during training less its VmRSS before the model is built. Predicted: "
             "`tiertrain.estimate.estimate` of the same run (tensors at the simulated peak + the framework "
             "constant).\n",
             "| seq | cp | measured peak (MiB) | predicted (MiB) | error | measured less model states | predicted less model states | error |",
             "|---|---|---|---|---|---|---|---|"]
        for r in rows:
            L.append(f"| {r['seq']} | {r['cp']} | {r['measured'] / 2**20:.1f} | {r['predicted'] / 2**20:.1f} | "
                     f"{r['predicted'] / r['measured'] - 1:+.1%} | {r['measured_less_states'] / 2**20:.1f} | "
                     f"{r['predicted_less_states'] / 2**20:.1f} | "
                     f"{r['predicted_less_states'] / r['measured_less_states'] - 1:+.1%} |")
        with open(a.out, "w") as f:
            f.write("\n".join(L) + "\n")


if __name__ == "__main__":
    main()
