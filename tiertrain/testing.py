"""Run a test body on N local gloo processes, failing fast and loudly.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on every
rank through :func:`tiertrain.launch.launch_local` (forkserver with torch preloaded, since
the test process has already run torch ops) and returns each rank's result. A rank that
raises or dies stops the others and surfaces as :class:`RankFailure` with its traceback;
ranks still running after ``timeout`` seconds are killed and :class:`DistributedTimeout`
is raised, so a hang costs seconds, not a CI run.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from .launch import WorkerFailure as RankFailure
from .launch import WorkersTimedOut as DistributedTimeout
from .launch import launch_local

__all__ = ["DistributedTimeout", "RankFailure", "run_distributed"]


def _with_rank(fn: Callable[..., Any], args: tuple, kwargs: dict, threads: int) -> Any:
    torch.set_num_threads(threads)
    return fn(dist.get_rank(), dist.get_world_size(), *args, **kwargs)


def run_distributed(fn: Callable[..., Any], world_size: int, *args, timeout: float = 60.0,
                    threads: int = 1, deadline: float | None = None, **kwargs) -> list[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on world_size gloo processes; returns the
    results in rank order. fn and its arguments must be picklable (module-level).

    ``timeout`` is the run's timeout (every collective, transfer and swap IO wait, as
    ``tiertrain train --timeout``) and, unless ``deadline`` is given, also the time after
    which unfinished ranks are killed; a test of the timeout itself gives a deadline longer
    than it, so that the ranks' own timeout fires first."""
    return launch_local(_with_rank, world_size, fn, args, kwargs, threads, timeout=timeout,
                        deadline=timeout if deadline is None else deadline, start_method="forkserver")
