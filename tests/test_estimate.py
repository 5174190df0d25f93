"""Specification of tiertrain.estimate: the papers' numbers (docs/concepts.md#zero, docs/concepts.md#zero-infinity) and the
engine's own accounting. GB in the papers' tables is 1e9 bytes."""

from __future__ import annotations

import dataclasses

import json

import pytest
import torch.nn as nn

from tiertrain.estimate import (
    ModelDims,
    ZeroLayout,
    activation_bytes_per_layer,
    ait_activation_checkpoints,
    ait_optimizer_states,
    ait_params_grads,
    combined_efficiency,
    count_module_parameters,
    efficiency,
    engine_model_state_bytes,
    estimate,
    estimate_from_args,
    human_bytes,
    infinity_activation_checkpoint_bytes,
    infinity_awm_bytes,
    infinity_model_state_bytes,
    infinity_mswm_bytes,
    infinity_parameters,
    iteration_flops,
    model_state_bytes,
    padded_shard,
    predict_efficiency,
    render_table,
    required_bandwidth,
    to_json,
    zero_activation_bytes,
    zero_max_parameters,
)

GB = 1e9
TB_BINARY = 2**40

# --------------------------------------------------------------------------- ZeRO §5 Table 1

# docs/concepts.md#zero-memory-per-rank, the paper's Table 1: GB per device for (Ψ, N_d) and stages os (1), os+g (2), os+g+p (3),
# exactly as printed (strings, so the number of printed digits is part of the data).
TABLE_1 = {
    7.5e9: {1: ("120", "120", "120"), 4: ("52.5", "41.3", "30"), 16: ("35.6", "21.6", "7.5"),
            64: ("31.4", "16.6", "1.88"), 256: ("30.4", "15.4", "0.47"),
            1024: ("30.1", "15.1", "0.12")},
    128e9: {1: ("2048", "2048", "2048"), 4: ("896", "704", "512"), 16: ("608", "368", "128"),
            64: ("536", "284", "32"), 256: ("518", "263", "8"), 1024: ("513", "257", "2")},
    1e12: {1: ("16000", "16000", "16000"), 4: ("7000", "5500", "4000"),
           16: ("4750", "2875", "1000"), 64: ("4187", "2218", "250"),
           256: ("4046", "2054", "62.5"), 1024: ("4011", "2013", "15.6")},
}
TABLE_1_CELLS = [
    (psi, nd, stage, printed[stage - 1])
    for psi, rows in TABLE_1.items()
    for nd, printed in rows.items()
    for stage in (1, 2, 3)
]


def last_digit_unit(printed: str) -> float:
    """1 for "4187", 0.1 for "52.5", 0.01 for "1.88"."""
    return 10.0 ** -(len(printed.split(".")[1]) if "." in printed else 0)


def test_table_1_has_all_54_cells():
    assert len(TABLE_1_CELLS) == 54


@pytest.mark.parametrize("psi,nd,stage,printed", TABLE_1_CELLS)
def test_zero_table_1_cell_within_last_printed_digit(psi, nd, stage, printed):
    """Each cell of ZeRO §5 Table 1 is the formula's value, rounded or cut short by the
    paper: |value - printed| < one unit of the last printed digit (4187.5 prints as 4187)."""
    value = model_state_bytes(psi, nd, stage) / GB
    assert abs(value - float(printed)) < last_digit_unit(printed), (value, printed)


def test_zero_stage_formulas_are_the_papers():
    psi, nd, K = 1000.0, 10, 12
    assert model_state_bytes(psi, nd, 0) == (2 + 2 + K) * psi
    assert model_state_bytes(psi, nd, 1) == 2 * psi + 2 * psi + K * psi / nd
    assert model_state_bytes(psi, nd, 2) == 2 * psi + (2 + K) * psi / nd
    assert model_state_bytes(psi, nd, 3) == (2 + 2 + K) * psi / nd


def test_some_table_1_cells_are_truncated_not_rounded():
    """4187.5 prints as 4187 and 2218.75 as 2218: the tolerance must be a full unit."""
    assert model_state_bytes(1e12, 64, 1) / GB == 4187.5
    assert model_state_bytes(1e12, 64, 2) / GB == 2218.75


# --------------------------------------------------------------------------- ZeRO Table 2


@pytest.mark.parametrize("stage,printed_billions", [(1, "7.6"), (2, "14.4"), (3, "128")])
def test_zero_table_2_theoretical_max_model_on_64_v100s(stage, printed_billions):
    """Table 2 (MP=1, 64 GPUs, 32 GB V100): the paper assumes the whole 32e9 bytes of a
    device hold model states (16 B/param mixed-precision Adam, nothing for activations)."""
    psi = zero_max_parameters(32 * GB, dp=64, stage=stage)
    assert abs(psi / 1e9 - float(printed_billions)) < last_digit_unit(printed_billions)


def test_zero_table_2_uses_decimal_gigabytes():
    """With 32 GiB the stage-3 maximum would be 137B, not the printed 128B."""
    assert zero_max_parameters(32 * 2**30, dp=64, stage=3) / 1e9 > 137


def test_zero_activation_estimate_for_gpt2_1_5b():
    """ZeRO §3.2: a 1.5B GPT-2 (48 layers, hd 1600) at seq 1K, batch 32 needs ~60 GB."""
    assert zero_activation_bytes(hd=1600, bsz=32, seq=1024, nl=48) / GB == pytest.approx(60, rel=0.02)


# --------------------------------------------------------------------------- ZeRO-Infinity §3


def test_infinity_model_states_are_20_bytes_per_paper_parameter():
    nl, hd = 128, 25600
    assert infinity_parameters(nl, hd) == 12 * nl * hd**2
    assert infinity_model_state_bytes(nl, hd) == 240 * nl * hd**2 == 20 * infinity_parameters(nl, hd)


def test_infinity_activation_checkpoint_formula():
    assert infinity_activation_checkpoint_bytes(bsz=4, seq=1024, hd=8192, nl=96, ci=2) == \
        2 * 4 * 1024 * 8192 * 96 / 2


@pytest.mark.parametrize("nl,hd,printed_tb", [(195, 65536, "0.76"), (315, 163840, "3")])
def test_infinity_checkpoints_of_10t_and_100t_models(nl, hd, printed_tb):
    """ZeRO-Infinity §3 (seed notes 000): at batch 32 per node, seq 1024, ci=1 the 10T
    model's checkpoints take 0.76 TB and the 100T model's 3 TB (binary TB, like the
    paper's other sizes). Model shapes from the paper's Fig. 2a."""
    assert infinity_parameters(nl, hd) == pytest.approx(10 ** (13 if hd == 65536 else 14), rel=0.02)
    size = infinity_activation_checkpoint_bytes(bsz=32, seq=1024, hd=hd, nl=nl, ci=1) / TB_BINARY
    assert abs(size - float(printed_tb)) < last_digit_unit(printed_tb)


def test_infinity_mswm_is_fp16_param_and_grad_of_the_hd_to_4hd_linear():
    hd = 8192
    assert infinity_mswm_bytes(hd) == 4 * hd * 4 * hd == (2 + 2) * hd * (4 * hd)
    assert infinity_mswm_bytes(hd, tile_factor=16) == 4 * hd * 4 * hd / 16


def test_infinity_awm_formula():
    bsz, seq, ci, hd, heads = 2, 1024, 3, 4096, 32
    assert infinity_awm_bytes(bsz, seq, ci, hd, heads) == bsz * seq * ci * (16 * hd + 2 * heads * seq)


# --------------------------------------------------------------------------- ZeRO-Infinity §4

PEAK = 70e12  # 70 TFLOP/s, the average achievable V100 DGX-2 peak of ZeRO-Infinity §4.2
SEQ = 1024  # Fig. 3 fixes the sequence length at 1024 (seed notes 002 on Fig. 3)


def test_ait_formulas():
    psi, nl, hd, bsz, ci = infinity_parameters(10, 1024), 10, 1024, 4, 2
    assert iteration_flops(bsz, SEQ, psi) == 2 * 4 * bsz * SEQ * psi
    assert ait_params_grads(SEQ, bsz) == iteration_flops(bsz, SEQ, psi) / (2 * 4 * psi)
    assert ait_optimizer_states(SEQ, bsz) == iteration_flops(bsz, SEQ, psi) / (2 * 16 * psi)
    checkpoint_bytes = 2 * infinity_activation_checkpoint_bytes(bsz, SEQ, hd, nl, ci)
    assert ait_activation_checkpoints(hd, ci) == pytest.approx(
        iteration_flops(bsz, SEQ, psi) / checkpoint_bytes)


def test_efficiency_and_required_bandwidth_are_inverse():
    assert efficiency(ait=1000, bw=70e9, peak=PEAK) == 1000 * 70e9 / (1000 * 70e9 + PEAK)
    bw = required_bandwidth(ait=512, peak=PEAK, target_efficiency=0.9)
    assert efficiency(512, bw, PEAK) == pytest.approx(0.9)


def test_70_gb_per_s_for_params_and_grads_beats_50_percent_at_the_smallest_batch():
    """ZeRO-Infinity §4.2 / Fig. 3a: smallest batch = bsz 1 at seq 1024."""
    assert efficiency(ait_params_grads(SEQ, 1), 70e9, PEAK) > 0.5


def test_optimizer_states_need_about_1_5_tb_per_s_for_90_percent_at_bsz_2():
    ait = ait_optimizer_states(SEQ, 2)
    assert efficiency(ait, 1.5e12, PEAK) >= 0.9
    assert 1.0e12 < required_bandwidth(ait, PEAK, 0.9) <= 1.5e12
    # ... "nearly 4x" the bandwidth of params/grads for the same efficiency
    assert required_bandwidth(ait, PEAK, 0.5) == 4 * required_bandwidth(ait_params_grads(SEQ, 2), PEAK, 0.5)


def test_activation_checkpoints_need_only_1_to_2_gb_per_s():
    """Fig. 3c (ci=1): 2 GB/s keeps >50% even at hd 2K (the paper's "1.4 GB/s"), and
    beyond hd 8K less than 1 GB/s is needed."""
    assert efficiency(ait_activation_checkpoints(2048, 1), 2e9, PEAK) > 0.5
    assert required_bandwidth(ait_activation_checkpoints(2048, 1), PEAK, 0.5) == pytest.approx(1.4e9, rel=0.02)
    for hd in (8192, 16384, 65536):
        assert required_bandwidth(ait_activation_checkpoints(hd, 1), PEAK, 0.5) < 1e9


def test_predict_efficiency_combines_offloaded_states_without_overlap():
    pred = predict_efficiency(SEQ, 2, 8192, PEAK, params_grads_bw=70e9, optimizer_bw=1.5e12)
    assert [s.state for s in pred.states] == ["params+grads", "optimizer states"]
    alone = [s.efficiency for s in pred.states]
    assert pred.combined < min(alone)
    assert pred.combined == combined_efficiency([(s.ait, s.bandwidth) for s in pred.states], PEAK)
    assert predict_efficiency(SEQ, 2, 8192, PEAK).combined == 1.0


# --------------------------------------------------------------------------- parameter counts


class StandInBlock(nn.Module):
    """The block structure ModelDims describes: ln1, qkv, proj, ln2, fc1, fc2."""

    def __init__(self, h: int, f: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, f * h), nn.Linear(f * h, h)


class StandInGPT(nn.Module):
    def __init__(self, d: ModelDims):
        super().__init__()
        self.embed = nn.Embedding(d.vocab, d.hidden)
        self.pos = nn.Embedding(d.seq_len, d.hidden)
        self.blocks = nn.ModuleList(StandInBlock(d.hidden, d.ffn_mult) for _ in range(d.n_layers))
        self.norm = nn.LayerNorm(d.hidden)
        self.head = nn.Linear(d.hidden, d.vocab, bias=False)
        if d.tie_embeddings:
            self.head.weight = self.embed.weight


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("ffn_mult", [4, 2])
def test_meta_count_of_a_stand_in_gpt_equals_model_dims(tied, ffn_mult):
    d = ModelDims(n_layers=3, hidden=64, n_heads=4, vocab=100, seq_len=32,
                  ffn_mult=ffn_mult, tie_embeddings=tied)
    assert count_module_parameters(lambda: StandInGPT(d)) == d.num_parameters()


def test_model_dims_count_by_hand():
    d = ModelDims(n_layers=2, hidden=8, n_heads=2, vocab=10, seq_len=4)
    block = 2 * 8 + (8 * 24 + 24) + (8 * 8 + 8) + 2 * 8 + (8 * 32 + 32) + (32 * 8 + 8)
    assert d.block_parameters() == block == 12 * 8 * 8 + 13 * 8
    assert d.num_parameters() == 2 * block + 10 * 8 + 4 * 8 + 2 * 8
    assert ModelDims(2, 8, 2, 10, 4, tie_embeddings=False).num_parameters() == d.num_parameters() + 8 * 10


def test_paper_approximation_is_close_for_wide_models():
    d = ModelDims(n_layers=24, hidden=8192, n_heads=64, vocab=50257, seq_len=2048)
    assert d.paper_parameters() == 12 * 24 * 8192**2
    assert d.paper_parameters() == pytest.approx(d.num_parameters(), rel=0.03)


def test_meta_count_allocates_nothing_even_for_a_trillion_parameters():
    d = ModelDims(n_layers=128, hidden=25600, n_heads=160, vocab=50304, seq_len=2048)
    assert count_module_parameters(lambda: StandInGPT(d)) == d.num_parameters() > 1e12


def test_shared_parameters_counted_once():
    lin = nn.Linear(4, 4)
    seq = nn.Sequential(lin, lin)
    assert count_module_parameters(seq) == 20


def test_meta_count_matches_tiertrain_gpt():
    gpt = pytest.importorskip("tiertrain.models.gpt")
    for tied in (True, False):
        cfg = gpt.GPTConfig(n_layers=3, hidden=96, n_heads=4, vocab_size=300, seq_len=64,
                            tie_embeddings=tied)
        dims = ModelDims.from_gpt_config(cfg)
        assert count_module_parameters(lambda: gpt.GPT(cfg)) == dims.num_parameters()
        est = estimate(lambda: gpt.GPT(cfg))  # the module's .config supplies the dims
        assert est.parameters == dims.num_parameters() and est.dims == dims


# --------------------------------------------------------------------------- engine accounting


def test_padded_shard_is_ceil_n_over_dp_times_alignment():
    assert padded_shard(10, 4) == 3
    assert padded_shard(12, 4) == 3
    assert padded_shard(10, 4, alignment=4) == 4
    assert padded_shard(33, 4, alignment=4) == 12


@pytest.mark.parametrize("precision,param_bytes,master_bytes", [("bf16", 2, 4), ("fp16", 2, 4), ("fp32", 4, 0)])
def test_engine_dtypes_unpartitioned(precision, param_bytes, master_bytes):
    """Stage 0: params in the compute dtype, fp32 grads, fp32 master only for 16-bit
    compute, Adam m+v 8 B."""
    ms = engine_model_state_bytes(1000, dp=4, stage=0, precision=precision)
    assert (ms.params, ms.grads, ms.master, ms.optimizer) == (
        param_bytes * 1000, 4 * 1000, master_bytes * 1000, 8 * 1000)


def test_engine_stages_partition_more_categories():
    n, dp, shard = 1001, 4, 251
    by_stage = [engine_model_state_bytes(n, dp, stage, "bf16") for stage in range(4)]
    assert [b.params for b in by_stage] == [2 * n, 2 * n, 2 * n, 2 * shard]
    assert [b.grads for b in by_stage] == [4 * n, 4 * n, 4 * shard, 4 * shard]
    assert [b.master for b in by_stage] == [4 * n, 4 * shard, 4 * shard, 4 * shard]
    assert [b.optimizer for b in by_stage] == [8 * n, 8 * shard, 8 * shard, 8 * shard]
    assert by_stage[3].total == 18 * shard


def test_engine_pads_each_tensor_when_given_sizes():
    ms = engine_model_state_bytes([10, 3], dp=4, stage=3, precision="fp32")
    assert ms.params == 4 * (3 + 1)


def test_estimate_model_state_lines_follow_the_tiers():
    lay = ZeroLayout(dp=2, stage=3, precision="bf16", optimizer_tier="nvme", grad_tier="cpu",
                     param_tier="cpu", ranks_per_node=2)
    est = estimate(10_000, lay)
    tiers = {l.name: l.tier for l in est.lines}
    assert tiers == {"parameters": "cpu", "gradients": "cpu", "master weights": "nvme",
                     "optimizer states": "nvme", "optimizer state, second generation": "nvme"}
    ms = engine_model_state_bytes(10_000, 2, 3, "bf16")
    # the transactional NVMe step keeps two generations of master + moments on disk
    assert est.by_tier() == {"device": 0, "cpu": ms.params + ms.grads, "nvme": 2 * (ms.master + ms.optimizer)}
    assert est.per_node() == {t: 2 * b for t, b in est.by_tier().items()}
    in_place = estimate(10_000, dataclasses.replace(lay, nvme_in_place=True))
    assert in_place.by_tier()["nvme"] == ms.master + ms.optimizer  # zero.nvme_in_place: one generation


def test_fp32_optimizer_on_another_tier_keeps_its_own_master_copy():
    on_device = estimate(1000, ZeroLayout(precision="fp32", stage=2))
    offloaded = estimate(1000, ZeroLayout(precision="fp32", stage=2, optimizer_tier="cpu"))
    assert on_device.line("master weights").bytes == 0
    assert offloaded.line("master weights").bytes == 4 * 1000


def test_paper_accounting_reproduces_zero_table_formula():
    for stage in range(4):
        est = estimate(7_500_000, ZeroLayout(dp=64, stage=stage, accounting="paper"))
        assert est.total() == pytest.approx(model_state_bytes(7_500_000, 64, stage), abs=3)
    assert "K·Ψ/N_d (ZeRO §5.1, P_os; K=12)" in estimate(
        1000, ZeroLayout(dp=4, stage=1, accounting="paper")).line("optimizer states").formula


def test_model_parallel_ranks_hold_a_tp_pp_share():
    full = estimate(8000, ZeroLayout()).total()
    assert estimate(8000, ZeroLayout(tp=2, pp=2)).total() == full // 4


def test_activation_formula_matches_megatron_34_plus_5as_over_h():
    s, b, h, a = 2048, 1, 12288, 96
    assert activation_bytes_per_layer(s, b, h, a) == pytest.approx(s * b * h * (34 + 5 * a * s / h))
    assert activation_bytes_per_layer(s, b, h, a, tp=8) == pytest.approx(
        s * b * h * (10 + 24 / 8 + 5 * a * s / (h * 8)))
    # fp32 doubles every non-mask tensor; no dropout, fused attention: 16 elements per s·b·h
    assert activation_bytes_per_layer(s, b, h, a, dtype_bytes=4, dropout=False,
                                      stores_attention_scores=False) == 16 * 4 * s * b * h


def test_estimate_with_dims_has_activation_and_working_memory_lines():
    d = ModelDims(n_layers=4, hidden=128, n_heads=4, vocab=256, seq_len=128)
    no_ckpt = estimate(d, ZeroLayout(micro_batch=2))
    assert "activations (blocks)" in [l.name for l in no_ckpt.lines]
    ckpt = estimate(d, ZeroLayout(micro_batch=2, checkpoint_interval=2, checkpoint_tier="cpu", stage=3))
    names = {l.name: l for l in ckpt.lines}
    assert names["activation checkpoints"].bytes == 2 * 2 * 128 * 128 * 2 and names["activation checkpoints"].tier == "cpu"
    assert names["activation working memory"].bytes < no_ckpt.line("activations (blocks)").bytes
    assert names["model-state working memory"].tier == "device"


def test_tiling_divides_the_gathered_block_working_set():
    """Stage 3 gathers the root plus one block at a time; tiling qkv/fc1/fc2 into t tiles
    (each its own unit) leaves the block unit with LNs + proj and gathers one tile at a time."""
    from tiertrain.estimate.units import gpt_meta_model, stage3_gathered_bytes

    d = ModelDims(n_layers=4, hidden=128, n_heads=4, vocab=256, seq_len=128)
    h, root = 128, (256 + 128) * 128 + 2 * 128
    untiled = stage3_gathered_bytes(gpt_meta_model(d), 2)
    tiled = stage3_gathered_bytes(gpt_meta_model(d, tile_factor=4), 2)
    assert untiled == 2 * (root + d.block_parameters())
    # block unit: ln1, ln2, proj (h² + h), padded to 128; largest tile: fc1 or fc2 slice (4h²/4 + bias)
    assert tiled == 2 * (root + (4 * h + h * h + h) + (4 * h * h // 4 + 4 * h // 4))


def test_paper_accounting_uses_section_3_formulas():
    d = ModelDims(n_layers=8, hidden=1024, n_heads=16, vocab=1000, seq_len=512)
    est = estimate(d, ZeroLayout(stage=3, dp=8, micro_batch=2, checkpoint_interval=1, accounting="paper"))
    assert est.line("activation checkpoints").bytes == infinity_activation_checkpoint_bytes(2, 512, 1024, 8, 1)
    assert est.line("activation working memory").bytes == infinity_awm_bytes(2, 512, 1, 1024, 16)
    assert est.line("model-state working memory").bytes == infinity_mswm_bytes(1024)


def test_estimate_without_dims_notes_the_omission():
    est = estimate(1000)
    assert [l.name for l in est.lines] == ["parameters", "gradients", "master weights", "optimizer states"]
    assert any("dims unknown" in n for n in est.notes)


def test_estimate_from_args_accepts_dims_or_params_and_aliases():
    a = estimate_from_args(n_layers=2, hidden=64, heads=4, vocab=100, seq=32, dp=2, stage=1, ci=1, bsz=3)
    assert a.layout.checkpoint_interval == 1 and a.layout.micro_batch == 3 and a.dims.n_heads == 4
    assert estimate_from_args(params=1234, dp=2).parameters == 1234


# --------------------------------------------------------------------------- report


def test_human_bytes():
    assert human_bytes(0) == "0 B"
    assert human_bytes(1536) == "1.50 KiB"
    assert human_bytes(3 * 2**30) == "3.00 GiB"


def test_report_table_and_json():
    d = ModelDims(n_layers=2, hidden=64, n_heads=4, vocab=100, seq_len=32)
    est = estimate(d, ZeroLayout(dp=2, stage=2, optimizer_tier="cpu"))
    table = render_table(est)
    assert table.splitlines()[2].split() == ["item", "bytes", "tier", "formula"]
    for line in est.lines:
        assert line.formula in table
    data = json.loads(to_json(est))
    assert data["per_rank"] == est.by_tier() and data["per_node"]["cpu"] == 2 * est.by_tier()["cpu"]
    assert [l["name"] for l in data["lines"]] == [l.name for l in est.lines]


# --------------------------------------------------------------------------- bad inputs


@pytest.mark.parametrize("field,value", [
    ("dp", 0), ("tp", -1), ("pp", 1.5), ("stage", 4), ("precision", "fp8"),
    ("optimizer_tier", "disk"), ("grad_tier", "gpu"), ("checkpoint_tier", "nvme"),
    ("checkpoint_interval", -1), ("micro_batch", 0), ("tile_factor", 0), ("alignment", 0),
    ("accounting", "guess"), ("ranks_per_node", -2),
])
def test_bad_layout_field_is_named(field, value):
    with pytest.raises(ValueError, match=rf"ZeroLayout\.{field}={value!r}"):
        ZeroLayout(**{field: value}).validate()


def test_param_offload_requires_stage_3():
    with pytest.raises(ValueError, match=r"param_tier='cpu'.*stage 3"):
        ZeroLayout(stage=2, param_tier="cpu").validate()


@pytest.mark.parametrize("field,value", [("n_layers", 0), ("hidden", -8), ("vocab", 2.0),
                                         ("n_heads", 3), ("tie_embeddings", 1)])
def test_bad_model_dims_field_is_named(field, value):
    kwargs = dict(n_layers=2, hidden=64, n_heads=4, vocab=100, seq_len=32)
    kwargs[field] = value
    with pytest.raises(ValueError, match=rf"ModelDims\.{field}="):
        ModelDims(**kwargs).validate()


def test_bad_function_arguments_are_named():
    with pytest.raises(ValueError, match="stage=5"):
        model_state_bytes(1e9, 4, 5)
    with pytest.raises(ValueError, match="precision='int8'"):
        engine_model_state_bytes(10, 1, 0, "int8")
    with pytest.raises(ValueError, match="target_efficiency=1"):
        required_bandwidth(100, PEAK, 1)
    with pytest.raises(ValueError, match="efficiency.bw=0"):
        efficiency(100, 0, PEAK)
    with pytest.raises(ValueError, match=r"unknown argument\(s\) \['hiden'\]"):
        estimate_from_args(hiden=64, n_layers=2)
    with pytest.raises(ValueError, match="model='gpt'"):
        estimate("gpt")
    with pytest.raises(ValueError, match="model=0"):
        estimate(0)


# --------------------------------------------------------------------------- tiers


def test_tiers_are_the_tier_members_and_any_spelling_becomes_one():
    """One vocabulary (tiertrain.tiers.Tier): TIERS, the layout's fields, every line's tier and
    the keys of by_tier() are members; "none" (the configuration's spelling) is the device.
    Members compare and hash like their strings, and JSON writes them as strings."""
    from tiertrain.estimate import TIERS
    from tiertrain.tiers import Tier

    assert TIERS == (Tier.DEVICE, Tier.CPU, Tier.NVME)
    lay = ZeroLayout(dp=2, stage=3, optimizer_tier="none", param_tier="cpu", checkpoint_tier=Tier.CPU,
                     checkpoint_interval=1).validate()
    assert (lay.optimizer_tier, lay.param_tier, lay.grad_tier) == (Tier.DEVICE, Tier.CPU, Tier.DEVICE)
    assert ZeroLayout().optimizer_tier is Tier.DEVICE
    est = estimate(ModelDims(n_layers=2, hidden=64, n_heads=4, vocab=100, seq_len=32), lay)
    assert all(type(line.tier) is Tier for line in est.lines)
    assert list(est.by_tier()) == list(TIERS) and est.total("cpu") == est.total(Tier.CPU) > 0
    data = json.loads(to_json(est))
    assert set(data["per_rank"]) == {"device", "cpu", "nvme"} and data["layout"]["param_tier"] == "cpu"


# --------------------------------------------------------------------------- reductions


def _reduction_bytes(stage, dp=2, backend="gloo", optimizer_tier="device", precision_bytes=4):
    from tiertrain.estimate.peak import simulate_peak
    from tiertrain.estimate.units import engine_units, gpt_meta_model

    model = gpt_meta_model(ModelDims(n_layers=2, hidden=64, n_heads=4, vocab=100, seq_len=32))
    pk = simulate_peak(model, dp=dp, stage=stage, precision_bytes=precision_bytes, bucket_mb=0.01, backend=backend,
                       optimizer_tier=optimizer_tier)
    return pk, engine_units(model, stage, dp, 0.01).units


def test_stage2_reductions_land_in_the_gradient_shard():
    """tiertrain.zero.reducer: after a step the gradient shards are zeroed lazily and the next
    reduction reduce-scatters straight into its shard, so a reduction in flight holds its
    bucket and no output of its own; only with an accelerator and the optimizer (and so the
    shards) in host memory does it go through a shard-sized device output. Activations not
    modelled: the filling bucket + 3 reductions in flight at their largest."""
    key = "gradient buckets and reductions in flight"
    pk, units = _reduction_bytes(2)
    buckets = sorted((4 * u.padded_numel for u in units), reverse=True)
    assert pk.items[key] == sum(buckets[:3]) + buckets[0]
    pk, units = _reduction_bytes(2, backend="nccl", optimizer_tier="cpu")
    with_output = sorted((4 * u.padded_numel + 4 * u.shard_numel for u in units), reverse=True)
    assert pk.items[key] == sum(with_output[:3]) + buckets[0]


@pytest.mark.parametrize("dp,receive", [(2, "shard"), (3, "full")])
def test_stage1_reduces_in_place_and_holds_nothing_at_the_step(dp, receive):
    """Stage 1 reduce-scatters each unit's full gradient in place into its shard: until the
    step waits on them, a shard-sized receive buffer each (2-rank gloo: the peer's copy of
    this rank's chunk), or a full-size one on gloo with more ranks; at the optimizer step
    they are gone (waited, and freed, before the gradient norm). (bf16: the step's own
    buffers, gloo's replicated all-gather sends with 3 ranks, stay below them.)"""
    pk, units = _reduction_bytes(1, dp=dp, precision_bytes=2)
    size = {"shard": lambda u: u.shard_numel, "full": lambda u: u.padded_numel}[receive]
    assert pk.items == {"gradient buckets and reductions in flight": sum(4 * size(u) for u in units)}
    assert pk.where != "optimizer step"


# --------------------------------------------------------------------------- against the engine
# (the model states of a real engine step, every stage and tier: tests/test_estimate_vs_engine.py)


@pytest.mark.parametrize("dtype,D", [("float32", 4), ("bfloat16", 2)])
def test_activation_bytes_are_what_autograd_saves(dtype, D):
    """Counted with saved_tensors_hooks on tiertrain's GPT (storages, parameters excluded):
    L blocks + the head equal gpt_activation_bytes to within the 4-byte loss scalar."""
    import torch

    from tiertrain.estimate.activations import gpt_activation_bytes
    from tiertrain.models.gpt import GPT, GPTConfig

    g = GPTConfig(n_layers=2, hidden=64, n_heads=4, seq_len=32, vocab_size=96)
    model = GPT(g).to(getattr(torch, dtype))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen[st.data_ptr()] = st.nbytes()
        return t

    ids = torch.randint(0, 96, (3, 32))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(ids, ids.roll(-1, 1))
    acts = gpt_activation_bytes(ModelDims.from_gpt_config(g), 3, D)
    assert 0 <= sum(seen.values()) - (2 * acts.block + acts.head) <= 8


def test_engine_estimate_predicts_the_peak_with_its_formula_lines():
    d = ModelDims(n_layers=8, hidden=640, n_heads=10, vocab=256, seq_len=256)
    from tiertrain.estimate.overhead import HostOverhead

    est = estimate(d, ZeroLayout(dp=2, stage=0, precision="fp32", micro_batch=2), HostOverhead.none())
    # measured on the reference machine: the live-tensor peak of this run is 779.4 MiB
    # (bench/results/estimate_accuracy.md); 16 B/param + 8 blocks of 16·s·b·h·4 B + grads in flight
    assert est.total() / 2**20 == pytest.approx(779.4, abs=0.1)
    assert est.peak_at == "backward of block 7"
    with_overhead = estimate(d, ZeroLayout(dp=2, stage=0, precision="fp32", micro_batch=2),
                             HostOverhead(10 << 20, 0.5, "test"))
    transient = est.total() - sum(l.bytes for l in est.lines[:4])
    assert with_overhead.total() - est.total() == (10 << 20) + int(0.5 * transient)
    assert with_overhead.line("framework overhead").tier == "cpu"


@pytest.mark.timeout(90)
def test_measure_a_real_run_and_predict_it():
    """tiertrain.estimate.measure (what bench/estimate_accuracy.py and `tiertrain probe`
    use): a fresh process, 2 gloo ranks; the estimate's model states equal the report."""
    import sys

    from tiertrain.estimate.measure import RunSpec, measure, predict
    from tiertrain.estimate.overhead import HostOverhead

    if not sys.platform.startswith("linux"):
        pytest.skip("needs /proc")
    spec = RunSpec(model=dict(n_layers=1, hidden=32, n_heads=2, seq_len=32), micro_batch=1,
                   overrides=["--zero.stage=2"], steps=2)
    ranks = measure(spec, timeout=80)
    assert [r["rank"] for r in ranks] == [0, 1]
    est = predict(spec, HostOverhead.none())
    lines = {l.name: l.bytes for l in est.lines}
    rep = max(ranks, key=lambda r: r["report"]["total"])["report"]
    assert (lines["parameters"], lines["gradients"], lines["master weights"] + lines["optimizer states"]) == (
        rep["params"], rep["grads"], rep["optimizer"])
    assert all(r["peak"] > 0 and r["baseline"] > 0 for r in ranks)
