"""Collectives used by the ZeRO engine, each taking its process group explicitly, with a
byte counter so tests and benchmarks can check communication volume against ZeRO §1.

Volume convention (ZeRO §1, "communication analysis"): an all-reduce of Ψ elements counts
as 2Ψ (a reduce-scatter plus an all-gather), a reduce-scatter counts its full input Ψ, an
all-gather its full output Ψ. Plain data parallelism then moves 2Ψ per step, stages 1 and 2
move 2Ψ (reduce-scatter of gradients + all-gather of parameters), stage 3 moves 3Ψ.
"""
from __future__ import annotations

import datetime
from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = datetime.timedelta(minutes=5)


class CollectiveMismatchError(RuntimeError):
    """Ranks issued different collectives (e.g. took different branches under ZeRO-3)."""


@dataclass
class CommCounter:
    """Logical bytes moved per collective kind since the last reset."""

    bytes: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))

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
    """A pending collective; ``wait()`` blocks (with a timeout) and runs its completion step once."""

    def __init__(self, handle, on_done=None, timeout: datetime.timedelta = DEFAULT_TIMEOUT):
        self._handle = handle
        self._on_done = on_done
        self._timeout = timeout

    def then(self, on_done) -> "Work":
        """Run on_done once, after the collective and any earlier completion steps."""
        first = self._on_done
        self._on_done = on_done if first is None else (lambda: (first(), on_done()))
        return self

    def wait(self) -> None:
        if self._handle is not None:
            self._handle.wait(timeout=self._timeout)
            self._handle = None
        if self._on_done is not None:
            done, self._on_done = self._on_done, None
            done()


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class Collectives:
    """The collectives of one process group, counted into one CommCounter.

    With ``group_size == 1`` every call is a local no-op (or a copy), so single-process
    runs use exactly the same code paths as distributed ones.
    """

    def __init__(self, group: dist.ProcessGroup | None, counter: CommCounter | None = None,
                 timeout: datetime.timedelta = DEFAULT_TIMEOUT):
        self.group = group
        self.size = 1 if group is None else dist.get_world_size(group)
        self.rank = 0 if group is None else dist.get_rank(group)
        self.counter = counter if counter is not None else CommCounter()
        self.timeout = timeout
        # On gloo, all_to_all_single (+ a local sum) beat reduce_scatter_tensor 2× and
        # all_gather_into_tensor 1.5× at 32 MiB: bench/results/gloo_collectives.md.
        self.via_all_to_all = group is not None and dist.get_backend(group) == "gloo"
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
        handle = dist.all_reduce(tensor, op=op, group=self.group, async_op=True)
        work = Work(handle, timeout=self.timeout)
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
            work = Work(handle, timeout=self.timeout).then(lambda: output.add_(received if in_place else mine))
        elif self.via_all_to_all:
            received = torch.empty_like(input)  # chunk i: rank i's copy of this rank's chunk
            handle = dist.all_to_all_single(received, input, group=self.group, async_op=True)
            work = Work(handle, timeout=self.timeout).then(
                lambda: torch.sum(received.view(self.size, -1), dim=0, out=output))
        elif in_place:
            result = torch.empty_like(output)
            handle = dist.reduce_scatter_tensor(result, input, group=self.group, async_op=True)
            work = Work(handle, timeout=self.timeout).then(lambda: output.copy_(result))
        else:
            handle = dist.reduce_scatter_tensor(output, input, group=self.group, async_op=True)
            work = Work(handle, timeout=self.timeout)
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
        work = Work(handle, timeout=self.timeout)
        if not async_op:
            work.wait()
        return work

    def broadcast(self, tensor: torch.Tensor, src_local_rank: int) -> None:
        if self.size == 1:
            return
        self._usable()
        src = dist.get_global_rank(self.group, src_local_rank)
        dist.broadcast(tensor, src=src, group=self.group, async_op=True).wait(timeout=self.timeout)

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
