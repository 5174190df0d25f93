"""``tiertrain estimate``: per-rank memory of a model under a ZeRO layout, line by line with its formula."""
from __future__ import annotations

import argparse
import sys
from typing import Any

from ..tiers import Tier
from .common import HF_CONFIG_HELP, hf_dims


def _estimate_parser() -> argparse.ArgumentParser:
    from ..models.gpt import PRESETS

    p = argparse.ArgumentParser(
        prog="tiertrain estimate", allow_abbrev=False,
        description="Per-rank memory of training a GPT-style model under a ZeRO layout, line by line "
                    "with the formula used (tiertrain.estimate).")
    m = p.add_argument_group("model (a preset, explicit dims, or a parameter count)")
    m.add_argument("--preset", choices=sorted(PRESETS), help="a GPTConfig preset; dims below override it")
    m.add_argument("--layers", type=int, help="transformer blocks (nl)")
    m.add_argument("--hidden", type=int, help="model width (hd)")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--vocab", type=int, help="vocabulary size (default 256)")
    m.add_argument("--seq", type=int, help="sequence length (default 128)")
    m.add_argument("--params", type=int, help="parameter count only (model-state lines only)")
    m.add_argument("--hf-config", metavar="PATH", help=HF_CONFIG_HELP)
    lay = p.add_argument_group("layout")
    lay.add_argument("--dp", type=int, help="data-parallel degree (default 1)")
    lay.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    lay.add_argument("--pp", type=int, help="pipeline-parallel degree (default 1)")
    lay.add_argument("--stage", type=int, help="ZeRO stage 0-3 (default 0)")
    lay.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="compute dtype (default bf16)")
    lay.add_argument("--micro-batch", type=int, help="sequences per micro-batch per rank (default 1)")
    lay.add_argument("--ci", type=int, help="activation checkpoint interval: blocks 0, ci, 2ci, ... are checkpointed "
                                            "(activations.checkpoint_every); 0 = none (default)")
    lay.add_argument("--recompute", choices=["block", "selective"],
                     help="what a checkpointed block recomputes (activations.recompute; default block)")
    lay.add_argument("--tile", type=int, help="memory-centric tiling factor (default 1)")
    lay.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"],
                     help="tier of fp32 master weights and Adam state (default none = device)")
    lay.add_argument("--offload-grads", choices=["none", "cpu", "nvme"],
                     help="tier of the gradient partition (default: same as --offload-optimizer)")
    lay.add_argument("--offload-params", choices=["none", "cpu", "nvme"],
                     help="tier of stage-3 parameter shards (default none = device)")
    lay.add_argument("--offload-checkpoints", choices=["none", "cpu"],
                     help="tier of activation checkpoints (activations.offload; default none = device)")
    lay.add_argument("--ranks-per-node", type=int, help="ranks sharing a node (default: all)")
    lay.add_argument("--accounting", choices=["engine", "paper"],
                     help="engine dtypes (default) or the papers' 2+2+K bytes per parameter")
    lay.add_argument("--bucket-mb", type=float, help="zero.bucket_mb (default 25)")
    lay.add_argument("--prefetch-mb", type=float, help="zero.prefetch_mb at stage 3 (default 0, the CPU default)")
    lay.add_argument("--accumulate-on-device", action="store_true", default=None,
                     help="stages 2-3: count the fp32 gradient accumulators of zero.accumulate_on_device=on "
                          "(a whole fp32 gradient per rank on the device, reduced once per step)")
    ov = p.add_argument_group("process overhead (engine accounting)")
    ov.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="compute device: cpu adds the host allocator's retention of transient bytes (default)")
    ov.add_argument("--probe", metavar="FILE", help="take the overhead measured by `tiertrain probe` from FILE")
    ov.add_argument("--no-overhead", action="store_true", help="tensor bytes only")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def _tier(value: str | None) -> Tier | None:
    return None if value is None else Tier(value)


def cmd_estimate(argv: list[str]) -> int:
    from ..estimate import estimate_from_args, render_table, to_json
    from ..models.gpt import GPTConfig

    a = _estimate_parser().parse_args(argv)
    hf = hf_dims(a, "estimate", ("preset", "layers", "hidden", "heads", "vocab", "params"))
    dims: dict[str, Any] = {}
    if a.preset:
        g = GPTConfig.preset(a.preset)
        dims = dict(n_layers=g.n_layers, hidden=g.hidden, n_heads=g.n_heads, vocab=g.vocab_size,
                    seq_len=g.seq_len, ffn_mult=g.ffn_mult, tie_embeddings=g.tie_embeddings)
    for key, value in (("n_layers", a.layers), ("hidden", a.hidden), ("n_heads", a.heads),
                       ("vocab", a.vocab), ("seq_len", a.seq)):
        if value is not None:
            dims[key] = value
    kwargs: dict[str, Any] = {}
    if hf is not None:
        kwargs["module"] = hf
    elif a.params is not None:
        if dims:
            raise ValueError("estimate: give either --params or model dims (--preset/--layers/...), not both")
        kwargs["params"] = a.params
    else:
        missing = [flag for flag, key in (("--layers", "n_layers"), ("--hidden", "hidden"), ("--heads", "n_heads"))
                   if key not in dims]
        if missing:
            raise ValueError(f"estimate: missing {', '.join(missing)}; give --preset NAME, or "
                             f"--layers, --hidden and --heads (or --params N)")
        dims.setdefault("vocab", GPTConfig.vocab_size)
        dims.setdefault("seq_len", GPTConfig.seq_len)
        kwargs.update(dims)
    grad_tier = a.offload_grads if a.offload_grads is not None else a.offload_optimizer
    kwargs.update(dp=a.dp, tp=a.tp, pp=a.pp, stage=a.stage, precision=a.precision,
                  micro_batch=a.micro_batch, checkpoint_interval=a.ci, tile_factor=a.tile,
                  optimizer_tier=_tier(a.offload_optimizer), grad_tier=_tier(grad_tier),
                  param_tier=_tier(a.offload_params), ranks_per_node=a.ranks_per_node,
                  accounting=a.accounting, bucket_mb=a.bucket_mb, prefetch_mb=a.prefetch_mb,
                  checkpoint_tier=_tier(a.offload_checkpoints), recompute=a.recompute,
                  accumulate_on_device=a.accumulate_on_device,
                  backend="nccl" if a.device == "cuda" else None)
    from ..estimate.overhead import HostOverhead

    if a.no_overhead:
        overhead = HostOverhead.none()
    elif a.probe:
        from ..estimate.probe import HardwareProbe

        pr = HardwareProbe.load(a.probe)
        base = HostOverhead.for_device(a.device)
        overhead = HostOverhead(pr.framework_overhead_bytes if pr.framework_overhead_bytes is not None
                                else base.framework_bytes,
                                base.retention if pr.allocator_retention is None or a.device == "cuda"
                                else pr.allocator_retention, f"probe file {a.probe}")
    else:
        overhead = HostOverhead.for_device(a.device)
    est = estimate_from_args(overhead=overhead, accelerator=a.device == "cuda", **kwargs)
    sys.stdout.write(to_json(est) + "\n" if a.json else render_table(est))
    return 0
