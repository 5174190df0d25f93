"""zero.retain_host_memory: buffers freed and allocated again every step reuse their pages.

Measured in fresh interpreters (the setting is process-wide and lasts), with the pattern
stage 3 has: a few unit-sized buffers gathered, used and freed, step after step.
"""
import json
import platform
import subprocess
import sys

import pytest
import torch

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



class _Linears(torch.nn.Module):
    """Six bias-free 2900 × 2900 layers: one unit each, whose fp32 bucket (33.6 MB) lies above
    the 32 MiB that glibc serves from its heap at most."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(2900, 2900, bias=False) for _ in range(6))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.pow(2).mean()


def _train_recording_buckets(stage: int, retain: bool, accum: int):
    """Four steps of a one-rank engine on a CPU device: per step, the addresses of the blocks
    its buckets used, one per unit reduced; after each step, the bytes of spares the reducer
    keeps; the final parameters; the units with parameters; a unit's bucket bytes; the bytes
    kept after close()."""
    import tiertrain
    from reference import make_config

    cfg = make_config(zero={"stage": stage, "offload_optimizer": "cpu", "retain_host_memory": retain},
                      batch={"micro_batch_size": 2, "grad_accum_steps": accum})
    engine = tiertrain.wrap(_Linears(), cfg, tiertrain.Topology.build(cfg.parallel))
    reducer = engine.reducer
    a_parameter = {u.unit.index: engine.flat.params[u.unit.slots[0].name] for u in engine.flat.units if u.unit.slots}
    blocks: list[list[int]] = []
    subscription = reducer.subscribe(before_collective=lambda index: index in a_parameter and blocks[-1].append(
        reducer.accumulated_gradient(a_parameter[index]).untyped_storage().data_ptr()))
    spares = []
    inputs = torch.randn(4, accum, 2, 2900, generator=torch.Generator().manual_seed(1))
    for step in inputs:
        blocks.append([])
        for micro in step:
            engine.backward(engine(micro))
        engine.step()
        spares.append(reducer.spare_bytes)
    subscription.remove()
    params = list(engine.full_state_dict().values())
    units = len(a_parameter)
    bucket = 4 * max(u.unit.padded_numel for u in engine.flat.units)
    engine.close()
    return blocks, spares, params, units, bucket, reducer.spare_bytes


@pytest.mark.timeout(120)
# (stage 3 with accumulation takes ~18 s: run with the slow tests)
@pytest.mark.parametrize("stage,accum", [(2, 1), pytest.param(3, 2, marks=pytest.mark.slow)])
def test_backward_reuses_the_gradient_buckets_it_freed_on_a_cpu_device(stage, accum, one_torch_thread):
    """With zero.retain_host_memory the reducer keeps the buckets above 32 MiB that backward
    freed (as many as it used at once) and the next backward fills those, not new blocks that
    glibc maps and the kernel faults in; without it none is kept. Which memory a bucket uses
    changes no result: both runs end with the same parameters, bit for bit."""
    blocks, spares, params, units, bucket, after_close = _train_recording_buckets(stage, True, accum)
    assert units == 6 and [len(b) for b in blocks] == [units * accum] * 4, "every unit's reduction is recorded"
    # One filling and max_in_flight = 2 reducing; accumulating, each with its reduced shard.
    most = 3 if accum == 1 else 6
    assert len(set(blocks[-1])) <= most, f"{len(set(blocks[-1]))} blocks held the {len(blocks[-1])} buckets of a step"
    assert set(blocks[-1]) == set(blocks[-2]), "a step reuses the blocks of the step before"
    assert spares[-1] == spares[-2] == len(set(blocks[-1])) * bucket, (spares, bucket)
    assert after_close == 0, "close() keeps no spare"

    _, spares_off, params_off, _, _, _ = _train_recording_buckets(stage, False, accum)
    assert spares_off == [0] * 4
    assert all(torch.equal(a, b) for a, b in zip(params, params_off))
