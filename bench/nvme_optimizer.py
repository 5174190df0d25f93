"""Optimizer step from NVMe (tiertrain.update.nvme.NVMeAdamW, docs/concepts.md#optimizer-step-with-nvme) against
the same AdamW in RAM and against the IO lower bound, all measured in one run on one disk.

Rows, for ``--params`` fp32 parameters split into ``--shards`` shards (ZeRO units):

* **AdamW in RAM**: ``torch.optim.AdamW(fused=True)`` over the shards in memory (what the CPU tier,
  ZeRO-Offload, runs), plus the same publish copy into ``--publish``-dtype shards, at 1 torch
  thread and at torch's default.
* **IO lower bound**: the step must read and write 12 B per parameter (fp32 master, exp_avg,
  exp_avg_sq). The swap layer's O_DIRECT bandwidth is measured here, in the same run, on the same
  directory, with the same AsyncIO settings (threads, block size, sum64 checksums) and pool
  buffers of the chunk size: writes alone, reads alone, and reads and writes at the same time
  (what the step does). The bound is state_bytes / read_bw + state_bytes / write_bw (reads and
  writes one after the other) and 2 · state_bytes / mixed_bw (both at once); the larger of the
  IO bound and the RAM AdamW time is what a perfectly overlapped step would take.
* **NVMeAdamW** for each (chunk MiB, buffers, transactional, compute threads) configuration:
  the median step time, with the achieved GB/s (bytes read + written per second of step), the
  IO time, the time the step blocked on IO, AdamW compute and publish seconds, and the overlap
  fraction (StepStats.overlap).

All rows are built first (each NVMe configuration with its own swap files: ~2.4 GB each at 100M
parameters, two generations) and then step round robin, one step per row per round, so that
load from other processes on a shared machine hits every row alike; medians over ``--steps``
rounds after ``--warmup``.

    python bench/nvme_optimizer.py                                  # 100M params in /tmp, ~3 min
    python bench/nvme_optimizer.py --params 2e7 --configs 8:4:1 --steps 2 --no-md
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

from _common import machine_lines  # noqa: E402
from tiertrain.config import OptimizerConfig  # noqa: E402
from tiertrain.io import AlignedBufferPool, AsyncIO  # noqa: E402
from tiertrain.update.nvme import NVMeAdamW  # noqa: E402

MiB = 1 << 20


class RawIO:
    """The IO lower bound, measured: the swap layer itself (AsyncIO, O_DIRECT, sum64 verified on
    read) reading ``state`` bytes of one file and writing ``state`` bytes to another, in requests
    of ``chunk`` bytes from a ring of 8 pool buffers, reads and writes interleaved as a step
    interleaves them (no AdamW, no copies). Files are laid out in the constructor, as the
    optimizer's are after its constructor. ``step`` = one such pass; ``write_only`` and
    ``read_only`` measure the directions separately."""

    def __init__(self, d: str, state: int, chunk: int, threads: int, block: int):
        self.nbuf = 8
        self.chunk = chunk
        self.n = -(-state // chunk)
        self.state = state
        self.pool = AlignedBufferPool(self.nbuf * chunk, chunk, pin=False)
        self.bufs = [self.pool.acquire(chunk) for _ in range(self.nbuf)]
        for b in self.bufs:
            b.view(torch.float32).copy_(torch.randn(chunk // 4))
        self.io = AsyncIO(threads, block, checksum="sum64")
        self.a, self.b = os.path.join(d, "raw_a.bin"), os.path.join(d, "raw_b.bin")
        self.cks = {}
        self.write_only(self.a)
        self.write_only(self.b)
        self.times, self.last = [], 0.0

    def _size(self, i: int) -> int:
        return min(self.chunk, self.state - i * self.chunk)

    def _ring(self, requests) -> float:
        t0 = time.perf_counter()
        pending = [None] * self.nbuf
        for k, submit in enumerate(requests):
            if pending[k % self.nbuf] is not None:
                pending[k % self.nbuf].wait(600)
            pending[k % self.nbuf] = submit(self.bufs[k % self.nbuf])
        for h in pending:
            if h is not None:
                h.wait(600)
        return time.perf_counter() - t0

    def _w(self, path, i):
        def submit(buf):
            h = self.io.submit_write(path, buf, i * self.chunk, nbytes=self._size(i))
            h.add_done_callback(lambda h: self.cks.__setitem__((path, i), h.checksum))
            return h
        return submit

    def _r(self, path, i):
        def submit(buf):
            h = self.io.submit_read(path, buf, i * self.chunk, nbytes=self._size(i),
                                    checksum=self.cks[(path, i)])
            return h
        return submit

    def write_only(self, path=None) -> float:
        return self._ring([self._w(path or self.b, i) for i in range(self.n)])

    def read_only(self) -> float:
        return self._ring([self._r(self.a, i) for i in range(self.n)])

    def step(self, record: bool) -> None:
        reqs = []
        for i in range(self.n):
            reqs += [self._r(self.a, i), self._w(self.b, i)]
        self.last = self._ring(reqs)
        if record:
            self.times.append(self.last)

    def close(self) -> None:
        self.io.close(600)
        for b in self.bufs:
            b.release()
        for p in (self.a, self.b):
            try:
                os.unlink(p)
            except OSError:
                pass


class RamAdamW:
    """torch.optim.AdamW(fused=True) over the shards in RAM, plus the publish copy."""

    def __init__(self, shards, grads, dests, cfg, threads):
        self.params = [s.clone() for s in shards]
        for p, g in zip(self.params, grads):
            p.grad = g
        self.opt = torch.optim.AdamW([{"params": self.params, "weight_decay": cfg.weight_decay}],
                                     lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, fused=True)
        self.dests, self.threads, self.times = dests, threads, []

    def step(self, record: bool) -> None:
        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            t0 = time.perf_counter()
            self.opt.step()
            for d, p in zip(self.dests, self.params):
                d.copy_(p)
            self.last = time.perf_counter() - t0
        finally:
            torch.set_num_threads(before)
        if record:
            self.times.append(self.last)

    def close(self) -> None:
        del self.opt, self.params


class NVMeRow:
    def __init__(self, spec, shards, grads, dests, cfg, d, threads, block):
        cm, nb, tr, *ct = spec.split(":")
        self.chunk_mib, self.buffers, self.transactional = float(cm), int(nb), tr == "1"
        self.compute_threads = int(ct[0]) if ct else "auto"
        self.grads, self.dests, self.lr = grads, dests, cfg.lr
        t0 = time.perf_counter()
        self.opt = NVMeAdamW(shards, None, cfg, swap_dir=os.path.join(d, spec.replace(":", "_")),
                             rank=0, chunk_bytes=int(self.chunk_mib * MiB), num_buffers=self.buffers,
                             transactional=self.transactional, aio_threads=threads,
                             aio_block_bytes=block, pin=False, compute_threads=self.compute_threads)
        self.init_s = time.perf_counter() - t0
        self.stats = []

    def step(self, record: bool) -> None:
        st = self.opt.step(self.grads, self.lr, out=self.dests)
        self.last = st.seconds
        if record:
            self.stats.append(st)

    def close(self) -> None:
        self.notes = list(self.opt.swapper.aio.notes)
        self.mem = self.opt.memory_report()
        self.opt.close()

    def summary(self) -> dict:
        med = sorted(self.stats, key=lambda s: s.seconds)[len(self.stats) // 2]
        return {"chunk_mib": self.chunk_mib, "buffers": self.buffers,
                "transactional": self.transactional, "compute_threads": self.compute_threads,
                "init_s": self.init_s, "seconds": med.seconds,
                "all_seconds": [s.seconds for s in self.stats], "gbps": med.gbps,
                "io_seconds": med.io_seconds, "io_wait": med.io_wait_seconds,
                "compute": med.compute_seconds, "publish": med.publish_seconds,
                "overlap": med.overlap, "resident": self.mem["resident_bytes"],
                "chunks": self.mem["chunks"], "disk": self.mem["disk_bytes"], "notes": self.notes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", type=float, default=100e6)
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--configs", nargs="+",
                    default=["24:4:1", "24:4:1:2", "96:4:1", "6:4:1", "24:3:1", "24:8:1", "24:4:0"],
                    help="chunk_mib:num_buffers:transactional(1/0)[:compute_threads] (default auto)")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=4, help="AsyncIO threads")
    ap.add_argument("--block-mib", type=int, default=8, help="AsyncIO block size")
    ap.add_argument("--raw-repeat", type=int, default=2)
    ap.add_argument("--publish", choices=["fp32", "bf16"], default="bf16",
                    help="dtype of the destination shards the updated parameters are copied into")
    ap.add_argument("--no-md", action="store_true")
    ap.add_argument("--out", default=os.path.join(HERE, "results", "nvme_optimizer.md"))
    args = ap.parse_args(argv)
    t_start = time.time()
    load_before = os.getloadavg()
    cfg = OptimizerConfig()
    n = int(args.params)
    sizes = [n // args.shards + (1 if i < n % args.shards else 0) for i in range(args.shards)]
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(s, generator=g) * 0.02 for s in sizes]
    grads = [torch.randn(s, generator=g) * 1e-3 for s in sizes]
    dtype = torch.bfloat16 if args.publish == "bf16" else torch.float32
    dests = [torch.empty(s, dtype=dtype) for s in sizes]
    state = 12 * n
    work = tempfile.mkdtemp(prefix="nvme_opt_bench_", dir=args.dir)
    rams, rows, raw = [], [], None
    try:
        first_chunk = int(float(args.configs[0].split(":")[0]) * MiB)
        raw = RawIO(work, state, first_chunk, args.threads, args.block_mib * MiB)
        t_write = statistics.median(raw.write_only() for _ in range(args.raw_repeat))
        t_read = statistics.median(raw.read_only() for _ in range(args.raw_repeat))
        print(f"raw O_DIRECT: write {state / t_write / 1e9:.2f} GB/s, read {state / t_read / 1e9:.2f} GB/s",
              flush=True)
        rams = [RamAdamW(shards, grads, dests, cfg, t) for t in sorted({1, torch.get_num_threads()})]
        for c in args.configs:
            rows.append(NVMeRow(c, shards, grads, dests, cfg, work, args.threads, args.block_mib * MiB))
            print(f"{c}: init {rows[-1].init_s:.2f} s", flush=True)
        # Round robin: every row steps once per round, so load from other processes on this
        # shared machine hits all rows alike; the IO bound is one of the rows.
        for k in range(args.warmup + args.steps):
            for row in [raw] + rams + rows:
                row.step(record=k >= args.warmup)
            print(f"round {k}: raw {raw.last:.3f} | " + ", ".join(f"{r.last:.3f}" for r in rams) + " | " +
                  ", ".join(f"{r.last:.3f}" for r in rows), flush=True)
    finally:
        for r in ([raw] if raw else []) + rams + rows:
            r.close()
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    ram_times = {r.threads: statistics.median(r.times) for r in rams}
    ram = min(ram_times.values())
    for r in rows:       # this row's step / the IO bound's pass in the same round
        r.same_round = statistics.median(st.seconds / t for st, t in zip(r.stats, raw.times))
    rows = [dict(r.summary(), same_round=r.same_round) for r in rows]
    raw_times = raw.times
    bound_serial = t_read + t_write
    bound_mixed = statistics.median(raw_times)
    per100 = 1e8 / n
    lines = ["# Optimizer step from NVMe: NVMeAdamW vs AdamW in RAM vs the IO lower bound", "",
             f"Command: `python bench/nvme_optimizer.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
             f" — {time.strftime('%Y-%m-%d %H:%M:%S')}, {time.time() - t_start:.0f} s.", "",
             "## Machine", *[f"- {line}" for line in machine_lines(dirs=[args.dir], torch_threads=True)],
             f"- load average before: {' '.join(f'{x:.2f}' for x in load_before)}; after: "
             f"{' '.join(f'{x:.2f}' for x in os.getloadavg())} (2 shared cores; other sessions were running)",
             "", "## Method",
             f"- {n / 1e6:.0f}M fp32 parameters in {args.shards} shards (ZeRO units), every element decayed; "
             f"state = 12 B/param = {state / 1e9:.2f} GB read and {state / 1e9:.2f} GB written per step; "
             f"updated parameters published into {args.publish} shards (the engine's `u.shard`) in every "
             f"NVMe and RAM row.",
             f"- AsyncIO: {args.threads} threads, {args.block_mib} MiB blocks, O_DIRECT, sum64 checksums "
             f"(verified on every read); swap files in `{args.dir}`.",
             f"- IO lower bound: the swap layer alone (AsyncIO + a ring of 8 pool buffers of "
             f"{first_chunk // MiB} MiB, the first configuration's chunk) reading {state / 1e9:.2f} GB from one "
             f"file while writing {state / 1e9:.2f} GB to another, requests interleaved as a step interleaves "
             f"them, on files laid out beforehand — the step's IO with no AdamW and no copies. It is a row of "
             f"the round robin, so each NVMe row is also compared with the IO bound of its own round "
             f"('same round' column: median over rounds of step / IO pass). Before the rounds, writes alone "
             f"and reads alone were timed ({args.raw_repeat} passes each, median) for the serial bound.",
             f"- Rounds: every row (the IO bound, RAM AdamW at 1 and {torch.get_num_threads()} torch threads, "
             f"each NVMeAdamW configuration, all built up front with their own swap files) steps once per round, "
             f"round robin, so that load from other processes hits all rows alike; medians of "
             f"{args.steps} rounds after {args.warmup} warm-up round(s). 'init' is the "
             f"constructor's first write of the state (not in the step time). Overlap = StepStats.overlap: "
             f"the fraction of the shorter of (IO time, time the step's thread worked) that ran concurrently "
             f"with the other.",
             "", "## Results (GB/s = 10^9 B/s)", "",
             f"Swap-layer bandwidth in this run: write alone {state / t_write / 1e9:.2f} GB/s, read alone "
             f"{state / t_read / 1e9:.2f} GB/s, reads and writes interleaved {2 * state / bound_mixed / 1e9:.2f} "
             f"GB/s (median of the rounds: {', '.join(f'{t:.2f}' for t in raw_times)} s).", "",
             "| row | step (s) | s per 100M params | GB/s moved | × IO bound | × IO bound, same round | notes |",
             "|---|---|---|---|---|---|---|",
             *[f"| AdamW in RAM (torch fused) + publish, {t} thread(s) | {v:.3f} | {v * per100:.3f} | — | — | — | "
               f"state in RAM: {(state + 4 * n) / 2**30:.2f} GiB incl. grads |" for t, v in ram_times.items()],
             f"| IO lower bound: reads, then writes | {bound_serial:.3f} | {bound_serial * per100:.3f} | "
             f"{2 * state / bound_serial / 1e9:.2f} | {bound_serial / bound_mixed:.2f} | — | read-alone + write-alone passes |",
             f"| **IO lower bound: reads and writes interleaved** | {bound_mixed:.3f} | {bound_mixed * per100:.3f} | "
             f"{2 * state / bound_mixed / 1e9:.2f} | 1.00 | 1.00 | the step's IO alone |",
             f"| max(IO bound, best RAM AdamW) | {max(bound_mixed, ram):.3f} | "
             f"{max(bound_mixed, ram) * per100:.3f} | — | {max(bound_mixed, ram) / bound_mixed:.2f} | — | "
             f"perfect overlap |"]
    for r in rows:
        mode = "2 generations" if r["transactional"] else "in place"
        lines.append(
            f"| NVMeAdamW {r['chunk_mib']:g} MiB chunks × {r['buffers']} buffers, {mode}, "
            f"{r['compute_threads']} compute thread(s) | "
            f"{r['seconds']:.3f} | {r['seconds'] * per100:.3f} | {r['gbps']:.2f} | "
            f"{r['seconds'] / bound_mixed:.2f} | {r['same_round']:.2f} | RAM {r['resident'] / 2**20:.0f} MiB; {r['chunks']} chunks; "
            f"IO {r['io_seconds']:.2f} s, blocked {r['io_wait']:.2f} s, AdamW {r['compute']:.3f} s, "
            f"publish {r['publish']:.3f} s, overlap {r['overlap']:.2f}; init {r['init_s']:.2f} s; "
            f"steps {', '.join(f'{x:.2f}' for x in r['all_seconds'])} |")
    notes = sorted({x for r in rows for x in r["notes"]})
    if notes:
        lines += ["", "IO notes: " + "; ".join(notes)]
    text = "\n".join(lines) + "\n"
    print(text)
    if not args.no_md:
        os.makedirs(os.path.dirname(args.out), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
