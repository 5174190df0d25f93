"""Seconds the training thread spends blocked, by kind: the "waits on IO and communication"
of the step-time breakdown (tiertrain/trainer/loop.py).

A :class:`WaitClock` is owned by what it times (a CommCounter for a group's collectives, a
TensorSwapper for its swap IO) and read by the engine (``Engine.wait_seconds``). Only waits
in the main thread count: background threads (the reducer's landing, the overlapped NVMe
step, an asynchronous checkpoint) wait *beside* the step, not in it, and counting them
would give waits longer than the step.

Here too is the run's one timeout (:func:`run_timeout`), the longest any of those waits may
last: collectives (tiertrain.comm), pipeline transfers and swap IO (tiertrain.io) all read it.
"""
from __future__ import annotations

import contextlib
import math
import os
import threading
import time
from typing import Iterator

__all__ = ["DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "WaitClock", "run_timeout"]

DEFAULT_TIMEOUT_S = 600.0
"""The run's timeout when none is given (``tiertrain train --timeout``): the longest any
collective, point-to-point transfer or swap IO may wait before the run fails."""

TIMEOUT_ENV = "TIERTRAIN_TIMEOUT_S"
"""Set by tiertrain.launch in every rank (to the process group's timeout), so that waits
built deep inside the engine (collectives, pipeline transfers, swap IO) use the same value
as the process group without each constructor being handed it."""


def run_timeout() -> float:
    """The run's one timeout in seconds: $TIERTRAIN_TIMEOUT_S (set by tiertrain.launch from
    ``--timeout`` for every rank), else DEFAULT_TIMEOUT_S. Read at construction time of each
    waiting object, not at import: the launcher imports this module before it knows the value."""
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(value)
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return seconds if math.isfinite(seconds) and seconds > 0 else DEFAULT_TIMEOUT_S


class WaitClock:
    """Cumulative seconds the main thread spent inside :meth:`timing` blocks."""

    def __init__(self) -> None:
        self.seconds = 0.0
        """Total so far (monotonic; readers take differences)."""

    @contextlib.contextmanager
    def timing(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds += time.perf_counter() - started

    def __repr__(self) -> str:
        return f"WaitClock(seconds={self.seconds:.3f})"
