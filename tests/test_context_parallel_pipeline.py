"""Context parallelism composed with pipeline parallelism (issue 38, cp × pp): a model converted by
apply_context_parallel and cut into pipeline stages by wrap() trains as one process trains it on
the whole batch, within the float64 oracle, at pp = 2 × cp = 2 (4 ranks, dp = 1), with ring and
Ulysses attention, the 1F1B, GPipe and interleaved schedules, ZeRO stages 0 to 3 and the loss in
tiles; and at pp = 2 × cp = 2 × dp = 2 and × tp = 2 (8 ranks). The models: tiertrain's GPT, and
Hugging Face Llama (grouped-query attention; with tp, a vocabulary-parallel head) and Mistral (a
sliding window narrower than the sequence) cut by tiertrain/pipeline/hf_split.py.

Each stage's attention runs the cp algorithm over its cp group; the first stage embeds each
rank's tokens at their global positions; the activations passed between stages are each rank's
share of the sequence, sent to the rank of the same (dp, cp, tp) coordinates on the next stage; the
last stage's loss is the exact token mean over the cp group (-100 labels falling unevenly on
the cp ranks check that, and a mutation whose loss is each rank's own token mean must fail).
The reference GPT ties its embeddings, so the tied-weight exchange between the first and last
stage runs too (the Hugging Face models' heads are untied), and clipping (grad_clip small
enough to be active) checks the gradient norm over dp × cp and pp.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tiertrain
import zoo
from reference import Oracle, engine_train, global_batches, make_config, make_model, reference_train, tp_gathered
from tiertrain.parallel import apply_tensor_parallel, parallelize_module
from tiertrain.parallel.cp_plan import apply_context_parallel
from tiertrain.testing import run_distributed

LAYERS, MICRO, ACCUM, STEPS = 4, 2, 2, 3
PP, CP = 2, 2


def _config(case: dict, cp: int = CP, pp: int = PP):
    parallel = {"pp": pp, "cp": cp, "schedule": case.get("schedule", "1f1b"), "virtual_stages": case.get("v", 1)}
    if cp > 1:
        parallel.update(cp_algorithm=case["algorithm"], tp=case.get("tp", 1), dp=case.get("dp", 1))
    return make_config(zero={"stage": case["stage"], "bucket_mb": 0.02}, parallel=parallel,
                       activations={"loss_tile_tokens": case.get("loss_tile", 0) if cp > 1 else 0},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": ACCUM},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _model(case: dict):
    return zoo.build(case["hf"]) if "hf" in case else make_model(n_layers=LAYERS)


def _batches(case: dict):
    rows = MICRO * ACCUM * case.get("dp", 1)
    if "hf" in case:  # labels as transformers takes them (the tokens), shifted by the model's loss
        return zoo.batches(case["hf"], STEPS, rows)
    batches = global_batches(STEPS, rows)
    if case.get("ignored"):
        # -100 on an uneven share of each row's tokens and of each cp rank's (the zig-zag split
        # gives rank 0 tokens 0-3 and 12-15), but as many in every micro-batch: the engine's
        # mean over the micro-batches of their token means is then the batch's token mean.
        for b in batches:
            for row in range(b["labels"].shape[0]):
                b["labels"][row, : 3 + 5 * (row % MICRO)] = -100
    return batches


LLAMA_TP_PLAN = {"model.embed_tokens": "vocab", "model.layers.*.self_attn.[qkv]_proj": "colwise",
                 "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
                 "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise",
                 "lm_head": "colwise"}
"""A tensor-parallel plan with a vocabulary-parallel head (tiertrain.parallel.parallelize_module)."""

CASES = {
    "ring, 1f1b, stage 1": {"algorithm": "ring", "stage": 1},
    "ring, gpipe, stage 0, -100 labels": {"algorithm": "ring", "stage": 0, "schedule": "gpipe", "ignored": True},
    "ulysses, 1f1b, stage 0": {"algorithm": "ulysses", "stage": 0},
    "ulysses, gpipe, stage 1, -100 labels": {"algorithm": "ulysses", "stage": 1, "schedule": "gpipe",
                                             "ignored": True},
    "ring, 1f1b, stage 3": {"algorithm": "ring", "stage": 3},
    "ulysses, interleaved, stage 1": {"algorithm": "ulysses", "stage": 1, "schedule": "interleaved", "v": 2},
    "ring, 1f1b, stage 2, the loss in tiles of 3 tokens, -100 labels": {"algorithm": "ring", "stage": 2,
                                                                        "loss_tile": 3, "ignored": True},
    "llama, ring, 1f1b, stage 1": {"hf": "llama-gqa", "algorithm": "ring", "stage": 1},
    "llama, ulysses, gpipe, stage 3": {"hf": "llama-gqa", "algorithm": "ulysses", "stage": 3, "schedule": "gpipe"},
    "mistral sliding window, ring, 1f1b, stage 0": {"hf": "mistral-sliding-window", "algorithm": "ring", "stage": 0},
    "llama, ulysses, 1f1b, stage 2, the loss in tiles of 5 tokens": {"hf": "llama-gqa", "algorithm": "ulysses",
                                                                     "stage": 2, "loss_tile": 5},
    "dp 2, ring, 1f1b, stage 3, -100 labels": {"algorithm": "ring", "stage": 3, "dp": 2, "ignored": True},
    "tp 2, ring, 1f1b, stage 1, -100 labels": {"algorithm": "ring", "stage": 1, "tp": 2, "ignored": True},
    "tp 2, llama, ulysses, 1f1b, stage 1, vocab-parallel head": {"hf": "llama-gqa", "algorithm": "ulysses",
                                                                  "stage": 1, "tp": 2},
}
FAST = "ring, 1f1b, stage 1"
"""The one 4-rank case kept in the suite; the others run with CI's slow tests."""

MUTATION = "mutation: each rank's plain token mean, -100 labels"
"""The loss a naive split computes: each cp rank's mean over its own labelled tokens, which is
not the batch's token mean when the -100 labels fall unevenly on the ranks: the check must fail."""


def _prepare(case: dict):
    """Tensor parallelism first (when the case has tp), then context parallelism."""
    def prepare(model, topology):
        if case.get("tp") and "hf" in case:
            parallelize_module(model, topology.group("tp"), LLAMA_TP_PLAN)
        elif case.get("tp"):
            model = apply_tensor_parallel(model, topology)
        return apply_context_parallel(model, topology, case["algorithm"], case.get("loss_tile", 0))
    return prepare


def _layout(case: dict) -> tuple[int, int]:
    """(dp, tp) of the case (pp = cp = 2 always)."""
    return case.get("dp", 1), case.get("tp", 1)


def _coords(rank: int, dp: int, tp: int) -> tuple[int, int, int, int]:
    """(pp, dp, cp, tp) coordinates of a global rank (tp fastest, then cp, then dp, then pp)."""
    return rank // (dp * CP * tp), rank // (CP * tp) % dp, rank // tp % CP, rank % tp


def _rank(rank, world, names):
    from tiertrain.parallel import cp_plan

    out = {}
    for name in names:
        case = CASES[name.replace(MUTATION, "ring, gpipe, stage 0, -100 labels")]
        exact = cp_plan.exact_token_mean
        if name == MUTATION:
            cp_plan.exact_token_mean = lambda summed, labelled, group: summed / labelled
        try:
            losses, params, engine = engine_train(rank, world, _model(case), _config(case), _batches(case),
                                                  _prepare(case))
        finally:
            cp_plan.exact_token_mean = exact
        if case.get("tp"):  # (this rank's stage's parameters, gathered over tp)
            params = tp_gathered(engine, params)
        peers = [_coords(r, *_layout(case)) for r in engine.topology.ranks("pp")]
        out[name] = (losses, params, peers)
        engine.close()
    return out


def _check(results: list[dict], name: str) -> None:
    case = CASES[name.replace(MUTATION, "ring, gpipe, stage 0, -100 labels")]
    oracle = Oracle.run(reference_train, _model(case), _config(case, cp=1, pp=1), _batches(case))
    tied = {} if "hf" in case else {"head.weight": "embed.weight"}  # (the GPT's, the last stage's copy)
    seen = set()
    for rank, by_name in enumerate(results):
        losses, params, peers = by_name[name]
        # Activations go to the next stage's rank with the same (dp, cp, tp) coordinates.
        _, dp_coord, cp_coord, tp_coord = _coords(rank, *_layout(case))
        assert peers == [(pp, dp_coord, cp_coord, tp_coord) for pp in range(PP)], f"rank {rank}'s pp group: {peers}"
        oracle.check(losses, None, f"{name}, rank {rank}'s losses")
        if tied and set(tied) | set(tied.values()) <= set(params):  # the copy stayed equal to the embedding
            assert torch.equal(params["head.weight"], params["embed.weight"]), name
        oracle.check(None, params, f"{name}, rank {rank} (cp coordinate {cp_coord})", key=lambda n: tied.get(n, n))
        seen |= {tied.get(n, n) for n in params}
    assert seen == set(oracle.params64), name


def _results(names: list[str], dp: int = 1, tp: int = 1) -> list[dict]:
    return run_distributed(_rank, PP * CP * dp * tp, names, timeout=150 * dp * tp)


@pytest.mark.timeout(120)
def test_ring_1f1b_stage_1_trains_as_one_process():
    _check(_results([FAST]), FAST)


_SLOW: dict = {}


def _slow_results(layout: tuple[int, int]) -> list[dict]:
    """Every slow case of the (dp, tp) layout, in one launch the first time one is asked for."""
    if layout not in _SLOW:
        names = [n for n, c in CASES.items() if n != FAST and _layout(c) == layout]
        _SLOW[layout] = _results(names + ([MUTATION] if layout == (1, 1) else []), *layout)
    return _SLOW[layout]


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("name", [n for n in CASES if n != FAST])
def test_trains_as_one_process_on_the_whole_batch(name):
    """pp = 2 × cp = 2 (4 ranks), and × dp = 2 or × tp = 2 (8 ranks) for the cases with those."""
    _check(_slow_results(_layout(CASES[name])), name)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_the_check_fails_a_loss_that_is_each_ranks_own_token_mean():
    with pytest.raises(AssertionError, match="from the float64 reference"):
        _check(_slow_results((1, 1)), MUTATION)


def _grid(pp: int, cp: int) -> tiertrain.Topology:
    """A one-process topology that reports pp pipeline and cp context-parallel ranks (for the
    checks made before any collective)."""
    topology = tiertrain.Topology.build()
    return dataclasses.replace(topology, sizes={"pp": pp, "dp": 1, "cp": cp, "tp": 1})


def test_a_pipeline_refuses_a_model_not_converted_for_context_parallelism():
    ring = {"algorithm": "ring", "stage": 1}
    for model in (make_model(n_layers=LAYERS), zoo.build("llama-gqa")):
        with pytest.raises(tiertrain.ConfigError, match="parallel.cp=2, but the model is not context-parallel: "
                                                        "convert it with .*apply_context_parallel"):
            tiertrain.wrap(model, _config(ring), _grid(2, 2))


def _split_tiled_vocab_parallel(rank, world):
    """A Llama with a vocabulary-parallel head (tp = 2), converted for cp = 2 with the loss in
    tiles, cut into 2 stages: refused (the topology reports cp = 2 before any cp exchange)."""
    from tiertrain.parallel.context import ContextParallelError
    from tiertrain.pipeline.hf_split import split_hf

    topology = tiertrain.Topology.build(tiertrain.config.ParallelConfig(tp=2))
    model = parallelize_module(zoo.build("llama-gqa"), topology.group("tp"), LLAMA_TP_PLAN)
    apply_context_parallel(model, dataclasses.replace(topology, sizes={**topology.sizes, "cp": 2}), "ring",
                           loss_tile_tokens=4)
    try:
        split_hf(model, 2)
    except ContextParallelError as e:
        return str(e)
    return None


@pytest.mark.timeout(60)
def test_the_loss_in_tiles_with_a_vocabulary_parallel_head_is_refused_in_a_pipeline():
    for message in run_distributed(_split_tiled_vocab_parallel, 2, timeout=50):
        assert message is not None and "loss_tile_tokens=4 with a vocabulary-parallel lm_head" in message, message
