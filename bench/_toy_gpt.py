"""Test-only fallback GPT for the benchmark scripts.

Used only when ``tiertrain.models.gpt`` cannot be imported (the real model is
``tiertrain.models.gpt.GPT``).  Same contract: ``forward(input_ids, labels)``
returns the mean cross-entropy, blocks live in ``model.blocks``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class ToyGPTConfig:
    vocab_size: int = 256
    seq_len: int = 128
    n_layers: int = 6
    hidden: int = 256
    n_heads: int = 8


class _Block(nn.Module):
    def __init__(self, c: ToyGPTConfig):
        super().__init__()
        h = c.hidden
        self.n_heads = c.n_heads
        self.ln1, self.ln2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.qkv, self.proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.fc1, self.fc2 = nn.Linear(h, 4 * h), nn.Linear(4 * h, h)

    def forward(self, x):
        b, t, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.n_heads, h // self.n_heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(y)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x)), approximate="tanh"))


class ToyGPT(nn.Module):
    def __init__(self, c: ToyGPTConfig):
        super().__init__()
        self.embed = nn.Embedding(c.vocab_size, c.hidden)
        self.pos_embed = nn.Embedding(c.seq_len, c.hidden)
        self.blocks = nn.ModuleList(_Block(c) for _ in range(c.n_layers))
        self.norm = nn.LayerNorm(c.hidden)
        self.head = nn.Linear(c.hidden, c.vocab_size, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, input_ids, labels=None):
        x = self.embed(input_ids) + self.pos_embed(torch.arange(input_ids.shape[1]))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))
