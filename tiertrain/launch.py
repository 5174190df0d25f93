"""Start the ranks of a run: under torchrun, or as N local processes torchrun-style.

Under torchrun (``RANK`` and ``WORLD_SIZE`` in the environment) every process is already
a rank: :func:`run` just initialises the default process group from ``env://`` and calls
the function. That is also the multi-node recipe, run once on every node::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:PORT -m tiertrain.cli train --zero.stage 3 ...

Otherwise :func:`launch_local` starts ``nproc`` worker processes on this machine (fork on
CPU, which starts in a fraction of a second because torch is already imported;
forkserver when CUDA devices are present, since CUDA cannot be used in a forked child).
They rendezvous through a TCPStore the launcher opens on a free port *after* forking,
with ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set as
torchrun would. The backend is nccl when CUDA is available, gloo otherwise.

Failure handling: the first rank that raises reports its exception to the launcher,
which stops the other ranks at once (SIGTERM, then SIGKILL) and raises
:class:`WorkerFailure` carrying that rank's traceback. A rank that dies without
reporting (killed, segfault) is noticed within a fraction of a second. Each process
group has a timeout, so a collective that can never complete raises instead of hanging,
and workers die with the launcher (``PR_SET_PDEATHSIG`` on Linux).

One timeout: ``timeout`` (``tiertrain train --timeout``) is the process group's, and every
rank gets it as ``$TIERTRAIN_TIMEOUT_S``, which the engine's collective, pipeline and swap IO
waits read (tiertrain.comm.run_timeout). A collective that times out names the ranks that
never issued it (tiertrain.comm.Arrivals), and the launcher blames those, not the rank that
waited; a rank whose function returned records it (tiertrain.comm.finish_collectives), so
that a peer still issuing collectives (it had more batches) fails at once naming it. Clean
exit: SIGTERM raises :class:`Terminated` (a KeyboardInterrupt) in the launcher and in the
ranks, so that they unwind; the ranks' swap directories are registered with the launcher
(tiertrain.io.swap_dir.CLEANUP_ENV) and removed once every rank is gone, however it ended
(a multiprocessing worker never runs atexit handlers, and a killed one runs nothing).

torch's own elastic launcher (``torch.distributed.launcher.api.elastic_launch``) was tried
first: on this CPU-only setup it starts workers with ``spawn`` (≈17 s for 2 ranks), logs
every worker traceback at ERROR level, and picks as "root cause" whichever failure has the
smallest whole-second timestamp, which is usually a peer's "Connection closed by peer"
rather than the rank that raised.
"""
from __future__ import annotations

import contextlib
import datetime
import io
import multiprocessing as mp
import os
import pickle
import queue
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, NamedTuple

import torch
import torch.distributed as dist

from .comm import (DEFAULT_TIMEOUT_S, TIMEOUT_ENV, CollectiveTimeout, PeerLost, finish_collectives, is_connection_lost,
                   peer_lost)
from .errors import TiertrainError

__all__ = ["WorkerFailure", "Terminated", "check_terminated", "under_torchrun", "default_nproc", "default_backend", "run",
           "launch_local", "DEFAULT_TIMEOUT_S"]

# DEFAULT_TIMEOUT_S (tiertrain.comm): the run's one timeout. The process group gets it, and
# every rank gets it as $TIERTRAIN_TIMEOUT_S, from which the engine's collective, pipeline
# and swap IO waits take theirs (tiertrain.comm.run_timeout()).


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so that finally blocks and exit handlers run (the
    default action ends the process on the spot, leaving swap files behind). A
    KeyboardInterrupt, so that whatever handles Ctrl-C handles it the same way.

    Not a TiertrainError: that is an Exception, and an ``except Exception`` on the way out
    (a best-effort cleanup, a worker's report) would then swallow the stop request."""


_terminated_by: list[str] = []
"""The signal that asked this process to stop, once one has (process-wide, as signals are)."""


def _raise_terminated(signum, frame) -> None:
    signal.signal(signum, signal.SIG_DFL)  # a second SIGTERM ends the process at once
    _terminated_by.append(signal.Signals(signum).name)
    raise Terminated(f"terminated by {signal.Signals(signum).name}")


def check_terminated() -> None:
    """Raise Terminated if a SIGTERM arrived. The handler raises it at once, wherever the main
    thread is; code that waits on IO and must not be interrupted half-way may catch every
    exception of a handle it drains, so a training loop also calls this between steps: a
    stop request is never lost."""
    if _terminated_by:
        raise Terminated(f"terminated by {_terminated_by[0]}")


@contextlib.contextmanager
def _sigterm_raises():
    """While inside: SIGTERM raises Terminated (main thread only, and only where nobody
    installed a handler of their own)."""
    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def _run_timeout(timeout: float):
    """$TIERTRAIN_TIMEOUT_S = timeout while inside (see tiertrain.comm.run_timeout)."""
    previous = os.environ.get(TIMEOUT_ENV)
    os.environ[TIMEOUT_ENV] = repr(float(timeout))
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(TIMEOUT_ENV, None)
        else:
            os.environ[TIMEOUT_ENV] = previous


class WorkerFailure(TiertrainError, RuntimeError):
    """A local worker raised or died. ``rank``, ``exc_type`` (class name or None when it
    died without reporting), ``message`` (one line) and ``details`` (its traceback).
    ``exit_code`` is the rank's error's (:attr:`TiertrainError.exit_code`, computed in the
    rank from the exception itself): the command reports a user's error in a rank as its one
    line with that status; None for a failure of the program, or a rank that died without
    reporting."""

    def __init__(self, rank: int, exc_type: str | None, message: str, details: str, exit_code: int | None = None):
        kind = f"{exc_type}: " if exc_type else ""
        super().__init__(f"rank {rank} failed: {kind}{message}" + (f"\n{details}" if details else ""))
        self.rank = rank
        self.exc_type = exc_type
        self.message = message
        self.details = details
        self.exit_code = exit_code
        self.others: list[str] = []
        """One line per other rank that failed too (usually as a consequence)."""


class WorkersTimedOut(TiertrainError, RuntimeError):
    """The ranks had not all finished when launch_local's deadline expired (a hang)."""


def under_torchrun() -> bool:
    """True when this process was started as a rank (torchrun or similar set RANK and WORLD_SIZE)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _cuda_devices() -> int:
    # torch.cuda.device_count() asks NVML and does not initialise CUDA in this process.
    try:
        return torch.cuda.device_count() if torch.cuda.is_built() else 0
    except Exception:
        return 0


def default_nproc() -> int:
    """Local processes by default: one per CUDA device, else 2."""
    return _cuda_devices() or 2


def default_backend() -> str:
    """nccl with CUDA, gloo otherwise."""
    return "nccl" if torch.cuda.is_available() else "gloo"


def _threads_per_rank(local_world_size: int) -> int:
    if "OMP_NUM_THREADS" in os.environ:
        try:
            return max(1, int(os.environ["OMP_NUM_THREADS"]))
        except ValueError:
            pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cpus // max(1, local_world_size))


def _set_device(local_rank: int) -> None:
    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def run(fn: Callable[..., Any], *args, timeout: float = DEFAULT_TIMEOUT_S, **kwargs) -> Any:
    """Call fn(*args, **kwargs) as one rank of a torchrun-started job: init the process
    group from env://, run, destroy it. Without RANK/WORLD_SIZE, fn runs alone. Either way
    every wait inside uses ``timeout`` and SIGTERM raises :class:`Terminated`, so that the
    process unwinds and its exit handlers remove swap files (torchrun stops workers with
    SIGTERM)."""
    with _run_timeout(timeout), _sigterm_raises():
        if not under_torchrun():
            return fn(*args, **kwargs)
        # A worker whose torchrun agent is killed (SIGKILL: it stops nothing) must not train on
        # to the end of the run, writing checkpoints: it gets SIGHUP when its parent dies.
        parent = os.getppid()
        _die_with_parent()
        if os.getppid() != parent:  # (it died before the request: no signal will come)
            raise Terminated("the torchrun agent that started this worker is gone")
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"]))
        torch.set_num_threads(_threads_per_rank(local_world))
        _set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(default_backend(), init_method="env://",
                                timeout=datetime.timedelta(seconds=timeout))
        try:
            value = fn(*args, **kwargs)
            finish_collectives()  # (a peer still issuing collectives fails at once, naming this rank)
            return value
        except RuntimeError as e:
            # A peer (node) went away under a collective issued outside tiertrain.comm (a
            # checkpoint barrier, a metrics gather): name the rank and node it was, not only
            # gloo's "Connection closed by peer [address]".
            if isinstance(e, PeerLost) or not is_connection_lost(e):
                raise
            raise peer_lost(e, dist.get_rank(), list(range(dist.get_world_size()))) from e
        finally:
            dist.destroy_process_group()


# --------------------------------------------------------------------------- local workers


ORPHAN_GRACE_S = 30.0
"""Seconds a worker whose parent died has to unwind (remove its swap files) before it exits
regardless (a main thread blocked where no signal handler can run)."""


def _parent_died(signum, frame) -> None:
    # A dying parent's threads each send PR_SET_PDEATHSIG's signal as the worker is handed from
    # one to the next: the first is the request, the others are ignored (a second SIGTERM used
    # to end the worker on the spot, before it removed its swap files).
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    _terminated_by.append("SIGHUP")
    raise Terminated("its parent process (the launcher or torchrun agent) died")


def _exit_when_orphaned(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(0.5)
    time.sleep(ORPHAN_GRACE_S)
    os._exit(1)


def _die_with_parent() -> None:
    """SIGHUP when the parent dies (raising Terminated once, so the worker unwinds), and a
    watchdog that ends the worker ORPHAN_GRACE_S after that if it has not."""
    try:
        import ctypes

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGHUP, _parent_died)
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGHUP)  # PR_SET_PDEATHSIG
        threading.Thread(target=_exit_when_orphaned, args=(os.getppid(),), daemon=True,
                         name="orphan-watchdog (tiertrain.launch)").start()
    except Exception:
        pass


def _remove_own_swap(cleanup_dir: str | None) -> None:
    """Remove the swap directories this process registered (tiertrain.io.swap_dir): a
    worker leaves through os._exit, which runs no exit handler, so the swapper's own
    at-exit removal never happens here. The launcher removes them too once the worker is
    gone (for a worker killed before it gets here)."""
    if cleanup_dir:
        try:
            from .io.swap_dir import remove_left_behind

            remove_left_behind(cleanup_dir, owner_pid=os.getpid())
        except BaseException:  # noqa: BLE001 - exiting anyway; the launcher removes what is left
            pass


class _RankError(NamedTuple):
    """What a failed rank sends the launcher about its exception (plain values: the
    exception object itself may not pickle)."""

    caught_at: float
    """time.time() when the rank caught it: the earliest is the root cause."""
    exc_type: str
    """The class name, for the report."""
    message: str
    """The first line of the message."""
    details: str
    """The traceback."""
    missing_ranks: list[int] | None
    """For a collective timeout (tiertrain.comm.CollectiveTimeout), the ranks that never
    issued the collective (empty when all had and the transfer stalled); None for any other
    failure."""
    exit_code: int | None
    """The exception's TiertrainError.exit_code (None for any other exception)."""


def _report_failure(results, rank: int, e: BaseException, cleanup_dir: str | None = None) -> None:
    """Send this rank's exception (with the time it was caught) and exit non-zero. The
    process group is deliberately not destroyed first: closing its connections makes the
    peers fail too, and their reports must not overtake this one. ``missing_ranks`` of a
    collective timeout (tiertrain.comm.CollectiveTimeout) travel with it: the launcher
    blames those ranks, not the one that waited for them."""
    caught_at = time.time()
    text = str(e).strip()
    message = text.splitlines()[0] if text else type(e).__name__
    missing = [int(r) for r in e.missing_ranks] if isinstance(e, CollectiveTimeout) else None
    exit_code = e.exit_code if isinstance(e, TiertrainError) else None
    try:
        results.put((rank, False, _RankError(caught_at, type(e).__name__, message, traceback.format_exc(), missing,
                                             exit_code)))
        results.close()
        results.join_thread()  # the report must leave before os._exit
    except Exception:
        pass
    _remove_own_swap(cleanup_dir)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(1)  # a non-zero exit status, without a second copy of the traceback


def _worker(fn, rank: int, world_size: int, host: str, port_conn, timeout: float,
            results, args, kwargs, cleanup_dir: str | None = None) -> None:
    try:
        _die_with_parent()
        # The launcher stops ranks with SIGTERM: unwind (finally blocks, engine.close) and
        # report, instead of vanishing with files open. Set here, not inherited: a forked
        # worker would otherwise carry the launcher's handler.
        signal.signal(signal.SIGTERM, _raise_terminated)
        if not port_conn.poll(timeout):
            raise TimeoutError(f"no rendezvous port from the launcher within {timeout:.0f} s")
        port = port_conn.recv()
        port_conn.close()
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                          LOCAL_WORLD_SIZE=str(world_size), GROUP_RANK="0",
                          MASTER_ADDR=host, MASTER_PORT=str(port), **{TIMEOUT_ENV: repr(float(timeout))})
        if cleanup_dir:
            from .io.swap_dir import CLEANUP_ENV

            os.environ[CLEANUP_ENV] = cleanup_dir
        torch.set_num_threads(_threads_per_rank(world_size))
        _set_device(rank)
        td = datetime.timedelta(seconds=timeout)
        store = dist.TCPStore(host, port, world_size, is_master=False, timeout=td)
        dist.init_process_group(default_backend(), store=store, rank=rank, world_size=world_size, timeout=td)
        value = fn(*args, **kwargs)
        finish_collectives()  # (a peer still issuing collectives fails at once, naming this rank)
        payload = io.BytesIO()  # by value: shared-memory tensor handles die with this process
        torch.save(value, payload)
    except BaseException as e:  # everything, KeyboardInterrupt and SystemExit included
        _report_failure(results, rank, e, cleanup_dir)
    try:
        dist.destroy_process_group()
        results.put((rank, True, payload.getvalue()))
        results.close()
        results.join_thread()
        # Reported: a SIGTERM from here on (a launcher done waiting) ends the process quietly
        # instead of raising Terminated inside the exit handlers.
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    except BaseException as e:
        _report_failure(results, rank, e, cleanup_dir)
    _remove_own_swap(cleanup_dir)
    sys.stdout.flush()
    sys.stderr.flush()


_GRACE_S = 1.0
"""After the first failure, how long other ranks' reports are awaited before blaming one."""

_EXIT_GRACE_S = 10.0
"""After every rank reported success, how long each may take to exit before it is stopped."""


def _root_cause(reports: dict[int, _RankError], dead: dict[int, int],
                states: dict[int, str] | None = None) -> "WorkerFailure":
    """The failure to blame: a rank that died without reporting (killed, crashed) if any,
    else the earliest exception. Peers of a failed rank fail later ("Connection closed by
    peer"), and those are listed in ``others``. When that exception is a collective timeout
    naming ranks that never issued the collective, the first of those that did not report
    an error of its own is blamed (with the waiting rank's message saying what it waited
    for): the rank that timed out is the healthy one. ``states``: what the launcher saw of
    each rank's process (e.g. "stopped")."""
    if dead:
        rank = reporter = min(dead)
        failure = WorkerFailure(rank, None, f"ended with {_exit_status(dead[rank])} before reporting", "")
    else:
        rank = reporter = min(reports, key=lambda r: (reports[r].caught_at, r))
        report = reports[rank]
        message = report.message
        absent = [r for r in report.missing_ranks or [] if r not in reports]
        stalled = [] if absent or report.missing_ranks is None else \
            [r for r in sorted(states or {}) if r not in reports and r != rank]  # all issued it: one stopped mid-way?
        if absent:
            rank = absent[0]
            state = (states or {}).get(rank)
            message = ("did not arrive at a collective" + (f" (its process is {state})" if state else "")
                       + f": {message}")
        elif stalled:
            rank = stalled[0]
            message = f"its process is {states[rank]} in the middle of a collective: {message}"
        failure = WorkerFailure(rank, report.exc_type, message, report.details, exit_code=report.exit_code)
    # (the reporter's own message is the failure's when it blamed a rank that never arrived)
    failure.others = [f"rank {r}: {reports[r].exc_type}: {reports[r].message}" for r in sorted(reports)
                      if r not in (rank, reporter)]
    failure.others += [f"rank {r}: ended with {_exit_status(d)}" for r, d in sorted(dead.items()) if r != rank]
    return failure


def _exit_status(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


def _process_state(pid: int | None) -> str | None:
    """'stopped' when the process is stopped (SIGSTOP, a debugger), from /proc; else None."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None
    return {"T": "stopped", "t": "stopped by a tracer"}.get(state)


def _stop(procs: list) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
            try:  # a stopped rank acts on SIGTERM (unwinds, reports) only once continued
                os.kill(p.pid, signal.SIGCONT)
            except (OSError, TypeError):
                pass
    deadline = time.monotonic() + 5.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join(timeout=5.0)


def launch_local(fn: Callable[..., Any], nproc: int, *args, timeout: float = DEFAULT_TIMEOUT_S,
                 deadline: float | None = None, start_method: str | None = None, **kwargs) -> list[Any]:
    """Run fn(*args, **kwargs) as ranks 0..nproc-1 of a fresh process group on this
    machine; returns the ranks' results in rank order, or raises WorkerFailure (the first
    rank to fail; the others are stopped). fn's results must be picklable.

    deadline: seconds after which unfinished ranks are killed and WorkersTimedOut raised.
    start_method: "fork" (default on CPU) or "forkserver" (default with CUDA; needed too
    when this process has already run torch ops, whose thread pools do not survive fork).
    """
    if nproc < 1:
        raise ValueError(f"nproc={nproc} is invalid: expected >= 1")
    # Every rank imports torch._dynamo when it builds an optimizer (≈3 s of CPU): import it
    # once here, so that forked ranks share it instead of each importing it again.
    # torch._dynamo is private, and kept: the optimizer imports it lazily on first use (through
    # torch's internal _disable_dynamo wrappers), and no public API just loads it: the public
    # torch.compiler functions (disable, reset, ...) import it only as a side effect of doing
    # something else, and a forkserver preload takes module names, not calls.
    # tests/test_private_apis.py fails if the module goes away, if building an optimizer stops
    # importing it (the preload is then dead weight) or if `import torch` already does.
    import torch._dynamo  # noqa: F401

    method = start_method or ("forkserver" if _cuda_devices() else "fork")
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(["torch", "torch._dynamo", "torch.distributed", "tiertrain", *_heavy_imports_held()])
    host = "127.0.0.1"
    # Where the ranks' swappers register the directories they create
    # (tiertrain.io.swap_dir.CLEANUP_ENV): removed below once every rank is gone, however
    # each ended (returned, raised, or was killed before it could clean up itself).
    from .cleanup import new_launch_dir, remove_abandoned_launches

    for line in remove_abandoned_launches():  # (what launchers killed earlier could not remove)
        print(f"tiertrain: removed what a killed run left: {line}", file=sys.stderr)
    cleanup_dir = new_launch_dir()
    try:
        with _sigterm_raises():  # SIGTERM to the launcher: stop the ranks, then clean up
            return _run_workers(ctx, fn, nproc, host, timeout, deadline, cleanup_dir, args, kwargs)
    finally:
        _remove_left_behind(cleanup_dir)


HEAVY_IMPORTS = ("transformers.modeling_utils", "transformers.trainer", "peft")
"""Modules that take a second or more to import (transformers' model base imports its
generation, integrations and hub code): preloaded into the forkserver when this process holds
them, since ranks launched from a process that uses them import them too."""


def _heavy_imports_held() -> list[str]:
    # Not on a CUDA machine: an import that initialised CUDA in the server (accelerate's, say)
    # would leave every forked rank unable to use it; that is unmeasured there, and the gain
    # is the CPU test suite's.
    return [name for name in HEAVY_IMPORTS if name in sys.modules] if not _cuda_devices() else []


def _remove_left_behind(cleanup_dir: str) -> None:
    """Remove the swap directories the (now stopped) ranks registered and what a rank killed
    mid-save left in their checkpoint directories, then cleanup_dir."""
    from .cleanup import remove_launch_dir

    remove_launch_dir(cleanup_dir)


def _run_workers(ctx, fn, nproc: int, host: str, timeout: float, deadline: float | None, cleanup_dir: str,
                 args: tuple, kwargs: dict) -> list[Any]:
    results = ctx.Queue()
    conns, procs = [], []
    store = None
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        for rank in range(nproc):
            recv, send = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, name=f"tiertrain-rank{rank}", daemon=True,
                            args=(fn, rank, nproc, host, recv, timeout, results, args, kwargs, cleanup_dir))
            p.start()
            recv.close()
            conns.append(send)
            procs.append(p)
        # The store (and its server thread) exists only after every fork.
        store = dist.TCPStore(host, 0, nproc + 1, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        for send in conns:
            try:
                send.send(store.port)
            except OSError:
                pass  # that worker already died: noticed below
            send.close()
        values: dict[int, Any] = {}
        reports: dict[int, _RankError] = {}
        first_failure = None
        give_up = None if deadline is None else time.monotonic() + deadline
        while len(values) < nproc:
            if give_up is not None and time.monotonic() > give_up:
                missing = sorted(set(range(nproc)) - set(values))
                raise WorkersTimedOut(f"rank(s) {missing} did not finish within {deadline:.0f} s "
                                      f"(a hang: mismatched collectives or a dead peer?)")
            try:
                rank, ok, payload = results.get(timeout=0.1)
                if ok:
                    values[rank] = payload
                else:
                    reports[rank] = payload
            except queue.Empty:
                pass
            # Ranks that ended without a report seen yet (it may still be in the pipe).
            dead = {r: p.exitcode for r, p in enumerate(procs)
                    if r not in values and r not in reports and p.exitcode is not None}
            if (reports or dead) and first_failure is None:
                first_failure = time.monotonic()
            settled = len(values) + len(reports) + len(dead) == nproc
            if first_failure is not None and (settled or time.monotonic() - first_failure > _GRACE_S):
                # Drain what already arrived, then blame the root cause (see _root_cause).
                while True:
                    try:
                        rank, ok, payload = results.get(timeout=0.05)
                    except queue.Empty:
                        break
                    (values if ok else reports)[rank] = payload
                dead = {r: d for r, d in dead.items() if r not in reports and r not in values}
                if reports or dead:
                    raise _root_cause(reports, dead, {r: st for r, p in enumerate(procs)
                                                      if (st := _process_state(p.pid)) is not None})
                first_failure = None  # only finished ranks whose results were in flight
        # Every rank reported success and is on its way out (exit handlers: an event-file
        # writer's thread, multiprocessing finalizers): let it finish before any SIGTERM.
        for p in procs:
            p.join(timeout=_EXIT_GRACE_S)
    finally:
        _stop(procs)
        del store
    return [_unpickle_result(values[r]) for r in range(nproc)]


def _unpickle_result(payload: bytes) -> Any:
    """A worker's return value, as its torch.save wrote it (_worker), with the full unpickler.

    Unpickling is acceptable here, unlike for checkpoint files (tiertrain/state/checkpoint.py):
    the bytes come from our own child processes (started by launch_local, running the
    function this process handed them) over a multiprocessing queue, and are never read
    from a file. The results are arbitrary Python objects (dataclasses, memory reports,
    tuples of them), which torch's weights-only unpickler would refuse. An explicit pickle_module selects the full
    unpickler (torch.load's weights_only default is False then)."""
    return torch.load(io.BytesIO(payload), pickle_module=pickle)
