"""Run a function on N local processes over gloo, failing fast and loudly.

``run_distributed(fn, world_size, *args)`` starts one process per rank (forkserver, with
torch preloaded so start-up is cheap), rendezvous through a TCPStore owned by the caller
(no free-port race), runs ``fn(rank, world_size, *args)`` and returns each rank's result.
If any rank raises, the others are stopped and :class:`RankFailure` carries that rank's
traceback; if the ranks do not all finish within ``timeout`` seconds, they are killed and
:class:`DistributedTimeout` is raised, so a hang costs seconds, not a CI run.
"""
from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import signal
import time
import traceback
from typing import Any, Callable

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """A rank raised or died; the message holds its traceback or exit status."""


class DistributedTimeout(RuntimeError):
    """Ranks were still running when the timeout expired."""


_CONTEXT = None


def _context():
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(["torch", "torch.distributed", "tiertrain"])
    return _CONTEXT


def _rank_main(fn, rank, world_size, host, port, timeout, threads, results, args, kwargs):
    try:
        torch.set_num_threads(threads)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR=host, MASTER_PORT=str(port))
        store = dist.TCPStore(host, port, world_size, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            value = fn(rank, world_size, *args, **kwargs)
        finally:
            dist.destroy_process_group()
        buffer = io.BytesIO()  # tensors by value: shared-memory handles die with this process
        torch.save(value, buffer)
        results.put((rank, True, buffer.getvalue()))
    except BaseException:  # report everything, including KeyboardInterrupt from termination
        results.put((rank, False, traceback.format_exc()))


def run_distributed(fn: Callable[..., Any], world_size: int, *args, timeout: float = 60.0,
                    threads: int = 1, **kwargs) -> list[Any]:
    """Run fn(rank, world_size, *args, **kwargs) on world_size gloo processes; returns the
    results in rank order. fn and its arguments must be picklable (module-level)."""
    if world_size < 1:
        raise ValueError(f"world_size={world_size} is invalid: expected >= 1")
    ctx = _context()
    host = "127.0.0.1"
    store = dist.TCPStore(host, 0, world_size + 1, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=timeout))
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank_main, daemon=True,
                         args=(fn, r, world_size, host, store.port, timeout, threads, results, args, kwargs))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    values: dict[int, Any] = {}
    try:
        while len(values) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                missing = sorted(set(range(world_size)) - set(values))
                raise DistributedTimeout(f"rank(s) {missing} did not finish within {timeout:.0f} s "
                                         f"(a hang: mismatched collectives or a dead peer?)")
            try:
                rank, ok, value = results.get(timeout=min(remaining, 0.5))
            except queue.Empty:
                for r, p in enumerate(procs):
                    if r not in values and p.exitcode not in (None, 0):
                        raise RankFailure(f"rank {r} died with {_exit_status(p.exitcode)} before reporting")
                continue
            if not ok:
                raise RankFailure(f"rank {rank} failed:\n{value}")
            values[rank] = torch.load(io.BytesIO(value), weights_only=False)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join(timeout=5)
        del store
    return [values[r] for r in range(world_size)]


def _exit_status(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"
