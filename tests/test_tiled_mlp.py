"""The tiled MLP (DeepSpeed ALST; issue 38, item 3): every block's MLP run over tiles of the
sequence's tokens, each tile's intermediate recomputed in backward (tiertrain.tiling
.apply_tiled_mlp), gives the untiled model's loss and gradients within the float64 oracle, for
tiertrain's GPT and Hugging Face Llama, whether the tile divides the sequence or not and when
it covers it; it keeps no whole-sequence intermediate for backward; it trains as one process
trains the untiled model at ZeRO-3 with context parallelism, with activation checkpointing, with
stage-3 units inside the MLP, with tensor (and sequence) parallelism, and without cp; the estimate drops the MLP intermediates as the
measured peak does; wrap() tiles a model as the config says and refuses one tiled otherwise."""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

import tiertrain
import zoo
from reference import (Oracle, check_tensors, engine_train, global_batches, make_config, make_model, reference_train,
                       tp_gathered)
from tiertrain.engine_contract import default_loss
from tiertrain.parallel import apply_tensor_parallel
from tiertrain.parallel.cp_plan import apply_context_parallel
from tiertrain.testing import run_distributed
from tiertrain.tiling import apply_tiled_mlp, apply_tiling, block_mlps, mlp_in_tiles, tiled_mlp_tokens

STEPS, MICRO = 3, 2


def _model(name: str):
    if name == "gpt tiled linears":  # ZeRO-3 units inside the MLP, gathered by each tile's recomputation
        return apply_tiling(make_model(), {"blocks.*.mlp.fc1": 2, "blocks.*.mlp.fc2": 2})
    return make_model() if name == "gpt" else zoo.build(ZOO.get(name, name))


ZOO = {"llama": "llama-gqa"}


def _batch(name: str, rows: int = 2):
    return global_batches(1, rows)[0] if name == "gpt" else zoo.batches(ZOO.get(name, name), 1, rows)[0]


def _loss_and_grads(model, batch) -> dict:
    model.zero_grad(set_to_none=True)
    loss = default_loss(model, batch)
    loss.backward()
    return {"loss": loss.detach().reshape(1), **{n: p.grad.clone() for n, p in model.named_parameters()}}


# 3 leaves a last tile of 1 of the 16 tokens; 64 covers them all. GPT-2's MLP views its input
# (Conv1D), as MoE blocks do: tiles of 2 sequences are made contiguous for it.
@pytest.mark.parametrize("name,tile", [(name, tile) for name in ("gpt", "llama") for tile in (3, 8, 64)]
                         + [("gpt2-tied", 3), ("mixtral-moe", 5)])
def test_tiled_mlp_gives_the_untiled_loss_and_gradients(name, tile):
    model, batch = _model(name), _batch(name)
    ref32 = _loss_and_grads(model, batch)
    ref64 = _loss_and_grads(copy.deepcopy(model).double(), batch)
    tiled = apply_tiled_mlp(copy.deepcopy(model), tile)
    assert tiled_mlp_tokens(tiled) == tile and len(block_mlps(tiled)) == 2  # every model here: 2 blocks
    actual = _loss_and_grads(tiled, batch)
    check_tensors(actual, ref32, ref64, f"{name}, MLP in tiles of {tile} tokens")
    if tile >= 16:  # one tile: the MLP runs as it is
        assert all(torch.equal(actual[n], ref32[n]) for n in ref32)


def test_backward_recomputes_each_tile_instead_of_keeping_the_intermediate():
    """A GPT MLP keeps fc1's output and GELU's (b·s·4h each) for backward; tiled, forward keeps
    the tiles' inputs only (and backward recomputes one tile's intermediate at a time)."""
    torch.manual_seed(0)
    mlp = make_model().blocks[0].mlp
    x = torch.randn(2, 16, 32, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        untiled = mlp(x)
    assert 2 * 16 * 128 in saved, "the check's premise: the untiled MLP keeps its intermediate"
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.numel()) or t, lambda t: t):
        tiled = mlp_in_tiles(mlp, x, 5)  # tiles of 5, 5, 5 and 1 tokens
    assert saved and not {2 * 16 * 128, 2 * 5 * 128, 2 * 1 * 128} & set(saved), f"intermediates kept: {saved}"
    grads = torch.autograd.grad(tiled.sum(), [x, mlp.fc1.weight])
    expected = torch.autograd.grad(untiled.sum(), [x, mlp.fc1.weight])
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(grads, expected))


def test_bad_tiles_are_refused():
    with pytest.raises(tiertrain.ConfigError, match=r"activations.mlp_tile_tokens.*-1.*>= 0"):
        make_config(activations={"mlp_tile_tokens": -1})
    for bad in (-2, True, 2.5):
        with pytest.raises(tiertrain.ConfigError, match=rf"mlp_tile_tokens={bad!r} is invalid: expected a number"):
            apply_tiled_mlp(make_model(), bad)
    with pytest.raises(tiertrain.ConfigError, match="Linear has no block MLP"):
        apply_tiled_mlp(torch.nn.Linear(2, 2), 4)


def test_a_mixture_of_experts_whose_tiles_would_route_differently_is_refused():
    """Capacity-limited routing (Switch) drops tokens by what is routed together, and routers'
    logits collected per call (output_router_logits) would be one entry per tile: both refused,
    naming why; per-token routing without collected logits (Mixtral above) is tiled."""
    import transformers
    switch = transformers.SwitchTransformersForConditionalGeneration(transformers.SwitchTransformersConfig(
        vocab_size=64, d_model=16, d_ff=32, num_layers=2, num_decoder_layers=2, num_heads=2, d_kv=8, num_experts=4,
        expert_capacity=4, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1))
    with pytest.raises(tiertrain.ConfigError, match=r"mlp_tile_tokens=4: SwitchTransformersSparseMLP routes with an "
                                                    r"expert capacity .*expert_capacity=4.*set activations"):
        apply_tiled_mlp(switch, 4)
    mixtral = zoo.build("mixtral-moe")
    mixtral.config.output_router_logits = True
    with pytest.raises(tiertrain.ConfigError, match=r"output_router_logits=True.*one entry per tile"):
        apply_tiled_mlp(mixtral, 4)
    assert tiled_mlp_tokens(mixtral) == 0  # refused before anything changed


def test_wrap_tiles_as_configured_refuses_other_tiles_and_close_undoes_it():
    topology = tiertrain.Topology.build()
    model = make_model()
    engine = tiertrain.wrap(model, make_config(activations={"mlp_tile_tokens": 4}), topology)
    assert tiled_mlp_tokens(model) == 4
    engine.close()
    assert tiled_mlp_tokens(model) == 0 and type(model.blocks[0].mlp).__name__ == "MLP"
    apply_tiled_mlp(model, 8)
    with pytest.raises(tiertrain.ConfigError, match=r"mlp_tile_tokens=4, but the model's MLPs were tiled with 8"):
        tiertrain.wrap(model, make_config(activations={"mlp_tile_tokens": 4}), topology)
    with pytest.raises(tiertrain.ConfigError, match=r"mlp_tile_tokens=0, but the model's MLPs were tiled with 8"):
        tiertrain.wrap(model, make_config(), topology)
    assert tiled_mlp_tokens(model) == 8, "a refused wrap leaves the model as it was"


# -- training: ZeRO-3, with and without context parallelism ----------------------------------

CASES = {
    "gpt, cp 2 ring, stage 3, tiles of 3, every block checkpointed": {
        "model": "gpt", "cp": 2, "algorithm": "ring", "tile": 3, "activations": {"checkpoint_every": 1}},
    "llama, cp 2 ulysses, stage 3, parameters and optimizer on CPU, tiles of 3, the loss in tiles of 5": {
        "model": "llama", "cp": 2, "algorithm": "ulysses", "tile": 3, "loss_tile": 5,
        "zero": {"offload_params": "cpu", "offload_optimizer": "cpu"}},
    "gpt, dp 2, stage 3, tiles of 5, every block checkpointed selectively": {
        "model": "gpt", "cp": 1, "tile": 5, "activations": {"checkpoint_every": 1, "recompute": "selective"}},
    "gpt, dp 2, stage 3, tiles of 5 over TiledLinear units (each linear in 2 gathered tiles)": {
        "model": "gpt tiled linears", "cp": 1, "tile": 5},
    "gpt, tp 2, stage 3, tiles of 3": {"model": "gpt", "cp": 1, "tp": 2, "tile": 3},
    "gpt, tp 2 with sequence parallelism, stage 3, tiles of 3": {
        "model": "gpt", "cp": 1, "tp": 2, "sequence_parallel": True, "tile": 3},
}


def _config(case: dict, cp: int, tile: int, tp: int = 1):
    return make_config(zero={"stage": 3, **case.get("zero", {})},
                       parallel={"cp": cp, "tp": tp, "cp_algorithm": case.get("algorithm", "ring")},
                       activations={"mlp_tile_tokens": tile, "loss_tile_tokens": case.get("loss_tile", 0) if cp > 1
                                    else 0, **case.get("activations", {})},
                       batch={"micro_batch_size": MICRO}, optimizer={"eps": 1e-3})


def _batches(case: dict, dp: int):
    if case["model"] == "llama":  # (tiertrain's GPT otherwise)
        return zoo.batches("llama-gqa", STEPS, MICRO * dp)
    return global_batches(STEPS, MICRO * dp)


def _rank(rank, world):
    out = {}
    for name, case in CASES.items():
        cp, tp = case["cp"], case.get("tp", 1)

        def prepare(model, topology, case=case):
            if topology.size("tp") > 1:
                return apply_tensor_parallel(model, topology, sequence_parallel=case.get("sequence_parallel", False))
            if topology.size("cp") == 1:
                return model
            return apply_context_parallel(model, topology, case["algorithm"], case.get("loss_tile", 0))

        losses, params, engine = engine_train(rank, world, _model(case["model"]), _config(case, cp, case["tile"], tp),
                                              _batches(case, world // (cp * tp)), prepare)
        if tp > 1:
            params = tp_gathered(engine, params)
        tiled = tiled_mlp_tokens(engine.module if hasattr(engine, "module") else engine.model)
        engine.close()
        out[name] = (losses, params, tiled)
    return out


_RESULTS: dict = {}


@pytest.mark.slow  # one 2-rank launch for the four cases: ~12 s on 2 shared cores
@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CASES))
def test_trains_as_one_process_trains_the_untiled_model(name):
    if not _RESULTS:
        _RESULTS.update(run_distributed(_rank, 2, timeout=150)[0])
    losses, params, tiled = _RESULTS[name]
    case = CASES[name]
    assert tiled == case["tile"], "wrap() tiled the model's MLPs"
    dp = 2 // (case["cp"] * case.get("tp", 1))
    oracle = Oracle.run(reference_train, _model(case["model"]), _config(case, 1, 0), _batches(case, dp))
    oracle.check(losses, params, name)


# -- the estimate ---------------------------------------------------------------------------

TALL = dict(n_layers=2, hidden=64, n_heads=4, seq_len=1024, bias=False)


def _estimate(dims, **layout) -> dict[str, int]:
    from tiertrain.estimate import estimate
    from tiertrain.estimate.layout import ZeroLayout

    return {line.name: line.bytes for line in estimate(dims, ZeroLayout(micro_batch=1, **layout)).lines}


def _live_peak(tile: int) -> int:
    """The most tensor bytes alive at once in one forward and backward of a GPT whose MLP
    intermediates dominate its activations (torch.profiler's allocator events)."""
    from torch.profiler import ProfilerActivity, profile

    model = apply_tiled_mlp(make_model(**TALL), tile)
    ids = global_batches(1, 1, seq_len=TALL["seq_len"])[0]
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        model(**ids).backward()
    events = sorted((e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in events:
        live += nbytes
        peak = max(peak, live)
    return peak


def test_the_estimate_drops_the_mlp_intermediates_as_the_measured_peak_does():
    """Tiles of 128 of 1024 tokens: no block keeps fc1's and GELU's outputs (2 blocks × 2 × 4h ×
    s × 4 bytes); the live-tensor peak falls by that within 5% (it is at the start of backward,
    where a block's backward holds one recomputed tile's intermediates besides)."""
    from tiertrain.estimate.dims import ModelDims

    dims = ModelDims(vocab=256, **TALL)
    whole, tiled = _estimate(dims, precision="fp32"), _estimate(dims, precision="fp32", mlp_tile_tokens=128)
    blocks = "activations (blocks)"
    assert whole[blocks] - tiled[blocks] == 2 * 2 * 4 * 64 * 1024 * 4
    assert _estimate(dims, precision="fp32", mlp_tile_tokens=1024) == whole, "a tile of the whole sequence: untiled"
    measured = _live_peak(0) - _live_peak(128)
    assert measured == pytest.approx(whole[blocks] - tiled[blocks], rel=0.05)


def test_the_estimate_tiles_a_context_parallel_ranks_tokens_and_hugging_face_mlps():
    from tiertrain.estimate.dims import ModelDims
    from tiertrain.estimate.modules import dims_of_hf_config

    dims = ModelDims(vocab=256, **TALL)
    blocks = "activations (blocks)"
    split = _estimate(dims, dp=1, cp=4, stage=3, precision="fp32")
    split_tiled = _estimate(dims, dp=1, cp=4, stage=3, precision="fp32", mlp_tile_tokens=128)
    assert split[blocks] - split_tiled[blocks] == 2 * 2 * 4 * 64 * (1024 // 4) * 4, "each rank's 256 tokens"
    assert _estimate(dims, dp=1, cp=4, stage=3, precision="fp32", mlp_tile_tokens=256) == split
    llama = dims_of_hf_config(zoo.build("llama-gqa").config, seq_len=1024)
    whole, tiled = _estimate(llama, precision="bf16"), _estimate(llama, precision="bf16", mlp_tile_tokens=64)
    assert whole[blocks] - tiled[blocks] == llama.n_layers * llama.mlp_saved_bytes(1024, 2)
