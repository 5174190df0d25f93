"""Point-to-point transfers between pipeline ranks, every handle waited on with a timeout.

Only ``dist.isend``/``dist.irecv`` are used, one tensor per call, each with a tag that names
the transfer (micro-batch, stage boundary, direction), so messages between the same two
ranks can never be confused whatever order they are posted in. ``batch_isend_irecv`` is
deliberately not used (on gloo it has hung elsewhere in this project's history).

Every wait has a timeout: a transfer that cannot complete (a deadlocked schedule, a dead
peer) raises :class:`P2PTimeout` naming the transfer instead of hanging the run.
A transfer to this same rank (p = 1 with several chunks) goes through a local mailbox.
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from ..comm import run_timeout
from ..errors import TiertrainError

__all__ = ["P2PTimeout", "PendingTransfer", "PipeComm", "transfer_tag"]


class P2PTimeout(TiertrainError, RuntimeError):
    """A point-to-point transfer did not complete in time (deadlock or failed peer)."""


def transfer_tag(microbatch: int, boundary: int, grad: bool, num_stages: int) -> int:
    """Tag of the transfer across the boundary between stages ``boundary`` and ``boundary+1``:
    the activation (forward) or its gradient (backward) of ``microbatch``."""
    return ((microbatch * max(num_stages - 1, 1) + boundary) << 1) | int(grad)


class PendingTransfer:
    """A posted isend/irecv. Keeps its tensor alive until :meth:`wait` returns."""

    def __init__(self, work, tensor: torch.Tensor | None, what: str, timeout: float, local=None):
        self._work = work
        self.tensor = tensor
        self.what = what
        self._timeout = timeout
        self._local = local  # a local receive: fetches the tensor from the mailbox at wait()

    def is_completed(self) -> bool:
        return self._work is None or self._work.is_completed()

    def wait(self) -> torch.Tensor:
        """Block until done (at most the timeout); returns the tensor (the received data)."""
        if self._local is not None:
            self.tensor, self._local = self._local(), None
        if self._work is not None:
            try:
                self._work.wait(timeout=datetime.timedelta(seconds=self._timeout))
            except RuntimeError as e:
                raise P2PTimeout(f"{self.what} did not complete within {self._timeout:g} s "
                                 f"(pipeline deadlock or a failed peer): {e}") from e
            self._work = None
        return self.tensor


class PipeComm:
    """isend/irecv between the ranks of one pipeline (the ``pp`` group of a topology).

    ``peer`` arguments are pipeline ranks (``0 .. p-1``), mapped to global ranks here."""

    def __init__(self, topology, timeout: float | None = None):
        self.group = topology.group("pp")
        self.ranks = topology.ranks("pp")
        self.me = topology.coord("pp")
        # None: the run's one timeout (--timeout, tiertrain.comm.run_timeout()), the same
        # as every collective's, not a constant of the pipeline.
        self.timeout = run_timeout() if timeout is None else float(timeout)
        self._mailbox: dict[int, torch.Tensor] = {}
        self.bytes_sent = 0

    def isend(self, tensor: torch.Tensor, peer: int, tag: int, what: str) -> PendingTransfer:
        tensor = tensor.detach().contiguous()
        self.bytes_sent += tensor.numel() * tensor.element_size()
        if peer == self.me:
            self._mailbox[tag] = tensor
            return PendingTransfer(None, tensor, what, self.timeout)
        work = dist.isend(tensor, dst=self.ranks[peer], group=self.group, tag=tag)
        return PendingTransfer(work, tensor, f"{what} (send to pipeline rank {peer})", self.timeout)

    def irecv(self, shape, dtype: torch.dtype, device, peer: int, tag: int, what: str) -> PendingTransfer:
        if peer == self.me:
            def take() -> torch.Tensor:
                if tag not in self._mailbox:
                    raise P2PTimeout(f"{what}: nothing was sent to this rank under tag {tag} "
                                     f"(a local transfer must be sent before it is received)")
                return self._mailbox.pop(tag)
            return PendingTransfer(None, None, what, self.timeout, local=take)
        buf = torch.empty(tuple(shape), dtype=dtype, device=device)
        work = dist.irecv(buf, src=self.ranks[peer], group=self.group, tag=tag)
        return PendingTransfer(work, buf, f"{what} (recv from pipeline rank {peer})", self.timeout)
