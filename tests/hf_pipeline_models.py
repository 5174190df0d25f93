"""Small Hugging Face models (built from configs, no download) and their batches, shared by
the pipeline tests (tests/test_pipeline_hf.py, tests/test_pipeline_zero3.py)."""
from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")  # (skips the importing test module without it)

T5_TARGET = 12
"""Decoder length of the T5 batches (shorter than the encoder's)."""

TIED = {"bert": ("bert.embeddings.word_embeddings.weight", "cls.predictions.decoder.weight"),
        "gpt2": ("transformer.wte.weight", "lm_head.weight"),
        "qwen2-tied": ("model.embed_tokens.weight", "lm_head.weight"), "t5": ("shared.weight", "lm_head.weight")}
"""(embedding, head) of each tied model: the head's copy on the last stage must stay equal."""


CAUSAL_LMS = ("llama", "gpt2", "qwen2-tied", "qwen3")


def hf_convention(batches: list[dict]) -> list[dict]:
    """Causal-LM batches as Hugging Face gives them: labels = input_ids (the model's loss shifts
    them), from tiertrain's already-shifted ones."""
    return [{"input_ids": b["input_ids"], "labels": b["input_ids"]} for b in batches]


def _causal_lm(model_class, config):
    """model_class(config) initialised from seed 0, in train mode, with its own loss."""
    torch.manual_seed(0)
    return model_class(config).train()


def llama():
    return _causal_lm(transformers.LlamaForCausalLM, transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=False))


def gpt2():
    return _causal_lm(transformers.GPT2LMHeadModel, transformers.GPT2Config(
        vocab_size=256, n_embd=32, n_layer=4, n_head=4, n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0,
        attn_pdrop=0.0, bos_token_id=0, eos_token_id=0))


def qwen2_tied():
    return _causal_lm(transformers.Qwen2ForCausalLM, transformers.Qwen2Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True))


def qwen3():
    """Qwen3: per-head RMS norms on the queries and keys (a family issue 34's items had not run on)."""
    return _causal_lm(transformers.Qwen3ForCausalLM, transformers.Qwen3Config(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=32, tie_word_embeddings=False))


def t5(tie=True):
    torch.manual_seed(0)
    config = transformers.T5Config(vocab_size=256, d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, d_kv=8, relative_attention_num_buckets=8, dropout_rate=0.0,
                                   decoder_start_token_id=0, pad_token_id=0, tie_word_embeddings=tie)
    config.tie_word_embeddings = tie  # (T5Config's constructor sets it True whatever it is given)
    return transformers.T5ForConditionalGeneration(config).train()


def bert(family="bert"):
    torch.manual_seed(0)
    kind, config = ((transformers.BertForMaskedLM, transformers.BertConfig) if family == "bert"
                    else (transformers.RobertaForMaskedLM, transformers.RobertaConfig))
    return kind(config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                       num_attention_heads=4, max_position_embeddings=64, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)).train()


MASK_TOKEN = 3


def mlm(batch):
    """A masked-LM batch from a tiertrain one: a quarter of the positions of every row (the
    same count per row, so the mean over micro-batches is the global batch's mean) replaced by
    MASK_TOKEN and predicted (labels aligned with the inputs, -100 elsewhere); token types 0
    then 1 (two segments)."""
    ids = batch["input_ids"]
    rows, seq = ids.shape
    masked = (torch.arange(seq) + torch.arange(rows)[:, None]) % 4 == 0
    return {"input_ids": ids.masked_fill(masked, MASK_TOKEN), "labels": ids.masked_fill(~masked, -100),
            "token_type_ids": (torch.arange(seq) >= seq // 2).long().expand(rows, seq).contiguous()}
