"""Smoke tests for the benchmark scripts (not part of the library test suite).

Run explicitly:  python -m pytest bench/test_bench_smoke.py -q
(DeepSpeed rows are skipped when deepspeed is not installed: bash bench/setup_env.sh)
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

HAVE_DS = importlib.util.find_spec("deepspeed") is not None


@pytest.mark.timeout(600)
def test_gloo_collectives_runs(tmp_path):
    import gloo_collectives

    out = tmp_path / "coll.md"
    gloo_collectives.main(["--sizes-mib", "0.25", "--iters", "2", "--warmup", "1",
                           "--overlap-mib", "0.25", "--overlap-iters", "1", "--matmul-n", "64",
                           "--timeout", "60", "--total-timeout", "300", "--out", str(out)])
    text = out.read_text()
    assert "all_to_all_single + local sum" in text
    assert "## async_op overlap" in text


@pytest.mark.timeout(900)
def test_baselines_agree(tmp_path):
    """DDP, FSDP2, tiertrain 0-3 and (if installed) DeepSpeed ZeRO-1/2/3 run and follow the same loss curve."""
    import run_baselines

    fws = ["ddp", "fsdp2"] + (["ds1", "ds2", "ds3"] if HAVE_DS else []) + \
        ["tiertrain0", "tiertrain1", "tiertrain2", "tiertrain3"]
    out = tmp_path / "bl.md"
    rc = run_baselines.main(["--preset", "tiny", "--batch-size", "2", "--seq-len", "32",
                             "--steps", "2", "--warmup", "1", "--run-timeout", "400",
                             "--frameworks", *fws, "--out", str(out)])
    data = json.loads((tmp_path / "bl.json").read_text())
    assert rc == 0, [r.get("error") for r in data["rows"]]
    rows = {r["framework"]: r for r in data["rows"]}
    ref = data["raw"]["ddp"][0]["result"]["losses"]
    for fw in fws:
        losses = data["raw"][fw][0]["result"]["losses"]
        assert len(losses) == 3
        assert losses == pytest.approx(ref, rel=1e-4, abs=1e-4), fw
        assert rows[fw]["median_step_ms"] > 0
        assert rows[fw]["peak_rss_mib"] > 0
        assert rows[fw]["max_abs_loss_diff"] <= 1e-4, fw
    ratios = {q["ratio"]: q for q in data["ratios"]}
    assert "tiertrain3 / fsdp2" in ratios and "tiertrain2 / ddp" in ratios
    assert "## Ratios (same run)" in out.read_text()


@pytest.mark.timeout(300)
def test_tp_megatron_runs(tmp_path):
    """tiertrain's tp=2 MLP (with and without sequence parallelism) matches tp=1 and, when
    megatron-core is installed, Megatron's Column/RowParallelLinear; the report is written."""
    import tp_megatron

    out = tmp_path / "tp.md"
    rc = tp_megatron.main(["--hidden", "128", "--tokens", "64", "--rounds", "1", "--warmup", "1",
                           "--steps", "1", "--timeout", "240", "--out", str(out)])
    assert rc == 0  # non-zero when the numerical check fails
    text = out.read_text()
    assert "| tiertrain-tp2 |" in text and "| tiertrain-tp2-sp |" in text
    if tp_megatron.HAVE_MEGATRON:
        assert "| megatron-tp2-sp |" in text
        assert "tiertrain / Megatron, tp=2 + SP" in text
    else:
        assert "Megatron-Core not installed" in text


@pytest.mark.timeout(300)
def test_plan_to_train_small_takes_the_nvme_path(tmp_path):
    """`tiertrain plan` at a low stated RAM puts the 4 × 1024 GPT's optimizer on NVMe, and
    `tiertrain train --config <plan>` trains it (the loss falls); the report is written."""
    import plan_to_train

    out = tmp_path / "p2t.md"
    swap = tmp_path / "swap"
    rc = plan_to_train.main(["--small", "--steps", "3", "--swap-dir", str(swap), "--out", str(out)])
    assert rc == 0
    text = out.read_text()
    assert "optimizer → nvme" in text or "parameters → nvme" in text
    assert "(falls)" in text
    assert "| = **measured increase** (what the plan predicts) |" in text
    assert not swap.exists()  # the swap directory is removed afterwards


@pytest.mark.timeout(120)
def test_adamw_pass_runs(tmp_path):
    """The kernels-alone benchmark: the C pass and the torch.compile'd one beside the bare step."""
    import subprocess

    run = subprocess.run([sys.executable, os.path.join(HERE, "adamw_pass.py"), "--elements", "2e6", "--reps", "2",
                          "--out", str(tmp_path / "pass.md")], capture_output=True, text=True, timeout=110)
    assert run.returncode == 0, run.stderr[-2000:]
    text = (tmp_path / "pass.md").read_text()
    assert "| tiertrain's pass (AdamW + clip + bf16 copy), C |" in text and "Build, from a cold cache" in text


@pytest.mark.timeout(300)
def test_cpu_step_and_overlap_run(tmp_path):
    """The CPU-tier step benchmark (a small size, both kernels), its traces, and the overlap proxy."""
    import subprocess

    step = subprocess.run([sys.executable, os.path.join(HERE, "cpu_step.py"), "--elements", "2e7", "--rounds", "1",
                           "--reps", "1", "--out", str(tmp_path / "step.md")], capture_output=True, text=True, timeout=280)
    assert step.returncode == 0, step.stderr[-2000:]
    text = (tmp_path / "step.md").read_text()
    assert "stage 3, parameters and optimizer on CPU, compiled" in text and "× bare fused AdamW" in text
    traced = subprocess.run([sys.executable, os.path.join(HERE, "cpu_step.py"), "--trace", str(tmp_path / "t"),
                             "--trace-elements", "4e6"], capture_output=True, text=True, timeout=280)
    assert traced.returncode == 0, traced.stderr[-2000:]
    assert (tmp_path / "t-delayed.json.gz").exists() and (tmp_path / "t-sync.png").exists()
    assert (tmp_path / "t-overlapped.json.gz").exists()
    overlap = subprocess.run([sys.executable, os.path.join(HERE, "cpu_overlap.py"), "--d", "256", "--layers", "2",
                              "--batch", "8", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "o.md")],
                             capture_output=True, text=True, timeout=280)
    assert overlap.returncode == 0, overlap.stderr[-2000:]
    assert "| delayed update |" in (tmp_path / "o.md").read_text()
    assert "| overlapped with backward (compiled pass) |" in (tmp_path / "o.md").read_text()
