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
    python bench/plan_to_train.py --small --no-md       # 4 × 1024 at a stated 1000 MB: the NVMe path in ~1 min

The measured peak is compared like with like: ``tiertrain train`` reports each rank's whole
peak RSS (ru_maxrss: interpreter, torch, the process group and the data included), while
the plan predicts the increase from the model build on (tensors + framework overhead +
allocator retention, as tiertrain.estimate.measure defines it). So the rank's RSS just
before its model is built (its *baseline*) is measured the same way tiertrain.estimate.
measure measures it — ranks started by tiertrain.launch, torch and the gloo group up, a
1 × 32 model — and subtracted from the reported peak.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results", "plan_to_train.md")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from _common import GiB, machine_lines, meminfo  # noqa: E402


def run(cmd: list[str], log: list[str]) -> subprocess.CompletedProcess:
    log.append(" ".join(shlex.quote(c) for c in cmd))
    print("$ " + log[-1], flush=True)
    env = dict(os.environ, PYTHONPATH=ROOT + (os.pathsep + os.environ["PYTHONPATH"]
                                              if os.environ.get("PYTHONPATH") else ""))
    return subprocess.run(cmd, cwd=ROOT, env=env, text=True, capture_output=True)


def rank_baseline() -> int:
    """RSS of a training rank just before its model is built (the larger of 2 ranks): what the
    plan's prediction does not include (see the module docstring)."""
    from tiertrain.estimate.measure import RunSpec, measure

    spec = RunSpec(model=dict(n_layers=1, hidden=32, n_heads=2, seq_len=32), micro_batch=1,
                   overrides=["--zero.stage=0"], steps=1)
    return max(r["baseline"] for r in measure(spec))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--swap-dir", default="/tmp/tiertrain-p2t")
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--small", action="store_true",
                    help="4 × 1024 (50 M parameters) at a stated RAM of 1000 MB (unless --ram): the planner must "
                         "choose an NVMe tier, the same path as the full run in ~1 min")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--ram", help="host RAM the job may use (default: MemAvailable now)")
    ap.add_argument("--timeout", type=int, default=3600)
    ap.add_argument("--no-md", action="store_true", help="print only; do not write the results file")
    ap.add_argument("--keep", action="store_true", help="keep the swap directory afterwards")
    ap.add_argument("--out", default=RESULTS, help="where to write the report (default %(default)s)")
    args = ap.parse_args(argv)
    argv = sys.argv[1:] if argv is None else argv
    if args.small:
        # a smaller model never goes to NVMe: its staging buffers (~100 MiB per rank) exceed its states
        args.layers, args.hidden = 4, 1024
        args.ram = args.ram or "1000M"
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
        # the same plan as a person sees it (the table `tiertrain plan` prints)
        shown = run([c if c != plan_yaml else plan_yaml + ".shown" for c in plan_cmd if c != "--json"], [])
        table = shown.stdout.rstrip()
        if args.small and "nvme" not in (plan["plan"]["optimizer_tier"], plan["plan"]["param_tier"]):
            print(f"--small: the plan at --ram {ram} uses no NVMe tier ({plan['plan']}); state a lower --ram")
            return 2
        if plan["rung"] == "nothing fits":
            print(f"the planner found nothing that fits: {plan['plan']}")
            return 2
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
        baseline = rank_baseline()
    finally:
        if not args.keep:
            shutil.rmtree(args.swap_dir, ignore_errors=True)

    # ---- 3. report
    from tiertrain.cli import parse_bytes

    pl = plan["plan"]
    pred = plan["memory_per_rank"]["ram"]
    build = plan["build_peak_per_rank"]["ram"]
    states = sum(l["bytes"] for l in plan["lines"][:4] if l["tier"] != "nvme")
    measured = max(r["peak_rss_bytes_per_rank"] for r in records)
    predicted = max(pred, build)
    increase = measured - baseline
    prev, rows, times = 0.0, [], []
    for r in records:
        times.append(r["elapsed_s"] - prev)
        rows.append(f"| {r['step']} | {r['loss']:.4f} | {r['elapsed_s'] - prev:.1f} | "
                    f"{r['peak_rss_bytes_per_rank'] / GiB:.2f} | {r['mem_bytes_per_rank'] / GiB:.2f} |")
        prev = r["elapsed_s"]
    losses = [r["loss"] for r in records]
    lines = [
        "# plan → train: a model larger than RAM, placed by `tiertrain plan`", "",
        f"Command: `python bench/plan_to_train.py{(' ' + shlex.join(argv)) if argv else ''}` — "
        f"{datetime.datetime.now():%Y-%m-%d %H:%M}, training {wall:.0f} s.", "",
        "## Machine",
        *[f"- {line}" for line in machine_lines()],
        f"- planned with host RAM {parse_bytes(ram) / GiB:.2f} GiB ({'stated: --ram ' + ram if args.ram else 'MemAvailable before the run'}) and the free space of "
        f"`{args.swap_dir}` as the NVMe tier", "",
        "## Commands", "", "```", *commands, "```", "",
        "## The plan",
        f"- {plan['parameters']:,} parameters; model states (bf16 params, fp32 grads, fp32 master + Adam) "
        f"{plan['parameters'] * 18 / GiB:.1f} GiB = {plan['parameters'] * 18 / meminfo('MemTotal'):.2f} × RAM",
        "- as `tiertrain plan` prints it (the same command without `--json`):", "", "```", table, "```", "",
        f"- rung: {plan['rung']}; zero.stage {pl['stage']}, optimizer → {pl['optimizer_tier']}, parameters → "
        f"{pl['param_tier']}, checkpoint_every {pl['checkpoint_every']} ({pl['checkpoint_tier']}), tile "
        f"{pl['tile_factor']}; built {'partitioned' if plan['build']['partitioned'] else 'whole (fp32)'}",
        f"- predicted per rank: training peak {pred / GiB:.2f} GiB of RAM, build peak {build / GiB:.2f} GiB, "
        f"budget {plan['budget_per_rank']['ram'] / GiB:.2f} GiB; model-state bytes in RAM {states / GiB:.2f} GiB, "
        f"on NVMe {plan['memory_per_rank']['nvme'] / GiB:.2f} GiB", "",
        f"## Steps (2 ranks, micro-batch 1 × {args.seq} tokens, the same sequences every step, AdamW lr {args.lr}, "
        "no warm-up)", "",
        "| step | loss | step time (s) | peak RSS per rank so far (GiB, max of ranks) | model states per rank, "
        "all tiers (memory_report, GiB) |",
        "|---|---|---|---|---|", *rows, "",
        f"Loss {losses[0]:.4f} → {losses[-1]:.4f} ({'falls' if losses[-1] < losses[0] else 'DOES NOT FALL'}); "
        f"mean step time after the first {sum(times[1:]) / max(1, len(times) - 1):.1f} s (first {times[0]:.1f} s).", "",
        "## Predicted vs measured peak per rank", "",
        "| | GiB per rank |", "|---|---|",
        f"| measured peak RSS (ru_maxrss of the rank, max of 2 ranks: the whole process, build included) | "
        f"{measured / GiB:.2f} |",
        f"| − baseline: RSS of a rank just before its model is built (tiertrain.estimate.measure, same launch) | "
        f"{baseline / GiB:.2f} |",
        f"| = **measured increase** (what the plan predicts) | **{increase / GiB:.2f}** |",
        f"| predicted: max(training peak {pred / GiB:.2f}, build peak {build / GiB:.2f}) | **{predicted / GiB:.2f}** |",
        f"| error of the prediction | {(predicted - increase) / increase:+.1%} |",
        f"| budget per rank (the plan's) | {plan['budget_per_rank']['ram'] / GiB:.2f} |", ""]
    out = "\n".join(lines)
    print(out)
    if not args.no_md:
        with open(args.out, "w") as f:
            f.write(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
