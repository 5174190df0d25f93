"""A stage-3 parameter read while its unit is released raises an error naming it and how to
read it (tiertrain/zero/released.py). Before, ``p.norm()`` there read freed memory and the
process died of a segmentation fault, and ``torch.save(model.state_dict())`` wrote a file that
torch.load could not read: the model was lost at the very end of a run."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import transformers as T

import tiertrain
from reference import global_batches, make_config, make_model
from tiertrain import ReleasedParameterError

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

REMEDY = "read it inside `with engine.gathered_parameters():`"


def _trained(model: nn.Module, stage: int = 3, steps: int = 2):
    cfg = make_config(zero={"stage": stage}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    for batch in global_batches(steps, 2):
        engine.backward(engine(batch))
        engine.step()
    return engine


def _raises_naming(read, name: str) -> str:
    with pytest.raises(ReleasedParameterError) as error:
        read()
    assert f"parameter {name!r}" in str(error.value) and REMEDY in str(error.value), str(error.value)
    return str(error.value)


def test_reading_a_released_parameter_raises_naming_it_and_metadata_still_answers():
    model = make_model()
    shapes = {n: p.shape for n, p in model.named_parameters()}
    engine = _trained(model)
    weight = model.blocks[1].mlp.fc1.weight
    name = "blocks.1.mlp.fc1.weight"
    assert weight.untyped_storage().size() == 0, "outside forward the unit is released"
    for read in (weight.norm, lambda: weight * 2, lambda: torch.cat([weight, weight]), weight.detach,
                 lambda: weight.data, lambda: weight.tolist(), lambda: weight.to(torch.bfloat16)):
        _raises_naming(read, name)
    # What does not read values still answers: counting, shapes, dtypes, gradients, hooks.
    assert {n: p.shape for n, p in model.named_parameters()} == shapes
    assert sum(p.numel() for p in model.parameters()) == sum(s.numel() for s in shapes.values())
    assert weight.dtype == torch.float32 and weight.requires_grad and weight.grad is None
    assert isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.size(0) == shapes[name][0]
    assert name in repr(weight) and "gathered_parameters" in repr(weight)

    full = engine.full_state_dict()
    with engine.gathered_parameters():
        assert torch.equal(weight.detach().float(), full[name]), "gathered, the parameter reads its values"
        assert type(weight) is nn.Parameter
    _raises_naming(weight.norm, name)  # released again on leaving the context

    x = global_batches(1, 2)[0]["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(x)).all(), "the model called outside the engine gathers unit by unit"
    _raises_naming(weight.norm, name)
    engine.close()


def test_the_state_dict_of_a_released_model_is_refused_instead_of_saved_unloadable(tmp_path):
    model = make_model()
    engine = _trained(model)
    path = tmp_path / "model.pt"
    message = _raises_naming(lambda: torch.save(model.state_dict(), path), "embed.weight")
    assert "full_state_dict" in message and "save_pretrained" in message
    assert not path.exists(), "nothing was written"
    with engine.gathered_parameters():  # the remedy the error names
        torch.save(model.state_dict(), path)
    saved = torch.load(path)
    assert all(torch.equal(saved[n], value) for n, value in engine.full_state_dict().items())
    engine.close()


def test_a_hugging_face_model_refuses_its_own_save_pretrained_while_released_and_the_engine_saves_it(tmp_path):
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(T.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel),
                            loss_fn=lambda m, b: m(input_ids=b["input_ids"], labels=b["input_ids"]).loss)
    for batch in global_batches(2, 2):
        engine.backward(engine(batch))
        engine.step()
    with pytest.raises(ReleasedParameterError, match="model.layers.0.self_attn.q_proj.weight|model.embed_tokens"):
        model.save_pretrained(tmp_path / "by_hf")
    assert not list((tmp_path / "by_hf").glob("*.safetensors")), "no weights file was written"
    engine.save_pretrained(tmp_path / "by_engine")
    loaded = T.LlamaForCausalLM.from_pretrained(tmp_path / "by_engine")
    full = engine.full_state_dict()
    assert all(torch.equal(p.float(), full[n]) for n, p in loaded.named_parameters())
    engine.close()


def test_close_hands_back_the_same_plain_parameters_with_the_trained_values():
    model = make_model()
    before = dict(model.named_parameters())
    engine = _trained(model)
    full = engine.full_state_dict()
    engine.close()
    for name, p in model.named_parameters():
        assert p is before[name] and type(p) is nn.Parameter, name
        assert torch.equal(p.detach(), full[name]), name


def test_below_stage_3_nothing_is_released_or_guarded():
    model = make_model()
    engine = _trained(model, stage=2)
    assert all(type(p) is nn.Parameter for p in model.parameters())
    assert torch.isfinite(model.blocks[1].mlp.fc1.weight.norm())
    engine.close()
