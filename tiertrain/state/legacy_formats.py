"""Read only, for checkpoints written before the update forms' state formats became types
(tiertrain/update/state_format.py; tiertrain at commit 661023e and before): what their tags
mean in today's formats. Nothing writes these tags any more; this module only lets such
checkpoints load, at their own layout and resharded.

Those checkpoints named the state's format in three places, each differently:

- the layout fingerprint (COMMITTED.json "layouts"), under "optimizer_tier": "memory" or
  "nvme" (today "state_format": a format's TAG);
- each rank's shard layout (COMMITTED.json "shards"), under "form": the class name of the
  update form that saved it (today "state_format": the format's record);
- the NVMe stream's state in the rank file, under "rule": the repr of its update rule, from
  which the names of its state slots were read (today "state_names").
"""
from __future__ import annotations

from typing import Callable

from ..errors import CheckpointError
from ..update.state_format import FormOwnState, NVMeStreamState, StateFormat, TorchOptimizerState

__all__ = ["FORMAT_OF_FORM", "FORMAT_OF_TIER", "PUBLISHING_FORMS", "STATE_NAMES_OF_RULE", "fingerprint_tag",
           "format_of", "format_type", "state_names_of_rule", "written_before_types"]

FORMAT_OF_FORM: dict[str, type[StateFormat]] = {
    "InMemoryUpdate": TorchOptimizerState,
    "DelayedUpdate": TorchOptimizerState,
    "WholeParameterUpdate": TorchOptimizerState,
    "NVMeUpdate": NVMeStreamState,
    "OverlappedNVMeUpdate": NVMeStreamState,
}
"""Old "form" (the saving form's class name) -> the format of its state. Any other name was a
form written outside the library, whose state was never read: FormOwnState."""

PUBLISHING_FORMS = frozenset({"DelayedUpdate"})
"""Old forms whose state may also hold "published" shards (TorchOptimizerState.published)."""

FORMAT_OF_TIER: dict[str, type[StateFormat]] = {"memory": TorchOptimizerState, "nvme": NVMeStreamState}
"""Old fingerprint "optimizer_tier" -> the format, where the shard layout names no form (a
checkpoint saved before resharding existed)."""

STATE_NAMES_OF_RULE: dict[str, tuple[str, ...]] = {
    "AdamWRule(": ("exp_avg", "exp_avg_sq"),
    "SGDRule(": ("momentum_buffer",),
}
"""Old NVMe "rule" (the rule's repr, by its start) -> what the stream's state slots hold."""


def written_before_types(description: dict) -> bool:
    """A shard layout as checkpoints recorded it before the formats were types."""
    return "state_format" not in description and "form" in description


def format_type(form: str) -> type[StateFormat]:
    """The format of the state an old form (its class name) saved."""
    return FORMAT_OF_FORM.get(form, FormOwnState)


def format_of(description: dict, nvme_state: Callable[[], dict]) -> StateFormat:
    """The format of an old shard layout's state; nvme_state: the rank file's NVMe stream state
    (read only for an NVMe form, whose slot names the rank file alone records)."""
    kind = format_type(description["form"])
    if kind is NVMeStreamState:
        return NVMeStreamState(state_names_of_rule(nvme_state()["rule"]))
    if kind is TorchOptimizerState:
        return TorchOptimizerState(published=description["form"] in PUBLISHING_FORMS)
    return kind()


def state_names_of_rule(rule: str) -> tuple[str, ...]:
    """The state slot names of an old NVMe state's rule (its repr)."""
    for start, names in STATE_NAMES_OF_RULE.items():
        if rule.startswith(start):
            return names
    raise CheckpointError(f"the NVMe optimizer state names the update rule {rule[:80]!r}; the rules known are "
                          f"{[s.rstrip('(') for s in STATE_NAMES_OF_RULE]}")


def fingerprint_tag(layout: dict, description: dict | None) -> str:
    """The state format's tag of an old layout fingerprint, from its shard layout's form where
    recorded (which tells a form written outside the library from the library's in-memory
    forms, both "memory"), else from its "optimizer_tier"."""
    if description is not None and "form" in description:
        return format_type(description["form"]).TAG
    tier = layout["optimizer_tier"]
    if tier not in FORMAT_OF_TIER:
        raise CheckpointError(f"the checkpoint's layout names the optimizer tier {tier!r}; the tiers known are "
                              f"{list(FORMAT_OF_TIER)}")
    return FORMAT_OF_TIER[tier].TAG
