"""Where each metrics record goes: a JSONL file, TensorBoard, Weights & Biases.

A record is the flat dict the training loop logs on rank 0 every ``logging.log_interval``
steps (``step``, ``loss``, ``lr``, ``tokens_per_s``, ``bytes_device``, ``time_forward_s``,
..., or an eval record with ``eval_loss``, ``eval_ppl``); any key may be missing or None.
Every writer has the same two methods, ``write(record)`` and ``close()``, and
:func:`open_writers` builds the ones ``logging.*`` configures behind one
:class:`MultiWriter`.

TensorBoard and W&B name each number by :func:`metric_tag` (``train/loss``,
``eval/loss``, ``throughput/tokens_per_s``, ``memory/bytes_device``, ``time/forward_s``)
so that their dashboards group the curves into those sections.

Both packages are optional and imported only when their writer is built. A configured
writer whose package is missing is a ConfigError naming the field and the pip command;
:func:`check_writers` raises it before any training process starts.
"""
from __future__ import annotations

import importlib
import json
import math
import os
from typing import Any, Protocol

from ..config import ConfigError, LoggingConfig

__all__ = ["metrics_line", "MetricsWriter", "JsonlWriter", "TensorBoardWriter", "WandbWriter", "MultiWriter", "metric_tag",
           "check_writers", "open_writers"]


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """record with each non-finite float as None, and those keys listed under "non_finite"
    (absent when there are none): strict JSON has no NaN or Infinity."""
    flagged = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not flagged:
        return dict(record)
    return {**{k: None if k in flagged else v for k, v in record.items()}, "non_finite": flagged}


def metrics_line(record: dict[str, Any]) -> str:
    """One metrics-file line: record as strict JSON (see _json_safe; allow_nan=False makes
    any non-finite number left over an error here rather than an unreadable file)."""
    return json.dumps(_json_safe(record), allow_nan=False)


class MetricsWriter(Protocol):
    """Anything that takes metrics records: the training loop needs nothing more."""

    def write(self, record: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


# --------------------------------------------------------------------------- naming

_THROUGHPUT_KEYS = ("tokens_per_s", "tflops", "mfu")


def metric_tag(key: str) -> str | None:
    """The TensorBoard / W&B name of a record key, grouped by what it measures; None for
    ``step`` (the x axis) and ``non_finite`` (a list, not a number).

    ``eval_loss`` → ``eval/loss``; ``time_forward_s`` → ``time/forward_s`` and
    ``elapsed_s`` → ``time/elapsed_s``; any key with ``bytes`` in it → ``memory/<key>``;
    ``tokens_per_s``, ``tflops``, ``mfu`` → ``throughput/<key>``; everything else (loss, lr,
    grad_norm, loss_scale, skipped, keys added later) → ``train/<key>``.
    """
    if key in ("step", "non_finite"):
        return None
    if key.startswith("eval_"):
        return "eval/" + key[len("eval_"):]
    if key.startswith("time_"):
        return "time/" + key[len("time_"):]
    if key == "elapsed_s":
        return "time/elapsed_s"
    if "bytes" in key:
        return "memory/" + key
    if key in _THROUGHPUT_KEYS:
        return "throughput/" + key
    return "train/" + key


def _scalars(record: dict[str, Any]) -> dict[str, float]:
    """record's numbers by metric_tag; None, strings, lists and ``step`` left out. Non-finite
    floats are kept: a NaN loss is worth seeing on the dashboard."""
    out = {}
    for key, value in record.items():
        tag = metric_tag(key)
        if tag is None or value is None or not isinstance(value, (int, float)):
            continue
        out[tag] = float(value)
    return out


def _step_of(record: dict[str, Any], writer: str) -> int:
    """record["step"] as an int, or a ValueError saying that the writer needs it."""
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"{writer} needs an integer 'step' in every record, got step={step!r} in {record!r}")
    return step


# --------------------------------------------------------------------------- optional packages

_PACKAGES = {
    "tensorboard_dir": (("tensorboard", "torch.utils.tensorboard"), "pip install tensorboard", "TensorBoard"),
    "wandb_project": (("wandb",), "pip install wandb", "Weights & Biases"),
}
"""LoggingConfig field → (modules its writer imports, how to install them, what it is)."""


def _require(field: str, value: str, path: str = "logging") -> None:
    """ConfigError naming ``<path>.<field>``, its value and the pip command when the modules
    its writer needs cannot be imported."""
    modules, pip, what = _PACKAGES[field]
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(
                f"{path}.{field}={value!r} needs the {modules[0]} package, which cannot be imported here ({e}): "
                f"`{pip}`, or set {path}.{field} '' to train without {what}") from e


def check_writers(logging: LoggingConfig, path: str = "logging") -> None:
    """ConfigError when a configured writer cannot be built: its package is missing, or
    ``tensorboard_dir`` names a file. Cheap and side-effect free, so the launcher calls it
    before starting any process (a missing package should not surface after start-up)."""
    if logging.tensorboard_dir:
        _require("tensorboard_dir", logging.tensorboard_dir, path)
        if os.path.exists(logging.tensorboard_dir) and not os.path.isdir(logging.tensorboard_dir):
            raise ConfigError(f"{path}.tensorboard_dir={logging.tensorboard_dir!r} is invalid: it is a file, "
                              f"expected a directory (created when missing)")
    if logging.wandb_project:
        _require("wandb_project", logging.wandb_project, path)
        if logging.wandb_mode not in ("online", "offline"):
            raise ConfigError(f"{path}.wandb_mode={logging.wandb_mode!r} is invalid: expected 'online' or 'offline'")


# --------------------------------------------------------------------------- writers


class JsonlWriter:
    """One strict-JSON line per record (metrics_line: NaN and Infinity become
    null, their keys listed under "non_finite"), flushed at once so that a crash loses
    nothing already logged and ``tail -f`` / ``tiertrain plot`` see every record.

    ``append=True`` continues an existing file (a resumed run); otherwise it starts afresh.
    """

    def __init__(self, path: str, append: bool = False):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._file = open(path, "a" if append else "w", buffering=1, encoding="utf-8")

    def write(self, record: dict[str, Any]) -> None:
        self._file.write(metrics_line(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter:
    """Each number of a record as a TensorBoard scalar named by :func:`metric_tag`, at
    ``global_step=record["step"]``; None and non-numbers are skipped. Flushed after each
    record so that a running ``tensorboard --logdir`` shows it."""

    def __init__(self, log_dir: str):
        _require("tensorboard_dir", log_dir)
        from torch.utils.tensorboard import SummaryWriter

        self.log_dir = log_dir
        self._writer = SummaryWriter(log_dir=log_dir)

    def write(self, record: dict[str, Any]) -> None:
        step = _step_of(record, "TensorBoardWriter")
        for tag, value in _scalars(record).items():
            self._writer.add_scalar(tag, value, global_step=step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    """Each record's numbers as one ``wandb.log(..., step=record["step"])`` of a W&B run,
    named by :func:`metric_tag`; the run is finished on close.

    ``mode="offline"`` writes the run under ``<directory>/wandb/offline-run-*`` for a later
    ``wandb sync``; ``config`` (the job's resolved config) is stored with the run. A train
    and an eval record of the same step become one W&B step.
    """

    def __init__(self, project: str, mode: str = "online", directory: str | None = None,
                 config: dict[str, Any] | None = None):
        if mode not in ("online", "offline"):
            raise ConfigError(f"logging.wandb_mode={mode!r} is invalid: expected 'online' or 'offline'")
        _require("wandb_project", project)
        import wandb

        if directory:
            os.makedirs(directory, exist_ok=True)
        try:
            self._run = wandb.init(project=project, mode=mode, dir=directory, config=config or {})
        except Exception as e:  # wandb raises its own error types (no API key, no network, ...)
            hint = " (without an account or network: --logging.wandb_mode offline)" if mode == "online" else ""
            raise ConfigError(f"logging.wandb_project={project!r}: wandb.init(mode={mode!r}) failed: "
                              f"{type(e).__name__}: {e}{hint}") from e

    @property
    def run_dir(self) -> str:
        """The run's directory (``.../wandb/<offline->run-<time>-<id>``), holding run-<id>.wandb."""
        return os.path.dirname(self._run.dir)

    def write(self, record: dict[str, Any]) -> None:
        step = _step_of(record, "WandbWriter")
        self._run.log(_scalars(record), step=step)

    def close(self) -> None:
        self._run.finish()


class MultiWriter:
    """Several writers as one: each record goes to every writer in order; close closes them
    all, even when one fails (the first error is raised afterwards). Also a context manager."""

    def __init__(self, writers: list[MetricsWriter]):
        self.writers = list(writers)

    def write(self, record: dict[str, Any]) -> None:
        for writer in self.writers:
            writer.write(record)

    def close(self) -> None:
        first_error = None
        for writer in self.writers:
            try:
                writer.close()
            except Exception as e:
                first_error = first_error or e
        self.writers = []
        if first_error is not None:
            raise first_error

    def __len__(self) -> int:
        return len(self.writers)

    def __enter__(self) -> "MultiWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()


def open_writers(logging: LoggingConfig, *, append: bool = False, run_config: dict[str, Any] | None = None,
                 wandb_dir: str | None = None) -> MultiWriter:
    """The writers ``logging`` configures, on rank 0: a JsonlWriter for ``metrics_file``
    (appending when ``append``, i.e. a resumed run), a TensorBoardWriter for
    ``tensorboard_dir``, a WandbWriter for ``wandb_project`` in ``wandb_mode`` with
    ``run_config`` stored with the run. Empty fields build nothing (an empty MultiWriter
    takes records and drops them).

    W&B's directory is ``wandb_dir``, else $WANDB_DIR, else the metrics file's directory,
    else the current one. Missing packages are a ConfigError before anything is opened.
    """
    check_writers(logging)
    writers: list[MetricsWriter] = []
    try:
        if logging.metrics_file:
            writers.append(JsonlWriter(logging.metrics_file, append=append))
        if logging.tensorboard_dir:
            writers.append(TensorBoardWriter(logging.tensorboard_dir))
        if logging.wandb_project:
            directory = (wandb_dir or os.environ.get("WANDB_DIR")
                         or (os.path.dirname(logging.metrics_file) if logging.metrics_file else "") or ".")
            writers.append(WandbWriter(logging.wandb_project, logging.wandb_mode, directory, run_config))
    except BaseException:
        MultiWriter(writers).close()
        raise
    return MultiWriter(writers)
