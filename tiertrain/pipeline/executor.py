"""Run a pipeline schedule on the ``pp`` axis of a topology.

:class:`PipelineExecutor` interprets this rank's lowered schedule
(:func:`~tiertrain.pipeline.schedule.lower`): compute actions call the stage modules,
communication actions post ``isend``/``irecv`` (:mod:`tiertrain.pipeline.p2p`).

* **No deadlock by construction.** Sends are posted and not waited on until later, so a
  rank only ever blocks on a *receive*, and only for data its peer produces by running its
  own list in order; the schedule is simulated first (:func:`~.schedule.timeline`), which
  raises :class:`~.schedule.ScheduleDeadlock` for a schedule whose in-order execution
  cannot finish. Every wait has a timeout anyway (``timeout``), so a failure costs seconds.
  The next receive in the list is posted one compute action ahead, so its data arrives
  while the rank computes.
* **Memory.** A stage's output activation is released as soon as it is handed to
  ``isend``: its ``.data`` is replaced by a 1-element tensor (Megatron's
  ``deallocate_output_tensor``); the send keeps the buffer alive until it completes, and the
  backward runs from the output's gradient edge (its ``grad_fn``, which does not need the
  output's values; :func:`backward_from`). What backward needs is kept by autograd as usual.
* **Loss and gradients.** The last stage's loss of each micro-batch is scaled by ``1/m``
  before its backward, so the stage parameters' ``.grad`` accumulate the gradient of the
  mean loss over the ``m`` micro-batches, exactly as a non-pipelined run with gradient
  accumulation. :meth:`PipelineExecutor.run` returns that mean loss on every pipeline rank.

A stage module is called as ``stage(x, batch)`` (see :mod:`tiertrain.pipeline.stage`).
"""
from __future__ import annotations

import math
import time
from typing import Callable, Sequence

import torch
import torch.distributed as dist
from torch.autograd.graph import get_gradient_edge

from .p2p import PendingTransfer, PipeComm, transfer_tag
from .schedule import Action, ActionKind, Schedule, forward_only, lower, one_f_one_b, stage_rank, timeline
from .stage import tied_weight_grad_sync

__all__ = ["PipelineExecutor", "release_output", "backward_from"]

K = ActionKind


def release_output(t: torch.Tensor) -> int:
    """Free an output activation's storage while keeping its ``grad_fn`` (Megatron's
    ``deallocate_output_tensor``); only valid for a tensor autograd does not save by identity
    (outputs of view ops are left alone). Returns the bytes released from ``t``."""
    # ``Tensor._base`` is private, and kept: no public API says whether a tensor is a view
    # (the "Tensor Views" docs only compare two tensors' storage pointers, which needs the base
    # at hand, and storage sizes cannot tell ``x.view(shape)``, a view over all of ``x``'s
    # storage, from a tensor that owns its storage). A view is skipped because swapping its ``.data`` frees
    # nothing while its base holds the storage (Megatron tests ``_base`` for the same reason).
    # tests/test_private_apis.py fails if ``_base`` stops telling views from non-views.
    if t._base is not None or t.numel() <= 1:
        return 0
    nbytes = t.numel() * t.element_size()
    t.data = torch.empty((1,), device=t.device, dtype=t.dtype)
    return nbytes


def backward_from(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``output.backward(grad)`` for an output whose storage was released (Megatron's
    ``custom_backward``): backpropagates from the output's gradient edge
    (``torch.autograd.graph.get_gradient_edge``), for which ``torch.autograd.backward`` checks
    ``grad`` against the shape recorded in the graph instead of the (released) tensor's shape."""
    torch.autograd.backward(get_gradient_edge(output), grad)


class PipelineExecutor:
    """Runs one pipeline step (forward + backward of ``m`` micro-batches) per :meth:`run`.

    ``stages``: this rank's stage modules in local-chunk order, i.e. global stages
    ``r, r+p, …`` for pipeline rank ``r`` (:func:`~.stage.stages_for_rank`); their number is
    ``v``. ``schedule``: a function ``(p, m, v) -> Schedule`` (:func:`~.schedule.gpipe`,
    :func:`~.schedule.one_f_one_b`, :func:`~.schedule.interleaved_one_f_one_b`) called with
    ``m = len(batches)``, or a fixed :class:`~.schedule.Schedule`. ``activation_shape``: the
    shape of the tensor sent between stages for one micro-batch (GPT: ``(micro_batch, seq,
    hidden)``), or a function ``batch -> shape``; the gradient sent back has the same shape.
    ``tied``: run :func:`~.stage.tied_weight_grad_sync` after the backward (default: when a
    stage says ``stage.tied``). ``timeout``: seconds any single transfer may wait.
    ``check``: simulate the schedule first and refuse one that deadlocks.
    ``grads_ready``: called as ``grads_ready(stage)`` once a local stage's gradients for the
    step are final: right after its last backward, or for a stage holding a tied weight after
    the tied-gradient exchange. An engine can start the data-parallel reduction (ZeRO-2
    reduce-scatter) of that stage's gradients there, overlapping the remaining pipeline work.
    ``scatter_gather``: Megatron PTD-P §4.1's scatter/gather optimisation (default: on when
    tp > 1 and the stages are not sequence parallel). The tensor sent between stages is then
    the same on every tensor-parallel rank of a stage (after the row-parallel all-reduce), so
    each tp rank sends only its 1/t of it (flattened) and the receiving stage's tp ranks
    all-gather the pieces: each point-to-point link carries 1/t of the bytes, and the
    all-gather runs over the fast intra-node links. Under sequence parallelism each tp rank's
    activation is already its own 1/t (along the sequence) and is sent as it is.
    """

    def __init__(self, stages: Sequence[torch.nn.Module], topology,
                 schedule: Callable[..., Schedule] | Schedule = one_f_one_b,
                 activation_shape: tuple[int, ...] | Callable[[dict], tuple[int, ...]] | None = None,
                 dtype: torch.dtype = torch.float32, *, tied: bool | None = None,
                 timeout: float | None = None, check: bool = True,
                 grads_ready: Callable[[torch.nn.Module], None] | None = None,
                 scatter_gather: bool | None = None):
        self.stages = list(stages)
        if not self.stages:
            raise ValueError("PipelineExecutor: stages is empty: this rank must run at least one stage")
        self.topology = topology
        self.p = topology.size("pp")
        self.rank = topology.coord("pp")
        self.v = len(self.stages)
        self.num_stages = self.p * self.v
        self.stage_ids = [self.rank + k * self.p for k in range(self.v)]
        self.module_of = dict(zip(self.stage_ids, self.stages))
        self.schedule_fn = schedule
        if self.num_stages > 1 and activation_shape is None:
            raise ValueError("PipelineExecutor: activation_shape is required with more than one stage "
                             "(GPT: (micro_batch, seq_len, hidden))")
        self.activation_shape = activation_shape
        self.dtype = dtype
        self.tied = any(getattr(s, "tied", False) for s in self.stages) if tied is None else tied
        self.check = check
        self.grads_ready = grads_ready
        self.comm = PipeComm(topology, timeout)
        self.device = next((p.device for s in self.stages for p in s.parameters()), topology.device)
        self.tp = topology.size("tp")
        if scatter_gather is None:
            scatter_gather = self.tp > 1 and not any(getattr(s, "sequence_parallel", False) for s in self.stages)
        self.scatter_gather = bool(scatter_gather) and self.tp > 1
        """Send 1/t of each boundary tensor per tp rank and all-gather on receipt (see above)."""
        self._schedules: dict[int, Schedule] = {}
        self.stats: dict[str, float] = {}
        """After :meth:`run`: ``max_in_flight`` (most (micro-batch, chunk) activations held),
        ``wall_s``, ``busy_s`` (time in forward/backward compute), ``recv_wait_s``, ``bytes_sent``,
        ``released_bytes`` (output activations freed right after being handed to isend)."""
        self.profile: list[tuple[Action, float, float]] = []
        """After :meth:`run`: each compute action with its start and end (``time.perf_counter``)."""

    # ------------------------------------------------------------------ schedule

    def schedule_for(self, m: int) -> Schedule:
        """The (checked) schedule for ``m`` micro-batches."""
        if m not in self._schedules:
            fn = self.schedule_fn
            sched = fn if isinstance(fn, Schedule) else fn(self.p, m, self.v)
            if (sched.p, sched.m, sched.v) != (self.p, m, self.v):
                raise ValueError(f"PipelineExecutor: schedule {sched.name!r} is for p={sched.p}, m={sched.m}, "
                                 f"v={sched.v} but this pipeline has p={self.p}, m={m}, v={self.v}")
            self._schedules[m] = self._checked(sched)
        return self._schedules[m]

    # ------------------------------------------------------------------ one step

    def run(self, batches: list[dict], loss_scale: float = 1.0) -> float:
        """Forward and backward of every micro-batch in ``batches`` (one dict per micro-batch,
        the same list on every pipeline rank); gradients accumulate into the stage parameters'
        ``.grad``. Returns the mean loss over the micro-batches, on every pipeline rank.

        With tied weights, ``run`` ends with the tied-gradient exchange, which sums whole
        ``.grad`` tensors: zero the gradients between steps (accumulating several ``run``
        calls would count earlier contributions twice; pass ``tied=False`` and call
        :func:`~.stage.tied_weight_grad_sync` once yourself instead). ``loss_scale``
        multiplies each micro-batch's loss before its backward (fp16 loss scaling); the
        returned loss is unscaled."""
        m = self._count(batches, "run")
        self._execute(lower(self.schedule_for(m), self.rank), batches, float(loss_scale), forward_only=False)
        if self.tied:
            tied_weight_grad_sync(self.stages, self.topology, self.comm.timeout)
            if self.grads_ready is not None:
                for st in self.stages:
                    if getattr(st, "tied", False):
                        self.grads_ready(st)
        return float(self._last_losses().sum() / m)

    def evaluate(self, batches: list[dict]) -> list[float]:
        """The loss of each micro-batch in ``batches`` (the same list on every pipeline rank),
        on every pipeline rank, by the forward-only schedule (:func:`~.schedule.forward_only`)
        without an autograd graph: no gradient is touched. The caller puts the stages in eval
        mode; the losses are those the last stage returns, unscaled."""
        m = self._count(batches, "evaluate")
        with torch.no_grad():
            self._execute(lower(self._checked(forward_only(self.p, m, self.v)), self.rank), batches, 1.0,
                          forward_only=True)
        return self._last_losses().tolist()

    @staticmethod
    def _count(batches: list[dict], what: str) -> int:
        if len(batches) < 1:
            raise ValueError(f"PipelineExecutor.{what}: batches is empty: need at least one micro-batch")
        return len(batches)

    def _checked(self, sched: Schedule) -> Schedule:
        if self.check:
            timeline(sched)  # validates; raises ScheduleDeadlock
        return sched

    def _execute(self, actions: list[Action], batches: list[dict], loss_scale: float, forward_only: bool) -> None:
        """Interpret one lowered schedule over ``batches``; the last stage's losses are left in
        ``self._losses`` (micro-batch → detached loss) and the run's figures in :attr:`stats`."""
        m = len(batches)
        self._batches, self._m, self._loss_scale, self._forward_only = batches, m, loss_scale, forward_only
        self._inputs: dict[tuple[int, int], torch.Tensor] = {}
        self._outputs: dict[tuple[int, int], torch.Tensor] = {}
        self._grads: dict[tuple[int, int], torch.Tensor] = {}
        self._recvs: dict[Action, PendingTransfer] = {}
        self._sends: list[PendingTransfer] = []
        self._losses: dict[int, torch.Tensor] = {}
        self.profile = []
        peak = 0
        busy = recv_wait = 0.0
        bytes0 = self.comm.bytes_sent
        self._released = 0
        self._backwards_left = {sid: m for sid in self.stage_ids}
        t_start = time.perf_counter()
        for idx, a in enumerate(actions):
            if a.kind.is_compute:
                self._prefetch(actions, idx)
                t0 = time.perf_counter()
                (self._forward if a.kind is K.FORWARD else self._backward)(a)
                t1 = time.perf_counter()
                busy += t1 - t0
                self.profile.append((a, t0, t1))
                peak = max(peak, len(self._outputs))
            elif a.kind in (K.RECV_ACT, K.RECV_GRAD):
                t0 = time.perf_counter()
                self._receive(a)
                recv_wait += time.perf_counter() - t0
            else:
                self._send(a)
            self._reap_sends()
        for s in self._sends:
            s.wait()
        self._sends = []
        if self._outputs or self._inputs or self._grads or self._recvs:
            raise RuntimeError("PipelineExecutor: the schedule left work behind: "
                               f"outputs {sorted(self._outputs)}, inputs {sorted(self._inputs)}")
        self.stats = dict(max_in_flight=peak, wall_s=time.perf_counter() - t_start, busy_s=busy,
                          recv_wait_s=recv_wait, bytes_sent=self.comm.bytes_sent - bytes0,
                          released_bytes=self._released)
        self._batches = None

    # ------------------------------------------------------------------ actions

    def _reap_sends(self) -> None:
        """Wait on (instantly) and drop the sends that have completed, releasing their buffers."""
        pending = []
        for s in self._sends:
            if s.is_completed():
                s.wait()
            else:
                pending.append(s)
        self._sends = pending

    def _shape(self, mb: int) -> tuple[int, ...]:
        s = self.activation_shape
        return tuple(s(self._batches[mb]) if callable(s) else s)

    def _transfer(self, a: Action) -> tuple[int, int, str]:
        """(peer pipeline rank, tag, description) of a communication action."""
        i, s = a.microbatch, a.chunk
        if a.kind in (K.RECV_ACT, K.SEND_GRAD):  # across the boundary below stage s
            boundary, peer = s - 1, stage_rank(s - 1, self.p)
        else:  # SEND_ACT, RECV_GRAD: across the boundary above stage s
            boundary, peer = s, stage_rank(s + 1, self.p)
        grad = a.kind in (K.SEND_GRAD, K.RECV_GRAD)
        what = f"{'gradient' if grad else 'activation'} of micro-batch {i} between stages {boundary} and {boundary + 1}"
        return peer, transfer_tag(i, boundary, grad, self.num_stages), what

    def _scattered(self, shape: tuple[int, ...], peer: int) -> bool:
        """Whether this transfer goes as 1/t pieces (to another rank, and divisible by t)."""
        return self.scatter_gather and peer != self.rank and math.prod(shape) % self.tp == 0

    def _post_recv(self, a: Action) -> None:
        if a not in self._recvs:
            peer, tag, what = self._transfer(a)
            shape = self._shape(a.microbatch)
            if self._scattered(shape, peer):  # this tp rank's 1/t; the rest comes by all-gather
                shape = (math.prod(shape) // self.tp,)
            self._recvs[a] = self.comm.irecv(shape, self.dtype, self.device, peer, tag, what)

    def _gathered(self, piece: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole tensor from every tp rank's piece (all-gather over the stage's tp ranks)."""
        full = torch.empty(piece.numel() * self.tp, dtype=piece.dtype, device=piece.device)
        dist.all_gather(list(full.chunk(self.tp)), piece, group=self.topology.group("tp"))
        return full.view(shape)

    def _prefetch(self, actions: list[Action], idx: int) -> None:
        """Post the next receive after this compute action, so it lands during the compute.
        (Local same-rank receives only read their mailbox when waited on.)"""
        for b in actions[idx + 1:]:
            if b.kind in (K.RECV_ACT, K.RECV_GRAD):
                self._post_recv(b)
                return

    def _receive(self, a: Action) -> None:
        self._post_recv(a)
        t = self._recvs.pop(a).wait()
        shape = self._shape(a.microbatch)
        if self._scattered(shape, self._transfer(a)[0]):
            t = self._gathered(t, shape)
        key = (a.microbatch, a.chunk)
        if a.kind is K.RECV_ACT:
            self._inputs[key] = t if self._forward_only else t.detach().requires_grad_(True)
        else:
            self._grads[key] = t

    def _send(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        peer, tag, what = self._transfer(a)
        if a.kind is K.SEND_ACT and self._forward_only:  # (no backward to keep it for)
            self._sends.append(self.comm.isend(self._piece(self._outputs.pop(key), peer), peer, tag, what))
        elif a.kind is K.SEND_ACT:
            out = self._outputs[key]
            self._sends.append(self.comm.isend(self._piece(out, peer), peer, tag, what))
            self._released += release_output(out)  # the send holds the buffer until it completes
        else:
            x = self._inputs.pop(key)
            g = x.grad if x.grad is not None else torch.zeros_like(x)
            self._sends.append(self.comm.isend(self._piece(g, peer), peer, tag, what))

    def _piece(self, t: torch.Tensor, peer: int) -> torch.Tensor:
        """What this rank sends of t: its 1/t piece (a view: the send keeps t's storage) when
        scattered, else t."""
        if not self._scattered(tuple(t.shape), peer):
            return t
        return t.detach().reshape(-1).chunk(self.tp)[self.topology.coord("tp")]

    def _forward(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        x = self._inputs.get(key) if a.chunk > 0 else None
        out = self.module_of[a.chunk](x, self._batches[a.microbatch])
        if self._forward_only:
            self._inputs.pop(key, None)
        if a.chunk == self.num_stages - 1:
            self._losses[a.microbatch] = out.detach()
            if self._forward_only:
                return
            out = out.float() / self._m
            if self._loss_scale != 1.0:
                out = out * self._loss_scale
        self._outputs[key] = out

    def _backward(self, a: Action) -> None:
        key = (a.microbatch, a.chunk)
        out = self._outputs.pop(key)
        if a.chunk == self.num_stages - 1:
            torch.autograd.backward(out)
        else:
            backward_from(out, self._grads.pop(key))
        if a.chunk == 0:
            self._inputs.pop(key, None)
        self._backwards_left[a.chunk] -= 1
        if self._backwards_left[a.chunk] == 0 and self.grads_ready is not None:
            stage = self.module_of[a.chunk]
            if not (self.tied and getattr(stage, "tied", False)):
                self.grads_ready(stage)

    def _last_losses(self) -> torch.Tensor:
        """Each micro-batch's loss (float64, in micro-batch order) on every pipeline rank: the
        last stage's, broadcast from its rank."""
        holder = stage_rank(self.num_stages - 1, self.p)
        if self._losses:
            loss = torch.stack([self._losses[i].double().reshape(()) for i in range(self._m)])
        else:
            loss = torch.zeros(self._m, dtype=torch.float64)
        if self.p > 1:
            loss = loss.to(self.device)
            dist.broadcast(loss, src=self.comm.ranks[holder], group=self.comm.group)
        return loss.cpu()
