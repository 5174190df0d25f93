"""The emulated accelerator host (TIERTRAIN_EMULATE_GPU_HOST=1, tiertrain/device.py): on a GPU
machine the host buffers an accelerator copies from and to are pinned, and pinned storage cannot
be resized; on the CPU nothing is pinned, so a resize of pinned memory (the NVMe tier's crash on
the first GPU run, issue 31) passes every CPU test unless the CPU run emulates that host.

Specification: under the switch, every host tensor that would be pinned on a GPU machine refuses
to resize and reports itself pinned; memory the tiers free in place is pageable; and the tiers
(CPU and NVMe, in place and transactional, with activation checkpoints on the CPU) train exactly
as without the switch. CI also runs the tier, NVMe, zoo and checkpoint tests under it (.ci/run).
"""
from __future__ import annotations

import gc

import pytest
import torch

from reference import engine_train, global_batches, make_config, make_model
from tiertrain.device import (GPU_HOST_ENV, emulated_pinned_bytes, emulating_gpu_host, free_storage, host_empty,
                              is_pinned, pins_host, renew_storage)
from tiertrain.testing import run_distributed
from tiertrain.tiers import Tier
from tiertrain.zero.flat import Placement

CPU = torch.device("cpu")


@pytest.fixture
def emulated(monkeypatch):
    monkeypatch.setenv(GPU_HOST_ENV, "1")


def test_pinned_host_memory_refuses_to_resize_and_says_it_is_pinned(emulated):
    t = host_empty((3, 5), torch.bfloat16, pinned=True)
    assert t.shape == (3, 5) and t.dtype == torch.bfloat16 and is_pinned(t) and is_pinned(t[1])
    with pytest.raises(RuntimeError, match="not resizable"):
        t.untyped_storage().resize_(0)
    with pytest.raises(RuntimeError, match=r"cannot free a \(3, 5\) torch.bfloat16 tensor in place.*pinned"):
        free_storage(t)
    plain = host_empty(7, torch.float32, pinned=False)
    assert not is_pinned(plain)
    free_storage(plain)
    assert plain.untyped_storage().nbytes() == 0 and plain.shape == (7,)
    renew_storage(plain)
    assert plain.untyped_storage().nbytes() == 28


def test_dropping_every_reference_gives_pinned_memory_back(emulated):
    gc.collect()  # (earlier tests' garbage first; 64 MiB dwarfs whatever else is freed meanwhile)
    before = emulated_pinned_bytes()
    t = host_empty(16 << 20, torch.float32, pinned=True)
    view = t[10:20]
    assert emulated_pinned_bytes() - before >= 64 << 20
    del t
    gc.collect()
    assert emulated_pinned_bytes() - before >= 64 << 20, "a view keeps the memory"
    del view
    gc.collect()
    assert emulated_pinned_bytes() - before < 1 << 20


def test_without_the_switch_or_an_accelerator_nothing_is_pinned(monkeypatch):
    monkeypatch.delenv(GPU_HOST_ENV, raising=False)
    assert not pins_host(CPU)
    with pytest.raises(RuntimeError, match="no accelerator"):
        host_empty(4, torch.float32, pinned=True)
    monkeypatch.setenv(GPU_HOST_ENV, "yes")
    with pytest.raises(ValueError, match=r"TIERTRAIN_EMULATE_GPU_HOST='yes' is invalid"):
        pins_host(CPU)


def test_the_tiers_place_host_memory_as_an_accelerator_host_would(emulated):
    placement = Placement(CPU, optimizer_tier="cpu", param_tier="nvme")
    assert is_pinned(placement.empty(8, torch.float32, Tier.CPU))
    assert is_pinned(placement.empty(8, torch.float32, Tier.NVME))
    assert not is_pinned(placement.empty(8, torch.float32, Tier.NVME, device_copies=False))
    assert not is_pinned(placement.empty(8, torch.float32, Tier.DEVICE)), "device memory is not host memory"


def _tier_runs(rank, world, zero, dtype, checkpoints):
    import os

    os.environ[GPU_HOST_ENV] = "1"  # (in the worker: the launcher's forkserver keeps the environment it started with)
    out = []
    for z in ({"stage": zero["stage"]}, zero):
        activations = {"checkpoint_every": 1, "offload": "cpu"} if checkpoints and z is zero else {}
        cfg = make_config(zero={"bucket_mb": 0.02, **z}, precision={"dtype": dtype}, activations=activations,
                          batch={"micro_batch_size": 2, "grad_accum_steps": 2}, optimizer={"grad_clip": 0.0})
        losses, params, engine = engine_train(rank, world, make_model(), cfg, global_batches(3, 8))
        pinned = {"shards": [is_pinned(u.shard) for u in engine.flat.units if not u.unit.resident],
                  "masters": [is_pinned(u.master) for u in engine.flat.units if u.master.numel()]}
        out.append((losses, params, pinned))
    return out, emulating_gpu_host()



@pytest.mark.timeout(90)
@pytest.mark.parametrize("zero,dtype,checkpoints", [
    ({"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme"}, "fp32", False),
    ({"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_in_place": True}, "bf16", True),
    ({"stage": 3, "offload_params": "nvme", "offload_optimizer": "cpu"}, "bf16", False),
    ({"stage": 2, "offload_optimizer": "nvme", "nvme_in_place": True}, "fp32", False),
    ({"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"}, "bf16", True),
], ids=["nvme-both", "nvme-both-in-place-bf16-ckpt-cpu", "params-nvme-opt-cpu-bf16", "opt-nvme-in-place",
        "both-cpu-bf16-ckpt-cpu"])
def test_every_tier_trains_on_an_emulated_accelerator_host_as_on_the_cpu(emulated, tmp_path, zero, dtype,
                                                                          checkpoints):
    """The NVMe tiers crashed at wrap() on a GPU (a pinned shard resized to nothing after its
    write); on the emulated host they must build and train bit for bit as stage 3 on the device."""
    if "nvme" in zero.values():
        zero = {**zero, "nvme_path": str(tmp_path / "swap")}
    ((base_losses, base_params, _), (losses, params, pinned)), emulated_there = run_distributed(
        _tier_runs, 2, zero, dtype, checkpoints, timeout=80)[0]
    assert emulated_there
    assert losses == base_losses
    assert all(torch.equal(params[k], base_params[k]) for k in params)
    if zero.get("offload_params") == "cpu":
        assert all(pinned["shards"]), "CPU-tier shards are what the device copies from"
    if zero.get("offload_params") == "nvme":
        assert not any(pinned["shards"]), "NVMe shards are freed in place after their write"
    if zero.get("offload_optimizer") == "cpu":
        assert all(pinned["masters"]), "masters are published to the device from the host"


def test_pinned_memory_is_allocated_and_memory_freed_in_place_only_through_tiertrain_device():
    """One place decides what is pinned and what may be resized (tiertrain/device.py): a
    ``pin_memory`` or a ``resize_`` elsewhere would bypass the emulated host's check (the hardware
    probe, which measures pinned copies on a real GPU, excepted)."""
    import io
    import pathlib
    import tokenize

    import tiertrain

    def uses(path: pathlib.Path) -> list[int]:
        """Lines whose code (not a string or comment: a DeepSpeed key named pin_memory is
        fine) names pin_memory or calls resize_."""
        tokens = [t for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                  if t.type in (tokenize.NAME, tokenize.OP)]
        return [t.start[0] for t, after in zip(tokens, tokens[1:] + [None])
                if t.type == tokenize.NAME and (t.string == "pin_memory" or
                                                (t.string == "resize_" and after is not None and after.string == "("))]

    root = pathlib.Path(tiertrain.__file__).parent
    allowed = {"device.py", "estimate/probe.py"}
    found = [f"{path.relative_to(root)}:{n}" for path in sorted(root.rglob("*.py"))
             if str(path.relative_to(root)) not in allowed for n in uses(path)]
    assert not found, f"pinned allocation or in-place resize outside tiertrain/device.py: {found}"
    assert uses(root / "device.py"), "(the scan finds them where they are)"
