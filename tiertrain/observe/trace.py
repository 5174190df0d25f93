"""A timeline of training steps: what ran when, on which thread (issue 36, item 4).

The engine marks its phases with named spans (tiertrain/spans.py): forward, backward, the
step's reduction wait, norm, update and publish, waits for collectives and copies, and the
work update forms run on their own threads.
``tiertrain train --logging.trace_steps N`` records N optimizer steps with torch's profiler
and writes them as a Chrome trace (``trace-rank<r>.json``, open it in Perfetto or
chrome://tracing); ``tiertrain plot`` draws each trace of a run as ``trace-rank<r>.png``, one
row per span per thread, so that overlap (or its absence) is visible on a CPU machine too,
where there is no GPU to time.
"""
from __future__ import annotations

import gzip
import json
import os
import threading
from dataclasses import dataclass

import torch

from ..spans import PREFIX, Timeline, start_recording, stop_recording


def trace_path(logging, rank: int) -> str:
    """Where rank's trace goes: trace-rank<r>.json beside logging.metrics_file (in runs/ without one)."""
    directory = os.path.dirname(logging.metrics_file) if logging.metrics_file else "runs"
    return os.path.join(directory or ".", f"trace-rank{rank}.json")


class StepTrace:
    """Records optimizer steps first_step .. first_step + steps - 1 (numbered as the caller
    numbers them) with torch's profiler and writes them to path as a Chrome trace."""

    def __init__(self, path: str, steps: int, first_step: int = 1):
        self.path = path
        self.steps = steps
        self.first_step = first_step
        self._profiler = None
        self._timeline: Timeline | None = None
        self._thread = 0
        self.written = False

    def before_step(self, step: int) -> None:
        """Call before optimizer step ``step`` begins (its first forward)."""
        if self.steps > 0 and step == self.first_step and self._profiler is None and not self.written:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._profiler = torch.profiler.profile(activities=activities)
            self._timeline = Timeline()
            self._thread = threading.get_ident()
            self._profiler.__enter__()
            start_recording(self._timeline)

    def after_step(self, step: int) -> None:
        """Call after optimizer step ``step`` returned: the trace is written after the last."""
        if self._profiler is not None and step >= self.first_step + self.steps - 1:
            self.close()

    def close(self) -> None:
        """Stop recording and write what was recorded (nothing if nothing was)."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        stop_recording(self._timeline)
        profiler.__exit__(None, None, None)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        profiler.export_chrome_trace(self.path)
        self._add_other_threads()
        self.written = True

    def _add_other_threads(self) -> None:
        """The spans of threads other than the profiled one, into the written trace, on its
        clock (the profiler's ts is microseconds after the file's baseTimeNanoseconds)."""
        others = [s for s in self._timeline.spans if s[0] != self._thread]
        if not others:
            return
        with open(self.path) as f:
            trace = json.load(f)
        base = int(trace.get("baseTimeNanoseconds", 0))
        pid = os.getpid()
        events = trace.setdefault("traceEvents", [])
        for tid, thread_name in sorted({(s[0], s[1]) for s in others}):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread_name}})
        for tid, _, name, start, end in others:
            events.append({"ph": "X", "cat": "user_annotation", "name": PREFIX + name, "pid": pid, "tid": tid,
                           "ts": (start - base) / 1e3, "dur": (end - start) / 1e3})
        with open(self.path, "w") as f:
            json.dump(trace, f)


@dataclass(frozen=True)
class Span:
    thread: str
    name: str
    start_s: float
    duration_s: float


def load_spans(path: str) -> list[Span]:
    """The tiertrain spans of a Chrome trace file (.json, or gzipped .json.gz), times in seconds
    from the first span."""
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        events = json.load(f)
    events = events.get("traceEvents", []) if isinstance(events, dict) else events
    picked = [e for e in events if e.get("ph") == "X" and str(e.get("name", "")).startswith(PREFIX)]
    if not picked:
        raise ValueError(f"{path}: no {PREFIX}* spans (not a trace written by --logging.trace_steps?)")
    t0 = min(float(e["ts"]) for e in picked)
    return [Span(f"{e.get('pid')}/{e.get('tid')}", e["name"][len(PREFIX):], (float(e["ts"]) - t0) / 1e6,
                 float(e.get("dur", 0.0)) / 1e6) for e in picked]


def plot_trace(path: str, out_path: str) -> str:
    """Draw the spans of the trace at path as out_path (a PNG): one row per (thread, span), the
    main thread's first, bars where each span ran."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise ImportError(f"tiertrain plot needs matplotlib, which cannot be imported here ({e}): "
                          f"`pip install matplotlib`") from e
    spans = load_spans(path)
    main = {s.thread for s in spans if s.name == "forward"}
    threads = []
    for s in sorted(spans, key=lambda s: (s.thread not in main, s.start_s)):  # (the training thread first)
        if s.thread not in threads:
            threads.append(s.thread)
    rows = sorted({(s.thread, s.name) for s in spans},
                  key=lambda r: (threads.index(r[0]), min(s.start_s for s in spans if (s.thread, s.name) == r)))
    fig = Figure(figsize=(12, 0.35 * len(rows) + 1.2))
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    names = sorted({s.name.split("/")[0] for s in spans})
    colour = {n: f"C{i % 10}" for i, n in enumerate(names)}
    for y, row in enumerate(rows):
        bars = [(s.start_s, s.duration_s) for s in spans if (s.thread, s.name) == row]
        ax.broken_barh(bars, (y - 0.4, 0.8), color=colour[row[1].split("/")[0]])
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([f"thread {threads.index(t)}: {n}" for t, n in rows], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("seconds")
    ax.set_title(os.path.basename(path))
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(out_path, dpi=100)
    return out_path
