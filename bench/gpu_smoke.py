#!/usr/bin/env python
"""One GPU, the bench GPT at each tier: tokens/s, TFLOP/s and peak device memory (issue 21).

Rows: stage 0 (every state on the device), stage 3 with the parameters on the CPU tier,
stage 2 with the optimizer on the CPU tier (ZeRO-Offload), stage 3 with both on the CPU tier,
and stage 3 with both on NVMe (``--nvme DIR``). One rank (an NCCL group of one), fp16 with
loss scaling, AdamW. TFLOP/s counts 6·N·tokens (forward and backward of the weights' matmuls;
attention's own matmuls not counted), as Megatron's MFU does for the dense part.

Usage (on a machine with CUDA; writes bench/results/gpu_smoke.md):
    python bench/gpu_smoke.py --hidden 2048 --layers 24 --steps 10 --out bench/results/gpu_smoke.md
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch
import torch.distributed as dist

from _common import free_port, machine_lines

ROWS = {
    "device (stage 0)": {"stage": 0},
    "params on cpu (stage 3)": {"stage": 3, "offload_params": "cpu"},
    "optimizer on cpu (stage 2)": {"stage": 2, "offload_optimizer": "cpu"},
    "both on cpu (stage 3)": {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"},
    "both on nvme (stage 3)": {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme"},
}


def run_row(args, zero: dict) -> dict:
    import tiertrain
    from tiertrain.models.gpt import GPT, GPTConfig

    cfg = tiertrain.Config()
    for key, value in zero.items():
        setattr(cfg.zero, key, value)
    if "nvme" in zero.values():
        cfg.zero.nvme_path = args.nvme
    cfg.precision.dtype = "fp16"
    cfg.batch.micro_batch_size = args.micro
    cfg.validate()
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                          n_heads=args.heads))
    n_params = sum(p.numel() for p in model.parameters())
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    tokens = torch.randint(0, args.vocab, (args.micro, args.seq + 1))
    batch = {"input_ids": tokens[:, :-1], "labels": tokens[:, 1:]}
    torch.cuda.reset_peak_memory_stats()
    times = []
    for step in range(args.steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        engine.train_batch(iter([batch]))
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    engine.close()
    step_s = sorted(times[2:])[len(times[2:]) // 2]
    tokens_per_step = args.micro * args.seq
    return {"params": n_params, "step_s": step_s, "tokens_per_s": tokens_per_step / step_s,
            "tflops": 6 * n_params * tokens_per_step / step_s / 1e12,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro", type=int, default=4)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--nvme", default="", help="swap directory for the nvme row (skipped when empty)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_smoke.py needs a CUDA device")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("nccl", rank=0, world_size=1)
    lines = ["# GPU smoke: one GPU, the bench GPT at each tier", "",
             f"Measured {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC on "
             f"{torch.cuda.get_device_name()}.", "", "```", *machine_lines(torch_threads=True), "```", "",
             f"Command: `python bench/gpu_smoke.py {' '.join(sys.argv[1:])}`", "",
             "| tier | parameters | step s | tokens/s | TFLOP/s (6N) | peak device GiB |", "|---|---|---|---|---|---|"]
    for name, zero in ROWS.items():
        if "nvme" in zero.values() and not args.nvme:
            continue
        r = run_row(args, zero)
        lines.append(f"| {name} | {r['params'] / 1e6:.0f} M | {r['step_s']:.3f} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tflops']:.1f} | {r['peak_gib']:.2f} |")
        print(lines[-1], flush=True)
    report = "\n".join(lines) + "\n"
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
