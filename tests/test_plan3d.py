"""Specification of the 3D planner (tiertrain.estimate.layout3d, `tiertrain plan --layout 3d`).

The rules (Megatron PTD-P §3, as the module docstring states them):

1. t divides the ranks of a node G (tensor parallelism never crosses nodes);
2. t divides heads, hidden, vocab and the MLP width; p divides the layers; d divides B/b;
3. a layout fits when its per-rank peak ≤ device memory less 10 %;
4. candidates are ordered by p, then t (ascending); the first that fits is chosen, d = N/(t·p);
5. m = B/(d·b); interleaving (smallest v | nl/p with m % p = 0 bringing (p−1)/(m·v) ≤ 10 %)
   when (p−1)/m > 10 %; a layout whose bubble stays > 50 % is rejected;
6. activation recomputation (every block) only when nothing fits without it;
7. ZeRO stage 1 over d (stage 0 at d = 1), everything on the device;
8. when no 3D layout fits, the ZeRO-Infinity offload ladder at t = p = 1; else refused.

Memory in the engine's dtypes for bf16: 2 B params + 4 B fp32 grads + (4 B master + 8 B Adam)/d
per parameter of a rank, so 6 + 12/d bytes; one layer's activations (fused attention, no
dropout) s·b·h·(8 + 24/t) bytes; plus 1 GiB device overhead and 50 MiB of buckets. Each
expected answer below is derived by hand with these numbers (rounded); pure computation, no
processes.
"""
from __future__ import annotations

import json

import pytest

from tiertrain import cli
from tiertrain.config import load
from tiertrain.estimate import ModelDims
from tiertrain.estimate.cost3d import Policy3D, held_micro_batches, rank_memory
from tiertrain.estimate.layout3d import BUBBLE, DIVISIBILITY, DOES_NOT_FIT, TP_ACROSS_NODES, plan3d, render_plan3d
from tiertrain.estimate.formulas import activation_bytes_per_layer
from tiertrain.estimate.hardware import Hardware
from tiertrain.estimate.plan import PlanError
from tiertrain.pipeline.schedule import interleaved_one_f_one_b, max_in_flight, one_f_one_b
from tiertrain.train import TrainConfig

GiB = 2**30
NO_FALLBACK = Policy3D(offload_fallback=False)

# 7B-shaped (LLaMA-like, no biases): Ψ = 32·(12h² + 4h) + (V + s)·h + 2h = 6.58e9
LLAMA7B = ModelDims(n_layers=32, hidden=4096, n_heads=32, vocab=32000, seq_len=2048, bias=False)
# GPT-3 39B shape of the Megatron paper's Table 1: Ψ ≈ 12·48·8192² = 38.9e9
GPT39B = ModelDims(n_layers=48, hidden=8192, n_heads=64, vocab=32000, seq_len=2048, bias=False)
# 70B-shaped: Ψ ≈ 12·80·8192² = 64.7e9
GPT70B = ModelDims(n_layers=80, hidden=8192, n_heads=64, vocab=32000, seq_len=2048, bias=False)
# GPT-2 small: 12 × 768, 12 heads (Ψ = 124e6)
GPT125M = ModelDims(n_layers=12, hidden=768, n_heads=12, vocab=50304, seq_len=1024, bias=False)
# 8 × 2048, 16 heads: Ψ = 8·(12h² + 4h) + (V + s)·h + 2h = 472e6
GPT470M = ModelDims(n_layers=8, hidden=2048, n_heads=16, vocab=32000, seq_len=2048, bias=False)
# 1T-shaped (Megatron's largest): 128 × 25600
GPT1T = ModelDims(n_layers=128, hidden=25600, n_heads=160, vocab=51200, seq_len=2048, bias=False)


def machine(nodes: int, gpus: int = 8, gib: float = 80, host_gib: float = 1024) -> Hardware:
    return Hardware(ranks_per_node=gpus, nodes=nodes, host_memory=int(host_gib * GiB),
                    device_memory=int(gib * GiB))


def choice(p) -> tuple:
    c = p.chosen
    return c.t, c.p, c.d, c.m, c.v, c.stage, c.checkpoint_every


# --------------------------------------------------------------------------- the table

TABLE = [
    # (id, model, machine, global batch, micro-batch, expected (t, p, d, m, v, zero stage, checkpoint_every))
    # 7B on 2 × 8 × 80 GiB (budget 72 GiB): t=p=1, d=16: 6.58e9·(6 + 12/16) = 44.4e9 B = 41.4 GiB of
    # model states + 32·2048·4096·32 B = 8 GiB of activations + 0.4 GiB logits + 1.05 GiB ≈ 50.8 GiB ≤ 72:
    # pure data parallelism with ZeRO-1, m = 512/16 = 32, no pipeline, no bubble.
    ("7b-2x8x80", LLAMA7B, machine(2), 512, 1, (1, 1, 16, 32, 1, 1, 0)),
    # 7B on 2 × 8 × 40 GiB (budget 36 GiB): t=1 needs 50.8 GiB > 36; t=2, d=8: 3.29e9·(6 + 12/8)
    # = 24.7e9 B = 23 GiB + 32·sbh·(8 + 12) = 5 GiB + ≈1.3 GiB ≈ 29.3 GiB ≤ 36 → t=2, m = 512/8 = 64.
    ("7b-2x8x40", LLAMA7B, machine(2, gib=40), 512, 1, (2, 1, 8, 64, 1, 1, 0)),
    # 39B on 2 × 8 × 80 GiB: t=4, d=4: 9.7e9·(6 + 3) = 87e9 B > 72 GiB; t=8, d=2: 4.86e9·(6 + 6)
    # = 58e9 B = 54 GiB + 48·2048·8192·11 B = 8.3 GiB + ≈1.3 GiB ≈ 64 GiB ≤ 72 → tensor parallelism
    # fills the node (t=8) before any pipeline, although (t=4, p=2) would fit too (66.5 GiB).
    ("39b-2x8x80", GPT39B, machine(2), 512, 1, (8, 1, 2, 256, 1, 1, 0)),
    # 70B on 4 × 8 × 80 GiB: p=1 never fits (t=8, d=4: 8.1e9·(6 + 3) = 73e9 B = 68 GiB of states
    # alone); p=2, t=8, d=2: first stage 4.05e9·(6 + 6) = 48.6e9 B = 45 GiB + 1F1B holds p=2
    # micro-batches of 40 layers = 80 layers' activations, 80·16.8e6·11 B = 13.8 GiB, + 1 GiB
    # ≈ 60 GiB ≤ 72 → pipeline across nodes; m = 512/2 = 256, bubble 1/256 ≤ 10 %: v = 1.
    ("70b-4x8x80", GPT70B, machine(4), 512, 1, (8, 2, 2, 256, 1, 1, 0)),
    # The same with B = 16: (t=8, p=2, d=2) has m = 8, bubble (p−1)/m = 12.5 % > 10 %: interleave;
    # m % p = 0 and v=2 divides 40 layers per stage: (p−1)/(m·v) = 6.25 % ≤ 10 % → v = 2; the first
    # stage then holds 1 + (p−1)/(p·v) = 1.25× the layers' activations: 45 + 17.2 + 1 ≈ 64 GiB ≤ 72.
    ("70b-4x8x80-B16", GPT70B, machine(4), 16, 1, (8, 2, 2, 8, 2, 1, 0)),
    # GPT-2 small on 1 × 8: 124e6·(6 + 12/8) B < 1 GiB: pure data parallelism over the node.
    ("125m-1x8x80", GPT125M, machine(1), 256, 1, (1, 1, 8, 32, 1, 1, 0)),
    # 39B, micro-batch 2, on 2 × 8 × 64 GiB (budget 57.6 GiB): without recomputation (t=8, d=2)
    # needs 54 + 2·8.3 + 1.3 ≈ 72 GiB and (t=8, p=2, d=1) 40.5 + 2·8.3 + 1 ≈ 59 GiB: nothing fits.
    # With every block recomputed (t=8, d=2) still needs ≈ 60 GiB (the states alone are 54), while
    # (t=8, p=2, d=1) needs 40.5 GiB + 48 block inputs of 2·2048·2·8192 B (3 GiB) + ≈ 2 GiB ≈ 46 GiB.
    ("39b-2x8x64-mb2", GPT39B, machine(2, gib=64), 512, 2, (8, 2, 1, 256, 1, 0, 1)),
]


@pytest.mark.parametrize("name,dims,hw,batch,micro,expected", TABLE, ids=[t[0] for t in TABLE])
def test_table_of_machines_and_models(name, dims, hw, batch, micro, expected):
    p = plan3d(dims, hw, global_batch=batch, micro_batch=micro, policy=NO_FALLBACK)
    assert p.fits and p.chosen is not None, render_plan3d(p)
    assert choice(p) == expected, render_plan3d(p)
    c = p.chosen
    assert c.t * c.p * c.d == hw.ranks and hw.ranks_per_node % c.t == 0  # rule 1
    assert c.m == batch // (micro * c.d) and c.bubble == pytest.approx((c.p - 1) / (c.m * c.v))
    assert c.peak <= c.budget == int(hw.device_memory * 0.9)
    # rule 4: every layout ahead of the choice in (p, t) order was rejected
    ahead = [x for x in p.candidates if (x.p, x.t) < (c.p, c.t)]
    assert all(x.status == "rejected" for x in ahead)
    # every alternative says why it was not chosen
    assert all(x.reason for x in p.candidates)


def test_7b_on_two_nodes_rows_of_the_alternatives():
    """The acceptance case, alternative by alternative: t=16 spans two nodes; every layout with
    more model parallelism than needed fits but is ranked after the choice."""
    p = plan3d(LLAMA7B, machine(2), global_batch=512, policy=NO_FALLBACK)
    rows = {(x.t, x.p, x.d): x for x in p.candidates}
    assert rows[(16, 1, 1)].kind == TP_ACROSS_NODES
    assert rows[(1, 1, 16)].status == "chosen"
    assert rows[(1, 1, 16)].memory["activations"] == pytest.approx(32 * 2048 * 4096 * 32, rel=1e-9)
    assert rows[(8, 2, 1)].status == "fits" and "larger p than needed" in rows[(8, 2, 1)].reason
    assert rows[(2, 1, 8)].status == "fits" and "larger t than needed" in rows[(2, 1, 8)].reason
    assert 50 * GiB < p.chosen.peak < 52 * GiB  # the hand derivation's ≈ 50.8 GiB
    text = render_plan3d(p)
    assert "plan (FITS): t=1 p=1 d=16, m=32 micro-batches, v=1 (1f1b), ZeRO stage 1" in text
    assert "tp across nodes: t=16 > 8 ranks per node" in text


def test_held_micro_batches_is_the_engines_schedule():
    """The closed form equals max_in_flight of the schedule the engine runs, on every rank."""
    for p in (2, 3, 4, 8):
        for m in (1, 2, p, 2 * p, 3 * p + 1, 32):
            for r in range(p):
                assert held_micro_batches(p, m, 1, r) == max_in_flight(one_f_one_b(p, m), r)
                if m % p == 0:
                    for v in (2, 3, 4):
                        assert held_micro_batches(p, m, v, r) == max_in_flight(interleaved_one_f_one_b(p, m, v), r)


def test_interleaving_memory_is_the_schedules_in_flight_count():
    """Interleaved 1F1B holds max_in_flight(rank 0) chunk activations of nl/(p·v) layers on the
    first stage: 1 + (p−1)/(p·v) = 1.25 of the 80 layers at p=2, v=2, m=8."""
    layer = activation_bytes_per_layer(2048, 1, 8192, 64, 2, 8, False, False)
    held = max_in_flight(interleaved_one_f_one_b(2, 8, 2), 0)
    assert held * 80 // 4 == 100
    mem = rank_memory(GPT70B, 8, 2, 2, 8, 2, 1, "bf16", 1, 0, Policy3D())
    assert mem["activations"] == pytest.approx(100 * layer, abs=1)


# --------------------------------------------------------------------------- rejections


def test_each_rejection_names_its_rule():
    # GPT-2 small on 2 × 8: heads 12 do not split over t=8; t=16 crosses nodes; p=16 does not divide 12 layers
    p = plan3d(GPT125M, machine(2), global_batch=256, policy=NO_FALLBACK)
    rows = {(x.t, x.p, x.d): x for x in p.candidates}
    assert rows[(8, 1, 2)].kind == DIVISIBILITY and "heads=12" in rows[(8, 1, 2)].reason
    assert rows[(16, 1, 1)].kind == TP_ACROSS_NODES
    assert rows[(1, 16, 1)].kind == DIVISIBILITY and "layers=12" in rows[(1, 16, 1)].reason
    # a global batch of 16 does not split over d=32; (t=1, p=2, d=16) has m=1 < p: bubble 100 % > 50 %
    q = plan3d(GPT70B, machine(4), global_batch=16, policy=NO_FALLBACK)
    rows = {(x.t, x.p, x.d): x for x in q.candidates}
    assert rows[(1, 1, 32)].kind == DIVISIBILITY and "d=32 does not divide" in rows[(1, 1, 32)].reason
    assert rows[(1, 2, 16)].kind == BUBBLE and "100%" in rows[(1, 2, 16)].reason
    assert rows[(8, 1, 4)].kind == DOES_NOT_FIT and "short by" in rows[(8, 1, 4)].reason


def test_a_model_too_large_for_any_layout_is_refused_clearly():
    """1T parameters on 16 GPUs of 80 GiB: even t=8, p=2, d=1 with every block recomputed holds
    Ψ/16 = 63e9 parameters × 18 B ≈ 1.05 TiB per rank."""
    p = plan3d(GPT1T, machine(2), global_batch=512, policy=NO_FALLBACK)
    assert not p.fits and p.chosen is None
    assert all(x.status == "rejected" for x in p.candidates)
    assert "error: no layout fits 1,008,009,267,200 parameters" in render_plan3d(p)
    with pytest.raises(PlanError, match=r"the most frugal 3D layout \(t=8 p=2 d=1, ZeRO stage 0, every block "
                                        r"recomputed\) needs 1.05 TiB per rank, short by"):
        plan3d(GPT1T, machine(2), global_batch=512, policy=NO_FALLBACK, raise_if_short=True)


def test_offload_ladder_when_no_3d_layout_fits_and_refusal_when_it_does_not_either():
    """GPT470M on one node of 2 × 4 GiB (budget 3.6 GiB): t=1, d=2 holds 472e6·(6 + 6) B = 5.3 GiB;
    t=2, d=1 236e6·18 B = 3.96 GiB; p=2 the first stage's 271e6·18 B = 4.5 GiB: no 3D layout
    fits, so the ZeRO-Infinity ladder at t=p=1, d=2 runs and sends optimizer states and
    gradients to the 64 GiB of CPU memory. With 1 GiB of host RAM (less than the 1.9 GB fp32
    model every rank builds) it cannot either: refused, naming what is short for both."""
    hw = Hardware(ranks_per_node=2, nodes=1, host_memory=64 * GiB, device_memory=4 * GiB)
    p = plan3d(GPT470M, hw, global_batch=64)
    assert p.fits and p.chosen is None and p.fallback is not None and p.fallback.fits
    assert all(x.kind == DOES_NOT_FIT for x in p.candidates)
    assert p.layout == (1, 1, 2) and p.fallback.rung == "optimizer states and gradients to cpu"
    cfg = p.config_dict()
    assert cfg["parallel"] == {"dp": 2, "tp": 1, "pp": 1, "schedule": "1f1b", "virtual_stages": 1}
    assert cfg["zero"]["offload_optimizer"] == "cpu" and cfg["batch"]["grad_accum_steps"] == 32
    assert "plan (FITS, offload)" in render_plan3d(p)
    small = Hardware(ranks_per_node=2, nodes=1, host_memory=1 * GiB, device_memory=4 * GiB)
    with pytest.raises(PlanError, match=r"no layout fits .* short by .*; with offload \(t=p=1\): no layout fits"):
        plan3d(GPT470M, small, global_batch=64, ladder={"tile_factors": [1], "checkpointing": False},
               raise_if_short=True)


def test_a_sequence_too_long_for_any_3d_layout_is_split_by_the_ladders_context_parallelism(tmp_path):
    """8 layers × 1024 at 512K tokens on 8 × 40 GiB: no (t, p, d) holds one sequence's
    activations (t=8 splits most of them, not the replicated ones nor enough of the logits), so
    the ZeRO-Infinity ladder at t=p=1 runs, which splits the sequence over cp ranks before it
    offloads anything (tiertrain.estimate.plan, rung 1b); the written config keeps that cp, with
    d = N / cp and the accumulation that makes the global batch."""
    long = ModelDims(n_layers=8, hidden=1024, n_heads=16, vocab=32000, seq_len=524288, bias=False)
    hw = machine(1, gib=40)
    p = plan3d(long, hw, global_batch=8)
    assert p.fits and p.chosen is None and p.fallback.rung == f"context parallelism cp={p.cp}" and p.cp > 1
    assert p.layout == (1, 1, 8 // p.cp) and p.to_dict()["plan"]["cp"] == p.cp
    path = tmp_path / "plan.yaml"
    path.write_text(p.to_yaml())
    cfg = load(TrainConfig, str(path))
    assert (cfg.parallel.cp, cfg.parallel.cp_algorithm) == (p.cp, "ring")
    assert cfg.parallel.resolve(hw.ranks) == (1, 8 // p.cp, 1)
    assert cfg.batch.resolve(8 // p.cp) == 8
    assert f"d={8 // p.cp} cp={p.cp} with the ZeRO-Infinity ladder" in render_plan3d(p)


def test_bad_inputs_name_the_value():
    with pytest.raises(ValueError, match="device_memory=None"):
        plan3d(LLAMA7B, Hardware(ranks_per_node=8, host_memory=GiB), global_batch=512)
    with pytest.raises(ValueError, match="global_batch=510 is invalid with micro_batch=4"):
        plan3d(LLAMA7B, machine(2), global_batch=510, micro_batch=4)


# --------------------------------------------------------------------------- the config


@pytest.mark.parametrize("dims,hw,batch", [(LLAMA7B, machine(2), 512), (GPT70B, machine(4), 16)],
                         ids=["7b-2x8", "70b-4x8-interleaved"])
def test_written_config_loads_and_resolves_on_the_stated_world(tmp_path, dims, hw, batch):
    p = plan3d(dims, hw, global_batch=batch, policy=NO_FALLBACK)
    path = tmp_path / "plan.yaml"
    path.write_text(p.to_yaml())
    cfg = load(TrainConfig, str(path))
    c = p.chosen
    assert cfg.parallel.resolve(hw.ranks) == (c.p, c.d, c.t)
    assert cfg.parallel.schedule == c.schedule and cfg.parallel.virtual_stages == c.v
    assert cfg.batch.resolve(c.d) == batch and cfg.batch.grad_accum_steps == c.m
    assert cfg.zero.stage == c.stage and cfg.activations.checkpoint_every == c.checkpoint_every
    assert (cfg.model.n_layers, cfg.model.hidden, cfg.model.n_heads, cfg.model.vocab_size) == (
        dims.n_layers, dims.hidden, dims.n_heads, dims.vocab)
    if c.v > 1:
        assert cfg.parallel.schedule == "interleaved"


def test_cli_plans_a_stated_2x8_machine(tmp_path, capsys):
    out = tmp_path / "plan.yaml"
    args = ["plan", "--layers", "32", "--hidden", "4096", "--heads", "32", "--vocab", "32000", "--seq", "2048",
            "--no-bias", "--nproc", "8", "--nodes", "2", "--gpu-memory", "80GiB", "--ram", "1TiB",
            "--global-batch", "512", "--out", str(out)]
    assert cli.main(args) == 0
    text = capsys.readouterr().out
    assert "plan (FITS): t=1 p=1 d=16, m=32 micro-batches, v=1 (1f1b), ZeRO stage 1" in text
    assert "alternatives" in text and "tp across nodes" in text and "torchrun --nnodes 2" in text
    cfg = load(TrainConfig, str(out))
    assert cfg.parallel.resolve(16) == (1, 16, 1) and cfg.batch.resolve(16) == 512
    assert cli.main(args + ["--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["fits"] and data["config_accepted"] is True
    assert {k: data["plan"][k] for k in ("tp", "pp", "dp", "micro_batches", "virtual_stages", "zero_stage")} == {
        "tp": 1, "pp": 1, "dp": 16, "micro_batches": 32, "virtual_stages": 1, "zero_stage": 1}
    assert len(data["candidates"]) == 15 and all(c["reason"] for c in data["candidates"])
    # a global batch is needed; --layout dp keeps the data-parallel ladder on the same machine
    assert cli.main([a for a in args if a not in ("--global-batch", "512")]) == 2
    assert "--global-batch" in capsys.readouterr().err
    assert cli.main(["plan", "--preset", "small", "--nproc", "8", "--nodes", "2", "--gpu-memory", "80GiB",
                     "--ram", "1TiB", "--layout", "dp", "--out", ""]) == 0
    text = capsys.readouterr().out
    assert "plan (FITS; rung: no offload)" in text and "alternatives" not in text
