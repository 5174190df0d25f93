"""QLoRA: LoRA adapters (peft) over a base model loaded in 4 bits by bitsandbytes
(transformers' BitsAndBytesConfig), the way most fine-tuning of large models runs. The frozen
4-bit weights are bitsandbytes' Params4bit, packed 4-bit codes in bytes of its quant_storage
dtype: uint8, or bf16, which at precision fp32 is a parameter of a class of its own in another
dtype than the compute one, held as stored (cast to fp32 its bytes lost their meaning and the
forward failed with "shape '[64, 64]' is invalid for input of size 8192").

One 2-rank launch at stage 3 (the adapters' optimizer on the CPU tier) per storage, against
single-process training of the same model. bitsandbytes' 4-bit matmul on the CPU rounds its
output to bf16 (0.003 from x @ dequantize_4bit(W).T at outputs of 0.6), so no float64 run of
its arithmetic exists; the bound is the rounding noise of that arithmetic itself: the largest
distance from the single-process run of the same run over the batch's rows in other orders
(every rotation, and reversed), which is what data parallelism changes.
"""
from __future__ import annotations

import functools

import pytest
import torch

import tiertrain
from reference import Oracle, engine_train, global_batches, make_config, reference_train
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

STEPS, GLOBAL = 3, 8
STORAGES = {"uint8": torch.uint8, "bf16": torch.bfloat16}


def _adapters(model):
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                      lora_dropout=0.0))


def _quantised(directory: str, storage: torch.dtype):
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=storage,
                                        bnb_4bit_compute_dtype=torch.float32)
    return _adapters(transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=q,
                                                                       dtype=torch.float32))


def _batches() -> list[dict]:
    """Causal-LM batches as a collator gives them: labels = input_ids (the model shifts them)."""
    return [{"input_ids": b["input_ids"], "labels": b["input_ids"].clone()} for b in global_batches(STEPS, GLOBAL)]


def _config():
    return make_config(zero={"stage": 3, "offload_optimizer": "cpu"}, batch={"micro_batch_size": GLOBAL // 2})


def _run(rank, world, directory, storage):
    model = _quantised(directory, storage)
    assert {type(p).__name__ for n, p in model.named_parameters() if "proj.weight" in n} == {"Params4bit"}
    losses, params, engine = engine_train(rank, world, model, _config(), _batches())
    adapters = {n: v.clone() for n, v in params.items() if "lora_" in n}
    engine.close()
    return losses, adapters


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    path = tmp_path_factory.mktemp("qlora")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).save_pretrained(path)
    return str(path)


def _oracle(directory: str, storage: torch.dtype) -> Oracle:
    """The single-process run as the reference, its noise that of the same run in other row orders."""
    batches = _batches()
    losses, params = reference_train(_quantised(directory, storage), _config(), batches)
    adapters = {n: v for n, v in params.items() if "lora_" in n}
    orders = [lambda v: v.flip(0)] + [functools.partial(torch.roll, shifts=k, dims=0) for k in range(1, GLOBAL)]
    others = []
    for order in orders:
        other_losses, other = reference_train(_quantised(directory, storage), _config(),
                                              [{k: order(v) for k, v in b.items()} for b in batches])
        others.append((other_losses, {n: other[n] for n in adapters}))
    return Oracle(losses, adapters, losses, adapters).widened(others)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("storage", list(STORAGES))
def test_lora_over_a_4bit_base_trains_as_in_one_process(directory, storage):
    oracle = _oracle(directory, STORAGES[storage])
    assert oracle.param_noise > 0  # (the noise is measured, not assumed)
    losses, adapters = run_distributed(_run, 2, directory, STORAGES[storage], timeout=120)[0]
    assert len(adapters) == 8  # (lora_A and lora_B of q_proj and v_proj in 2 layers)
    oracle.check(losses, adapters, f"QLoRA, quant_storage {storage}, stage 3, 2 ranks")


def _where(rank, world, directory, storage, precision):
    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=storage,
                                        bnb_4bit_compute_dtype=torch.bfloat16)
    model = _adapters(transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=q,
                                                                       dtype=torch.bfloat16))
    config = make_config(zero={"stage": 3}, precision={"dtype": precision}, batch={"micro_batch_size": GLOBAL // 2})
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
    sharded = {s.name for u in engine.flat.frozen_units for s in u.unit.slots}
    four_bit = {n for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    batch = {k: v[rank * GLOBAL // 2:(rank + 1) * GLOBAL // 2] for k, v in _batches()[0].items()}
    loss = engine.train_batch(iter([batch]))
    engine.close()
    return len(four_bit), len(four_bit & sharded), loss


@pytest.mark.timeout(120)
@pytest.mark.parametrize("storage,precision,sharded", [("bf16", "bf16", True), ("uint8", "bf16", False),
                                                       ("bf16", "fp32", False)])
def test_the_4bit_base_is_sharded_where_its_storage_is_the_compute_dtype(directory, storage, precision, sharded):
    """As FSDP-QLoRA: bf16 storage at bf16 compute lives in stage 3's frozen units (each rank its
    shard of the packed codes); any other storage stays whole on every rank, as stored."""
    counts = run_distributed(_where, 2, directory, STORAGES[storage], precision, timeout=90)
    four_bit, in_units, loss = counts[0]
    assert four_bit == 14 and in_units == (four_bit if sharded else 0)
    assert all(torch.isfinite(torch.tensor(c[2])) for c in counts)


@pytest.mark.timeout(60)
def test_a_4bit_base_held_as_stored_is_not_warned_as_rounded(directory):
    """bf16 storage at fp16 compute: the packed codes keep their bf16 bytes, so the warning of
    frozen weights rounded to the compute dtype does not name them (it did, for a cast that never
    happens); the model's other frozen weights, bf16 rounded to fp16, it still names."""
    import warnings

    q = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_storage=torch.bfloat16,
                                        bnb_4bit_compute_dtype=torch.float16)
    model = _adapters(transformers.AutoModelForCausalLM.from_pretrained(directory, quantization_config=q,
                                                                       dtype=torch.bfloat16))
    four_bit = {n for n, p in model.named_parameters() if type(p).__name__ == "Params4bit"}
    config = make_config(zero={"stage": 3}, precision={"dtype": "fp16"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
    rounded = " ".join(str(w.message) for w in caught if "no fp32 master" in str(w.message))
    assert "embed_tokens" in rounded and not any(f"'{n}'" in rounded for n in four_bit), rounded
    assert {p.dtype for n, p in model.named_parameters() if n in four_bit} == {torch.bfloat16}
    engine.close()
