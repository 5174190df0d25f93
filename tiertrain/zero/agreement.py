"""Collective agreement for ZeRO stage 3: every rank must issue the same collectives in the
same order, and this module checks that they do.

When ranks disagree (a module run on some ranks only), gloo exchanges mismatched buffers or
aborts and NCCL hangs. With ``check="traced"`` (the default) each rank's work is a sequence
of *segments* — a forward pass, a backward pass, an optimizer step, a
``gathered_parameters`` fetch outside them — and

* every segment opens with one small agreement (Collectives.check_same) on what opens,
  which also compares a digest of the segment just recorded, if one was;
* the first segment of each kind (forward with or without gradients, backward, ...) is
  *recorded*: its events — each unit's forward, end of forward, backward, last gradient,
  reduce-scatter — are logged, and each of its collectives is agreed first, as before;
* later segments of that kind are *checked locally* against the recording, event by event
  (no communication). A rank whose event differs (a skipped, extra or reordered module), or
  that opens a segment before the previous one reached its end, raises
  CollectiveMismatchError before issuing its next collective, and its Collectives refuses
  every later one. Its peers wait in the collective it skipped until it exits: then gloo
  fails their collective ("Connection closed by peer") and the launcher stops them, naming
  the deviating rank (tiertrain.launch, run_distributed; torchrun stops the job too). With
  NCCL the peers wait until the launcher stops them or the process-group timeout.

So a step costs three small agreements (forward, backward, step) instead of one before each
of its collectives (about three per unit), and none stands between the asynchronous
reduce-scatters of a backward, which each used to wait for. A model whose module order
changes between steps *alike on every rank* fails with the same error; call ``retrace()``
(collective) whenever the order changes, or use ``check="every"`` (an agreement before every
collective, as in the first step; "off": none).

:class:`CollectiveAgreement` holds the recordings and the open segment; the stage-3
ParameterFetcher (``stage3.py``) tells it what happens and when a collective is about to be
issued.
"""
from __future__ import annotations

import array
import hashlib
from collections import Counter
from enum import IntEnum
from typing import Callable

from ..comm import CollectiveMismatchError, Collectives


class Event(IntEnum):
    """What a rank does, as exchanged between ranks by Collectives.check_same. The values are
    part of that exchange (and of the trace digests): never renumber them."""

    # collectives agreed one by one (REDUCE and STEP are announced by the engine)
    GATHER = 1
    REDUCE = 2
    STEP = 3
    # what opens a segment (agreed by every rank)
    FORWARD = 4
    BACKWARD = 5
    OUTSIDE = 6
    RETRACE = 7
    # local events, recorded in or checked against a segment's trace
    VISIT = 8
    RELEASE = 9
    BACKWARD_VISIT = 10
    GRADS_DONE = 11
    RECOMPUTE = 12
    RECOMPUTE_END = 13


CHECKS = ("traced", "every", "off")

# An event code packs the event and a unit index: the index takes the low 20 bits.
_INDEX_BITS = 20

_UNIT_EVENT_WORDING = {
    Event.GATHER: "the all-gather of", Event.REDUCE: "the gradient reduce-scatter of",
    Event.VISIT: "the forward of", Event.RELEASE: "the end of the forward of",
    Event.BACKWARD_VISIT: "the backward of", Event.GRADS_DONE: "the last gradient of",
    Event.RECOMPUTE: "the recomputed forward of", Event.RECOMPUTE_END: "the end of the recomputed forward of",
}
_SEGMENT_NAMES = {
    0: "start", Event.FORWARD: "forward pass", Event.BACKWARD: "backward pass", Event.STEP: "optimizer step",
    Event.OUTSIDE: "gathered_parameters() fetch", Event.RETRACE: "retrace()",
}


def event_code(event: int, index: int = 0) -> int:
    """The integer that stands for `event` on unit `index` in traces and agreements."""
    return (int(event) << _INDEX_BITS) + index


def trace_digest(trace: list[int]) -> int:
    """A 56-bit hash of a trace, the same in every process."""
    return int.from_bytes(hashlib.blake2b(array.array("q", trace).tobytes(), digest_size=7).digest(), "little")


class CollectiveAgreement:
    """Keeps one rank's collectives in step with its peers' (``check``: "traced", "every" or
    "off"; see the module docstring). ``unit_label(index)`` names unit `index` in messages."""

    def __init__(self, comm: Collectives, unit_label: Callable[[int], str], check: str = "traced"):
        self.comm = comm
        self.unit_label = unit_label
        self.check = check
        # check="traced": the recording of each segment kind, the open segment, its trace,
        # whether it is being recorded, and where this rank is in it
        self._recordings: dict[tuple, list[int]] = {}
        self._segment: tuple = (0,)
        self._trace: list[int] = []
        self._recording = True
        self._position = 0
        self._opened: Counter = Counter()

    def describe(self, code: int) -> str:
        """Words for an event code, as they appear in mismatch errors."""
        event, index = divmod(code, 1 << _INDEX_BITS)
        if event == Event.STEP:
            return "the optimizer step"
        if event == Event.FORWARD:
            return "the start of a forward pass" + ("" if index else " without gradients")
        if event == Event.BACKWARD:
            return "the start of a backward pass"
        if event == Event.RETRACE:
            return "retrace()"
        label = self.unit_label(index)
        if event == Event.OUTSIDE:
            return (f"the gather of unit '{label}' outside the engine's passes (gathered_parameters(), or the model "
                    f"called directly: evaluation, generate)")
        return f"{_UNIT_EVENT_WORDING.get(event, 'collective')} unit '{label}'"

    def open(self, event: Event, index: int = 0, key: tuple | None = None) -> None:
        """Open a segment: a forward pass, a backward pass, an optimizer step, a fetch
        outside them (`key` tells segments of one event apart, e.g. forward with or without
        gradients). The previous segment must have run to the end of its trace; all ranks
        agree on what opens, and on the digest of the segment just recorded, if one was."""
        if self.check != "traced":
            if self.check == "every" and event in (Event.STEP, Event.OUTSIDE):
                collective = Event.STEP if event == Event.STEP else Event.GATHER
                self.comm.check_same(event_code(collective, index), self.describe)
            return
        if not self._recording and self._position != len(self._trace):
            self._deviate(self.describe(event_code(event, index)))
        digest = trace_digest(self._trace) if self._recording else 0
        self.comm.check_same(event_code(event, index), self.describe, digest)
        key = key or (event,)
        self._segment = key
        self._opened[key] += 1
        self._recording = key not in self._recordings
        self._trace = self._recordings.setdefault(key, [])
        self._position = 0

    def log(self, event: Event, index: int) -> None:
        """One event of this rank's segment: recorded, or checked against the recording."""
        if self.check != "traced":
            return
        code = event_code(event, index)
        if self._recording:
            self._trace.append(code)
            return
        position = self._position
        if position >= len(self._trace) or self._trace[position] != code:
            self._deviate(self.describe(code))
        self._position = position + 1

    def before_collective(self, event: Event, index: int) -> None:
        """Agree on a collective about to be issued, where collectives are agreed one by one
        (check="every", or while the open segment is being recorded)."""
        if self.check == "every" or (self.check == "traced" and self._recording):
            self.comm.check_same(event_code(event, index), self.describe)

    def expect_segment_end(self, happened: str) -> None:
        """The open segment ends here (`happened` names what ends it): a checked segment must
        have run through its whole recording."""
        if self.check == "traced" and not self._recording and self._position != len(self._trace):
            self._deviate(happened)

    def abandon(self) -> None:
        """The open segment ended early, alike on every rank (a forward or backward that raised
        and was caught): it counts as complete; one being recorded is recorded again next time."""
        if self.check != "traced":
            return
        if self._recording:
            self._recordings.pop(self._segment, None)
            self._trace, self._recording = [], False
        self._position = len(self._trace)

    def forget_recordings(self) -> None:
        """Record every segment kind again from its next segment on (the segment open now,
        a retrace(), stays recorded)."""
        self._recordings = {self._segment: self._trace}

    def _deviate(self, happened: str) -> None:
        """This rank left the trace every rank agreed on: stop before its next collective."""
        event = self._segment[0]
        name = _SEGMENT_NAMES.get(event, "segment") + (
            " without gradients" if self._segment == (Event.FORWARD, False) else "")
        expected = (self.describe(self._trace[self._position]) if self._position < len(self._trace)
                    else f"the end of the {name}")
        message = (
            f"rank {self.comm.rank} reached {happened} as event {self._position + 1} of its {name} "
            f"#{self._opened[self._segment]}, where the trace of every {name} (recorded on the first one and "
            f"identical on every rank) has {expected}: ranks executed different modules, or a module order "
            f"that changes between steps. This rank stops before issuing another collective; the other ranks "
            f"wait in the collective it skips until the launcher stops them (tiertrain.launch and torchrun do). "
            f"Under ZeRO-3 every rank must run the same partitioned modules in the same order; if the order "
            f"changes on purpose, alike on every rank, call engine.fetcher.retrace() on every rank when it "
            f"changes, or construct the fetcher with check='every' (an agreement before every collective).")
        self.comm.fail(message)
        raise CollectiveMismatchError(message)
