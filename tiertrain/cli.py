"""The ``tiertrain`` command: train, show the resolved config, estimate memory, probe hardware.

    tiertrain train [--config FILE] [--nproc N] [--timeout S] [--resume DIR] [--section.key VALUE ...]
    tiertrain config [--config FILE] [--section.key VALUE ...]
    tiertrain estimate (--preset NAME | --layers L --hidden H --heads A [--vocab V --seq S]) [...]
    tiertrain probe [--swap-dir DIR] [--quick] [--out FILE]
    tiertrain plan (--preset NAME | --layers L --hidden H --heads A | --config FILE) [hardware] [--json] [--out FILE]

Invalid configurations print one ``error: ...`` line to stderr and exit with status 2; a
refused checkpoint or a diverged run (CheckpointError, NonFiniteError), in this process or
in a worker rank, one line and status 1 (each error's class says how it is reported:
tiertrain.errors.TiertrainError). ``tiertrain --debug <command>`` adds the traceback.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import traceback
from typing import Any

import yaml

from .config import ConfigError, field_docs, load
from .errors import TiertrainError
from .tiers import Tier

USAGE = """\
usage: tiertrain <command> [options]

commands:
  train      train a GPT (default: ~1.85M parameters, bundled corpus, 2 local processes) or a
             Hugging Face causal LM (--model.hf DIR) on your data (--data FILE)
  config     print the resolved training config as YAML, each field with its documentation
  estimate   per-rank memory of a model under a ZeRO layout (formulas of ZeRO / ZeRO-Infinity)
  probe      measure this machine (RAM, memory and disk bandwidth, GPU) and save it as JSON
  plan       choose ZeRO stage, offload tiers, activation checkpointing and tiling that fit,
             and write a config for `tiertrain train --config`
  export     write a saved checkpoint as a Hugging Face checkpoint (safetensors, config.json),
             offline: one process, one tensor in memory at a time
  clean      remove what killed runs left: abandoned launch directories with their swap files,
             unfinished checkpoint saves and unlocked swap directories in the DIRs given
  plot       draw a run's metrics (loss and eval loss, throughput, memory per tier against
             the estimator's prediction, step time) as PNGs

Every field of the training config can be overridden on the command line with
--section.key VALUE (or --section.key=VALUE), e.g.

  tiertrain train --zero.stage 3 --precision.dtype bf16 --model.n_layers 4 --steps 50
  tiertrain train --config examples/gpt_small.yaml --nproc 4
  tiertrain train --model.hf DIR --data corpus.jsonl --eval.every 20 --zero.stage 3
  tiertrain config --zero.stage 2 > job.yaml

Multi-node (or any torchrun launch): run on every node
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
      -m tiertrain.cli train --zero.stage 3 ...

`tiertrain <command> --help` describes a command's options; `tiertrain --debug <command>`
shows the traceback behind an error.
"""

_OVERRIDES_HELP = """\
overrides:
  --section.key VALUE   set any field of the config (values are read as YAML scalars), e.g.
                        --zero.stage 3 --precision.dtype bf16 --model.n_layers 4 --steps 50
                        --optimizer.betas [0.9,0.99] --logging.metrics_file ''
  sections: steps, seed, eval, model, data, precision, optimizer, schedule, batch,
            parallel, zero, checkpoint, logging  (`tiertrain config` lists every field with its doc)
"""


# --------------------------------------------------------------------------- helpers


def _split_args(argv: list[str], takes_value: dict[str, bool]) -> tuple[list[str], list[str]]:
    """Separate the command's own options (names in takes_value, plus -h/--help) from
    --section.key overrides, keeping each group's order."""
    own, overrides = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        name = arg.split("=", 1)[0]
        if arg in ("-h", "--help"):
            own.append(arg)
            i += 1
        elif name in takes_value:
            own.append(arg)
            if takes_value[name] and "=" not in arg and i + 1 < len(argv):
                own.append(argv[i + 1])
                i += 1
            i += 1
        else:
            overrides.append(arg)
            i += 1
    return own, overrides


def load_train_config(path: str | None, overrides: list[str], deepspeed: str | None = None):
    """TrainConfig from an optional YAML/TOML file, an optional DeepSpeed config
    (tiertrain/deepspeed_config.py) and --section.key overrides, in that order (validated)."""
    return load_with_deepspeed(path, overrides, deepspeed)[0]


def load_with_deepspeed(path: str | None, overrides: list[str], deepspeed: str | None):
    """(load_train_config's TrainConfig, what became of each key of the DeepSpeed config)."""
    from .train import TrainConfig

    if deepspeed is None:
        return load(TrainConfig, path, overrides), []
    from .config import from_dict, merge, parse_overrides, read_file
    from .deepspeed_config import from_deepspeed

    base, extra = read_file(path) if path else {}, parse_overrides(overrides)
    dtype = (merge(base, extra).get("precision") or {}).get("dtype", "fp32")  # (where the file says "auto")
    translation = from_deepspeed(deepspeed, dtype=dtype)
    data = merge(merge(base, translation.values), extra)
    cfg = from_dict(TrainConfig, data)
    cfg.validate()
    translation.finish(cfg)
    return cfg, translation.lines()


def _all_docs(cls: type) -> dict[str, str]:
    """Field docs of a dataclass including those of its dataclass bases."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    return docs


def _scalar(value: Any) -> str:
    if isinstance(value, tuple):
        value = list(value)
    if isinstance(value, Tier):
        value = value.config_name
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    if text.endswith("\n..."):
        text = text[: -len("\n...")]
    return text


_TOP_ORDER = ("steps", "seed", "model", "data")


def render_config(obj: Any, indent: int = 0) -> list[str]:
    """A dataclass as YAML lines, each field preceded by its docstring as a comment."""
    docs = _all_docs(type(obj))
    names = [f.name for f in dataclasses.fields(obj)]
    if indent == 0:
        names = [n for n in _TOP_ORDER if n in names] + [n for n in names if n not in _TOP_ORDER]
    pad = "  " * indent
    lines: list[str] = []
    for name in names:
        value = getattr(obj, name)
        doc = docs.get(name, "")
        if dataclasses.is_dataclass(value) and indent == 0 and lines:
            lines.append("")
        for line in doc.splitlines():
            lines.append(f"{pad}# {line.strip()}".rstrip())
        if dataclasses.is_dataclass(value):
            lines.append(f"{pad}{name}:")
            lines.extend(render_config(value, indent + 1))
        else:
            lines.append(f"{pad}{name}: {_scalar(value)}")
    return lines


def _error(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


# --------------------------------------------------------------------------- train


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tiertrain train", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="tiertrain train [-h] [--config FILE] [--deepspeed ds.json] [--nproc N] [--timeout S] [--resume DIR] "
              "[--data PATH] [--section.key VALUE ...]",
        description="Train a GPT, or a Hugging Face causal LM (--model.hf DIR), with the tiertrain engine.\n"
                    "With no options: the default job (see `tiertrain config`) on 2 local gloo processes\n"
                    "(one per GPU with CUDA).",
        epilog=_OVERRIDES_HELP + "\nmulti-node (run on every node; --nproc is then ignored):\n"
               "  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\\n"
               "      -m tiertrain.cli train ...")
    p.add_argument("--config", metavar="FILE", help="YAML or TOML file with config sections")
    p.add_argument("--deepspeed", metavar="FILE",
                   help="a DeepSpeed JSON config, translated key by key (docs/deepspeed.md; refused keys are "
                        "named); --config values come first, --section.key overrides after")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="local processes to start (default: number of GPUs, else 2; 1 runs in this process)")
    from .comm import DEFAULT_TIMEOUT_S

    p.add_argument("--timeout", type=float, metavar="S", default=None,
                   help="seconds any collective, pipeline transfer or swap IO may wait before the run fails "
                        f"(default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--resume", metavar="DIR", default=None,
                   help="continue the run checkpointed in DIR (its newest committed checkpoint) at this "
                        "command's --nproc, parallel.* and zero.* (resharded on load); sets checkpoint.dir=DIR "
                        "and checkpoint.resume=true")
    p.add_argument("--data", metavar="PATH", default=None,
                   help="the data to train on (sets data.path): .npy/.bin token arrays, .txt/.jsonl text, a "
                        "datasets directory")
    return p


def _say(lines: list[str]) -> None:
    """Notes for the user, once (rank 0 under torchrun)."""
    if lines and int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(f"tiertrain: {line}" for line in lines), file=sys.stderr)


def cmd_train(argv: list[str]) -> int:
    from . import launch
    from .train import check_launch, keep_global_batch, run_training

    own, overrides = _split_args(argv, {"--config": True, "--nproc": True, "--timeout": True, "--resume": True,
                                        "--data": True, "--deepspeed": True})
    args = _train_parser().parse_args(own)
    timeout = args.timeout if args.timeout is not None else launch.DEFAULT_TIMEOUT_S
    if not (math.isfinite(timeout) and timeout > 0):  # (NaN passes `<= 0`: it compares false)
        raise ConfigError(f"--timeout={timeout} is invalid: expected a finite number of seconds > 0")
    if args.resume is not None:
        _check_resumable(args.resume)
        overrides = [*overrides, "--checkpoint.dir", args.resume, "--checkpoint.resume", "true"]
    if args.data is not None:
        overrides = [*overrides, "--data.path", args.data]
    cfg, fates = load_with_deepspeed(args.config, overrides, args.deepspeed)
    if fates:
        _say([f"the DeepSpeed config {args.deepspeed}, key by key:\n  " + "\n  ".join(fates)])

    if launch.under_torchrun():
        if args.nproc is not None:
            print("tiertrain: --nproc is ignored under torchrun (WORLD_SIZE is set)", file=sys.stderr)
        _say(keep_global_batch(cfg, int(os.environ["WORLD_SIZE"])))
        check_launch(cfg, int(os.environ["WORLD_SIZE"]))
        launch.run(run_training, cfg, timeout=timeout)
        return 0

    nproc = args.nproc if args.nproc is not None else launch.default_nproc()
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} is invalid: expected >= 1")
    _say(keep_global_batch(cfg, nproc))
    check_launch(cfg, nproc)
    if nproc == 1:
        launch.run(run_training, cfg, timeout=timeout)  # alone, with the run's timeout and SIGTERM handling
        return 0
    launch.launch_local(run_training, nproc, cfg, timeout=timeout)  # (a WorkerFailure is reported by main)
    return 0


def _check_resumable(directory: str) -> None:
    """--resume DIR needs a committed checkpoint in DIR (a ConfigError naming DIR otherwise)."""
    from .checkpoint import CheckpointError, find_committed

    if not os.path.isdir(directory):
        raise ConfigError(f"--resume={directory!r} is invalid: no such directory (expected the checkpoint.dir "
                          f"of an earlier run)")
    try:
        find_committed(directory)
    except CheckpointError as e:
        raise ConfigError(f"--resume={directory!r} is invalid: {e} (expected the checkpoint.dir of an earlier "
                          f"run)") from None


def _record_for_torchrun(exc: BaseException) -> None:
    """Under torchrun, write the failure to the error file torchrun gives each rank
    (TORCHELASTIC_ERROR_FILE, torch.distributed.elastic's own error handler), so that its
    summary shows this message instead of an exit code and "error_file: <N/A>"."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)
    except Exception:  # noqa: BLE001 - the report is best effort; the failure itself is printed below
        pass


def _user_error_code(exc: BaseException) -> int | None:
    """The exit status of a one-line report of exc (TiertrainError.exit_code); None when exc
    is a failure of the program, reported with its traceback."""
    return exc.exit_code if isinstance(exc, TiertrainError) else None


def _report_worker_failure(failure, debug: bool) -> int:
    """A worker rank's failure (launch.WorkerFailure): a user error as its one line, anything
    else (or everything with --debug) with the rank's traceback and the other ranks' notes."""
    code = failure.exit_code
    if code is None or debug:
        if failure.details:
            print(failure.details.rstrip(), file=sys.stderr)
        for other in failure.others:
            print(f"note: also failed: {other}", file=sys.stderr)
    if code is not None:
        return _error(failure.message, code=code)
    kind = f"{failure.exc_type}: " if failure.exc_type else ""
    return _error(f"rank {failure.rank} failed: {kind}{failure.message}", code=1)


# --------------------------------------------------------------------------- config


def cmd_config(argv: list[str]) -> int:
    own, overrides = _split_args(argv, {"--config": True, "--from-deepspeed": True})
    p = argparse.ArgumentParser(
        prog="tiertrain config", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="tiertrain config [-h] [--config FILE] [--from-deepspeed ds.json] [--section.key VALUE ...]",
        description="Print the resolved training config (defaults < --config file < DeepSpeed config <\n"
                    "overrides) as YAML, each field with its documentation; the output is a valid --config file.",
        epilog=_OVERRIDES_HELP)
    p.add_argument("--config", metavar="FILE", help="YAML or TOML file with config sections")
    p.add_argument("--from-deepspeed", metavar="FILE", help="a DeepSpeed JSON config (docs/deepspeed.md)")
    args = p.parse_args(own)
    cfg, fates = load_with_deepspeed(args.config, overrides, args.from_deepspeed)
    if fates:
        print(f"# from the DeepSpeed config {args.from_deepspeed}, key by key:")
        print("\n".join(f"#   {line}" for line in fates))
    print("# tiertrain training config (resolved); use with: tiertrain train --config FILE")
    print("\n".join(render_config(cfg)))
    return 0


# --------------------------------------------------------------------------- estimate


def _estimate_parser() -> argparse.ArgumentParser:
    from .models.gpt import PRESETS

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
    m.add_argument("--hf-config", metavar="PATH", help=_HF_CONFIG_HELP)
    lay = p.add_argument_group("layout")
    lay.add_argument("--dp", type=int, help="data-parallel degree (default 1)")
    lay.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    lay.add_argument("--pp", type=int, help="pipeline-parallel degree (default 1)")
    lay.add_argument("--stage", type=int, help="ZeRO stage 0-3 (default 0)")
    lay.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="compute dtype (default bf16)")
    lay.add_argument("--micro-batch", type=int, help="sequences per micro-batch per rank (default 1)")
    lay.add_argument("--ci", type=int, help="activation checkpoint interval: blocks 0, ci, 2ci, ... are checkpointed "
                                            "(activations.checkpoint_every); 0 = none (default)")
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
    ov = p.add_argument_group("process overhead (engine accounting)")
    ov.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                    help="compute device: cpu adds the host allocator's retention of transient bytes (default)")
    ov.add_argument("--probe", metavar="FILE", help="take the overhead measured by `tiertrain probe` from FILE")
    ov.add_argument("--no-overhead", action="store_true", help="tensor bytes only")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


_HF_CONFIG_HELP = ("a Hugging Face config.json (or its directory): any model of a modelled family (llama, "
                   "mistral, qwen2, gpt2, bert, roberta, t5, bart), counted exactly on the meta device, "
                   "activations per block; --seq sets the tokens per sequence (default: the config's "
                   "max_position_embeddings)")


def _hf_dims(a: argparse.Namespace, command: str, dim_flags: tuple[str, ...]):
    """The HFModelDims of ``--hf-config`` (None without it); ValueError when GPT dims are
    also given."""
    if not a.hf_config:
        return None
    given = [f"--{f.replace('_', '-')}" for f in dim_flags if getattr(a, f, None) not in (None, False)]
    if given:
        raise ValueError(f"{command}: --hf-config describes the model; drop {', '.join(given)} (or drop --hf-config)")
    from .estimate.modules import dims_of_hf_config

    return dims_of_hf_config(a.hf_config, a.seq)


def _tier(value: str | None) -> Tier | None:
    return None if value is None else Tier(value)


def cmd_estimate(argv: list[str]) -> int:
    from .estimate import estimate_from_args, render_table, to_json
    from .models.gpt import GPTConfig

    a = _estimate_parser().parse_args(argv)
    hf = _hf_dims(a, "estimate", ("preset", "layers", "hidden", "heads", "vocab", "params"))
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
                  checkpoint_tier=_tier(a.offload_checkpoints),
                  backend="nccl" if a.device == "cuda" else None)
    from .estimate.peak import HostOverhead

    if a.no_overhead:
        overhead = HostOverhead.none()
    elif a.probe:
        from .estimate.probe import HardwareProbe

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


# --------------------------------------------------------------------------- probe


def format_probe(result: Any) -> str:
    """A HardwareProbe as aligned 'field  value' lines (bytes in binary units, GB/s as such)."""
    from .estimate import human_bytes

    rows = []
    for name, value in result.to_dict().items():
        if name == "notes":
            continue
        if value is None:
            text = "-"
        elif name.endswith("_bytes"):
            text = human_bytes(value)
        elif name.endswith("_gbps"):
            text = f"{value:.2f} GB/s"
        elif name.endswith("_tflops"):
            text = f"{value:.1f} TFLOP/s"
        elif name.endswith("_gflops"):
            text = f"{value:.1f} GFLOP/s"
        else:
            text = str(value)
        rows.append((name, text))
    width = max(len(n) for n, _ in rows)
    lines = [f"{n.ljust(width)}  {t}" for n, t in rows]
    lines += [f"note: {n}" for n in result.notes]
    return "\n".join(lines)


def cmd_probe(argv: list[str]) -> int:
    from .estimate import probe as probe_module

    p = argparse.ArgumentParser(prog="tiertrain probe", allow_abbrev=False,
                                description="Measure this machine's memory, bandwidths and GPU (if any) "
                                            "and save the figures as JSON for the planner.")
    p.add_argument("--swap-dir", metavar="DIR", help="directory to probe as the NVMe tier (a temporary file is written)")
    p.add_argument("--quick", action="store_true",
                   help="small sizes: seconds, noisier numbers; skips the process-overhead calibration")
    p.add_argument("--no-overhead", action="store_true",
                   help="skip the process-overhead calibration (two short 2-rank training runs, ~15 s)")
    p.add_argument("--out", metavar="FILE", default="runs/hardware_probe.json",
                   help="where to save the JSON (default runs/hardware_probe.json; '' to skip)")
    a = p.parse_args(argv)
    result = probe_module.probe(swap_dir=a.swap_dir, quick=a.quick, overhead=False if a.no_overhead else None)
    print(format_probe(result))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        result.save(a.out)
        print(f"saved to {a.out}")
    return 0


# --------------------------------------------------------------------------- plan

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
    from .models.gpt import PRESETS

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
    m.add_argument("--hf-config", metavar="PATH", help=_HF_CONFIG_HELP + "; plans data parallelism (--layout dp)")
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
    from . import launch
    from .estimate.plan import Hardware
    from .estimate.probe import HardwareProbe, read_meminfo

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
    from .config import ConfigError, from_dict
    from .train import TrainConfig

    try:
        from_dict(TrainConfig, values).validate()
    except (ConfigError, ValueError) as e:
        return str(e)
    return None


def _config_check_3d(values: dict, world_size: int) -> str | None:
    """None when the train config accepts a 3D plan's sections and its process grid and
    batch resolve on ``world_size`` ranks (what ``tiertrain train`` checks first), else the error."""
    from .config import ConfigError, from_dict
    from .train import TrainConfig

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
    from .estimate.layout3d import Interconnect, Policy3D, plan3d, plan3d_to_json, render_plan3d

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
    from .estimate import ModelDims
    from .estimate.plan import plan, plan_to_json, render_plan
    from .models.gpt import GPTConfig

    a = _plan_parser().parse_args(argv)
    hf = _hf_dims(a, "plan", ("preset", "layers", "hidden", "heads", "vocab", "ffn_mult", "no_bias"))
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


# --------------------------------------------------------------------------- export


def _size(nbytes: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if nbytes < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    return str(nbytes)


def _peak_rss() -> int:
    """This process's peak resident memory in bytes (VmHWM on Linux: reset at exec, unlike
    ru_maxrss, which keeps a forking parent's)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
    except (OSError, StopIteration, ValueError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)


def cmd_clean(argv: list[str]) -> int:
    from .checkpoint import CheckpointError
    from .cleanup import clean_directory, remove_abandoned_launches

    p = argparse.ArgumentParser(
        prog="tiertrain clean", allow_abbrev=False,
        description="Remove what killed runs left behind, naming each thing removed: launch directories "
                    "($TMPDIR/tiertrain-launch-*) whose launcher is gone, with the swap files and unfinished "
                    "checkpoint saves their ranks registered; in each DIR given, a checkpoint directory's "
                    "unfinished steps and temporary files (refused while a live job holds the directory) or a "
                    "swap directory's rank directories that no live process locks. Every new launch does the "
                    "first part by itself.")
    p.add_argument("dirs", metavar="DIR", nargs="*", help="a checkpoint directory or a swap directory (zero.nvme_path)")
    args = p.parse_args(argv)
    lines = remove_abandoned_launches()
    for directory in args.dirs:
        try:
            lines += clean_directory(directory)
        except (CheckpointError, OSError) as e:
            return _error(str(e), code=1)
    for line in lines:
        print(f"removed {line}")
    if not lines:
        print("nothing to remove")
    return 0


def cmd_export(argv: list[str]) -> int:
    from .checkpoint import CheckpointError
    from .consolidate import FORMATS, export_checkpoint

    p = argparse.ArgumentParser(
        prog="tiertrain export", allow_abbrev=False,
        description="Write a checkpoint saved by Engine.save_checkpoint (the newest committed step, or --step) as "
                    "a Hugging Face checkpoint: safetensors files, model.safetensors.index.json and, when the "
                    "run's model had a Hugging Face config, config.json. One process, no model code, no "
                    "torch.distributed; one tensor is assembled in memory at a time.")
    p.add_argument("checkpoint", metavar="CHECKPOINT_DIR", help="the directory given to save_checkpoint")
    p.add_argument("out", metavar="OUT_DIR", help="where to write the Hugging Face checkpoint")
    p.add_argument("--step", type=int, default=None, help="the committed step to export (default: the newest)")
    p.add_argument("--dtype", default="fp32", help="bf16, fp16 or fp32 (default: fp32, the masters' values)")
    p.add_argument("--max-shard-bytes", type=int, default=None, help="tensor bytes per file at most (default 5e9)")
    p.add_argument("--format", choices=FORMATS, default=None,
                   help="hf: a from_pretrained directory (config.json included; needs a Hugging Face model); "
                        "safetensors: the tensor files and index only (default: hf when the run's model had a "
                        "Hugging Face config)")
    args = p.parse_args(argv)
    kwargs = {} if args.max_shard_bytes is None else {"max_shard_bytes": args.max_shard_bytes}
    try:
        report = export_checkpoint(args.checkpoint, args.out, step=args.step, dtype=args.dtype,
                                   format=args.format, **kwargs)
    except CheckpointError as e:
        return _error(str(e), code=1)
    except OSError as e:
        return _error(f"export failed: {e}", code=1)
    peak_rss = _peak_rss()
    print(f"exported step {report.step} of {args.checkpoint} to {report.directory} "
          f"({str(report.dtype).removeprefix('torch.')})")
    for name in report.files + report.config_files:
        print(f"  {name}")
    if len(report.files) > 1:
        print("  model.safetensors.index.json")
    print(f"tensors: {report.tensors}, bytes: {report.bytes_written} ({_size(report.bytes_written)}), "
          f"largest tensor: {_size(report.largest_tensor)}, peak assembled: {_size(report.peak_assembled)}, "
          f"process peak RSS: {_size(peak_rss)}")
    for note in report.notes:
        print(f"note: {note}")
    return 0


# --------------------------------------------------------------------------- entry point


def cmd_plot(argv: list[str]) -> int:
    from .observe.plot import main as plot_main

    return plot_main(argv)


COMMANDS = {"train": cmd_train, "config": cmd_config, "estimate": cmd_estimate, "probe": cmd_probe,
            "plan": cmd_plan, "export": cmd_export, "clean": cmd_clean, "plot": cmd_plot}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tiertrain`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = argv[:1] == ["--debug"]
    if debug:
        argv = argv[1:]
    if not argv or argv[0] in ("-h", "--help", "help"):
        sys.stdout.write(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        from . import __version__

        print(f"tiertrain {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        return _error(f"unknown command {argv[0]!r}: valid commands are {', '.join(COMMANDS)} "
                      f"(`tiertrain --help`)")
    try:
        return command(argv[1:])
    except BrokenPipeError:  # `tiertrain config | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except yaml.YAMLError as e:
        if debug:
            traceback.print_exc()
        return _error(f"invalid YAML: {' '.join(str(e).split())}")
    except Exception as e:
        _record_for_torchrun(e)
        launch = sys.modules.get("tiertrain.launch")  # (imported by whatever started workers)
        if launch is not None and isinstance(e, launch.WorkerFailure):
            return _report_worker_failure(e, debug)
        if isinstance(e, TiertrainError) and e.message_is_diagnosis:  # (this rank's own, under torchrun)
            if debug:
                traceback.print_exc()
            text = str(e).strip()
            return _error(f"rank {os.environ.get('RANK', '0')} failed: {type(e).__name__}: "
                          f"{text.splitlines()[0] if text else ''}", code=1)
        code = _user_error_code(e)
        if code is None:
            # The estimator and the probe report bad arguments as ValueError. Training reports
            # configuration errors as ConfigError; any other ValueError raised while training
            # is a failure of the run and keeps its traceback, like every other exception.
            if isinstance(e, ValueError) and command is not cmd_train:
                if debug:
                    traceback.print_exc()
                return _error(str(e))
            raise
        if debug:
            traceback.print_exc()
        text = str(e).strip()
        return _error(text.splitlines()[0] if text else type(e).__name__, code=code)


if __name__ == "__main__":
    sys.exit(main())
