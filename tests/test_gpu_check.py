"""bench/gpu.py, the one-command GPU check, end to end on the CPU: its --dry-run runs the GPU
suite with TIERTRAIN_GPU_TESTS_ON_CPU=1 and every row of the side-by-side table on a tiny GPT
over gloo, each in its own subprocess, and writes the report and the JSON lines. So the check is
known to work before a GPU's time is spent on it. Every row runs (30-60 s on 2 cores), except the
DeepSpeed ones where DeepSpeed is installed (see the test)."""
from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _bench_gpu():
    """bench/gpu.py as a module (for its rows), leaving sys.path as it was: bench/ holds
    modules (checkpoint.py, scale.py, ...) that must not shadow anything the suite imports."""
    path = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location("bench_gpu", os.path.join(ROOT, "bench", "gpu.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module  # (its dataclasses look their module up there)
        spec.loader.exec_module(module)
        return module
    finally:
        sys.path[:] = path


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_the_gpu_check_runs_end_to_end_on_the_cpu(tmp_path):
    gpu = _bench_gpu()
    out, jsonl = tmp_path / "gpu.md", tmp_path / "gpu.jsonl"
    names = list(gpu.ROWS)
    if importlib.util.find_spec("deepspeed") is not None:
        # Installed (bench/setup_env.sh): on the CPU its process group JIT-compiles an op, ~2 min
        # cold, beyond this test's time; without it the DeepSpeed rows must say "not importable".
        names = [n for n in names if gpu.ROWS[n].framework != "ds"]
    traced = "tt-z3-bothcpu-delayed"
    proc = subprocess.run([sys.executable, "bench/gpu.py", "--dry-run", "--out", str(out), "--jsonl", str(jsonl),
                           "--only", ",".join(names), "--trace", traced],
                          cwd=ROOT, capture_output=True, text=True, timeout=230)
    report = out.read_text() if out.exists() else ""
    # (rc 1: the suite failed or a row did not run; the checks below say which is allowed)
    assert proc.returncode in (0, 1), f"rc {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{report}"

    # The GPU suite ran (on the CPU) and passed; its summary line is in the report.
    assert re.search(r"## `TIERTRAIN_GPU_TESTS_ON_CPU=1 pytest -q -m gpu tests/test_gpu\.py[^`]*`: "
                     r"\d+ passed(, \d+ skipped)?(, \d+ warnings?)? in ", report), report
    assert " failed" not in report.split("## Side by side")[0], report

    records = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert "pytest" in records[0] and records[0]["pytest"]["rc"] == 0
    rows = {r["name"]: r for r in records[1:]}
    assert list(rows) == names, "every row, in order, once"
    for name, row in rows.items():
        assert row["label"] in report, f"{name}: not in the report"
        framework = gpu.ROWS[name].framework
        if framework in ("tt", "torch"):  # tiertrain's tiers (NVMe included) and plain torch must run
            assert row["status"] == "ok", f"{name}: {row}"
        elif framework == "ds":  # DeepSpeed, not installed: named as not importable
            assert row["status"] == "missing" and "No module named 'deepspeed'" in row["error"], f"{name}: {row}"
        else:  # FSDP2 rows: on the CPU where torch runs them
            assert row["status"] in ("ok", "error"), f"{name}: {row}"
    ran = [r for r in rows.values() if r["status"] == "ok"]
    for r in ran:  # one timed and one warm-up step, of the same model on the same data
        assert len(r["steps_s"]) == 2 and set(r["phases_s"]) == {"fwd", "bwd", "step"}, r
        assert r["peak_gpu_gib"] is None and r["device"] == "cpu (dry run)", r
        first = rows["torch-plain"]["losses"][0]
        assert abs(r["losses"][0] - first) < 1e-2 * first, f"{r['name']}: first loss {r['losses'][0]} vs {first}"
    assert report.count("| ok |") == len(ran)

    # tiertrain rows say their gradient norm and build split, overlapped ones what they kept;
    # issue 36's targets are read off the run; the traced row's step is a trace tiertrain reads.
    for name, row in rows.items():
        if gpu.ROWS[name].framework == "tt":
            assert {"grad_norm", "model_s", "wrap_s", "compile_in_wrap_s", "compiles_s"} <= set(row), row
            assert ("speculation" in row) == bool(gpu.ROWS[name].options.get("overlap_cpu_step")), row
    assert "## Targets (issue 36)" in report
    from tiertrain.observe.trace import load_spans

    assert rows[traced]["trace"]["file"] == f"trace-{traced}.json.gz"
    spans = load_spans(str(tmp_path / rows[traced]["trace"]["file"]))
    assert {"forward", "backward", "step"} <= {s.name for s in spans}
