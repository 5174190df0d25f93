"""Evaluation under pipeline parallelism: ``PipelineEngine.evaluate_each(micro_batches)`` runs
the forward-only schedule (Megatron's ``forward_only``, DeepSpeed's ``eval_batch``) and gives
every pipeline rank each micro-batch's loss, as the single-process model in eval mode gives it.

Each run (tiertrain's GPT; Llama, GPT-2, T5 and BERT cut by hf_split) evaluates held-out
micro-batches before its first step and after each step: the evaluation losses and the training
around them are the reference's (float64 oracle of tests/reference.py), so evaluating changes no
parameter, gradient or optimizer state. Every dropout module is raised to 0.5 around each
evaluation: the losses match the reference only if the stages really are in eval mode, and
after it they are back in training mode.
"""
from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import tiertrain
from reference import (Oracle, _floats_to, global_batches, make_config, make_model, rank_slices, reference_train,
                       tp_gathered)
from tiertrain.engine_contract import default_loss
from tiertrain.parallel import apply_tensor_parallel
from tiertrain.pipeline.schedule import (Action, ActionKind, Schedule, bubble_fraction, forward_only, ideal_bubble,
                                         timeline, validate)
from tiertrain.testing import run_distributed

LAYERS = 4
MICRO, ACCUM, STEPS, EVAL = 2, 4, 2, 3
"""Rows per micro-batch, micro-batches per step, steps, held-out micro-batches per dp rank."""


def _config(stage, dp, tp, pp, schedule="1f1b", v=1):
    return make_config(zero={"stage": stage, "bucket_mb": 0.02},
                       parallel={"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, "virtual_stages": v},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": ACCUM},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _model(name):
    if name == "gpt":
        return make_model(n_layers=LAYERS)
    import hf_pipeline_models
    return getattr(hf_pipeline_models, name)()


def _as(name, batches):
    """tiertrain's batches in the model's own convention (tests/hf_pipeline_models.py)."""
    from hf_pipeline_models import T5_TARGET, hf_convention, mlm
    if name in ("llama", "gpt2"):
        return hf_convention(batches)
    if name == "t5":  # a decoder shorter than the encoder
        return [{"input_ids": b["input_ids"], "labels": b["labels"][:, :T5_TARGET].contiguous()} for b in batches]
    return [mlm(b) for b in batches] if name == "bert" else batches


def _train(name, dp):
    return _as(name, global_batches(STEPS, MICRO * ACCUM * dp))


def _held_out(name, dp):
    """EVAL × dp micro-batches; dp rank r evaluates micro-batches r, r + dp, ..."""
    whole = global_batches(1, EVAL * dp * MICRO, seed=7)[0]
    return _as(name, [{k: v[j * MICRO:(j + 1) * MICRO] for k, v in whole.items()} for j in range(EVAL * dp)])


@contextlib.contextmanager
def _dropout(module, p):
    """Every dropout of module at p for the block (what eval mode must switch off)."""
    drops = [m for m in module.modules() if isinstance(m, torch.nn.Dropout)]
    for m in drops:
        m.p = p
    try:
        yield
    finally:
        for m in drops:
            m.p = 0.0


def _reference(model, config, batches, held_out):
    """Each step's loss, then before the first step and after each the held-out micro-batches'
    losses in eval mode."""
    evals = []
    for k in range(len(batches) + 1):
        losses, params = reference_train(model, config, batches[:k])
        trained = copy.deepcopy(model)
        trained.load_state_dict(params, strict=False)
        trained.eval()
        dtype = next(trained.parameters()).dtype
        with torch.no_grad():
            evals += [default_loss(trained, _floats_to(b, dtype)).item() for b in held_out]
    return losses + evals, params


def _run(rank, world, cases):
    results = []
    for name, stage, dp, tp, pp, schedule, v in cases:
        config = _config(stage, dp, tp, pp, schedule, v)
        topology = tiertrain.Topology.build(config.parallel)
        model = _model(name)
        if tp > 1:
            model = apply_tensor_parallel(model, topology)
        engine = tiertrain.wrap(model, config, topology)
        d = topology.coord("dp")
        mine = _held_out(name, dp)[d::dp]
        losses, evals = [], {}
        for batch in [None] + _train(name, dp):
            if batch is not None:
                loss = engine.train_batch(rank_slices(batch, d, dp, MICRO, ACCUM))
                total = torch.tensor([loss], dtype=torch.float64)
                torch.distributed.all_reduce(total, group=topology.group("dp"))
                losses.append(float(total) / dp)
            with _dropout(engine.module, 0.5):
                got = engine.evaluate_each(mine)
            assert engine.module.training and all(s.training for s in engine.stages)
            one = engine.evaluate(mine[-1])  # (one micro-batch alone through the stages)
            assert one.shape == () and float(one) == got[-1]
            for j, value in enumerate(got):
                evals.setdefault(len(losses), {})[j * dp + d] = value
        results.append((losses, evals, tp_gathered(engine, engine.full_state_dict())))
        engine.close()
    return results


def _check(results, cases):
    from hf_pipeline_models import TIED
    tied = {**TIED, "gpt": ("embed.weight", "head.weight")}
    for k, case in enumerate(cases):
        name, stage, dp = case[:3]
        oracle = Oracle.run(_reference, _model(name), _config(stage, 1, 1, 1), _train(name, dp), _held_out(name, dp))
        merged, evals = {}, {}
        for rank_results in results:
            losses, rank_evals, params = rank_results[k]
            oracle.check(losses, None, f"{case} training losses")
            for step, values in rank_evals.items():
                for j, value in values.items():
                    assert evals.setdefault((step, j), value) == value, "every pipeline rank has the same loss"
            merged.update(params)
        assert sorted(evals) == [(s, j) for s in range(STEPS + 1) for j in range(EVAL * dp)]
        oracle.check(losses + [evals[key] for key in sorted(evals)], None, f"{case} evaluation losses")
        if name in tied:  # (the last stage's copy of a tied embedding)
            first, last = tied[name]
            assert torch.equal(merged.pop(last), merged[first]), case
        oracle.check(None, merged, f"{case} parameters")


TWO_RANK_CASES = [("gpt", 0, 1, 1, 2, "1f1b", 1), ("gpt", 1, 1, 1, 2, "gpipe", 1),
                  ("gpt", 2, 1, 1, 2, "interleaved", 2), ("gpt", 3, 1, 1, 2, "1f1b", 1),
                  ("gpt", 3, 1, 1, 2, "interleaved", 2)]
"""(model, zero stage, dp, tp, pp, schedule, virtual stages)."""


@pytest.mark.timeout(150)
def test_pipeline_evaluation_is_the_single_process_models_in_eval_mode():
    _check(run_distributed(_run, 2, TWO_RANK_CASES, timeout=140), TWO_RANK_CASES)


HF_CASES = [("llama", 1, 1, 1, 2, "1f1b", 1), ("gpt2", 2, 1, 1, 2, "interleaved", 2),
            ("t5", 1, 1, 1, 2, "1f1b", 1), ("bert", 3, 1, 1, 2, "1f1b", 1)]


@pytest.mark.timeout(150)
def test_hugging_face_models_split_into_a_pipeline_evaluate_as_in_one_process():
    """Their own losses: a causal LM's (labels shifted inside), T5's (the encoder's output
    carried to the decoder stages), BERT's masked-LM loss; tied heads at both ends."""
    pytest.importorskip("transformers")
    _check(run_distributed(_run, 2, HF_CASES, timeout=140), HF_CASES)


FOUR_RANK_CASES = [("gpt", 3, 2, 1, 2, "1f1b", 1), ("gpt", 1, 1, 2, 2, "1f1b", 1)]


@pytest.mark.timeout(150)
def test_pipeline_evaluation_with_data_and_tensor_parallelism():
    """dp = 2 (each stage's ranks evaluate their own micro-batches; at stage 3 they gather each
    block together) and tp = 2 (the boundary tensors sent as 1/t pieces and all-gathered)."""
    _check(run_distributed(_run, 4, FOUR_RANK_CASES, timeout=140), FOUR_RANK_CASES)


def _misuse(rank, world):
    config = _config(2, 1, 1, 2)
    engine = tiertrain.wrap(make_model(n_layers=LAYERS), config, tiertrain.Topology.build(config.parallel))
    refused = []
    for bad in ([], _held_out("gpt", 1)[0], iter(_held_out("gpt", 1))):
        try:
            engine.evaluate_each(bad)
        except ValueError as e:
            refused.append(str(e))
    batch = global_batches(1, MICRO * ACCUM)[0]
    loss = engine.train_batch(rank_slices(batch, 0, 1, MICRO, ACCUM))  # (a refused call leaves it training)
    return refused, loss


@pytest.mark.timeout(60)
def test_a_bad_argument_is_refused_and_the_engine_trains_on():
    for refused, loss in run_distributed(_misuse, 2, timeout=45):
        assert len(refused) == 3
        assert "non-empty list of micro-batches (every one is evaluated in one schedule), got list (empty)" in \
            refused[0]
        assert "got dict" in refused[1] and "evaluate(batch)" in refused[1]
        assert "got list_iterator" in refused[2] and "itertools.islice" in refused[2]
        assert loss == loss


# -- the schedule ---------------------------------------------------------------------------

@pytest.mark.parametrize("p,m,v", [(2, 4, 1), (4, 8, 1), (2, 4, 2), (4, 8, 2), (4, 4, 3), (2, 3, 2)])
def test_the_forward_only_schedule_runs_each_forward_once_with_the_interleaved_bubble(p, m, v):
    """With m ≥ p micro-batches: each rank's m·v forwards back to back after p - 1 slots of
    fill, the bubble (p-1)/(m·v) of interleaved 1F1B."""
    schedule = validate(forward_only(p, m, v))
    assert not schedule.with_backward
    assert all(a.kind is ActionKind.FORWARD for rank in schedule.ranks for a in rank)
    assert sum(map(len, schedule.ranks)) == p * m * v
    tl = timeline(schedule, 1, 2)
    assert tl.makespan == m * v + p - 1
    assert bubble_fraction(tl) == pytest.approx(ideal_bubble(p, m, v))


def test_a_forward_only_schedule_with_a_backward_is_refused():
    good = forward_only(2, 1)
    bad = Schedule("bad", 2, 1, 1, (good.ranks[0] + (Action(ActionKind.BACKWARD, 0, 0),), good.ranks[1]),
                   with_backward=False)
    with pytest.raises(ValueError, match=r"lists B0 in a forward-only schedule"):
        validate(bad)
    missing = Schedule("missing", 2, 1, 1, (good.ranks[0], ()), with_backward=False)
    with pytest.raises(ValueError, match=r"never runs \[\('F', 0, 1\)\]"):
        validate(missing)
    backwards = Schedule("training", 2, 1, 1, good.ranks)  # (with_backward: the backwards are missing)
    with pytest.raises(ValueError, match="never runs"):
        validate(backwards)
