"""``tiertrain plot RUN_DIR [--out DIR]``: pictures of a run from its metrics file.

Reads the JSONL metrics file a run wrote (``RUN_DIR/metrics.jsonl``, or the ``.jsonl``
file itself) and writes, as PNGs beside it (or in ``--out``):

* ``loss.png``       train loss per logged step, with the eval loss on the same axes;
* ``throughput.png`` tokens/s, with TFLOP/s per rank (or MFU) on a second axis;
* ``memory.png``     model-state bytes per tier (device, cpu, nvme) as measured, with the
  estimator's prediction dashed in the same colour, and the peak RSS per rank;
* ``timing.png``     the step time split into data, forward, backward, optimizer, I/O and
  communication waits, stacked per logged step;
* ``trace-rank<r>.png`` for each trace a run recorded (``--logging.trace_steps``): what ran when,
  on which thread (tiertrain/observe/trace.py). A trace file given instead of a run draws that.

A picture whose keys no record has is not drawn. A resumed run appends to the metrics file
and may log a step twice: the later record of a step wins, as it is the run that continued.

matplotlib is optional and imported only here, through its Agg canvas (no display, no
global pyplot state).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import warnings
from typing import Any

__all__ = ["find_metrics_file", "load_records", "plot_run", "main"]

METRICS_NAME = "metrics.jsonl"

_TIERS = (("device", "C0"), ("cpu", "C1"), ("nvme", "C2"))
_PHASES = (("data", "data loading"), ("forward", "forward"), ("backward", "backward"),
           ("optimizer", "optimizer step"), ("io_wait", "offload I/O wait"), ("comm_wait", "communication wait"))
_MAX_BARS = 80
"""Above this many logged steps the timing breakdown is a stacked area, not bars (which would be slivers)."""


# --------------------------------------------------------------------------- reading


def find_metrics_file(path: str) -> str:
    """The metrics file of ``path``: the file itself, or a directory's metrics.jsonl (or its
    only .jsonl file). FileNotFoundError naming the path and what was looked for otherwise."""
    if os.path.isfile(path):
        return path
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} does not exist: expected a run directory holding {METRICS_NAME} "
                                f"or a metrics .jsonl file")
    candidate = os.path.join(path, METRICS_NAME)
    if os.path.isfile(candidate):
        return candidate
    jsonl = sorted(name for name in os.listdir(path) if name.endswith(".jsonl"))
    if len(jsonl) == 1:
        return os.path.join(path, jsonl[0])
    found = f"it holds {', '.join(jsonl)}" if jsonl else "it holds no .jsonl file"
    raise FileNotFoundError(f"{path!r} is a directory without {METRICS_NAME} ({found}): "
                            f"pass the run directory holding {METRICS_NAME}, or the metrics file itself")


def _is_eval(record: dict[str, Any]) -> bool:
    return any(key.startswith("eval_") for key in record)


def load_records(metrics_file: str) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(train records, eval records) of a metrics file, each sorted by step, one per step
    (the later line wins: a resumed run re-logs the steps after its checkpoint).

    Lines that are not JSON objects with an integer ``step`` (e.g. the last line of a run
    killed while writing it) are skipped with a warning. ValueError naming the file when
    it holds no record at all.
    """
    train: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    bad_lines = []
    with open(metrics_file, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                record = None
            step = record.get("step") if isinstance(record, dict) else None
            if isinstance(step, bool) or not isinstance(step, int):
                bad_lines.append(number)
                continue
            (evals if _is_eval(record) else train)[step] = record
    if bad_lines:
        shown = ", ".join(map(str, bad_lines[:5])) + (", ..." if len(bad_lines) > 5 else "")
        warnings.warn(f"{metrics_file}: skipped {len(bad_lines)} line(s) that are not a JSON record with an "
                      f"integer 'step' (line {shown})", stacklevel=2)
    if not train and not evals:
        what = "is empty" if not bad_lines else f"has no valid record ({len(bad_lines)} unreadable line(s))"
        raise ValueError(f"metrics file {metrics_file!r} {what}: nothing to plot (is it the file a run's "
                         f"logging.metrics_file wrote?)")
    return ([train[s] for s in sorted(train)], [evals[s] for s in sorted(evals)])


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]] | None:
    """(steps, values) of key over records, missing or null values as NaN (a gap in the
    line); None when no record has a number for key."""
    steps, values = [], []
    for record in records:
        value = record.get(key)
        number = float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan
        steps.append(record["step"])
        values.append(number)
    return (steps, values) if any(not math.isnan(v) for v in values) else None


def _finite_max(values: list[float]) -> float:
    return max((v for v in values if math.isfinite(v)), default=0.0)


# --------------------------------------------------------------------------- drawing


def _figure(title: str, rows: int = 1):
    """A fresh Figure on an Agg canvas with its title, and its axes (a list when rows > 1:
    stacked, the first twice as tall, sharing the step axis), step on the x axis."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.ticker import MaxNLocator
    except ImportError as e:
        raise ImportError(f"tiertrain plot needs matplotlib, which cannot be imported here ({e}): "
                          f"`pip install matplotlib`") from e
    fig = Figure(figsize=(9, 5 if rows == 1 else 6.5), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(rows, 1, sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [2] + [1] * (rows - 1)})[:, 0].tolist()
    axes[0].set_title(title)
    axes[-1].set_xlabel("step")
    for ax in axes:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(True, alpha=0.3)
    return (fig, axes[0]) if rows == 1 else (fig, axes)


def _save(fig, out_dir: str, name: str) -> str:
    path = os.path.join(out_dir, name)
    fig.tight_layout()
    fig.savefig(path)
    return path


def _legend(*axes, reverse: bool = False, **kwargs) -> None:
    """One legend for the lines of several (twin) axes; reverse lists a stack top first."""
    handles, labels = [], []
    for ax in axes:
        h, l = ax.get_legend_handles_labels()
        handles += h
        labels += l
    if reverse:
        handles, labels = handles[::-1], labels[::-1]
    if handles:
        axes[0].legend(handles, labels, **kwargs)


def _byte_unit(largest: float) -> tuple[float, str]:
    """(divisor, name) of the binary unit that shows largest as a number of 1 to 1023."""
    for power, name in ((4, "TiB"), (3, "GiB"), (2, "MiB"), (1, "KiB")):
        if largest >= 1024 ** power:
            return float(1024 ** power), name
    return 1.0, "B"


def _plot_loss(train, evals, out_dir, run_name) -> str | None:
    loss, eval_loss = _series(train, "loss"), _series(evals, "eval_loss")
    if loss is None and eval_loss is None:
        return None
    fig, ax = _figure(f"Loss — {run_name}")
    if loss is not None:
        ax.plot(*loss, color="C0", linewidth=1.5, label="train loss")
        diverged = [r["step"] for r in train if "loss" in (r.get("non_finite") or ())]
        for i, step in enumerate(diverged):  # a gap in the line: say why
            ax.axvline(step, color="C3", alpha=0.25, linewidth=2, label="non-finite loss" if i == 0 else None)
    if eval_loss is not None:
        ax.plot(*eval_loss, color="C3", linestyle="--", marker="o", markersize=6, linewidth=1.2, label="eval loss")
    ax.set_ylabel("loss")
    _legend(ax, loc="upper right")
    return _save(fig, out_dir, "loss.png")


def _plot_throughput(train, out_dir, run_name) -> str | None:
    """tokens/s, with TFLOP/s per rank on the right. The two are proportional (FLOPs per
    token are fixed), so TFLOP/s is a second scale of the same line rather than a second
    line hiding the first; drawn as its own line only when the ratio varies."""
    tokens, tflops, mfu = _series(train, "tokens_per_s"), _series(train, "tflops"), _series(train, "mfu")
    if tokens is None and tflops is None and mfu is None:
        return None
    title = f"Throughput — {run_name}"
    if mfu is not None:
        title += f" (mean MFU {100 * _mean(mfu[1]):.1f}%)"
    fig, ax = _figure(title)
    from matplotlib.ticker import EngFormatter

    if tokens is None:  # FLOPs or MFU only
        label, scale = ("TFLOP/s per rank", 1.0) if tflops is not None else ("MFU (% of peak)", 100.0)
        steps, values = tflops or mfu
        ax.plot(steps, [v * scale for v in values], color="C2", linewidth=1.5, label=label)
        ax.set_ylabel(label)
        ax.set_ylim(bottom=0)
        _legend(ax, loc="lower right")
        return _save(fig, out_dir, "throughput.png")
    ax.plot(*tokens, color="C0", linewidth=1.5, label="tokens/s (all ranks)")
    ax.set_ylabel("tokens/s (all ranks)")
    ax.yaxis.set_major_formatter(EngFormatter(sep=""))
    ax.set_ylim(bottom=0)
    axes = [ax]
    if tflops is not None:
        ratios = [f / t for t, f in zip(tokens[1], tflops[1]) if math.isfinite(t) and t > 0 and math.isfinite(f)]
        ratio = sorted(ratios)[len(ratios) // 2] if ratios else math.nan
        if ratios and ratio > 0 and all(abs(r / ratio - 1) < 0.01 for r in ratios):
            right = ax.secondary_yaxis("right", functions=(lambda x: x * ratio, lambda y: y / ratio))
        else:
            right = ax.twinx()
            right.plot(*tflops, color="C2", linewidth=1.5, label="TFLOP/s per rank")
            right.set_ylim(bottom=0)
            axes.append(right)
        right.set_ylabel("TFLOP/s per rank")
    _legend(*axes, loc="lower right")
    return _save(fig, out_dir, "throughput.png")


def _mean(values: list[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return sum(finite) / len(finite) if finite else math.nan


def _plot_memory(train, out_dir, run_name) -> str | None:
    """Model-state bytes per tier, measured (solid) and predicted (dashed, same colour), and
    below them the peak RSS per rank on its own scale: RSS is often ten times the model
    states of a small run and would flatten them."""
    lines = []  # (series, label, style)
    for tier, colour in _TIERS:
        measured, predicted = _series(train, f"bytes_{tier}"), _series(train, f"predicted_bytes_{tier}")
        if not any(s is not None and _finite_max(s[1]) > 0 for s in (measured, predicted)):
            continue  # a tier this run does not use: no flat line at zero
        if measured is not None:
            lines.append((measured, f"{tier}: measured", dict(color=colour, linewidth=2.2)))
        if predicted is not None:
            lines.append((predicted, f"{tier}: predicted", dict(color=colour, linewidth=1.6, linestyle=(0, (4, 3)))))
    total = _series(train, "mem_bytes_per_rank")
    if total is not None and len({label.split(":")[0] for _, label, _ in lines}) != 1:  # one tier: it is the total
        lines.append((total, "all tiers: measured", dict(color="grey", linewidth=1.6, linestyle="-.")))
    rss = _series(train, "peak_rss_bytes_per_rank")
    if not lines and rss is None:
        return None
    panels = [(lines, "model states per tier")] if lines else []
    if rss is not None:
        panels.append(([(rss, "peak RSS per rank", dict(color="black", linewidth=1.6))], "process peak RSS"))
    title = f"Memory per rank (rank holding most) — {run_name}"
    fig, axes = _figure(title, rows=len(panels))
    for ax, (panel_lines, what) in zip(axes if len(panels) > 1 else [axes], panels):
        divisor, unit = _byte_unit(max(_finite_max(series[1]) for series, _, _ in panel_lines))
        for (steps, values), label, style in panel_lines:
            ax.plot(steps, [v / divisor for v in values], label=label, **style)
        ax.set_ylabel(f"{what} ({unit})")
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.1)
        _legend(ax, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    return _save(fig, out_dir, "memory.png")


def _plot_timing(train, out_dir, run_name) -> str | None:
    phases = [(label, _series(train, f"time_{name}_s")) for name, label in _PHASES]
    phases = [(label, series) for label, series in phases if series is not None and _finite_max(series[1]) > 0]
    if not phases:
        return None
    steps = [record["step"] for record in train]
    stacks = [[0.0 if math.isnan(v) else v for v in series[1]] for _, series in phases]
    totals = [sum(column) for column in zip(*stacks)]
    scale, unit = (1000.0, "ms") if max(totals, default=0.0) < 1.0 else (1.0, "s")
    stacks = [[v * scale for v in stack] for stack in stacks]
    fig, ax = _figure(f"Step time breakdown — {run_name}")
    colours = [f"C{i}" for i in range(len(phases))]
    if len(steps) <= _MAX_BARS:
        gaps = [b - a for a, b in zip(steps, steps[1:])]
        width = 0.8 * min(gaps, default=1)
        bottom = [0.0] * len(steps)
        for (label, _), stack, colour in zip(phases, stacks, colours):
            ax.bar(steps, stack, width=width, bottom=bottom, color=colour, label=label)
            bottom = [b + v for b, v in zip(bottom, stack)]
    else:
        ax.stackplot(steps, *stacks, colors=colours, labels=[label for label, _ in phases])
    ax.set_ylabel(f"mean time per optimizer step ({unit})")
    _legend(ax, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small", reverse=True)
    return _save(fig, out_dir, "timing.png")


# --------------------------------------------------------------------------- entry points


TRACE_SUFFIXES = (".json", ".json.gz")
"""A trace file (tiertrain/observe/trace.py), plain or gzipped."""


def _trace_png(name: str) -> str:
    return next(name[:-len(s)] for s in TRACE_SUFFIXES[::-1] if name.endswith(s)) + ".png"


def plot_run(path: str, out_dir: str | None = None) -> list[str]:
    """Write loss.png, throughput.png, memory.png and timing.png (those the metrics have
    keys for) for the run at ``path`` (a run directory or its metrics .jsonl file) into
    ``out_dir`` (default: the metrics file's directory); returns the paths written.

    FileNotFoundError when path is neither; ValueError when the file holds no record or no
    key any picture draws; ImportError with the pip command when matplotlib is missing.
    """
    if path.endswith(TRACE_SUFFIXES) and os.path.isfile(path):
        from .trace import plot_trace

        out = os.path.join(out_dir or os.path.dirname(os.path.abspath(path)), _trace_png(os.path.basename(path)))
        os.makedirs(os.path.dirname(out), exist_ok=True)
        return [plot_trace(path, out)]
    metrics_file = find_metrics_file(path)
    train, evals = load_records(metrics_file)
    run_dir = os.path.dirname(os.path.abspath(metrics_file))
    out_dir = out_dir or run_dir
    os.makedirs(out_dir, exist_ok=True)
    run_name = os.path.basename(run_dir)
    if os.path.basename(metrics_file) != METRICS_NAME:
        run_name = os.path.join(run_name, os.path.basename(metrics_file))
    written = [_plot_loss(train, evals, out_dir, run_name), _plot_throughput(train, out_dir, run_name),
               _plot_memory(train, out_dir, run_name), _plot_timing(train, out_dir, run_name)]
    written = [p for p in written if p is not None]
    if written:
        from .trace import plot_trace

        for name in sorted(os.listdir(run_dir)):
            if name.startswith("trace-rank") and name.endswith(TRACE_SUFFIXES):
                written.append(plot_trace(os.path.join(run_dir, name), os.path.join(out_dir, _trace_png(name))))
    if not written:
        raise ValueError(f"metrics file {metrics_file!r} has {len(train) + len(evals)} record(s) but none with "
                         f"loss, eval_loss, tokens_per_s, tflops, mfu, bytes_* or time_* values: nothing to plot")
    return written


def main(argv: list[str] | None = None) -> int:
    """``tiertrain plot RUN_DIR [--out DIR]``: print each PNG written; status 0, or 2 with one
    ``error: ...`` line when the run cannot be plotted."""
    parser = argparse.ArgumentParser(
        prog="tiertrain plot", allow_abbrev=False,
        description="Plot a run's metrics file: loss.png, throughput.png, memory.png and timing.png "
                    "(those its records have values for), and trace-rank<r>.png for each trace the run "
                    "recorded (--logging.trace_steps).")
    parser.add_argument("run", metavar="RUN_DIR",
                        help=f"a run directory holding {METRICS_NAME}, a metrics .jsonl file, or a trace .json file "
                             f"(--logging.trace_steps)")
    parser.add_argument("--out", metavar="DIR", default=None,
                        help="where to write the PNGs (default: beside the metrics file)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        written = plot_run(args.run, args.out)
    except (OSError, ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for path in written:
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
