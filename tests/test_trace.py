"""A timeline of training steps (tiertrain/observe/trace.py): `--logging.trace_steps N` writes
N optimizer steps as a Chrome trace holding the engine's spans, those of worker threads
included, and `tiertrain plot` draws it."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest
import torch

import tiertrain
from reference import global_batches, make_config, make_model
from tiertrain.config import ConfigError
from tiertrain.observe.trace import StepTrace, load_spans, plot_trace
from tiertrain.spans import span


def test_a_trace_holds_the_engine_phases_and_a_worker_threads_spans(tmp_path):
    cfg = make_config(zero={"stage": 2, "offload_optimizer": "cpu"}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    batches = iter(global_batches(3, 2))
    engine.train_batch(batches)  # (outside the trace)
    trace = StepTrace(str(tmp_path / "trace.json"), steps=1, first_step=1)

    def worker():
        with span("worker/thing"):
            torch.ones(1000).sum()
    trace.before_step(1)
    engine.train_batch(batches)
    thread = threading.Thread(target=worker, name="a-worker")
    thread.start()
    thread.join()
    trace.after_step(1)
    assert trace.written
    engine.train_batch(batches)  # (after the trace: not in it)
    spans = load_spans(trace.path)
    names = [s.name for s in spans]
    for phase in ("forward", "backward", "step", "step/reduce_wait", "step/grad_norm", "step/update", "publish"):
        assert names.count(phase) == 1, (phase, names)
    main = {s.thread for s in spans if s.name == "forward"}
    (worker_span,) = [s for s in spans if s.name == "worker/thing"]
    assert worker_span.thread not in main
    step = next(s for s in spans if s.name == "step")
    assert worker_span.start_s >= step.start_s + step.duration_s - 1e-3  # on the same clock, after the step
    with open(trace.path) as f:
        events = json.load(f)["traceEvents"]
    assert any(e.get("ph") == "M" and e["args"].get("name") == "a-worker" for e in events)
    out = plot_trace(trace.path, str(tmp_path / "trace.png"))
    assert os.path.getsize(out) > 1000


def test_a_file_without_spans_is_refused_by_name(tmp_path):
    path = tmp_path / "other.json"
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", "name": "aten::mm", "ts": 0, "dur": 1}]}))
    with pytest.raises(ValueError, match="no tiertrain/\\* spans"):
        load_spans(str(path))


def test_trace_steps_must_be_a_whole_number():
    with pytest.raises(ConfigError, match="logging.trace_steps"):
        make_config(logging={"trace_steps": -1})


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_train_writes_a_trace_per_rank_and_plot_draws_it(tmp_path):
    metrics = tmp_path / "run" / "metrics.jsonl"
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    run = [sys.executable, "-m", "tiertrain.cli"]
    proc = subprocess.run(run + ["train", "--nproc", "2", "--steps", "4", "--model.n_layers", "1",
                                 "--model.hidden", "32", "--model.n_heads", "2", "--model.seq_len", "32",
                                 "--batch.micro_batch_size", "2", "--zero.stage", "3",
                                 "--logging.trace_steps", "2", "--logging.metrics_file", str(metrics),
                                 "--data.cache_dir", str(tmp_path), "--logging.progress", "false"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=110)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "trace of 2 step(s) in" in proc.stdout
    for rank in (0, 1):
        spans = load_spans(str(metrics.parent / f"trace-rank{rank}.json"))
        assert [s.name for s in spans].count("step") == 2
    plotted = subprocess.run(run + ["plot", str(metrics.parent)], capture_output=True, text=True, timeout=60, env=env)
    assert plotted.returncode == 0, plotted.stderr
    assert (metrics.parent / "trace-rank0.png").exists() and (metrics.parent / "trace-rank1.png").exists()
