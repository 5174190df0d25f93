"""Quantised checkpoints in load_pretrained (tiertrain/state/quantized.py).

A block-FP8 checkpoint, as DeepSeek-V3 and Qwen3-FP8 ship (each linear weight in float8 beside
one fp32 scale per 128 × 128 block, ``weight_scale_inv``; config.json's quantization_config
``quant_method: fp8``), loads dequantised: every weight equals, bit for bit, the fp32 product of
its values and its block's scale (computed here in float64, where the product of an fp8 value
and an fp32 scale is exact), whether the rank reads the whole tensor or only its rows of a
ZeRO-3 shard, and equals transformers' own ``FineGrainedFP8Config(dequantize=True)`` load. It
used to load the fp8 values cast, without their scales: weights in the hundreds, silently under
strict=False. Every other quantisation is refused before anything is read, naming the method.
"""
from __future__ import annotations

import copy
import json
import os

import pytest
import torch

import tiertrain
from tiertrain.state.pretrained import load_pretrained
from tiertrain.state.quantized import QuantizedCheckpointError
from tiertrain.testing import run_distributed

from reference import make_config

transformers = pytest.importorskip("transformers")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytestmark = pytest.mark.timeout(120)

BLOCK = 128
FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [BLOCK, BLOCK]}


def _model(seed: int = 0) -> torch.nn.Module:
    """A Llama whose MLP has 192 rows (a last block of 64: DeepSeek-V3's 576-row kv_a_proj too
    ends in a partial block) and whose attention has 128 (whole blocks, as transformers reads)."""
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=128, intermediate_size=192, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's format: per block, scale = max|w| / 448 and value = w / scale in e4m3."""
    rows, cols = w.shape
    scale = torch.empty(-(-rows // BLOCK), -(-cols // BLOCK))
    values = torch.empty(w.shape, dtype=torch.float8_e4m3fn)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            block = w[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK]
            scale[i, j] = block.abs().max() / 448
            values[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scale[i, j]).to(values.dtype)
    return values, scale


def _exact(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = values.shape
    grid = scale.double().repeat_interleave(BLOCK, 0)[:rows].repeat_interleave(BLOCK, 1)[:, :cols]
    return (values.double() * grid).float()


def _write(directory: str, tensors: dict, quantization: dict | None) -> None:
    _model().save_pretrained(directory)
    safetensors_torch.save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config.pop("quantization_config", None)
    if quantization is not None:
        config["quantization_config"] = quantization
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    """(directory, {name: the exact dequantised value}) of a block-FP8 checkpoint of _model()."""
    directory = str(tmp_path_factory.mktemp("fp8"))
    tensors, expected = {}, {}
    for name, value in _model().state_dict().items():
        if name.endswith("proj.weight"):
            values, scale = _quantize(value)
            tensors[name], tensors[name + "_scale_inv"] = values, scale
            expected[name] = _exact(values, scale)
        else:
            tensors[name] = expected[name] = value.contiguous()
    _write(directory, tensors, FP8_CONFIG)
    return directory, expected


def test_the_premise_an_fp8_value_cast_without_its_scale_is_not_the_weight(fp8_checkpoint):
    directory, expected = fp8_checkpoint
    stored = safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))
    name = "model.layers.0.mlp.gate_proj.weight"
    assert stored[name].float().abs().max() > 100 * expected[name].abs().max()


def test_a_block_fp8_checkpoint_loads_as_the_product_of_values_and_scales(fp8_checkpoint):
    directory, expected = fp8_checkpoint
    model = _model(seed=1)
    report = load_pretrained(model, directory)
    assert not report.unexpected and not report.missing
    loaded = model.state_dict()
    for name, value in expected.items():
        assert torch.equal(loaded[name], value), name
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=transformers.FineGrainedFP8Config(dequantize=True), dtype=torch.float32)
    for name in ("model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.o_proj.weight"):
        assert torch.equal(hf.state_dict()[name], loaded[name]), name  # (whole blocks: transformers' layout)


def _engine_loads(rank, world, directory):
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(_model(seed=1), cfg, tiertrain.Topology.build(cfg.parallel))
    load_pretrained(engine, directory)
    values = engine.full_state_dict()
    engine.close()
    return values


def test_each_rank_of_a_zero3_engine_dequantises_only_the_rows_it_keeps(fp8_checkpoint):
    """Stage 3 shards start mid-tensor and mid-block: each rank's rows with their blocks' scales."""
    directory, expected = fp8_checkpoint
    for values in run_distributed(_engine_loads, 2, directory, timeout=60):
        for name, value in expected.items():
            assert torch.equal(values[name], value), name


def test_other_quantisations_are_refused_before_anything_is_read(tmp_path, fp8_checkpoint):
    directory, _ = fp8_checkpoint
    stored = safetensors_torch.load_file(os.path.join(directory, "model.safetensors"))
    name = "model.layers.0.mlp.gate_proj.weight"
    cases = {
        "bitsandbytes": ({**stored, name: torch.zeros(192 * 64, 1, dtype=torch.uint8)},
                         {"quant_method": "bitsandbytes", "load_in_4bit": True},
                         r"\(config.json quantization_config\) holds weights quantised by 'bitsandbytes'"),
        "int8 with SCB, no config": ({**stored, name: torch.zeros(192, 128, dtype=torch.int8),
                                      name.replace("weight", "SCB"): torch.ones(192)}, None,
                                     rf"quantised by a method with scales beside the weights \({name}: torch.int8"),
        "fp8 without scales": ({k: v for k, v in stored.items() if not k.endswith("_scale_inv")}, FP8_CONFIG,
                               r"quantised by 'fp8' without per-block scales"),
        "a scale grid of other blocks": ({**stored, name + "_scale_inv": torch.ones(3, 2)}, FP8_CONFIG,
                                         rf"{name} is block-FP8 of shape \(192, 128\), but its scale_inv has shape "
                                         rf"\(3, 2\): blocks of \[128, 128\] give \(2, 1\)"),
    }
    for label, (tensors, quantization, message) in cases.items():
        path = str(tmp_path / label.replace(" ", "_"))
        _write(path, tensors, quantization)
        model = _model(seed=1)
        before = {n: v.clone() for n, v in model.state_dict().items()}
        with pytest.raises(QuantizedCheckpointError, match=message):
            load_pretrained(model, path, strict=False)
        assert all(torch.equal(before[n], v) for n, v in model.state_dict().items()), label
    assert issubclass(tiertrain.QuantizedCheckpointError, ValueError)


def test_a_config_that_names_a_method_over_unquantised_tensors_loads_them(tmp_path, fp8_checkpoint):
    """Some dequantised saves keep the quantization_config: no tensor stored quantised, no refusal."""
    _, expected = fp8_checkpoint
    path = str(tmp_path / "kept config")
    _write(path, expected, {"quant_method": "bitsandbytes", "load_in_8bit": True})
    model = _model(seed=1)
    load_pretrained(model, path)
    assert all(torch.equal(model.state_dict()[n], v) for n, v in expected.items())


def test_fp8_experts_stored_one_per_tensor_are_dequantised_before_transformers_stacks_them(tmp_path):
    """Mixtral keeps its experts stacked in memory, one tensor per expert on disk (transformers'
    conversion, tiertrain/state/hf_conversion.py): the fp8 checkpoint loads as the checkpoint of
    the exact dequantised values does."""
    def mixtral(seed):
        torch.manual_seed(seed)
        return transformers.MixtralForCausalLM(transformers.MixtralConfig(
            vocab_size=64, hidden_size=128, intermediate_size=192, num_hidden_layers=1, num_attention_heads=4,
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=32))
    quantized, exact = str(tmp_path / "fp8"), str(tmp_path / "exact")
    mixtral(0).save_pretrained(quantized)
    mixtral(0).save_pretrained(exact)
    stored, fp8, values = safetensors_torch.load_file(os.path.join(quantized, "model.safetensors")), {}, {}
    for name, value in stored.items():
        if ".experts." in name or name.endswith("proj.weight"):
            fp8[name], fp8[name + "_scale_inv"] = _quantize(value)
            values[name] = _exact(fp8[name], fp8[name + "_scale_inv"])
        else:
            fp8[name] = values[name] = value
    for directory, tensors in ((quantized, fp8), (exact, values)):
        safetensors_torch.save_file(tensors, os.path.join(directory, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(quantized, "config.json")) as f:
        config = json.load(f)
    with open(os.path.join(quantized, "config.json"), "w") as f:
        json.dump({**config, "quantization_config": FP8_CONFIG}, f)
    from_fp8, from_exact = mixtral(1), mixtral(2)
    assert load_pretrained(from_fp8, quantized).conversion  # (the experts went through the conversion)
    load_pretrained(from_exact, exact)
    assert all(torch.equal(v, from_exact.state_dict()[n]) for n, v in from_fp8.state_dict().items())


def test_an_export_of_the_dequantised_model_does_not_say_its_weights_are_fp8(fp8_checkpoint, tmp_path):
    """The model built from the FP8 checkpoint's config keeps its quantization_config; written
    into an export of bf16 weights, from_pretrained on a GPU would take them for FP8 ones. The
    live and offline exports leave it out, and the export loads as the values the engine held."""
    from tiertrain.state.consolidate import export_checkpoint

    directory, expected = fp8_checkpoint
    model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(directory))
    assert model.config.quantization_config  # (the premise)
    cfg = make_config(zero={"stage": 0}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    load_pretrained(engine, directory)
    engine.save_pretrained(tmp_path / "live", dtype=torch.bfloat16)
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    engine.close()
    export_checkpoint(tmp_path / "ckpt", tmp_path / "offline", dtype="bf16")
    for export in ("live", "offline"):
        with open(tmp_path / export / "config.json") as f:
            assert "quantization_config" not in json.load(f), export
        loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / export).state_dict()
        for name, value in expected.items():
            assert torch.equal(loaded[name], value.bfloat16()), (export, name)


def _fp8_linear_model(trainable: bool) -> torch.nn.Module:
    """_model() as from_pretrained of an FP8 checkpoint on a GPU holds it (FP8Linear layers)."""
    from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

    model = replace_with_fp8_linear(_model(), quantization_config=transformers.FineGrainedFP8Config())
    torch.manual_seed(0)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if p.is_meta:  # (values, as a checkpoint would give them)
                value = torch.randn(p.shape).to(p.dtype) if p.dtype.itemsize == 1 else torch.full(p.shape, 0.01)
                setattr(module, name, torch.nn.Parameter(value, requires_grad=trainable and p.dtype.itemsize == 1))
    return model


def test_quantised_parameters_are_held_as_stored_when_frozen_and_refused_when_trained():
    """transformers' FP8Linear (from_pretrained of an FP8 checkpoint on a GPU, without
    dequantize) holds fp8 weights beside their scales, and computes F.linear with a weight wider
    than a byte as already dequantised. The engine held frozen fp8 weights in precision.dtype:
    the stored values became the weights, outputs off by the scales, in silence. Frozen, they
    are now held as stored, as integer ones (bitsandbytes' 4-bit) always were; trainable, wrap()
    refuses them (their fp32 masters would be the stored values)."""
    from tiertrain.estimate.peak import simulate_peak

    widened = copy.deepcopy(_fp8_linear_model(False).model.layers[0].mlp.gate_proj)  # (the premise)
    widened.weight = torch.nn.Parameter(widened.weight.to(torch.bfloat16), requires_grad=False)
    x = torch.randn(3, 128, dtype=torch.bfloat16)
    assert type(widened).__name__ == "FP8Linear"
    assert torch.equal(widened(x), torch.nn.functional.linear(x, widened.weight))  # (its scales unused)
    for stage in (0, 3):
        cfg = make_config(zero={"stage": stage}, batch={"micro_batch_size": 2}, precision={"dtype": "bf16"})
        model = _fp8_linear_model(False)
        stored = {n: p.detach().clone() for n, p in model.named_parameters() if p.dtype.itemsize == 1}
        estimated = simulate_peak(model, dp=1, stage=stage, precision_bytes=2, compute=torch.bfloat16).params
        engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
        assert engine.memory_report().params == estimated, stage  # (the fp8 weights counted at a byte each)
        held = dict(model.named_parameters())
        for name, value in stored.items():
            assert held[name].dtype == value.dtype and torch.equal(held[name].view(torch.uint8),
                                                                   value.view(torch.uint8)), (stage, name)
        engine.close()
        with pytest.raises(tiertrain.ConfigError, match=r"'model.layers.0.self_attn.q_proj.weight \(torch.float8_"
                                                        r"e4m3fn, in FP8Linear\)'.* trainable and stored quantised: "
                                                        r".*FineGrainedFP8Config"):
            tiertrain.wrap(_fp8_linear_model(True), cfg, tiertrain.Topology.build(cfg.parallel))
