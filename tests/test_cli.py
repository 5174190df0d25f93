"""The `tiertrain` command and the local launcher: end-to-end training runs as subprocesses
(2 gloo processes), config errors, `config`/`estimate`/`probe`, and failure propagation."""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from tiertrain import cli, launch
from tiertrain.config import to_dict
from tiertrain.train import TrainConfig

TINY = ["--steps", "6", "--model.n_layers", "1", "--model.hidden", "32", "--model.n_heads", "2",
        "--model.seq_len", "32", "--batch.micro_batch_size", "2"]


def _tiertrain(args: list[str], cwd, timeout: float = 90) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("RANK", None)
    env.pop("WORLD_SIZE", None)
    return subprocess.run([sys.executable, "-m", "tiertrain.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _records(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# --------------------------------------------------------------------------- train, end to end


@pytest.mark.parametrize("stage", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_train_end_to_end(tmp_path, stage):
    metrics = tmp_path / "logs" / "m.jsonl"
    proc = _tiertrain(["train", "--nproc", "2", *TINY, "--zero.stage", str(stage),
                       "--logging.metrics_file", str(metrics), "--data.cache_dir", str(tmp_path),
                       "--logging.log_interval", "5"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(metrics)
    assert [r["step"] for r in records] == [1, 5, 6]
    for r in records:
        assert math.isfinite(r["loss"]) and 4.0 < r["loss"] < 7.0  # ~ln(256) for an untrained model
        for key in ("lr", "grad_norm", "tokens_per_s", "mem_bytes_per_rank", "loss_scale",
                    "skipped", "elapsed_s"):
            assert key in r
        assert r["tokens_per_s"] > 0 and r["mem_bytes_per_rank"] > 0
    assert "training done" in proc.stdout
    assert f"zero.stage   {stage}" in proc.stdout
    assert "world size   2 (dp=2)" in proc.stdout
    assert "loss " in proc.stdout and "->" in proc.stdout


@pytest.mark.parametrize("algorithm", ["ring", pytest.param("ulysses", marks=pytest.mark.slow)])
def test_train_with_each_sequence_split_over_two_ranks(tmp_path, algorithm):
    """--parallel.cp 2: both ranks train on the same samples, each on half of every sequence."""
    metrics = tmp_path / "m.jsonl"
    proc = _tiertrain(["train", "--nproc", "2", *TINY, "--zero.stage", "3", "--parallel.cp", "2",
                       "--parallel.cp_algorithm", algorithm, "--logging.metrics_file", str(metrics),
                       "--data.cache_dir", str(tmp_path), "--logging.log_interval", "5"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(metrics)
    assert [r["step"] for r in records] == [1, 5, 6]
    assert all(math.isfinite(r["loss"]) and 4.0 < r["loss"] < 7.0 for r in records)
    assert "world size   2 (dp=1, cp=2)" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(150)
def test_train_with_each_sequence_split_over_two_ranks_in_a_pipeline(tmp_path):
    """--parallel.pp 2 --parallel.cp 2: each of the 2 pipeline stages splits every sequence over
    2 ranks (4 ranks; tests/test_context_parallel_pipeline.py checks the maths)."""
    metrics = tmp_path / "m.jsonl"
    proc = _tiertrain(["train", "--nproc", "4", *TINY, "--model.n_layers", "2", "--batch.grad_accum_steps", "2",
                       "--zero.stage", "1", "--parallel.pp", "2", "--parallel.cp", "2",
                       "--logging.metrics_file", str(metrics), "--data.cache_dir", str(tmp_path),
                       "--logging.log_interval", "5"], cwd=tmp_path, timeout=140)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = _records(metrics)
    assert [r["step"] for r in records] == [1, 5, 6]
    assert all(math.isfinite(r["loss"]) and 4.0 < r["loss"] < 7.0 for r in records)
    assert "world size   4 (dp=1, cp=2)" in proc.stdout


def test_bad_override_exits_2_naming_the_field(tmp_path):
    proc = _tiertrain(["train", "--zero.stage", "7"], cwd=tmp_path, timeout=60)
    assert proc.returncode == 2
    assert "zero.stage" in proc.stderr and proc.stderr.startswith("error: ")
    assert "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "runs").exists()  # nothing was started


def test_a_too_short_token_file_is_one_line_before_any_rank_starts(tmp_path):
    """(Once raised on every rank, with a worker traceback; a failing rank's report is
    tests/test_faults_config.py's.)"""
    tokens = tmp_path / "short.u16"
    tokens.write_bytes(b"\x01\x00" * 8)  # 8 tokens: too short for seq_len 32
    proc = _tiertrain(["train", "--nproc", "2", *TINY, "--data.path", str(tokens),
                       "--logging.metrics_file", ""], cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: data.path=") and "short.u16" in proc.stderr
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_checkpoint_resume_continues_the_same_run(tmp_path):
    """4 steps + resume to 6 logs the same losses as 6 steps in one go (ranks forked in process)."""
    from tiertrain.train import run_training

    def job(name, steps, ckpt=""):
        return cli.load_train_config(None, [*TINY, "--steps", str(steps), "--logging.log_interval", "1",
                                            "--logging.progress", "false", "--data.cache_dir", str(tmp_path),
                                            "--logging.metrics_file", str(tmp_path / f"{name}.jsonl"),
                                            "--checkpoint.dir", ckpt, "--zero.stage", "2"])

    straight = launch.launch_local(run_training, 2, job("straight", 6), timeout=60)
    ckpt = str(tmp_path / "ckpt")
    first = launch.launch_local(run_training, 2, job("resumed", 4, ckpt), timeout=60)
    assert first[0]["steps_run"] == 4 and os.path.isdir(ckpt)
    second = launch.launch_local(run_training, 2, job("resumed", 6, ckpt), timeout=60)
    assert second[0]["steps_run"] == 2 and second[0]["optimizer_steps"] == 6
    losses = [r["loss"] for r in _records(tmp_path / "resumed.jsonl")]  # appended on resume
    assert losses == [r["loss"] for r in _records(tmp_path / "straight.jsonl")]
    assert straight[0]["last_loss"] == second[0]["last_loss"] == second[1]["last_loss"]


# --------------------------------------------------------------------------- config errors, in process


@pytest.mark.parametrize("args, field", [
    (["--zero.stage", "7"], "zero.stage"),
    (["--model.hidden", "30", "--model.n_heads", "4"], "model.hidden"),
    (["--model.hidden", str(10**18 + 1), "--model.n_heads", "4"], "expected a divisor of hidden, e.g. 1, 101, 9901"),
    (["--steps", "0"], "steps"),
    (["--zero.nope", "1"], "zero.nope"),
    (["--batch.global_batch_size", "5"], "batch.global_batch_size"),
    (["--data.path", "/nonexistent/tokens.u16"], "data.path"),
    (["--parallel.tp", "3"], "tp × pp = 3 × 1"),
    (["--parallel.tp", "2", "--tile_factor", "2"], "tile_factor=2 with parallel.tp=2"),
    (["--nproc", "0"], "--nproc"),
])
def test_train_config_errors(capsys, args, field):
    assert cli.main(["train", "--nproc", "2", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and field in err


def test_unknown_command_and_help(capsys):
    assert cli.main(["frobnicate"]) == 2
    assert "unknown command" in capsys.readouterr().err
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for word in ("train", "config", "estimate", "probe", "torchrun"):
        assert word in out


def test_overrides_mix_with_command_options():
    from tiertrain.cli.common import split_args

    own, overrides = split_args(
        ["--zero.stage", "3", "--nproc", "4", "--config=x.yaml", "--steps=5", "--precision.dtype", "bf16"],
        {"--config": True, "--nproc": True})
    assert own == ["--nproc", "4", "--config=x.yaml"]
    assert overrides == ["--zero.stage", "3", "--steps=5", "--precision.dtype", "bf16"]


# --------------------------------------------------------------------------- config / estimate / probe


def test_config_prints_documented_yaml_that_loads_back(tmp_path, capsys):
    assert cli.main(["config", "--zero.stage", "2", "--model.n_layers", "3", "--optimizer.betas", "[0.8,0.9]"]) == 0
    out = capsys.readouterr().out
    assert "# ZeRO stage: 0 plain data parallel" in out  # a field docstring from config.py
    assert "# Number of transformer blocks." in out  # from GPTConfig
    assert "# Optimizer steps to run" in out  # from TrainConfig
    path = tmp_path / "job.yaml"
    path.write_text(out)
    loaded = cli.load_train_config(str(path), [])
    assert loaded.zero.stage == 2 and loaded.model.n_layers == 3 and loaded.optimizer.betas == (0.8, 0.9)
    expected = cli.load_train_config(None, ["--zero.stage", "2", "--model.n_layers", "3",
                                            "--optimizer.betas", "[0.8,0.9]"])
    assert to_dict(loaded) == to_dict(expected)


def test_config_file_and_overrides(tmp_path, capsys):
    path = tmp_path / "job.yaml"
    path.write_text("zero:\n  stage: 1\nsteps: 7\nmodel:\n  n_layers: 2\n")
    cfg = cli.load_train_config(str(path), ["--zero.stage", "3"])
    assert cfg.zero.stage == 3 and cfg.steps == 7 and cfg.model.n_layers == 2
    assert isinstance(cfg, TrainConfig)
    assert type(cfg.engine_config()).__name__ == "Config"
    path.write_text("zero: [1, 2\n")
    assert cli.main(["config", "--config", str(path)]) == 2
    assert capsys.readouterr().err.startswith("error: ")


def test_example_config_loads():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    cfg = cli.load_train_config(os.path.join(root, "examples", "gpt_small.yaml"), [])
    assert cfg.model.n_layers >= 1


def test_estimate_json(capsys):
    assert cli.main(["estimate", "--preset", "small", "--dp", "4", "--stage", "3", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["parameters"] > 4_000_000
    assert cli.main(["estimate", "--layers", "2", "--hidden", "64", "--heads", "4",
                     "--offload-optimizer", "cpu", "--stage", "2"]) == 0
    assert "cpu" in capsys.readouterr().out
    assert cli.main(["estimate", "--layers", "2"]) == 2
    assert "--hidden" in capsys.readouterr().err
    assert cli.main(["estimate", "--preset", "small", "--stage", "5"]) == 2
    assert "stage" in capsys.readouterr().err


def test_probe_quick(tmp_path, capsys):
    out = tmp_path / "probe.json"
    assert cli.main(["probe", "--quick", "--swap-dir", str(tmp_path), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "host_copy_gbps" in printed and "GB/s" in printed
    data = json.loads(out.read_text())
    assert data["quick"] is True and data["cpu_count"] >= 1 and data["swap_write_gbps"] > 0
    assert cli.main(["probe", "--quick", "--swap-dir", str(tmp_path / "missing"), "--out", ""]) == 2


# --------------------------------------------------------------------------- the local launcher


def _sum_ranks():
    import torch

    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank(), dist.get_world_size(), float(t), os.environ["LOCAL_RANK"]


def _rank1_raises():
    if dist.get_rank() == 1:
        raise ValueError("boom on rank 1")
    dist.barrier()  # rank 0 would wait here forever without the launcher stopping it


def _rank1_killed():
    if dist.get_rank() == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def test_launch_local_results_in_rank_order():
    assert launch.launch_local(_sum_ranks, 3, timeout=30) == [(r, 3, 3.0, str(r)) for r in range(3)]


def test_launch_local_reports_the_failing_rank_and_stops_the_others():
    start = time.monotonic()
    with pytest.raises(launch.WorkerFailure) as info:
        launch.launch_local(_rank1_raises, 2, timeout=30)
    assert info.value.rank == 1 and info.value.exc_type == "ValueError"
    assert "boom on rank 1" in info.value.message and "Traceback" in info.value.details
    assert time.monotonic() - start < 20


def test_launch_local_notices_a_killed_rank():
    start = time.monotonic()
    with pytest.raises(launch.WorkerFailure) as info:
        launch.launch_local(_rank1_killed, 2, timeout=30)
    assert info.value.rank == 1 and "SIGKILL" in info.value.message
    assert time.monotonic() - start < 20


# --------------------------------------------------------------------------- estimate (engine) / plan / tiling


def test_estimate_engine_lines_peak_and_overhead(capsys):
    assert cli.main(["estimate", "--preset", "small", "--dp", "2", "--stage", "3", "--micro-batch", "8",
                     "--precision", "fp32", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    names = [l["name"] for l in data["lines"]]
    assert data["peak_at"].startswith("backward of block")
    for name in ("parameters", "gradients", "optimizer states", "activations (blocks)",
                 "model-state working memory", "gradient buckets and reductions in flight",
                 "framework overhead", "allocator retention"):
        assert name in names, name
    assert cli.main(["estimate", "--preset", "small", "--stage", "2", "--device", "cuda", "--json"]) == 0
    cuda = json.loads(capsys.readouterr().out)
    assert "allocator retention" not in [l["name"] for l in cuda["lines"]]
    assert cli.main(["estimate", "--preset", "small", "--no-overhead"]) == 0
    assert "framework overhead" not in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_train_with_activation_checkpointing_and_tiling(tmp_path):
    """`tiertrain train` applies activations.* and tile_factor (the settings a plan writes)."""
    from tiertrain.train import run_training

    cfg = cli.load_train_config(None, [*TINY, "--steps", "3", "--logging.progress", "false",
                                       "--data.cache_dir", str(tmp_path), "--logging.metrics_file", "",
                                       "--zero.stage", "3", "--activations.checkpoint_every", "1",
                                       "--activations.offload", "cpu", "--tile_factor", "2"])
    plain = cli.load_train_config(None, [*TINY, "--steps", "3", "--logging.progress", "false",
                                         "--data.cache_dir", str(tmp_path), "--logging.metrics_file", "",
                                         "--zero.stage", "3"])
    tiled = launch.launch_local(run_training, 2, cfg, timeout=60)
    straight = launch.launch_local(run_training, 2, plain, timeout=60)
    assert tiled[0]["steps_run"] == 3 and math.isfinite(tiled[0]["last_loss"])
    assert tiled[0]["first_loss"] == pytest.approx(straight[0]["first_loss"], rel=1e-5)


@pytest.mark.parametrize("args, field", [
    (["--tile_factor", "0"], "tile_factor"),
    (["--activations.checkpoint_every", "5"], "activations.checkpoint_every"),
])
def test_tiling_and_checkpointing_config_errors(capsys, args, field):
    assert cli.main(["train", "--nproc", "2", *TINY, *args]) == 2
    assert field in capsys.readouterr().err


def test_parse_bytes():
    assert cli.parse_bytes("24GiB") == 24 * 2**30 and cli.parse_bytes("1.5e9") == 1_500_000_000
    assert cli.parse_bytes("512 MiB") == 512 * 2**20 and cli.parse_bytes("32GB") == 32 * 10**9
    with pytest.raises(ValueError, match="not a size"):
        cli.parse_bytes("12 parsecs")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout", [["--parallel.pp", "2", "--batch.grad_accum_steps", "2", "--model.n_layers", "2"],
                                    ["--parallel.tp", "2"]])
def test_train_with_pipeline_or_tensor_parallelism(tmp_path, layout):
    """`tiertrain train` runs any dp × tp × pp: the GPT is tensor-parallelised before wrap()
    and cut into pipeline stages by it."""
    from tiertrain.train import run_training

    cfg = cli.load_train_config(None, [*TINY, "--steps", "3", "--logging.progress", "false", "--zero.stage", "1",
                                       "--data.cache_dir", str(tmp_path), "--logging.metrics_file", "", *layout])
    summaries = launch.launch_local(run_training, 2, cfg, timeout=100)
    assert all(4.0 < s["last_loss"] < 7.0 for s in summaries)
