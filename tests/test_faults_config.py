"""Faults a training run meets through its configuration, its checkpoint directory and its
numbers (issue 18 items 1, 4, 5, 6; issue 16 item 6), each refused or survived in the way
a user can act on: one line naming the field or file, the value and what is valid.

Most tests run in this process (``--nproc 1`` trains in-process, a tiny model in well under
a second); the few that need the launcher or a worker rank start `tiertrain` as a
subprocess, each with its own short timeout.
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import types

import pytest
import torch

from tiertrain import cli
from tiertrain.state import checkpoint
from tiertrain.state.checkpoint import CheckpointError, committed_steps, find_committed
from tiertrain.config import Config, ConfigError, OptimizerConfig, load
from tiertrain.train import TrainConfig, default_model, run_training

TINY = ["--model.n_layers", "1", "--model.hidden", "32", "--model.n_heads", "2", "--model.seq_len", "32",
        "--batch.micro_batch_size", "2", "--logging.progress", "false"]


def _cfg(tmp_path, *args: str) -> TrainConfig:
    return cli.load_train_config(None, [*TINY, "--data.cache_dir", str(tmp_path / "cache"),
                                        "--logging.metrics_file", "", *args])


def _tiertrain(args: list[str], cwd, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "tiertrain.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _one_line_error(err: str) -> str:
    """stderr must be exactly one `error: ...` line: no traceback, no notes."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err[-3000:]
    return lines[0]


def _strict_json(line: str):
    """json.loads that refuses NaN/Infinity, which Python's json writes but JSON forbids."""
    def refuse(constant):
        raise ValueError(f"non-JSON constant {constant}")
    return json.loads(line, parse_constant=refuse)


# --------------------------------------------------------------------------- item 4: non-finite numbers in the config


@pytest.mark.parametrize("override, field", [
    (["--optimizer.lr", ".inf"], "optimizer.lr"),
    (["--optimizer.grad_clip", ".nan"], "optimizer.grad_clip"),
    (["--zero.bucket_mb", "nan"], "zero.bucket_mb"),
    (["--zero.bucket_mb", ".inf"], "zero.bucket_mb"),
    (["--zero.prefetch_mb", ".inf"], "zero.prefetch_mb"),
    (["--precision.loss_scale.initial_scale", ".inf"], "precision.loss_scale.initial_scale"),
    (["--schedule.min_lr_ratio", ".nan"], "schedule.min_lr_ratio"),
    (["--model.init_std", ".nan"], "model.init_std"),
    (["--optimizer.betas", "[0.9, .nan]"], "optimizer.betas[1]"),
])
def test_non_finite_numbers_are_refused_naming_the_field(override, field):
    """inf and NaN pass every `> 0` check (inf > 0; NaN compares false to everything), so
    --optimizer.lr .inf used to train, skip every step and commit a NaN checkpoint."""
    with pytest.raises(ConfigError, match=r"=.*is invalid: expected a finite number") as info:
        cli.load_train_config(None, override)
    assert str(info.value).startswith(f"{field}=")


def test_non_finite_numbers_in_a_config_built_in_code_are_refused():
    """A Config built from dataclasses never passes through the loader's coercion."""
    with pytest.raises(ConfigError, match=r"optimizer\.lr=inf is invalid: expected a finite number"):
        Config(optimizer=OptimizerConfig(lr=float("inf"))).validate()


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
def test_timeout_must_be_finite_and_positive(capsys, value):
    assert cli.main(["train", "--nproc", "2", "--timeout", value, *TINY]) == 2
    assert "--timeout" in _one_line_error(capsys.readouterr().err)


def test_max_consecutive_skips_is_a_validated_precision_field():
    assert TrainConfig().precision.max_consecutive_skips == 20
    with pytest.raises(ConfigError, match=r"precision\.max_consecutive_skips=0 is invalid"):
        load(Config, None, ["--precision.max_consecutive_skips", "0"])


# --------------------------------------------------------------------------- item 5: a partial model section


def test_a_partial_model_override_keeps_the_default_model():
    """`--model.n_layers 4` (the example in --help) changes one field of the job's model
    (192 wide, 6 heads), not the GPTConfig class defaults (128, 4)."""
    cfg = cli.load_train_config(None, ["--model.n_layers", "2"])
    assert cfg.model == type(default_model())(**{**vars(default_model()), "n_layers": 2})


def test_a_partial_model_section_in_a_file_keeps_the_default_model(tmp_path):
    (tmp_path / "job.yaml").write_text("model:\n  n_layers: 2\n")
    cfg = cli.load_train_config(str(tmp_path / "job.yaml"), [])
    assert (cfg.model.n_layers, cfg.model.hidden, cfg.model.n_heads) == (2, 192, 6)


def test_config_command_shows_the_default_model_under_a_partial_override(capsys):
    assert cli.main(["config", "--model.n_layers", "4"]) == 0
    out = capsys.readouterr().out
    assert "  hidden: 192" in out and "  n_heads: 6" in out


def test_a_bad_head_count_names_n_heads(capsys):
    """192 is a valid width; 5 heads is what does not divide it."""
    assert cli.main(["train", "--nproc", "2", "--model.n_heads", "5"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "model.n_heads=5" in line and "192" in line


# --------------------------------------------------------------------------- item 6: user mistakes, one line each


def test_a_directory_as_config_file(tmp_path, capsys):
    (tmp_path / "job.yaml").mkdir()
    assert cli.main(["train", "--config", str(tmp_path / "job.yaml")]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "job.yaml" in line and "is a directory" in line


def test_an_unparsable_config_file_is_named(tmp_path, capsys):
    (tmp_path / "job.toml").write_text("[zero\nstage = 1\n")
    assert cli.main(["train", "--config", str(tmp_path / "job.toml")]) == 2
    assert "job.toml" in _one_line_error(capsys.readouterr().err)


def test_debug_shows_the_traceback(tmp_path, capsys):
    (tmp_path / "job.yaml").mkdir()
    assert cli.main(["--debug", "train", "--config", str(tmp_path / "job.yaml")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.strip().splitlines()[-1].startswith("error: ")


def test_checkpoint_dir_that_is_a_file_fails_before_training(tmp_path, capsys):
    """It used to fail at the first save, after every training step had run."""
    (tmp_path / "ckpt").write_text("not a directory")
    assert cli.main(["train", "--nproc", "2", *TINY, "--checkpoint.dir", str(tmp_path / "ckpt")]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "checkpoint.dir=" in line and "ckpt" in line and "directory" in line


def test_a_missing_nvme_path_is_refused_unless_told_to_create_it(tmp_path, capsys):
    """Issue 35, item 7: a mistyped mount point (/mnt/nvme0 for /mnt/nvme) was created on
    whatever filesystem held its parent, often the root disk."""
    missing = tmp_path / "mnt" / "nvme0"
    args = ["train", "--nproc", "2", *TINY, "--zero.stage", "3", "--zero.offload_params", "nvme",
            "--zero.nvme_path", str(missing)]
    assert cli.main(args) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"zero.nvme_path={str(missing)!r} does not exist" in line and "--zero.nvme_create true" in line, line
    assert "on the filesystem mounted at" in line and not missing.exists()


@pytest.mark.parametrize("field, relative", [
    ("logging.metrics_file", "blocker/m.jsonl"),
    ("logging.metrics_file", "metrics_dir_itself"),
    ("zero.nvme_path", "blocker/swap"),
    ("data.cache_dir", "blocker/cache"),
])
def test_unusable_paths_are_named_before_training(tmp_path, capsys, field, relative):
    (tmp_path / "blocker").write_text("a file where a directory is needed")
    (tmp_path / "metrics_dir_itself").mkdir()
    extra = ["--zero.stage", "3", "--zero.offload_params", "nvme"] if field == "zero.nvme_path" else []
    assert cli.main(["train", "--nproc", "2", *TINY, *extra, f"--{field}", str(tmp_path / relative)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert f"{field}=" in line and relative.split("/")[0] in line


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only directories")
def test_unwritable_metrics_directory(tmp_path, capsys):
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    try:
        assert cli.main(["train", "--nproc", "2", *TINY, "--logging.metrics_file", str(locked / "m.jsonl")]) == 2
    finally:
        locked.chmod(0o700)
    assert "logging.metrics_file=" in _one_line_error(capsys.readouterr().err)


def test_tensor_parallel_size_must_divide_the_heads(capsys):
    assert cli.main(["train", "--nproc", "2", "--parallel.tp", "2", "--model.n_heads", "3"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "model.n_heads=3" in line and "parallel.tp=2" in line


def test_a_too_short_token_file_is_a_config_error(tmp_path, capsys):
    tokens = tmp_path / "short.u16"
    tokens.write_bytes(b"\x01\x00" * 8)
    assert cli.main(["train", "--nproc", "2", *TINY, "--data.path", str(tokens)]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "data.path=" in line and "short.u16" in line


# --------------------------------------------------------------------------- item 1: rotation by run, overwrite


class _Part:
    def __init__(self, value=0.0):
        self.value = torch.tensor([value])

    def state_dict(self):
        return {"value": self.value}

    def load_state_dict(self, state):
        self.value = state["value"]


_ONE_RANK = types.SimpleNamespace(rank=0, world_size=1, world_group=lambda: None)


def _save(directory, step, run_id, keep_last=3):
    return checkpoint.save({"p": _Part(step)}, str(directory), step, _ONE_RANK, {"stage": 0}, keep_last=keep_last,
                           run_id=run_id)


def test_rotation_deletes_only_the_runs_own_checkpoints(tmp_path):
    """An older run's step_22..24 used to win rotation by number and delete each new
    checkpoint the moment it was committed."""
    for step in (22, 23, 24):
        _save(tmp_path, step, "old-run")
    for step in range(1, 6):
        _save(tmp_path, step, "new-run")
        assert step in committed_steps(str(tmp_path))
    assert committed_steps(str(tmp_path)) == [3, 4, 5, 22, 23, 24]


def test_rotation_never_deletes_a_checkpoint_without_a_run_id(tmp_path):
    """Checkpoints written before run ids existed belong to no run this one can prove it is."""
    _save(tmp_path, 1, None)
    marker = tmp_path / "step_00000001" / checkpoint.MARKER
    assert "run_id" not in json.loads(marker.read_text())
    for step in range(2, 6):
        _save(tmp_path, step, "run", keep_last=1)
    assert committed_steps(str(tmp_path)) == [1, 5]


def test_resume_false_into_a_directory_with_checkpoints_is_refused(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    run_training(_cfg(tmp_path, "--steps", "2", "--checkpoint.dir", str(ckpt)))
    assert committed_steps(str(ckpt)) == [2]
    assert cli.main(["train", "--nproc", "1", *TINY, "--steps", "3", "--checkpoint.dir", str(ckpt),
                     "--checkpoint.resume", "false", "--data.cache_dir", str(tmp_path / "cache")]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "checkpoint.resume=false" in line.lower() and "checkpoint.overwrite" in line and str(ckpt) in line
    assert committed_steps(str(ckpt)) == [2]  # untouched


def test_overwrite_replaces_the_old_runs_checkpoints(tmp_path):
    """checkpoint.overwrite=true removes the old checkpoints before the first step, so none
    of them can shadow the new run on a later resume."""
    ckpt = str(tmp_path / "ckpt")
    run_training(_cfg(tmp_path, "--steps", "5", "--checkpoint.dir", ckpt))
    assert committed_steps(ckpt) == [5]
    run_training(_cfg(tmp_path, "--steps", "2", "--checkpoint.dir", ckpt, "--checkpoint.resume", "false",
                      "--checkpoint.overwrite", "true", "--checkpoint.interval", "1", "--checkpoint.keep_last", "3"))
    assert committed_steps(ckpt) == [1, 2]
    resumed = run_training(_cfg(tmp_path, "--steps", "3", "--checkpoint.dir", ckpt))
    assert resumed["steps_run"] == 1 and resumed["optimizer_steps"] == 3


def test_a_resumed_run_rotates_the_checkpoints_of_the_run_it_continues(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    common = ["--checkpoint.dir", ckpt, "--checkpoint.interval", "1", "--checkpoint.keep_last", "2"]
    run_training(_cfg(tmp_path, "--steps", "2", *common))
    assert committed_steps(ckpt) == [1, 2]
    run_training(_cfg(tmp_path, "--steps", "4", *common))
    assert committed_steps(ckpt) == [3, 4]


# --------------------------------------------------------------------------- item 6: a corrupt commit marker


def test_a_corrupt_marker_is_named_and_resume_falls_back(tmp_path):
    for step in (1, 2):
        _save(tmp_path, step, "run")
    marker = tmp_path / "step_00000002" / checkpoint.MARKER
    marker.write_text(marker.read_text()[:20])  # truncated: invalid JSON
    with pytest.warns(UserWarning, match=r"step_00000002.*COMMITTED\.json.*falling back to step 1"):
        step_dir, found = find_committed(str(tmp_path))
    assert found["step"] == 1 and step_dir.endswith("step_00000001")
    with pytest.raises(CheckpointError, match=r"step_00000002.*COMMITTED\.json.*not valid JSON"):
        find_committed(str(tmp_path), 2)
    (tmp_path / "step_00000001" / checkpoint.MARKER).write_text("[]")  # JSON, but not a marker
    with pytest.raises(CheckpointError, match=r"COMMITTED\.json"):
        find_committed(str(tmp_path))


def test_a_corrupt_newest_marker_resumes_the_previous_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    common = ["--checkpoint.dir", ckpt, "--checkpoint.interval", "1", "--checkpoint.keep_last", "3"]
    run_training(_cfg(tmp_path, "--steps", "3", *common))
    (tmp_path / "ckpt" / "step_00000003" / checkpoint.MARKER).write_text("{")
    with pytest.warns(UserWarning, match="step_00000003"):
        summary = run_training(_cfg(tmp_path, "--steps", "4", *common))
    assert summary["steps_run"] == 2 and summary["optimizer_steps"] == 4


def test_resume_with_only_corrupt_markers_is_refused_not_started_afresh(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    run_training(_cfg(tmp_path, "--steps", "1", "--checkpoint.dir", ckpt))
    (tmp_path / "ckpt" / "step_00000001" / checkpoint.MARKER).write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"no intact committed checkpoint.*step_00000001.*COMMITTED\.json"):
        run_training(_cfg(tmp_path, "--steps", "2", "--checkpoint.dir", ckpt))


# --------------------------------------------------------------------------- item 6 end: the model in the fingerprint


def test_resume_with_another_model_config_names_each_field(tmp_path):
    """n_heads 2 → 4 at hidden 32 keeps every tensor shape, so the layout check passed and
    the run continued with a different model."""
    ckpt = str(tmp_path / "ckpt")
    run_training(_cfg(tmp_path, "--steps", "2", "--checkpoint.dir", ckpt))
    with pytest.raises(ConfigError, match=r"model\.n_heads: 2 in the checkpoint, 4 now") as info:
        run_training(_cfg(tmp_path, "--steps", "3", "--checkpoint.dir", ckpt, "--model.n_heads", "4",
                          "--model.layernorm_eps", "1e-6"))
    assert "model.layernorm_eps" in str(info.value) and "model.hidden" not in str(info.value)


# --------------------------------------------------------------------------- item 4: the numerics guard


def _engine(tmp_path, **precision):
    import tiertrain
    from tiertrain.config import from_dict
    from tiertrain.models.gpt import GPT, GPTConfig

    cfg = from_dict(Config, {"precision": precision, "batch": {"micro_batch_size": 2},
                             "zero": {"stage": 2}}).validate()
    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layers=1, hidden=16, n_heads=2, seq_len=8))
    return tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel, device="cpu"))


def _batch():
    ids = torch.arange(16).view(2, 8) % 256
    return {"input_ids": ids, "labels": ids.roll(-1, 1)}  # (next-token labels)


def test_a_run_of_skipped_steps_stops_with_the_step_scale_and_tensor(tmp_path):
    """A loss that stays NaN used to be skipped forever (exit 0)."""
    from tiertrain.precision import NonFiniteError

    engine = _engine(tmp_path, max_consecutive_skips=3)
    engine.train_batch(iter([_batch()]))
    assert engine.steps == 1
    engine.module.blocks[0].mlp.fc1.weight.register_hook(lambda g: torch.full_like(g, float("nan")))
    for _ in range(2):
        engine.train_batch(iter([_batch()]))
    assert engine.skipped_steps == 2
    with pytest.raises(NonFiniteError) as info:
        engine.train_batch(iter([_batch()]))
    message = str(info.value)
    assert "step 4" in message and "3 consecutive" in message and "loss scale 1" in message
    assert "blocks.0.mlp.fc1.weight" in message and "precision.max_consecutive_skips" in message


def test_a_good_step_resets_the_consecutive_skip_count(tmp_path):
    engine = _engine(tmp_path, max_consecutive_skips=2)
    poison = {"on": True}
    engine.module.blocks[0].mlp.fc1.weight.register_hook(
        lambda g: torch.full_like(g, float("inf")) if poison["on"] else g)
    for on in (True, False, True, False, True):  # never two skips in a row
        poison["on"] = on
        engine.train_batch(iter([_batch()]))
    assert engine.skipped_steps == 3 and engine.steps == 2


def test_a_checkpoint_of_non_finite_masters_is_refused(tmp_path):
    engine = _engine(tmp_path)
    engine.train_batch(iter([_batch()]))
    engine.masters()[0][3] = float("nan")
    with pytest.raises(CheckpointError, match=r"step 1 not saved.*non-finite values \(rank 0: first in [\w.]+\)"):
        engine.save_checkpoint(str(tmp_path / "ckpt"))
    assert committed_steps(str(tmp_path / "ckpt")) == []


def test_what_a_killed_save_left_behind_is_removed_by_the_next_save(tmp_path):
    """A process killed inside atomic_write cannot remove its temporary file (found by
    bench/soak.py: a killed save's rankNNNNN.pt.*.tmp stayed in the step directory the
    resumed run committed again, up to a whole rank file each time)."""
    engine = _engine(tmp_path)
    ckpt = tmp_path / "ckpt"
    crashed = ckpt / "step_00000001"  # a save killed before its commit: never loadable
    crashed.mkdir(parents=True)
    (crashed / "rank00000.pt").write_bytes(b"0" * 100)
    (crashed / "rank00001.pt.k3x9.tmp").write_bytes(b"0" * 1000)
    again = ckpt / "step_00000002"  # the step this run saves now, killed once already
    again.mkdir()
    (again / "rank00000.pt.zq81.tmp").write_bytes(b"0" * 10)
    later = ckpt / "step_00000009"  # beyond this save: not touched
    later.mkdir()
    (later / "rank00000.pt.aa00.tmp").write_bytes(b"0")
    for _ in range(2):
        engine.train_batch(iter([_batch()]))
    engine.save_checkpoint(str(ckpt))
    assert sorted(os.listdir(ckpt)) == [checkpoint.LOCK, "step_00000002", "step_00000009"]
    assert {"COMMITTED.json", "rank00000.pt"} <= set(os.listdir(again))
    assert not [f for f in os.listdir(again) if f.endswith(".tmp")]
    assert os.listdir(later) == ["rank00000.pt.aa00.tmp"]


def test_metrics_lines_are_strict_json_with_a_flag_for_non_finite_values():
    from tiertrain.train import metrics_line

    line = metrics_line({"step": 3, "loss": float("nan"), "lr": float("inf"), "grad_norm": 1.5, "skipped": 0})
    record = _strict_json(line)
    assert record["loss"] is None and record["lr"] is None and record["grad_norm"] == 1.5
    assert record["non_finite"] == ["loss", "lr"]
    assert "non_finite" not in _strict_json(metrics_line({"step": 1, "loss": 2.0}))


# --------------------------------------------------------------------------- subprocesses: workers, --resume


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_resume_flag_at_another_world_size_and_stage_and_one_line_worker_errors(tmp_path):
    """`tiertrain train --resume DIR` continues a 2-rank stage-2 run on 1 rank at stage 3
    (engine.load_checkpoint reshards it). A corrupt newest checkpoint is passed over for the
    previous one; with none intact, the refusal inside the worker ranks is reported as one line
    naming the file (the traceback only with --debug)."""
    ckpt = tmp_path / "ckpt"
    metrics = tmp_path / "m.jsonl"
    common = [*TINY, "--data.cache_dir", str(tmp_path / "cache"), "--logging.metrics_file", str(metrics),
              "--logging.log_interval", "1"]
    # (step 1 saved in the background while step 2 trains; the final save waits for it)
    first = _tiertrain(["train", "--nproc", "2", "--zero.stage", "2", "--steps", "2", "--checkpoint.dir",
                        str(ckpt), "--checkpoint.interval", "1", "--checkpoint.async_save", "true", *common],
                       cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert committed_steps(str(ckpt)) == [1, 2]
    second = _tiertrain(["train", "--nproc", "1", "--zero.stage", "3", "--steps", "3", "--resume", str(ckpt),
                         *common], cwd=tmp_path)
    assert second.returncode == 0, second.stderr[-3000:]
    # (issue 35, item 5: one rank instead of two accumulates twice, keeping the global batch)
    assert "batch.grad_accum_steps 1 -> 2 keeps the checkpoint's global batch of 4 samples" in second.stderr
    records = [_strict_json(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3]  # appended: the run continued
    assert math.isfinite(records[-1]["loss"]) and 4.0 < records[-1]["loss"] < 7.0
    assert committed_steps(str(ckpt)) == [2, 3]

    def corrupt(step):
        rank_file = ckpt / f"step_{step:08d}" / "rank00000.pt"
        data = bytearray(rank_file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        rank_file.write_bytes(bytes(data))

    # The newest checkpoint corrupt: every rank falls back to the newest intact one, saying so
    # (issue 32: ranks agree, and a corrupt newest checkpoint does not stop the resume); the
    # run's step 3 is then saved again, beside the corrupt one, which it replaces.
    corrupt(3)
    fallback = _tiertrain(["train", "--nproc", "2", "--zero.stage", "2", "--steps", "3", "--resume", str(ckpt),
                           *common], cwd=tmp_path)
    assert fallback.returncode == 0, fallback.stderr[-3000:]
    assert "falling back to step 2" in fallback.stderr and "rank00000.pt" in fallback.stderr
    assert committed_steps(str(ckpt)) == [2, 3]
    for step in committed_steps(str(ckpt)):  # nothing intact: refused
        corrupt(step)
    refused = _tiertrain(["train", "--nproc", "2", "--zero.stage", "2", "--steps", "4", "--resume", str(ckpt),
                          *common], cwd=tmp_path)
    assert refused.returncode == 1
    assert "rank00000.pt" in _one_line_error(refused.stderr)
    debug = _tiertrain(["--debug", "train", "--nproc", "2", "--zero.stage", "2", "--steps", "4", "--resume",
                        str(ckpt), *common], cwd=tmp_path)
    assert debug.returncode == 1 and "Traceback" in debug.stderr and "rank00000.pt" in debug.stderr


def test_resume_flag_needs_a_committed_checkpoint(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    assert cli.main(["train", "--nproc", "1", *TINY, "--resume", str(tmp_path / "empty")]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "--resume" in line and "empty" in line


def test_a_worker_failure_is_one_line_for_a_user_error_and_a_traceback_otherwise(capsys):
    """How `tiertrain train` reports a rank's failure: a refusal the user acts on as its one
    line; a failure of the program with the rank's traceback and the other ranks' notes."""
    from tiertrain.cli.report import report_worker_failure
    from tiertrain.launch import WorkerFailure

    def failure(exc_type, message, exit_code=None):
        f = WorkerFailure(1, exc_type, message, "Traceback (most recent call last):\n  ...\n", exit_code=exit_code)
        f.others = ["rank 0: RuntimeError: Connection closed by peer"]
        return f

    assert report_worker_failure(failure("CheckpointError", "'x/rank00001.pt' is corrupt", exit_code=1), debug=False) == 1
    assert _one_line_error(capsys.readouterr().err) == "error: 'x/rank00001.pt' is corrupt"
    assert report_worker_failure(failure("KeyError", "'w'"), debug=False) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "note: also failed: rank 0" in err
    assert err.strip().splitlines()[-1] == "error: rank 1 failed: KeyError: 'w'"


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_that_diverges_marks_its_checkpoint_and_the_resume_takes_the_previous_one(tmp_path):
    """Issue 32, item 9: optimizer.lr 1e30 stops the run cleanly (its gradients never finite
    again), but the checkpoint it saved after the exploding update, finite masters up to 5e28,
    was the newest one and the one a resume took. The run now marks it diverged on the way out,
    and a resume passes over it to the previous one, saying so."""
    ckpt = tmp_path / "ckpt"
    common = [*TINY, "--nproc", "1", "--data.cache_dir", str(tmp_path / "cache"), "--logging.metrics_file", "",
              "--checkpoint.dir", str(ckpt), "--checkpoint.interval", "1", "--checkpoint.keep_last", "5"]
    healthy = _tiertrain(["train", "--steps", "2", *common], cwd=tmp_path)
    assert healthy.returncode == 0, healthy.stderr[-3000:]
    exploding = _tiertrain(["train", "--steps", "8", "--optimizer.lr", "1e30", "--precision.max_consecutive_skips",
                            "2", *common], cwd=tmp_path)
    assert exploding.returncode == 1 and "the run has diverged" in exploding.stderr, exploding.stderr[-3000:]
    assert "the checkpoint of step 3" in exploding.stderr and "is marked diverged" in exploding.stderr
    assert committed_steps(str(ckpt)) == [1, 2, 3] and checkpoint.diverged_reason(str(ckpt), 3)
    resumed = _tiertrain(["train", "--steps", "3", *common], cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "step 3 is marked diverged" in resumed.stderr and "falling back to step 2" in resumed.stderr
    assert committed_steps(str(ckpt)) == [1, 2, 3] and checkpoint.diverged_reason(str(ckpt), 3) is None


def test_a_model_that_cannot_fit_the_machine_is_one_line_before_any_allocation(tmp_path, capsys):
    """Issue 32, item 9: a Hugging Face config with vocab_size 1e9 tried to allocate 256 GB at
    the build and died there with a raw allocator error. The estimator's peaks for the layout
    asked for are compared with the RAM available first, and the line names the short tier,
    the model's size and its largest tensor; nothing is built."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=10**9, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=64).save_pretrained(tmp_path / "huge_vocab")
    assert cli.main(["train", "--nproc", "2", "--model.hf", str(tmp_path / "huge_vocab"), "--model.seq_len", "32",
                     "--steps", "1", "--logging.progress", "false"]) == 2
    line = _one_line_error(capsys.readouterr().err)
    assert "does not fit this machine" in line and "host RAM" in line and "while the model is built" in line
    assert "model.embed_tokens.weight [1000000000, 64]" in line and "tiertrain plan" in line


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_small_corpus_trains_with_evaluation_on_what_it_holds_out(tmp_path):
    """Issue 35, item 7: data.eval_fraction of a small corpus held out fewer samples than one
    micro-batch per rank, and the run failed at its first evaluation, after training had
    started. Now the partial batch is evaluated (as the Hugging Face Trainer does); a split
    that would leave a rank nothing to train on is one line before any process starts."""
    import json

    import numpy as np

    tokens = np.arange(33 * 40, dtype=np.uint16) % 256  # 40 samples of 32 + 1 tokens
    np.save(tmp_path / "small.npy", tokens)
    metrics = tmp_path / "m.jsonl"
    args = ["train", "--nproc", "2", *TINY, "--batch.micro_batch_size", "8", "--data.path",
            str(tmp_path / "small.npy"), "--steps", "2", "--eval.every", "1", "--logging.metrics_file", str(metrics)]
    done = subprocess.run([sys.executable, "-m", "tiertrain.cli", *args], cwd=tmp_path, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 0, done.stderr[-3000:]
    evals = [r for r in map(json.loads, metrics.read_text().splitlines()) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [1, 2] and all(r["eval_tokens"] == 2 * 32 for r in evals), evals
    assert math.isfinite(evals[-1]["eval_loss"])
    np.save(tmp_path / "tiny.npy", tokens[:33 * 3])  # 3 samples: 2 held out (one per rank) leave 1
    bad = [a if a != str(tmp_path / "small.npy") else str(tmp_path / "tiny.npy") for a in args]
    done = subprocess.run([sys.executable, "-m", "tiertrain.cli", *bad], cwd=tmp_path, capture_output=True,
                          text=True, timeout=100)
    assert done.returncode == 2 and "leaves 1 to train on" in _one_line_error(done.stderr)
