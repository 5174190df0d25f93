"""A parameter-efficient fine-tuning model for the tests: a Hugging Face Llama whose every
weight is frozen, with trainable low-rank adapters (LoRA: y = Wx + B·A·x) on the attention's
query and value projections, as peft builds them. Most of its bytes are frozen."""
from __future__ import annotations

import torch
import torch.nn as nn


class LowRankAdapter(nn.Module):
    """A frozen linear layer plus a trainable rank-r update B·A (B starts small, not zero, so
    that both factors get gradients from the first step)."""

    def __init__(self, base: nn.Linear, rank: int = 4):
        super().__init__()
        self.base = base
        self.a = nn.Linear(base.in_features, rank, bias=False)
        self.b = nn.Linear(rank, base.out_features, bias=False)
        nn.init.normal_(self.b.weight, std=0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.b(self.a(x))


def lora_llama(seed: int = 0, layers: int = 4) -> nn.Module:
    """A small Llama (GQA) from a config, frozen, with adapters on q_proj and v_proj."""
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=32, tie_word_embeddings=False)
    model = transformers.LlamaForCausalLM(config)
    model.requires_grad_(False)
    for layer in model.model.layers:
        layer.self_attn.q_proj = LowRankAdapter(layer.self_attn.q_proj)
        layer.self_attn.v_proj = LowRankAdapter(layer.self_attn.v_proj)
    return model
