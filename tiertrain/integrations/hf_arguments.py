"""TrainingArguments → tiertrain Config for :class:`~tiertrain.integrations.hf_trainer.TiertrainTrainer`:
the settings the engine refuses (``check_training_arguments``), the fields TrainingArguments
decide (``config_from_training_arguments``) and a DeepSpeed config's values and schedule beside
them (``deepspeed_schedule``), and the Trainer's ``optimizers=`` as the engine takes them
(``client_optimizers``). Reads the arguments' fields only: no transformers import here.
"""
from __future__ import annotations

import copy
import functools
from typing import Any

from ..config import Config, ConfigError
from ..deepspeed_fates import is_auto

__all__ = ["SUPPORTED_OPTIMS", "TRAINER_OPTIMS", "check_training_arguments", "client_optimizers",
           "config_from_training_arguments", "deepspeed_schedule", "trainer_optimizer", "trainer_param_groups"]

SUPPORTED_OPTIMS = {"adamw_torch": "auto", "adamw_torch_fused": "fused"}
"""TrainingArguments.optim values the engine builds (torch AdamW), with the kernel each maps to."""

TRAINER_OPTIMS = {"adafactor": (), "sgd": ("momentum", "dampening", "weight_decay", "nesterov"),
                  "adagrad": ("lr_decay", "weight_decay", "eps"),
                  "rmsprop": ("momentum", "alpha", "eps", "weight_decay", "centered"),
                  **dict.fromkeys(("adamw_bnb_8bit", "adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit",
                                   "lion_8bit", "lion_32bit", "paged_lion_8bit", "paged_lion_32bit",
                                   "rmsprop_bnb", "rmsprop_bnb_8bit", "rmsprop_bnb_32bit"), ())}
"""TrainingArguments.optim values built as the Trainer builds them (its get_optimizer_cls_and_kwargs:
transformers' Adafactor, torch's SGD, Adagrad and RMSprop, bitsandbytes' AdamW, Lion and RMSprop:
trainer_optimizer) and stepped by the engine as an optimizer the user brought (tiertrain/optim.py;
bitsandbytes' 8-bit states take the whole-parameter path, docs/optimizers.md), with the
optim_args keys the Trainer reads for each."""


def trainer_param_groups(model, split: tuple[list[str], list[str]], weight_decay: float, deepspeed=None) -> list[dict]:
    """The param groups (by name) of the optimizer the Trainer trains with: its decay split
    (create_optimizer: ``split`` = the decayed names, then the others; no decay for biases and
    norms), or, where a DeepSpeed config has an optimizer block, one group of every trained
    parameter at ``weight_decay``: transformers hands DeepSpeed the trained parameters as one list
    (DummyOptim(params=...)), and DeepSpeed builds its optimizer over them, decaying every one."""
    from ..deepspeed_config import read_deepspeed

    if deepspeed is not None and "optimizer" in read_deepspeed(deepspeed):
        return [{"params": [n for n, p in model.named_parameters() if p.requires_grad], "weight_decay": weight_decay}]
    groups = [{"params": split[0], "weight_decay": weight_decay}, {"params": split[1], "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def trainer_optimizer(cls: type, options: dict, groups: list[dict], model) -> tuple[Any, list[dict] | None]:
    """The optimizer Trainer.create_optimizer builds from (cls, options) over these groups of
    parameter names, as wrap() takes it: (factory, groups). With bitsandbytes at optim_bits 8
    the Trainer keeps every nn.Embedding's weight at 32 bits (a GlobalOptimManager override keyed
    by the parameter, which the engine's optimizer does not step): the same here as a list of two
    optimizers, the embeddings' at optim_bits 32, ([(factory, their groups), (factory, the
    rest's)], None)."""
    import torch.nn as nn

    factory = functools.partial(cls, **options)
    # (the Trainer's own test: "bitsandbytes" in str(optimizer_cls) and optim_bits == 8)
    if not (cls.__module__.split(".")[0] == "bitsandbytes" and options.get("optim_bits") == 8):
        return factory, groups
    ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    embeddings = {n for n, p in model.named_parameters() if id(p) in ids}
    parts = [[{**g, "params": [n for n in g["params"] if (n in embeddings) == inside]} for g in groups]
             for inside in (True, False)]
    parts = [[g for g in part if g["params"]] for part in parts]
    if not parts[0]:
        return factory, groups
    wide = functools.partial(cls, **{**options, "optim_bits": 32})
    return [(wide, parts[0]), *([(factory, parts[1])] if parts[1] else [])], None

_NEEDS_METRICS = ("reduce_lr_on_plateau", "greedy")


def _value(x: Any) -> Any:
    return getattr(x, "value", x)  # ExplicitEnum / str enums → their string


def _refuse(argument: str, value: Any, valid: str) -> None:
    raise ConfigError(f"TrainingArguments({argument}={value!r}) is not supported by TiertrainTrainer: {valid}")


def check_training_arguments(args) -> None:
    """Raise ConfigError for a TrainingArguments setting the engine would not honour (it would
    silently train differently); see the module docstring's Limits. Reads fields only (does
    not set up devices)."""
    if args.fsdp:
        _refuse("fsdp", args.fsdp, "tiertrain's engine replaces FSDP; set fsdp=None (or '') and use "
                "tiertrain_config.zero.stage=3 for fully sharded parameters")
    if getattr(args, "parallelism_config", None) is not None:
        _refuse("parallelism_config", args.parallelism_config, "set it to None; the engine's data parallelism "
                "spans every rank (tiertrain_config.parallel)")
    _check_optim(_value(args.optim), args.optim_args)
    if _value(args.lr_scheduler_type) in _NEEDS_METRICS:
        _refuse("lr_scheduler_type", _value(args.lr_scheduler_type), "the engine steps its scheduler at each update, "
                "without metrics; valid: linear, cosine, cosine_with_restarts, polynomial, constant, "
                "constant_with_warmup, inverse_sqrt, cosine_with_min_lr, cosine_warmup_with_min_lr, "
                "warmup_stable_decay")
    if args.auto_find_batch_size:
        _refuse("auto_find_batch_size", True, "set it to False and choose per_device_train_batch_size yourself")
    if args.use_liger_kernel:
        _refuse("use_liger_kernel", True, "set it to False (Liger patches the model's modules in place)")
    for name in ("bf16_full_eval", "fp16_full_eval"):
        if getattr(args, name):
            _refuse(name, True, "set it to False: evaluation runs in the engine's precision.dtype (bf16=True or "
                    "fp16=True sets it for training and evaluation)")


def _check_optim(optim: str, optim_args: str | None) -> None:
    """ConfigError for an optim the engine does not build, or optim_args the Trainer would
    ignore (it reads them only for some optims, and only some keys: a typo would pass unseen)."""
    if optim not in SUPPORTED_OPTIMS and optim not in TRAINER_OPTIMS:
        _refuse("optim", optim, f"valid: {', '.join(repr(o) for o in [*SUPPORTED_OPTIMS, *TRAINER_OPTIMS])}, or pass "
                f"optimizer_cls_and_kwargs=(cls, kwargs) with a torch optimizer (torch.optim.Adafactor, ...)")
    if not optim_args:
        return
    read = TRAINER_OPTIMS.get(optim, ())
    if not read:
        _refuse("optim_args", optim_args, f"the Trainer reads no optim_args for optim={optim!r} (it takes its "
                f"settings from learning_rate, adam_beta1, adam_beta2, adam_epsilon and weight_decay): set "
                f"optim_args=None")
    pairs = [p.split("=") for p in optim_args.replace(" ", "").split(",")]
    bad = [p for p in pairs if len(p) != 2 or p[0] not in read]
    if bad:
        _refuse("optim_args", optim_args, f"{'='.join(bad[0])!r} is not key=value with a key the Trainer reads for "
                f"optim={optim!r}; valid keys: {', '.join(read)}")


def _field(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config


def _set_field(config: Any, path: str, value: Any) -> None:
    *parents, last = path.split(".")
    for part in parents:
        config = getattr(config, part)
    setattr(config, last, value)


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def config_from_training_arguments(args, base: Config | None = None, deepspeed=None) -> Config:
    """The engine's Config: ``base`` (zero, activations, parallel, loss scaling; default
    Config()) with the fields TrainingArguments decides set from it. A field both set to
    different values raises ConfigError naming both (neither silently wins); so does a
    base with a schedule or checkpoint section of its own (the Trainer's scheduler and
    save_steps apply), or with parallel.tp/pp > 1. deepspeed: a DeepSpeed config (a dict or
    a JSON file; default: args.deepspeed), translated as tiertrain/deepspeed_config.py does,
    its "auto" values TrainingArguments', its explicit ones checked against them as
    transformers checks them. Validated."""
    check_training_arguments(args)
    deepspeed = deepspeed if deepspeed is not None else (args.deepspeed or None)
    if deepspeed is not None and _value(args.optim) in TRAINER_OPTIMS:
        from ..deepspeed_config import read_deepspeed

        if "optimizer" in read_deepspeed(deepspeed):
            _refuse("optim", _value(args.optim), "the DeepSpeed config's optimizer block names the optimizer too (with "
                    "DeepSpeed the block wins and optim is ignored): remove the block, or use optim='adamw_torch'")
    config = copy.deepcopy(base) if base is not None else Config()
    defaults = Config()
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    derived = [
        ("optimizer.lr", float(args.learning_rate), "learning_rate"),
        ("optimizer.betas", (float(args.adam_beta1), float(args.adam_beta2)), "adam_beta1, adam_beta2"),
        ("optimizer.eps", float(args.adam_epsilon), "adam_epsilon"),
        ("optimizer.weight_decay", float(args.weight_decay), "weight_decay"),
        ("optimizer.grad_clip", float(args.max_grad_norm), "max_grad_norm"),
        *([("optimizer.impl", SUPPORTED_OPTIMS[_value(args.optim)], "optim")] if _value(args.optim) in SUPPORTED_OPTIMS
          else []),
        ("batch.micro_batch_size", int(args.per_device_train_batch_size), "per_device_train_batch_size"),
        ("batch.grad_accum_steps", int(args.gradient_accumulation_steps), "gradient_accumulation_steps"),
        ("precision.dtype", dtype, "bf16, fp16"),
    ]
    for path, value, argument in derived:
        given, default = _field(config, path), _field(defaults, path)
        if not _same(given, default) and not _same(given, value):
            raise ConfigError(f"tiertrain_config {path}={given!r} disagrees with TrainingArguments({argument}) "
                              f"which sets it to {value!r}: with TiertrainTrainer the TrainingArguments decide it; "
                              f"leave {path} at its default ({default!r}) or change {argument}")
        _set_field(config, path, value)
    if deepspeed is not None:
        _apply_deepspeed(config, defaults, deepspeed, {path: (value, arg) for path, value, arg in derived}, dtype)
    elif dtype == "fp16" and config.precision.loss_scale == defaults.precision.loss_scale:
        # The Trainer scales fp16 losses with torch's GradScaler: its 2000 good steps before growing, and
        # a backoff at every overflow (no hysteresis). Its scale may also fall below 1; min_scale stays 1.
        config.precision.loss_scale.growth_interval = 2000
        config.precision.loss_scale.hysteresis = 1
    for section, instead in (("schedule", "lr_scheduler_type, warmup_steps and max_steps"),
                             ("checkpoint", "output_dir, save_steps and save_total_limit")):
        if getattr(config, section) != getattr(defaults, section):
            raise ConfigError(f"tiertrain_config.{section}={getattr(config, section)!r} is not used by "
                              f"TiertrainTrainer: TrainingArguments' {instead} apply; leave {section} at its defaults")
    checkpointing = next((n for n in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, n, False)),
                         None)
    if checkpointing and config.activations.checkpoint_every:
        _refuse(checkpointing, True, f"tiertrain_config.activations.checkpoint_every="
                f"{config.activations.checkpoint_every} checkpoints the layers too (two checkpoints around "
                f"each layer; with use_reentrant=True each recomputed twice): choose one, the model's own "
                f"(transformers' activation_checkpointing_enable, which the Trainer calls) or the engine's")
    if config.parallel.tp != 1 or config.parallel.pp != 1:
        raise ConfigError(f"tiertrain_config.parallel tp={config.parallel.tp}, pp={config.parallel.pp} is not "
                          f"supported by TiertrainTrainer: the Trainer's data loaders give every rank its own "
                          f"batch; valid: tp=1, pp=1 (ZeRO data parallelism over every rank)")
    config.batch.global_batch_size = 0 if config.batch.global_batch_size == defaults.batch.global_batch_size \
        else config.batch.global_batch_size
    return config.validate()


def _apply_deepspeed(config: Config, defaults: Config, deepspeed, decided: dict, dtype: str) -> None:
    """The DeepSpeed config's values into config: those TrainingArguments decide must agree
    with them (DeepSpeed's "auto" takes them; a key left out takes DeepSpeed's default, as the
    DeepSpeed engine would: no gradient clipping); the schedule is deepspeed_schedule's; the
    rest (zero, loss scaling, monitors) set, unless tiertrain_config set them otherwise."""
    from ..deepspeed_config import from_deepspeed

    translation = from_deepspeed(deepspeed, dtype=dtype)
    _check_peak_rate(translation, *decided["optimizer.lr"])
    for path, value, key in translation.assignments:
        if path.startswith("schedule.") or key.startswith("scheduler") or path == "optimizer.weight_decay_on":
            continue  # (the schedule: deepspeed_schedule; the groups and their decay: trainer_param_groups)
        if path in decided and not key.endswith("(absent)"):
            want, argument = decided[path]
            if not _same(value, want):
                raise ConfigError(f"DeepSpeed {key}={value!r} disagrees with TrainingArguments({argument})={want!r}: "
                                  f"set it to \"auto\" or to the same value (transformers refuses the same mismatch)")
            continue
        given, default = _field(config, path), _field(defaults, path)
        if path not in decided and not _same(given, default) and not _same(given, value):
            raise ConfigError(f"tiertrain_config {path}={given!r} disagrees with DeepSpeed {key}={value!r}: "
                              f"set one of them")
        _set_field(config, path, value)


def _check_peak_rate(translation, lr: float, argument: str) -> None:
    """Where the DeepSpeed scheduler sets the peak rate itself (warmup_max_lr), it and the
    optimizer's lr must be the TrainingArguments' rate: transformers refuses a mismatch of
    either (fill_match); WarmupDecayLR without warmup_max_lr would run at DeepSpeed's 0.001
    whatever learning_rate says."""
    if translation.peak is None:
        return
    from ..deepspeed_schedule import optimizer_lr

    given = optimizer_lr(translation.source)
    for key, value in (translation.peak, ("optimizer.params.lr", given)):
        if value is None or is_auto(value) or _same(float(value), lr):
            continue
        why = ("DeepSpeed would run at that rate and ignore learning_rate: set warmup_max_lr to \"auto\""
               if "absent" in key else "set it to \"auto\" or to the same value (transformers refuses the same "
               "mismatch)")
        raise ConfigError(f"DeepSpeed {key}={value!r} disagrees with TrainingArguments({argument})={lr!r}: {why}")


def deepspeed_schedule(deepspeed, args, max_steps: int):
    """The learning-rate schedule of a DeepSpeed config's scheduler block (a ScheduleConfig),
    its "auto" values resolved as transformers resolves them (warmup_num_steps: the
    TrainingArguments' warmup; warmup_min_lr: 0; total_num_steps: the run's steps); None
    without a scheduler block (the Trainer's lr_scheduler_type applies, as with DeepSpeed)."""
    from ..config import ScheduleConfig
    from ..deepspeed_config import from_deepspeed, read_deepspeed

    if deepspeed is None or "scheduler" not in read_deepspeed(deepspeed):
        return None
    translation = from_deepspeed(deepspeed)
    params = translation.source["scheduler"].get("params") or {}
    # (transformers fills "auto" with these and refuses any other value: trainer_config_finalize)
    for name, want, argument in (("warmup_num_steps", max(1, args.get_warmup_steps(max_steps)), "warmup_steps"),
                                 ("total_num_steps", max_steps, "the run's steps (max_steps, or the epochs')")):
        given = params.get(name)
        if given is not None and not is_auto(given) and not _same(given, want):
            raise ConfigError(f"DeepSpeed scheduler.params.{name}={given!r} disagrees with TrainingArguments: "
                              f"{argument} gives {want}; set it to \"auto\" or to {want} (transformers refuses the "
                              f"same mismatch)")
    schedule = ScheduleConfig(warmup_steps=args.get_warmup_steps(max_steps), min_lr_ratio=0.0)
    for path, value, key in translation.assignments:
        if path.startswith("schedule."):
            setattr(schedule, path.removeprefix("schedule."), value)
    if translation.decay_over_run:
        schedule.decay_steps = max(0, max_steps - schedule.warmup_steps)
    translation.set_relative_to(float(args.learning_rate), schedule)  # (the peak is learning_rate: _check_peak_rate)
    schedule.validate()
    return schedule


def client_optimizers(optimizers, deepspeed=None):
    """Trainer(optimizers=(optimizer, scheduler)) as the engine takes them: (the optimizer
    instance or None, a factory of the scheduler over the engine's optimizer or None). The
    engine steps the instance's class over its shards, from the instance's groups and their
    rates before any scheduler (tiertrain/optim.py); a scheduler instance is rebuilt on the
    engine's optimizer, which only a LambdaLR can be (what transformers' get_*_schedule
    functions return: its lr_lambdas are its whole state). ConfigError otherwise, naming why."""
    import torch

    if optimizers is None:
        return None, None
    if not isinstance(optimizers, (tuple, list)) or len(optimizers) != 2:
        raise ConfigError(f"TiertrainTrainer(optimizers={optimizers!r}) is invalid: expected (optimizer, scheduler), "
                          f"either may be None")
    optimizer, scheduler = optimizers
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigError(f"TiertrainTrainer(optimizers=({type(optimizer).__name__}, ...)) is invalid: the first "
                          f"must be a torch.optim.Optimizer built on the model's parameters")
    if optimizer is not None and deepspeed is not None:
        from ..deepspeed_config import read_deepspeed

        blocks = read_deepspeed(deepspeed)
        if "optimizer" in blocks or (scheduler is not None and "scheduler" in blocks):
            raise ConfigError("TiertrainTrainer(optimizers=(...)) and the DeepSpeed config's optimizer or scheduler "
                              "block both name one: remove the block, or pass optimizers=(None, None)")
    if scheduler is None:
        return optimizer, None
    name = type(scheduler).__name__
    if type(scheduler) is not torch.optim.lr_scheduler.LambdaLR:
        raise ConfigError(f"TiertrainTrainer(optimizers=(..., {name})): the engine rebuilds the scheduler on its own "
                          f"optimizer, which it can do for a LambdaLR only (transformers' get_*_schedule_with_warmup); "
                          f"pass optimizers=(optimizer, None) with TrainingArguments' lr_scheduler_type and "
                          f"warmup_steps instead")
    if scheduler.optimizer is not optimizer:
        raise ConfigError("TiertrainTrainer(optimizers=(optimizer, scheduler)): the scheduler is built on another "
                          "optimizer than the one given")
    if scheduler.last_epoch != 0:
        raise ConfigError(f"TiertrainTrainer(optimizers=(..., {name})): the scheduler was stepped "
                          f"{scheduler.last_epoch} time(s) already; give one fresh from its constructor")
    lambdas = list(scheduler.lr_lambdas)
    one = lambdas[0] if all(f is lambdas[0] for f in lambdas) else None
    return optimizer, lambda engine_optimizer: torch.optim.lr_scheduler.LambdaLR(
        engine_optimizer, one if one is not None else lambdas)
