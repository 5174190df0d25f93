"""The size of a model for the estimator: :class:`ModelDims`, the shape of a GPT-style decoder
(tiertrain's GPT), with its exact parameter count, and the parameter sizes of any module,
counted on the meta device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn as nn

from .formulas import _positive_int, infinity_parameters

__all__ = ["ModelDims", "count_module_parameters", "module_parameter_sizes"]


# --------------------------------------------------------------------------- model size


@dataclass
class ModelDims:
    """Shape of a GPT-style decoder (tiertrain.models.gpt.GPT's block structure)."""

    n_layers: int
    """Number of transformer blocks (nl)."""
    hidden: int
    """Model width (hd)."""
    n_heads: int
    """Attention heads (attn_heads); must divide ``hidden``."""
    vocab: int
    """Vocabulary size (V)."""
    seq_len: int
    """Sequence length (seq); also the size of the learned position table."""
    ffn_mult: int = 4
    """MLP inner width as a multiple of ``hidden``."""
    tie_embeddings: bool = True
    """Output head shares the token-embedding weight (then it adds no parameters)."""
    dropout: bool = False
    """Dropout is active in training, so its 1-byte masks are kept for backward."""
    stores_attention_scores: bool = False
    """Attention keeps the seq x seq score/softmax tensors (False for fused SDPA/flash)."""
    bias: bool = True
    """Linear layers carry biases (GPTConfig.bias)."""

    def validate(self) -> "ModelDims":
        """Raise ValueError naming the first invalid field; return self when valid."""
        for name in ("n_layers", "hidden", "n_heads", "vocab", "seq_len", "ffn_mult"):
            _positive_int("ModelDims", name, getattr(self, name))
        if self.hidden % self.n_heads:
            raise ValueError(
                f"ModelDims.n_heads={self.n_heads} is invalid: must divide "
                f"hidden={self.hidden}"
            )
        for name in ("tie_embeddings", "dropout", "stores_attention_scores", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(
                    f"ModelDims.{name}={getattr(self, name)!r} is invalid: must be a bool"
                )
        return self

    @classmethod
    def from_gpt_config(cls, config: Any) -> "ModelDims":
        """Dims of ``tiertrain.models.gpt.GPTConfig`` (read by attribute, not imported)."""
        return cls(
            n_layers=config.n_layers, hidden=config.hidden, n_heads=config.n_heads,
            vocab=config.vocab_size, seq_len=config.seq_len, ffn_mult=config.ffn_mult,
            tie_embeddings=config.tie_embeddings, dropout=float(config.dropout) > 0.0,
            bias=bool(getattr(config, "bias", True)),
        ).validate()

    def block_parameters(self) -> int:
        """One block: ln1 2h, qkv h·3h+3h, proj h·h+h, ln2 2h, fc1 h·fh+fh, fc2 fh·h+h
        (the bias terms only with ``bias``)."""
        h, f = self.hidden, self.ffn_mult * self.hidden
        b = 1 if self.bias else 0
        return 2 * h + (3 * h * h + b * 3 * h) + (h * h + b * h) + 2 * h + (h * f + b * f) + (f * h + b * h)

    def num_parameters(self) -> int:
        """Exact count: nl blocks + token (V·h) and position (seq·h) embeddings + final
        LayerNorm (2h) + head h·V without bias (0 when tied to the embedding)."""
        self.validate()
        h = self.hidden
        head = 0 if self.tie_embeddings else h * self.vocab
        return self.n_layers * self.block_parameters() + (self.vocab + self.seq_len) * h + 2 * h + head

    def paper_parameters(self) -> int:
        """ZeRO-Infinity §3 approximation Ψ ≈ 12·nl·hd² (four linears per block)."""
        return infinity_parameters(self.n_layers, self.hidden)

    def largest_operator_elements(self) -> int:
        """Weight elements of the biggest single linear: max(h·ffn·h, V·h) (fc1 or head)."""
        return max(self.ffn_mult * self.hidden * self.hidden, self.vocab * self.hidden)


def count_module_parameters(module_or_factory: nn.Module | Callable[[], nn.Module]) -> int:
    """Distinct parameters of a module; a factory is built on the meta device (nothing
    allocated). Shared (tied) parameters are counted once (``Module.parameters`` dedups)."""
    return sum(module_parameter_sizes(module_or_factory))


def module_parameter_sizes(module_or_factory: nn.Module | Callable[[], nn.Module]) -> list[int]:
    """numel of each distinct parameter tensor, in registration order (meta device)."""
    if isinstance(module_or_factory, nn.Module):
        module = module_or_factory
    elif callable(module_or_factory):
        with torch.device("meta"):
            module = module_or_factory()
        if not isinstance(module, nn.Module):
            raise ValueError(
                f"module_factory returned {type(module).__name__}: must return an nn.Module"
            )
    else:
        raise ValueError(
            f"module_or_factory={module_or_factory!r} is invalid: must be an nn.Module "
            "or a zero-argument callable returning one"
        )
    return [p.numel() for p in module.parameters()]
