"""The state format a checkpoint records, read back as a type of tiertrain/update/state_format.py:
by the tag the format chose (never by the class name of the form that saved it), or, in a
checkpoint written before the formats were types, through tiertrain/state/legacy_formats.py.
A tag this version does not know is refused by name.
"""
from __future__ import annotations

from typing import Callable

from ..errors import CheckpointError
from ..update.state_format import FORMATS, NVMeStreamState, StateFormat
from . import legacy_formats

__all__ = ["fingerprint_tag", "format_type", "recorded_format", "recorded_type"]


def format_type(tag: str) -> type[StateFormat]:
    """The format named by tag; a CheckpointError naming it and the tags known otherwise."""
    for kind in FORMATS:
        if kind.TAG == tag:
            return kind
    raise CheckpointError(f"the checkpoint's optimizer state is in the format {tag!r}, which this version of "
                          f"tiertrain does not know (it knows {[k.TAG for k in FORMATS]})")


def recorded_type(description: dict) -> type[StateFormat]:
    """The format of the state a rank's shard layout (shard_layout.describe) says it saved."""
    if legacy_formats.written_before_types(description):
        return legacy_formats.format_type(description["form"])
    return format_type(description["state_format"]["tag"])


def recorded_format(description: dict, nvme_state: Callable[[], dict]) -> StateFormat:
    """The format, fields and all, of the state a rank's shard layout says it saved;
    nvme_state: that rank file's NVMe stream state (read only for a checkpoint written before
    the formats were types, whose rank file alone names the stream's state slots)."""
    if legacy_formats.written_before_types(description):
        return legacy_formats.format_of(description, nvme_state)
    record = description["state_format"]
    kind = format_type(record["tag"])
    values = {k: v for k, v in record.items() if k != "tag"}
    if kind is NVMeStreamState:
        names = values.get("state_names")
        if not (isinstance(names, list) and 1 <= len(names) <= 2 and all(isinstance(n, str) for n in names)):
            raise CheckpointError(f"the checkpoint's NVMe state names its slots {names!r}, not one or two names")
        values["state_names"] = tuple(names)
    return kind(**values)


def fingerprint_tag(layout: dict, description: dict | None) -> str:
    """The tag of the state format a rank's layout fingerprint records (description: its shard
    layout, None where the checkpoint records none)."""
    if "state_format" in layout:
        return format_type(layout["state_format"]).TAG
    return legacy_formats.fingerprint_tag(layout, description)
