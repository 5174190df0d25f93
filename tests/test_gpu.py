"""The GPU path on a GPU: `pytest -m gpu` (every test here is skipped without CUDA).

The CPU suite runs the same stream, event and copy calls (tiertrain/device.py) and checks
their waits with the deferred-copy harness (tests/test_deferred_copies.py); what only a GPU
can show is checked here:

* the copy stream overlaps compute: a host→device copy of a parameter-shard-sized pinned
  buffer issued on it while a matmul runs on the compute stream ends, by CUDA event timing,
  sooner than the two run one after the other;
* host buffers a device copies from are pinned (the CPU-tier shards, the gradient landing
  buffers, the activation-checkpoint pool), and asynchronous copies into them complete
  before the host reads them (Transfer.synchronize);
* an NCCL process group (one rank) runs the engine's collectives;
* the engine trains on the GPU at each tier like the single-process reference (float64 oracle).
"""
from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _elapsed_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def test_the_copy_stream_overlaps_compute():
    from tiertrain.device import Copy, DeviceStreams

    streams = DeviceStreams(torch.device("cuda"))
    host = streams.host_empty((64 << 20,), torch.float32)  # 256 MiB: a large shard
    assert host.is_pinned()
    dst = torch.empty_like(host, device="cuda")
    a = torch.randn(8192, 8192, device="cuda")

    def compute():
        for _ in range(4):
            a @ a

    def copy():
        streams.copy(dst, host, Copy.PARAM_TO_DEVICE).wait()

    for _ in range(2):  # (warm-up: cuBLAS handles, the copy stream)
        compute(), copy()
    alone = _elapsed_ms(compute) + _elapsed_ms(copy)

    def both():
        transfer = streams.copy(dst, host, Copy.PARAM_TO_DEVICE)
        compute()
        transfer.wait()
    together = _elapsed_ms(both)
    assert together < 0.9 * alone, f"copy and compute took {together:.1f} ms together, {alone:.1f} ms apart"


def test_a_device_to_host_transfer_has_landed_after_synchronize():
    from tiertrain.device import Copy, DeviceStreams

    streams = DeviceStreams(torch.device("cuda"))
    src = torch.arange(1 << 24, device="cuda", dtype=torch.float32)
    for _ in range(5):
        landed = streams.to_host(src * 2, Copy.GRAD_TO_HOST).synchronize()
        assert landed.is_pinned()
        assert torch.equal(landed, (src * 2).cpu())


def test_host_tier_buffers_are_pinned(tmp_path):
    from tiertrain.offload.buffers import AlignedBufferPool
    from tiertrain.zero.flat import Placement

    placement = Placement(torch.device("cuda"), optimizer_tier="cpu", param_tier="cpu")
    assert placement.empty(1024, torch.float32, placement.host).is_pinned()
    assert AlignedBufferPool(4 << 20, block_bytes=1 << 20).pinned


def _nccl_group():
    import os

    import torch.distributed as dist

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29531")
        dist.init_process_group("nccl", rank=0, world_size=1)


@pytest.mark.parametrize("zero", [{"stage": 3}, {"stage": 3, "offload_params": "cpu"},
                                  {"stage": 2, "offload_optimizer": "cpu"},
                                  {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"}],
                         ids=["stage3", "params-cpu", "optimizer-cpu", "both-cpu"])
def test_the_engine_trains_on_the_gpu_like_the_reference(zero):
    import tiertrain
    from reference import Oracle, global_batches, make_config, make_model, reference_train

    _nccl_group()
    cfg = make_config(zero={**zero, "bucket_mb": 0.02}, batch={"micro_batch_size": 4}, optimizer={"eps": 1e-3})
    batches = global_batches(3, 4)
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    assert engine.device.type == "cuda"
    losses = [engine.train_batch(iter([b])) for b in batches]
    params = {n: p.cpu() for n, p in engine.full_state_dict().items()}
    engine.close()
    Oracle.run(reference_train, make_model(), cfg, batches).check(losses, params, f"gpu {zero}")
