"""The acid test of ZeRO-Infinity (issue 4, acceptance (d); docs/concepts.md#zero-infinity): train a GPT whose
model states are at least 1.5× this machine's RAM, and compare its step time with the IO
lower bound (bytes moved / the disk bandwidth measured in the same run).

The model is chosen from the machine: with bf16 parameters, fp32 gradients and an fp32
master + two Adam moments, model states are 2 + 4 + 12 = 18 bytes per parameter; the GPT
(hidden 2560, vocabulary 256) gets enough layers for 18·Ψ ≥ ratio × MemTotal. It runs on
2 ranks (ZeRO stage 3, dp=2):

* built directly in partitioned form (``partitioned_init``: each rank materialises one
  module at a time and keeps its shard);
* parameter shards on NVMe (``zero.offload_params=nvme``), fetched per block;
* fp32 masters and Adam moments on NVMe, streamed through a few chunk buffers at each step
  (``zero.offload_optimizer=nvme``); gradient shards in the CPU tier;
* every block's input checkpointed to the CPU tier (``activations.checkpoint_every=1``).

Measured per step and rank: wall time, bytes read and written by the process
(``/proc/self/io``), peak resident memory (``VmHWM``); per run: the engine's memory report
(model-state bytes by kind and tier). The IO lower bound of a step is
``Σ_ranks read / read GB/s + Σ_ranks written / write GB/s`` with both bandwidths measured with
O_DIRECT in the swap directory just before training (the ranks share one disk).

    python bench/larger_than_ram.py --swap-dir /work/swap --steps 4
    python bench/larger_than_ram.py --ratio 0.05 --steps 2 --no-md     # a quick smoke run
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from _common import machine_lines, meminfo  # noqa: E402

BYTES_PER_PARAM = 2 + 4 + 12  # bf16 parameter, fp32 gradient, fp32 master + exp_avg + exp_avg_sq
RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "larger_than_ram.md")


def proc_io() -> tuple[int, int]:
    """(read_bytes, write_bytes) this process caused to reach the block layer."""
    fields = {}
    with open("/proc/self/io") as f:
        for line in f:
            k, v = line.split(":")
            fields[k] = int(v)
    return fields["read_bytes"], fields["write_bytes"]


def vm_hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def choose_model(target_bytes: int, hidden: int, seq_len: int):
    from tiertrain.models.gpt import GPTConfig

    layers = 1
    while True:
        cfg = GPTConfig(vocab_size=256, seq_len=seq_len, n_layers=layers, hidden=hidden, n_heads=hidden // 128,
                        bias=False, dropout=0.0)
        if cfg.num_parameters() * BYTES_PER_PARAM >= target_bytes:
            return cfg
        layers += 1


def rank_main(args, model_cfg):
    import torch.distributed as dist

    import tiertrain
    from tiertrain.config import Config, from_dict
    from tiertrain.data import bundled_dataset
    from tiertrain.models.gpt import GPT

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    config = from_dict(Config, {
        "precision": {"dtype": "bf16"},
        "optimizer": {"lr": args.lr, "grad_clip": 1.0},
        "schedule": {"warmup_steps": 0},
        "batch": {"micro_batch_size": args.micro_batch, "grad_accum_steps": 1},
        "zero": {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": args.swap_dir},
        "activations": {"checkpoint_every": 1, "offload": "cpu"},
    }).validate()
    topology = tiertrain.Topology.build(config.parallel)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    with tiertrain.partitioned_init(topology):
        model = GPT(model_cfg)
    t_build = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine = tiertrain.wrap(model, config, topology)
    t_wrap = time.perf_counter() - t0
    dataset = bundled_dataset(model_cfg.seq_len, os.path.join(args.swap_dir, "data"))
    steps = []
    for step in range(args.steps):
        first = ((step if args.data == "stream" else 0) * world + rank) * args.micro_batch
        rows = [dataset[first + i] for i in range(args.micro_batch)]
        batch = {k: torch.stack([r[k] for r in rows]) for k in rows[0]}
        dist.barrier()
        r0, w0 = proc_io()
        t0 = time.perf_counter()
        loss = engine.train_batch(iter([batch]))
        seconds = time.perf_counter() - t0
        r1, w1 = proc_io()
        steps.append({"loss": loss, "seconds": seconds, "read": r1 - r0, "written": w1 - w0, "hwm": vm_hwm(),
                      "grad_norm": engine.last_grad_norm})
        if rank == 0:
            print(f"step {step}: loss {loss:.4f} | {seconds:.1f} s | read {(r1 - r0) / 1e9:.2f} GB "
                  f"written {(w1 - w0) / 1e9:.2f} GB (rank 0)", flush=True)
    report = engine.memory_report()
    return {"steps": steps, "build_s": t_build, "wrap_s": t_wrap, "memory": vars(report),
            "swapper": dict(engine.swapper.stats), "hwm": vm_hwm()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--swap-dir", default="/tmp/tiertrain-larger-than-ram")
    ap.add_argument("--ratio", type=float, default=1.5, help="model states / MemTotal")
    ap.add_argument("--hidden", type=int, default=2560)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--data", choices=["fixed", "stream"], default="fixed",
                    help="fixed: every step trains on the same micro-batches, so the loss curve shows the "
                         "optimizer working without data noise; stream: new micro-batches each step")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--no-md", action="store_true", help="print only; do not write the results file")
    args = ap.parse_args()

    from tiertrain.estimate.probe import measure_direct_io
    from tiertrain.launch import launch_local

    os.makedirs(args.swap_dir, exist_ok=True)
    ram = meminfo("MemTotal")
    machine = [f"- {line}" for line in machine_lines(dirs=[args.swap_dir])]
    model_cfg = choose_model(int(args.ratio * ram), args.hidden, args.seq_len)
    n = model_cfg.num_parameters()
    print(f"model: {model_cfg.n_layers} layers × hidden {model_cfg.hidden}: {n / 1e9:.2f} B parameters, "
          f"model states {n * BYTES_PER_PARAM / 2**30:.1f} GiB = {n * BYTES_PER_PARAM / ram:.2f} × RAM", flush=True)
    free = shutil.disk_usage(args.swap_dir).free
    need = n * (2 + 24)  # parameter shards + both generations of the optimizer state
    if free < need * 1.1:
        sys.exit(f"{args.swap_dir}: {free / 2**30:.0f} GiB free, the run needs about {need / 2**30:.0f} GiB")
    write_gbps, read_gbps, direct, note = measure_direct_io(args.swap_dir, 1 << 30, 8 << 20)
    print(f"disk ({args.swap_dir}): write {write_gbps:.2f} GB/s, read {read_gbps:.2f} GB/s (O_DIRECT={direct})",
          flush=True)
    started = time.perf_counter()
    results = launch_local(rank_main, args.ranks, args, model_cfg, timeout=7200, deadline=7200)
    wall = time.perf_counter() - started

    rows = []
    for s in range(args.steps):
        per_rank = [r["steps"][s] for r in results]
        read = sum(p["read"] for p in per_rank)
        written = sum(p["written"] for p in per_rank)
        seconds = max(p["seconds"] for p in per_rank)
        bound = read / (read_gbps * 1e9) + written / (write_gbps * 1e9)
        rows.append((s, per_rank[0]["loss"], seconds, read, written, bound, per_rank[0]["grad_norm"]))
    mem = results[0]["memory"]
    states_per_rank = mem["params"] + mem["grads"] + mem["optimizer"]
    states = sum(r["memory"]["params"] + r["memory"]["grads"] + r["memory"]["optimizer"] for r in results)
    lines = [
        "# Training a model larger than RAM (ZeRO-Infinity, NVMe tiers)", "",
        f"Command: `python bench/larger_than_ram.py --swap-dir {args.swap_dir} --steps {args.steps} "
        f"--ratio {args.ratio} --lr {args.lr} --data {args.data}` — {datetime.datetime.now():%Y-%m-%d %H:%M}, "
        f"{wall:.0f} s in all.", "",
        "## Machine", *machine,
        f"- swap directory `{args.swap_dir}`: O_DIRECT write {write_gbps:.2f} GB/s, read {read_gbps:.2f} GB/s "
        f"(1 GiB, 8 MiB requests, measured just before training{'; ' + note if note else ''})", "",
        "## Model and placement",
        f"- GPT: {model_cfg.n_layers} layers, hidden {model_cfg.hidden}, {model_cfg.n_heads} heads, vocabulary 256, "
        f"sequence {model_cfg.seq_len}: **{n / 1e9:.3f} B parameters**",
        f"- model states: {states / 2**30:.1f} GiB over {args.ranks} ranks (engine memory report: params + grads + "
        f"optimizer) = **{states / ram:.2f} × RAM**",
        f"- per rank: params {mem['params'] / 2**30:.2f} GiB, grads {mem['grads'] / 2**30:.2f} GiB, optimizer "
        f"{mem['optimizer'] / 2**30:.2f} GiB; of these {mem['nvme_tier'] / 2**30:.2f} GiB on NVMe and "
        f"{mem['cpu_tier'] / 2**30:.2f} GiB in the CPU tier; activation checkpoints {mem['activation_checkpoints'] / 2**20:.1f} MiB (CPU tier)",
        f"- peak resident memory per rank (VmHWM): " + ", ".join(f"{r['hwm'] / 2**30:.2f} GiB" for r in results)
        + f"; both ranks together {sum(r['hwm'] for r in results) / ram:.2f} × RAM",
        f"- build under partitioned_init {results[0]['build_s']:.0f} s, wrap (shards and optimizer state written "
        f"to NVMe) {results[0]['wrap_s']:.0f} s", "",
        "## Steps (2 ranks, micro-batch "
        f"{args.micro_batch} × {model_cfg.seq_len} tokens per rank, "
        + ("the same micro-batches every step" if args.data == "fixed" else "new micro-batches every step")
        + f", AdamW lr {args.lr}, clipping at 1.0)", "",
        "| step | loss | step time (s) | read (GB, both ranks) | written (GB) | IO lower bound (s) | time / bound | grad norm |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for s, loss, seconds, read, written, bound, norm in rows:
        lines.append(f"| {s} | {loss:.4f} | {seconds:.1f} | {read / 1e9:.2f} | {written / 1e9:.2f} | {bound:.1f} | "
                     f"{seconds / bound:.2f} | {norm:.3g} |")
    lines += ["", f"Swapper statistics (rank 0): `{json.dumps(results[0]['swapper'])}`", ""]
    text = "\n".join(lines)
    print(text)
    if not args.no_md:
        with open(RESULTS, "w") as f:
            f.write(text)
    shutil.rmtree(os.path.join(args.swap_dir, "data"), ignore_errors=True)


if __name__ == "__main__":
    main()
