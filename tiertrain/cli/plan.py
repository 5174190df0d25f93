"""``tiertrain plan``: the ZeRO stage, offload tiers, activation checkpointing and tiling (and,
with an accelerator, the tensor/pipeline/data-parallel sizes) that fit, written as a config for
``tiertrain train --config``."""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from .common import HF_CONFIG_HELP, hf_dims, load_train_config


_UNITS = {"": 1, "b": 1, "k": 1e3, "kb": 1e3, "m": 1e6, "mb": 1e6, "g": 1e9, "gb": 1e9, "t": 1e12, "tb": 1e12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str) -> int:
    """'24GiB', '1.5e9', '512MiB', '32GB' (GB = 1e9, GiB = 2^30) -> bytes."""
    import re

    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"{text!r} is not a size: expected e.g. 24GiB, 512MiB, 32GB or a number of bytes")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def _plan_parser() -> argparse.ArgumentParser:
    from ..models.gpt import PRESETS

    p = argparse.ArgumentParser(
        prog="tiertrain plan", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Choose the ZeRO stage, offload tiers, activation checkpointing and tiling that fit a\n"
                    "model on the hardware, by ZeRO-Infinity's placement policy (offload only when memory\n"
                    "is short; optimizer states and gradients first, to the fastest tier with room; then\n"
                    "parameters vs activation checkpoints), print the plan with its predicted memory and\n"
                    "efficiency, and write a config for `tiertrain train --config`.\n\n"
                    "With an accelerator (--layout 3d, the default when the hardware has one) it first chooses\n"
                    "the tensor/pipeline/data-parallel sizes (t, p, d), the micro-batches m and the virtual\n"
                    "stages v by Megatron PTD-P's rules (t within a node, the smallest t·p that fits, tensor\n"
                    "before pipeline, interleaving when the bubble (p-1)/(m·v) exceeds 10%), and prints the\n"
                    "alternatives it rejected and why.",
        epilog="hardware: a probe file (default runs/hardware_probe.json when it exists, from `tiertrain probe`)\n"
               "and/or stated figures, which override it. Exit status 1 when nothing fits.\n\n"
               "a stated machine (no GPU needed here):\n"
               "  tiertrain plan --layers 32 --hidden 4096 --heads 32 --vocab 32000 --seq 2048 --no-bias \\\n"
               "      --nodes 2 --nproc 8 --gpu-memory 80GiB --ram 1TiB --global-batch 512 --out plan.yaml")
    m = p.add_argument_group("model (a preset, explicit dims, or the model section of a train config)")
    m.add_argument("--preset", choices=sorted(PRESETS), help="a GPTConfig preset; dims below override it")
    m.add_argument("--config", metavar="FILE", help="a train config: its model, precision and micro-batch")
    m.add_argument("--hf-config", metavar="PATH", help=HF_CONFIG_HELP + "; plans data parallelism (--layout dp)")
    m.add_argument("--layers", type=int, help="transformer blocks")
    m.add_argument("--hidden", type=int, help="model width")
    m.add_argument("--heads", type=int, help="attention heads")
    m.add_argument("--vocab", type=int, help="vocabulary size (default 256)")
    m.add_argument("--seq", type=int, help="sequence length (default 128)")
    m.add_argument("--ffn-mult", type=int, help="MLP width multiple (default 4)")
    m.add_argument("--no-bias", action="store_true", help="linear layers without biases (model.bias: false)")
    m.add_argument("--micro-batch", type=int, help="sequences per micro-batch per rank (default 8, or the config's)")
    m.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="compute dtype (default fp32, or the config's)")
    h = p.add_argument_group("hardware")
    h.add_argument("--probe", metavar="FILE", help="probe file (default runs/hardware_probe.json if present)")
    h.add_argument("--nproc", type=int, help="ranks per node (default: number of GPUs, else 2)")
    h.add_argument("--nodes", type=int, default=1, help="nodes (default 1)")
    h.add_argument("--ram", metavar="SIZE", help="host RAM per node the job may use (default: MemAvailable)")
    h.add_argument("--gpu-memory", metavar="SIZE", help="memory per accelerator (default: probed; none on CPU)")
    h.add_argument("--nvme", metavar="SIZE", help="free NVMe swap space per node (default: probed)")
    h.add_argument("--swap-dir", metavar="DIR", help="the NVMe tier's directory (written as zero.nvme_path)")
    h.add_argument("--peak-tflops", type=float, help="achievable compute per rank, TFLOP/s")
    h.add_argument("--h2d-gbps", type=float, help="host<->device bandwidth per rank, GB/s")
    h.add_argument("--nvme-gbps", type=float, help="NVMe bandwidth per node, GB/s")
    h.add_argument("--reserve", type=float, default=0.10, help="fraction of each tier left free (default 0.1)")
    pol = p.add_argument_group("policy")
    pol.add_argument("--stages", default="0,1,2,3", help="ZeRO stages allowed (default 0,1,2,3)")
    pol.add_argument("--tiers", default="cpu,nvme", help="offload tiers allowed (default cpu,nvme)")
    pol.add_argument("--no-checkpointing", action="store_true", help="never recompute activations")
    pol.add_argument("--max-tile", type=int, default=16, help="largest tiling factor (default 16; 1 = no tiling)")
    pol.add_argument("--layout", choices=["auto", "3d", "dp"], default="auto",
                     help="3d: choose tensor/pipeline/data sizes (t, p, d), micro-batches m and virtual stages v by "
                          "Megatron PTD-P's rules (tiertrain/estimate/layout3d.py), falling back to the ZeRO ladder "
                          "at t=p=1 when no 3D layout fits the devices; dp: the ZeRO ladder over data parallelism "
                          "only; auto (default): 3d when the hardware has an accelerator (probed or --gpu-memory), "
                          "else dp")
    p3 = p.add_argument_group("3D layout (--layout 3d; defaults there: --micro-batch 1, --precision bf16)")
    p3.add_argument("--global-batch", type=int, metavar="B",
                    help="samples per optimizer step (default: the config's batch.global_batch_size)")
    p3.add_argument("--intra-node-gbps", type=float,
                    help="per-rank collective bandwidth within a node, GB/s (default 150: NVLink)")
    p3.add_argument("--inter-node-gbps", type=float,
                    help="per-rank bandwidth across nodes, GB/s (default 25: one 200 Gb/s HDR adapter per GPU)")
    p3.add_argument("--interleave-above", type=float,
                    help="bubble fraction above which interleaving (v > 1) is used (default 0.1)")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    p.add_argument("--out", metavar="FILE", default="runs/plan.yaml",
                   help="where to write the config (default runs/plan.yaml; '' to skip)")
    return p


def hardware_from_args(a: argparse.Namespace):
    """Hardware for the planner: the probe file (if any), overridden by stated figures."""
    from .. import launch
    from ..estimate.hardware import Hardware
    from ..estimate.probe import HardwareProbe, read_meminfo

    ranks = a.nproc if a.nproc is not None else launch.default_nproc()
    if ranks < 1:
        raise ValueError(f"--nproc={ranks} is invalid: expected >= 1")
    path = a.probe or ("runs/hardware_probe.json" if os.path.isfile("runs/hardware_probe.json") else None)
    if path:
        hw = Hardware.from_probe(HardwareProbe.load(path), ranks_per_node=ranks, nodes=a.nodes, reserve=a.reserve)
        hw.source = f"probe file {path}"
    else:
        mem = read_meminfo()
        hw = Hardware(ranks_per_node=ranks, nodes=a.nodes, reserve=a.reserve,
                      host_memory=mem.get("MemAvailable", mem.get("MemTotal", 0)), source="this machine's MemAvailable")
    stated = []
    if a.ram:
        hw.host_memory = parse_bytes(a.ram)
        stated.append("RAM")
    if a.gpu_memory:
        hw.device_memory = parse_bytes(a.gpu_memory)
        stated.append("GPU memory")
    if a.nvme:
        hw.nvme_bytes = parse_bytes(a.nvme)
        stated.append("NVMe")
    if a.swap_dir:
        hw.swap_dir = a.swap_dir
        if not a.nvme:
            import shutil

            hw.nvme_bytes = shutil.disk_usage(a.swap_dir).free
    if a.peak_tflops:
        hw.peak_flops = a.peak_tflops * 1e12
        stated.append("peak")
    if a.h2d_gbps:
        hw.host_device_bw = a.h2d_gbps * 1e9
    if a.nvme_gbps:
        hw.nvme_bw = a.nvme_gbps * 1e9
    if stated:
        hw.source += " + stated " + ", ".join(stated)
    return hw.validate()


def _config_check(values: dict) -> str | None:
    """None when this version's train config accepts the plan's sections, else the error."""
    from ..config import ConfigError, from_dict
    from ..train import TrainConfig

    try:
        from_dict(TrainConfig, values).validate()
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


def _config_check_3d(values: dict, world_size: int) -> str | None:
    """None when the train config accepts a 3D plan's sections and its process grid and
    batch resolve on ``world_size`` ranks (what ``tiertrain train`` checks first), else the error."""
    from ..config import ConfigError, from_dict
    from ..train import TrainConfig

    try:
        cfg = from_dict(TrainConfig, values).validate()
        _, dp, _ = cfg.parallel.resolve(world_size)
        cfg.batch.resolve(dp)
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


def _cmd_plan_3d(a: argparse.Namespace, model: Any, hw: Any, micro: int | None, precision: str | None,
                 config_global_batch: int, ladder: dict[str, Any]) -> int:
    """`tiertrain plan` with the 3D search (tiertrain.estimate.layout3d): the chosen (t, p, d, m,
    v), the rejected alternatives, and the config; exit status 1 when nothing fits."""
    from ..estimate.cost3d import Interconnect, Policy3D
    from ..estimate.layout3d import plan3d, plan3d_to_json, render_plan3d

    if hw.device_memory is None:
        raise ValueError("--layout 3d needs an accelerator's memory: give --gpu-memory SIZE (e.g. 80GiB) for a "
                         "stated machine, or a probe file of one")
    global_batch = a.global_batch or config_global_batch
    if not global_batch:
        raise ValueError("plan --layout 3d: missing --global-batch B (samples per optimizer step; it sets the "
                         "micro-batches m = B / (d · micro-batch)), or a --config with batch.global_batch_size; "
                         "--layout dp plans data parallelism only and needs none")
    net = Interconnect()
    if a.intra_node_gbps is not None:
        net.intra_node_bw = a.intra_node_gbps * 1e9
    if a.inter_node_gbps is not None:
        net.inter_node_bw = a.inter_node_gbps * 1e9
    policy = Policy3D(recompute=ladder["checkpointing"])
    if a.interleave_above is not None:
        policy.interleave_above = a.interleave_above
    result = plan3d(model, hw, global_batch=global_batch, micro_batch=micro or 1, precision=precision or "bf16",
                    interconnect=net, policy=policy, ladder=ladder)
    rejected = _config_check_3d(result.config_dict(), hw.ranks)
    run = (f"run on each of the {hw.nodes} node(s): torchrun --nnodes {hw.nodes} --nproc-per-node "
           f"{hw.ranks_per_node} ... -m tiertrain.cli train --config {a.out}")
    return _emit_plan(a, result, rejected, plan3d_to_json, render_plan3d, run)


def _emit_plan(a, result, rejected: str | None, to_json, render, run: str) -> int:
    """Write the plan's config (--out), print it (or its JSON, --json); exit status 0 when it fits."""
    if rejected:
        result.notes.append(f"this version's train config does not accept the plan: {rejected}")
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        with open(a.out, "w") as f:
            f.write(result.to_yaml())
    if a.json:
        data = json.loads(to_json(result))
        data["config_file"] = a.out or None
        data["config_accepted"] = rejected is None
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
    else:
        sys.stdout.write(render(result))
        if a.out:
            if not result.fits:
                print(f"config of the most frugal layout written to {a.out} (for reference: it does not fit)")
            elif rejected:
                print(f"config written to {a.out} (not accepted by this version's train config)")
            else:
                print(f"config written to {a.out} ({run})")
    return 0 if result.fits else 1


def cmd_plan(argv: list[str]) -> int:
    from ..estimate import ModelDims
    from ..estimate.plan import plan, plan_to_json, render_plan
    from ..models.gpt import GPTConfig

    a = _plan_parser().parse_args(argv)
    hf = hf_dims(a, "plan", ("preset", "layers", "hidden", "heads", "vocab", "ffn_mult", "no_bias"))
    micro, precision = a.micro_batch, a.precision
    config_global_batch = 0
    if a.config:
        cfg = load_train_config(a.config, [])
        g = cfg.model
        micro = micro or cfg.batch.micro_batch_size
        precision = precision or cfg.precision.dtype
        config_global_batch = cfg.batch.global_batch_size
    else:
        g = GPTConfig.preset(a.preset) if a.preset else None
    dims: dict[str, Any] = {}
    if g is not None:
        dims = dict(n_layers=g.n_layers, hidden=g.hidden, n_heads=g.n_heads, vocab=g.vocab_size,
                    seq_len=g.seq_len, ffn_mult=g.ffn_mult, tie_embeddings=g.tie_embeddings,
                    dropout=float(g.dropout) > 0, bias=g.bias)
    for key, value in (("n_layers", a.layers), ("hidden", a.hidden), ("n_heads", a.heads), ("vocab", a.vocab),
                       ("seq_len", a.seq), ("ffn_mult", a.ffn_mult)):
        if value is not None:
            dims[key] = value
    missing = [f for f, k in (("--layers", "n_layers"), ("--hidden", "hidden"), ("--heads", "n_heads")) if k not in dims]
    if hf is not None:
        missing = []
    if missing:
        raise ValueError(f"plan: missing {', '.join(missing)}; give --preset NAME, --config FILE, or "
                         f"--layers, --hidden and --heads")
    dims.setdefault("vocab", GPTConfig.vocab_size)
    dims.setdefault("seq_len", GPTConfig.seq_len)
    if a.no_bias:
        dims["bias"] = False
    model = hf if hf is not None else ModelDims(**dims).validate()
    try:
        stages = [int(x) for x in a.stages.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--stages={a.stages!r} is invalid: expected e.g. 0,1,2,3") from None
    if not stages or any(s not in (0, 1, 2, 3) for s in stages):
        raise ValueError(f"--stages={a.stages!r} is invalid: expected stages among 0,1,2,3")
    tiers = [t.strip() for t in a.tiers.split(",") if t.strip()]
    if any(t not in ("cpu", "nvme") for t in tiers):
        raise ValueError(f"--tiers={a.tiers!r} is invalid: expected a subset of cpu,nvme")
    if a.max_tile < 1:
        raise ValueError(f"--max-tile={a.max_tile} is invalid: expected >= 1")
    hw = hardware_from_args(a)
    if hf is not None and a.layout == "3d":
        raise ValueError(f"plan --layout 3d with --hf-config {a.hf_config!r}: the 3D search splits tiertrain's GPT "
                         "only; a Hugging Face model is planned with --layout dp (data parallelism + ZeRO)")
    if hf is None and (a.layout == "3d" or (a.layout == "auto" and hw.device_memory is not None)):
        return _cmd_plan_3d(a, model, hw, micro, precision, config_global_batch,
                            dict(stages=stages, tiers=tiers, checkpointing=not a.no_checkpointing,
                                 tile_factors=[t for t in (1, 2, 4, 8, 16, 32, 64) if t <= a.max_tile]))
    result = plan(model, hw, micro_batch=micro or 8, precision=precision or "fp32", stages=stages, tiers=tiers,
                  checkpointing=not a.no_checkpointing,
                  tile_factors=[t for t in (1, 2, 4, 8, 16, 32, 64) if t <= a.max_tile])
    rejected = _config_check(result.config_dict())
    return _emit_plan(a, result, rejected, plan_to_json, render_plan,
                      f"run: tiertrain train --config {a.out} --nproc {hw.ranks_per_node}")
