"""Run a test body on N local gloo processes, failing fast and loudly.

``run_distributed(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` on every
rank through :func:`tiertrain.launch.launch_local` (forkserver with torch preloaded, since
the test process has already run torch ops) and returns each rank's result. A rank that
raises or dies stops the others and surfaces as :class:`RankFailure` with its traceback;
ranks still running after ``timeout`` seconds are killed and :class:`DistributedTimeout`
is raised, so a hang costs seconds, not a CI run.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from .launch import WorkerFailure as RankFailure
from .launch import WorkersTimedOut as DistributedTimeout
from .launch import launch_local

__all__ = ["DistributedTimeout", "RankFailure", "run_distributed", "another_job_holding"]


@contextlib.contextmanager
def another_job_holding(directory: str) -> Iterator[int]:
    """A separate process holding the checkpoint lock of directory (as another job's rank 0
    does) until the block ends; yields its pid."""
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, tiertrain.state.checkpoint as c; c.claim_directory(sys.argv[1]); "
                               "print('locked', flush=True); sys.stdin.read()", str(directory)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        if holder.stdout.readline().strip() != "locked":
            raise RuntimeError(f"the process meant to hold {directory!r} did not lock it")
        yield holder.pid
    finally:
        holder.kill()
        holder.wait()


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
