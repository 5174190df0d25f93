"""``tiertrain train``: a run on local processes, under torchrun, or alone in this process."""
from __future__ import annotations

import argparse
import math
import os
import sys

from ..config import ConfigError
from .common import OVERRIDES_HELP, derived_batch, load_with_deepspeed, say, split_args


def _train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tiertrain train", allow_abbrev=False, formatter_class=argparse.RawDescriptionHelpFormatter,
        usage="tiertrain train [-h] [--config FILE] [--deepspeed ds.json] [--nproc N] [--timeout S] [--resume DIR] "
              "[--data PATH] [--section.key VALUE ...]",
        description="Train a GPT, or a Hugging Face causal LM (--model.hf DIR), with the tiertrain engine.\n"
                    "With no options: the default job (see `tiertrain config`) on 2 local gloo processes\n"
                    "(one per GPU with CUDA).",
        epilog=OVERRIDES_HELP + "\nmulti-node (run on every node; --nproc is then ignored):\n"
               "  torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\\n"
               "      -m tiertrain.cli train ...")
    p.add_argument("--config", metavar="FILE", help="YAML or TOML file with config sections")
    p.add_argument("--deepspeed", metavar="FILE",
                   help="a DeepSpeed JSON config, translated key by key (docs/deepspeed.md; refused keys are "
                        "named); --config values come first, --section.key overrides after")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="local processes to start (default: number of GPUs, else 2; 1 runs in this process)")
    from ..comm import DEFAULT_TIMEOUT_S

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


def cmd_train(argv: list[str]) -> int:
    from .. import launch
    from ..train import check_launch, keep_global_batch, run_training

    own, overrides = split_args(argv, {"--config": True, "--nproc": True, "--timeout": True, "--resume": True,
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
        say([f"the DeepSpeed config {args.deepspeed}, key by key:\n  " + "\n  ".join(fates)])

    if launch.under_torchrun():
        if args.nproc is not None:
            print("tiertrain: --nproc is ignored under torchrun (WORLD_SIZE is set)", file=sys.stderr)
        say(derived_batch(cfg, int(os.environ["WORLD_SIZE"]), args.deepspeed, overrides))
        say(keep_global_batch(cfg, int(os.environ["WORLD_SIZE"])))
        check_launch(cfg, int(os.environ["WORLD_SIZE"]))
        launch.run(run_training, cfg, timeout=timeout)
        return 0

    nproc = args.nproc if args.nproc is not None else launch.default_nproc()
    if nproc < 1:
        raise ConfigError(f"--nproc={nproc} is invalid: expected >= 1")
    say(derived_batch(cfg, nproc, args.deepspeed, overrides))
    say(keep_global_batch(cfg, nproc))
    check_launch(cfg, nproc)
    if nproc == 1:
        launch.run(run_training, cfg, timeout=timeout)  # alone, with the run's timeout and SIGTERM handling
        return 0
    launch.launch_local(run_training, nproc, cfg, timeout=timeout)  # (a WorkerFailure is reported by main)
    return 0


def _check_resumable(directory: str) -> None:
    """--resume DIR needs a committed checkpoint in DIR (a ConfigError naming DIR otherwise)."""
    from ..state.checkpoint import CheckpointError, find_committed

    if not os.path.isdir(directory):
        raise ConfigError(f"--resume={directory!r} is invalid: no such directory (expected the checkpoint.dir "
                          f"of an earlier run)")
    try:
        find_committed(directory)
    except CheckpointError as e:
        raise ConfigError(f"--resume={directory!r} is invalid: {e} (expected the checkpoint.dir of an earlier "
                          f"run)") from None
