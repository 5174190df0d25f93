"""A peft model trained by the engine and exported in a form that loads (issue 34, item 8):
PeftExport.ADAPTER is the directory PeftModel.save_pretrained writes (adapter_config.json, the
adapter's tensors under peft's names), PeftExport.MERGED the base model's checkpoint with each
LoRA update folded in. Before, save_pretrained wrote peft's wrapper names and
``architectures: ["PeftModel"]``, and from_pretrained re-initialised every weight with only a
warning. Both families LoRA is applied to here: Llama (linear layers) and GPT-2 (Conv1D, whose
weight is stored transposed: fan_in_fan_out)."""
from __future__ import annotations

import json
import os

import pytest
import torch

import tiertrain
from reference import make_config, rank_slices
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
import zoo  # noqa: E402
from safetensors import safe_open  # noqa: E402

WORLD, MICRO = 2, 2
TARGETS = {"llama": ["q_proj", "v_proj"], "gpt2": ["c_attn"]}
BASES = {"llama": zoo.llama_gqa, "gpt2": zoo.gpt2_tied}


def _peft(name: str):
    torch.manual_seed(0)
    base = BASES[name]()
    base.loss_function = zoo.causal_lm_loss
    torch.manual_seed(1)  # (LoRA's B starts at zero: one step makes the update nonzero)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS[name],
                                                     fan_in_fan_out=name == "gpt2"))


def _run(rank, world, root, name):
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": MICRO}, optimizer={"lr": 1e-2})
    engine = tiertrain.wrap(_peft(name), cfg, tiertrain.Topology.build(cfg.parallel))
    for b in zoo.global_batches(2, MICRO * world, seq_len=zoo.SEQ):
        engine.train_batch(rank_slices({"input_ids": b["input_ids"], "labels": b["input_ids"]}, rank, world, MICRO, 1))
    out = {"full": engine.full_state_dict()}
    try:
        engine.save_pretrained(os.path.join(root, "refused"))
        out["refused"] = None
    except ValueError as e:
        out["refused"] = str(e)
    engine.save_pretrained(os.path.join(root, "adapter"), peft=tiertrain.PeftExport.ADAPTER)
    engine.save_pretrained(os.path.join(root, "merged"), peft=tiertrain.PeftExport.MERGED, max_shard_bytes=16 * 1024)
    model = engine.module
    engine.close()
    if rank == 0:
        model.save_pretrained(os.path.join(root, "peft_own"))  # what peft itself writes, for the names
        model.eval()
        with torch.no_grad():
            out["logits"] = model(input_ids=torch.arange(8).reshape(1, 8)).logits
    return out


@pytest.fixture(scope="module", params=["llama", "gpt2"])
def exported(request, tmp_path_factory, one_torch_thread):
    root = str(tmp_path_factory.mktemp(f"peft_{request.param}"))
    return request.param, root, run_distributed(_run, WORLD, root, request.param, timeout=100)[0]


def _tensors(path: str) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            with safe_open(os.path.join(path, f), framework="pt") as h:
                out.update({k: h.get_tensor(k) for k in h.keys()})
    return out


@pytest.mark.timeout(120)
def test_a_peft_model_is_not_written_under_its_wrapper_names(exported):
    name, root, got = exported
    assert got["refused"] is not None and "PeftExport.ADAPTER" in got["refused"] and "MERGED" in got["refused"]
    assert not os.path.exists(os.path.join(root, "refused", "config.json"))


@pytest.mark.timeout(120)
def test_the_adapter_directory_is_peft_s_own_and_loads_the_trained_adapter(exported):
    name, root, got = exported
    adapter, own = os.path.join(root, "adapter"), os.path.join(root, "peft_own")
    assert sorted(f for f in os.listdir(adapter)) == ["adapter_config.json", "adapter_model.safetensors"]
    ours, theirs = _tensors(adapter), _tensors(own)
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert json.load(open(os.path.join(adapter, "adapter_config.json")))["r"] == 4
    torch.manual_seed(0)
    base = BASES[name]()
    loaded = peft.PeftModel.from_pretrained(base, adapter)
    state = loaded.state_dict()
    lora = [k for k in got["full"] if ".lora_" in k]
    assert lora and all(torch.equal(state[k], got["full"][k]) for k in lora)
    loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=torch.arange(8).reshape(1, 8)).logits, got["logits"])


@pytest.mark.timeout(120)
def test_the_merged_checkpoint_is_the_base_model_with_each_update_folded_in(exported):
    """W + s·B A computed in float64 from the trained values and rounded once (the oracle); a
    Conv1D weight (GPT-2) takes the update transposed. from_pretrained of the base class loads
    every tensor, and its logits are the adapted model's to fp32 rounding."""
    name, root, got = exported
    merged = os.path.join(root, "merged")
    config = json.load(open(os.path.join(merged, "config.json")))
    assert config["architectures"] == [type(BASES[name]()).__name__]
    model, info = transformers.AutoModelForCausalLM.from_pretrained(merged, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    full, state = got["full"], model.state_dict()
    folded = 0
    for k, v in full.items():
        if ".lora_" in k or not k.startswith("base_model.model."):
            continue
        base_name = k.removeprefix("base_model.model.").replace(".base_layer.", ".")
        want = v
        if ".base_layer.weight" in k:
            layer = k.removesuffix(".base_layer.weight")
            delta = (full[f"{layer}.lora_B.default.weight"].double() @ full[f"{layer}.lora_A.default.weight"].double())
            delta = delta * (8 / 4)
            want = (v.double() + (delta.T if name == "gpt2" else delta)).float()
            folded += 1
        assert torch.equal(state[base_name], want), base_name
    assert folded == 2 * len(TARGETS[name])  # (each target of both layers)
    model.eval()
    with torch.no_grad():  # (W + ΔW against W x + B A x: the same function, rounded otherwise)
        logits = model(input_ids=torch.arange(8).reshape(1, 8)).logits
    assert torch.allclose(logits, got["logits"], rtol=0, atol=1e-4), (logits - got["logits"]).abs().max()
