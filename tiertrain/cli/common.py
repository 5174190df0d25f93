"""What several commands share: their own options told apart from --section.key overrides, a
train config loaded with an optional DeepSpeed config, a model given as a Hugging Face config,
notes for the user and the one-line error."""
from __future__ import annotations

import argparse
import os
import sys

from ..config import load

OVERRIDES_HELP = """\
overrides:
  --section.key VALUE   set any field of the config (values are read as YAML scalars), e.g.
                        --zero.stage 3 --precision.dtype bf16 --model.n_layers 4 --steps 50
                        --optimizer.betas [0.9,0.99] --logging.metrics_file ''
  sections: steps, seed, eval, model, data, precision, optimizer, schedule, batch,
            parallel, zero, checkpoint, logging  (`tiertrain config` lists every field with its doc)
"""


def split_args(argv: list[str], takes_value: dict[str, bool]) -> tuple[list[str], list[str]]:
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
    from ..train import TrainConfig

    if deepspeed is None:
        return load(TrainConfig, path, overrides), []
    from ..config import from_dict, merge, parse_overrides, read_file
    from ..deepspeed_config import from_deepspeed

    base, extra = read_file(path) if path else {}, parse_overrides(overrides)
    dtype = (merge(base, extra).get("precision") or {}).get("dtype", "fp32")  # (where the file says "auto")
    translation = from_deepspeed(deepspeed, dtype=dtype)
    data = merge(merge(base, translation.values), extra)
    cfg = from_dict(TrainConfig, data)
    cfg.validate()
    translation.finish(cfg)
    return cfg, translation.lines()


def derived_batch(cfg, world_size: int, deepspeed: str | None, overrides: list[str]) -> list[str]:
    """The batch size a DeepSpeed config leaves to the world size (deepspeed_config.derive_batch),
    set in cfg; the lines to say (none without a DeepSpeed config)."""
    if deepspeed is None:
        return []
    from ..config import parse_overrides
    from ..deepspeed_config import derive_batch

    _, dp, _ = cfg.parallel.resolve(world_size)
    return derive_batch(cfg.batch, dp, deepspeed, set(parse_overrides(overrides).get("batch") or {}))


def print_error(message: str, code: int = 2) -> int:
    """Print ``error: message`` to stderr; returns ``code``, the command's exit status."""
    print(f"error: {message}", file=sys.stderr)
    return code


def say(lines: list[str]) -> None:
    """Notes for the user, once (rank 0 under torchrun)."""
    if lines and int(os.environ.get("RANK", "0")) == 0:
        print("\n".join(f"tiertrain: {line}" for line in lines), file=sys.stderr)


HF_CONFIG_HELP = ("a Hugging Face config.json (or its directory): any model of a modelled family (llama, "
                  "mistral, qwen2, gpt2, bert, roberta, t5, bart), counted exactly on the meta device, "
                  "activations per block; --seq sets the tokens per sequence (default: the config's "
                  "max_position_embeddings)")
"""The help of --hf-config (estimate, plan)."""


def hf_dims(a: argparse.Namespace, command: str, dim_flags: tuple[str, ...]):
    """The HFModelDims of ``--hf-config`` (None without it); ValueError when GPT dims are
    also given."""
    if not a.hf_config:
        return None
    given = [f"--{f.replace('_', '-')}" for f in dim_flags if getattr(a, f, None) not in (None, False)]
    if given:
        raise ValueError(f"{command}: --hf-config describes the model; drop {', '.join(given)} (or drop --hf-config)")
    from ..estimate.modules import dims_of_hf_config

    return dims_of_hf_config(a.hf_config, a.seq)
