"""The fates a DeepSpeed config key can have (tiertrain/deepspeed_config.py, docs/deepspeed.md):
mapped to a tiertrain field, no effect (with the reason), or refused (with the reason); the
Translation that collects them, and the handlers the key tables are written with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from .config import ConfigError

AUTO = "auto"


@dataclass
class Translation:
    """A DeepSpeed config as tiertrain config values."""

    values: dict[str, dict | Any] = field(default_factory=dict)
    """Nested tiertrain config values ({"zero": {"stage": 3}, ...}), as a --config file holds them."""
    fates: list[tuple[str, str]] = field(default_factory=list)
    """(DeepSpeed key, what became of it), in the file's order."""
    refused: list[tuple[str, str]] = field(default_factory=list)
    """(DeepSpeed key, why it cannot be honoured)."""
    assignments: list[tuple[str, Any, str]] = field(default_factory=list)
    """(tiertrain field, value, the DeepSpeed key it came from), in order."""
    decay_over_run: bool = False
    """total_num_steps "auto": the decay spans the run's steps after warmup (:meth:`finish`)."""
    source: dict = field(default_factory=dict)
    """The whole DeepSpeed config, for a section whose meaning depends on another (the
    scheduler's rate replaces the optimizer's)."""
    peak: tuple[str, float] | None = None
    """(DeepSpeed key, rate) where the scheduler sets the peak rate itself (WarmupLR's and
    WarmupDecayLR's warmup_max_lr): the optimizer's own lr then has no effect."""
    relative_to_lr: dict[str, float] = field(default_factory=dict)
    """schedule fields that are a rate of the file (warmup_min_lr) divided by a peak the file
    leaves to the run (WarmupLR warms up to the optimizer's lr: tiertrain's optimizer.lr, or
    TrainingArguments' learning_rate): set by :meth:`finish` once the rate is known."""

    def finish(self, cfg) -> None:
        """What needs the whole config (a TrainConfig): the decay of an "auto" total_num_steps,
        the ratios to a peak rate the file leaves to the run."""
        if self.decay_over_run:
            cfg.schedule.decay_steps = max(0, cfg.steps - cfg.schedule.warmup_steps)
        self.set_relative_to(cfg.optimizer.lr, cfg.schedule)
        cfg.validate()

    def set_relative_to(self, lr: float, schedule) -> None:
        """schedule's fields of :attr:`relative_to_lr`, for a peak rate ``lr``."""
        for name, rate in self.relative_to_lr.items():
            if lr <= 0:
                raise ConfigError(f"DeepSpeed scheduler.params.warmup_min_lr={rate!r} needs a peak rate > 0 to "
                                  f"start from, and the optimizer's lr is {lr!r}")
            setattr(schedule, name, rate / lr)

    def lines(self) -> list[str]:
        return [f"{key}: {fate}" for key, fate in self.fates]

    def set(self, key: str, path: str, value: Any, note: str = "") -> None:
        section, _, name = path.rpartition(".")
        target = self.values
        for part in filter(None, section.split(".")):
            target = target.setdefault(part, {})
        target[name] = value
        self.assignments.append((path, value, key))
        self.fates.append((key, f"→ {path} = {value!r}" + (f" ({note})" if note else "")))

    def no_effect(self, key: str, why: str) -> None:
        self.fates.append((key, f"no effect: {why}"))

    def refuse(self, key: str, why: str) -> None:
        self.refused.append((key, why))


def is_auto(value: Any) -> bool:
    return isinstance(value, str) and value == AUTO


def checked_number(key: str, value: Any, integer: bool = False, minimum: float | None = 0,
            maximum: float | None = None) -> float | int:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    try:
        ok = ok and math.isfinite(value) and (not integer or float(value).is_integer())
    except OverflowError:  # (an integer beyond any float)
        ok = False
    if not ok or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        kind = "an integer" if integer else "a number"
        bounds = [f">= {minimum}"] * (minimum is not None) + [f"<= {maximum}"] * (maximum is not None)
        raise ConfigError(f"DeepSpeed {key}={value!r} is invalid: expected {kind}"
                          + (f" {' and '.join(bounds)}" if bounds else "") + ' or "auto"')
    return int(value) if integer else float(value)


def mapped(path: str, integer: bool = False, minimum: float | None = 0, convert=None, note: str = "",
            maximum: float | None = None):
    def handle(t: Translation, key: str, value: Any) -> None:
        if is_auto(value):
            t.fates.append((key, f"auto: tiertrain's {path}"))
            return
        number = checked_number(key, value, integer, minimum, maximum)
        t.set(key, path, convert(number) if convert else number, note)
    return handle


def no_effect(why: str):
    return lambda t, key, value: t.no_effect(key, why)


def enabled_inside(value: Any, path: str = "") -> list[str]:
    """The paths of every ``enabled`` flag set true in a DeepSpeed section, at any depth (each
    of DeepSpeed's switches, data_efficiency.data_routing.random_ltd.enabled and the like,
    defaults to false, so a section with none set true does nothing)."""
    if not isinstance(value, dict):
        return []
    found = [f"{path}enabled"] if value.get("enabled", False) else []
    for name, inner in value.items():
        found += enabled_inside(inner, f"{path}{name}.")
    return found


def params_of(key: str, value: dict) -> dict:
    """The section's "params" object ({} where absent or null)."""
    params = value.get("params")
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise ConfigError(f"DeepSpeed {key}.params={params!r} is invalid: expected an object of parameters")
    return params


def refuse_unless(default: Any, why: str, same: tuple = ()):
    """Refuse the key unless it holds default (or "auto"), or a value in ``same``: what
    tiertrain always does (e.g. communication_data_type "fp32"). A section whose default is
    ``{"enabled": False}`` is refused only where a switch in it is on."""
    section = isinstance(default, dict) and default.get("enabled") is False

    def handle(t: Translation, key: str, value: Any) -> None:
        if value == default or is_auto(value):
            t.no_effect(key, f"{value!r}, the default (tiertrain: the same)")
        elif section and isinstance(value, dict):
            switched_on = enabled_inside(value)
            if switched_on:
                t.refuse(key, f"{', '.join(switched_on)} true: {why}")
            else:
                t.no_effect(key, "not enabled (its other keys configure what is off)")
        elif value in same:
            t.no_effect(key, f"{value!r}: tiertrain always does it ({why})")
        else:
            t.refuse(key, f"{value!r}: {why}")
    return handle


__all__ = ["AUTO", "Translation", "checked_number", "enabled_inside", "is_auto", "mapped", "no_effect", "params_of",
           "refuse_unless"]
