"""tiertrain.observe: the metrics writers (JSONL, TensorBoard read back, W&B offline read
back), the missing-package ConfigErrors, and `tiertrain plot` on a synthetic run."""
import glob
import json
import math
import os
import struct
import subprocess
import sys
import time

import pytest

from tiertrain.config import ConfigError, LoggingConfig
from tiertrain.observe import (JsonlWriter, MultiWriter, TensorBoardWriter, WandbWriter, check_writers, metric_tag,
                               open_writers, plot_run)
from tiertrain.observe.plot import load_records, main as plot_main

GiB = 1024 ** 3


def train_record(step, loss=3.0, **extra):
    return {"step": step, "loss": loss, "lr": 1e-3, "grad_norm": 0.5, "tokens_per_s": 1000.0 + step,
            "bytes_device": 2 * GiB, "time_forward_s": 0.25, "skipped": 0, "elapsed_s": float(step), **extra}


def synthetic_run(path, steps=200, interval=10, eval_every=50):
    """A realistic run: falling loss, an eval every eval_every steps, memory per tier with
    predictions, throughput and the step-time breakdown."""
    with open(path, "w") as f:
        for step in [1] + list(range(interval, steps + 1, interval)):
            loss = 2.0 + 3.5 * math.exp(-step / 50)
            record = train_record(step, loss, tflops=(1000.0 + step) * 0.03, mfu=0.25, mem_bytes_per_rank=8 * GiB,
                                  peak_rss_bytes_per_rank=10 * GiB, bytes_device=3 * GiB, bytes_cpu=5 * GiB,
                                  bytes_nvme=0, predicted_bytes_device=3 * GiB, predicted_bytes_cpu=int(5.5 * GiB),
                                  predicted_bytes_nvme=0, time_backward_s=0.5, time_optimizer_s=0.1,
                                  time_data_s=0.01, time_io_wait_s=0.05, time_comm_wait_s=0.02)
            if step == 120:  # a diverged window, as metrics_line writes it: a gap in the loss line
                record.update(loss=None, non_finite=["loss"])
            f.write(json.dumps(record) + "\n")
            if step % eval_every == 0:
                f.write(json.dumps({"step": step, "eval_loss": loss + 0.1, "eval_ppl": math.exp(loss + 0.1),
                                    "eval_tokens": 4096, "elapsed_s": float(step)}) + "\n")


# --------------------------------------------------------------------------- naming, JSONL


def test_metric_tag_groups_keys_by_what_they_measure():
    assert metric_tag("loss") == "train/loss"
    assert metric_tag("grad_norm") == "train/grad_norm"
    assert metric_tag("eval_loss") == "eval/loss"
    assert metric_tag("tokens_per_s") == "throughput/tokens_per_s"
    assert metric_tag("mfu") == "throughput/mfu"
    assert metric_tag("bytes_nvme") == "memory/bytes_nvme"
    assert metric_tag("predicted_bytes_cpu") == "memory/predicted_bytes_cpu"
    assert metric_tag("peak_rss_bytes_per_rank") == "memory/peak_rss_bytes_per_rank"
    assert metric_tag("time_io_wait_s") == "time/io_wait_s"
    assert metric_tag("elapsed_s") == "time/elapsed_s"
    assert metric_tag("step") is None and metric_tag("non_finite") is None


def _strict(text):
    def refuse(constant):
        raise AssertionError(f"non-strict JSON constant {constant} in {text!r}")

    return json.loads(text, parse_constant=refuse)


def test_jsonl_writer_writes_strict_json_flushed_and_appends(tmp_path):
    path = tmp_path / "sub" / "metrics.jsonl"
    writer = JsonlWriter(str(path), append=False)
    writer.write(train_record(1, loss=float("nan"), grad_norm=float("inf")))
    lines = path.read_text().splitlines()  # before close: flushed per record
    assert len(lines) == 1
    first = _strict(lines[0])
    assert first["loss"] is None and first["grad_norm"] is None and first["step"] == 1
    assert sorted(first["non_finite"]) == ["grad_norm", "loss"]
    writer.close()

    writer = JsonlWriter(str(path), append=True)  # a resumed run continues the file
    writer.write(train_record(2))
    writer.close()
    records = [_strict(line) for line in path.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2] and records[1]["loss"] == 3.0 and "non_finite" not in records[1]

    writer = JsonlWriter(str(path), append=False)  # a fresh run starts afresh
    writer.write(train_record(7))
    writer.close()
    assert [_strict(line)["step"] for line in path.read_text().splitlines()] == [7]


# --------------------------------------------------------------------------- TensorBoard


def _tensorboard_scalars(log_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    return {tag: [(e.step, e.value) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]}


def test_tensorboard_writer_events_read_back(tmp_path):
    writer = TensorBoardWriter(str(tmp_path / "tb"))
    writer.write(train_record(1, loss=5.5, loss_scale=None, bytes_cpu=3 * GiB))
    writer.write(train_record(10, loss=4.25, loss_scale=None, bytes_cpu=3 * GiB, non_finite=["x"]))
    writer.write({"step": 10, "eval_loss": 4.5, "eval_ppl": None, "elapsed_s": 12.0})
    writer.close()
    scalars = _tensorboard_scalars(tmp_path / "tb")
    assert set(scalars) == {"train/loss", "train/lr", "train/grad_norm", "train/skipped", "throughput/tokens_per_s",
                            "memory/bytes_device", "memory/bytes_cpu", "time/forward_s", "time/elapsed_s",
                            "eval/loss"}  # None (loss_scale, eval_ppl), step and the non_finite list left out
    assert scalars["train/loss"] == [(1, 5.5), (10, 4.25)]
    assert scalars["eval/loss"] == [(10, 4.5)]
    assert scalars["memory/bytes_cpu"] == [(1, 3 * GiB), (10, 3 * GiB)]
    assert scalars["throughput/tokens_per_s"] == [(1, 1001.0), (10, 1010.0)]
    assert scalars["time/elapsed_s"] == [(1, 1.0), (10, 10.0), (10, 12.0)]


def test_writers_need_an_integer_step(tmp_path):
    writer = TensorBoardWriter(str(tmp_path / "tb"))
    with pytest.raises(ValueError, match="integer 'step'"):
        writer.write({"loss": 1.0})
    writer.close()


# --------------------------------------------------------------------------- W&B offline


def _wandb_records(run_file):
    """The protobuf records of a .wandb file (LevelDB log format: 7-byte file header, 32 KiB
    blocks of chunks, each crc32 (4) + length (2) + type (1: full, 2: first, 3: middle, 4: last))."""
    from wandb.proto import wandb_internal_pb2

    data = open(run_file, "rb").read()
    assert data[:4] == b":W&B", data[:7]
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if (kind == 0 and length == 0) or pos + 7 + length > len(data):
            break  # the end, or a chunk still being written
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
    return records


def test_wandb_writer_offline_run_holds_history_and_config(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    writer = WandbWriter("tiertrain-test", "offline", str(tmp_path), config={"steps": 20, "model": {"n_layers": 2}})
    writer.write(train_record(1, loss=5.5, loss_scale=None))
    writer.write(train_record(10, loss=4.25))
    writer.write({"step": 10, "eval_loss": 4.5, "eval_ppl": None})
    writer.write(train_record(20, loss=3.75))
    run_dir = writer.run_dir
    writer.close()

    assert os.path.dirname(run_dir) == str(tmp_path / "wandb") and "offline-run-" in os.path.basename(run_dir)
    run_files = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    assert len(run_files) == 1, os.listdir(run_dir)
    # wandb-core may still be writing the file when finish() returns (seen under load: only
    # the header, complete a moment later): wait for the run's exit record.
    deadline = time.monotonic() + 20
    while not any(r.WhichOneof("record_type") == "exit" for r in _wandb_records(run_files[0])):
        assert time.monotonic() < deadline, f"{run_files[0]} holds no exit record 20 s after finish()"
        time.sleep(0.1)
    history, config = {}, {}
    for record in _wandb_records(run_files[0]):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history[record.history.step.num] = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                                for item in record.history.item}  # "a/b" is stored as ["a", "b"]
        elif kind in ("run", "config"):  # the config given to wandb.init comes with the run record
            updates = record.run.config.update if kind == "run" else record.config.update
            config.update({item.key: json.loads(item.value_json) for item in updates})
    assert sorted(history) == [1, 10, 20]
    assert history[1]["train/loss"] == 5.5 and "train/loss_scale" not in history[1]
    assert history[10]["train/loss"] == 4.25 and history[10]["eval/loss"] == 4.5  # one W&B step
    assert "eval/ppl" not in history[10] and "step" not in history[10]
    assert history[20]["train/loss"] == 3.75 and history[20]["memory/bytes_device"] == 2 * GiB
    assert config["steps"] == 20 and config["model"] == {"n_layers": 2}


# --------------------------------------------------------------------------- open_writers, missing packages


def test_open_writers_builds_what_logging_configures(tmp_path):
    logging = LoggingConfig(metrics_file=str(tmp_path / "metrics.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    with open_writers(logging, append=False) as writer:
        assert [type(w) for w in writer.writers] == [JsonlWriter, TensorBoardWriter]
        writer.write(train_record(3, loss=2.5))
    assert _strict((tmp_path / "metrics.jsonl").read_text())["loss"] == 2.5
    assert _tensorboard_scalars(tmp_path / "tb")["train/loss"] == [(3, 2.5)]

    nothing = open_writers(LoggingConfig(metrics_file=""))
    assert len(nothing) == 0
    nothing.write(train_record(1))
    nothing.close()


@pytest.mark.parametrize("module", ["tensorboard", "torch.utils.tensorboard"])
def test_missing_tensorboard_is_a_config_error_before_anything_opens(tmp_path, monkeypatch, module):
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    logging = LoggingConfig(metrics_file=str(tmp_path / "metrics.jsonl"), tensorboard_dir=str(tmp_path / "tb"))
    for attempt in (lambda: check_writers(logging), lambda: open_writers(logging),
                    lambda: TensorBoardWriter(str(tmp_path / "tb"))):
        with pytest.raises(ConfigError, match=r"logging\.tensorboard_dir=.*pip install tensorboard"):
            attempt()
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tb").exists()
    check_writers(LoggingConfig(tensorboard_dir=""))  # not configured: not needed


def test_missing_wandb_is_a_config_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    logging = LoggingConfig(metrics_file="", wandb_project="proj", wandb_mode="offline")
    with pytest.raises(ConfigError, match=r"logging\.wandb_project='proj'.*pip install wandb"):
        check_writers(logging)
    with pytest.raises(ConfigError, match=r"pip install wandb"):
        WandbWriter("proj", "offline", str(tmp_path))
    check_writers(LoggingConfig(wandb_project=""))


def test_check_writers_refuses_a_tensorboard_dir_that_is_a_file_and_a_bad_wandb_mode(tmp_path):
    (tmp_path / "tb").write_text("")
    with pytest.raises(ConfigError, match=r"logging\.tensorboard_dir=.*is a file"):
        check_writers(LoggingConfig(tensorboard_dir=str(tmp_path / "tb")))
    with pytest.raises(ConfigError, match=r"logging\.wandb_mode='sometimes'.*'online' or 'offline'"):
        WandbWriter("proj", "sometimes", str(tmp_path))


def test_multi_writer_closes_every_writer_when_one_fails():
    closed = []

    class Failing:
        def write(self, record): pass
        def close(self): closed.append("failing"); raise OSError("disk full")

    class Fine:
        def write(self, record): pass
        def close(self): closed.append("fine")

    with pytest.raises(OSError, match="disk full"):
        MultiWriter([Failing(), Fine()]).close()
    assert closed == ["failing", "fine"]


def test_importing_tiertrain_observe_imports_no_optional_package():
    code = ("import sys, tiertrain.observe, tiertrain.observe.plot\n"
            "print([m for m in ('matplotlib', 'tensorboard', 'wandb') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


# --------------------------------------------------------------------------- plot


def _png_shape(path):
    from matplotlib.image import imread

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", path
    return imread(path).shape


def test_plot_run_writes_the_four_pngs(tmp_path):
    synthetic_run(tmp_path / "metrics.jsonl")
    written = plot_run(str(tmp_path))
    assert [os.path.basename(p) for p in written] == ["loss.png", "throughput.png", "memory.png", "timing.png"]
    for path in written:
        assert os.path.dirname(path) == str(tmp_path) and os.path.getsize(path) > 10_000
        height, width, _ = _png_shape(path)
        assert width > 600 and height > 300


def test_plot_main_draws_only_what_the_records_have(tmp_path, capsys):
    metrics = tmp_path / "losses.jsonl"
    with open(metrics, "w") as f:
        for step in (1, 2, 3):
            f.write(json.dumps({"step": step, "loss": 4.0 - step, "lr": None}) + "\n")
        f.write(json.dumps({"step": 3, "eval_loss": 1.5}) + "\n")
    assert plot_main([str(metrics), "--out", str(tmp_path / "pictures")]) == 0
    assert capsys.readouterr().out.split() == [str(tmp_path / "pictures" / "loss.png")]
    assert _png_shape(tmp_path / "pictures" / "loss.png")[0] > 300


def test_plot_throughput_alone_and_tflops_not_proportional_to_tokens(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text("".join(json.dumps({"step": s, "tokens_per_s": 100.0 * s, "tflops": 5.0 + s % 3}) + "\n"
                               for s in range(1, 6)))
    assert [os.path.basename(p) for p in plot_run(str(metrics))] == ["throughput.png"]
    assert _png_shape(tmp_path / "throughput.png")[1] > 600


def test_load_records_later_step_wins_and_a_torn_last_line_is_skipped(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    lines = [train_record(1, 5.0), train_record(10, 4.0), train_record(20, 3.0),
             {"step": 20, "eval_loss": 3.5},
             train_record(10, 3.9), train_record(20, 2.9)]  # resumed from step 1's checkpoint
    metrics.write_text("".join(json.dumps(r) + "\n" for r in lines) + '{"step": 30, "lo')
    with pytest.warns(UserWarning, match=r"skipped 1 line.*line 7"):
        train, evals = load_records(str(metrics))
    assert [(r["step"], r["loss"]) for r in train] == [(1, 5.0), (10, 3.9), (20, 2.9)]
    assert [(r["step"], r["eval_loss"]) for r in evals] == [(20, 3.5)]


def test_plot_errors_name_the_path(tmp_path, capsys):
    missing = tmp_path / "nowhere"
    with pytest.raises(FileNotFoundError, match="nowhere.*does not exist"):
        plot_run(str(missing))
    (tmp_path / "empty_run").mkdir()
    with pytest.raises(FileNotFoundError, match=r"empty_run.*without metrics\.jsonl.*no \.jsonl"):
        plot_run(str(tmp_path / "empty_run"))
    (tmp_path / "empty_run" / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl.* is empty"):
        plot_run(str(tmp_path / "empty_run"))
    (tmp_path / "empty_run" / "metrics.jsonl").write_text("not json\n[1, 2]\n")
    with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"no valid record \(2 unreadable"):
        plot_run(str(tmp_path / "empty_run"))
    (tmp_path / "empty_run" / "metrics.jsonl").write_text('{"step": 1, "lr": 0.1}\n')
    with pytest.raises(ValueError, match="1 record.*nothing to plot"):
        plot_run(str(tmp_path / "empty_run"))

    with pytest.raises(SystemExit) as exit_info:
        plot_main(["--help"])
    assert exit_info.value.code == 0 and capsys.readouterr().out.startswith("usage: tiertrain plot ")

    assert plot_main([str(missing)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "nowhere" in err and err.count("\n") == 1
