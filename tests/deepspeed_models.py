"""The model of tests/deepspeed_checkpoints/ (written by DeepSpeed, read by tiertrain): a tiny
Hugging Face Llama with tied embeddings and one frozen MLP; and transformers' Trainer's rule
for its no-decay param group."""
from __future__ import annotations

import torch


def build_llama(seed: int = 0) -> torch.nn.Module:
    import transformers

    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32, tie_word_embeddings=True))
    model.model.layers[0].mlp.requires_grad_(False)
    return model


def no_decay(name: str) -> bool:
    """Biases and normalisation weights: transformers' Trainer's no-decay group."""
    return name.endswith("bias") or "norm" in name


def as_deepspeed_left_it(expected: dict) -> torch.nn.Module:
    """The model holding a DeepSpeed run's fp32 masters and frozen values (its expected.pt, as
    tests/deepspeed_checkpoints/make.py writes it): the reference's start."""
    model = build_llama()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(expected["masters"][n] if p.requires_grad else expected["frozen"][n].float())
    return model
