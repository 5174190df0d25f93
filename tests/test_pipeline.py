"""Pipeline execution on gloo: loss and every gradient equal the single-process GPT.

Each distributed test launches once and runs several schedules in it (launches dominate the
time). The reference is the same GPT, fed the same micro-batches with each loss scaled by
1/m (gradient accumulation), in one process; bounds come from its float64 run (the oracle of
tests/reference.py).
"""
from __future__ import annotations

import pytest
import torch

from tiertrain import Topology
from tiertrain.config import ParallelConfig
from tiertrain.models.gpt import GPT, GPTConfig
from tiertrain.pipeline import (Action, ActionKind, P2PTimeout, PipelineExecutor, Schedule, backward_from,
                                gpipe, interleaved_one_f_one_b, max_in_flight, one_f_one_b, pipeline_grad_norm,
                                release_output, split_gpt, stage_boundaries, stages_for_rank)
from tiertrain.testing import RankFailure, run_distributed
from reference import Oracle, global_batches

CFG = dict(vocab_size=256, seq_len=16, n_layers=4, hidden=32, n_heads=4, bias=False)
MICRO = 2
STEPS = 3
LR = 1e-2


def make_model(tie: bool) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(**CFG, tie_embeddings=tie))


def micro_batches(m: int, step: int, replica: int = 0) -> list[dict]:
    batch = global_batches(1, MICRO * m, seed=10 + step + 100 * replica)[0]
    return [{k: t[i * MICRO:(i + 1) * MICRO] for k, t in batch.items()} for i in range(m)]


def reference(tie: bool, m: int, replica: int = 0, dtype=torch.float32):
    """Losses per step, gradients and gradient norm of step 0, and final parameters of the
    single-process run (one thread, like each rank, so the kernels reduce in the same order)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference(tie, m, replica, dtype)
    finally:
        torch.set_num_threads(threads)


def oracles(tie: bool, m: int, replica: int = 0) -> tuple[Oracle, Oracle]:
    """The reference in fp32 and float64: (losses and final parameters; the step-0 gradient
    norm, as the one scalar, and step-0 gradients)."""
    l32, g32, n32, p32 = reference(tie, m, replica)
    l64, g64, n64, p64 = reference(tie, m, replica, torch.float64)
    return Oracle(l32, p32, l64, p64), Oracle([n32], g32, [n64], g64)


def _reference(tie: bool, m: int, replica: int, dtype):
    model = make_model(tie).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, grads0, norm0 = [], None, None
    for step in range(STEPS):
        total = 0.0
        for mb in micro_batches(m, step, replica):
            loss = model(mb["input_ids"], mb["labels"])
            (loss / m).backward()
            total += loss.item() / m
        losses.append(total)
        if grads0 is None:
            grads0 = {n: p.grad.clone() for n, p in model.named_parameters()}
            norm0 = float(torch.stack([g.double().pow(2).sum() for g in grads0.values()]).sum().sqrt())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return losses, grads0, norm0, {n: p.detach().clone() for n, p in model.named_parameters()}


SCHEDULE_FNS = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_one_f_one_b}


def _pipeline_worker(rank, world, cases, pp):
    """For each (schedule name, v, tie, m): STEPS AdamW steps on a dp × pp grid (each dp
    replica its own data); returns this rank's (dp, pp) coordinates and results."""
    topo = Topology.build(ParallelConfig(pp=pp))
    p, r, replica = topo.size("pp"), topo.coord("pp"), topo.coord("dp")
    out = []
    for name, v, tie, m in cases:
        stages = stages_for_rank(split_gpt(make_model(tie), p * v), p, r)
        ready = []  # (stage index, its gradients when grads_ready fired)
        ex = PipelineExecutor(stages, topo, SCHEDULE_FNS[name], activation_shape=(MICRO, CFG["seq_len"],
                              CFG["hidden"]), timeout=30,
                              grads_ready=lambda st: ready.append(
                                  (st.index, {n: q.grad.clone() for n, q in st.named_parameters()})))
        opts = [torch.optim.AdamW(st.parameters(), lr=LR) for st in stages]
        losses, grads0, stats = [], None, None
        for step in range(STEPS):
            losses.append(ex.run(micro_batches(m, step, replica)))
            if grads0 is None:
                grads0 = {n: q.grad.clone() for st in stages for n, q in st.named_parameters()}
                stats = dict(ex.stats, expected_in_flight=max_in_flight(ex.schedule_for(m), r),
                             norm=pipeline_grad_norm(stages, topo),
                             ready_order=[i for i, _ in ready],
                             ready_final=all(torch.equal(g[n], grads0[n]) for _, g in ready for n in g))
            for o in opts:
                o.step()
                o.zero_grad(set_to_none=True)
        params = {n: q.detach().clone() for st in stages for n, q in st.named_parameters()}
        out.append((losses, grads0, params, stats))
    return (replica, r), out


def check_against_reference(results, cases):
    replicas = sorted({coords[0] for coords, _ in results})
    for replica in replicas:
        mine = [out for (dp, _), out in sorted(results) if dp == replica]
        for c, (name, v, tie, m) in enumerate(cases):
            trajectory, step0 = oracles(tie, m, replica)
            ref_grads, ref_params = step0.params32, trajectory.params32
            what = f"{name} v={v} tie={tie} m={m} replica {replica}"
            per_rank = [res[c] for res in mine]
            for losses, *_ in per_rank:  # every pipeline rank returns the same mean loss
                assert losses == per_rank[-1][0]
                trajectory.check(losses, None, f"{what} losses")
            copies = [{}, {}]  # a tied weight has two: the first stage's and the last stage's
            for _, g, prm, stats in per_rank:
                assert stats["max_in_flight"] == stats["expected_in_flight"], (name, stats)
                step0.check([stats["norm"]], None, f"{what} gradient norm")
                assert len(stats["ready_order"]) == v and stats["ready_final"], (name, stats)
                for n in g:
                    key = "embed.weight" if (tie and n == "head.weight") else n
                    copy = copies[1] if key in copies[0] else copies[0]
                    copy[key] = (g[n], prm[n])
            assert set(copies[0]) == set(ref_grads), (name, sorted(set(copies[0]) ^ set(ref_grads)))
            for copy in filter(None, copies):
                step0.check(None, {n: g for n, (g, _) in copy.items()}, f"{what} step-0 gradients")
                trajectory.check(None, {n: p for n, (_, p) in copy.items()}, f"{what} parameters")
                for n, (g, p) in copy.items():
                    # untied, the pipeline *is* gradient accumulation: same kernels, same order
                    assert tie or torch.equal(g, ref_grads[n]), (name, n)
                    assert tie or torch.equal(p, ref_params[n]), (name, n)
            for n, (_, p) in copies[1].items():  # the tied copies stay identical
                assert torch.equal(p, copies[0][n][1]), n


PP2_CASES = [("gpipe", 1, False, 4), ("1f1b", 1, True, 4), ("interleaved", 2, True, 4),
             ("interleaved", 2, False, 6)]


@pytest.mark.timeout(80)
def test_pp2_gpipe_1f1b_interleaved_match_single_process():
    results = run_distributed(_pipeline_worker, 2, PP2_CASES, 2, timeout=70)
    check_against_reference(results, PP2_CASES)


PP4_CASES = [("1f1b", 1, False, 6), ("1f1b", 1, True, 3)]


@pytest.mark.timeout(80)
def test_pp4_1f1b_matches_single_process():
    results = run_distributed(_pipeline_worker, 4, PP4_CASES, 4, timeout=70)
    check_against_reference(results, PP4_CASES)


DPxPP_CASES = [("1f1b", 1, True, 4), ("interleaved", 2, False, 4)]


@pytest.mark.timeout(80)
def test_two_pipelines_side_by_side_in_a_dp2_pp2_grid():
    """Ranks 0,2 and 1,3 form two pipelines (tp fastest, then dp, then pp); each replica
    gets its own data and must match its own reference: no transfer crosses pipelines."""
    results = run_distributed(_pipeline_worker, 4, DPxPP_CASES, 2, timeout=70)
    assert sorted(coords for coords, _ in results) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [coords for coords, _ in results] == [(0, 0), (1, 0), (0, 1), (1, 1)]
    check_against_reference(results, DPxPP_CASES)


def _deadlock_worker(rank, world):
    topo = Topology.build(ParallelConfig(pp=2))
    stages = stages_for_rank(split_gpt(make_model(False), 2), 2, rank)
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    cycle = Schedule("cycle", 2, 2, 1, (
        (Action(F, 0, 0), Action(B, 0, 0), Action(F, 1, 0), Action(B, 1, 0)),
        (Action(F, 1, 1), Action(B, 1, 1), Action(F, 0, 1), Action(B, 0, 1)),
    ))
    ex = PipelineExecutor(stages, topo, cycle, activation_shape=(MICRO, 16, 32), timeout=2, check=False)
    ex.run(micro_batches(2, 0))


@pytest.mark.timeout(40)
def test_deadlocked_schedule_fails_fast_with_a_timeout():
    with pytest.raises(RankFailure) as info:
        run_distributed(_deadlock_worker, 2, timeout=30)
    assert info.value.exc_type == P2PTimeout.__name__, str(info.value)
    assert "did not complete within 2 s" in info.value.message


def test_deadlocked_schedule_is_refused_before_running():
    topo = Topology.build()
    stages = split_gpt(make_model(False), 2)
    F, B = ActionKind.FORWARD, ActionKind.BACKWARD
    # one rank, two chunks: backward of stage 0 before the forward of stage 1 it depends on
    bad = Schedule("bad", 1, 1, 2, ((Action(F, 0, 0), Action(B, 0, 0), Action(F, 0, 1), Action(B, 0, 1)),))
    ex = PipelineExecutor(stages, topo, bad, activation_shape=(MICRO, 16, 32))
    with pytest.raises(Exception, match="deadlocks"):
        ex.run(micro_batches(1, 0))


@pytest.mark.parametrize("fn,v", [(one_f_one_b, 1), (gpipe, 3), (interleaved_one_f_one_b, 2)])
def test_single_rank_with_chunks_matches_reference(fn, v):
    """p = 1 with v chunks: transfers go through the local mailbox."""
    m = 2
    trajectory, step0 = oracles(True, m)
    stages = split_gpt(make_model(True), v)
    ex = PipelineExecutor(stages, Topology.build(), fn, activation_shape=(MICRO, 16, 32))
    loss = ex.run(micro_batches(m, 0))
    trajectory.check([loss], None, f"{fn.__name__} v={v} first loss")
    for st in stages:
        step0.check(None, {n: q.grad for n, q in st.named_parameters()}, f"{fn.__name__} v={v} gradients",
                    key=lambda n: "embed.weight" if n == "head.weight" else n)
    step0.check([pipeline_grad_norm(stages, Topology.build())], None, f"{fn.__name__} v={v} gradient norm")
    if v > 1:
        assert ex.stats["released_bytes"] == m * (v - 1) * MICRO * 16 * 32 * 4


def test_released_output_still_backpropagates():
    w = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4)
    y = torch.tanh(x @ w) * 2
    assert release_output(y) == 3 * 4 * 4 and y.numel() == 1
    backward_from(y, torch.ones(3, 4))
    w2 = w.detach().clone().requires_grad_(True)
    (torch.tanh(x @ w2) * 2).backward(torch.ones(3, 4))
    assert torch.equal(w.grad, w2.grad)


def test_split_gpt_layout_and_balance():
    model = make_model(True)
    rng = torch.random.get_rng_state()
    stages = split_gpt(model, 4)
    assert torch.equal(rng, torch.random.get_rng_state()), "splitting draws no random numbers"
    assert [st.layers for st in stages] == [[0], [1], [2], [3]]
    assert stages[0].is_first and stages[-1].is_last and stages[-1].tied and not stages[1].tied
    names = set().union(*(dict(st.named_parameters()) for st in stages))
    assert names == set(dict(model.named_parameters())) | {"head.weight"}
    assert torch.equal(stages[-1].head.weight, model.embed.weight)
    assert stages[-1].head.weight is not model.embed.weight  # its own copy (Megatron)
    assert [len(x) for x in stage_boundaries(make_model(False), 3)] == [2, 1, 1]
    # params: a wide vocabulary makes the embedding and the head each worth several blocks
    big = GPT(GPTConfig(**{**CFG, "vocab_size": 2048, "n_layers": 6}, tie_embeddings=False))
    cuts = stage_boundaries(big, 4, balance="params")
    counts = [sum(q.numel() for q in st.parameters()) for st in split_gpt(big, 4, balance="params")]
    even = [sum(q.numel() for q in st.parameters()) for st in split_gpt(big, 4)]
    assert sorted(i for c in cuts for i in c) == list(range(6))
    assert max(counts) < max(even), (counts, even)
    assert cuts[0] == [] and cuts[-1] == []  # embedding alone, head alone
    with pytest.raises(ValueError, match=r"balance='bytes' is invalid"):
        split_gpt(model, 2, balance="bytes")
    with pytest.raises(ValueError, match=r"num_stages=5 is invalid .*n_layers=4"):
        split_gpt(model, 5)
    with pytest.raises(ValueError, match=r"do not divide over p=3"):
        stages_for_rank(stages, 3, 0)
