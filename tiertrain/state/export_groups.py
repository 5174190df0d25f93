"""The tensors of an export as the checkpoint holds them, when that is not one tensor per model
tensor under its own name: groups of model tensors written as other tensors (transformers'
checkpoint conversion, tiertrain/state/hf_conversion.py; a PEFT merge, tiertrain/state/peft_export.py),
for the streaming writers of tiertrain/state/export.py and tiertrain/state/consolidate.py.

An item of a converted group waits for the last unit its members are in; its value is made
when it is written, from its members' values, one group at a time (ConvertedValues), the
members of earlier units kept until then (GroupMembers).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn

from .hf_conversion import SaveGroup, saving_groups

Item = Any
"""tiertrain.state.export's _Item (a frozen dataclass: name, shape, dtype, position, unit, slot,
value, group, members); typed loosely here, as export imports this module."""


def converted_items(module: nn.Module, items: list[Item]) -> list[Item]:
    """items (the model's tensors under their state_dict names) as the model's Hugging Face
    checkpoint holds them: through its checkpoint conversion (hf_conversion.saving_groups:
    experts unstacked, layers renamed), in the model's order. A converted tensor waits for the
    last unit its group's members are in; positions follow that order."""
    groups = saving_groups(module, {i.name: i.shape for i in items})
    return items if groups is None else grouped_items(items, groups)


def grouped_items(items: list[Item], groups: list[SaveGroup]) -> list[Item]:
    """The checkpoint's items from the model's, one group at a time (a group renamed: its
    member under the new name; converted: each output waiting for its members' last unit)."""
    by_name = {i.name: i for i in items}
    out: list[Item] = []
    for g in groups:
        members = tuple(by_name[m] for m in g.members)
        if g.renames_only:
            (name, _), = g.outputs.items()
            out.append(dataclasses.replace(members[0], name=name, members=members))  # (renamed only)
            continue
        units = [m.unit for m in members if m.unit is not None]
        first = min(members, key=lambda m: m.position)
        for name, shape in g.outputs.items():
            out.append(type(first)(name, shape, first.dtype, first.position, max(units) if units else None,
                             group=g, members=members))
    order = sorted(range(len(out)), key=lambda k: (out[k].unit is None, out[k].unit or 0, out[k].position, k))
    return [dataclasses.replace(out[k], position=n) for n, k in enumerate(order)]


class ConvertedValues:
    """The values of converted items, each group converted once and each of its outputs handed
    out once (only those this writer writes are kept: at most one group's outputs at a time
    when items are taken in order). member_value gives a member's value."""

    def __init__(self, module: nn.Module, items: list[Item], member_value: Callable[[Item], torch.Tensor]):
        self.module = module
        self.member_value = member_value
        self.wanted = {i.name for i in items if i.group is not None}
        self.ready: dict[str, torch.Tensor] = {}

    def __call__(self, item: Item) -> torch.Tensor:
        if item.name not in self.ready:
            values = {m.name: self.member_value(m) for m in item.members}
            converted = item.group.convert(values, self.module)
            del values
            self.ready.update({k: v for k, v in converted.items() if k in self.wanted})
        self.wanted.discard(item.name)
        return self.ready.pop(item.name)


class GroupMembers:
    """The members of the converted groups this rank writes, kept from their unit's gather
    until the group is converted: a view of the gathered unit when the group is complete with
    it, else a copy (the unit is dropped before the next one is gathered)."""

    def __init__(self, items: list[Item]):
        self.last_unit = {m.name: i.unit for i in items if i.group is not None for m in i.members}
        self.by_unit: dict[int, dict[str, Item]] = {}
        for i in items:
            for m in (i.members if i.group is not None else ()):
                if m.unit is not None:
                    self.by_unit.setdefault(m.unit, {})[m.name] = m
        self.kept: dict[str, torch.Tensor] = {}

    def collect(self, unit: int, cut: Callable[[Item], torch.Tensor]) -> None:
        for name, m in self.by_unit.get(unit, {}).items():
            value = cut(m)
            self.kept[name] = value if self.last_unit[name] == unit else value.clone()

    def take(self, m: Item) -> torch.Tensor:
        return m.value if m.unit is None else self.kept.pop(m.name)


__all__ = ["ConvertedValues", "GroupMembers", "converted_items", "grouped_items"]
