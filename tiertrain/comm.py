"""Collectives used by the ZeRO engine, each taking its process group explicitly, with a
byte counter so tests and benchmarks can check communication volume against ZeRO §7.

Volume convention (ZeRO §7, "communication analysis"): an all-reduce of Ψ elements counts
as 2Ψ (a reduce-scatter plus an all-gather), a reduce-scatter counts its full input Ψ, an
all-gather its full output Ψ. Plain data parallelism then moves 2Ψ per step, stages 1 and 2
move 2Ψ (reduce-scatter of gradients + all-gather of parameters), stage 3 moves 3Ψ.

The check that the ranks of a group issue the same collectives in the same order (Arrivals),
and the errors of a collective that fails, are tiertrain/collective_order.py's (imported here
too, as before).
"""
from __future__ import annotations

import contextlib
import datetime
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .collective_order import Arrivals, CollectiveMismatchError, CollectiveTimeout, is_connection_lost, peer_lost
from .collective_order import PeerLost, finish_collectives  # noqa: F401 (re-exported)
from .spans import span
from .waits import DEFAULT_TIMEOUT_S, TIMEOUT_ENV, WaitClock, run_timeout  # noqa: F401 (re-exported)

DEFAULT_TIMEOUT = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


@dataclass
class CommCounter:
    """Logical bytes moved per collective kind since the last reset."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    waits: WaitClock = field(default_factory=WaitClock)
    """Seconds the training thread blocked waiting for these collectives (not reset)."""

    def add(self, kind: str, nbytes: int) -> None:
        self.bytes[kind] += nbytes
        self.calls[kind] += 1

    def total(self) -> int:
        return sum(self.bytes.values())

    def reset(self) -> None:
        self.bytes.clear()
        self.calls.clear()

    def snapshot(self) -> dict[str, int]:
        return dict(self.bytes)


class Work:
    """A pending collective; ``wait()`` blocks (with a timeout) and runs its completion step once.

    ``explain(error)``, when given, turns the backend's timeout or lost-connection error into
    the exception to raise (Collectives names the collective, the ranks that did not arrive
    or the peer that went away)."""

    def __init__(self, handle, on_done=None, timeout: datetime.timedelta | None = None, explain=None,
                 clock: WaitClock | None = None, check_peers=None):
        self._handle = handle
        self._clock = clock
        self._on_done = on_done
        self._timeout = timeout if timeout is not None else datetime.timedelta(seconds=run_timeout())
        self._explain = explain
        self._check_peers = check_peers

    def then(self, on_done) -> "Work":
        """Run on_done once, after the collective and any earlier completion steps."""
        first = self._on_done
        self._on_done = on_done if first is None else (lambda: (first(), on_done()))
        return self

    def wait(self) -> None:
        if self._handle is not None:
            with span("wait/collective"), self._clock.timing() if self._clock is not None else contextlib.nullcontext():
                self._wait_in_slices()
            self._handle = None
        if self._on_done is not None:
            done, self._on_done = self._on_done, None
            done()

    def _wait_in_slices(self) -> None:
        """Wait up to the timeout; with check_peers, in slices of SUSPECT_S: a wait that
        outlasts a slice asks check_peers() whether the ranks are in different collectives
        (the error it returns is raised at once, not after the whole timeout). A gloo wait
        that times out can be waited on again."""
        total = self._timeout.total_seconds()
        waited = 0.0
        while True:
            part = total - waited if self._check_peers is None else min(SUSPECT_S, total - waited)
            try:
                self._handle.wait(timeout=datetime.timedelta(seconds=part))
                return
            except RuntimeError as e:  # gloo: "Timed out waiting …", c10d: "… timed out …"
                if self._explain is None:
                    raise
                timed_out = "timed out" in str(e).lower()
                if not timed_out and not is_connection_lost(e):
                    raise
                waited += part
                if not timed_out or waited >= total:
                    raise self._explain(e) from e
                mismatch = self._check_peers()
                if mismatch is not None:
                    raise mismatch from None


SUSPECT_S = 5.0
"""Seconds a collective may wait before its rank checks, in the store, whether the ranks of
its group wait in different collectives (then it fails at once, naming them)."""


def _within(seconds: float, fn):
    """fn()'s result, or None when it has not returned within seconds (it goes on, on a daemon
    thread, and its result is dropped). Where no thread can start (the address space used up:
    a peer lost under memory pressure, or an RLIMIT_AS cap) fn runs here, unbounded: the
    diagnosis the caller is writing must not become "can't start new thread" instead."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(fn()), name="comm store query", daemon=True)
    try:
        thread.start()
    except RuntimeError:
        return fn()
    thread.join(seconds)
    return result[0] if result else None


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Collectives:
    """The collectives of one process group, counted into one CommCounter.

    With ``group_size == 1`` every call is a local no-op (or a copy), so single-process
    runs use exactly the same code paths as distributed ones.
    """

    def __init__(self, group: dist.ProcessGroup | None, counter: CommCounter | None = None,
                 timeout: datetime.timedelta | None = None):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.counter = counter if counter is not None else CommCounter()
        # One timeout for the run (run_timeout(): what the launcher gave the process group),
        # not a constant of this module: a shorter constant here used to cut every wait at
        # 300 s whatever --timeout said.
        self.timeout = timeout if timeout is not None else datetime.timedelta(seconds=run_timeout())
        self.arrivals: Arrivals | None = None
        if group is not None and self.size > 1:
            try:
                self.arrivals = Arrivals(group, self.rank, self.size)
            except Exception:  # noqa: BLE001 - a group without a store: plain timeout messages
                self.arrivals = None
        # On gloo, all_to_all_single (+ a local sum) beat reduce_scatter_tensor 2× and
        # all_gather_into_tensor 1.5× at 32 MiB: bench/results/gloo_collectives.md.
        self.via_all_to_all = group is not None and dist.get_backend(group) == "gloo"
        self.waits_in_slices = self.via_all_to_all
        """Whether a long wait checks for ranks in different collectives (SUSPECT_S): on gloo,
        whose timed-out wait can be waited on again; NCCL aborts its communicator when a wait
        with a timeout expires, so there a wait takes the whole timeout at once."""
        self.broken: str | None = None
        """Set by :meth:`fail`: this rank left the group's common sequence of collectives."""
        self.dropped: list[str] = []
        """The passes this rank dropped in this run (drop_pass), each said in a few
        words. Their number is part of the description of every later collective, so that
        ranks which dropped different numbers stop at their next collective, also where the
        sizes would pair it with a peer's collective of another batch."""

    def drop_pass(self, description: str) -> None:
        """Record that this rank dropped a pass (``description``: which, for messages;
        also kept in the group's store, where a peer's mismatch message reads it): its
        peers must have dropped one too, or the next collective stops the ranks."""
        self.dropped.append(description)
        if self.arrivals is not None:
            try:
                self.arrivals.note_dropped(len(self.dropped), description)
            except Exception:  # noqa: BLE001 - the store is gone: this rank's own message still names it
                pass

    def _described(self, what: str) -> str:
        """``what`` as the ranks compare it: with the number of passes dropped, if any."""
        n = len(self.dropped)
        return what if not n else f"{what}, after {n} pass{'es' if n > 1 else ''} dropped"

    def fail(self, reason: str) -> None:
        """Mark this rank as out of step with its group (it skipped, added or reordered a
        collective): every later collective through this object raises instead of meeting a
        peer's different collective, which gloo would answer with wrong data or an abort."""
        self.broken = reason

    def _usable(self) -> None:
        if self.broken is not None:
            raise CollectiveMismatchError(f"rank {self.rank} is out of step with its group since an earlier "
                                          f"error, so it issues no more collectives: {self.broken}")

    def _work(self, handle, what: str, number: int | None) -> Work:
        """A Work whose timeout says what this rank waited for and which ranks never issued it,
        and which fails within seconds when the ranks wait in different collectives."""
        started = time.monotonic()
        what = self._described(what)
        check = None
        if number is not None and self.waits_in_slices:
            check = lambda: self._different_collective(what, number)  # noqa: E731
        return Work(handle, timeout=self.timeout, explain=lambda error: self._explain(what, number, started, error),
                    clock=self.counter.waits, check_peers=check)

    def _different_collective(self, what: str, number: int) -> "CollectiveMismatchError | None":
        """A long wait: the error to raise when a peer is in another collective #number, or
        done with the group; else None."""
        try:
            found = self.arrivals.different_collective(number, what) if self.arrivals is not None else None
        except Exception:  # noqa: BLE001 - the store is gone: the timeout will name what it can
            return None
        if found is None:
            return None
        return self._mismatch(f"waits in collective #{number}", what, *found)

    def _dropped_note(self) -> str:
        """What a mismatch message adds when the ranks dropped different numbers of passes:
        each rank's number and its last (from the group's store where it answers)."""
        dropped = {self.rank: (len(self.dropped), self.dropped[-1] if self.dropped else "")}
        try:
            dropped = {**self.arrivals.dropped(), **dropped} if self.arrivals is not None else dropped
        except Exception:  # noqa: BLE001 - the store is gone: this rank's own count
            pass
        if all(n == len(self.dropped) for n, _ in dropped.values()) and (len(dropped) > 1 or not self.dropped):
            return ""
        ranks = dist.get_process_group_ranks(self.group)
        said = ", ".join(f"rank {ranks[r]} dropped {n or 'none'}" + (f" (the last: {last})" if last else "")
                         for r, (n, last) in sorted(dropped.items()))
        return (f" The ranks dropped different numbers of passes (a forward or backward that raised, caught by the "
                f"loop, or a forward with no backward; {said}); a pass skipped on some ranks only leaves the ranks "
                f"out of step: skip it on every rank or on none, or resume from the last checkpoint.")

    def _mismatch(self, doing: str, what: str, peer: int, theirs: str, their_number: int) -> CollectiveMismatchError:
        """The one-line error for ranks at one collective number in different collectives (or
        a peer done with the group): both ranks and what each is in. Marks this rank out of
        step (fail)."""
        ranks = dist.get_process_group_ranks(self.group)
        if theirs == Arrivals.FINISHED:
            where = f"rank {ranks[peer]} returned from its program after its collective #{their_number}"
        else:
            where = f"rank {ranks[peer]} in its collective #{their_number} ({theirs})"
        message = (f"rank {ranks[self.rank]} {doing} of the group of ranks {ranks} ({what}), {where}: the ranks "
                   f"run different code — unequal numbers of batches or steps per rank, or a branch one rank took "
                   f"alone." + self._dropped_note())
        self.fail(message)
        return CollectiveMismatchError(message)

    def _issue(self, what: str) -> int | None:
        """Take the number of the collective ``what`` about to be issued, after checking that
        no peer issued a different collective at that number (Arrivals.issue): then raise
        CollectiveMismatchError instead of issuing it. None when the group keeps no count."""
        if self.arrivals is None or not self.arrivals.enabled:
            return None
        what = self._described(what)
        try:
            number, different = self.arrivals.issue(what)
        except Exception:  # noqa: BLE001 - the store went away: keep training, lose the checks
            self.arrivals = None
            return None
        if different is not None:
            raise self._mismatch(f"is about to issue collective #{number}", what, *different)
        return number

    def enter(self, operation: str) -> None:
        """Mark the start of a collective operation of the engine (``operation``, e.g.
        "save_checkpoint()") in the group's sequence, as a collective would be, without
        communicating: ranks whose code differs here (one saves while its peer is still in a
        training step, one has returned) fail at once naming both, also where the operation
        issues no collective on this group first (a checkpoint's gathers run on the world
        group, stage 0's full_state_dict on none). Every rank of the group must call it."""
        if self.size == 1:
            return
        self._usable()
        self._issue(operation)

    def _control_device(self) -> torch.device | str | None:
        """Where this group's small control tensors live: the CPU on gloo, else the accelerator
        (NCCL refuses CPU tensors)."""
        return "cpu" if self.via_all_to_all else torch.accelerator.current_accelerator()

    def meet(self, operation: str) -> None:
        """As enter(operation), but a small all-reduce known by the operation's name: when it
        returns every rank of the group is in ``operation``. For operations whose first wait
        is not one of this group's checked collectives (a checkpoint makes a gloo group of its
        own and waits in its barriers): a rank alone in it fails within the run's timeout
        naming the ranks that never came, and at once naming a peer that returned or is still
        training, instead of waiting in the process group's barrier without a name."""
        if self.size == 1:
            return
        self._usable()
        number = self._issue(operation)  # (the all-reduce is known by the operation's name)
        handle = dist.all_reduce(torch.zeros(1, dtype=torch.int32, device=self._control_device()), group=self.group,
                                 async_op=True)
        self._work(handle, operation, number).wait()

    def _explain(self, what: str, number: int | None, started: float, error: BaseException) -> RuntimeError:
        me = dist.get_global_rank(self.group, self.rank)
        ranks = dist.get_process_group_ranks(self.group)
        if "timed out" not in str(error).lower():
            # A peer went away: one that raised on a different collective, or returned from its
            # program, is named as such; else it died (peer_lost). The store is asked on a helper
            # thread, for SUSPECT_S at most: a store whose host died may not answer until its
            # own timeout, and a lost peer must be reported at once.
            mismatch = None
            if number is not None:
                mismatch = _within(SUSPECT_S, lambda: self._different_collective(what, number))
            return mismatch if mismatch is not None else peer_lost(error, me, ranks, what, number)
        waited = time.monotonic() - started
        head = (f"rank {me} timed out after {waited:.0f} s (timeout {self.timeout.total_seconds():g} s) "
                f"waiting for {what}" + (f", collective #{number}" if number else "") +
                f" of the group of ranks {ranks}")
        missing: list[int] = []
        detail = ""
        if number is not None and self.arrivals is not None:
            try:
                counts = self.arrivals.counts()
            except Exception as e:  # noqa: BLE001 - the store is gone too (a node died?)
                detail = f"; the arrival counters could not be read ({type(e).__name__}: {e})"
            else:
                behind = {r: c for r, c in counts.items() if c < number and r != self.rank}
                missing = [ranks[r] for r in sorted(behind)]
                if missing:
                    detail = "; " + ", ".join(f"rank {ranks[r]} did not arrive (it issued {c} collectives on this "
                                              f"group, this one is #{number})" for r, c in sorted(behind.items()))
                    detail += ": stopped, hung or slower than the timeout"
                else:
                    detail = ("; every rank of the group issued it, so the transfer itself stalled "
                              "(a peer stopped or its connection died mid-collective)")
        if not detail:
            detail = f" ({' '.join(str(error).split())})"
        return CollectiveTimeout(head + detail, me, what, missing)

    def _peer_splits(self, numel: int) -> tuple[int, list[int]]:
        """With 2 ranks: the other rank, and all_to_all split sizes that send `numel`
        elements to it and none to this rank."""
        peer = 1 - self.rank
        splits = [0, 0]
        splits[peer] = numel
        return peer, splits

    def all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM, async_op: bool = False,
                   count: bool = True) -> Work:
        if count:
            self.counter.add("all_reduce", 2 * _nbytes(tensor))
        if self.size == 1:
            return Work(None)
        self._usable()
        reduction = "" if op == dist.ReduceOp.SUM else f" ({getattr(op, 'name', op)})"
        what = f"all_reduce{reduction} of {tensor.numel()} {tensor.dtype} elements"
        number = self._issue(what)
        handle = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        work = self._work(handle, what, number)
        if not async_op:
            work.wait()
        return work

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """Sum input (size × output.numel()) across ranks; this rank keeps chunk `rank` in output.
        Output may be that chunk of input itself (in place: no separate result to copy back)."""
        self.counter.add("reduce_scatter", _nbytes(input))
        if self.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Work(None)
        self._usable()
        what = f"reduce_scatter of {input.numel()} {input.dtype} elements"
        number = self._issue(what)
        chunks = input.view(self.size, -1)
        mine = chunks[self.rank]
        in_place = output.data_ptr() == mine.data_ptr()
        if self.via_all_to_all and self.size == 2:
            # Send only the peer's chunk, receive the peer's copy of mine, add my own chunk:
            # no exchange with myself (gloo's all_to_all moves the self chunk too) and no
            # full-size receive buffer. x0 + x1 in either order is the same float sum, so
            # in place or not the results are bit-identical.
            peer, splits = self._peer_splits(output.numel())
            received = torch.empty_like(output) if in_place else output
            handle = dist.all_to_all_single(received, chunks[peer], output_split_sizes=splits,
                                            input_split_sizes=splits, group=self.group, async_op=True)
            work = self._work(handle, what, number).then(lambda: output.add_(received if in_place else mine))
        elif self.via_all_to_all:
            received = torch.empty_like(input)  # chunk i: rank i's copy of this rank's chunk
            handle = dist.all_to_all_single(received, input, group=self.group, async_op=True)
            work = self._work(handle, what, number).then(
                lambda: torch.sum(received.view(self.size, -1), dim=0, out=output))
        elif in_place:
            result = torch.empty_like(output)
            handle = dist.reduce_scatter_tensor(result, input, group=self.group, async_op=True)
            work = self._work(handle, what, number).then(lambda: output.copy_(result))
        else:
            handle = dist.reduce_scatter_tensor(output, input, group=self.group, async_op=True)
            work = self._work(handle, what, number)
        if not async_op:
            work.wait()
        return work

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, async_op: bool = False) -> Work:
        """Concatenate every rank's input (in rank order) into output."""
        self.counter.add("all_gather", _nbytes(output))
        if self.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Work(None)
        self._usable()
        what = f"all_gather of {output.numel()} {output.dtype} elements"
        number = self._issue(what)
        if self.via_all_to_all and self.size == 2:
            # Send my shard to the peer and receive its shard straight into its chunk of
            # output (split sizes: nothing to myself); my own chunk is a local copy, made
            # while the exchange runs. No replicated send buffer, no self exchange.
            chunks = output.view(2, -1)
            peer, splits = self._peer_splits(input.numel())
            handle = dist.all_to_all_single(chunks[peer], input, output_split_sizes=splits,
                                            input_split_sizes=splits, group=self.group, async_op=True)
            if chunks[self.rank].data_ptr() != input.data_ptr():  # resident units gather in place
                chunks[self.rank].copy_(input)
        elif self.via_all_to_all:  # send my shard to every rank; chunk i of output is rank i's shard
            replicated = input.repeat(self.size)
            handle = dist.all_to_all_single(output, replicated, group=self.group, async_op=True)
        else:
            handle = dist.all_gather_into_tensor(output, input, group=self.group, async_op=True)
        work = self._work(handle, what, number)
        if not async_op:
            work.wait()
        return work

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
                   input_splits: list[int], label: str, async_op: bool = False) -> Work:
        """Send input's chunk i (input_splits[i] rows, in rank order) to rank i; output's chunk
        i (output_splits[i] rows) receives rank i's chunk for this rank. label: what is
        exchanged, the same words on every rank (the splits differ; a rank that waits long
        compares its collective with its peers' by these words). Counted as the bytes this
        rank sends to the others."""
        row = input[0].numel() * input.element_size() if input.dim() > 1 else input.element_size()
        self.counter.add("all_to_all", sum(n for r, n in enumerate(input_splits) if r != self.rank) * row)
        if self.size == 1:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Work(None)
        self._usable()
        what = f"all_to_all of {label} ({input.dtype})"
        number = self._issue(what)
        handle = dist.all_to_all_single(output, input, output_split_sizes=list(output_splits),
                                        input_split_sizes=list(input_splits), group=self.group, async_op=True)
        work = self._work(handle, what, number)
        if not async_op:
            work.wait()
        return work

    def broadcast(self, tensor: torch.Tensor, src_local_rank: int) -> None:
        if self.size == 1:
            return
        self._usable()
        src = dist.get_global_rank(self.group, src_local_rank)
        what = f"broadcast of {tensor.numel()} {tensor.dtype} elements from rank {src}"
        number = self._issue(what)
        handle = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        self._work(handle, what, number).wait()

    def extremes(self, values: list[int]) -> tuple[list[int], list[int]]:
        """The largest and the smallest of each of these integers (|v| < 2**63) over the
        group's ranks, in one all-reduce; every rank must pass as many."""
        t = torch.tensor(values + [-v for v in values], dtype=torch.int64)
        if self.size > 1:
            t = t.to(self._control_device())
            self.all_reduce(t, op=dist.ReduceOp.MAX, count=False)
        t = t.cpu().tolist()
        return t[:len(values)], [-v for v in t[len(values):]]

    def check_same(self, code: int, describe, digest: int = 0) -> None:
        """Raise CollectiveMismatchError on every rank unless all ranks pass the same code
        (and the same digest, 0 <= digest < 2**62: e.g. a hash of what each rank did since
        its previous check).

        Costs one 4-element all-reduce. Ranks that diverged (different branches, a skipped
        module) learn it here, together, instead of hanging or silently exchanging the wrong
        buffers in the collective that follows.
        """
        if self.size == 1:
            return
        self._usable()
        (hi, hi_digest), (lo, lo_digest) = self.extremes([code, digest])
        if hi != code or lo != code:
            raise CollectiveMismatchError(
                f"rank {self.rank} issued {describe(code)} but other ranks of its group issued "
                f"{describe(lo) if lo != code else describe(hi)}: ranks executed different modules "
                f"(a branch taken on some ranks only?). Under ZeRO-3 every rank must run the same "
                f"sequence of partitioned modules in forward and backward." + self._dropped_note()
            )
        if hi_digest != digest or lo_digest != digest:
            raise CollectiveMismatchError(
                f"rank {self.rank} and other ranks of its group reached {describe(code)} together, but "
                f"the sequences of partitioned modules they ran before it differ (digest {digest} here, "
                f"{hi_digest if hi_digest != digest else lo_digest} on another rank): ranks executed "
                f"different modules (a branch taken on some ranks only?). Under ZeRO-3 every rank must run "
                f"the same sequence of partitioned modules in forward and backward." + self._dropped_note()
            )
