"""Pipeline parallelism × ZeRO stage 3 (issue 19, item 2): at (dp, tp, pp) = (2, 1, 2) each
pipeline stage's parameters are partitioned over its two data-parallel ranks, kept on the CPU
tier (optimizer too), and gathered per block inside the 1F1B and interleaved schedules
(tiertrain/pipeline/zero3.py). Losses and the parameters gathered from every stage equal the
single-process reference within the float64 oracle's bound (tests/reference.py), for
tiertrain's GPT (tied embeddings: the exchange between first and last stage runs on the
accumulated flat gradients) and Hugging Face models split by hf_split (Llama with GQA, tied
GPT-2, tied T5 encoder-decoder, BERT masked-LM encoder with its tied head); between steps
every rank holds only its 1/dp shard of each block, and each block is gathered once for each
micro-batch's forward and once for its backward. The NVMe tier (parameters and optimizer) is
checked once too.
"""
from __future__ import annotations

import pytest
import torch

from hf_pipeline_models import CAUSAL_LMS, T5_TARGET, TIED as HF_TIED, bert, gpt2, hf_convention, llama, mlm, t5
from reference import Oracle, engine_train, global_batches, make_config, make_model, reference_train
from tiertrain.testing import run_distributed

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the references: see conftest.py

MICRO, ACCUM, STEPS = 2, 4, 2
GPT_LAYERS = 6
TIED = {**HF_TIED, "gpt": ("embed.weight", "head.weight")}


def _config(stage, dp, pp, schedule="1f1b", v=1, nvme_path=None):
    zero = {"stage": stage, "bucket_mb": 0.02}
    if stage == 3 and nvme_path is None:
        zero.update(offload_params="cpu", offload_optimizer="cpu")
    elif stage == 3:
        zero.update(offload_params="nvme", offload_optimizer="nvme", nvme_path=nvme_path)
    return make_config(zero=zero, parallel={"dp": dp, "tp": 1, "pp": pp, "schedule": schedule, "virtual_stages": v},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": ACCUM},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _gpt():
    return make_model(n_layers=GPT_LAYERS)


MODELS = {"gpt": _gpt, "llama": llama, "gpt2": gpt2, "t5": t5, "bert": bert}

CASES = [("gpt", "1f1b", 1), ("gpt", "interleaved", 2), ("llama", "1f1b", 1), ("llama", "interleaved", 2),
         ("gpt2", "1f1b", 1), ("t5", "interleaved", 2), ("bert", "1f1b", 1)]
"""tiertrain's GPT (tied), a GQA decoder (Llama, untied), a tied decoder (GPT-2), an
encoder-decoder (T5, tied; position biases carried between stages), a masked-LM encoder
(BERT, tied; labels aligned with the inputs, -100 where not predicted)."""


def _batches(dp, name="gpt"):
    batches = global_batches(STEPS, MICRO * ACCUM * dp)
    if name == "t5":  # a decoder shorter than the encoder; decoder inputs built from the labels
        return [{"input_ids": b["input_ids"], "labels": b["labels"][:, :T5_TARGET].contiguous()} for b in batches]
    if name == "bert":  # a quarter of each row masked and predicted, token types 0 then 1
        return [mlm(b) for b in batches]
    if name in CAUSAL_LMS:  # labels = input_ids: the model's own loss shifts them
        return hf_convention(batches)
    return batches


def _at_rest(engine):
    """What this rank holds of its stages' parameters between steps."""
    flat, fetcher = engine.flat, engine.pipeline_fetcher
    units = [u for u in flat.all_units if not u.unit.resident]  # (with a middle chunk's empty root)
    used = sum(len(chunk) for chunk in fetcher.chunks)  # the units with parameters
    report = engine.memory_report()
    element = flat.dtype.itemsize
    whole = sum(u.unit.padded_numel for u in units) * element
    return dict(
        partitioned_bytes=whole,
        params_bytes=report.params,
        gathered_bytes=report.gathered_params,
        cpu_tier=report.cpu_tier,
        any_gathered=any(u.gathered for u in units),
        storage=sum(p.untyped_storage().size() for s in engine.stages for p in s.parameters()),
        shards_ok=all(u.shard.numel() * engine.dp == u.unit.padded_numel and u.shard.device.type == "cpu"
                      for u in units),
        gathers=fetcher.gathers,
        expected_gathers=2 * ACCUM * STEPS * used,  # forward and backward of every micro-batch
        peak=flat.peak_gathered_bytes,
        chunk_bytes=max(sum(flat.all_units[i].full.numel() for i, _ in chunk) * element for chunk in fetcher.chunks),
        per_block_bound=max(_largest_two(flat, chunk) for chunk in fetcher.chunks) * element,
    )


def _largest_two(flat, chunk):
    """A chunk's first unit (its root, when it has one) and its two largest blocks: at most what
    per-block gathering holds at once (a block's backward may begin before the next one's
    parameter gradients have all landed)."""
    sizes = [flat.all_units[i].full.numel() for i, _ in chunk]
    return sizes[0] + sum(sorted(sizes[1:])[-2:])


def _run(rank, world, cases):
    out = []
    for name, schedule, v in cases:
        losses, params, engine = engine_train(rank, world, MODELS[name](), _config(3, 2, 2, schedule, v),
                                              _batches(2, name))
        out.append((losses, params, _at_rest(engine)))
        engine.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_dp2_pp2_zero3_cpu_tier_matches_single_process_and_stays_partitioned():
    results = run_distributed(_run, 4, CASES, timeout=140)
    for k, case in enumerate(CASES):
        name = case[0]
        oracle = Oracle.run(reference_train, MODELS[name](), _config(2, 1, 1), _batches(2, name))
        merged = {}
        for losses, params, rest in (r[k] for r in results):
            oracle.check(losses, None, f"(2,1,2) zero-3 {case} losses")
            merged.update(params)
            # Between steps: only this rank's 1/dp shard of every block, on the CPU tier.
            assert not rest["any_gathered"] and rest["gathered_bytes"] == 0 and rest["storage"] == 0, (case, rest)
            assert rest["shards_ok"], (case, rest)
            assert rest["params_bytes"] == rest["partitioned_bytes"] // 2, (case, rest)
            assert rest["cpu_tier"] >= rest["params_bytes"], (case, rest)
            # Gathered per block inside the schedule: once per micro-batch's forward and once per
            # its backward, never a whole chunk at once where it has three blocks.
            assert rest["gathers"] == rest["expected_gathers"], (case, rest)
            assert rest["peak"] <= rest["per_block_bound"], (case, rest)
            if case == ("gpt", "1f1b", 1):  # (three blocks per chunk)
                assert rest["peak"] < rest["chunk_bytes"], (case, rest)
        if name in TIED:  # the last stage's copy stayed equal to the embedding
            first, last = TIED[name]
            assert torch.equal(merged.pop(last), merged[first]), case
        assert set(merged) == set(oracle.params64), case
        oracle.check(None, merged, f"(2,1,2) zero-3 {case} parameters")


def _nvme_run(rank, world, cases, nvme_path):
    out = []
    for name, schedule, v in cases:
        losses, params, engine = engine_train(rank, world, MODELS[name](), _config(3, 2, 2, schedule, v, nvme_path),
                                              _batches(2))
        report = engine.memory_report()
        out.append((losses, params, report.nvme_tier, report.params, engine.pipeline_fetcher.gathers))
        engine.close()
    return out


@pytest.mark.timeout(90)
def test_dp2_pp2_zero3_nvme_tier_matches_single_process(tmp_path):
    cases = [("gpt", "interleaved", 2)]
    results = run_distributed(_nvme_run, 4, cases, str(tmp_path), timeout=80)
    oracle = Oracle.run(reference_train, _gpt(), _config(2, 1, 1), _batches(2))
    merged = {}
    for losses, params, nvme, held, gathers in (r[0] for r in results):
        oracle.check(losses, None, "(2,1,2) zero-3 nvme losses")
        assert nvme >= held > 0 and gathers == 2 * ACCUM * STEPS * 4  # (2 chunks: root and one block each)
        merged.update(params)
    assert torch.equal(merged.pop("head.weight"), merged["embed.weight"])
    oracle.check(None, merged, "(2,1,2) zero-3 nvme parameters")


def _resume(rank, world, directory):
    """Four steps straight, saving after two; then a fresh engine (other initial values) loads
    that checkpoint and runs the last two steps."""
    import tiertrain
    from reference import rank_slices

    config = _config(3, 2, 2)
    topology = tiertrain.Topology.build(config.parallel)
    batches = global_batches(4, MICRO * ACCUM * 2)
    out = []
    for resume in (False, True):
        engine = tiertrain.wrap(make_model(seed=1 if resume else 0, n_layers=4), config, topology)
        if resume:
            engine.load_checkpoint(directory)
        losses = []
        for i, batch in enumerate(batches[2:] if resume else batches):
            losses.append(engine.train_batch(rank_slices(batch, topology.coord("dp"), 2, MICRO, ACCUM)))
            if not resume and i == 1:
                engine.save_checkpoint(directory)
        out.append((losses, engine.full_state_dict()))
        engine.close()
    return out


@pytest.mark.timeout(90)
def test_dp2_pp2_zero3_checkpoint_resumes_exactly(tmp_path):
    for (full, params), (resumed, resumed_params) in run_distributed(_resume, 4, str(tmp_path), timeout=80):
        assert resumed == full[2:]
        assert params.keys() == resumed_params.keys()
        assert all(torch.equal(params[k], resumed_params[k]) for k in params)
