#!/usr/bin/env python
"""Micro-benchmark of gloo collectives on CPU (2 processes by default).

Measures, for fp32 buffers of several sizes, the median wall time of the
different ways to express reduce-scatter and all-gather with torch.distributed
on the gloo backend, plus all-reduce as a reference, and whether
``async_op=True`` overlaps communication with a matmul in the main thread.

Size convention: SIZE is the *full (unsharded) flat buffer* held by each rank,
i.e. the per-rank input of reduce-scatter / all-reduce and the per-rank output
of all-gather (whose per-rank input is the SIZE/world shard).  This is the
ZeRO situation: reduce-scatter a full grad buffer, all-gather a full param
buffer from shards.

Usage:
    python bench/gloo_collectives.py                      # 1,8,32 MiB, 2 ranks
    python bench/gloo_collectives.py --sizes-mib 1 8 32 --iters 20 --warmup 3 \
        --threads 1 --out bench/results/gloo_collectives.md

Every wait has a timeout: the process group timeout (--timeout) applies to
synchronous collectives, ``work.wait(timeout)`` to async ones, and the parent
kills the workers if they are not done within --total-timeout seconds.
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
import warnings

import torch
import torch.distributed as dist

from _common import free_port, init_gloo, loadavg, machine_lines, spawn_ranks

MiB = 1 << 20


# --------------------------------------------------------------------------
# Collective implementations.  Each "make" function receives (numel, rank,
# world) and returns (run, check): run() performs one collective (blocking),
# check() verifies the result of the last run() against a reference.
# Buffers are allocated once, outside the timed region.
# --------------------------------------------------------------------------


def _rs_input(numel, rank, world):
    # deterministic, rank-dependent values; small enough that repeated
    # in-place all-reduce does not overflow within a run
    x = torch.arange(numel, dtype=torch.float32).remainder_(97.0).add_(rank)
    return x


def _rs_expected(numel, rank, world):
    shard = numel // world
    base = torch.arange(numel, dtype=torch.float32).remainder_(97.0)
    full = base * world + sum(range(world))
    return full[rank * shard:(rank + 1) * shard]


def make_rs_single(numel, rank, world):
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    inp = _rs_input(numel, rank, world)
    out = torch.empty(numel // world)

    def run():
        fn(out, inp)

    def check():
        torch.testing.assert_close(out, _rs_expected(numel, rank, world))

    return run, check


def make_rs_tensor(numel, rank, world):
    inp = _rs_input(numel, rank, world)
    out = torch.empty(numel // world)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.reduce_scatter_tensor(out, inp)

    def check():
        torch.testing.assert_close(out, _rs_expected(numel, rank, world))

    return run, check


def make_rs_a2a(numel, rank, world):
    inp = _rs_input(numel, rank, world)
    recv = torch.empty(numel)
    out = torch.empty(numel // world)

    def run():
        dist.all_to_all_single(recv, inp)
        torch.sum(recv.view(world, -1), dim=0, out=out)

    def check():
        torch.testing.assert_close(out, _rs_expected(numel, rank, world))

    return run, check


def make_rs_allreduce(numel, rank, world):
    src = _rs_input(numel, rank, world)
    buf = torch.empty(numel)
    out = torch.empty(numel // world)
    shard = numel // world

    def run():
        # all_reduce is in-place: copy the grad into a scratch buffer first so
        # the source stays intact (a real ZeRO impl could reduce in place; the
        # copy costs ~1 memcpy of SIZE, reported separately as 'memcpy').
        buf.copy_(src)
        dist.all_reduce(buf)
        out.copy_(buf[rank * shard:(rank + 1) * shard])

    def check():
        torch.testing.assert_close(out, _rs_expected(numel, rank, world))

    return run, check


def make_rs_list(numel, rank, world):
    inp = _rs_input(numel, rank, world)
    chunks = list(inp.chunk(world))
    out = torch.empty(numel // world)

    def run():
        dist.reduce_scatter(out, chunks)

    def check():
        torch.testing.assert_close(out, _rs_expected(numel, rank, world))

    return run, check


def _ag_shard(numel, rank, world):
    shard = numel // world
    return torch.arange(rank * shard, (rank + 1) * shard, dtype=torch.float32)


def _ag_expected(numel, rank, world):
    return torch.arange(numel, dtype=torch.float32)


def make_ag_single(numel, rank, world):
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    inp = _ag_shard(numel, rank, world)
    out = torch.empty(numel)

    def run():
        fn(out, inp)

    def check():
        torch.testing.assert_close(out, _ag_expected(numel, rank, world))

    return run, check


def make_ag_into_tensor(numel, rank, world):
    inp = _ag_shard(numel, rank, world)
    out = torch.empty(numel)

    def run():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            dist.all_gather_into_tensor(out, inp)

    def check():
        torch.testing.assert_close(out, _ag_expected(numel, rank, world))

    return run, check


def make_ag_list(numel, rank, world):
    inp = _ag_shard(numel, rank, world)
    out = torch.empty(numel)
    views = list(out.chunk(world))  # gather straight into views of the flat buffer

    def run():
        dist.all_gather(views, inp)

    def check():
        torch.testing.assert_close(out, _ag_expected(numel, rank, world))

    return run, check


def make_ag_a2a(numel, rank, world):
    inp = _ag_shard(numel, rank, world)
    send = torch.empty(numel)
    out = torch.empty(numel)

    def run():
        # each rank sends its shard to every rank: replicate it world times
        send.view(world, -1).copy_(inp.unsqueeze(0).expand(world, -1))
        dist.all_to_all_single(out, send)

    def check():
        torch.testing.assert_close(out, _ag_expected(numel, rank, world))

    return run, check


def make_allreduce(numel, rank, world):
    buf = torch.zeros(numel)

    def run():
        dist.all_reduce(buf)

    def check():
        pass

    return run, check


def make_memcpy(numel, rank, world):
    a = torch.ones(numel)
    b = torch.empty(numel)

    def run():
        b.copy_(a)

    def check():
        pass

    return run, check


METHODS = [
    # (group, label, factory)
    ("reduce-scatter", "reduce_scatter_single (= reduce_scatter_tensor in 2.13)", make_rs_single),
    ("reduce-scatter", "reduce_scatter_tensor (deprecated alias)", make_rs_tensor),
    ("reduce-scatter", "all_to_all_single + local sum", make_rs_a2a),
    ("reduce-scatter", "copy + all_reduce + keep own slice", make_rs_allreduce),
    ("reduce-scatter", "reduce_scatter (list form)", make_rs_list),
    ("all-gather", "all_gather_single (= all_gather_into_tensor in 2.13)", make_ag_single),
    ("all-gather", "all_gather_into_tensor (deprecated alias)", make_ag_into_tensor),
    ("all-gather", "all_gather (list form, views of flat out)", make_ag_list),
    ("all-gather", "replicate shard + all_to_all_single", make_ag_a2a),
    ("all-reduce", "all_reduce (in place)", make_allreduce),
    ("local", "memcpy of SIZE (reference, no comm)", make_memcpy),
]


def _sync_check(ok: bool) -> bool:
    """True iff ok on every rank (keeps ranks in lock-step after a failure)."""
    t = torch.tensor([1.0 if ok else 0.0])
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item() == 1.0)


def overlap_test(args, rank, world, results):
    """compute alone / comm alone / async comm + compute in the main thread."""
    n = args.matmul_n
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    c = torch.empty(n, n)

    def compute():
        for _ in range(args.matmul_reps):
            torch.mm(a, b, out=c)

    numel = int(args.overlap_mib * MiB) // 4
    numel -= numel % world
    cases = {
        "all_reduce": (torch.zeros(numel), None,
                       lambda buf, _o, ao: dist.all_reduce(buf, async_op=ao)),
        "reduce_scatter_single": (torch.zeros(numel), torch.empty(numel // world),
                                  lambda buf, o, ao: dist.reduce_scatter_single(o, buf, async_op=ao)),
        "all_gather_single": (torch.zeros(numel // world), torch.empty(numel),
                              lambda buf, o, ao: dist.all_gather_single(o, buf, async_op=ao)),
    }
    wait_to = datetime.timedelta(seconds=args.timeout)
    fns = {"compute": compute}
    for name, (buf, out, fn) in cases.items():
        if name != "all_reduce" and not hasattr(dist, name):
            continue

        def comm_only(buf=buf, out=out, fn=fn):
            w = fn(buf, out, True)
            w.wait(timeout=wait_to)

        def both(buf=buf, out=out, fn=fn):
            w = fn(buf, out, True)
            compute()
            w.wait(timeout=wait_to)

        def serial(buf=buf, out=out, fn=fn):
            fn(buf, out, False)
            compute()

        fns[(name, "comm_ms")] = comm_only
        fns[(name, "both_async_ms")] = both
        fns[(name, "serial_ms")] = serial
    times = {k: [] for k in fns}
    for f in fns.values():  # warmup
        f()
    for _ in range(args.overlap_iters):  # interleaved rounds
        for k, f in fns.items():
            dist.barrier()
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    med = {}
    for k in fns:
        t = torch.tensor([statistics.median(times[k])])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        med[k] = t.item() * 1e3
    results["overlap"] = {"matmul": f"{args.matmul_reps}x mm({n}x{n})",
                          "compute_ms": med["compute"], "size_mib": args.overlap_mib, "cases": {}}
    for k, v in med.items():
        if k != "compute":
            results["overlap"]["cases"].setdefault(k[0], {})[k[1]] = v


def worker(rank, world, port, args, result_path):
    init_gloo(rank, world, port, threads=args.threads, timeout_s=args.timeout)
    results = {"rows": [], "errors": {}}
    try:
        for size_mib in args.sizes_mib:
            numel = int(size_mib * MiB) // 4
            numel -= numel % world
            # build + correctness-check every method, then time them
            # round-robin (one iteration of each method per round) so that
            # background load on a shared machine hits all methods alike.
            live = []  # (group, label, run)
            for group, label, factory in METHODS:
                err = None
                try:
                    run, check = factory(numel, rank, world)
                    run()
                    check()
                    ok = True
                except Exception as e:  # noqa: BLE001
                    ok = False
                    err = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                if _sync_check(ok):
                    live.append((group, label, run))
                else:
                    # rank-local error text if this rank failed, else the peer's
                    err = err or "failed on another rank"
                    results["errors"][label] = err
                    results["rows"].append({"group": group, "method": label, "size_mib": size_mib,
                                            "median_ms": None, "min_ms": None, "error": err})
                    if rank == 0:
                        print(f"[{size_mib:>4} MiB] {group:15s} {label:55s} ERROR {err}", flush=True)
            for _ in range(args.warmup):
                for _g, _l, run in live:
                    run()
            times = {label: [] for _g, label, _r in live}
            for _ in range(args.iters):
                for _g, label, run in live:
                    dist.barrier()
                    t0 = time.perf_counter()
                    run()
                    times[label].append(time.perf_counter() - t0)
            for group, label, _r in live:
                med = statistics.median(times[label])
                # worst rank's median = what the slowest participant sees
                t = torch.tensor([med, min(times[label])])
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                results["rows"].append({"group": group, "method": label, "size_mib": size_mib,
                                        "median_ms": t[0].item() * 1e3, "min_ms": t[1].item() * 1e3,
                                        "error": None})
                if rank == 0:
                    print(f"[{size_mib:>4} MiB] {group:15s} {label:55s} {t[0].item() * 1e3:9.2f} ms",
                          flush=True)
            del live, times
        if args.overlap:
            overlap_test(args, rank, world, results)
    finally:
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(results, f)
        dist.barrier()
        dist.destroy_process_group()


def machine_description(args) -> str:
    return "\n".join(machine_lines(lscpu_head=True)
                     + [f"torch threads per rank: {args.threads} (--threads)",
                        f"load average at start: {loadavg(5)}"])


def render(results, args, machine, cmd) -> str:
    sizes = args.sizes_mib
    lines = ["# gloo collectives micro-benchmark", "",
             f"Command: `{cmd}`", "",
             f"Date: {datetime.datetime.now().isoformat(timespec='seconds')}", "",
             "```", machine, "```", "",
             f"world={args.world}, fp32, median over {args.iters} iters after {args.warmup} warmup, "
             "methods timed round-robin (one iteration of each per round), "
             "barrier before each iteration; value = max over ranks of each rank's median. "
             "SIZE = full flat buffer per rank (reduce-scatter input, all-gather output; "
             "the shard is SIZE/world).", ""]
    hdr = "| op | method | " + " | ".join(f"{s} MiB (ms)" for s in sizes) + " |"
    lines += [hdr, "|" + "---|" * (2 + len(sizes))]
    by = {}
    for r in results["rows"]:
        by.setdefault((r["group"], r["method"]), {})[r["size_mib"]] = r
    for (group, method), d in by.items():
        cells = []
        for s in sizes:
            r = d.get(s)
            if r is None:
                cells.append("-")
            elif r["median_ms"] is None:
                cells.append("ERR")
            else:
                cells.append(f"{r['median_ms']:.2f}")
        lines.append(f"| {group} | {method} | " + " | ".join(cells) + " |")
    if results["errors"]:
        lines += ["", "Errors:", ""]
        for k, v in results["errors"].items():
            lines.append(f"- `{k}`: {v}")
    # conclusions
    lines += ["", "## Fastest per op", ""]
    for group in ("reduce-scatter", "all-gather"):
        for s in sizes:
            cands = [(d[s]["median_ms"], m) for (g, m), d in by.items()
                     if g == group and s in d and d[s]["median_ms"] is not None]
            if cands:
                cands.sort()
                best = cands[0]
                rest = ", ".join(f"{m} {t:.2f}" for t, m in cands[1:])
                lines.append(f"- {group} {s} MiB: **{best[1]}** {best[0]:.2f} ms (others: {rest})")
    ov = results.get("overlap")
    if ov:
        lines += ["", "## async_op overlap with a main-thread matmul", "",
                  f"compute = {ov['matmul']} per rank: {ov['compute_ms']:.2f} ms; "
                  f"comm buffer {ov['size_mib']} MiB (full buffer, as above).", "",
                  "| collective | comm alone (async+wait) | serial comm then compute | async comm + compute, then wait | overlap saved vs serial |",
                  "|---|---|---|---|---|"]
        for name, c in ov["cases"].items():
            if "error" in c:
                lines.append(f"| {name} | ERR: {c['error']} | | | |")
                continue
            ideal = max(c["comm_ms"], ov["compute_ms"])
            saved = c["serial_ms"] - c["both_async_ms"]
            lines.append(f"| {name} | {c['comm_ms']:.2f} | {c['serial_ms']:.2f} | {c['both_async_ms']:.2f} "
                         f"(ideal max = {ideal:.2f}) | {saved:.2f} ms |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 8, 32])
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=120.0, help="process-group / wait timeout (s)")
    p.add_argument("--total-timeout", type=float, default=1200.0, help="kill workers after this (s)")
    p.add_argument("--no-overlap", dest="overlap", action="store_false")
    p.add_argument("--overlap-mib", type=float, default=32)
    p.add_argument("--overlap-iters", type=int, default=7)
    p.add_argument("--matmul-n", type=int, default=1024)
    p.add_argument("--matmul-reps", type=int, default=4)
    p.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "gloo_collectives.md"))
    args = p.parse_args(argv)
    cmd = "python " + " ".join(shlex.quote(a) for a in [os.path.relpath(sys.argv[0])] + sys.argv[1:])
    machine = machine_description(args)
    print(machine, flush=True)

    port = free_port()
    fd, result_path = tempfile.mkstemp(suffix=".json", prefix="gloo_coll_")
    os.close(fd)
    try:
        spawn_ranks(worker, (args.world, port, args, result_path), args.world, args.total_timeout, "workers")
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
    with open(result_path) as f:
        results = json.load(f)
    os.unlink(result_path)
    md = render(results, args, machine, cmd)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        f.write(md)
    print()
    print(md)
    print(f"written to {args.out}")


if __name__ == "__main__":
    main()
