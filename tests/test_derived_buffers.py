"""Derived (non-persistent) buffers keep the dtype the model built them in; persistent ones take
the compute dtype.

wrap() at bf16 used to cast every floating buffer, rotary frequencies included: a Llama's
``inv_freq`` rounded to bf16 moves the cosines of positions below 2048 by up to 1.9 of their
range of 2 (head dimension 128), so a pretrained model fine-tuned through tiertrain computed other attention than
transformers' own bf16 model (``from_pretrained(dtype=torch.bfloat16)`` keeps them in fp32, as
FSDP2 does; DeepSpeed's ``module.bfloat16()`` rounds them), without a word. A model that mixes
such a table into its activations without casting it fails in torch with a dtype mismatch: the
error then names the buffers and ``precision.cast_derived_buffers``, which casts them too.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tiertrain
from reference import make_config

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

POSITIONS = 4096


def _llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=POSITIONS))


def _wrap(model, stage: int, **precision):
    cfg = make_config(zero={"stage": stage}, batch={"micro_batch_size": 2}, precision={"dtype": "bf16", **precision})
    return tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))


def _rotary(model) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.zeros(1, dtype=torch.bfloat16)
    return model.model.rotary_emb(x, torch.arange(POSITIONS)[None])


@pytest.mark.parametrize("stage", [0, 3])
def test_a_llama_at_bf16_turns_positions_as_transformers_own_bf16_model_does(tmp_path, stage):
    """The cosines and sines of every position up to 4096, bit for bit those of the model
    transformers loads at bf16 from the same weights (with inv_freq rounded to bf16 they differ
    by up to 0.40 at this head dimension, 8)."""
    _llama().save_pretrained(tmp_path)
    theirs = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    model = _llama()
    engine = _wrap(model, stage)
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32 == theirs.model.rotary_emb.inv_freq.dtype
    assert next(model.model.layers[0].parameters()).dtype == torch.bfloat16
    for mine, want in zip(_rotary(model), _rotary(theirs)):
        assert mine.dtype == want.dtype == torch.bfloat16 and torch.equal(mine, want)
    ids = torch.arange(32).view(2, 16) % 128
    engine.backward(engine({"input_ids": ids, "labels": ids}))
    assert engine.step()
    engine.close()


class _Tabled(nn.Module):
    """A model of the user's own that adds a derived fp32 table to its activations uncast, and
    keeps a persistent scale."""

    def __init__(self):
        super().__init__()
        self.inner = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)
        self.register_buffer("table", torch.linspace(0, 1, 8), persistent=False)
        self.register_buffer("scale", torch.ones(8))

    def forward(self, x, y):
        return nn.functional.cross_entropy(self.head((self.inner(x) + self.table) * self.scale), y)


def test_a_table_mixed_into_activations_names_itself_and_the_switch_that_casts_it():
    x, y = torch.randn(2, 8), torch.tensor([0, 3])
    torch.manual_seed(0)
    model = _Tabled()
    engine = _wrap(model, 2)
    assert model.table.dtype == torch.float32 and model.scale.dtype == torch.bfloat16
    with pytest.raises(RuntimeError) as raised:
        engine((x, y))
    note = " ".join(getattr(raised.value, "__notes__", []))
    assert "derived (non-persistent) buffers 'table' keep the dtype" in note, (str(raised.value), note)
    assert "set precision.cast_derived_buffers: true" in note
    engine.close()

    torch.manual_seed(0)
    model = _Tabled()
    engine = _wrap(model, 2, cast_derived_buffers=True)
    assert model.table.dtype == torch.bfloat16
    engine.backward(engine((x, y)))
    assert engine.step()
    engine.close()
