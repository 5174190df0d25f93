"""Seconds the training thread spends blocked, by kind: the "waits on IO and communication"
of the step-time breakdown (tiertrain/trainer/loop.py).

A :class:`WaitClock` is owned by what it times (a CommCounter for a group's collectives, a
TensorSwapper for its swap IO) and read by the engine (``Engine.wait_seconds``). Only waits
in the main thread count: background threads (the reducer's landing, the overlapped NVMe
step, an asynchronous checkpoint) wait *beside* the step, not in it, and counting them
would give waits longer than the step.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

__all__ = ["WaitClock"]


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
