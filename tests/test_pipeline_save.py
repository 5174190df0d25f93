"""``engine.save_pretrained(directory)`` of a pipeline engine (tiertrain/state/export.py): every
pipeline rank writes its own stages' tensors (its data-parallel ranks sharing the bytes, one unit
gathered at a time), the files numbered over the whole pipeline, rank 0 writing config.json and
the index last. The directory is what transformers' save_pretrained writes for the same model
(the same tensor names, a tied head once) and from_pretrained loads it with nothing missing or
unexpected, every tensor the engine's trained value. A rank that fails makes every stage raise,
and no index is written (an incomplete directory never reads as complete)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import tiertrain
from hf_pipeline_models import T5_TARGET, bert, gpt2, hf_convention, llama, mlm, qwen2_tied, t5
from reference import global_batches, make_config, rank_slices
from tiertrain.models.gpt import GPT, GPTConfig
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")

MICRO, ACCUM = 2, 2
MODELS = {"llama": llama, "gpt2": gpt2, "qwen2-tied": qwen2_tied, "t5": t5, "bert": bert}
CASES = [  # (model, zero stage, virtual stages, bytes per file at most)
    ("llama", 1, 1, None),
    ("qwen2-tied", 3, 1, 20_000),  # a tied head; many files
    ("gpt2", 2, 2, None),  # interleaved: rank 0 holds stages 0 and 2
    ("t5", 3, 1, 30_000),
    ("bert", 1, 1, None),
]


def _config(stage, v=1, dp=1):
    schedule = "interleaved" if v > 1 else "1f1b"
    return make_config(zero={"stage": stage, "bucket_mb": 0.02},
                       parallel={"pp": 2, "dp": dp, "virtual_stages": v, "schedule": schedule},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": ACCUM})


def _batches(name, dp=1):
    batches = global_batches(2, MICRO * ACCUM * dp)
    if name == "t5":
        return [{"input_ids": b["input_ids"], "labels": b["labels"][:, :T5_TARGET].contiguous()} for b in batches]
    return [mlm(b) for b in batches] if name == "bert" else hf_convention(batches)


def _train_and_save(rank, world, root, cases, dp=1):
    out = []
    for name, stage, v, shard in cases:
        config = _config(stage, v, dp)
        engine = tiertrain.wrap(MODELS[name](), config, tiertrain.Topology.build(config.parallel))
        for batch in _batches(name, dp):
            engine.train_batch(rank_slices(batch, engine.topology.coord("dp"), dp, MICRO, ACCUM))
        report = engine.save_pretrained(os.path.join(root, name), max_shard_bytes=shard)
        out.append((report.files, report.written, engine.full_state_dict()))
        engine.close()
    return out


def _stored(directory):
    """Every tensor of a safetensors checkpoint directory, by name."""
    from safetensors.torch import load_file

    files = [f for f in os.listdir(directory) if f.endswith(".safetensors")]
    return {k: v for f in files for k, v in load_file(os.path.join(directory, f)).items()}


def _check(root, name, files, written, whole):
    directory = os.path.join(root, name)
    n = len(files)
    assert files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)], files
    assert sorted(w for ranks in written for w in ranks) == files, "each file written by one rank"
    index = json.loads(open(os.path.join(directory, "model.safetensors.index.json")).read())
    stored = _stored(directory)
    assert set(index["weight_map"]) == set(stored)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in stored.values())
    reference = os.path.join(root, f"{name}-transformers")
    MODELS[name]().save_pretrained(reference)
    assert set(stored) == set(_stored(reference)), (name, set(stored) ^ set(_stored(reference)))
    loaded, info = type(MODELS[name]()).from_pretrained(directory, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], (name, info)
    state = loaded.state_dict()
    for key, value in whole.items():
        assert torch.equal(state[key], value.to(state[key].dtype)), (name, key)


@pytest.mark.timeout(120)
def test_save_pretrained_of_a_pipeline_writes_what_transformers_writes(tmp_path):
    results = run_distributed(_train_and_save, 2, str(tmp_path), CASES, timeout=100)
    for k, (name, *_) in enumerate(CASES):
        files, _, whole = results[0][k]
        assert results[1][k][0] == files
        _check(str(tmp_path), name, files, [r[k][1] for r in results], whole)
        if name in ("llama", "gpt2", "bert"):  # (one file per pipeline rank)
            assert [r[k][1] for r in results] == [[files[0]], [files[1]]]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_data_parallel_ranks_of_each_stage_share_its_files(tmp_path):
    cases = [("qwen2-tied", 3, 1, 20_000), ("t5", 2, 1, 30_000)]
    results = run_distributed(_train_and_save, 4, str(tmp_path), cases, 2, timeout=100)
    for k, (name, *_) in enumerate(cases):
        files, _, whole = results[0][k]
        written = [r[k][1] for r in results]
        assert all(written), "every rank wrote some of the files"
        _check(str(tmp_path), name, files, written, whole)


def _failing(rank, world, directory):
    from tiertrain.state import export_files

    config = _config(1)
    engine = tiertrain.wrap(llama(), config, tiertrain.Topology.build(config.parallel))
    if rank == 1:  # the second stage's disk fails while writing
        def fail(self, item, value):
            raise OSError(28, "No space left on device")
        export_files._StreamedFile.write = fail
    try:
        engine.save_pretrained(directory)
    except (OSError, RuntimeError) as e:
        said = f"{type(e).__name__}: {e}"
    gpt_config = _config(1)
    gpt = tiertrain.wrap(GPT(GPTConfig(n_layers=2, hidden=16, n_heads=2, vocab_size=256, seq_len=16)), gpt_config,
                         tiertrain.Topology.build(gpt_config.parallel))
    try:
        gpt.save_pretrained(directory + "-gpt")
    except NotImplementedError as e:
        refused = str(e)
    return said, refused


@pytest.mark.timeout(60)
def test_a_stage_that_fails_to_write_fails_every_stage_and_no_index_is_written(tmp_path):
    said = run_distributed(_failing, 2, str(tmp_path / "out"), timeout=50)
    assert said[1][0] == "OSError: [Errno 28] No space left on device"
    assert said[0][0].startswith("RuntimeError: save_pretrained: global rank(s) [1] of another pipeline stage failed "
                                 "writing their files"), said[0][0]
    assert not (tmp_path / "out" / "model.safetensors.index.json").exists()
    for _, refused in said:
        assert "not cut from a Hugging Face model" in refused and "tiertrain export" in refused
