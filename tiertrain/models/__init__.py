"""Models that tiertrain can train; see :mod:`tiertrain.models.gpt`."""

from tiertrain.models.gpt import GPT, MLP, PRESETS, Block, CausalSelfAttention, GPTConfig, gpt_tiny

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "MLP", "PRESETS", "gpt_tiny"]
