"""Collectives used by the ZeRO engine, each taking its process group explicitly, with a
byte counter so tests and benchmarks can check communication volume against ZeRO §1.

Volume convention (ZeRO §1, "communication analysis"): an all-reduce of Ψ elements counts
as 2Ψ (a reduce-scatter plus an all-gather), a reduce-scatter counts its full input Ψ, an
all-gather its full output Ψ. Plain data parallelism then moves 2Ψ per step, stages 1 and 2
move 2Ψ (reduce-scatter of gradients + all-gather of parameters), stage 3 moves 3Ψ.
"""
from __future__ import annotations

import contextlib
import datetime
import math
import os
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from .waits import WaitClock

DEFAULT_TIMEOUT_S = 600.0
"""The run's timeout when none is given (``tiertrain train --timeout``): the longest any
collective, point-to-point transfer or swap IO may wait before the run fails."""

TIMEOUT_ENV = "TIERTRAIN_TIMEOUT_S"
"""Set by tiertrain.launch in every rank (to the process group's timeout), so that waits
built deep inside the engine (collectives, pipeline transfers, swap IO) use the same value
as the process group without each constructor being handed it."""

DEFAULT_TIMEOUT = datetime.timedelta(seconds=DEFAULT_TIMEOUT_S)


def run_timeout() -> float:
    """The run's one timeout in seconds: $TIERTRAIN_TIMEOUT_S (set by tiertrain.launch from
    ``--timeout`` for every rank), else DEFAULT_TIMEOUT_S. Read at construction time of each
    waiting object, not at import: the launcher imports this module before it knows the value."""
    value = os.environ.get(TIMEOUT_ENV, "")
    try:
        seconds = float(value)
    except ValueError:
        return DEFAULT_TIMEOUT_S
    return seconds if math.isfinite(seconds) and seconds > 0 else DEFAULT_TIMEOUT_S


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (e.g. took different branches under ZeRO-3)."""


class CollectiveTimeout(RuntimeError):
    """A collective did not complete within the run's timeout. ``rank`` (global) timed out
    waiting for ``waiting_for``; ``missing_ranks`` (global) are the ranks of the group that
    had not issued that collective when the wait ended (empty when all had: the transfer
    itself stalled, e.g. a peer stopped or a link died mid-way)."""

    def __init__(self, message: str, rank: int, waiting_for: str, missing_ranks: list[int]):
        super().__init__(message)
        self.rank = rank
        self.waiting_for = waiting_for
        self.missing_ranks = missing_ranks


class PeerLost(RuntimeError):
    """A collective failed because a peer's connection closed (its process or its node died).
    ``rank`` (global) is the rank that noticed, ``lost_ranks`` the ranks it lost (global; all
    the group's ranks on other nodes when the peer could not be told apart)."""

    def __init__(self, message: str, rank: int, waiting_for: str, lost_ranks: list[int]):
        super().__init__(message)
        self.rank = rank
        self.waiting_for = waiting_for
        self.lost_ranks = lost_ranks


_CONNECTION_LOST = ("connection closed by peer", "connection reset by peer", "broken pipe",
                    "connection refused", "read error", "write error")
"""How gloo words a peer that went away (transport/tcp/pair.cc)."""


def _node_of(rank: int) -> int | None:
    """The node (torchrun's GROUP_RANK) a global rank runs on: torchrun numbers ranks node by
    node, LOCAL_WORLD_SIZE per node. None when not known."""
    try:
        return rank // int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError, ZeroDivisionError):
        return None


def is_connection_lost(error: BaseException) -> bool:
    """Whether error is the backend's word for a peer whose connection closed."""
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(words in text for words in _CONNECTION_LOST)


def peer_lost(error: BaseException, me: int, ranks: list[int], what: str | None = None,
              number: int | None = None) -> PeerLost:
    """The one-line error for a peer whose connection closed: which rank (and node) noticed,
    during what, and which rank(s) and node it lost. gloo names only the peer's address
    (``Connection closed by peer [10.0.0.2]:6788``); the node follows from torchrun's
    numbering (_node_of). ``ranks``: the global ranks of the group the error came from."""
    text = " ".join(str(error).split())
    found = re.search(r"\[([0-9A-Fa-f.:]+)\]:\d+", text)
    address = found.group(1) if found else None
    others = [r for r in ranks if r != me]
    my_node = _node_of(me)
    remote = [r for r in others if _node_of(r) is not None and _node_of(r) != my_node]
    if len(others) == 1:
        lost = others
    elif address and not address.startswith("127.") and remote:
        lost = remote  # another node's address: one of the ranks there
    else:
        lost = others

    def where(r: int) -> str:
        node = _node_of(r)
        return f"rank {r}" + (f" on node {node}" if node is not None and my_node is not None else "")

    nodes = sorted({_node_of(r) for r in lost} - {None, my_node})
    who = ((where(lost[0]) if len(lost) == 1 else f"one of ranks {lost}" if lost else "a peer")
           + (f" ({address})" if address else ""))
    why = f"node {nodes[0]} or its process died?" if len(nodes) == 1 else "its process died?"
    gloo = re.sub(r"^\[[^\]]*\] ", "", text).split(" This is typically")[0]
    during = (f" during {what}" + (f", collective #{number}" if number else "") + f" of the group of ranks {ranks}"
              if what else "")
    head = (f"rank {me}" + (f" (node {my_node})" if my_node is not None else "") +
            f" lost its connection to {who}{during}: {why} ({gloo})")
    return PeerLost(head, me, what or "", lost)


class Arrivals:
    """How many collectives each rank of a group has issued, kept in the group's c10d store
    (one counter per rank, ``store.add``), so that a rank whose wait times out can name the
    ranks that never issued the collective it waits for, even when those ranks are stopped
    or hung and cannot answer. The counters live in the store rather than in this object so
    that every Collectives object built on the same group (the engine's, the stage-3
    constructor's, a delayed update's) counts into the same per-rank sequence.

    One store round trip per collective (~30 µs on localhost, measured); a store that stops
    answering disables the counts (the run then fails with the plain timeout message)
    rather than failing the collective."""

    PREFIX = "tiertrain/issued/"

    def __init__(self, group: dist.ProcessGroup, rank: int, size: int):
        self.store = group.get_group_store()
        self.rank = rank
        self.size = size
        self.ranks = dist.get_process_group_ranks(group)

    def issue(self) -> int:
        """Count one more collective issued by this rank; returns its number (1-based)."""
        return int(self.store.add(f"{self.PREFIX}{self.rank}", 1))

    def counts(self) -> dict[int, int]:
        """Collectives issued so far by each group rank (0 for a rank that issued none)."""
        keys = [f"{self.PREFIX}{r}" for r in range(self.size)]
        return {r: int(self.store.add(k, 0)) for r, k in enumerate(keys)}

    WAITING = "tiertrain/waiting/"

    def different_collective(self, number: int, what: str) -> tuple[int, str] | None:
        """Called by a rank whose wait for collective #number (``what``) has gone on for
        long: say so in the store, and return (group rank, what it waits for) of a peer
        waiting in a collective of the same number that is another one (the ranks run
        different code: one ran out of batches, or took a branch the others did not), else
        None. A peer's entry counts only while the peer's issue count is still ``number``."""
        self.store.set(f"{self.WAITING}{self.rank}", f"{number}|{what}")
        counts = self.counts()
        for r in range(self.size):
            key = f"{self.WAITING}{r}"
            if r == self.rank or counts[r] != number or not self.store.check([key]):
                continue
            theirs, _, their_what = self.store.get(key).decode(errors="replace").partition("|")
            if theirs == str(number) and their_what != what:
                return r, their_what
        return None


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
            with self._clock.timing() if self._clock is not None else contextlib.nullcontext():
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
        check = None
        if number is not None and self.waits_in_slices:
            check = lambda: self._different_collective(what, number)  # noqa: E731
        return Work(handle, timeout=self.timeout, explain=lambda error: self._explain(what, number, started, error),
                    clock=self.counter.waits, check_peers=check)

    def _different_collective(self, what: str, number: int) -> "CollectiveMismatchError | None":
        try:
            found = self.arrivals.different_collective(number, what) if self.arrivals is not None else None
        except Exception:  # noqa: BLE001 - the store is gone: the timeout will name what it can
            return None
        if found is None:
            return None
        peer, theirs = found
        ranks = dist.get_process_group_ranks(self.group)
        me = ranks[self.rank]
        message = (f"rank {me} waits in collective #{number} of the group of ranks {ranks} ({what}), rank "
                   f"{ranks[peer]} in its collective #{number} ({theirs}): the ranks run different code — "
                   f"unequal numbers of batches or steps per rank, or a branch one rank took alone")
        self.fail(message)
        return CollectiveMismatchError(message)

    def _issue(self) -> int | None:
        """Count the collective about to be issued in the group's arrival counters."""
        if self.arrivals is None:
            return None
        try:
            return self.arrivals.issue()
        except Exception:  # noqa: BLE001 - the store went away: keep training, lose the counts
            self.arrivals = None
            return None

    def _explain(self, what: str, number: int | None, started: float, error: BaseException) -> RuntimeError:
        me = dist.get_global_rank(self.group, self.rank)
        ranks = dist.get_process_group_ranks(self.group)
        if "timed out" not in str(error).lower():
            return peer_lost(error, me, ranks, what, number)
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
        number = self._issue()
        handle = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        work = self._work(handle, f"all_reduce of {tensor.numel()} {tensor.dtype} elements", number)
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
        number = self._issue()
        what = f"reduce_scatter of {input.numel()} {input.dtype} elements"
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
        number = self._issue()
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
        work = self._work(handle, f"all_gather of {output.numel()} {output.dtype} elements", number)
        if not async_op:
            work.wait()
        return work

    def broadcast(self, tensor: torch.Tensor, src_local_rank: int) -> None:
        if self.size == 1:
            return
        self._usable()
        number = self._issue()
        src = dist.get_global_rank(self.group, src_local_rank)
        handle = dist.broadcast(tensor, src=src, group=self.group, async_op=True)
        self._work(handle, f"broadcast of {tensor.numel()} {tensor.dtype} elements from rank {src}", number).wait()

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
        t = torch.tensor([code, -code, digest, -digest], dtype=torch.int64)
        self.all_reduce(t, op=dist.ReduceOp.MAX, count=False)
        hi, lo = int(t[0]), -int(t[1])
        if hi != code or lo != code:
            raise CollectiveMismatchError(
                f"rank {self.rank} issued {describe(code)} but other ranks of its group issued "
                f"{describe(lo) if lo != code else describe(hi)}: ranks executed different modules "
                f"(a branch taken on some ranks only?). Under ZeRO-3 every rank must run the same "
                f"sequence of partitioned modules in forward and backward."
            )
        if int(t[2]) != digest or -int(t[3]) != digest:
            raise CollectiveMismatchError(
                f"rank {self.rank} and other ranks of its group reached {describe(code)} together, but "
                f"the sequences of partitioned modules they ran before it differ (digest {digest} here, "
                f"{int(t[2]) if int(t[2]) != digest else -int(t[3])} on another rank): ranks executed "
                f"different modules (a branch taken on some ranks only?). Under ZeRO-3 every rank must run "
                f"the same sequence of partitioned modules in forward and backward."
            )
