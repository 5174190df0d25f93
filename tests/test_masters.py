"""fp32 masters start from the model's own values (issue 34, item 2): an fp32 model wrapped
at bf16 or fp16 keeps its weights exactly in its masters — at every ZeRO stage and tier, built
whole or partitioned, tiertrain's GPT and a Hugging Face Llama — and only the compute copy is
rounded. The masters used to be copied from the rounded compute copy, so wrap() then close()
without a step changed most tensors of a small Llama (up to 3.4e-3 relative)."""
from __future__ import annotations

import pytest
import torch

import tiertrain
from reference import make_config, make_model
from tiertrain.testing import run_distributed

pytestmark = pytest.mark.timeout(90)


def _llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32))


def _masters_equal_the_model(rank, world, family, stage, dtype, tiers, partitioned, swap):
    builders = {"gpt": make_model, "llama": _llama}
    original = {k: v.detach().clone() for k, v in builders[family]().named_parameters()}
    cfg = make_config(zero={"stage": stage, "offload_optimizer": tiers[0], "offload_params": tiers[1],
                            "nvme_path": swap}, precision={"dtype": dtype})
    topology = tiertrain.Topology.build(cfg.parallel)
    if partitioned:
        with tiertrain.partitioned_init(topology):
            model = builders[family]()
    else:
        model = builders[family]()
    engine = tiertrain.wrap(model, cfg, topology)
    masters = engine.full_state_dict()
    differ = sorted(k for k in original if not torch.equal(masters[k], original[k]))
    with engine.gathered_parameters():
        rounded = sum(not torch.equal(p.detach().float(), original[k]) for k, p in engine.module.named_parameters())
    engine.close()
    closed = {k: v for k, v in model.named_parameters()}
    differ_after_close = sorted(k for k in original if not torch.equal(closed[k].detach().float(), original[k]))
    return differ, differ_after_close, rounded


@pytest.mark.parametrize("family,stage,dtype,tiers,partitioned", [
    ("gpt", 0, "bf16", ("none", "none"), False),
    ("gpt", 1, "bf16", ("none", "none"), False),
    ("gpt", 2, "fp16", ("cpu", "none"), False),
    ("gpt", 3, "bf16", ("none", "none"), True),
    ("gpt", 3, "bf16", ("nvme", "nvme"), False),
    ("llama", 3, "bf16", ("cpu", "cpu"), True),
    pytest.param("llama", 2, "bf16", ("none", "none"), False, marks=pytest.mark.slow),
])
def test_masters_hold_the_models_own_fp32_values(tmp_path, family, stage, dtype, tiers, partitioned):
    results = run_distributed(_masters_equal_the_model, 2, family, stage, dtype, tiers, partitioned,
                              str(tmp_path / "swap"), timeout=60)
    for differ, differ_after_close, _ in results:
        assert differ == [], f"masters differ from the model's values: {differ}"
        assert differ_after_close == [], f"close() handed back changed values: {differ_after_close}"
    assert any(rounded for _, _, rounded in results), "the compute copy is rounded (else this proves nothing)"


def _masters_after_load_pretrained(rank, world, directory, stage):
    from safetensors.torch import load_file

    cfg = make_config(zero={"stage": stage}, precision={"dtype": "bf16"})
    torch.manual_seed(1)  # (other initial values than the file's)
    engine = tiertrain.wrap(_llama(), cfg, tiertrain.Topology.build(cfg.parallel))
    tiertrain.load_pretrained(engine, directory)
    saved, masters = load_file(f"{directory}/model.safetensors"), engine.full_state_dict()
    return sorted(k for k in saved if not torch.equal(masters[k], saved[k]))


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_masters_loaded_from_a_pretrained_file_hold_its_fp32_values(tmp_path, stage):
    _llama().save_pretrained(tmp_path / "llama")
    for differ in run_distributed(_masters_after_load_pretrained, 2, str(tmp_path / "llama"), stage, timeout=60):
        assert differ == []
