"""What an update form's checkpoint state is, as a type each form declares
(``OptimizerUpdate.state_format``), so that tiertrain/state/ reads and reshards a checkpoint by
its format, never by which class saved it.

A checkpoint records a format by its :attr:`StateFormat.TAG`, a constant chosen here once and
never derived from a class name: renaming or subclassing a form, or one of these classes,
changes nothing a checkpoint holds. The layout fingerprint records the tag alone (a checkpoint
loads as it is into a form of the same format); each rank's shard layout records the whole
:meth:`StateFormat.record` (the tag and the format's fields, such as the NVMe stream's state slot
names), so what a rank file holds is known without unpickling it.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    from ..elementwise import ElementwiseRule

__all__ = ["FORMATS", "FormOwnState", "NVMeStreamState", "StateFormat", "TorchOptimizerState"]


class StateFormat:
    """The format of an update form's state_dict in a checkpoint (the concrete formats below)."""

    TAG: ClassVar[str]
    """What checkpoints record for this format (stable: changing it changes the file format)."""

    def record(self) -> dict:
        """This format as a checkpoint's shard layout records it: {"tag": TAG, field: value}
        (JSON-like; tiertrain/state/shard_layout.py reads it back)."""
        out: dict = {"tag": self.TAG}
        for f in fields(self):  # type: ignore[arg-type]  (every format is a dataclass)
            value = getattr(self, f.name)
            out[f.name] = list(value) if isinstance(value, tuple) else value
        return out


@dataclass(frozen=True)
class TorchOptimizerState(StateFormat):
    """A torch optimizer's state held in memory, keyed by *piece*: views of this rank's fp32
    master shards (one per parameter per shard), or whole parameters on the rank that steps
    them (update/whole.py). The form's state_dict is {"masters", "optimizer" (torch's
    state_dict), "schedule"}; tiertrain/state/shard_layout.py records where each piece lies in
    its parameter from the form's ``optimizer``, which is what lets it reshard."""

    TAG: ClassVar[str] = "torch_optimizer"

    published: bool = False
    """The state may also hold "published": the compute-dtype shards one update behind the
    masters (the delayed update, update/delayed.py), cut like the masters when resharded."""


@dataclass(frozen=True)
class NVMeStreamState(StateFormat):
    """The NVMe stream's per-shard records (update/nvme/): each shard's fp32 master and two
    state slots, kept under AdamW's names ("exp_avg", "exp_avg_sq") whatever the rule, the
    stream's step count and the steps each piece was left out of."""

    TAG: ClassVar[str] = "nvme_stream"

    state_names: tuple[str, ...]
    """What the slots hold, by the torch optimizer's names, in slot order: AdamW's two moments,
    SGD's momentum buffer alone (its second slot is unused)."""

    @classmethod
    def of_rule(cls, rule: "ElementwiseRule") -> "NVMeStreamState":
        """The format of a stream stepped by rule (its slots' names, from the rule itself)."""
        return cls(tuple(rule.state_names))


@dataclass(frozen=True)
class FormOwnState(StateFormat):
    """The form's own state_dict, which tiertrain/state/ saves and restores whole without
    reading it: it loads at the layout it was saved at, never resharded. The default of a form
    written outside the library; one whose state is one of the formats above declares that."""

    TAG: ClassVar[str] = "form_own"


FORMATS: tuple[type[StateFormat], ...] = (TorchOptimizerState, NVMeStreamState, FormOwnState)
"""Every format, the ones a checkpoint may name (by TAG)."""
