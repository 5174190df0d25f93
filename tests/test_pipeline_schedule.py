"""Pipeline schedules as data: timelines, bubbles and activation memory (Megatron PTD-P §2)."""
from __future__ import annotations

import pytest

from tiertrain.pipeline.schedule import (Action, ActionKind, Schedule, ScheduleDeadlock, bubble_fraction,
                                         gpipe, ideal_bubble, interleaved_one_f_one_b, local_chunk, lower,
                                         max_in_flight, one_f_one_b, render, stage_rank, timeline, validate)

P, M = 4, 8
SCHEDULES = {
    "gpipe": lambda: gpipe(P, M),
    "1f1b": lambda: one_f_one_b(P, M),
    "interleaved": lambda: interleaved_one_f_one_b(P, M, 2),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
@pytest.mark.parametrize("t_b", [1, 2, 3])
def test_timeline_bubble_matches_the_paper(name, t_b):
    sched = SCHEDULES[name]()
    tl = timeline(sched, t_forward=1, t_backward=t_b)
    text = render(tl)
    print("\n" + text)
    ideal = ideal_bubble(P, M, sched.v)  # (p-1)/m, or (p-1)/(m·v) interleaved
    assert ideal == pytest.approx((P - 1) / (M * sched.v))
    for r in range(P):
        # every rank computes m·v·(t_f+t_b) slots and idles exactly (p-1)·(t_f+t_b)/v
        assert tl.busy(r) == M * sched.v * (1 + t_b)
        assert bubble_fraction(tl, r) == pytest.approx(ideal)
    assert bubble_fraction(tl) == pytest.approx(ideal)
    # the rendering is the timeline: one row per rank, one cell per slot, idle cells counted
    rows = text.splitlines()[1:]
    assert len(rows) == P
    for r, row in enumerate(rows):
        cells = row.split("|")[1].split()
        assert len(cells) == tl.makespan
        assert cells.count(".") == tl.idle(r)
        assert sum(c.startswith("B") for c in cells) == M * sched.v * t_b


def test_rendered_1f1b_first_row():
    tl = timeline(one_f_one_b(P, M))
    rows = render(tl).splitlines()
    assert rows[1].split("|")[1].split()[:12] == ["F0", "F1", "F2", "F3"] + ["."] * 6 + ["B0", "B0"]
    assert rows[4].split("|")[1].split()[:6] == [".", ".", ".", "F0", "B0", "B0"]  # last rank: 1F1B at once


def test_interleaved_render_names_chunks():
    text = render(timeline(interleaved_one_f_one_b(P, M, 2)))
    assert "F0a" in text and "F0b" in text and "B7a" in text


def test_activation_memory_1f1b_at_most_p_gpipe_m():
    g, o = gpipe(P, M), one_f_one_b(P, M)
    assert [max_in_flight(g, r) for r in range(P)] == [M] * P
    assert [max_in_flight(o, r) for r in range(P)] == [P - r for r in range(P)]
    assert all(max_in_flight(o, r) <= P for r in range(P))
    # fewer micro-batches than stages: 1F1B holds at most m
    assert max(max_in_flight(one_f_one_b(P, 2), r) for r in range(P)) == 2
    # interleaved holds more (micro-batch, chunk) pairs, each 1/v of the rank's layers
    il = interleaved_one_f_one_b(P, M, 2)
    assert [max_in_flight(il, r) for r in range(P)] == [(P - r - 1) * 2 + P + 1 for r in range(P)]


@pytest.mark.parametrize("make", [lambda: gpipe(P, M), lambda: gpipe(2, 4, 3), lambda: one_f_one_b(P, M),
                                  lambda: one_f_one_b(3, 2), lambda: interleaved_one_f_one_b(P, M, 2),
                                  lambda: interleaved_one_f_one_b(2, 4, 3), lambda: interleaved_one_f_one_b(1, 3, 2)])
def test_every_microbatch_and_chunk_runs_forward_and_backward_once(make):
    sched = make()
    validate(sched)
    S = sched.p * sched.v
    seen = [(a.kind, a.microbatch, a.chunk) for acts in sched.ranks for a in acts]
    assert sorted(seen, key=str) == sorted(
        [(k, i, s) for k in (ActionKind.FORWARD, ActionKind.BACKWARD) for i in range(sched.m) for s in range(S)],
        key=str)
    assert len(set(seen)) == len(seen)
    for r, acts in enumerate(sched.ranks):
        assert all(stage_rank(a.chunk, sched.p) == r for a in acts)
    timeline(sched)  # and it runs to completion


def test_interleaved_chunk_to_layer_mapping():
    # p=2, v=2, 8 layers in 4 stages of 2: device 1 (rank 0) holds stages 0 and 2 = layers 1,2,5,6
    p, v, layers = 2, 2, 8
    per = layers // (p * v)
    held = {r: [] for r in range(p)}
    for s in range(p * v):
        held[stage_rank(s, p)] += [s * per + k + 1 for k in range(per)]
    assert held == {0: [1, 2, 5, 6], 1: [3, 4, 7, 8]}
    assert [local_chunk(s, p) for s in range(4)] == [0, 0, 1, 1]
    # the paper's figure: p=4, v=2, 16 layers
    assert [s * 2 + k + 1 for s in range(8) if stage_rank(s, 4) == 0 for k in range(2)] == [1, 2, 9, 10]
    sched = interleaved_one_f_one_b(p, 4, v)
    assert {a.chunk for a in sched.ranks[0]} == {0, 2} and {a.chunk for a in sched.ranks[1]} == {1, 3}


def test_lowered_communication():
    acts = lower(one_f_one_b(2, 2), 0)
    kinds = [(a.kind.name, a.microbatch) for a in acts]
    assert kinds == [("FORWARD", 0), ("SEND_ACT", 0), ("FORWARD", 1), ("SEND_ACT", 1),
                     ("RECV_GRAD", 0), ("BACKWARD", 0), ("RECV_GRAD", 1), ("BACKWARD", 1)]
    last = [(a.kind.name, a.microbatch) for a in lower(one_f_one_b(2, 2), 1)]
    assert last[:4] == [("RECV_ACT", 0), ("FORWARD", 0), ("BACKWARD", 0), ("SEND_GRAD", 0)]


def test_invalid_arguments_are_named():
    with pytest.raises(ValueError, match=r"m=6 is invalid: .*multiple of the pipeline size p=4"):
        interleaved_one_f_one_b(4, 6, 2)
    with pytest.raises(ValueError, match=r"p=0 is invalid"):
        gpipe(0, 4)
    with pytest.raises(ValueError, match=r"m=-1 is invalid"):
        one_f_one_b(2, -1)
    with pytest.raises(ValueError, match=r"v=2 is invalid: plain 1F1B"):
        one_f_one_b(2, 4, 2)
    with pytest.raises(ValueError, match=r"v=0 is invalid"):
        interleaved_one_f_one_b(2, 4, 0)
    with pytest.raises(ValueError, match=r"t_backward=0 is invalid"):
        timeline(gpipe(2, 2), t_backward=0)


def test_broken_schedules_are_rejected():
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    missing = Schedule("x", 2, 1, 1, ((Action(F, 0, 0), Action(B, 0, 0)), (Action(F, 0, 1),)))
    with pytest.raises(ValueError, match="never runs"):
        validate(missing)
    wrong_rank = Schedule("x", 2, 1, 1, ((Action(F, 0, 1),), ()))
    with pytest.raises(ValueError, match="lives on rank 1"):
        validate(wrong_rank)
    # rank 0 waits for micro-batch 0's gradient before sending micro-batch 1's activation,
    # while rank 1 runs micro-batch 1 first: a cycle
    deadlock = Schedule("cycle", 2, 2, 1, (
        (Action(F, 0, 0), Action(B, 0, 0), Action(F, 1, 0), Action(B, 1, 0)),
        (Action(F, 1, 1), Action(B, 1, 1), Action(F, 0, 1), Action(B, 0, 1)),
    ))
    with pytest.raises(ScheduleDeadlock, match=r"rank 0 at B0.*rank 1 at F1"):
        timeline(deadlock)
