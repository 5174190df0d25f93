#!/usr/bin/env python
"""Tensor-parallel MLP throughput at tp=2 on gloo CPU: tiertrain vs Megatron-Core (issue 6).

The block is a transformer MLP, ``column (h→4h) → GELU → row (4h→h)``, timed as one
forward + backward step (input gradient included, as inside a transformer; no optimizer)
in fp32 on 2 local gloo processes, one compute thread each:

* ``torch-tp1``: plain ``nn.Linear`` MLP, tp=1, 1 thread. Both processes run their own copy
  at the same time, so each has one core, like every tp=2 rank (the reference line).
* ``torch-tp1-2thr``: the same MLP on rank 0 with 2 intra-op threads while rank 1 waits
  (what tensor parallelism has to beat on this 2-core machine).
* ``tiertrain-tp2`` / ``tiertrain-tp2-sp``: :class:`tiertrain.parallel.tensor.ColumnParallelLinear`
  + :class:`~tiertrain.parallel.tensor.RowParallelLinear`, without / with sequence
  parallelism (``seq_dim=0``, Megatron's ``[s, b, h]`` layout).
* ``megatron-tp2`` / ``megatron-tp2-sp``: ``megatron.core.tensor_parallel.ColumnParallelLinear``
  + ``RowParallelLinear`` (``ModelParallelConfig(use_cpu_initialization=True)``), after
  ``parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)``.

All variants start from the same full weights (one seeded ``nn.Linear`` pair, sliced into
each tp=2 layer) and the same input; at startup every config is checked numerically: the
full output, input gradient and parameter gradients of every tp=2 variant are gathered and
compared with each other and with the tp=1 reference (max abs differences are printed and
written to the report).

Timing: the variants run round-robin within each config (order reversed on odd rounds), so
the shared machine's background load hits all of them alike; each measurement is
``--steps`` steps (auto: enough for ``--min-time`` s) between barriers, taken on the slowest
rank; the report gives the median over ``--rounds`` rounds after ``--warmup``.

Megatron-Core is a benchmark-only dependency (``bash bench/setup_env.sh``); without it the
Megatron rows are skipped. On CPU its sequence-parallel path calls
``torch.cuda.current_device()`` (global all-gather buffer, backward reduce-scatter output);
the script replaces that function by ``lambda: "cpu"`` only while a Megatron sequence-parallel
step runs (see ``_megatron_cpu_device``). Nothing else is patched.

Usage:
    python bench/tp_megatron.py                                    # h 1024 2048 × tokens 512 2048
    python bench/tp_megatron.py --hidden 1024 2048 --tokens 512 2048 --rounds 5 \\
        --out bench/results/tp_megatron.md
"""
from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import math
import os
import shlex
import statistics
import sys
import threading
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if ROOT not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, ROOT)

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from _common import machine_lines  # noqa: E402
from tiertrain import Topology  # noqa: E402
from tiertrain.config import ParallelConfig  # noqa: E402
from tiertrain.parallel.tensor import ColumnParallelLinear, RowParallelLinear, gather_tensor  # noqa: E402
from tiertrain.testing import run_distributed  # noqa: E402



def _have_megatron() -> bool:
    try:
        return importlib.util.find_spec("megatron.core") is not None
    except (ImportError, ValueError):  # no `megatron` package at all
        return False


HAVE_MEGATRON = _have_megatron()
ALL_VARIANTS = ["torch-tp1", "torch-tp1-2thr", "tiertrain-tp2", "megatron-tp2", "tiertrain-tp2-sp", "megatron-tp2-sp"]
TP = 2


# --------------------------------------------------------------------------- Megatron on CPU


@contextlib.contextmanager
def _megatron_cpu_device():
    """Megatron-Core's sequence-parallel linear allocates its all-gather buffer
    (``GlobalMemoryBuffer.get_tensor``) and its backward reduce-scatter output with
    ``device=torch.cuda.current_device()``, which raises "Torch not compiled with CUDA
    enabled" on a CPU build. While a Megatron step runs, make it answer "cpu"; restored after.
    The only monkeypatch in this benchmark; a no-op where CUDA is available."""
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def _megatron_setup():
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed" × 4
        warnings.simplefilter("ignore")
        import megatron.core.tensor_parallel  # noqa: F401
        from megatron.core import parallel_state
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=TP)
    return parallel_state


def _megatron_mlp(fc1: nn.Linear, fc2: nn.Linear, sp: bool, rank: int):
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel import ColumnParallelLinear as MColumn
    from megatron.core.tensor_parallel import RowParallelLinear as MRow

    cfg = ModelParallelConfig(tensor_model_parallel_size=TP, sequence_parallel=sp, use_cpu_initialization=True,
                              perform_initialization=False, params_dtype=torch.float32)
    h, f = fc1.in_features, fc1.out_features

    def noop(weight):  # no initialisation: the weights are copied in below
        return None

    col = MColumn(h, f, config=cfg, init_method=noop, bias=True, gather_output=False)
    row = MRow(f, h, config=cfg, init_method=noop, bias=True, input_is_parallel=True, skip_bias_add=False)
    fp = f // TP
    with torch.no_grad():
        col.weight.copy_(fc1.weight[rank * fp:(rank + 1) * fp])
        col.bias.copy_(fc1.bias[rank * fp:(rank + 1) * fp])
        row.weight.copy_(fc2.weight[:, rank * fp:(rank + 1) * fp])
        row.bias.copy_(fc2.bias)
    guard = _megatron_cpu_device if sp else contextlib.nullcontext

    def forward(x):
        y, _ = row(F.gelu(col(x)[0]))
        return y
    return (col, row), forward, guard


# --------------------------------------------------------------------------- variants


class Variant:
    """One implementation of the MLP on this rank: its layers, a forward, this rank's input
    and output gradient, and whether this rank takes part (torch-tp1-2thr: rank 0 only)."""

    def __init__(self, name, layers, forward, x, gy, active=True, threads=1, guard=contextlib.nullcontext):
        self.name, self.layers, self.forward = name, layers, forward
        self.x, self.gy, self.active, self.threads, self.guard = x, gy, active, threads, guard
        self.params = [p for m in layers for p in m.parameters()]

    def step(self) -> torch.Tensor:
        for p in self.params:
            p.grad = None
        self.x.grad = None
        with self.guard():
            y = self.forward(self.x)
            y.backward(self.gy)
        return y


def _build(name, fc1, fc2, x_full, gy_full, group, rank):
    sp = name.endswith("-sp")
    chunk = x_full.shape[0] // TP
    if sp:  # this rank's sequence chunk ([s, b, h], sequence first)
        x = x_full[rank * chunk:(rank + 1) * chunk].clone().requires_grad_(True)
        gy = gy_full[rank * chunk:(rank + 1) * chunk].clone()
    else:
        x, gy = x_full.clone().requires_grad_(True), gy_full.clone()
    if name.startswith("torch-tp1"):
        a, b = _clone_linear(fc1), _clone_linear(fc2)
        two = name.endswith("2thr")
        return Variant(name, (a, b), lambda t: b(F.gelu(a(t))), x, gy, active=(rank == 0 or not two),
                       threads=2 if two else 1)
    if name.startswith("tiertrain"):
        col = ColumnParallelLinear.from_linear(fc1, group, sequence_parallel=sp, seq_dim=0)
        row = RowParallelLinear.from_linear(fc2, group, input_is_parallel=True, sequence_parallel=sp, seq_dim=0)
        return Variant(name, (col, row), lambda t: row(F.gelu(col(t))), x, gy)
    if name.startswith("megatron"):
        layers, forward, guard = _megatron_mlp(fc1, fc2, sp, rank)
        return Variant(name, layers, forward, x, gy, guard=guard)
    raise ValueError(name)


def _clone_linear(lin: nn.Linear) -> nn.Linear:
    out = nn.Linear(lin.in_features, lin.out_features)
    with torch.no_grad():
        out.weight.copy_(lin.weight)
        out.bias.copy_(lin.bias)
    return out


# --------------------------------------------------------------------------- numerical check


def _full_results(v: Variant, y: torch.Tensor, group) -> dict:
    """Full (tp=1-shaped) output, input gradient and parameter gradients of a variant."""
    sp = v.name.endswith("-sp")

    def g(t, d):
        return gather_tensor(t, d, group)

    col, row = v.layers
    if v.name.startswith("torch"):
        return {"y": y.detach(), "dx": v.x.grad, "fc1.weight": col.weight.grad, "fc1.bias": col.bias.grad,
                "fc2.weight": row.weight.grad, "fc2.bias": row.bias.grad}
    row_bias = row.bias.grad.clone()
    if sp:  # each rank saw half the sequence: its row-bias gradient is a partial sum
        dist.all_reduce(row_bias, group=group)
    return {"y": g(y.detach(), 0) if sp else y.detach(), "dx": g(v.x.grad, 0) if sp else v.x.grad,
            "fc1.weight": g(col.weight.grad, 0), "fc1.bias": g(col.bias.grad, 0),
            "fc2.weight": g(row.weight.grad, 1), "fc2.bias": row_bias}


def _max_diff(a: dict, b: dict) -> tuple[float, float, str]:
    """(max |Δy|, the largest relative gradient difference max|Δ| / max|b| over dx and the
    four parameter gradients, the name of that gradient)."""
    dy = (a["y"] - b["y"]).abs().max().item()
    rel = {k: (a[k] - b[k]).abs().max().item() / max(b[k].abs().max().item(), 1e-30) for k in a if k != "y"}
    worst = max(rel, key=rel.get)
    return dy, rel[worst], worst


# --------------------------------------------------------------------------- worker


def _runqueue_s() -> float:
    """Seconds this thread has waited runnable for a CPU (2nd field of schedstat; 0 if absent):
    the time other processes on this shared machine took from it."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def _time(v: Variant, steps: int) -> tuple[float, float, float]:
    """Per step: (wall s on the slowest rank, max over ranks of wall − the main thread's
    run-queue wait, max over ranks of that run-queue wait). Inactive ranks wait at the barrier."""
    dist.barrier()
    dt = rq = 0.0
    if v.active:
        torch.set_num_threads(v.threads)
        q0, t0 = _runqueue_s(), time.perf_counter()
        for _ in range(steps):
            v.step()
        dt, rq = time.perf_counter() - t0, _runqueue_s() - q0
        torch.set_num_threads(1)
    t = torch.tensor([dt, dt - rq, rq], dtype=torch.float64) / steps
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return tuple(t.tolist())


def _worker(rank, world, configs, variants, rounds, warmup, steps, min_time, seed):
    assert world == TP, f"this benchmark runs on exactly {TP} processes"
    # Megatron calls the deprecated all_gather_into_tensor / reduce_scatter_tensor and asks
    # for CUDA_DEVICE_MAX_CONNECTIONS=1 (a CUDA stream setting): noise on CPU.
    warnings.filterwarnings("ignore", message=".*is deprecated. Please use `torch.distributed.*")
    warnings.filterwarnings("ignore", message=".*CUDA_DEVICE_MAX_CONNECTIONS.*")
    topo = Topology.build(ParallelConfig(tp=TP))
    group = topo.group("tp")
    mg_version = None
    if any(v.startswith("megatron") for v in variants):
        _megatron_setup()
        import megatron.core
        mg_version = megatron.core.__version__
    out = {"configs": [], "megatron_version": mg_version}
    for hidden, tokens, batch in configs:
        seq = tokens // batch
        torch.manual_seed(seed)
        fc1, fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)
        g = torch.Generator().manual_seed(seed + 1)
        x_full = torch.randn(seq, batch, hidden, generator=g)
        gy_full = torch.randn(seq, batch, hidden, generator=g)
        built = {name: _build(name, fc1, fc2, x_full, gy_full, group, rank) for name in variants}

        # numerical check: every variant once, gathered to full tensors
        full = {}
        for name, v in built.items():
            if name == "torch-tp1-2thr":
                continue
            y = v.step()
            full[name] = _full_results(v, y, group)
        ref = full.get("torch-tp1")
        check = []
        for name in full:
            if name == "torch-tp1":
                continue
            row = {"variant": name}
            if ref is not None:
                row["vs_tp1"] = _max_diff(full[name], ref)
            other = ("megatron" + name[len("tiertrain"):]) if name.startswith("tiertrain") else None
            if other in full:
                row["vs_megatron"] = _max_diff(full[name], full[other])
            check.append(row)
        ref_scale = max(ref["y"].abs().max().item(), 1e-30) if ref is not None else None
        del full

        # timing: warm-up rounds (also size the step count), then interleaved rounds
        per_step = {}
        for _ in range(max(1, warmup)):
            for name, v in built.items():
                per_step[name] = _time(v, 1)[0]
        n = steps or max(1, math.ceil(min_time / max(min(per_step.values()), 1e-6)))
        times = {name: [] for name in built}   # wall s/step, slowest rank
        adj = {name: [] for name in built}     # wall − run-queue wait
        runq = {name: [] for name in built}    # run-queue wait
        order = list(built)
        for r in range(rounds):
            for name in (order if r % 2 == 0 else order[::-1]):
                w, a, q = _time(built[name], n)
                times[name].append(w)
                adj[name].append(a)
                runq[name].append(q)
        if rank == 0:
            print(f"h={hidden} tokens={tokens} (s={seq}, b={batch}) steps/measurement={n}: " +
                  ", ".join(f"{k} {statistics.median(t) * 1e3:.0f} ms" for k, t in times.items()), flush=True)
        out["configs"].append(dict(hidden=hidden, tokens=tokens, seq=seq, batch=batch, steps=n, times=times, adj=adj, runq=runq,
                                   check=check, ref_scale=ref_scale))
        del built
    return out


# --------------------------------------------------------------------------- report


def _flops(hidden: int, tokens: int) -> float:
    """fwd+bwd multiply-adds ×2 of h→4h→h with input gradient: 3 × 2 GEMMs × 2·T·h·4h."""
    return 3 * 2 * 2 * tokens * hidden * 4 * hidden


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048])
    ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048], help="tokens per micro-batch (s × b)")
    ap.add_argument("--batch", type=int, default=1, help="micro-batch b; the sequence is tokens / b")
    ap.add_argument("--variants", nargs="+", default=ALL_VARIANTS, choices=ALL_VARIANTS)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=0, help="steps per measurement (0: enough for --min-time)")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds per measurement of the fastest variant")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tol", type=float, default=1e-4,
                    help="fail (exit 1) when an output or relative gradient difference in the check exceeds this")
    ap.add_argument("--timeout", type=float, default=900, help="kill the ranks after this many seconds")
    ap.add_argument("--out", default=None, help="write a markdown report here")
    args = ap.parse_args(argv)

    variants = list(args.variants)
    skipped = []
    if not HAVE_MEGATRON:
        skipped = [v for v in variants if v.startswith("megatron")]
        variants = [v for v in variants if v not in skipped]
        if skipped:
            print("megatron-core is not installed (bash bench/setup_env.sh): skipping " + ", ".join(skipped))
    for t in args.tokens:
        if t % args.batch or (t // args.batch) % TP:
            ap.error(f"--tokens {t}: needs to be a multiple of --batch {args.batch} with the sequence divisible by {TP}")
    configs = [(h, t, args.batch) for h in args.hidden for t in args.tokens]
    load_before = os.getloadavg()
    t0 = time.perf_counter()
    res = run_distributed(_worker, TP, configs, variants, args.rounds, args.warmup, args.steps, args.min_time,
                          args.seed, timeout=args.timeout)[0]
    wall = time.perf_counter() - t0
    load_after = os.getloadavg()
    bad = []
    for c in res["configs"]:
        for row in c["check"]:
            diffs = {k: v for k, v in row.items() if k != "variant"}
            print(f"check h={c['hidden']} tokens={c['tokens']} {row['variant']}: " + "; ".join(
                f"{k} max|Δy| {v[0]:.2e} max rel. Δgrad {v[1]:.2e} ({v[2]})" for k, v in diffs.items()))
            bad += [f"h={c['hidden']} T={c['tokens']} {row['variant']} {k}" for k, v in diffs.items()
                    if not (v[0] <= args.tol and v[1] <= args.tol)]
    print(f"total {wall:.0f} s")
    if args.out:
        write_report(args, res, variants, skipped, load_before, load_after, wall)
    if bad:
        print(f"NUMERICAL CHECK FAILED (tolerance {args.tol:g}): " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


PAIRS = [("tiertrain-tp2", "megatron-tp2", "tiertrain / Megatron, tp=2"),
         ("tiertrain-tp2-sp", "megatron-tp2-sp", "tiertrain / Megatron, tp=2 + SP"),
         ("tiertrain-tp2-sp", "tiertrain-tp2", "tiertrain SP / no SP"),
         ("megatron-tp2-sp", "megatron-tp2", "Megatron SP / no SP"),
         ("tiertrain-tp2", "torch-tp1", "tiertrain tp=2 / torch tp=1 (1 thread)"),
         ("megatron-tp2", "torch-tp1", "Megatron tp=2 / torch tp=1 (1 thread)"),
         ("tiertrain-tp2", "torch-tp1-2thr", "tiertrain tp=2 / torch tp=1 (2 threads)"),
         ("megatron-tp2", "torch-tp1-2thr", "Megatron tp=2 / torch tp=1 (2 threads)")]


def ratio(c: dict, a: str, b: str, key: str = "times") -> dict | None:
    """Step-time ratio a / b from one config's rounds: the median of the per-round ratios
    (a and b ran next to each other in every round), their min..max, and the ratio of the
    two variants' fastest rounds."""
    if a not in c[key] or b not in c[key]:
        return None
    per_round = [x / y for x, y in zip(c[key][a], c[key][b])]
    return dict(median=statistics.median(per_round), lo=min(per_round), hi=max(per_round),
                of_min=min(c[key][a]) / min(c[key][b]))


def reading(res) -> list[str]:
    """Data-derived summary lines plus what differs between the two implementations."""
    def span(a, b):
        rs = [r["median"] for c in res["configs"] if (r := ratio(c, a, b))]
        return f"{min(rs):.2f}–{max(rs):.2f}" if rs else None

    share = [q / w for c in res["configs"] for name in c["times"]
             for w, q in zip(c["times"][name], c["runq"][name]) if w > 0]
    runq_share = statistics.median(share) if share else 0.0
    out = ["", "## Reading", ""]
    vs_mg = [row["vs_megatron"] for c in res["configs"] for row in c["check"] if "vs_megatron" in row]
    if (s := span("tiertrain-tp2", "megatron-tp2")):
        out.append(f"- tiertrain / Megatron step time, tp=2: {s} over the configs; with sequence parallelism: "
                   f"{span('tiertrain-tp2-sp', 'megatron-tp2-sp')}. Both compute the same thing (numerical check "
                   f"below: outputs within {max(d[0] for d in vs_mg):.1e} of each other, gradients within "
                   f"{max(d[1] for d in vs_mg):.1e} relative).")
    if (s := span("tiertrain-tp2", "torch-tp1")):
        out.append(f"- tiertrain tp=2 / tp=1 (1 thread per process): {s} (0.5 = perfect two-way split); "
                   f"tp=2 / tp=1 with 2 intra-op threads: {span('tiertrain-tp2', 'torch-tp1-2thr')}.")
    out.append(f"- Load: the main threads spent a median {100 * runq_share:.0f}% of the measured wall time waiting "
               "in the run queue for a core (other jobs on this shared 2-core machine). "
               + ("At this level a ratio's per-round min..max is wide and differences of ±10–20% between "
                  "implementations are not significant; re-run on an idle machine for finer comparisons."
                  if runq_share > 0.1 else "The machine was quiet enough that the medians are stable."))
    out.append("- What differs (same GEMMs, same collectives per forward): Megatron's backward starts the "
               "input-gradient all-reduce (tp) or reduce-scatter (SP) asynchronously and computes the weight "
               "gradient while it runs; under SP it keeps only the local input chunk and all-gathers it again in "
               "backward (one extra all-gather per column-parallel linear per step, less activation memory), into "
               "a persistent global buffer. tiertrain waits on every collective and keeps the gathered input for "
               "the weight gradient (see the memory note in `tiertrain/parallel/tensor.py`); its f / g operators "
               "also copy the tensor they all-reduce (`clone()`), one T×h copy each.")
    return out


def write_report(args, res, variants, skipped, load_before, load_after, wall) -> None:
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    mg = res["megatron_version"]
    lines = [
        "# Tensor-parallel MLP at tp=2 on gloo CPU: tiertrain vs Megatron-Core",
        "",
        f"- Date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        f"- Machine: {'; '.join(machine_lines())}, megatron-core {mg or 'not installed'}; "
        "backend gloo, 2 processes, 1 compute thread each",
        f"- Load average (1/5/15 min) before: {load_before[0]:.2f} / {load_before[1]:.2f} / {load_before[2]:.2f}; "
        f"after: {load_after[0]:.2f} / {load_after[1]:.2f} / {load_after[2]:.2f} (the machine is shared with "
        f"other jobs); whole run {wall:.0f} s",
        f"- Command: `{cmd}`",
        f"- Block: `column (h→4h) → GELU → row (4h→h)`, both with bias, fp32, activations `[s, b, h]` with "
        f"b = {args.batch}; one step = forward + backward with a fixed output gradient (input gradient "
        "included, no optimizer). FLOP/step = 48·T·h² (6 GEMMs of 2·T·h·4h).",
        f"- Timing: the variants alternate within each config (order reversed every other round); each "
        f"measurement is N steps between barriers, timed on the slowest rank; {args.warmup} warm-up round, then "
        f"{args.rounds} rounds. *wall−runq*: per rank, wall time minus its main thread's run-queue wait "
        "(`/proc/self/task/TID/schedstat`: time it was runnable while other processes had the CPU), max over "
        "ranks; *runq*: that wait (max over ranks), the size of the outside load's bite. Ratios come from the same "
        "run: the median of the per-round ratios (the two variants ran next to each other in each round), "
        "their min..max, and the ratio of the two variants' fastest rounds.",
        "",
        "Variants:",
        "",
        "- `torch-tp1`: plain `nn.Linear` MLP, tp=1, 1 thread; both processes run their own copy at the same "
        "time (each has one core, like each tp=2 rank). The reference line: ideal tp=2 takes half its time.",
        "- `torch-tp1-2thr`: the same on rank 0 with 2 intra-op threads while rank 1 waits at a barrier "
        "(what tp=2 has to beat on this 2-core machine).",
        "- `tiertrain-tp2[-sp]`: `tiertrain.parallel.tensor.ColumnParallelLinear` → GELU → `RowParallelLinear` "
        "(`from_linear`, `seq_dim=0`), without / with sequence parallelism.",
        "- `megatron-tp2[-sp]`: `megatron.core.tensor_parallel.ColumnParallelLinear` → GELU → `RowParallelLinear` "
        "(`ModelParallelConfig(tensor_model_parallel_size=2, sequence_parallel=…, use_cpu_initialization=True)`, "
        "after `parallel_state.initialize_model_parallel(tensor_model_parallel_size=2)`).",
        "- tokens/s = T / median step time for one model replica (T tokens per micro-batch): for `torch-tp1` one "
        "core does it (the machine as a whole does 2× that, with two replicas); for tp=2 both cores do it together.",
    ]
    if skipped:
        lines += ["", f"**Megatron-Core not installed: skipped {', '.join(skipped)}** (`bash bench/setup_env.sh`)."]

    lines += ["", "## Summary: step-time ratios (median of per-round ratios; < 1: the first is faster)", "",
              "| h | T | tiertrain / Megatron tp=2 | tiertrain / Megatron tp=2+SP | tiertrain tp=2 / tp=1 | "
              "Megatron tp=2 / tp=1 | tiertrain tp=2 / tp=1 2 threads |",
              "|---|---|---|---|---|---|---|"]
    for c in res["configs"]:
        def cell(a, b, c=c):
            r = ratio(c, a, b)
            return f"{r['median']:.3f} ({r['lo']:.2f}..{r['hi']:.2f})" if r else "n/a"
        lines.append(f"| {c['hidden']} | {c['tokens']} | {cell('tiertrain-tp2', 'megatron-tp2')} | "
                     f"{cell('tiertrain-tp2-sp', 'megatron-tp2-sp')} | {cell('tiertrain-tp2', 'torch-tp1')} | "
                     f"{cell('megatron-tp2', 'torch-tp1')} | {cell('tiertrain-tp2', 'torch-tp1-2thr')} |")
    lines += ["", "A tp=2 / tp=1 ratio of 0.5 is perfect scaling (each rank does half the GEMM work on its own core).",
              "", "## Step time and throughput", ""]
    for c in res["configs"]:
        T, h = c["tokens"], c["hidden"]
        med = {k: statistics.median(v) for k, v in c["times"].items()}
        lines += [f"### h = {h}, T = {T} tokens (s = {c['seq']}, b = {c['batch']}), {c['steps']} step(s) per "
                  "measurement", "",
                  "| variant | median step ms | min..max ms | wall−runq ms | runq ms | tokens/s | GFLOP/s |",
                  "|---|---|---|---|---|---|---|"]
        for name, t in med.items():
            ts = c["times"][name]
            lines.append(f"| {name} | **{t * 1e3:.0f}** | {min(ts) * 1e3:.0f}..{max(ts) * 1e3:.0f} | "
                         f"{statistics.median(c['adj'][name]) * 1e3:.0f} | "
                         f"{statistics.median(c['runq'][name]) * 1e3:.0f} | {T / t:,.0f} | "
                         f"{_flops(h, T) / t / 1e9:.0f} |")
        lines += ["", "| ratio of step times | median of per-round | per-round min..max | of fastest rounds | "
                  "median of per-round, wall−runq |", "|---|---|---|---|---|"]
        for a, b, label in PAIRS:
            r, q = ratio(c, a, b), ratio(c, a, b, "adj")
            if r:
                lines.append(f"| {label} | **{r['median']:.3f}** | {r['lo']:.3f}..{r['hi']:.3f} | {r['of_min']:.3f} | "
                             f"{q['median']:.3f} |")
        lines.append("")
    lines += ["## Numerical check (same weights, same input; before timing)", "",
              "Δy: max abs difference of the full output (gathered along the sequence under SP); `max|y|` of the "
              "tp=1 output gives its scale. Δgrad: the largest relative difference max|Δ| / max|reference| over the "
              "input gradient and the four parameter gradients (sharded ones gathered; under SP the row bias's "
              "partial gradients all-reduced first), and which gradient it was.", "",
              "| h | T | variant | max\\|y\\| | vs torch-tp1: Δy | Δgrad (rel.) | vs Megatron, same SP setting: Δy | "
              "Δgrad (rel.) |", "|---|---|---|---|---|---|---|---|"]
    for c in res["configs"]:
        for row in c["check"]:
            a, b = row.get("vs_tp1"), row.get("vs_megatron")
            dy = f"{a[0]:.1e}" if a else "—", f"{b[0]:.1e}" if b else "—"
            dg = f"{a[1]:.1e} ({a[2]})" if a else "—", f"{b[1]:.1e} ({b[2]})" if b else "—"
            scale = f"{c['ref_scale']:.2f}" if c["ref_scale"] is not None else "—"
            lines.append(f"| {c['hidden']} | {c['tokens']} | {row['variant']} | {scale} | {dy[0]} | {dg[0]} | "
                         f"{dy[1]} | {dg[1]} |")
    lines += reading(res)
    lines += ["", "## Megatron-Core on CPU", "",
              f"- megatron-core {mg or '(not installed)'}: PyPI's 0.17–0.19 need Python ≥ 3.12, so on Python 3.11 "
              "the newest installable is 0.16.1 (`bench/setup_env.sh`, `--no-deps`; its only runtime deps, numpy and "
              "packaging, are already present; torch pinned by a constraint). It imports without Transformer Engine "
              "or Apex (warnings only, silenced here).",
              "- `initialize_model_parallel(tensor_model_parallel_size=2)` works on a gloo default group unchanged.",
              "- Without sequence parallelism `ColumnParallelLinear` / `RowParallelLinear` run on CPU unpatched "
              "(with `use_cpu_initialization=True`).",
              "- With `sequence_parallel=True` the forward fails with `AssertionError: Torch not compiled with CUDA "
              "enabled` from `torch.cuda.current_device()` in `megatron/core/utils.py` (`GlobalMemoryBuffer.get_tensor`, "
              "the all-gather buffer) and again in the backward (`sub_grad_input = torch.empty(..., "
              "device=torch.cuda.current_device())`). **Monkeypatch:** while a Megatron SP step runs, "
              "`torch.cuda.current_device` is replaced by `lambda: \"cpu\"` (`_megatron_cpu_device` in the script), "
              "restored right after; nothing else is patched and no Megatron code is changed.",
              ""]
    with open(args.out, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
