"""Selective against full-block activation checkpointing (issue 37, item 4), on tiertrain's GPT.

For each mode (no checkpointing, every block recomputed whole, every block recomputed
selectively) one process runs forward + backward of the same model on the same micro-batch
and reports: the median wall time and its ratio to no checkpointing (measured in the same
run), backward's FLOPs (torch's FlopCounterMode) as a ratio to no checkpointing's, and the
bytes the blocks hold between forward and backward, measured (saved-tensor hooks outside the
blocks for none; the checkpointing's own count otherwise) and as the estimator predicts them
(tiertrain.estimate.activations.gpt_activation_bytes).

    python bench/selective_checkpointing.py --out bench/results/selective_checkpointing.md
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from _common import machine_lines, print_and_write
from tiertrain.config import ActivationConfig
from tiertrain.engine import default_loss
from tiertrain.estimate.dims import ModelDims
from tiertrain.estimate.activations import gpt_activation_bytes
from tiertrain.models.gpt import GPT, GPTConfig
from tiertrain.offload.activations import apply_activation_checkpointing, checkpoint_memory

MODES = ("none", "block", "selective")


def build(mode: str, config: GPTConfig) -> GPT:
    torch.manual_seed(0)
    model = GPT(config)
    if mode != "none":
        apply_activation_checkpointing(model, ActivationConfig(checkpoint_every=1, recompute=mode))
    return model


def saved_outside_checkpoints(model: nn.Module, batch: dict) -> tuple[torch.Tensor, int]:
    """The loss, and the bytes autograd saved outside the checkpointed regions (each
    storage once, parameters excluded): everything for an unmodified model."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen.setdefault(storage.data_ptr(), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = default_loss(model, batch)
    return loss, sum(seen.values())


def run(mode: str, config: GPTConfig, batch: dict, args) -> dict:
    model = build(mode, config)
    times = []
    for i in range(args.warmup + args.steps):
        start = time.perf_counter()
        default_loss(model, batch).backward()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)
        model.zero_grad(set_to_none=True)
    loss, outside = saved_outside_checkpoints(model, batch)
    held = checkpoint_memory(model).bytes
    with FlopCounterMode(display=False) as flops:
        loss.backward()
    return {"time": statistics.median(times), "outside": outside, "held": held,
            "backward_flops": flops.get_total_flops()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    config = GPTConfig(vocab_size=8192, seq_len=args.seq, n_layers=args.layers, hidden=args.hidden,
                       n_heads=args.heads)
    ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids.roll(-1, 1)}  # (next-token labels)
    load_before = os.getloadavg()
    results = {mode: run(mode, config, batch, args) for mode in MODES}
    head = results["block"]["outside"]  # with every block checkpointed, the hooks see the rest of the model only
    results["none"]["held"] = results["none"]["outside"] - head
    acts = gpt_activation_bytes(ModelDims.from_gpt_config(config), args.batch, 4)
    predicted = {"none": acts.block * args.layers, "block": acts.checkpoint * args.layers,
                 "selective": (acts.checkpoint + acts.kept_at(0)) * args.layers}
    base = results["none"]
    lines = ["# Selective against full-block activation checkpointing", "",
             f"Command: `python {' '.join(sys.argv)}`", "",
             f"Machine: {'; '.join(machine_lines())}; torch at {torch.get_num_threads()} threads; load average "
             f"before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}.",
             f"Model: tiertrain GPT, {args.layers} blocks × hidden {args.hidden}, {args.heads} heads, "
             f"sequence {args.seq}, micro-batch {args.batch}, fp32, one process; every block checkpointed "
             f"(checkpoint_every=1); forward + backward, median of {args.steps} after {args.warmup}.", "",
             "| recompute | forward + backward (ms) | time / none | backward FLOPs / none | held by the blocks "
             "(MiB, measured) | estimator (MiB) |",
             "|---|---|---|---|---|---|"]
    for mode, r in results.items():
        lines.append(f"| {mode if mode != 'none' else 'no checkpointing'} | {r['time'] * 1e3:.0f} | "
                     f"**{r['time'] / base['time']:.2f}** | {r['backward_flops'] / base['backward_flops']:.2f} | "
                     f"{r['held'] / 2**20:.1f} | {predicted[mode] / 2**20:.1f} |")
    print_and_write("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
