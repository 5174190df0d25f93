"""The GPU path on a GPU: `pytest -m gpu` (every test here is marked gpu and skipped without CUDA).

The CPU suite runs the same stream, event and copy calls (tiertrain/device.py) and checks their
waits with the deferred-copy harness (tests/test_deferred_copies.py); what only a GPU can show is
checked here:

* the copy stream overlaps compute: a host→device copy from a pinned buffer and a run of matmuls
  sized to take as long as the copy (each measured alone first) end, by CUDA event timing, about
  when the longer of the two alone would;
* host buffers a device copies from are pinned, and asynchronous copies into them have landed
  before the host reads them (Transfer.synchronize);
* an NCCL process group (one rank) runs the engine's collectives;
* the engine trains on the GPU like the single-process reference at every tier, the NVMe ones
  included: fp32 within the float64 oracle's bound, bf16 within tests/test_engine.py's bf16
  bounds of the fp32 reference; a Hugging Face Llama at stage 3 with both tiers on the CPU;
  activation checkpoints offloaded to the CPU;
* the CPU tier's step sends its updated shards to the device through pinned chunk buffers
  (tiertrain/zero/upload.py), each reused within a step, and trains like the reference;
* a checkpoint saved on the GPU resumes bit for bit, and save_pretrained / the offline export
  hold the fp32 masters bit for bit.

``TIERTRAIN_GPU_TESTS_ON_CPU=1`` runs the module on the CPU (a gloo group of one, nothing skipped
for want of CUDA): the way to prove the tests themselves before GPU time is spent. Only what
needs CUDA itself (event timing, pinned memory) is skipped then, inside the tests that need it;
stage 3 then gathers ahead as it does on CUDA (zero.prefetch_mb 64, the engine's CUDA default).
"""
from __future__ import annotations

import os
import statistics

import pytest
import torch

from tiertrain.device import env_flag

ON_CPU_ENV = "TIERTRAIN_GPU_TESTS_ON_CPU"


ON_CPU = env_flag(ON_CPU_ENV, "run tests/test_gpu.py on the CPU")
DEVICE = torch.device("cpu") if ON_CPU else torch.device("cuda", 0)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_CPU and not torch.cuda.is_available(),
                                 reason=f"needs a CUDA device (or {ON_CPU_ENV}=1 to run on the CPU)")]


def _skip_without_cuda(what: str) -> None:
    if ON_CPU:
        pytest.skip(f"{what} needs CUDA ({ON_CPU_ENV}=1 runs this module on the CPU)")


STEPS, MICRO = 3, 4
# eps 1e-3: Adam with eps far below |g| turns rounding differences into lr-sized steps (test_engine.py).
OPTIMIZER = {"eps": 1e-3}
# bf16 compute with fp32 masters against the fp32 reference: tests/test_engine.py's bounds
# (test_bf16_tracks_fp32_reference: measured ≤ 6e-5 loss, ≤ 2.3e-2 parameters on the CPU).
BF16_LOSS_TOL, BF16_PARAM_TOL = 1e-3, 4e-2


@pytest.fixture(scope="module", autouse=True)
def process_group():
    """An NCCL group of one on the GPU (a gloo group of one under ON_CPU_ENV), made by this
    module and destroyed after it, so the engine runs its real collectives."""
    import torch.distributed as dist

    if dist.is_initialized():  # (another module's group: use it as it is)
        yield
        return
    import socket

    with socket.socket() as s:  # (a port free now: several sessions may share the host)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo" if ON_CPU else "nccl", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


# -- the device's streams and host buffers ------------------------------------------------------

def _elapsed_ms(fn) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end)


def _median_ms(fn, repeats: int = 5) -> float:
    return statistics.median(_elapsed_ms(fn) for _ in range(repeats))


def test_the_copy_stream_overlaps_compute():
    """Sized so that neither side hides the other: the matmul count is calibrated from the
    measured time of one matmul and of the copy, so compute alone ≈ copy alone. Perfect overlap
    then takes max(alone) ≈ half the sum; serialised copies take the sum."""
    _skip_without_cuda("CUDA event timing of a pinned host→device copy")
    from tiertrain.device import Copy, DeviceStreams

    streams = DeviceStreams(DEVICE)
    host = streams.host_empty((64 << 20,), torch.float32)  # 256 MiB: a large shard
    assert host.is_pinned()
    dst = torch.empty_like(host, device=DEVICE)
    a = torch.randn(2048, 2048, device=DEVICE)  # small enough for a fine-grained count

    def copy():
        streams.copy(dst, host, Copy.PARAM_TO_DEVICE).wait()

    for _ in range(3):  # (warm-up: cuBLAS handle, the copy stream, clocks)
        a @ a, copy()
    copy_ms, matmul_ms = _median_ms(copy), _median_ms(lambda: a @ a)
    matmuls = max(1, round(copy_ms / matmul_ms))

    def compute():
        for _ in range(matmuls):
            a @ a

    def both():
        transfer = streams.copy(dst, host, Copy.PARAM_TO_DEVICE)  # (issued first: waits on nothing queued)
        compute()
        transfer.wait()

    compute_ms = _median_ms(compute)
    together = _median_ms(both)
    numbers = (f"copy alone {copy_ms:.2f} ms, {matmuls} matmuls alone {compute_ms:.2f} ms, "
               f"together {together:.2f} ms")
    assert 0.5 < compute_ms / copy_ms < 2, f"the calibration failed to balance the two: {numbers}"
    assert together < 0.8 * (copy_ms + compute_ms), f"no overlap: {numbers}"
    assert together <= 1.15 * max(copy_ms, compute_ms), f"overlap, but not of the whole copy: {numbers}"


def test_a_device_to_host_transfer_has_landed_after_synchronize():
    from tiertrain.device import Copy, DeviceStreams

    streams = DeviceStreams(DEVICE)
    src = torch.arange(1 << 24, device=DEVICE, dtype=torch.float32)
    for _ in range(5):
        landed = streams.to_host(src * 2, Copy.GRAD_TO_HOST).synchronize()
        assert landed.device.type == "cpu"
        if not ON_CPU:
            assert landed.is_pinned()
        assert torch.equal(landed, (src * 2).cpu())


def test_host_tier_buffers_are_pinned():
    """The CPU tiers' shards, masters and gradient shards of a live engine, and the NVMe buffer pool."""
    _skip_without_cuda("pinned host memory")
    import tiertrain
    from reference import make_config, make_model
    from tiertrain.io.buffers import AlignedBufferPool

    cfg = make_config(zero={"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu", "bucket_mb": 0.02},
                      batch={"micro_batch_size": MICRO})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel, device=DEVICE))
    try:
        partitioned = [u for u in engine.flat.units if not u.unit.resident]
        assert partitioned, "every unit is resident: nothing is on the CPU tier"
        for u in partitioned:
            for kind in ("shard", "master", "grad"):
                t = getattr(u, kind)
                assert t.device.type == "cpu" and t.is_pinned(), f"unit {u.unit.index}: {kind} is not pinned"
    finally:
        engine.close()
    assert AlignedBufferPool(4 << 20, block_bytes=1 << 20).pinned


# -- the engine against the single-process reference -------------------------------------------

TIERS = {
    "stage3": {"stage": 3},
    "params-cpu": {"stage": 3, "offload_params": "cpu"},
    "optimizer-cpu": {"stage": 2, "offload_optimizer": "cpu"},
    "both-cpu": {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"},
    "optimizer-nvme": {"stage": 2, "offload_optimizer": "nvme"},
    "both-nvme": {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme"},
}
BF16_TIERS = ["stage3", "params-cpu", "optimizer-cpu", "both-cpu", "both-nvme"]


def _config(zero: dict, tmp_path, **sections):
    from reference import make_config

    zero = {**zero, "bucket_mb": 0.02}  # small buckets: several units, reductions during backward
    if ON_CPU and zero["stage"] == 3:  # (the engine's CUDA default, 0 on the CPU: the GPU's gathers ahead)
        zero["prefetch_mb"] = 64.0
    if "nvme" in zero.values():
        zero["nvme_path"] = str(tmp_path / "swap")
    return make_config(zero=zero, batch={"micro_batch_size": MICRO},
                       optimizer={**OPTIMIZER, **sections.pop("optimizer", {})}, **sections)


def _train(model, cfg, batches, after=None):
    """(losses, fp32 parameters on the CPU, the engine's memory report) of the engine on DEVICE;
    after(engine) runs before it is closed."""
    import tiertrain

    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel, device=DEVICE))
    try:
        assert engine.device.type == DEVICE.type
        losses = [engine.train_batch(iter([b])) for b in batches]
        params = {n: p.cpu() for n, p in engine.full_state_dict().items()}
        extra = after(engine) if after is not None else None
        return losses, params, engine.memory_report(), extra
    finally:
        engine.close()


def _check_bf16(losses, params, ref_losses, ref_params, what: str) -> None:
    """tests/test_engine.py's bf16 check: bf16 rounding (2^-8) dominates any fp32 noise, so the
    run is held to fixed bounds of the fp32 reference rather than to the oracle."""
    from reference import max_rel_diff

    loss_err = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses, strict=True))
    param_err = max_rel_diff(params, ref_params)
    assert loss_err <= BF16_LOSS_TOL, f"{what}: losses differ by {loss_err:.2e} (bound {BF16_LOSS_TOL:g})"
    assert param_err <= BF16_PARAM_TOL, f"{what}: parameters differ by {param_err:.2e} (bound {BF16_PARAM_TOL:g})"


@pytest.mark.parametrize("tier", list(TIERS))
def test_the_engine_trains_on_the_gpu_like_the_reference(tier, tmp_path):
    from reference import Oracle, global_batches, make_model, reference_train

    cfg = _config(TIERS[tier], tmp_path)
    batches = global_batches(STEPS, MICRO)
    losses, params, mem, _ = _train(make_model(), cfg, batches)
    in_nvme = {"optimizer": cfg.zero.offload_optimizer == "nvme", "params": cfg.zero.offload_params == "nvme"}
    assert mem.nvme_tier == sum(getattr(mem, kind) for kind, there in in_nvme.items() if there)
    Oracle.run(reference_train, make_model(), cfg, batches).check(losses, params, f"{DEVICE.type} {tier}")


def test_the_nvme_optimizer_steps_during_backward_on_the_gpu(tmp_path):
    """grad_clip 0: each unit is updated from NVMe as soon as its gradient is reduced
    (tiertrain/update/nvme/overlapped_step.py), on its own thread while backward goes on."""
    from reference import Oracle, global_batches, make_model, reference_train

    cfg = _config(TIERS["optimizer-nvme"], tmp_path, optimizer={"grad_clip": 0.0})
    batches = global_batches(STEPS, MICRO)
    losses, params, _, overlapped = _train(make_model(), cfg, batches, after=lambda e: e.last_overlapped_step)
    assert overlapped is not None and overlapped["shards"] > 1, f"the step did not overlap backward: {overlapped}"
    Oracle.run(reference_train, make_model(), cfg, batches).check(losses, params, f"{DEVICE.type} nvme in backward")


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_cpu_tier_sends_its_updated_shards_to_the_gpu_in_chunks(dtype, tmp_path, monkeypatch):
    """Stage 2, optimizer on the CPU: every piece takes the CPU pass (SMALL_PIECE 0), which sends
    its compute-dtype copy to the device's shard through the pinned chunk buffers
    (tiertrain/zero/upload.py), chunks of 1000 elements so that each buffer is reused many times
    within a step; the run trains like the reference and the shards are the masters rounded."""
    import tiertrain
    from reference import Oracle, global_batches, make_model, reference_train
    from tiertrain.device import GPU_HOST_ENV
    from tiertrain.update import host_adamw
    from tiertrain.zero.upload import SLOTS

    if ON_CPU:  # (the emulated GPU host: stage 2's shards stand for device memory)
        monkeypatch.setenv(GPU_HOST_ENV, "1")
    monkeypatch.setattr(host_adamw, "SMALL_PIECE", 0)
    cfg = _config(TIERS["optimizer-cpu"], tmp_path, precision={"dtype": dtype}, optimizer={"impl": "compiled"})
    batches = global_batches(STEPS, MICRO)
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel, device=DEVICE))
    try:
        engine.flat.upload.chunk = 1000
        assert all(engine.flat.uploaded_shard(u.unit.index) is not None for u in engine.flat.units)
        losses = [engine.train_batch(iter([b])) for b in batches]
        params = {n: p.cpu() for n, p in engine.full_state_dict().items()}
        assert all(torch.equal(u.shard[:u.master.numel()].cpu(), u.master.to(u.shard.dtype))
                   for u in engine.flat.units)
        element = 2 if dtype == "bf16" else 4
        assert engine.memory_report().upload_buffers == SLOTS * 1000 * element
    finally:
        engine.close()
    if dtype == "fp32":
        Oracle.run(reference_train, make_model(), cfg, batches).check(losses, params, f"{DEVICE.type} sent in chunks")
    else:
        ref_losses, ref_params = reference_train(make_model(), _config(TIERS["optimizer-cpu"], tmp_path), batches)
        _check_bf16(losses, params, ref_losses, ref_params, f"{DEVICE.type} bf16 sent in chunks")


@pytest.mark.parametrize("tier", BF16_TIERS)
def test_bf16_on_the_gpu_tracks_the_fp32_reference(tier, tmp_path):
    from reference import global_batches, make_model, reference_train

    batches = global_batches(STEPS, MICRO)
    losses, params, _, _ = _train(make_model(), _config(TIERS[tier], tmp_path, precision={"dtype": "bf16"}), batches)
    ref_losses, ref_params = reference_train(make_model(), _config(TIERS[tier], tmp_path), batches)
    _check_bf16(losses, params, ref_losses, ref_params, f"{DEVICE.type} bf16 {tier}")


def test_activation_checkpoints_offloaded_to_the_cpu_train_like_the_reference(tmp_path):
    """Every block's input leaves the device after forward and comes back for its recomputation."""
    from reference import Oracle, global_batches, make_model, reference_train

    cfg = _config(TIERS["both-cpu"], tmp_path, activations={"checkpoint_every": 1, "offload": "cpu"})
    batches = global_batches(STEPS, MICRO)
    losses, params, mem, _ = _train(make_model(), cfg, batches)
    tiny = make_model().config
    expected = tiny.n_layers * MICRO * tiny.seq_len * tiny.hidden * 4  # every block's fp32 input
    assert mem.activation_checkpoints == mem.activation_checkpoints_cpu == expected, mem
    Oracle.run(reference_train, make_model(), cfg, batches).check(losses, params,
                                                                   f"{DEVICE.type} activations offloaded")


LLAMA_VOCAB = 128


def _llama():
    """A tiny Llama with grouped-query attention (4 query heads, 2 key/value heads), its loss
    as tests/zoo.py computes it (no cast that would round the float64 reference)."""
    transformers = pytest.importorskip("transformers")
    import zoo

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=LLAMA_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    model.loss_function = zoo.causal_lm_loss
    return model.train()


def test_a_hugging_face_llama_at_stage_3_with_both_tiers_on_the_cpu(tmp_path):
    """As tests/test_zoo.py checks its models: the float64 oracle's bound, every name present."""
    from reference import Oracle, global_batches, reference_train

    batches = [{"input_ids": b["input_ids"] % LLAMA_VOCAB, "labels": b["input_ids"] % LLAMA_VOCAB}
               for b in global_batches(STEPS, MICRO)]
    cfg = _config(TIERS["both-cpu"], tmp_path)
    losses, params, _, _ = _train(_llama(), cfg, batches)
    oracle = Oracle.run(reference_train, _llama(), cfg, batches)
    assert set(params) == set(oracle.params64), "full_state_dict() names differ from the model's"
    assert oracle.losses64[-1] < oracle.losses64[0], "the reference itself must learn"
    oracle.check(losses, params, f"{DEVICE.type} llama, stage 3, params+optimizer on cpu")


# -- checkpoints and export ---------------------------------------------------------------------

def _read_safetensors(directory) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out = {}
    for name in sorted(os.listdir(directory)):
        if name.endswith(".safetensors"):
            out.update(load_file(os.path.join(directory, name)))
    return out


def _same(a: dict, b: dict) -> list[str]:
    """Names whose tensors differ (or are missing from either side)."""
    return sorted(n for n in set(a) | set(b) if n not in a or n not in b or not torch.equal(a[n].cpu(), b[n].cpu()))


@pytest.mark.parametrize("tier", ["stage3", "both-cpu", "both-nvme"])
def test_a_checkpoint_saved_on_the_gpu_resumes_bit_for_bit_and_exports_the_masters(tier, tmp_path):
    """Two steps, save; a third step in the saving engine and in a fresh engine (other initial
    weights) that loaded the checkpoint: the same loss and parameters, bit for bit. Then the
    live export (save_pretrained) and the offline one (tiertrain.state.consolidate) of the checkpoint
    hold the masters bit for bit, and load_pretrained brings them into another engine.
    Attention runs as plain matmuls (the math SDPA kernel): the fused kernels' backward may add
    in a different order on each call, which would make equal runs differ in the last bit."""
    import tiertrain
    from reference import global_batches, make_model
    from tiertrain.state.consolidate import export_checkpoint
    from torch.nn.attention import SDPBackend, sdpa_kernel

    batches = global_batches(STEPS, MICRO)

    def engine(seed: int, name: str):
        cfg = _config(TIERS[tier], tmp_path / name)
        return tiertrain.wrap(make_model(seed=seed), cfg, tiertrain.Topology.build(cfg.parallel, device=DEVICE))

    ckpt, live, offline = str(tmp_path / "ckpt"), str(tmp_path / "live"), str(tmp_path / "offline")
    with sdpa_kernel([SDPBackend.MATH]):
        first = engine(0, "first")
        try:
            for b in batches[:2]:
                first.train_batch(iter([b]))
            first.save_checkpoint(ckpt)
            saved = first.full_state_dict()
            first.save_pretrained(live)
            loss = first.train_batch(iter([batches[2]]))
            after = first.full_state_dict()
        finally:
            first.close()
        second = engine(5, "second")
        try:
            second.load_checkpoint(ckpt)
            assert not _same(second.full_state_dict(), saved), "the loaded masters differ from the saved ones"
            resumed_loss = second.train_batch(iter([batches[2]]))
            resumed = second.full_state_dict()
            assert resumed_loss == loss, f"resumed loss {resumed_loss!r} != {loss!r}"
            assert not _same(resumed, after), f"resumed parameters differ: {_same(resumed, after)}"
            tiertrain.load_pretrained(second, live)
            assert not _same(second.full_state_dict(), saved), "load_pretrained did not restore the exported values"
        finally:
            second.close()
    assert not _same(_read_safetensors(live), saved), "save_pretrained wrote other values than the masters"
    export_checkpoint(ckpt, offline)
    assert not _same(_read_safetensors(offline), saved), "the offline export wrote other values than the masters"
