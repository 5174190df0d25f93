"""Every example in examples/ runs, in a fast configuration (issue 35, item 6: the README's
complete script crashed at its first log line, and no test ran it). A new example without a
runner here fails the first test."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLES = os.path.join(ROOT, "examples")

RUNNERS = {
    "train_custom_model.py": ["{python}", "{example}", "--nproc", "2", "--stage", "3", "--steps", "20"],
    "gpt_small.yaml": ["{python}", "-m", "tiertrain.cli", "train", "--config", "{example}", "--steps", "2",
                       "--nproc", "1", "--logging.progress", "false", "--checkpoint.dir", "{tmp}/ckpt",
                       "--data.cache_dir", "{tmp}/cache", "--logging.metrics_file", "{tmp}/metrics.jsonl"],
}
ELSEWHERE = {"trainer_quickstart.py": "tests/test_trainer.py::test_the_quickstart_example_trains_evaluates_and_resumes"}


def test_every_example_has_a_runner():
    present = sorted(os.listdir(EXAMPLES))
    assert sorted(set(RUNNERS) | set(ELSEWHERE)) == present, "an example without a test"


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", sorted(RUNNERS))
def test_the_example_runs(name, tmp_path):
    args = [a.format(python=sys.executable, example=os.path.join(EXAMPLES, name), tmp=tmp_path)
            for a in RUNNERS[name]]
    done = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=140)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-3000:])
    if name == "train_custom_model.py":
        assert "done: loss" in done.stdout, done.stdout[-2000:]
