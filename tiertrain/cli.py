"""The ``tiertrain`` command: train, show the resolved config, estimate memory, probe hardware.

    tiertrain train [--config FILE] [--nproc N] [--timeout S] [--section.key VALUE ...]
    tiertrain config [--config FILE] [--section.key VALUE ...]
    tiertrain estimate (--preset NAME | --layers L --hidden H --heads A [--vocab V --seq S]) [...]
    tiertrain probe [--swap-dir DIR] [--quick] [--out FILE]

Invalid configurations print one ``error: ...`` line to stderr and exit with status 2.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from typing import Any

import yaml

from .config import ConfigError, field_docs, load

USAGE = """\
usage: tiertrain <command> [options]

commands:
  train      train a GPT (default: ~1.9M parameters, bundled corpus, 2 local processes)
  config     print the resolved training config as YAML, each field with its documentation
  estimate   per-rank memory of a model under a ZeRO layout (formulas of ZeRO / ZeRO-Infinity)
  probe      measure this machine (RAM, memory and disk bandwidth, GPU) and save it as JSON

Every field of the training config can be overridden on the command line with
--section.key VALUE (or --section.key=VALUE), e.g.

  tiertrain train --zero.stage 3 --precision.dtype bf16 --model.n_layers 4 --steps 50
  tiertrain train --config examples/gpt_small.yaml --nproc 4
  tiertrain config --zero.stage 2 > job.yaml

Multi-node (or any torchrun launch): run on every node
  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
      -m tiertrain.cli train --zero.stage 3 ...

`tiertrain <command> --help` describes a command's options.
"""

_OVERRIDES_HELP = """\
overrides:
  --section.key VALUE   set any field of the config (values are read as YAML scalars), e.g.
                        --zero.stage 3 --precision.dtype bf16 --model.n_layers 4 --steps 50
                        --optimizer.betas [0.9,0.99] --logging.metrics_file ''
  sections: steps, seed, model, data, precision, optimizer, schedule, batch, parallel,
            zero, checkpoint, logging  (`tiertrain config` lists every field with its doc)
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


def load_train_config(path: str | None, overrides: list[str]):
    """TrainConfig from an optional YAML/TOML file and --section.key overrides (validated)."""
    from .train import TrainConfig

    return load(TrainConfig, path, overrides)


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
        usage="tiertrain train [-h] [--config FILE] [--nproc N] [--timeout S] [--section.key VALUE ...]",
        description="Train a GPT with the tiertrain engine. With no options: the default job\n"
                    "(see `tiertrain config`) on 2 local gloo processes (one per GPU with CUDA).",
        epilog=_OVERRIDES_HELP + "\nmulti-node (run on every node; --nproc is then ignored):\n"
               "  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\\n"
               "      -m tiertrain.cli train ...")
    p.add_argument("--config", metavar="FILE", help="YAML or TOML file with config sections")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="local processes to start (default: number of GPUs, else 2; 1 runs in this process)")
    p.add_argument("--timeout", type=float, metavar="S", default=None,
                   help="process-group timeout in seconds: a collective stuck longer fails the run (default 600)")
    return p


def cmd_train(argv: list[str]) -> int:
    from . import launch
    from .train import check_launch, run_training

    own, overrides = _split_args(argv, {"--config": True, "--nproc": True, "--timeout": True})
    args = _train_parser().parse_args(own)
    timeout = args.timeout if args.timeout is not None else launch.DEFAULT_TIMEOUT_S
    if timeout <= 0:
        raise ConfigError(f"--timeout={timeout} is invalid: expected seconds > 0")
    cfg = load_train_config(args.config, overrides)

    if launch.under_torchrun():
        if args.nproc is not None:
            print("tiertrain: --nproc is ignored under torchrun (WORLD_SIZE is set)", file=sys.stderr)
        check_launch(cfg, int(os.environ["WORLD_SIZE"]))
        launch.run(run_training, cfg, timeout=timeout)
        return 0

    nproc = args.nproc if args.nproc is not None else launch.default_nproc()
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} is invalid: expected >= 1")
    check_launch(cfg, nproc)
    if nproc == 1:
        run_training(cfg)
        return 0
    try:
        launch.launch_local(run_training, nproc, cfg, timeout=timeout)
    except launch.WorkerFailure as failure:
        if failure.exc_type == "ConfigError":
            return _error(failure.message)
        if failure.details:
            print(failure.details.rstrip(), file=sys.stderr)
        for other in failure.others:
            print(f"note: also failed: {other}", file=sys.stderr)
        kind = f"{failure.exc_type}: " if failure.exc_type else ""
        return _error(f"rank {failure.rank} failed: {kind}{failure.message}", code=1)
    return 0


# --------------------------------------------------------------------------- config


def cmd_config(argv: list[str]) -> int:
    own, overrides = _split_args(argv, {"--config": True})
    p = argparse.ArgumentParser(
        prog="tiertrain config", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="tiertrain config [-h] [--config FILE] [--section.key VALUE ...]",
        description="Print the resolved training config (defaults < --config file < overrides) as\n"
                    "YAML, each field with its documentation; the output is a valid --config file.",
        epilog=_OVERRIDES_HELP)
    p.add_argument("--config", metavar="FILE", help="YAML or TOML file with config sections")
    args = p.parse_args(own)
    cfg = load_train_config(args.config, overrides)
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
    lay = p.add_argument_group("layout")
    lay.add_argument("--dp", type=int, help="data-parallel degree (default 1)")
    lay.add_argument("--tp", type=int, help="tensor-parallel degree (default 1)")
    lay.add_argument("--pp", type=int, help="pipeline-parallel degree (default 1)")
    lay.add_argument("--stage", type=int, help="ZeRO stage 0-3 (default 0)")
    lay.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="compute dtype (default bf16)")
    lay.add_argument("--micro-batch", type=int, help="sequences per micro-batch per rank (default 1)")
    lay.add_argument("--ci", type=int, help="blocks between activation checkpoints; 0 = none (default)")
    lay.add_argument("--tile", type=int, help="memory-centric tiling factor (default 1)")
    lay.add_argument("--offload-optimizer", choices=["none", "cpu", "nvme"],
                     help="tier of fp32 master weights and Adam state (default none = device)")
    lay.add_argument("--offload-grads", choices=["none", "cpu", "nvme"],
                     help="tier of the gradient partition (default: same as --offload-optimizer)")
    lay.add_argument("--offload-params", choices=["none", "cpu", "nvme"],
                     help="tier of stage-3 parameter shards (default none = device)")
    lay.add_argument("--ranks-per-node", type=int, help="ranks sharing a node (default: all)")
    lay.add_argument("--accounting", choices=["engine", "paper"],
                     help="engine dtypes (default) or the papers' 2+2+K bytes per parameter")
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def _tier(value: str | None) -> str | None:
    return None if value is None else ("device" if value == "none" else value)


def cmd_estimate(argv: list[str]) -> int:
    from .estimate import estimate_from_args, render_table, to_json
    from .models.gpt import GPTConfig

    a = _estimate_parser().parse_args(argv)
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
    if a.params is not None:
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
                  accounting=a.accounting)
    est = estimate_from_args(**kwargs)
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
    p.add_argument("--quick", action="store_true", help="small sizes: seconds, noisier numbers")
    p.add_argument("--out", metavar="FILE", default="runs/hardware_probe.json",
                   help="where to save the JSON (default runs/hardware_probe.json; '' to skip)")
    a = p.parse_args(argv)
    result = probe_module.probe(swap_dir=a.swap_dir, quick=a.quick)
    print(format_probe(result))
    if a.out:
        os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
        result.save(a.out)
        print(f"saved to {a.out}")
    return 0


# --------------------------------------------------------------------------- entry point


COMMANDS = {"train": cmd_train, "config": cmd_config, "estimate": cmd_estimate, "probe": cmd_probe}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``tiertrain`` command; returns the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
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
    except ConfigError as e:
        return _error(str(e))
    except yaml.YAMLError as e:
        return _error(f"invalid YAML: {' '.join(str(e).split())}")
    except ValueError as e:
        # The estimator and the probe report bad arguments as ValueError. Training reports
        # configuration errors as ConfigError (above); any other ValueError raised while
        # training is a failure of the run and keeps its traceback.
        if command is cmd_train:
            raise
        return _error(str(e))
    except BrokenPipeError:  # `tiertrain config | head`
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
