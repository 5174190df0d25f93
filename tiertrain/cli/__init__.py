"""The ``tiertrain`` command: train, show the resolved config, estimate memory, probe hardware.
One module per command (``train.py``, ``config.py``, ...), each with its ``cmd_<name>``;
what they share in ``common.py``; how a failure is reported in ``report.py``.

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

import os
import sys
import traceback

import yaml

from .clean import cmd_clean
from .common import load_train_config, load_with_deepspeed, print_error
from .config import cmd_config
from .estimate import cmd_estimate
from .export import cmd_export
from .plan import cmd_plan, parse_bytes
from .plot import cmd_plot
from .probe import cmd_probe
from .report import report_failure
from .train import cmd_train

__all__ = ["COMMANDS", "USAGE", "load_train_config", "load_with_deepspeed", "main", "parse_bytes"]

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


COMMANDS = {"train": cmd_train, "config": cmd_config, "estimate": cmd_estimate, "probe": cmd_probe,
            "plan": cmd_plan, "export": cmd_export, "clean": cmd_clean, "plot": cmd_plot}
"""Each command's function: its arguments (after the command's name) -> the exit status."""


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
        from .. import __version__

        print(f"tiertrain {__version__}")
        return 0
    command = COMMANDS.get(argv[0])
    if command is None:
        return print_error(f"unknown command {argv[0]!r}: valid commands are {', '.join(COMMANDS)} "
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
        return print_error(f"invalid YAML: {' '.join(str(e).split())}")
    except Exception as e:
        code = report_failure(e, debug, value_error_is_bad_argument=command is not cmd_train)
        if code is None:
            raise
        return code
