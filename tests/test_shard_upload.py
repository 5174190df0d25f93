"""Updated shards sent to the device through pinned chunks (tiertrain/zero/upload.py).

On an accelerator the CPU tier's step sends each updated shard to the device in the compute
dtype, chunk by chunk through a few pinned buffers, each chunk copied while the next is written:

* the device shard receives exactly the values written (a cast of the master: torch's own
  rounding), in chunks of the given size;
* a buffer is written again only once the copy that read it has (``Transfer.source_read``),
  and :meth:`ShardUpload.finish` orders the device after every copy (under the deferred-copy
  harness the shard holds NaN until then);
* the CPU pass sending its compute-dtype copy through it updates masters and moments to the
  same bits as the pass writing a host shard, and the device shards get the masters rounded;
* an engine on the emulated GPU host (whose shards at stage 2 stand for device memory) trains
  bit for bit as on the CPU, where the pass writes the shards in place; its buffers are reported.
"""
from __future__ import annotations

import pytest
import torch

from reference import engine_train, global_batches, make_config, make_model
from tiertrain.device import DEFER_COPIES_ENV, GPU_HOST_ENV, DeviceStreams
from tiertrain.update import host_adamw
from tiertrain.zero.upload import CHUNK, SLOTS, ShardUpload, upload_buffer_bytes

pytestmark = pytest.mark.timeout(60)


class RecordingStreams:
    """DeviceStreams' copy and host_empty, recording the order of copies and source reads."""

    def __init__(self):
        self.events = []

    def host_empty(self, numel, dtype):
        return torch.empty(numel, dtype=dtype)

    def copy(self, dst, src, kind):
        dst.copy_(src)
        n = sum(e[0] == "copy" for e in self.events)
        self.events.append(("copy", n, src.data_ptr()))
        return RecordedTransfer(self, n)


class RecordedTransfer:
    def __init__(self, streams, n):
        self.streams, self.n = streams, n

    def source_read(self):
        self.streams.events.append(("source_read", self.n))

    def wait(self):
        self.streams.events.append(("wait", self.n))


def test_a_shard_receives_the_values_cast_in_chunks_of_the_given_size():
    upload = ShardUpload(DeviceStreams(torch.device("cpu")), torch.bfloat16, chunk=7, slots=2)
    values = torch.randn(30, dtype=torch.float64) * 1e3
    shard = torch.zeros(30, dtype=torch.bfloat16)
    ranges = []
    for start, end, buffer in upload.chunks(shard):
        ranges.append((start, end))
        buffer.copy_(values[start:end])
    upload.finish()
    assert ranges == [(0, 7), (7, 14), (14, 21), (21, 28), (28, 30)]
    assert torch.equal(shard, values.to(torch.bfloat16))
    upload.send(shard, -values)
    upload.finish()
    assert torch.equal(shard, (-values).to(torch.bfloat16))


def test_a_buffer_is_written_again_only_once_its_copy_has_read_it():
    streams = RecordingStreams()
    upload = ShardUpload(streams, torch.float32, chunk=4, slots=2)
    upload.send(torch.zeros(16), torch.arange(16.0))
    copies = [e for e in streams.events if e[0] == "copy"]
    assert len(copies) == 4 and len({e[2] for e in copies}) == 2  # (two buffers, each used twice)
    # Chunk 3 reuses chunk 1's buffer: chunk 1's copy has read it before chunk 3 is written.
    assert streams.events.index(("source_read", 0)) < streams.events.index(copies[2])
    assert streams.events.index(("source_read", 1)) < streams.events.index(copies[3])
    assert not any(e[0] == "wait" for e in streams.events)
    upload.finish()
    assert [e for e in streams.events if e[0] == "wait"] == [("wait", n) for n in range(4)]
    upload.finish()  # (nothing left to wait for)
    assert len([e for e in streams.events if e[0] == "wait"]) == 4


def test_under_the_deferred_copy_harness_the_shard_holds_nan_until_finish(monkeypatch):
    monkeypatch.setenv(DEFER_COPIES_ENV, "1")
    upload = ShardUpload(DeviceStreams(torch.device("cpu")), torch.bfloat16, chunk=5, slots=3)
    shard = torch.zeros(12, dtype=torch.bfloat16)
    upload.send(shard, torch.ones(12))
    assert shard.isnan().all()
    upload.finish()
    assert torch.equal(shard, torch.ones(12, dtype=torch.bfloat16))


def test_buffers_are_allocated_by_use_up_to_slots_chunks():
    upload = ShardUpload(DeviceStreams(torch.device("cpu")), torch.bfloat16, chunk=100, slots=3)
    assert upload.nbytes == 0
    upload.send(torch.zeros(10, dtype=torch.bfloat16), torch.ones(10))
    assert upload.nbytes == 10 * 2
    upload.send(torch.zeros(1000, dtype=torch.bfloat16), torch.ones(1000))
    assert upload.nbytes == 3 * 100 * 2  # (three chunks of 100)
    # The estimator's bound, with the default chunk: SLOTS buffers of min(CHUNK, largest shard).
    assert upload_buffer_bytes(1000, 2) == SLOTS * 1000 * 2
    assert upload_buffer_bytes(10 ** 12, 2) == SLOTS * CHUNK * 2


def test_what_it_cannot_send_is_refused_by_name():
    upload = ShardUpload(DeviceStreams(torch.device("cpu")), torch.bfloat16)
    with pytest.raises(ValueError, match=r"sends contiguous torch.bfloat16 shards; got torch.float32 \(4,\)"):
        next(upload.chunks(torch.zeros(4)))
    with pytest.raises(ValueError, match=r"got torch.bfloat16 \(2,\), not contiguous"):
        next(upload.chunks(torch.zeros(4, dtype=torch.bfloat16)[::2]))
    with pytest.raises(ValueError, match=r"needs chunk >= 1 and slots >= 1; got chunk=0, slots=2"):
        ShardUpload(DeviceStreams(torch.device("cpu")), torch.bfloat16, chunk=0, slots=2)


class TargetsUpload:
    """The pass's Upload over given targets (as in_memory.PieceUpload does for the flat shards)."""

    def __init__(self, targets: dict, upload: ShardUpload):
        self.targets = targets
        self.chunks, self.send, self.finish = upload.chunks, upload.send, upload.finish

    def target_of(self, piece):
        return self.targets.get(id(piece))


def _pieces(seed: int):
    torch.manual_seed(seed)
    pieces = [torch.randn(host_adamw.SMALL_PIECE + 1001), torch.randn(host_adamw.SMALL_PIECE * 2), torch.randn(100)]
    for p in pieces:
        p.grad = torch.randn_like(p)
    return pieces, torch.optim.AdamW(pieces, lr=1e-2, weight_decay=0.1)


def test_the_pass_sending_through_the_upload_updates_as_the_pass_writing_host_shards():
    written, opt_written = _pieces(0)
    sent, opt_sent = _pieces(0)
    host = {id(p): torch.zeros(p.numel(), dtype=torch.bfloat16) for p in written}
    device = {id(p): torch.zeros(p.numel(), dtype=torch.bfloat16) for p in sent}
    by_host = host_adamw.HostAdamW(opt_written, lambda p: host[id(p)])
    upload = ShardUpload(DeviceStreams(torch.device("cpu")), torch.bfloat16, chunk=30_000, slots=2)
    by_upload = host_adamw.HostAdamW(opt_sent, lambda p: None, upload=TargetsUpload(device, upload))
    for _ in range(2):
        by_host.step(torch.tensor(0.5))
        by_upload.step(torch.tensor(0.5))
    for a, b in zip(written, sent):
        assert torch.equal(a, b)
        assert torch.equal(host[id(a)], device[id(b)])
        assert torch.equal(device[id(b)], b.to(torch.bfloat16))
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt_written.state[a][key], opt_sent.state[b][key])
    assert upload.nbytes == 2 * 30_000 * 2  # (the large pieces went in chunks of 30 000)


def _train(emulate: bool, monkeypatch, model=None, batches=None, **zero):
    monkeypatch.setenv(GPU_HOST_ENV, "1" if emulate else "0")
    monkeypatch.delenv(DEFER_COPIES_ENV, raising=False)
    monkeypatch.setattr(host_adamw, "SMALL_PIECE", 0)  # (every piece takes the pass)
    cfg = make_config(zero={"stage": 2, "offload_optimizer": "cpu", "bucket_mb": 0.02, **zero},
                      precision={"dtype": "bf16"}, batch={"micro_batch_size": 2},
                      optimizer={"lr": 1e-2, "grad_clip": 0.05, "impl": "compiled"})
    losses, params, engine = engine_train(0, 1, model or make_model(), cfg, batches or global_batches(3, 2))
    uploaded = [engine.flat.uploaded_shard(u.unit.index) is not None for u in engine.flat.units]
    shards = [u.shard.clone() for u in engine.flat.units]
    report = engine.memory_report()
    engine.close()
    return losses, params, uploaded, shards, report


def test_on_the_emulated_gpu_host_the_engine_sends_its_shards_and_trains_bit_for_bit_as_on_the_cpu(monkeypatch):
    losses, params, uploaded, shards, report = _train(True, monkeypatch)
    cpu_losses, cpu_params, cpu_uploaded, cpu_shards, cpu_report = _train(False, monkeypatch)
    assert all(uploaded) and not any(cpu_uploaded)
    assert losses == cpu_losses
    assert all(torch.equal(params[k], cpu_params[k]) for k in cpu_params)
    assert all(torch.equal(a, b) for a, b in zip(shards, cpu_shards))
    assert 0 < report.upload_buffers <= upload_buffer_bytes(max(s.numel() for s in shards), 2)
    assert cpu_report.upload_buffers == 0


@pytest.mark.parametrize("name, zero", [("llama-gqa", {}), ("t5", {}), ("llama-lora-frozen", {}),
                                        ("llama-gqa", {"delayed_update": True, "delayed_update_warmup": 1})],
                         ids=["llama", "t5", "lora adapters", "llama, delayed update"])
def test_hugging_face_models_train_bit_for_bit_when_their_shards_are_sent(monkeypatch, name, zero):
    """Foreign models with their own conventions (labels = input_ids, rotary buffers, an
    encoder-decoder, frozen weights beside LoRA adapters; fp32 weights wrapped at bf16): the
    shards sent through the chunk buffers on the emulated GPU host, or written in place on the
    CPU, give the same run bit for bit; also with the delayed update, whose worker writes the
    staging buffers that its publish sends."""
    zoo = pytest.importorskip("zoo")
    runs = [_train(emulate, monkeypatch, zoo.build(name), zoo.batches(name, 3, 2), **zero) for emulate in (True, False)]
    (losses, params, uploaded, shards, report), (cpu_losses, cpu_params, cpu_uploaded, cpu_shards, _) = runs
    assert any(uploaded) and not any(cpu_uploaded)
    assert losses == cpu_losses
    assert all(torch.equal(params[k], cpu_params[k]) for k in cpu_params)
    assert all(torch.equal(a, b) for a, b in zip(shards, cpu_shards))
    assert report.upload_buffers > 0
