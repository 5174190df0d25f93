"""Hugging Face causal language models for ``tiertrain train --model.hf DIR``.

DIR is a directory ``save_pretrained`` wrote (or any local copy of a Hugging Face model
repository): its ``config.json`` says the architecture, built with
``AutoModelForCausalLM.from_config`` (no download: only local files are read); its
safetensors weights, when present, are loaded after wrapping with the streaming loader
(tiertrain.state.pretrained: each rank reads only what it keeps), which makes the run a
fine-tune; without weights the model trains from its initialisation. A ``tokenizer.json``
there tokenises text data (``data.tokenizer`` unless set).

The loss is the next-token cross-entropy of the logits against the dataset's ``labels``
(already shifted by one position: tiertrain's datasets yield ``input_ids = tokens[:-1]``,
``labels = tokens[1:]``), computed here rather than by the model's own ``labels=`` argument,
which would shift them a second time.
"""
from __future__ import annotations

import functools
import json
import os
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..config import ConfigError

__all__ = ["ROTARY_DECODERS", "hf_config", "build_causal_lm", "causal_lm_loss", "has_weights", "tokenizer_file"]

ROTARY_DECODERS = frozenset({"llama", "mistral", "qwen2", "qwen3"})
"""``config.model_type`` values whose base model runs embed_tokens → layers (each given the rotary
cos/sin, position ids and a causal or sliding-window mask) → norm, nothing else (no embedding
scale, no soft-capping), and whose attention context parallelism converts
(tiertrain/parallel/cp_hf.py). The pipeline cuts these and more
(tiertrain/pipeline/hf_families.py PIPELINE_DECODERS)."""


@functools.lru_cache(maxsize=8)
def _load_config(directory: str, mtime: float):
    from transformers import AutoConfig

    # (Never the directory's own code: a config.json whose auto_map names a module of the
    # directory would otherwise run it, after transformers' interactive prompt.)
    return AutoConfig.from_pretrained(directory, local_files_only=True, trust_remote_code=False)


def hf_config(directory: str):
    """The transformers config of model directory ``directory``; a ConfigError naming
    model.hf when it is missing, not a directory, holds no config.json, or the config is
    not one transformers knows."""
    if not os.path.isdir(directory):
        what = "is a file" if os.path.exists(directory) else "does not exist"
        raise ConfigError(f"model.hf={directory!r} is invalid: it {what}; expected a Hugging Face model directory "
                          f"holding config.json (what save_pretrained writes)")
    path = os.path.join(directory, "config.json")
    if not os.path.isfile(path):
        raise ConfigError(f"model.hf={directory!r} is invalid: it has no config.json; expected a Hugging Face model "
                          f"directory (what save_pretrained writes)")
    try:
        import transformers  # noqa: F401
    except ImportError:
        raise ConfigError("model.hf needs the transformers package: pip install transformers") from None
    try:
        with open(path) as f:
            data = json.load(f)
        if isinstance(data, dict) and data.get("auto_map"):
            from transformers import CONFIG_MAPPING

            if data.get("model_type") not in CONFIG_MAPPING:
                raise ConfigError(f"model.hf={directory!r} is refused: its config.json names model_type "
                                  f"{data.get('model_type')!r}, which transformers does not know, and auto_map "
                                  f"{sorted(data['auto_map'])} points at code in the directory; tiertrain never runs "
                                  f"a model directory's code (trust_remote_code=False): use a model type transformers "
                                  f"ships, or build the model yourself and train it with tiertrain.Trainer")
        return _load_config(os.path.abspath(directory), os.path.getmtime(path))
    except ConfigError:
        raise
    except (ValueError, KeyError, OSError) as e:
        raise ConfigError(f"model.hf={directory!r} is invalid: its config.json cannot be read as a transformers "
                          f"config ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def build_causal_lm(directory: str) -> nn.Module:
    """A causal LM of the directory's architecture, freshly initialised (weights are loaded
    after wrapping). Call under ``partitioned_init`` to build it partitioned."""
    from transformers import AutoModelForCausalLM

    config = hf_config(directory)
    try:
        return AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except ValueError as e:
        raise ConfigError(f"model.hf={directory!r} is invalid: {type(config).__name__} has no causal-LM head in "
                          f"transformers ({str(e).splitlines()[0][:200]}); `tiertrain train` trains causal LMs, "
                          f"other models train through tiertrain.Trainer") from None


def causal_lm_loss(model: nn.Module, batch: dict[str, Any]) -> torch.Tensor:
    """Mean next-token cross-entropy of the model's logits against batch["labels"] (a
    context-parallel model computes it from its own tokens: tiertrain/parallel/cp_hf.py)."""
    if getattr(model, "cp_size", 1) > 1:
        return model(input_ids=batch["input_ids"], shift_labels=batch["labels"]).loss
    logits = model(input_ids=batch["input_ids"]).logits
    return F.cross_entropy(logits.float().flatten(0, -2), batch["labels"].flatten())


WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt", "merges.txt")
"""The files transformers' tokenizers are saved as (whichever of them a directory has)."""


def tokenizer_files(directory: str) -> dict[str, bytes]:
    """The tokenizer saved with a model (TOKENIZER_FILES found in directory), name → content:
    kept with the run's checkpoints and written beside every export, so that
    ``AutoTokenizer.from_pretrained`` of an exported directory gets the tokenizer trained with."""
    out = {}
    for name in TOKENIZER_FILES:
        path = os.path.join(directory, name)
        if os.path.isfile(path):
            with open(path, "rb") as f:
                out[name] = f.read()
    return out


def has_weights(directory: str) -> bool:
    """Whether the directory holds safetensors weights to load (a fine-tune). A weight file
    that is there but cannot be read (a dangling symlink, as a Hugging Face cache snapshot with
    a missing blob leaves; not a regular file; no read permission) is a ConfigError naming it:
    training from the initialisation instead would be silent."""
    from ..io.fileio import unreadable_file

    found = False
    for name in WEIGHT_FILES:
        path = os.path.join(directory, name)
        if not os.path.lexists(path):
            continue
        problem = unreadable_file(path)
        if problem:
            raise ConfigError(f"model.hf={directory!r}: {name} is {problem}; restore the file, or remove it to "
                              f"train from the initialisation")
        found = True
    return found


def tokenizer_file(directory: str) -> str:
    """The directory's tokenizer.json, or "" when it has none."""
    path = os.path.join(directory, "tokenizer.json")
    return path if os.path.isfile(path) else ""
