"""Named intervals of the training timeline: the engine and its parts mark their phases with
``span("step/update")``, so that a trace recorded with ``--logging.trace_steps`` shows what ran
when, on which thread (tiertrain/observe/trace.py).

A span is a torch.profiler.record_function (the profiler records it on the thread that started
the profiler) and, while a trace is recording, also an entry of that trace's Timeline, from any
thread: torch's profiler does not see the threads an update form runs its work on (the delayed
update, the NVMe step) through public API. Outside a trace a span costs a few microseconds.
"""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import torch

PREFIX = "tiertrain/"
"""Every span's name starts with this."""


class Timeline:
    """Spans of every thread while it is recording: (thread id, thread name, name, start and
    end in time.time_ns())."""

    def __init__(self):
        self.spans: list[tuple[int, str, str, int, int]] = []
        self._lock = threading.Lock()

    def add(self, name: str, start_ns: int, end_ns: int) -> None:
        thread = threading.current_thread()
        with self._lock:
            self.spans.append((thread.ident, thread.name, name, start_ns, end_ns))


_RECORDING: list[Timeline] = []
"""The timelines recording now (a trace is process-wide, as torch's profiler is): start_recording
and stop_recording change it; every span is added to each."""


def start_recording(timeline: Timeline) -> None:
    _RECORDING.append(timeline)


def stop_recording(timeline: Timeline) -> None:
    _RECORDING.remove(timeline)


@contextlib.contextmanager
def span(name: str) -> Iterator[None]:
    """A named interval of the timeline."""
    with torch.profiler.record_function(PREFIX + name):
        if not _RECORDING:
            yield
            return
        start = time.time_ns()
        try:
            yield
        finally:
            end = time.time_ns()
            for timeline in list(_RECORDING):
                timeline.add(name, start, end)
