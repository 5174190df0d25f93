"""Pipeline schedules as data (Megatron-LM PTD-P §2).

A schedule is, for every pipeline rank, the ordered list of compute actions that rank
performs during one step ("pipeline flush"): ``Action(FORWARD, microbatch, chunk)`` and
``Action(BACKWARD, microbatch, chunk)``. Nothing here runs a model; the same data is
printed (:func:`render`), simulated (:func:`timeline`), checked by the tests, and executed
by :class:`tiertrain.pipeline.executor.PipelineExecutor`.

Stages and chunks
-----------------
The model is cut into ``S = p·v`` consecutive *stages* (Megatron's "model chunks"); an
action's ``chunk`` is the **global stage index** ``s`` in ``0 .. S-1``. Stage ``s`` lives on
pipeline rank ``s % p`` as that rank's local chunk ``s // p`` (:func:`stage_rank`,
:func:`local_chunk`), so rank ``r`` holds stages ``r, r+p, r+2p, …``. With ``L`` layers cut
evenly, stage ``s`` holds layers ``s·L/S + 1 … (s+1)·L/S`` (1-based). Examples:

* p=2, v=2, 8 layers (2 per stage): rank 0 (device 1) holds layers 1,2 and 5,6;
  rank 1 (device 2) holds 3,4 and 7,8.
* p=4, v=2, 16 layers (the paper's figure): device 1 holds 1,2,9,10; device 2 holds 3,4,11,12.

Communication is derived, not stored: the input activation of stage ``s > 0`` comes from
stage ``s-1`` and the gradient of its output from stage ``s+1``. :func:`lower` inserts the
``RECV_ACT``/``SEND_ACT``/``RECV_GRAD``/``SEND_GRAD`` actions around each compute action;
that lowered list is what the executor interprets.

Bubble
------
As in the paper, the bubble fraction is idle time over ideal compute time,
``(makespan - busy) / busy`` on a rank, with all stages taking the same time. For GPipe and
1F1B it is ``(p-1)·(t_f+t_b) / (m·(t_f+t_b)) = (p-1)/m`` whatever the ratio ``t_b/t_f``;
interleaving divides it by ``v``. :func:`timeline` simulates this with unit time slots.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..errors import TiertrainError

__all__ = [
    "ActionKind", "Action", "Schedule", "ScheduleDeadlock", "Slot", "Timeline",
    "gpipe", "one_f_one_b", "interleaved_one_f_one_b", "forward_only", "lower", "stage_rank", "local_chunk",
    "timeline", "bubble_fraction", "ideal_bubble", "render", "max_in_flight", "validate",
]


class ActionKind(enum.Enum):
    FORWARD = "F"
    BACKWARD = "B"
    SEND_ACT = "send_act"
    RECV_ACT = "recv_act"
    SEND_GRAD = "send_grad"
    RECV_GRAD = "recv_grad"

    @property
    def is_compute(self) -> bool:
        return self in (ActionKind.FORWARD, ActionKind.BACKWARD)


F = ActionKind.FORWARD
B = ActionKind.BACKWARD


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule. ``chunk`` is the global stage index (see module doc).

    For the communication kinds: ``RECV_ACT``/``SEND_GRAD`` concern the *input* of stage
    ``chunk`` (from/to stage ``chunk-1``), ``SEND_ACT``/``RECV_GRAD`` its *output*
    (to/from stage ``chunk+1``)."""

    kind: ActionKind
    microbatch: int
    chunk: int

    def __str__(self) -> str:
        return f"{self.kind.value}{self.microbatch}" + (f"@{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Schedule:
    """Per-rank ordered compute actions for ``p`` ranks, ``m`` micro-batches, ``v`` chunks per rank."""

    name: str
    p: int
    m: int
    v: int
    ranks: tuple[tuple[Action, ...], ...]
    with_backward: bool = True
    """False for an evaluation schedule (:func:`forward_only`): forwards only, no gradients."""

    @property
    def num_stages(self) -> int:
        return self.p * self.v

    def __getitem__(self, rank: int) -> tuple[Action, ...]:
        return self.ranks[rank]


class ScheduleDeadlock(TiertrainError, RuntimeError):
    """A schedule whose in-order execution can never finish (simulated, before running it)."""


def stage_rank(stage: int, p: int) -> int:
    """Pipeline rank that holds global stage ``stage`` (Megatron interleaving: ``stage % p``)."""
    return stage % p


def local_chunk(stage: int, p: int) -> int:
    """Index of global stage ``stage`` among its rank's chunks (``stage // p``)."""
    return stage // p


# --------------------------------------------------------------------------- argument checks


def _positive_int(name: str, value, func: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{func}: {name}={value!r} is invalid: must be a positive int")
    return value


# --------------------------------------------------------------------------- schedules


def gpipe(p: int, m: int, v: int = 1) -> Schedule:
    """GPipe (Huang et al.): every rank runs all forwards, then all backwards.

    Holds the activations of all ``m`` micro-batches at once. With ``v > 1`` chunks per
    rank the forwards go chunk by chunk (all micro-batches of local chunk 0, then chunk 1, …)
    and the backwards in the reverse chunk order."""
    _positive_int("p", p, "gpipe")
    _positive_int("m", m, "gpipe")
    _positive_int("v", v, "gpipe")
    ranks = []
    for r in range(p):
        fwd = [Action(F, i, c * p + r) for c in range(v) for i in range(m)]
        bwd = [Action(B, i, c * p + r) for c in reversed(range(v)) for i in range(m)]
        ranks.append(tuple(fwd + bwd))
    return Schedule("gpipe", p, m, v, tuple(ranks))


def one_f_one_b(p: int, m: int, v: int = 1) -> Schedule:
    """1F1B with a flush (PipeDream-Flush, Megatron's default non-interleaved schedule).

    Rank ``r`` runs ``min(p-r-1, m)`` warm-up forwards, then alternates one forward and one
    backward, then drains the remaining backwards, so at most ``p - r`` micro-batches have
    activations held at once (``p`` on rank 0). ``v`` must be 1 (it is accepted so that every
    schedule function has the signature ``(p, m, v)``)."""
    _positive_int("p", p, "one_f_one_b")
    _positive_int("m", m, "one_f_one_b")
    _positive_int("v", v, "one_f_one_b")
    if v != 1:
        raise ValueError(f"one_f_one_b: v={v} is invalid: plain 1F1B runs one chunk per rank "
                         f"(v=1); use interleaved_one_f_one_b for v > 1")
    ranks = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action(F, i, r) for i in range(warmup)]
        for k in range(m - warmup):
            acts += [Action(F, warmup + k, r), Action(B, k, r)]
        acts += [Action(B, k, r) for k in range(m - warmup, m)]
        ranks.append(tuple(acts))
    return Schedule("1f1b", p, m, 1, tuple(ranks))


def interleaved_one_f_one_b(p: int, m: int, v: int) -> Schedule:
    """Interleaved 1F1B (Megatron PTD-P §2.2): ``v`` model chunks per rank, bubble ``(p-1)/(m·v)``.

    Follows Megatron-LM's ``forward_backward_pipelining_with_interleaving``: the k-th forward
    of a rank works on local chunk ``(k mod p·v) // p`` and micro-batch
    ``(k // (p·v))·p + k mod p`` (groups of ``p`` micro-batches go through chunk 0, then
    chunk 1, …); backwards visit the chunks in reverse. Rank ``r`` starts with
    ``(p-r-1)·2 + (v-1)·p`` warm-up forwards (capped at ``m·v``), then alternates, then
    drains. Requires ``m`` to be a multiple of ``p``. ``v = 1`` gives :func:`one_f_one_b`."""
    _positive_int("p", p, "interleaved_one_f_one_b")
    _positive_int("m", m, "interleaved_one_f_one_b")
    _positive_int("v", v, "interleaved_one_f_one_b")
    if v == 1:
        return one_f_one_b(p, m)
    if m % p:
        raise ValueError(f"interleaved_one_f_one_b: m={m} is invalid: the number of micro-batches "
                         f"must be a multiple of the pipeline size p={p}")
    total = m * v
    group = p * v

    def fwd(k: int, r: int) -> Action:
        c = (k % group) // p
        return Action(F, (k // group) * p + k % p, c * p + r)

    def bwd(k: int, r: int) -> Action:
        c = v - 1 - (k % group) // p
        return Action(B, (k // group) * p + k % p, c * p + r)

    ranks = []
    for r in range(p):
        warmup = min((p - r - 1) * 2 + (v - 1) * p, total)
        acts = [fwd(k, r) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [fwd(warmup + k, r), bwd(k, r)]
        acts += [bwd(k, r) for k in range(total - warmup, total)]
        ranks.append(tuple(acts))
    return Schedule(f"interleaved_1f1b(v={v})", p, m, v, tuple(ranks))


def forward_only(p: int, m: int, v: int = 1) -> Schedule:
    """Evaluation (Megatron's ``forward_only`` pass, DeepSpeed's ``eval_batch``): every rank
    runs the forwards of its chunks, chunk by chunk and micro-batch after micro-batch within a
    chunk, as GPipe's forward half. Nothing waits for a backward, so a rank holds no
    activations beyond the sends in flight; with ``m ≥ p`` the bubble is interleaved 1F1B's,
    ``(p-1)/(m·v)`` (:func:`timeline`)."""
    _positive_int("p", p, "forward_only")
    _positive_int("m", m, "forward_only")
    _positive_int("v", v, "forward_only")
    ranks = tuple(tuple(Action(F, i, c * p + r) for c in range(v) for i in range(m)) for r in range(p))
    return Schedule("forward_only", p, m, v, ranks, with_backward=False)


# --------------------------------------------------------------------------- checks and lowering


def validate(schedule: Schedule) -> Schedule:
    """Check that every (micro-batch, stage) runs forward and backward exactly once (forward
    only, in a schedule without backward), on the rank that holds the stage, forward before
    backward; raise ValueError otherwise."""
    p, m, S = schedule.p, schedule.m, schedule.num_stages
    if len(schedule.ranks) != p:
        raise ValueError(f"schedule {schedule.name!r} has {len(schedule.ranks)} rank lists for p={p}")
    seen: dict[tuple, int] = {}
    for r, acts in enumerate(schedule.ranks):
        for a in acts:
            if not a.kind.is_compute:
                raise ValueError(f"schedule {schedule.name!r}: rank {r} lists {a}: only compute "
                                 f"actions belong in a schedule (communication is derived)")
            if not (0 <= a.microbatch < m and 0 <= a.chunk < S):
                raise ValueError(f"schedule {schedule.name!r}: rank {r} lists {a} outside m={m}, stages={S}")
            if a.kind is B and not schedule.with_backward:
                raise ValueError(f"schedule {schedule.name!r}: rank {r} lists {a} in a forward-only schedule")
            if stage_rank(a.chunk, p) != r:
                raise ValueError(f"schedule {schedule.name!r}: rank {r} lists {a} but stage "
                                 f"{a.chunk} lives on rank {stage_rank(a.chunk, p)}")
            key = (a.kind, a.microbatch, a.chunk)
            if key in seen:
                raise ValueError(f"schedule {schedule.name!r}: rank {r} runs {a} twice")
            if a.kind is B and (F, a.microbatch, a.chunk) not in seen:
                raise ValueError(f"schedule {schedule.name!r}: rank {r} runs {a} before its forward")
            seen[key] = r
    kinds = (F, B) if schedule.with_backward else (F,)
    missing = [(k.value, i, s) for k in kinds for i in range(m) for s in range(S) if (k, i, s) not in seen]
    if missing:
        raise ValueError(f"schedule {schedule.name!r} never runs {missing[:4]}"
                         + (f" and {len(missing) - 4} more" if len(missing) > 4 else ""))
    return schedule


def lower(schedule: Schedule, rank: int) -> list[Action]:
    """Rank ``rank``'s compute actions with the point-to-point actions they imply:
    ``RECV_ACT`` before a forward (unless first stage), ``SEND_ACT`` after it (unless last
    stage), ``RECV_GRAD`` before a backward (unless last stage), ``SEND_GRAD`` after it
    (unless first stage)."""
    last = schedule.num_stages - 1
    out: list[Action] = []
    for a in schedule.ranks[rank]:
        i, s = a.microbatch, a.chunk
        if a.kind is F:
            out += ([Action(ActionKind.RECV_ACT, i, s)] if s > 0 else []) + [a]
            out += [Action(ActionKind.SEND_ACT, i, s)] if s < last else []
        elif a.kind is B:
            out += ([Action(ActionKind.RECV_GRAD, i, s)] if s < last else []) + [a]
            out += [Action(ActionKind.SEND_GRAD, i, s)] if s > 0 else []
    return out


def max_in_flight(schedule: Schedule, rank: int) -> int:
    """Most (micro-batch, chunk) forwards on ``rank`` whose backward has not run yet, i.e. the
    most micro-batches whose activations the rank holds at once. With ``v > 1`` each pair holds
    one chunk's activations (1/v of the rank's layers)."""
    held = peak = 0
    for a in schedule.ranks[rank]:
        held += 1 if a.kind is F else -1
        peak = max(peak, held)
    return peak


# --------------------------------------------------------------------------- simulation


@dataclass(frozen=True)
class Slot:
    start: int
    end: int
    action: Action


@dataclass
class Timeline:
    """Simulated execution: per rank, its compute actions with start/end times (unit slots)."""

    schedule: Schedule
    t_forward: int
    t_backward: int
    slots: list[list[Slot]] = field(default_factory=list)

    @property
    def makespan(self) -> int:
        return max((s.end for rank in self.slots for s in rank), default=0)

    def busy(self, rank: int) -> int:
        return sum(s.end - s.start for s in self.slots[rank])

    def idle(self, rank: int) -> int:
        return self.makespan - self.busy(rank)

    def cells(self, rank: int) -> list[Action | None]:
        """One entry per time slot: the action occupying it, or None when idle."""
        row: list[Action | None] = [None] * self.makespan
        for s in self.slots[rank]:
            for t in range(s.start, s.end):
                row[t] = s.action
        return row


def timeline(schedule: Schedule, t_forward: int = 1, t_backward: int = 2) -> Timeline:
    """Simulate ``schedule``: each rank runs its actions in order, each as early as its
    dependencies allow (forward of stage s on micro-batch i after the forward of stage s-1;
    backward after the backward of stage s+1 and its own forward), communication free.
    Raises :class:`ScheduleDeadlock` when no rank can make progress."""
    _positive_int("t_forward", t_forward, "timeline")
    _positive_int("t_backward", t_backward, "timeline")
    validate(schedule)
    p, last = schedule.p, schedule.num_stages - 1
    done: dict[tuple, int] = {}
    free = [0] * p
    pos = [0] * p
    tl = Timeline(schedule, t_forward, t_backward, [[] for _ in range(p)])
    remaining = sum(len(a) for a in schedule.ranks)
    while remaining:
        progressed = False
        for r in range(p):
            while pos[r] < len(schedule.ranks[r]):
                a = schedule.ranks[r][pos[r]]
                i, s = a.microbatch, a.chunk
                if a.kind is F:
                    deps = [(F, i, s - 1)] if s > 0 else []
                else:
                    deps = [(F, i, s)] + ([(B, i, s + 1)] if s < last else [])
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                end = start + (t_forward if a.kind is F else t_backward)
                tl.slots[r].append(Slot(start, end, a))
                done[(a.kind, i, s)] = end
                free[r] = end
                pos[r] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = ", ".join(f"rank {r} at {schedule.ranks[r][pos[r]]}" for r in range(p)
                              if pos[r] < len(schedule.ranks[r]))
            raise ScheduleDeadlock(f"schedule {schedule.name!r} deadlocks: {stuck} wait on each other")
    return tl


def bubble_fraction(tl: Timeline, rank: int | None = None) -> float:
    """Idle time over busy (ideal compute) time: for ``rank``, or the mean over ranks."""
    ranks = range(tl.schedule.p) if rank is None else [rank]
    return sum(tl.idle(r) / tl.busy(r) for r in ranks) / len(ranks)


def ideal_bubble(p: int, m: int, v: int = 1) -> float:
    """The paper's bubble fraction ``(p-1)/(m·v)`` (``v=1`` for GPipe and 1F1B)."""
    return (p - 1) / (m * v)


def render(tl: Timeline) -> str:
    """ASCII timeline: one row per rank, one cell per time slot; ``F3``/``B3`` is the forward /
    backward of micro-batch 3 (a backward fills ``t_backward`` cells), ``.`` is idle. With
    ``v > 1`` a letter names the local chunk (``F3a`` chunk 0, ``F3b`` chunk 1, …)."""
    sched = tl.schedule

    def label(a: Action | None) -> str:
        if a is None:
            return "."
        suffix = chr(ord("a") + local_chunk(a.chunk, sched.p)) if sched.v > 1 else ""
        return f"{a.kind.value}{a.microbatch}{suffix}"

    rows = [[label(a) for a in tl.cells(r)] for r in range(sched.p)]
    width = max((len(c) for row in rows for c in row), default=1)
    head = (f"{sched.name}: p={sched.p} m={sched.m} v={sched.v} t_f={tl.t_forward} "
            f"t_b={tl.t_backward} makespan={tl.makespan} bubble={bubble_fraction(tl):.4f} "
            f"(ideal {ideal_bubble(sched.p, sched.m, sched.v):.4f})")
    lines = [head]
    for r, row in enumerate(rows):
        lines.append(f"rank {r} |" + " ".join(c.ljust(width) for c in row) + "|")
    return "\n".join(lines)
