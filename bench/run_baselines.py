#!/usr/bin/env python
"""Side-by-side timings: tiertrain ZeRO 0-3 vs DDP vs FSDP2 vs DeepSpeed ZeRO-1/2/3 on CPU/gloo.

Each framework runs in its own fresh set of ``--world`` processes (so peak RSS
is per framework), on the same model (same seed), same per-rank batches and the
same AdamW hyper-parameters (torch AdamW, ``--adam-impl``, weight decay on
>= 2-D parameters only, no clipping, constant LR).  Prints a table, the loss
cross-check against the first framework (DDP), and -- when tiertrain and the
baselines ran together -- the ratios of issue 3's benchmark; writes markdown to
``--out`` plus raw per-rank JSON next to it.

    python bench/run_baselines.py --frameworks all                  # issue 3: tiertrain 0-3 + DDP/FSDP2/DS 1-3 (small GPT)
    python bench/run_baselines.py --frameworks all --preset bench --warmup 2 --steps 4
    python bench/run_baselines.py                                   # baselines only, small GPT, 2 ranks, 5 steps
    python bench/run_baselines.py --preset bench --steps 10 --frameworks ddp fsdp2 ds1 ds2 ds3
    python bench/run_baselines.py --frameworks ds2_offload ds3_offload   # ZeRO-Offload (DeepSpeedCPUAdam)

``--frameworks all`` = ddp fsdp2 ds1 ds2 ds3 ds3_p0 tiertrain0 tiertrain1
tiertrain2 tiertrain3 (``ds3_p0``: ZeRO-3 with
``stage3_param_persistence_threshold=0``).  ``--rounds R`` runs the whole list
R times round-robin (fresh processes each time) and pools the timed steps, so
slow drifts of background load hit every framework alike.

Model: ``tiertrain.models.gpt.GPT(GPTConfig.preset(--preset))`` when importable,
else the test-only fallback in ``bench/_toy_gpt.py`` (reported in the output).
DeepSpeed runs need ``bash bench/setup_env.sh`` first; missing DeepSpeed makes
those rows "skipped" rather than failing the whole run.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for p in (HERE, ROOT):
    if p not in sys.path:
        sys.path.insert(0, p)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from _common import free_port, gather_results, init_gloo, loadavg, machine_lines, spawn_ranks  # noqa: E402

DEFAULT_FRAMEWORKS = ["ddp", "fsdp2", "ds1", "ds2", "ds3"]
ALL_FRAMEWORKS = ["ddp", "fsdp2", "ds1", "ds2", "ds3", "ds3_p0",
                  "tiertrain0", "tiertrain1", "tiertrain2", "tiertrain3"]
# Order in which `all` is *run*: each tiertrain stage next to what it is compared with, so a
# drift in background load hits both sides of a ratio alike (the table keeps ALL_FRAMEWORKS order).
ALL_RUN_ORDER = ["ddp", "tiertrain0", "tiertrain1", "ds1", "tiertrain2", "ds2",
                 "fsdp2", "tiertrain3", "ds3", "ds3_p0"]
# (numerator, denominator, target) of issue 3's benchmark; None = informative only.
RATIOS = [("tiertrain3", "fsdp2", 0.9), ("tiertrain3", "ds3", 0.9), ("tiertrain3", "ds3_p0", None),
          ("tiertrain0", "ddp", 1.05), ("tiertrain1", "ddp", 1.05), ("tiertrain2", "ddp", 1.05),
          ("tiertrain1", "ds1", None), ("tiertrain2", "ds2", None)]


# ----------------------------------------------------------------------------- model + data


class ModelFactory:
    """Picklable model factory: the real tiertrain GPT, or the bench fallback."""

    def __init__(self, preset: str, overrides: dict | None = None, force_toy: bool = False):
        self.preset, self.overrides, self.force_toy = preset, dict(overrides or {}), force_toy

    def source(self) -> str:
        if not self.force_toy:
            try:
                import tiertrain.models.gpt  # noqa: F401
                return "tiertrain.models.gpt.GPT"
            except Exception:  # noqa: BLE001  (library under construction)
                pass
        return "bench/_toy_gpt.ToyGPT (fallback)"

    def config(self):
        if self.source().startswith("tiertrain"):
            from tiertrain.models.gpt import GPTConfig
            return GPTConfig.preset(self.preset, **self.overrides)
        from _toy_gpt import ToyGPTConfig
        sizes = {"tiny": dict(n_layers=4, hidden=128, n_heads=4),
                 "small": dict(n_layers=6, hidden=256, n_heads=8),
                 "bench": dict(n_layers=8, hidden=640, n_heads=10, seq_len=256)}[self.preset]
        return ToyGPTConfig(**{**sizes, **self.overrides})

    def __call__(self):
        cfg = self.config()
        if self.source().startswith("tiertrain"):
            from tiertrain.models.gpt import GPT
            return GPT(cfg)
        from _toy_gpt import ToyGPT
        return ToyGPT(cfg)


class Batches:
    """Deterministic random-token batches, different per rank and per step."""

    def __init__(self, rank: int, batch_size: int, seq_len: int, vocab: int, n: int, seed: int = 1234):
        g = torch.Generator().manual_seed(seed + 7919 * rank)
        self.data = [torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g) for _ in range(n)]

    def __call__(self, step: int):
        x = self.data[step % len(self.data)]
        return x[:, :-1].contiguous(), x[:, 1:].contiguous()


# ----------------------------------------------------------------------------- worker


def worker(rank, world, port, fw, args, result_path):
    init_gloo(rank, world, port, threads=args.threads, timeout_s=args.timeout)
    from baselines import OptimConfig, run_framework

    factory = ModelFactory(args.preset, json.loads(args.model_overrides), args.toy)
    cfg = factory.config()
    seq = args.seq_len or cfg.seq_len
    batches = Batches(rank, args.batch_size, seq, cfg.vocab_size, args.warmup + args.steps)
    optim = OptimConfig(lr=args.lr, betas=(args.beta1, args.beta2), eps=args.eps,
                        weight_decay=args.weight_decay, impl=args.adam_impl, decay=args.decay)
    out = {"rank": rank, "ok": False}
    try:
        extra = {}
        if fw.startswith("ds") and args.ds_zero_overrides != "{}":
            extra["zero_overrides"] = json.loads(args.ds_zero_overrides)
        if fw.startswith("tiertrain") and args.tt_zero_overrides != "{}":
            extra["zero_overrides"] = json.loads(args.tt_zero_overrides)
        res = run_framework(fw, factory, optim, batches, steps=args.steps, warmup=args.warmup,
                            seed=args.seed, barrier=args.barrier, **extra)
        out.update(ok=True, result=res.to_dict(), model=factory.source(), seq_len=seq)
    except Exception as e:  # noqa: BLE001
        out.update(error=f"{type(e).__name__}: {e}", tb=traceback.format_exc())
    gather_results(out, result_path)
    dist.barrier()
    dist.destroy_process_group()


def launch(fw, args) -> list[dict]:
    fd, path = tempfile.mkstemp(prefix=f"baseline_{fw}_", suffix=".json")
    os.close(fd)
    try:
        spawn_ranks(worker, (args.world, free_port(), fw, args, path), args.world, args.run_timeout, fw)
        with open(path) as f:
            return json.load(f)
    except BaseException as e:  # noqa: BLE001
        error = f"{type(e).__name__}: {str(e)[:2000]}"
        # A rank that aborted while its process exited (seen here as "terminate called without
        # an active exception" after destroy_process_group, in DDP and tiertrain runs alike)
        # has already written every rank's complete measurement: keep it, and say so.
        try:
            with open(path) as f:
                ranks = json.load(f)
        except (OSError, ValueError):
            ranks = None
        if isinstance(ranks, list) and len(ranks) == args.world and all(r.get("ok") for r in ranks):
            for r in ranks:
                r["exit_error"] = error
            return ranks
        return [{"rank": -1, "ok": False, "error": error}]
    finally:
        os.unlink(path)


# ----------------------------------------------------------------------------- report


def machine_description() -> str:
    return "\n".join(machine_lines(packages=["deepspeed"], lscpu_head=True)
                     + [f"load average at start: {loadavg(5)}"])


def pool_rounds(rounds: list[list[dict]]) -> list[dict]:
    """Per-rank results of several rounds of one framework as one set of ranks: timed steps
    pooled, peak memory the max, losses/setup from the first round. Rounds that failed are
    left out (and counted in ``rounds_failed``); the framework fails only if every round did."""
    good = [r for r in rounds if all(x.get("ok") for x in r)]
    if not good:
        return rounds[0]
    failed = [next(x.get("error", "?") for x in r if not x.get("ok")) for r in rounds if r not in good]
    rounds = good
    if len(rounds) == 1:
        pooled = json.loads(json.dumps(rounds[0]))
        for x in pooled:
            x["rounds_failed"] = failed
        return pooled
    pooled = json.loads(json.dumps(rounds[0]))
    for rank, x in enumerate(pooled):
        res = x["result"]
        others = [r[rank]["result"] for r in rounds]
        res["step_times_s"] = [t for o in others for t in o["step_times_s"]]
        res["median_step_s"] = statistics.median(res["step_times_s"])
        for k in ("step_cpu_s", "step_runq_s", "step_unqueued_s"):
            res[k] = [t for o in others for t in o.get(k, [])]
        res["median_cpu_s"] = statistics.median(res["step_cpu_s"]) if res["step_cpu_s"] else float("nan")
        res["median_unqueued_s"] = (statistics.median(res["step_unqueued_s"]) if res["step_unqueued_s"]
                                    else float("nan"))
        for k in ("peak_rss_mib", "peak_over_start_mib", "rss_delta_mib"):
            res[k] = max(o[k] for o in others)
        res["round_medians_s"] = [o["median_step_s"] for o in others]
        x["rounds_failed"] = failed
        x["exit_error"] = next((r[rank]["exit_error"] for r in rounds if r[rank].get("exit_error")), None)
    return pooled


def summarize(fw, ranks) -> dict:
    if not all(r.get("ok") for r in ranks):
        errs = [r.get("error", "?") for r in ranks if not r.get("ok")]
        return {"framework": fw, "ok": False, "error": errs[0]}
    res = [r["result"] for r in ranks]
    med = max(r["median_step_s"] for r in res)  # slowest rank
    return {
        "framework": fw, "ok": True, "model": ranks[0]["model"], "n_params": res[0]["n_params"],
        "median_step_ms": med * 1e3,
        "min_step_ms": max(min(r["step_times_s"]) for r in res) * 1e3,
        "median_cpu_ms": max(r.get("median_cpu_s", float("nan")) for r in res) * 1e3,
        "median_unqueued_ms": max(r.get("median_unqueued_s", float("nan")) for r in res) * 1e3,
        "median_runq_ms": max(statistics.median(r["step_runq_s"]) if r.get("step_runq_s") else float("nan")
                              for r in res) * 1e3,
        "timed_steps": len(res[0]["step_times_s"]),
        "setup_s": max(r["setup_s"] for r in res),
        "peak_rss_mib": max(r["peak_rss_mib"] for r in res),
        "peak_over_start_mib": max(r["peak_over_start_mib"] for r in res),
        "rss_delta_mib": max(r["rss_delta_mib"] for r in res),
        "loss_first": res[0]["losses"][0], "loss_last": res[0]["losses"][-1],
        "losses_per_rank": [r["losses"] for r in res],
        "optimizer": res[0]["extra"].get("optimizer") or "torch AdamW",
        "memory_report_mib": res[0]["extra"].get("memory_report_mib"),
        "comm_mib_per_step": res[0]["extra"].get("comm_mib_per_step"),
        "rounds_failed": ranks[0].get("rounds_failed", []),
        "exit_error": ranks[0].get("exit_error"),
    }


def check_losses(rows) -> str | None:
    """Max |loss - reference loss| over every rank and step, per row; reference = first ok row."""
    ok = [r for r in rows if r.get("ok")]
    if not ok:
        return None
    ref = ok[0]
    for r in ok:
        diffs = [abs(a - b) for la, lb in zip(r["losses_per_rank"], ref["losses_per_rank"])
                 for a, b in zip(la, lb)]
        r["max_abs_loss_diff"] = max(diffs) if diffs else float("nan")
    return ref["framework"]


def ratio_rows(rows) -> list[dict]:
    by = {r["framework"]: r for r in rows if r.get("ok")}
    out = []
    for num, den, target in RATIOS:
        if num in by and den in by:
            t = by[num]["median_step_ms"] / by[den]["median_step_ms"]
            c = by[num]["median_cpu_ms"] / by[den]["median_cpu_ms"]
            mn = by[num]["min_step_ms"] / by[den]["min_step_ms"]
            uq = by[num]["median_unqueued_ms"] / by[den]["median_unqueued_ms"]
            m = by[num]["peak_over_start_mib"] / max(by[den]["peak_over_start_mib"], 1e-9)
            out.append({"ratio": f"{num} / {den}", "time": t, "min": mn, "unqueued": uq, "cpu": c, "mem": m, "target": target,
                        "pass": None if target is None else t <= target})
    return out


def render(rows, args, machine, cmd, load_after="?") -> str:
    model = next((r["model"] for r in rows if r.get("ok")), "?")
    n_params = next((r["n_params"] for r in rows if r.get("ok")), 0)
    ref = check_losses(rows)
    has_tt = any(r["framework"].startswith("tiertrain") for r in rows)
    title = ("# ZeRO benchmark: tiertrain stages 0-3 vs DDP / FSDP2 / DeepSpeed ZeRO on CPU (gloo)" if has_tt
             else "# Baselines: DDP / FSDP2 / DeepSpeed ZeRO on CPU (gloo)")
    lines = [title, "",
             f"Command: `{cmd}`", "", f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}", "",
             "```", machine, f"load average at end: {load_after}", "```", "",
             f"Model: {model}, preset `{args.preset}` ({n_params / 1e6:.2f}M params), fp32; "
             f"world={args.world}, {args.threads} torch thread(s)/rank, micro-batch {args.batch_size} x "
             f"seq {rows[0].get('seq_len', '') or 'preset'} per rank; AdamW lr={args.lr} betas=({args.beta1},{args.beta2}) "
             f"eps={args.eps} wd={args.weight_decay} on {'>= 2-D params only' if args.decay == 'matrices' else 'all params'}, "
             f"torch kernel impl={args.adam_impl} (tiertrain optimizer.impl mapped to the same kernel), no grad clipping, "
             f"constant LR; {args.warmup} warmup + {args.steps} timed steps"
             f"{f' x {args.rounds} rounds (round-robin, odd rounds in reverse order, timed steps pooled)' if args.rounds > 1 else ''}; "
             f"run order: {' '.join(getattr(args, 'run_order', args.frameworks))}; "
             "step = forward+backward+optimizer step (+zero_grad); value = slowest rank's median. "
             "wall-runq = step wall time minus the main thread's run-queue wait (schedstat: runnable "
             "but another process had the CPU), runq = that wait; CPU = process CPU time per step (all threads). "
             "Peak RSS = ru_maxrss (max over ranks, whole process incl. imports); "
             "peak-start = peak minus RSS before model build (the model state + activations the run added); "
             "delta = RSS after last step minus before build. "
             f"Loss check: max |loss - {ref}'s loss| over both ranks and every step (warmup included). "
             "DeepSpeed ZeRO-3 at its defaults keeps params < 1e5 elements unpartitioned; "
             "ds3_p0 sets stage3_param_persistence_threshold=0 (tiertrain's default persistence_threshold is 0)."
             + (f" tiertrain zero overrides: `{args.tt_zero_overrides}`." if args.tt_zero_overrides != "{}" else ""),
             "",
             "| framework | median step (ms) | min step (ms) | median wall-runq (ms) | median runq (ms) | median CPU/step (ms) | setup (s) | peak RSS (MiB) | peak-start (MiB) | RSS delta (MiB) | loss first -> last | max abs loss diff | load1 at start | optimizer |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if not r["ok"]:
            lines.append(f"| {r['framework']} | FAILED: {r['error'][:200]} | | | | | | | | | | | | |")
            continue
        lines.append(f"| {r['framework']} | {r['median_step_ms']:.1f} | {r['min_step_ms']:.1f} | "
                     f"{r['median_unqueued_ms']:.1f} | {r['median_runq_ms']:.1f} | "
                     f"{r['median_cpu_ms']:.1f} | {r['setup_s']:.2f} | "
                     f"{r['peak_rss_mib']:.0f} | {r['peak_over_start_mib']:.0f} | {r['rss_delta_mib']:.0f} | "
                     f"{r['loss_first']:.4f} -> {r['loss_last']:.4f} | {r.get('max_abs_loss_diff', float('nan')):.1e} | "
                     f"{r.get('load_at_start', '?')} | {r['optimizer']} |")
    flaky = [r for r in rows if r.get("ok") and (r.get("rounds_failed") or r.get("exit_error"))]
    if flaky:
        lines += ["", "Runs that did not end cleanly:"]
        for r in flaky:
            if r.get("rounds_failed"):
                lines.append(f"- {r['framework']}: {len(r['rounds_failed'])} round(s) failed and are left out of "
                             f"its pooled steps ({r['rounds_failed'][0][:160]})")
            if r.get("exit_error"):
                lines.append(f"- {r['framework']}: a rank aborted while exiting, after its measurement was "
                             f"complete and saved ({r['exit_error'][:160]})")
    ratios = ratio_rows(rows)
    if ratios:
        lines += ["", "## Ratios (same run)", "",
                  "time = median wall-clock step ratio (the target applies to it); min = ratio of the "
                  "fastest steps (least disturbed by other load); wall-runq = ratio of the median of "
                  "(step wall time minus the main thread's run-queue wait), i.e. with the time other "
                  "processes held this rank's CPU taken out; CPU = ratio of median "
                  "process CPU time per step (all threads; less sensitive to other load, but counts "
                  "busy-polling communication threads as work); memory = peak-start ratio. Lower is better.", "",
                  "| ratio | time | target | | min | wall-runq | CPU | memory (peak-start) |",
                  "|---|---|---|---|---|---|---|---|"]
        for q in ratios:
            verdict = "" if q["pass"] is None else ("PASS" if q["pass"] else "FAIL")
            target = "" if q["target"] is None else f"<= {q['target']}"
            lines.append(f"| {q['ratio']} | {q['time']:.3f} | {target} | {verdict} | {q['min']:.3f} | {q['unqueued']:.3f} | {q['cpu']:.3f} | {q['mem']:.3f} |")
    tt = [r for r in rows if r.get("ok") and r.get("memory_report_mib")]
    if tt:
        lines += ["", "## tiertrain engine accounting (rank 0)", "",
                  "`engine.memory_report()` after the last step (MiB) and the comm counter (logical MiB per step).", "",
                  "| framework | params | gathered | grads | optimizer (master+moments) | comm MiB/step |",
                  "|---|---|---|---|---|---|"]
        for r in tt:
            m = r["memory_report_mib"]
            comm = ", ".join(f"{k} {v:.1f}" for k, v in sorted((r.get("comm_mib_per_step") or {}).items()))
            lines.append(f"| {r['framework']} | {m['params']:.1f} | {m['gathered_params']:.1f} | {m['grads']:.1f} | "
                         f"{m['optimizer']:.1f} | {comm} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--frameworks", nargs="+", default=DEFAULT_FRAMEWORKS,
                   help="all | ddp fsdp2 fsdp2_noreshard ds0 ds1 ds2 ds3 ds3_p0 ds2_offload ds3_offload "
                        "tiertrain0 tiertrain1 tiertrain2 tiertrain3 ('all' = " + " ".join(ALL_FRAMEWORKS) + ")")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the framework list this many times round-robin and pool the timed steps")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--preset", default="small", choices=["tiny", "small", "bench"])
    p.add_argument("--model-overrides", default="{}", help='JSON, e.g. \'{"n_layers": 4}\'')
    p.add_argument("--toy", action="store_true", help="force the bench/_toy_gpt.py fallback model")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=0, help="0 = preset's seq_len")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--barrier", action="store_true", help="dist.barrier() before each timed step")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--beta1", type=float, default=0.9)
    p.add_argument("--beta2", type=float, default=0.95)
    p.add_argument("--eps", type=float, default=1e-8)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--adam-impl", default="fused", choices=["default", "foreach", "fused", "forloop"],
                   help="torch AdamW kernel for every framework (tiertrain's optimizer.impl is mapped to it)")
    p.add_argument("--decay", default="matrices", choices=["matrices", "all"],
                   help="weight decay on >= 2-D params only (tiertrain's rule; default) or on all params")
    p.add_argument("--ds-zero-overrides", default="{}",
                   help='JSON merged into DeepSpeed zero_optimization, e.g. '
                        '\'{"stage3_param_persistence_threshold": 0}\' (default keeps DS defaults: '
                        'params < 1e5 elements stay unpartitioned under ZeRO-3)')
    p.add_argument("--tt-zero-overrides", default="{}",
                   help='JSON merged into tiertrain\'s zero config, e.g. \'{"prefetch_mb": 0}\'')
    p.add_argument("--timeout", type=float, default=300, help="process-group timeout (s)")
    p.add_argument("--run-timeout", type=float, default=900, help="kill one framework's ranks after (s)")
    p.add_argument("--out", default=None,
                   help="markdown output (+ .json next to it); default results/zero.md when tiertrain "
                        "runs, else results/baselines.md")
    args = p.parse_args(argv)
    fws, run_order = [], []
    for fw in args.frameworks:
        for f in (ALL_FRAMEWORKS if fw == "all" else [fw]):
            if f not in fws:
                fws.append(f)
        for f in (ALL_RUN_ORDER if fw == "all" else [fw]):
            if f not in run_order:
                run_order.append(f)
    args.frameworks, args.run_order = fws, run_order
    if args.out is None:
        args.out = os.path.join(HERE, "results", "zero.md" if any(f.startswith("tiertrain") for f in fws)
                                else "baselines.md")
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    machine = machine_description()
    print(machine, flush=True)
    rounds: dict[str, list[list[dict]]] = {fw: [] for fw in args.frameworks}
    load_at: dict[str, list[str]] = {fw: [] for fw in args.frameworks}
    for rnd in range(args.rounds):
        for fw in (run_order if rnd % 2 == 0 else run_order[::-1]):  # odd rounds run backwards
            t0 = time.perf_counter()
            load_at[fw].append(loadavg().split()[0])
            ranks = launch(fw, args)
            rounds[fw].append(ranks)
            row = summarize(fw, ranks)
            tag = f"[round {rnd + 1}/{args.rounds}] " if args.rounds > 1 else ""
            if row["ok"]:
                print(f"{tag}{fw:16s} median {row['median_step_ms']:8.1f} ms  wall-runq {row['median_unqueued_ms']:8.1f} ms  "
                      f"CPU {row['median_cpu_ms']:8.1f} ms  peak RSS {row['peak_rss_mib']:7.0f} MiB  "
                      f"loss {row['loss_first']:.4f} -> {row['loss_last']:.4f}  ({time.perf_counter() - t0:.0f}s wall, "
                      f"load {loadavg()})", flush=True)
            else:
                print(f"{tag}{fw:16s} FAILED: {row['error'][:500]}", flush=True)
                tb = next((r.get("tb") for r in ranks if r.get("tb")), None)
                if tb:
                    print(tb, flush=True)
    rows, raw = [], {}
    for fw in args.frameworks:
        ranks = pool_rounds(rounds[fw])
        raw[fw] = ranks if args.rounds == 1 else {"pooled": ranks, "rounds": rounds[fw]}
        row = summarize(fw, ranks)
        row["load_at_start"] = "/".join(load_at[fw])
        if ranks and ranks[0].get("seq_len"):
            row["seq_len"] = ranks[0]["seq_len"]
        rows.append(row)
    load_after = loadavg(5)
    md = render(rows, args, machine, cmd, load_after)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(md)
    with open(os.path.splitext(args.out)[0] + ".json", "w") as f:
        json.dump({"args": vars(args), "command": cmd, "machine": machine, "load_after": load_after,
                   "rows": rows, "ratios": ratio_rows(rows), "raw": raw}, f, indent=1, default=str)
    print()
    print(md)
    print(f"written to {args.out}")
    return 0 if all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
