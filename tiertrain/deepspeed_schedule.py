"""A DeepSpeed config's ``scheduler`` block and the learning rate it decides (tiertrain/
deepspeed_config.py reads the rest of the file): WarmupLR, WarmupDecayLR and WarmupCosineLR as
tiertrain's schedule, which then gives every update DeepSpeed's rate (tiertrain/optim.py
deepspeed_factor), and which of the optimizer's lr and the scheduler's warmup_max_lr is the peak,
whatever the order of the file's keys (docs/deepspeed.md, "scheduler")."""
from __future__ import annotations

from typing import Any

from .config import ConfigError
from .deepspeed_fates import Translation, checked_number, is_auto, mapped, params_of, refuse_unless


def scheduler(t: Translation, key: str, value: Any) -> None:
    """WarmupLR, WarmupDecayLR and WarmupCosineLR as tiertrain's schedule (warmup from a start
    ratio, linear or log, then constant, linear or cosine decay)."""
    if not isinstance(value, dict):
        raise ConfigError(f"DeepSpeed {key}={value!r} is invalid: expected an object with type and params")
    kind, params = value.get("type"), params_of(key, value)
    if kind not in ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR"):
        t.refuse(f"{key}.type", f"{kind!r}: tiertrain maps WarmupLR, WarmupDecayLR and WarmupCosineLR; another "
                                f"schedule is passed in code (lr_scheduler=)")
        return
    t.set(f"{key}.type", "schedule.deepspeed_scheduler", kind, "DeepSpeed's rates, update for update")
    known = _SCHEDULER_PARAMS[kind]
    for name in params:
        if name not in known:  # (DeepSpeed passes them to the class as keyword arguments: a TypeError there)
            t.refuse(f"{key}.params.{name}", f"not a parameter of DeepSpeed's {kind}; valid: {', '.join(known)}")
    if "last_batch_iteration" in params:
        refuse_unless(-1, "a schedule that starts part way is a resumed run's: resume from its checkpoint")(
            t, f"{key}.params.last_batch_iteration", params["last_batch_iteration"])
    warmup = params.get("warmup_num_steps", 1000)
    mapped("schedule.warmup_steps", integer=True, minimum=1)(t, f"{key}.params.warmup_num_steps", warmup)
    shape = params.get("warmup_type", "log")
    if shape not in ("log", "linear"):
        raise ConfigError(f"DeepSpeed {key}.params.warmup_type={shape!r} is invalid: expected 'log' or 'linear'")
    t.set(f"{key}.params.warmup_type", "schedule.warmup_shape", shape)
    if kind == "WarmupCosineLR":
        mapped("schedule.warmup_start_ratio", minimum=0)(t, f"{key}.params.warmup_min_ratio",
                                                          params.get("warmup_min_ratio", 0.0))
        mapped("schedule.min_lr_ratio", minimum=0)(t, f"{key}.params.cos_min_ratio",
                                                   params.get("cos_min_ratio", 0.0001))
    else:
        _warmup_rates(t, key, kind, params)
    if kind == "WarmupLR":
        t.set(f"{key}.type", "schedule.decay_steps", 0, "constant after warmup")
        return
    total = params.get("total_num_steps")
    if total is None:
        raise ConfigError(f"DeepSpeed {key}.params.total_num_steps is missing: {kind} needs it")
    if is_auto(total) or is_auto(warmup):
        t.fates.append((f"{key}.params.total_num_steps", "auto: decay over the run's steps after warmup"))
        t.decay_over_run = True
    else:
        t.set(f"{key}.params.total_num_steps", "schedule.decay_steps",
              max(0, checked_number("total_num_steps", total, integer=True) - int(warmup)), "total_num_steps - warmup")
    t.set(f"{key}.type", "schedule.decay_shape", "linear" if kind == "WarmupDecayLR" else "cosine")


_WARMUP = ("warmup_num_steps", "warmup_type", "last_batch_iteration")
_SCHEDULER_PARAMS = {
    "WarmupLR": ("warmup_min_lr", "warmup_max_lr", *_WARMUP),
    "WarmupDecayLR": ("total_num_steps", "warmup_min_lr", "warmup_max_lr", *_WARMUP),
    "WarmupCosineLR": ("total_num_steps", "warmup_min_ratio", "cos_min_ratio", *_WARMUP),
}
"""The keyword arguments of DeepSpeed's scheduler classes (deepspeed/runtime/lr_schedules.py, 0.19)."""
DECAY_LR_PEAK = 0.001
"""DeepSpeed's WarmupDecayLR warmup_max_lr when the file leaves it out (its WarmupLR takes the
optimizer's lr instead: deepspeed/runtime/lr_schedules.py, 0.19)."""


def optimizer_lr(ds: dict) -> Any:
    """The optimizer block's params.lr as the file gives it; None where it gives none (or
    the block is malformed, which its own handler refuses)."""
    block = ds.get("optimizer")
    params = block.get("params") if isinstance(block, dict) else None
    return params.get("lr") if isinstance(params, dict) else None


def scheduler_peak(scheduler: Any) -> tuple[str, float] | None:
    """(key, rate) where the scheduler block sets the peak rate itself, overwriting the
    optimizer's lr in every param group before the first step: WarmupLR's warmup_max_lr when
    given, WarmupDecayLR's always (its default 0.001); None where the optimizer's lr is the
    peak (WarmupLR without warmup_max_lr, WarmupCosineLR's ratios, no scheduler) or the value
    is "auto" (the run's rate)."""
    if not isinstance(scheduler, dict) or not isinstance(scheduler.get("params", {}), dict):
        return None
    kind, params = scheduler.get("type"), scheduler.get("params", {})
    key = "scheduler.params.warmup_max_lr"
    if kind == "WarmupDecayLR" and "warmup_max_lr" not in params:
        return f"{key} (absent: WarmupDecayLR's default)", DECAY_LR_PEAK
    value = params.get("warmup_max_lr") if kind in ("WarmupLR", "WarmupDecayLR") else None
    if value is None or is_auto(value):
        return None
    return key, checked_number(key, value, minimum=0)


def _warmup_rates(t: Translation, key: str, kind: str, params: dict) -> None:
    """WarmupLR / WarmupDecayLR: the rate goes from warmup_min_lr to the peak (warmup_max_lr,
    or the optimizer's lr where WarmupLR has none) and WarmupDecayLR back down to
    warmup_min_lr at total_num_steps; tiertrain's schedule scales optimizer.lr, so the peak is
    optimizer.lr and warmup_min_lr a ratio of it."""
    low = params.get("warmup_min_lr", 0.0)
    if t.peak is not None:
        peak_key, peak = t.peak
        t.set(peak_key, "optimizer.lr", peak, f"DeepSpeed's {kind} sets every group's rate from it")
    else:
        peak = optimizer_lr(t.source) if kind == "WarmupLR" else None
        peak = None if peak is None or is_auto(peak) else checked_number("optimizer.params.lr", peak, minimum=0)
        if "warmup_max_lr" in params:
            t.fates.append((f"{key}.params.warmup_max_lr", "auto: tiertrain's optimizer.lr"))
        else:
            t.fates.append((f"{key}.params.warmup_max_lr (absent)", "the optimizer's lr is the peak (DeepSpeed's "
                                                                     "WarmupLR warms up to it)"))
    fields = ["warmup_start_ratio", *(["min_lr_ratio"] if kind == "WarmupDecayLR" else [])]
    what = " and ".join(f"schedule.{f}" for f in fields)
    if is_auto(low):
        t.fates.append((f"{key}.params.warmup_min_lr", f"auto: tiertrain's {what}"))
        return
    low = checked_number(f"{key}.params.warmup_min_lr", low, minimum=0)
    if peak is None:  # (the run's rate: known to Translation.finish, or to the Trainer's arguments)
        t.relative_to_lr.update(dict.fromkeys(fields, low))
        t.fates.append((f"{key}.params.warmup_min_lr", f"→ {what} = {low!r} / optimizer.lr"))
        return
    if peak <= 0:
        raise ConfigError(f"DeepSpeed {key}.params.warmup_max_lr={peak!r} is invalid: expected a rate > 0")
    for f in fields:
        t.set(f"{key}.params.warmup_min_lr", f"schedule.{f}", low / peak)


__all__ = ["DECAY_LR_PEAK", "optimizer_lr", "scheduler", "scheduler_peak"]
