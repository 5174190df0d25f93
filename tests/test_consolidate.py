"""`tiertrain export`: a sharded checkpoint written as a Hugging Face checkpoint offline (one
process, no model code, no torch.distributed), tensor by tensor. The result loads with
``from_pretrained`` with no missing or unexpected tensor and holds the engine's fp32 values bit
for bit (or them cast to bf16); the process's memory stays near one tensor, not the model.

One launch of 2 gloo ranks trains and saves every case; the export runs in this process (and,
for the memory bound, in a fresh subprocess whose peak RSS is read)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import tiertrain
from reference import make_config, rank_slices
from tiertrain.state.checkpoint import CheckpointError
from tiertrain.cli import main
from tiertrain.state.consolidate import export_checkpoint
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402

WORLD, MICRO, STEPS = 2, 2, 2
PROBE = torch.arange(2 * 8).reshape(2, 8) % 251
"""A batch the exported model and the trained one must give the same logits for."""


def _llama_big():
    """About 12.7M parameters (51 MB in fp32), none over 1 MiB: enough for RSS to tell one tensor
    (and the allocator's few MB of slack) from the model."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=1024, num_hidden_layers=12, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))


BUILDERS = {"llama": zoo.llama_gqa, "gpt2": zoo.gpt2_tied, "big": _llama_big, "bart": zoo.bart, "lora": zoo.lora,
            "mixtral": zoo.mixtral}
CASES = {
    "llama3": ("llama", {"stage": 3}),
    "gpt2_1": ("gpt2", {"stage": 1}),
    "llama3_nvme": ("llama", {"stage": 3, "offload_optimizer": "nvme", "nvme_chunk_mb": 0.01}),
    "big2": ("big", {"stage": 2}),
    "gpt2_0": ("gpt2", {"stage": 0}),
    "bart3": ("bart", {"stage": 3}),
    "lora3": ("lora", {"stage": 3}),
    "lora1": ("lora", {"stage": 1}),
    "mixtral3": ("mixtral", {"stage": 3}),
}


def _case(rank: int, world: int, root: str, label: str) -> dict:
    name, zero = CASES[label]
    base = os.path.join(root, label)
    if "nvme" in zero.values():
        zero = {**zero, "nvme_path": os.path.join(base, "swap")}
    cfg = make_config(zero=zero, batch={"micro_batch_size": MICRO}, optimizer={"eps": 1e-3})
    torch.manual_seed(0)
    model = BUILDERS[name]()
    if name != "bart":
        model.loss_function = zoo.causal_lm_loss
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    batches = [{"input_ids": b["input_ids"], "labels": b["input_ids"]}
               for b in zoo.global_batches(STEPS, MICRO * WORLD, seq_len=zoo.SEQ)]
    for batch in batches:
        engine.train_batch(rank_slices(batch, rank, world, MICRO, 1))
    full = engine.full_state_dict()
    full.update({n: b.detach().float().clone() for n, b in engine.module.named_buffers()
                 if n.endswith("final_logits_bias")})  # (BART's persistent buffer)
    engine.save_checkpoint(os.path.join(base, "ckpt"))
    engine.close()  # (the module is left holding the trained values, as a plain module)
    out = {"full": full}
    if name == "llama":
        with torch.no_grad():
            out["logits"] = model(input_ids=PROBE).logits
    return out if rank == 0 else {}


def _all(rank: int, world: int, root: str) -> dict:
    return {label: _case(rank, world, root, label) for label in CASES}


@pytest.fixture(scope="module")
def saved(tmp_path_factory, one_torch_thread):
    root = str(tmp_path_factory.mktemp("consolidate"))
    return root, run_distributed(_all, WORLD, root, timeout=200)[0]


def _load(out: str):
    with open(os.path.join(out, "config.json")) as f:
        auto = transformers.AutoModelForSeq2SeqLM if json.load(f)["model_type"] == "bart" \
            else transformers.AutoModelForCausalLM
    model, info = auto.from_pretrained(out, output_loading_info=True)
    return model, info


def _check_loads(saved, label: str, tmp_path, capsys) -> tuple:
    root, results = saved
    out = str(tmp_path / f"{label}_fp32")
    assert main(["export", os.path.join(root, label, "ckpt"), out]) == 0
    printed = capsys.readouterr().out
    assert "tensors:" in printed and "peak" in printed and "model.safetensors" in printed
    model, info = _load(out)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert not info.get("mismatched_keys"), info
    full = results[label]["full"]
    state = model.state_dict()
    for name, value in full.items():
        assert state[name].dtype == torch.float32
        assert torch.equal(state[name], value), name
    return full, out, model


@pytest.mark.timeout(200)
def test_llama_stage3_loads_bit_for_bit_and_bf16(saved, tmp_path, capsys):
    full, out, model = _check_loads(saved, "llama3", tmp_path, capsys)
    assert isinstance(model, transformers.LlamaForCausalLM)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]
    root, _ = saved
    out_bf16 = str(tmp_path / "llama3_bf16")
    assert main(["export", os.path.join(root, "llama3", "ckpt"), out_bf16, "--dtype", "bf16",
                 "--max-shard-bytes", "16384"]) == 0
    assert os.path.exists(os.path.join(out_bf16, "model.safetensors.index.json"))
    model_bf16, info = _load(out_bf16)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    state = model_bf16.state_dict()
    for name, value in full.items():
        assert state[name].dtype == torch.bfloat16
        assert torch.equal(state[name], value.to(torch.bfloat16)), name


@pytest.mark.timeout(200)
def test_gpt2_tied_stage1(saved, tmp_path, capsys):
    _, out, model = _check_loads(saved, "gpt2_1", tmp_path, capsys)
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    assert "transformer.wte.weight" in keys and "lm_head.weight" not in keys  # (the tied copy, as HF writes)
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()


@pytest.mark.timeout(200)
def test_gpt2_stage0_every_rank_whole(saved, tmp_path, capsys):
    _check_loads(saved, "gpt2_0", tmp_path, capsys)


@pytest.mark.timeout(200)
def test_mixtral_experts_are_written_as_transformers_writes_them(saved, tmp_path, capsys):
    """Issue 34, item 7: the offline export converts as the model's own save_pretrained does
    (one tensor per expert, under block_sparse_moe), from the model rebuilt on the meta device
    from the recorded config; from_pretrained loads it with nothing missing."""
    _, out, model = _check_loads(saved, "mixtral3", tmp_path, capsys)
    from safetensors import safe_open

    with safe_open(os.path.join(out, "model.safetensors"), framework="pt") as f:
        keys = set(f.keys())
    torch.manual_seed(0)
    zoo.mixtral().save_pretrained(str(tmp_path / "hf"))
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), framework="pt") as f:
        assert keys == set(f.keys())
    assert "model.layers.1.block_sparse_moe.experts.3.w2.weight" in keys


@pytest.mark.timeout(200)
def test_bart_persistent_buffer_and_shared_embedding(saved, tmp_path, capsys):
    _, out, model = _check_loads(saved, "bart3", tmp_path, capsys)
    assert isinstance(model, transformers.BartForConditionalGeneration)
    root, _ = saved
    step_dir = next(p for p in os.scandir(os.path.join(root, "bart3", "ckpt")) if p.name.startswith("step_"))
    with open(os.path.join(step_dir.path, "export.json")) as f:
        assert "final_logits_bias" in json.load(f)["held"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("label", ["lora3", "lora1"])
def test_frozen_backbone(saved, tmp_path, label):
    """Frozen parameters: stage 3's frozen units (compute-dtype shards), stage 1's held whole by
    the module (saved beside the shards)."""
    from safetensors import safe_open

    root, results = saved
    out = str(tmp_path / label)
    report = export_checkpoint(os.path.join(root, label, "ckpt"), out, max_shard_bytes=16384)
    tensors = {}
    for name in report.files:
        with safe_open(os.path.join(out, name), framework="pt") as f:
            tensors.update({k: f.get_tensor(k) for k in f.keys()})
    full = results[label]["full"]
    assert sorted(tensors) == sorted(full) and len(report.files) > 1
    for name, value in full.items():
        assert torch.equal(tensors[name], value), name


@pytest.mark.timeout(200)
def test_stage3_nvme_optimizer_exports_a_model_with_the_trained_logits(saved, tmp_path, capsys):
    _, results = saved
    _, _, model = _check_loads(saved, "llama3_nvme", tmp_path, capsys)
    with torch.no_grad():
        logits = model(input_ids=PROBE).logits
    assert torch.equal(logits, results["llama3_nvme"]["logits"])


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_memory_stays_near_one_tensor(saved, tmp_path):
    root, results = saved
    full = results["big2"]["full"]
    model_bytes = sum(t.numel() * 4 for t in full.values())
    largest = max(t.numel() * 4 for t in full.values())
    assert model_bytes > 45 * 2**20 and largest <= 2**20
    out = str(tmp_path / "big")
    report = export_checkpoint(os.path.join(root, "big2", "ckpt"), out)
    assert report.peak_assembled <= largest and report.tensors == len(full)
    # The peak RSS of a fresh process during the export, above its RSS before it (VmHWM is reset
    # through clear_refs first: ru_maxrss would carry this test process's peak over the fork).
    if not os.path.exists("/proc/self/clear_refs"):
        pytest.skip("the peak RSS is read from /proc (Linux)")
    script = (
        "import sys\n"
        "from tiertrain.state.consolidate import export_checkpoint\n"
        "def kib(key):\n"
        "    return next(int(l.split()[1]) for l in open('/proc/self/status') if l.startswith(key))\n"
        "export_checkpoint(sys.argv[3], sys.argv[4])\n"  # (warm-up: what the first export imports)
        "open('/proc/self/clear_refs', 'w').write('5')\n"
        "before = kib('VmRSS')\n"
        "export_checkpoint(sys.argv[1], sys.argv[2])\n"
        "print((kib('VmHWM') - before) * 1024)\n")
    done = subprocess.run([sys.executable, "-c", script, os.path.join(root, "big2", "ckpt"), str(tmp_path / "big_rss"),
                           os.path.join(root, "llama3", "ckpt"), str(tmp_path / "warm_up")],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0 and "clear_refs" in done.stderr:
        pytest.skip(f"cannot reset the peak RSS here: {done.stderr.strip().splitlines()[-1]}")
    assert done.returncode == 0, done.stderr
    extra = int(done.stdout.strip().splitlines()[-1])
    print(f"export peak RSS above its start: {extra / 2**20:.1f} MiB of a {model_bytes / 2**20:.1f} MiB model")
    assert extra < model_bytes / 2, (extra, model_bytes)


@pytest.mark.timeout(200)
@pytest.mark.timeout(200)
def test_format_safetensors_writes_the_tensors_alone_and_hf_needs_a_config(saved, tmp_path, capsys):
    from safetensors.torch import load_file

    root, results = saved
    out = tmp_path / "tensors"
    assert main(["export", os.path.join(root, "llama3", "ckpt"), str(out), "--format", "safetensors"]) == 0
    assert sorted(os.listdir(out)) == ["model.safetensors"]
    tensors = load_file(str(out / "model.safetensors"))
    assert all(torch.equal(tensors[n], v) for n, v in results["llama3"]["full"].items())
    # A model without a Hugging Face config (the engine's own GPT in tests/test_reshard.py) has
    # no config to write: "hf" is refused by name; here the config is simply not in the checkpoint.
    copy = tmp_path / "no_config"
    import shutil
    shutil.copytree(os.path.join(root, "llama3", "ckpt"), copy)
    step_dir = next(p for p in copy.iterdir() if p.name.startswith("step_"))
    marker = json.loads((step_dir / "COMMITTED.json").read_text())
    del marker["files"]["hf_config.json"]
    (step_dir / "COMMITTED.json").write_text(json.dumps(marker))
    assert main(["export", str(copy), str(tmp_path / "o"), "--format", "hf"]) == 1
    assert "holds no Hugging Face config" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"format='onnx' is invalid"):
        export_checkpoint(str(copy), str(tmp_path / "o"), format="onnx")


def test_errors(saved, tmp_path, capsys):
    root, _ = saved
    with pytest.raises(CheckpointError, match="not a checkpoint directory"):
        export_checkpoint(str(tmp_path / "missing"), str(tmp_path / "o"))
    empty = tmp_path / "empty"
    (empty / "step_00000003").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        export_checkpoint(str(empty), str(tmp_path / "o"))
    with pytest.raises(ValueError, match="unknown dtype"):
        export_checkpoint(os.path.join(root, "llama3", "ckpt"), str(tmp_path / "o"), dtype="fp8")
    assert main(["export", os.path.join(root, "llama3", "ckpt"), str(tmp_path / "o"), "--dtype", "int4"]) == 2
    assert "unknown dtype" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "missing"), str(tmp_path / "o")]) == 1
    assert "not a checkpoint directory" in capsys.readouterr().err

    # A corrupt rank file is named (a copy of the checkpoint: the others use the original).
    import shutil

    copy = tmp_path / "corrupt"
    shutil.copytree(os.path.join(root, "llama3", "ckpt"), copy)
    step_dir = next(p for p in copy.iterdir() if p.name.startswith("step_"))
    with open(step_dir / "rank00001.pt", "r+b") as f:
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(CheckpointError, match=r"rank00001\.pt.* is corrupt"):
        export_checkpoint(str(copy), str(tmp_path / "o2"))
    assert not os.path.exists(tmp_path / "o2")


@pytest.mark.timeout(200)
def test_a_held_tensor_whose_header_overruns_the_file_is_refused_not_filled_from_memory(saved, tmp_path):
    """Issue 32, item 5: a held_tensors.safetensors whose header claims more bytes than the file
    holds, its checksum recomputed in COMMITTED.json (as the producer of a hostile file would),
    exported with the bytes after the file's end taken from process memory. Now the header is
    checked against the file before any read: an error naming the file, nothing exported."""
    import shutil
    import struct

    from tiertrain.io.fileio import file_sha256

    root, _ = saved
    copy = tmp_path / "hostile"
    shutil.copytree(os.path.join(root, "bart3", "ckpt"), copy)
    step_dir = next(p for p in copy.iterdir() if p.name.startswith("step_"))
    held = step_dir / "held_tensors.safetensors"
    data = held.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    name = next(k for k in header if k != "__metadata__")
    begin, end = header[name]["data_offsets"]
    grown = end - begin + (1 << 18)  # 256 KiB past the file's end
    header[name]["shape"] = [grown // torch.tensor([], dtype=torch.float32).element_size()]
    header[name]["dtype"] = "F32"
    header[name]["data_offsets"] = [begin, begin + grown]
    text = json.dumps(header).encode()
    held.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    marker_path = step_dir / "COMMITTED.json"
    marker = json.loads(marker_path.read_text())
    marker["files"]["held_tensors.safetensors"] = file_sha256(str(held))
    marker_path.write_text(json.dumps(marker))
    with pytest.raises(CheckpointError, match=r"held_tensors\.safetensors.* is not a valid safetensors file"):
        export_checkpoint(str(copy), str(tmp_path / "out"))
    assert not list(tmp_path.glob("out/*.safetensors")), "a file was exported"
