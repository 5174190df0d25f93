"""zero.retain_host_memory: buffers freed and allocated again every step reuse their pages.

Measured in fresh interpreters (the setting is process-wide and lasts), with the pattern
stage 3 has: a few unit-sized buffers gathered, used and freed, step after step.
"""
import json
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's mallopt")

_STEPS = """
import json, resource, sys, torch
if sys.argv[1] == "retain":  # ("default": glibc as configured by the environment)
    from tiertrain.host_memory import retain_freed_host_memory
    assert retain_freed_host_memory()
def step():  # three 20 MiB "gathered units", used and released in turn
    held = [torch.ones(5 * 2**20) for _ in range(3)]
    del held
step(); step()  # the heap grows to the pattern's size (it may still grow once more later)
faults = []
for _ in range(7):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(sorted(faults)[3]))  # the median step
"""


def _faults_per_step(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", _STEPS, mode], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_freed_buffers_are_reused_instead_of_faulted_in_again():
    # Without the setting glibc returns such blocks (mmap, heap trim) and faults in 10-100% of
    # their pages again every step, depending on its adaptive thresholds' history.
    pages_per_step = 3 * 20 * 2**20 // 4096
    retained = _faults_per_step("retain")
    assert retained < 0.02 * pages_per_step, retained


@pytest.mark.slow
def test_the_engine_applies_it_unless_disabled():
    code = """
import sys, torch, tiertrain
from tiertrain import host_memory
from tiertrain.config import Config, from_dict
cfg = from_dict(Config, {"zero": {"retain_host_memory": sys.argv[1] == "on"}}).validate()
tiertrain.wrap(torch.nn.Linear(4, 4), cfg, tiertrain.Topology.build(cfg.parallel), loss_fn=lambda m, b: m(b).sum())
print(host_memory._applied)
"""
    runs = {mode: subprocess.run([sys.executable, "-c", code, mode], capture_output=True, text=True, timeout=120)
            for mode in ("on", "off")}
    for mode, out in runs.items():
        assert out.returncode == 0, out.stderr
    assert runs["on"].stdout.split()[-1] == "True"
    assert runs["off"].stdout.split()[-1] == "None"
