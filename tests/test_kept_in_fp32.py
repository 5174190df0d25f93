"""What a Hugging Face model declares it keeps in fp32 (``_keep_in_fp32_modules_strict`` at
bf16 and fp16, ``_keep_in_fp32_modules`` at fp16; tiertrain.precision.kept_in_fp32), as
transformers' from_pretrained(dtype=) keeps it:

* buffers and frozen parameters so named stay fp32, also at stage 3, in the model, in
  ``full_state_dict`` and through a checkpoint. Before, a DeepSeek-V3 router's
  ``e_score_correction_bias`` was rounded to bf16 at wrap: the engine routed tokens to other
  experts than the model does, and saved the rounded values;
* trainable ones (the router's ``gate.weight``) are trained from fp32 masters but read in the
  compute dtype, as DeepSpeed and FSDP2 do: a warning says so, naming them;
* ``save_pretrained(dtype=bf16)`` and the offline export write every one of them in fp32, the
  dtypes transformers' own save_pretrained writes; the estimator counts a frozen one whole in
  fp32, as the engine holds it.
"""
from __future__ import annotations

import copy
import os

import pytest
import torch

import tiertrain
from reference import make_config
from tiertrain.precision import kept_in_fp32
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")

WORLD = 2
BIAS = torch.tensor([100.3, 100.0, 100.2, 100.0])
"""The routed experts' correction biases: bf16 rounds 100.3 up to 100.5 and 100.2 down to
100.0 (its spacing there is 0.5), so expert 2, the second choice of every token with the exact
values, ties with experts 1 and 3 once rounded: the rounded bias routes tokens elsewhere."""


def _deepseek_v3(frozen_router: bool = False):
    torch.manual_seed(0)
    config = transformers.DeepseekV3Config(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        vocab_size=128, max_position_embeddings=64, moe_intermediate_size=16, first_k_dense_replace=1,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, q_lora_rank=16,
        kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, pad_token_id=0, bos_token_id=0,
        eos_token_id=0)
    model = transformers.DeepseekV3ForCausalLM(config)
    gate = model.model.layers[1].mlp.gate
    with torch.no_grad():
        gate.e_score_correction_bias.copy_(BIAS)
    gate.weight.requires_grad_(not frozen_router)
    return model


ROUTER = "model.layers.1.mlp.gate"
IDS = torch.arange(24).reshape(2, 12) * 5 % 128


def _reference_logits() -> torch.Tensor:
    """The model as from_pretrained(dtype=bfloat16) holds it: bf16, the correction bias fp32."""
    model = _deepseek_v3().to(torch.bfloat16).eval()
    model.get_submodule(ROUTER).e_score_correction_bias = BIAS.clone()
    with torch.no_grad():
        return model(input_ids=IDS).logits.float()


def _run(rank, world, stage, root):
    import warnings

    cfg = make_config(zero={"stage": stage}, precision={"dtype": "bf16"})
    topology = tiertrain.Topology.build(cfg.parallel)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = tiertrain.wrap(_deepseek_v3(), cfg, topology)
    out["warnings"] = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    module = engine.module.eval()
    with torch.no_grad():
        out["logits"] = module(input_ids=IDS).logits.float()
    out["bias"] = module.get_submodule(ROUTER).e_score_correction_bias.clone()
    out["full"] = engine.full_state_dict()[ROUTER + ".e_score_correction_bias"].clone()
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    engine.save_pretrained(os.path.join(root, "hf"), dtype=torch.bfloat16)
    engine.close()
    fresh = tiertrain.wrap(_deepseek_v3(), cfg, topology)
    with torch.no_grad():
        fresh.module.get_submodule(ROUTER).e_score_correction_bias.zero_()
    fresh.load_checkpoint(os.path.join(root, "ckpt"))
    out["restored"] = fresh.module.get_submodule(ROUTER).e_score_correction_bias.clone()
    fresh.close()
    frozen = tiertrain.wrap(_deepseek_v3(frozen_router=True), cfg, topology)
    out["frozen gate"] = frozen.module.get_submodule(ROUTER).weight.detach().clone()
    out["frozen gate, full"] = frozen.full_state_dict()[ROUTER + ".weight"].clone()
    out["frozen, parameter bytes"] = frozen.memory_report().params
    frozen.close()
    return out


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [0, 3])
def test_a_routers_correction_bias_stays_fp32_and_routes_as_the_model_does(stage, tmp_path, one_torch_thread):
    from tiertrain.estimate.peak import simulate_peak

    expected = _reference_logits()
    original_gate = _deepseek_v3().get_submodule(ROUTER).weight.detach()
    with torch.device("meta"):
        estimated_bytes = simulate_peak(_deepseek_v3(frozen_router=True), dp=WORLD, stage=stage, precision_bytes=2,
                                        compute=torch.bfloat16).params
    for out in run_distributed(_run, WORLD, stage, str(tmp_path), timeout=45):
        for key in ("bias", "full", "restored"):
            assert out[key].dtype == torch.float32 and torch.equal(out[key], BIAS), (key, out[key])
        assert torch.equal(out["logits"], expected)  # (with the rounded bias, other experts: other logits)
        assert out["frozen gate"].dtype == torch.float32 and torch.equal(out["frozen gate"], original_gate)
        assert torch.equal(out["frozen gate, full"], original_gate)
        assert out["frozen, parameter bytes"] == estimated_bytes  # (the router's weight: whole, fp32)
        assert len(out["warnings"]) == 1 and "'model.layers.1.mlp.gate.weight'" in out["warnings"][0]
        assert "precision.dtype: fp32" in out["warnings"][0]
    # Written in bf16 but for what the model keeps in fp32, the dtypes transformers' own
    # save_pretrained writes for the model loaded in bf16 (the trained router weight from its
    # fp32 master, the correction bias as held): by the engine, and offline from the checkpoint.
    from safetensors import safe_open

    from tiertrain.state.consolidate import export_checkpoint

    export_checkpoint(tmp_path / "ckpt", tmp_path / "offline", dtype=torch.bfloat16)
    _deepseek_v3().save_pretrained(tmp_path / "fp32")
    transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.bfloat16).save_pretrained(
        tmp_path / "transformers")
    saved = {}
    for directory in ("transformers", "hf", "offline"):
        saved[directory] = {}
        for path in (tmp_path / directory).glob("*.safetensors"):
            with safe_open(str(path), "pt") as f:
                saved[directory].update({name: f.get_tensor(name) for name in f.keys()})
    dtypes = {name: t.dtype for name, t in saved["transformers"].items()}
    assert dtypes[ROUTER + ".weight"] == dtypes[ROUTER + ".e_score_correction_bias"] == torch.float32
    assert dtypes["model.embed_tokens.weight"] == torch.bfloat16
    for directory in ("hf", "offline"):
        written = saved[directory]
        assert {name: t.dtype for name, t in written.items()} == dtypes, directory
        assert torch.equal(written[ROUTER + ".e_score_correction_bias"], BIAS), directory
        assert torch.equal(written[ROUTER + ".weight"], original_gate), directory
        exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / directory, dtype=torch.bfloat16)
        assert torch.equal(exported.get_submodule(ROUTER).e_score_correction_bias, BIAS)


def test_the_rounded_bias_would_route_elsewhere():
    """The premise of the test above: with the bias rounded to bf16, the logits differ."""
    model = _deepseek_v3().to(torch.bfloat16).eval()
    with torch.no_grad():
        rounded = model(input_ids=IDS).logits.float()
    assert not torch.equal(rounded, _reference_logits())


def test_which_names_are_kept_in_fp32_follows_the_compute_dtype():
    deepseek = _deepseek_v3()
    strict = kept_in_fp32(deepseek, torch.bfloat16)
    assert strict.search(ROUTER + ".weight") and strict.search(ROUTER + ".e_score_correction_bias")
    assert not strict.search("model.layers.1.mlp.experts.gate_up_proj")
    assert kept_in_fp32(deepseek, torch.float32) is None
    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=16, d_ff=32, d_kv=4, num_heads=4, num_layers=1, vocab_size=32, decoder_start_token_id=0))
    assert kept_in_fp32(t5, torch.bfloat16) is None  # (its "wo" only against fp16's range)
    assert kept_in_fp32(t5, torch.float16).search("encoder.block.0.layer.1.DenseReluDense.wo.weight")
    assert kept_in_fp32(copy.deepcopy(torch.nn.Linear(2, 2)), torch.float16) is None


def test_a_pipelines_stages_carry_what_their_model_keeps_in_fp32():
    from tiertrain.pipeline.hf_split import split_hf

    t5 = transformers.T5ForConditionalGeneration(transformers.T5Config(
        d_model=16, d_ff=32, d_kv=4, num_heads=4, num_layers=2, num_decoder_layers=2, vocab_size=32,
        decoder_start_token_id=0))
    stages = torch.nn.ModuleList(split_hf(t5, 2))
    names = [n for n, _ in stages.named_parameters() if kept_in_fp32(stages, torch.float16).search(n)]
    assert names and all(".wo." in n for n in names)
    assert len(names) == sum(".wo." in n for n, _ in t5.named_parameters())
