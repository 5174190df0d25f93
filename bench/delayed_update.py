"""Step time with and without ZeRO-Offload's one-step delayed update (zero.delayed_update).

One process, ZeRO stage 2, zero.offload_optimizer=cpu, the same GPT (the ``bench`` preset
of tiertrain.models.gpt, ~40M parameters, by default at a short sequence so that the CPU
AdamW update is a noticeable share of the step) trained twice in one run: synchronously
and with DPU (the update of step t in a background thread during step t+1's forward and
backward). The two engines alternate in rounds of ``--steps-per-round`` steps, so drifts in
machine load hit both alike. Reported: median step time of each (forward + backward +
step, measured from one train_batch return to the next), their ratio, the median duration
of the update itself (timed inside the worker thread), and the median time the main thread
still waited for it at the next boundary.

    python bench/delayed_update.py --out bench/results/delayed_update.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

import tiertrain
from _common import machine_lines
from tiertrain.config import from_dict
from tiertrain.models.gpt import GPT, GPTConfig


def build(delayed: bool, args) -> tiertrain.Engine:
    cfg = from_dict(tiertrain.Config, {
        "zero": {"stage": 2, "offload_optimizer": "cpu", "delayed_update": delayed, "delayed_update_warmup": 2},
        "batch": {"micro_batch_size": args.micro_batch},
        "optimizer": {"lr": 1e-4},
        "schedule": {"warmup_steps": 0},
    }).validate()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset(args.preset, seq_len=args.seq_len))
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    engine.update_times, engine.wait_times = [], []
    if delayed:
        update, wait = engine.update._update, engine.update.wait

        def timed_update():
            start = time.perf_counter()
            update()
            engine.update_times.append(time.perf_counter() - start)

        def timed_wait(agree):
            start = time.perf_counter()
            wait(agree)
            engine.wait_times.append(time.perf_counter() - start)

        engine.update._update, engine.update.wait = timed_update, timed_wait
    else:
        step = engine.update.optimizer.step

        def timed_step(*a, **k):
            start = time.perf_counter()
            step(*a, **k)
            engine.update_times.append(time.perf_counter() - start)

        engine.update.optimizer.step = timed_step
    return engine


def batches(args, vocab: int):
    g = torch.Generator().manual_seed(1)
    while True:
        ids = torch.randint(0, vocab, (args.micro_batch, args.seq_len + 1), generator=g)
        yield {"input_ids": ids[:, :-1], "labels": ids[:, 1:]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="bench")
    ap.add_argument("--seq-len", type=int, default=32)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--steps-per-round", type=int, default=5)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load_before = os.getloadavg()

    engines = {"synchronous": build(False, args), "delayed (DPU)": build(True, args)}
    params = sum(p.numel() for p in engines["synchronous"].module.parameters())
    data = {name: batches(args, engines[name].module.config.vocab_size) for name in engines}
    times = {name: [] for name in engines}
    for name, engine in engines.items():  # warm-up: past the DPU warmup, first-touch of the moments
        for _ in range(4):
            engine.train_batch(data[name])
        engine.update_times.clear()
        engine.wait_times.clear()
    for _ in range(args.rounds):
        for name, engine in engines.items():
            last = time.perf_counter()
            for _ in range(args.steps_per_round):
                engine.train_batch(data[name])
                now = time.perf_counter()
                times[name].append(now - last)
                last = now
    for engine in engines.values():
        engine.close()
    load_after = os.getloadavg()

    med = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    upd = {name: statistics.median(e.update_times) * 1e3 for name, e in engines.items()}
    waited = statistics.median(engines["delayed (DPU)"].wait_times) * 1e3
    ratio = med["delayed (DPU)"] / med["synchronous"]
    command = "python bench/delayed_update.py " + " ".join(sys.argv[1:])
    lines = [
        "# One-step delayed update (DPU): step time with and without",
        "",
        f"Command: `{command}`",
        "",
        (f"Machine: {'; '.join(machine_lines())}; {args.threads} torch "
        f"threads; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}."),
        (f"Model: GPT preset `{args.preset}` ({params / 1e6:.1f}M parameters), seq_len {args.seq_len}, micro-batch "
        f"{args.micro_batch}; one process, zero.stage 2, offload_optimizer=cpu, fp32. "
        f"{args.rounds} rounds × {args.steps_per_round} steps per engine, alternating, after 4 warm-up steps each."),
        "",
        "| mode | median step (ms) | median CPU update (ms) | update share of the synchronous step |",
        "|---|---|---|---|",
        (f"| synchronous | {med['synchronous']:.1f} | {upd['synchronous']:.1f} | "
        f"{upd['synchronous'] / med['synchronous']:.0%} |"),
        f"| delayed (DPU) | {med['delayed (DPU)']:.1f} | {upd['delayed (DPU)']:.1f} (in the background) | |",
        "",
        (f"**DPU / synchronous step time: {ratio:.3f}** (median wait for the background update at the next "
        f"boundary: {waited:.1f} ms)."),
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
