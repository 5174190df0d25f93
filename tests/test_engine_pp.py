"""Pipeline parallelism composed with the engine (Megatron PTD-P with ZeRO over dp): any
dp × tp × pp grid trains like one process.

``tiertrain.wrap`` splits the GPT into pp × v stages and returns a PipelineEngine; each
step runs grad_accum_steps micro-batches through the schedule. Losses and the parameters
gathered from every stage must equal the single-process run on the whole global batch
(fp32 within the float64 oracle's bound of tests/reference.py; AdamW eps=1e-3 as in
test_engine for the reasons given there). The reference GPT ties its embeddings, so every
run also checks the tied-weight exchange between the first and last stage, and clipping
(grad_clip is small enough to be active) checks the norm over dp, tp and pp.
"""
from __future__ import annotations

import pytest
import torch

import tiertrain
from reference import (Oracle, engine_train, global_batches, make_config, make_model, rank_slices, reference_train,
                       tp_gathered)
from tiertrain.config import ConfigError
from tiertrain.parallel import apply_tensor_parallel
from tiertrain.testing import RankFailure, run_distributed

LAYERS = 4
MICRO, ACCUM, STEPS = 2, 4, 3


def _config(stage, dp, tp, pp, schedule="1f1b", v=1, dtype="fp32", activations=None):
    return make_config(zero={"stage": stage, "bucket_mb": 0.02}, activations=activations or {},
                       parallel={"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, "virtual_stages": v},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": ACCUM},
                       precision={"dtype": dtype},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _batches(dp):
    return global_batches(STEPS, MICRO * ACCUM * dp)


def _run(rank, world, cases):
    results = []
    for stage, dp, tp, pp, schedule, v, dtype in cases:
        prepare = (lambda m, topo: apply_tensor_parallel(m, topo)) if tp > 1 else None
        losses, local, engine = engine_train(rank, world, make_model(n_layers=LAYERS),
                                             _config(stage, dp, tp, pp, schedule, v, dtype), _batches(dp), prepare)
        results.append((losses, tp_gathered(engine, local), engine.topology.coord("pp"),
                        engine.executor.stats["max_in_flight"]))
    return results


def _check(results, cases):
    for k, (stage, dp, tp, pp, schedule, v, dtype) in enumerate(cases):
        oracle = Oracle.run(reference_train, make_model(n_layers=LAYERS), _config(stage, 1, 1, 1), _batches(dp))
        merged = {}
        for rank_results in results:
            losses, params, _, _ = rank_results[k]
            oracle.check(losses, None, f"{cases[k]} losses")
            merged.update(params)
        # The last stage's copy of the tied embedding stayed equal to the embedding.
        assert torch.equal(merged.pop("head.weight"), merged["embed.weight"]), cases[k]
        assert set(merged) == set(oracle.params64)
        oracle.check(None, merged, f"{cases[k]} parameters")


PP2_CASES = [(0, 1, 1, 2, "1f1b", 1, "fp32"), (1, 1, 1, 2, "gpipe", 1, "fp32"), (2, 1, 1, 2, "1f1b", 1, "fp32"),
             (2, 1, 1, 2, "interleaved", 2, "fp32"), (1, 1, 1, 2, "interleaved", 2, "fp32")]


@pytest.mark.timeout(150)
def test_pp2_every_zero_stage_and_schedule_matches_single_process():
    _check(run_distributed(_run, 2, PP2_CASES, timeout=140), PP2_CASES)


GRID_CASES = {
    "dp2_pp2": [(1, 2, 1, 2, "1f1b", 1, "fp32"), (2, 2, 1, 2, "interleaved", 2, "fp32")],
    "tp2_pp2": [(0, 1, 2, 2, "1f1b", 1, "fp32"), (2, 1, 2, 2, "1f1b", 1, "fp32")],
    "pp4": [(2, 1, 1, 4, "1f1b", 1, "fp32")],
}


@pytest.mark.timeout(150)
@pytest.mark.parametrize("grid", sorted(GRID_CASES))
def test_four_rank_grids_match_single_process(grid):
    cases = GRID_CASES[grid]
    _check(run_distributed(_run, 4, cases, timeout=140), cases)


def _scatter_gather(rank, world):
    """tp=2, pp=2: the same steps with Megatron's scatter/gather of the boundary tensors and
    without; the bytes each rank sends and what it trains."""
    out = {}
    for scattered in (True, False):
        prepare = lambda m, topo: apply_tensor_parallel(m, topo)  # noqa: E731
        cfg = _config(1, 1, 2, 2)
        topology = tiertrain.Topology.build(cfg.parallel)
        engine = tiertrain.wrap(prepare(make_model(n_layers=LAYERS), topology), cfg, topology)
        assert engine.executor.scatter_gather  # (on by default at tp > 1 without sequence parallelism)
        engine.executor.scatter_gather = scattered
        sent, losses = 0, []
        for batch in _batches(1):
            losses.append(engine.train_batch(rank_slices(batch, 0, 1, MICRO, ACCUM)))
            sent += engine.executor.stats["bytes_sent"]
        out[scattered] = (sent, losses, tp_gathered(engine, engine.full_state_dict()))
        engine.close()
    return out


@pytest.mark.timeout(120)
def test_scatter_gather_sends_half_the_bytes_at_tp2_and_trains_the_same():
    """Megatron PTD-P §4.1: each tensor-parallel rank sends 1/t of the boundary activation (and
    of its gradient), the receiving stage all-gathers: the point-to-point bytes fall to 1/t,
    the training is unchanged bit for bit (the pieces reassemble the same tensor)."""
    seq = _batches(1)[0]["input_ids"].shape[1]
    micro_bytes = MICRO * seq * 32 * 4  # (micro-batch, seq, hidden) fp32: one boundary tensor
    for by_rank in run_distributed(_scatter_gather, 4, timeout=110):
        (sent, losses, params), (sent_whole, losses_whole, params_whole) = by_rank[True], by_rank[False]
        assert sent_whole == STEPS * ACCUM * micro_bytes  # one tensor per micro-batch each way per rank
        assert sent == sent_whole // 2
        assert losses == losses_whole
        assert all(torch.equal(params[n], params_whole[n]) for n in params)


def _checkpointed(rank, world):
    cfg = _config(2, 1, 1, 2, activations={"checkpoint_every": 1, "offload": "cpu"})
    losses, local, engine = engine_train(rank, world, make_model(n_layers=LAYERS), cfg, _batches(1))
    return losses, local, engine.memory_report().activation_checkpoints_cpu


@pytest.mark.timeout(90)
def test_activation_checkpointing_in_the_pipeline_matches_single_process():
    results = run_distributed(_checkpointed, 2, timeout=80)
    oracle = Oracle.run(reference_train, make_model(n_layers=LAYERS), _config(2, 1, 1, 1), _batches(1))
    merged = {}
    for losses, params, host_bytes in results:
        oracle.check(losses, None, "checkpointed pipeline losses")
        assert host_bytes > 0  # each stage's block inputs went to the CPU tier
        merged.update(params)
    merged.pop("head.weight")
    oracle.check(None, merged, "checkpointed pipeline parameters")


def test_one_f_one_b_engine_holds_at_most_p_micro_batches():
    """The engine runs 1F1B as scheduled: at most p micro-batches' activations at once
    (GPipe holds all m)."""
    results = run_distributed(_run, 2, [(0, 1, 1, 2, "1f1b", 1, "fp32"), (0, 1, 1, 2, "gpipe", 1, "fp32")],
                              timeout=100)
    for rank_results in results:
        (_, _, _, one_f_one_b), (_, _, _, gpipe) = rank_results
        assert one_f_one_b <= 2 and gpipe == ACCUM


@pytest.mark.timeout(120)
def test_bf16_pipeline_tracks_the_fp32_reference():
    cases = [(2, 1, 1, 2, "1f1b", 1, "bf16")]
    results = run_distributed(_run, 2, cases, timeout=100)
    ref_losses, _ = reference_train(make_model(n_layers=LAYERS), _config(2, 1, 1, 1), _batches(1))
    for rank_results in results:
        losses = rank_results[0][0]
        assert max(abs(a - b) / b for a, b in zip(losses, ref_losses)) <= 2e-2


def _fp16_overflow(rank, world):
    cfg = _config(2, 1, 1, 2, dtype="fp16")
    topology = tiertrain.Topology.build(cfg.parallel)
    engine = tiertrain.wrap(make_model(n_layers=LAYERS), cfg, topology)
    before = engine.full_state_dict()
    batch = _batches(1)[0]
    engine.scaler.state.scale = 2.0**60  # overflows fp16 in the backward of some stage
    engine.train_batch(rank_slices(batch, 0, 1, MICRO, ACCUM))
    unchanged = all(torch.equal(before[k], v) for k, v in engine.full_state_dict().items())
    engine.scaler.state.scale = 2.0**10
    engine.train_batch(rank_slices(batch, 0, 1, MICRO, ACCUM))
    return engine.skipped_steps, unchanged, engine.steps


@pytest.mark.timeout(90)
def test_fp16_overflow_on_any_stage_skips_the_step_on_every_stage():
    for skipped, unchanged, steps in run_distributed(_fp16_overflow, 2, timeout=80):
        assert (skipped, unchanged, steps) == (1, True, 1)


SPLIT = 2


def _resume(rank, world, directory, resume):
    cfg = _config(2, 2, 1, 2)
    topology = tiertrain.Topology.build(cfg.parallel)
    engine = tiertrain.wrap(make_model(seed=1 if resume else 0, n_layers=LAYERS), cfg, topology)
    batches = global_batches(4, MICRO * ACCUM * 2)
    if resume:
        engine.load_checkpoint(directory)
        batches = batches[SPLIT:]
    losses = []
    for i, batch in enumerate(batches):
        losses.append(engine.train_batch(rank_slices(batch, topology.coord("dp"), 2, MICRO, ACCUM)))
        if not resume and i + 1 == SPLIT:
            engine.save_checkpoint(directory)
    return losses, engine.full_state_dict()


@pytest.mark.timeout(150)
def test_resume_at_the_same_layout_is_bit_identical(tmp_path):
    full = run_distributed(_resume, 4, str(tmp_path), False, timeout=70)
    resumed = run_distributed(_resume, 4, str(tmp_path), True, timeout=70)
    for (full_losses, full_params), (losses, params) in zip(full, resumed):
        assert losses == full_losses[SPLIT:]
        assert all(torch.equal(params[k], full_params[k]) for k in full_params)


def _bad(rank, world, what):
    cfg = _config(2, 1, 1, 2)
    engine = tiertrain.wrap(make_model(n_layers=LAYERS), cfg, tiertrain.Topology.build(cfg.parallel))
    engine(global_batches(1, 2)[0])


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what,message", [
    ("call", r"use engine.train_batch"),
])
def test_bad_use_is_a_clear_error(what, message):
    with pytest.raises(RankFailure, match=message):
        run_distributed(_bad, 2, what, timeout=40)


def _micro_batch_arguments(rank, world):
    cfg = _config(1, 1, 1, 2)
    micro = list(rank_slices(global_batches(1, MICRO * ACCUM)[0], 0, 1, MICRO, ACCUM))
    out = {}
    for kind in ("iterator", "list"):
        engine = tiertrain.wrap(make_model(n_layers=LAYERS), cfg, tiertrain.Topology.build(cfg.parallel))
        for what, batches in (("short list", micro[:-1]), ("one dict", micro[0]), ("exhausted", iter([])),
                              ("partial", iter(micro[:-1]))):
            try:
                engine.train_batch(batches)
            except (TypeError, ValueError, StopIteration) as e:
                out[what] = f"{type(e).__name__}: {e}"
        out[kind] = (engine.steps, engine.train_batch(iter(micro) if kind == "iterator" else micro),
                     engine.full_state_dict())
        engine.close()
    return out


@pytest.mark.timeout(60)
def test_train_batch_takes_an_iterator_or_a_list_of_one_steps_micro_batches():
    """DeepSpeed's train_batch(data_iter) takes the next grad_accum_steps micro-batches of an
    iterator; a list of exactly that many trains the same (it raised "'list' object is not an
    iterator"). Anything else is refused before the schedule runs, naming it: a list of another
    length, one micro-batch's dict, an iterator that runs out partway (its micro-batches would
    be dropped); an exhausted one ends the data with StopIteration, as DeepSpeed's does."""
    for out in run_distributed(_micro_batch_arguments, 2, timeout=45):
        (steps, loss, params), (steps_list, loss_list, params_list) = out["iterator"], out["list"]
        assert steps == steps_list == 0, "nothing refused stepped"
        assert loss == loss_list and all(torch.equal(params[k], params_list[k]) for k in params)
        assert out["short list"].startswith("ValueError") and f"grad_accum_steps={ACCUM}" in out["short list"]
        assert out["short list"].endswith(f"got {ACCUM - 1} (or pass an iterator: train_batch takes the next {ACCUM})")
        assert out["one dict"].startswith("TypeError") and "got dict" in out["one dict"]
        assert out["exhausted"] == "StopIteration: "
        assert out["partial"].startswith("ValueError") and f"ran out after {ACCUM - 1} of" in out["partial"]


def _composition(rank, world):
    """Build a stage-3 pipeline engine, counting the one-model parameter fetchers built on
    the way (engine_build's ParameterFetcher: it would hook modules, agree collectives and
    be told of each reduction, all for a forward-then-backward a schedule never runs)."""
    from tiertrain import engine_build
    from tiertrain.training_core import TrainingCore

    built, original = [], engine_build.ParameterFetcher

    def counting(*args, **kwargs):
        built.append(args[2])
        return original(*args, **kwargs)

    cfg = _config(3, 1, 1, 2)
    engine_build.ParameterFetcher = counting
    try:
        engine = tiertrain.wrap(make_model(n_layers=LAYERS), cfg, tiertrain.Topology.build(cfg.parallel))
    finally:
        engine_build.ParameterFetcher = original
    refused = {}
    for name, call in (("call", lambda: engine(None)), ("forward", lambda: engine.forward(None)),
                       ("backward", lambda: engine.backward(None))):
        try:
            call()
        except TypeError as e:
            refused[name] = str(e)
    loss = engine.train_batch(iter(rank_slices(global_batches(1, MICRO * ACCUM)[0], 0, 1, MICRO, ACCUM)))
    return dict(built=len(built), fetcher=engine.fetcher, pipeline_fetcher=engine.pipeline_fetcher is not None,
                core=isinstance(engine, TrainingCore), one_model=isinstance(engine, tiertrain.Engine),
                refused=refused,
                steps=engine.steps, loss=loss)


@pytest.mark.timeout(60)
def test_the_pipeline_engine_is_the_core_plus_its_schedule():
    """Issue 33: the pipeline engine is built on the training core, not on the one-model
    engine: at stage 3 no one-model parameter fetcher is ever built (none built and then
    removed, so the reducer reports to none), and the one-model contract's calls are refused
    naming train_batch, while train_batch steps (evaluate: tests/test_pipeline_evaluate.py)."""
    for out in run_distributed(_composition, 2, timeout=45):
        assert out["built"] == 0 and out["fetcher"] is None and out["pipeline_fetcher"]
        assert out["core"] and not out["one_model"]
        assert set(out["refused"]) == {"call", "forward", "backward"}
        assert all("use engine.train_batch" in out["refused"][k] for k in ("call", "forward", "backward"))
        assert out["steps"] == 1 and out["loss"] == out["loss"]


def test_virtual_stages_need_the_interleaved_schedule():
    with pytest.raises(ConfigError, match=r"parallel.virtual_stages=2 is invalid.*schedule='interleaved'"):
        _config(1, 1, 1, 2, schedule="1f1b", v=2)


def _full_state_dict_at_pp2(rank, world):
    cfg = _config(1, 1, 1, 2, "1f1b", 1, "fp32")
    topology = tiertrain.Topology.build(cfg.parallel)
    model = make_model(n_layers=LAYERS)
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = tiertrain.wrap(model, cfg, topology)
    return sorted(engine.full_state_dict()), sorted(expected), sorted(engine.flat.params)


@pytest.mark.timeout(60)
def test_full_state_dict_under_pipeline_parallelism_is_the_whole_model():
    """Issue 34, item 10: it returned only the local stage's parameters (19 of 39 tensors for a
    4-layer Llama at pp = 2), where every other layout gives the whole model."""
    for names, expected, local in run_distributed(_full_state_dict_at_pp2, 2, timeout=45):
        assert names == expected and len(local) < len(expected)
