"""plan → train for a model larger than RAM (issue 5, third acceptance point).

1. ``tiertrain plan`` for the 2.124 B GPT of bench/larger_than_ram.py (27 × 2560, 20 heads,
   vocabulary 256, sequence 64, no biases, bf16, micro-batch 1, 2 ranks) on this machine:
   host RAM = MemAvailable now (or --ram), NVMe = the free space of --swap-dir; the plan is
   written as a config file;
2. ``tiertrain train --config <plan.yaml>`` for --steps steps on 2 ranks, on a fixed tiny
   corpus (a token file of exactly one sequence per rank, read in order: every step trains on
   the same micro-batches, so the loss shows the optimizer working without data noise), at a
   small constant learning rate without warm-up (2e-6: bench/results/larger_than_ram.md
   explains why this width diverges at 1e-4 even in plain PyTorch);
3. writes bench/results/plan_to_train.md: machine, commands, plan, per-step loss and time,
   and the measured peak RSS per rank against the plan's prediction.

    python bench/plan_to_train.py                       # the 2.124 B run (~10-15 min, ~18 GiB RAM)
    python bench/plan_to_train.py --small --no-md       # 2 × 512: the same path in ~1 min
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "plan_to_train.md")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
GiB = 2**30


def meminfo(key: str) -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(key)


def run(cmd: list[str], log: list[str]) -> subprocess.CompletedProcess:
    log.append(" ".join(shlex.quote(c) for c in cmd))
    print("$ " + log[-1], flush=True)
    env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"]
                                              if os.environ.get("PYTHONPATH") else ""))
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--swap-dir", default="/tmp/tiertrain-p2t")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--small", action="store_true", help="2 × 512 (a 1-minute check of the same path)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--ram", help="host RAM the job may use (default: MemAvailable now)")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--no-md", action="store_true", help="print only; do not write the results file")
    ap.add_argument("--keep", action="store_true", help="keep the swap directory afterwards")
    args = ap.parse_args()
    if args.small:
        args.layers, args.hidden = 2, 512
    heads = max(1, args.hidden // 128)
    os.makedirs(args.swap_dir, exist_ok=True)
    plan_yaml = os.path.join(args.swap_dir, "plan.yaml")
    tokens = os.path.join(args.swap_dir, "tokens.bin")
    metrics = os.path.join(args.swap_dir, "metrics.jsonl")
    ram = args.ram or f"{meminfo('MemAvailable')}"
    commands: list[str] = []
    try:
        # ---- 1. plan
        plan_cmd = [sys.executable, "-m", "tiertrain.cli", "plan", "--layers", str(args.layers), "--hidden",
                    str(args.hidden), "--heads", str(heads), "--vocab", "256", "--seq", str(args.seq), "--no-bias",
                    "--micro-batch", "1", "--precision", "bf16", "--nproc", "2", "--ram", ram,
                    "--swap-dir", args.swap_dir, "--json", "--out", plan_yaml]
        p = run(plan_cmd, commands)
        if p.returncode != 0:
            print(p.stdout[-4000:], p.stderr[-4000:])
            return p.returncode
        plan = json.loads(p.stdout)
        # ---- the data: one sequence per rank, in order, every step
        from tiertrain.data.corpus import load_bundled_corpus

        text = load_bundled_corpus()
        data = text.encode("utf-8") if isinstance(text, str) else bytes(text)
        n = 2 * args.seq + 1
        import numpy as np

        np.frombuffer(data[:n], dtype=np.uint8).astype("<u2").tofile(tokens)
        # ---- 2. train
        train_cmd = [sys.executable, "-m", "tiertrain.cli", "train", "--config", plan_yaml, "--nproc", "2",
                     "--timeout", str(args.timeout), "--steps", str(args.steps), "--optimizer.lr", str(args.lr),
                     "--schedule.warmup_steps", "0", "--schedule.min_lr_ratio", "1.0", "--data.path", tokens,
                     "--data.shuffle", "false", "--logging.metrics_file", metrics, "--logging.log_interval", "1",
                     "--logging.progress", "false"]
        t0 = time.perf_counter()
        t = run(train_cmd, commands)
        wall = time.perf_counter() - t0
        print(t.stdout[-3000:])
        if t.returncode != 0:
            print(t.stderr[-6000:])
            return t.returncode
        records = [json.loads(line) for line in open(metrics)]
    finally:
        if not args.keep:
            shutil.rmtree(args.swap_dir, ignore_errors=True)

    # ---- 3. report
    pl = plan["plan"]
    pred = plan["memory_per_rank"]["ram"]
    build = plan["build_peak_per_rank"]["ram"]
    states = sum(l["bytes"] for l in plan["lines"][:4] if l["tier"] != "nvme")
    measured = max(r["peak_rss_bytes_per_rank"] for r in records)
    prev, rows = 0.0, []
    for r in records:
        rows.append(f"| {r['step']} | {r['loss']:.4f} | {r['elapsed_s'] - prev:.1f} | "
                    f"{r['peak_rss_bytes_per_rank'] / GiB:.2f} | {r['mem_bytes_per_rank'] / GiB:.2f} |")
        prev = r["elapsed_s"]
    losses = [r["loss"] for r in records]
    cpu = subprocess.run("lscpu | grep 'Model name' | sed 's/.*: *//'", shell=True, capture_output=True,
                         text=True).stdout.strip()
    lines = [
        "# plan → train: a model larger than RAM, placed by `tiertrain plan`", "",
        f"Command: `python bench/plan_to_train.py{' --small' if args.small else ''}` — "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, training {wall:.0f} s.", "",
        "## Machine",
        f"- {platform.node()}, {platform.platform()}; {os.cpu_count()} CPUs ({cpu}); MemTotal "
        f"{meminfo('MemTotal') / GiB:.1f} GiB; python {platform.python_version()}",
        f"- planned with host RAM {int(ram) / GiB:.1f} GiB (MemAvailable before the run) and the free space of "
        f"`{args.swap_dir}` as the NVMe tier", "",
        "## Commands", "", "```", *commands, "```", "",
        "## The plan",
        f"- {plan['parameters']:,} parameters; model states (bf16 params, fp32 grads, fp32 master + Adam) "
        f"{plan['parameters'] * 18 / GiB:.1f} GiB = {plan['parameters'] * 18 / meminfo('MemTotal'):.2f} × RAM",
        f"- rung: {plan['rung']}; zero.stage {pl['stage']}, optimizer → {pl['optimizer_tier']}, parameters → "
        f"{pl['param_tier']}, checkpoint_every {pl['checkpoint_every']} ({pl['checkpoint_tier']}), tile "
        f"{pl['tile_factor']}; built {'partitioned' if plan['build']['partitioned'] else 'whole (fp32)'}",
        f"- predicted per rank: training peak {pred / GiB:.2f} GiB of RAM, build peak {build / GiB:.2f} GiB, "
        f"budget {plan['budget_per_rank']['ram'] / GiB:.2f} GiB; model-state bytes in RAM {states / GiB:.2f} GiB, "
        f"on NVMe {plan['memory_per_rank']['nvme'] / GiB:.2f} GiB", "",
        f"## Steps (2 ranks, micro-batch 1 × {args.seq} tokens, the same sequences every step, AdamW lr {args.lr}, "
        "no warm-up)", "",
        "| step | loss | step time (s) | peak RSS per rank so far (GiB, max of ranks) | model states per rank "
        "(memory_report, GiB) |",
        "|---|---|---|---|---|", *rows, "",
        f"Loss {losses[0]:.4f} → {losses[-1]:.4f} ({'falls' if losses[-1] < losses[0] else 'DOES NOT FALL'}). "
        f"Measured peak RSS per rank {measured / GiB:.2f} GiB (ru_maxrss: the whole process, build included) vs "
        f"predicted max(training, build) {max(pred, build) / GiB:.2f} GiB: "
        f"{(max(pred, build) - measured) / measured:+.1%}.", ""]
    out = "\n".join(lines)
    print(out)
    if not args.no_md:
        with open(RESULTS, "w") as f:
            f.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
