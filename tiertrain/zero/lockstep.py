"""Stage 3 over several ranks: every forward runs on every rank, the same modules in the same order.

Each partitioned unit is gathered from every rank's shard when its module runs, so a module that
runs on some ranks only stops the others in a gather it never joins (zero/agreement.py turns
that into CollectiveMismatchError). Two things in Hugging Face models do it by design, and both
are handled before they can happen:

* ``generate()`` stops when this rank's sequences end, while a peer still decodes. transformers
  keeps the ranks in step itself under DeepSpeed ZeRO-3 and FSDP (``synced_gpus``: a finished
  rank runs dummy forwards until every rank is done); :func:`generate_in_lockstep` makes the
  model's ``generate`` do the same here.
* LayerDrop (``layerdrop``, ``encoder_layerdrop``, ``decoder_layerdrop``: Fan et al. 2019) skips
  layers at random in training, each rank by its own draws. transformers runs every layer under
  ZeRO-3 for some families (wav2vec2's) and skips on each rank alone for others (BART's);
  :func:`refuse_layerdrop` refuses both at wrap(), naming the setting, rather than have the
  ranks part ways at the first draw that differs.
"""
from __future__ import annotations

import functools
import inspect
from typing import Callable

import torch.nn as nn

from ..config import ConfigError

LAYERDROP_FIELDS = ("layerdrop", "encoder_layerdrop", "decoder_layerdrop")
"""The settings of LayerDrop's probability, on a module or on its ``config``."""


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def layerdrop_settings(model: nn.Module) -> list[str]:
    """Where the model sets a LayerDrop probability above 0: "encoder.layerdrop = 0.1",
    "config.layerdrop = 0.05" (each config once, however many modules share it)."""
    found, seen = [], set()
    for name, module in model.named_modules():
        prefix = f"{name}." if name else ""
        owners = [(module, prefix)]
        config = getattr(module, "config", None)
        if config is not None and id(config) not in seen:
            seen.add(id(config))
            owners.append((config, f"{prefix}config."))
        for owner, where in owners:
            found += [f"{where}{field} = {getattr(owner, field)}" for field in LAYERDROP_FIELDS
                      if _positive(getattr(owner, field, None))]
    return found


def refuse_layerdrop(model: nn.Module, ranks: int) -> None:
    """ConfigError when the model drops layers at random in training (see the module docstring)."""
    found = layerdrop_settings(model)
    if found:
        raise ConfigError(
            f"the model drops layers at random in training (LayerDrop: {', '.join(found)}); at zero.stage 3 over "
            f"{ranks} ranks each layer is gathered from every rank's shard, so every rank must run the same layers "
            f"and a draw that differs between ranks stops them: set these to 0.0 before wrap() (under DeepSpeed "
            f"ZeRO-3 and FSDP transformers runs every layer of wav2vec2-like models anyway), or train at "
            f"zero.stage 1 or 2, where each rank may skip its own layers")


def generate_in_lockstep(model: nn.Module) -> Callable[[], None]:
    """Make every ``generate`` of the model (a method taking ``synced_gpus``: transformers'
    GenerationMixin, the model's and any inner one a wrapper such as peft calls) run with
    ``synced_gpus=True``, as transformers does by itself under DeepSpeed ZeRO-3 and FSDP. A
    ``synced_gpus=False`` passed in (the Seq2SeqTrainer's default) is overridden: no rank can
    stop early while its peers need its shards. Returns what undoes it (engine.close())."""
    patched = []
    for module in model.modules():
        method = getattr(type(module), "generate", None)
        if method is None or "generate" in vars(module):
            continue
        try:
            signature = inspect.signature(method)
        except (TypeError, ValueError):
            continue
        if "synced_gpus" not in signature.parameters:
            continue
        module.generate = functools.update_wrapper(functools.partial(_synced, method, signature, module), method)
        patched.append(module)

    def undo() -> None:
        for module in patched:
            vars(module).pop("generate", None)
    return undo


def _synced(method, signature: inspect.Signature, module: nn.Module, *args, **kwargs):
    bound = signature.bind(module, *args, **kwargs)
    bound.arguments["synced_gpus"] = True
    return method(*bound.args, **bound.kwargs)
