"""A GPT-2-style decoder-only transformer, laid out to be split by name: tensor
parallelism (:mod:`tiertrain.parallel.tp_plan`) shards its matrices and pipeline
parallelism (:mod:`tiertrain.pipeline.stage`, :func:`~tiertrain.pipeline.split_gpt`)
cuts it into stages of whole blocks.

The module tree is fixed so that tensor and pipeline parallelism can find the
pieces by name:

    GPT
    ├── embed      nn.Embedding(vocab, hidden)          token embedding
    ├── pos_embed  nn.Embedding(seq_len, hidden)        learned positions
    ├── drop       nn.Dropout
    ├── blocks     nn.ModuleList[Block] (n_layers)
    │     ├── ln1   nn.LayerNorm
    │     ├── attn  CausalSelfAttention: qkv Linear(h, 3h), proj Linear(h, h)
    │     ├── ln2   nn.LayerNorm
    │     └── mlp   MLP: fc1 Linear(h, ffn_mult*h), GELU, fc2 Linear(ffn_mult*h, h)
    ├── norm       nn.LayerNorm (final)
    └── head       nn.Linear(hidden, vocab, bias=False), weight tied to embed by default

Megatron-LM (Shoeybi et al., 2019) §3 splits exactly these matrices: ``attn.qkv``
and ``mlp.fc1`` column-wise (each rank owns whole attention heads / a slice of
the FFN width), ``attn.proj`` and ``mlp.fc2`` row-wise (followed by one
all-reduce each), so a block needs two all-reduces forward and two backward.
To make the column split of ``qkv`` a plain contiguous chunk of its output
dimension, its output is laid out *per head* as ``[n_heads, 3, head_dim]``
(Megatron's layout), not GPT-2's ``[3, n_heads, head_dim]``; and
:class:`CausalSelfAttention` infers the number of heads it holds from the size
of its ``qkv`` output, so a block whose ``qkv``/``proj`` were replaced by
sharded linears runs unchanged.

Initialisation (GPT-2, Radford et al., 2019): every weight matrix and embedding
is drawn from N(0, init_std), the two residual output projections
(``attn.proj``, ``mlp.fc2``) from N(0, init_std / sqrt(2 * n_layers)), biases
are zero and LayerNorms are (1, 0). Each module draws its *own* parameters in
its own ``__init__`` (via ``reset_parameters``) from torch's global RNG, in
construction order. Nothing re-initialises the model afterwards. This matters
for ZeRO-3-style partitioned construction, which shards each submodule as soon
as its ``__init__`` returns, and it makes ``torch.manual_seed(s); GPT(cfg)``
reproducible. The draws in order are:

    embed.weight, pos_embed.weight,
    for each block: attn.qkv.weight, attn.proj.weight, mlp.fc1.weight, mlp.fc2.weight,
    head.weight                      (untied only)

So a tied model draws a strict prefix of what the untied model draws, and with
the same seed the two agree on every parameter except ``head.weight``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields
from types import MappingProxyType
from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..label_conventions import BATCHES_CHECKED, check_gpt_labels

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "MLP", "gpt_tiny", "PRESETS"]


PRESETS: Mapping[str, Mapping[str, Any]] = MappingProxyType(
    {
        # ~0.84M parameters: unit tests and CPU smoke runs.
        "tiny": MappingProxyType({}),
        # ~4.8M parameters: CPU multi-process runs that should still learn something.
        "small": MappingProxyType(dict(n_layers=6, hidden=256, n_heads=8, seq_len=128)),
        # ~39.7M parameters: benchmarks (memory/throughput of the ZeRO stages).
        "bench": MappingProxyType(dict(n_layers=8, hidden=640, n_heads=10, seq_len=256)),
    }
)
"""Named configurations for :meth:`GPTConfig.preset`; values override the defaults."""


@dataclass
class GPTConfig:
    """Shape and initialisation of a :class:`GPT`."""

    vocab_size: int = 256
    """Number of token ids; 256 is the byte-level vocabulary of ByteTokenizer."""
    seq_len: int = 128
    """Maximum sequence length (size of the learned position table)."""
    n_layers: int = 4
    """Number of transformer blocks."""
    hidden: int = 128
    """Model width (embedding and residual stream size)."""
    n_heads: int = 4
    """Number of attention heads; must divide ``hidden``."""
    ffn_mult: int = 4
    """MLP inner width as a multiple of ``hidden``."""
    tie_embeddings: bool = True
    """Share ``head.weight`` with ``embed.weight`` (GPT-2 does)."""
    dropout: float = 0.0
    """Dropout probability for embeddings, attention and residual branches, in [0, 1)."""
    layernorm_eps: float = 1e-5
    """Epsilon of every LayerNorm; must be > 0."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weights and embeddings."""
    bias: bool = True
    """Linear layers carry biases (GPT-2); False drops them (PaLM, LLaMA). Note the key part
    of the qkv bias has an analytically zero gradient (softmax is shift-invariant), so Adam
    turns its rounding noise into lr-sized steps: runs compared bit-for-bit use bias=False."""

    def validate(self) -> "GPTConfig":
        """Raise ValueError naming the first invalid field; return self when valid."""
        for name in ("vocab_size", "seq_len", "n_layers", "hidden", "n_heads", "ffn_mult"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"GPTConfig.{name}={value!r} is invalid: must be a positive int")
        if self.hidden % self.n_heads != 0:
            raise ValueError(
                f"GPTConfig.hidden={self.hidden} is invalid: must be divisible by "
                f"n_heads={self.n_heads}"
            )
        for name in ("tie_embeddings", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"GPTConfig.{name}={getattr(self, name)!r} is invalid: must be a bool")
        if not isinstance(self.dropout, (int, float)) or not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r} is invalid: must be in [0, 1)")
        for name in ("layernorm_eps", "init_std"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"GPTConfig.{name}={value!r} is invalid: must be a number > 0")
        return self

    @property
    def head_dim(self) -> int:
        """Width of one attention head."""
        return self.hidden // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """Inner width of the MLP."""
        return self.ffn_mult * self.hidden

    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "GPTConfig":
        """Return the named preset ("tiny", "small", "bench"), with ``overrides`` applied."""
        if name not in PRESETS:
            raise ValueError(
                f"GPTConfig.preset name={name!r} is unknown: valid names are {sorted(PRESETS)}"
            )
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise ValueError(
                f"GPTConfig.preset overrides {unknown} are not fields: valid fields are {sorted(known)}"
            )
        return cls(**{**PRESETS[name], **overrides}).validate()

    def to_dict(self) -> dict[str, Any]:
        """Plain dict of the fields (for checkpoints and logs)."""
        return asdict(self)

    def num_parameters(self) -> int:
        """Exact number of distinct parameters of ``GPT(self)`` (tied weights counted once)."""
        h, f, v, t = self.hidden, self.ffn_hidden, self.vocab_size, self.seq_len
        layernorm = 2 * h
        b = 1 if self.bias else 0
        attn = (h * 3 * h + b * 3 * h) + (h * h + b * h)  # qkv + proj
        mlp = (h * f + b * f) + (f * h + b * h)  # fc1 + fc2
        block = 2 * layernorm + attn + mlp
        embeddings = v * h + t * h
        head = 0 if self.tie_embeddings else v * h
        return embeddings + self.n_layers * block + layernorm + head


# --------------------------------------------------------------------------- init-owning layers


class _InitLinear(nn.Linear):
    """nn.Linear whose ``reset_parameters`` draws N(0, std) weights and zero biases.

    ``std=None`` draws nothing and leaves the weight uninitialised: used for a head
    whose weight is about to be replaced by the (already initialised) tied embedding.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, std: float | None):
        self.std = std  # read by reset_parameters(), which nn.Linear.__init__ calls
        super().__init__(in_features, out_features, bias=bias)

    def reset_parameters(self) -> None:
        if self.std is not None:
            nn.init.normal_(self.weight, mean=0.0, std=self.std)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class _InitEmbedding(nn.Embedding):
    """nn.Embedding whose ``reset_parameters`` draws N(0, std)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, *, std: float):
        self.std = std
        super().__init__(num_embeddings, embedding_dim)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


# --------------------------------------------------------------------------- blocks


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with a fused, per-head-interleaved ``qkv``.

    ``qkv`` output features are ordered ``[head, (q|k|v), head_dim]`` so that a
    Megatron column split (§3) of ``qkv.weight`` along dim 0 hands each rank
    complete heads; ``forward`` derives the local head count from that width.
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        h = config.hidden
        self.head_dim = config.head_dim
        self.dropout = float(config.dropout)
        self.qkv = _InitLinear(h, 3 * h, bias=config.bias, std=config.init_std)
        self.proj = _InitLinear(
            h, h, bias=config.bias, std=config.init_std / math.sqrt(2 * config.n_layers)
        )
        self.resid_drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        qkv = self.qkv(x)  # [B, T, n_local_heads * 3 * head_dim]
        n_heads = qkv.shape[-1] // (3 * self.head_dim)
        qkv = qkv.view(b, t, n_heads, 3, self.head_dim).permute(3, 0, 2, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]  # each [B, n_heads, T, head_dim]
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        y = y.transpose(1, 2).reshape(b, t, n_heads * self.head_dim)
        return self.resid_drop(self.proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward network: fc1 -> GELU(tanh) -> fc2 -> dropout."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        h, f = config.hidden, config.ffn_hidden
        self.fc1 = _InitLinear(h, f, bias=config.bias, std=config.init_std)
        self.fc2 = _InitLinear(
            f, h, bias=config.bias, std=config.init_std / math.sqrt(2 * config.n_layers)
        )
        self.drop = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.fc2(F.gelu(self.fc1(x), approximate="tanh")))


class Block(nn.Module):
    """Pre-LN transformer block: x + attn(ln1(x)), then x + mlp(ln2(x))."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.hidden, eps=config.layernorm_eps)
        self.attn = CausalSelfAttention(config)
        self.ln2 = nn.LayerNorm(config.hidden, eps=config.layernorm_eps)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


# --------------------------------------------------------------------------- model


class GPT(nn.Module):
    """Decoder-only language model; ``forward`` returns logits, or the loss given labels."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.label_checks = 0  # the batches whose labels forward has checked (label_conventions.py)
        self.config = config.validate()
        self.embed = _InitEmbedding(config.vocab_size, config.hidden, std=config.init_std)
        self.pos_embed = _InitEmbedding(config.seq_len, config.hidden, std=config.init_std)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layers))
        self.norm = nn.LayerNorm(config.hidden, eps=config.layernorm_eps)
        if config.tie_embeddings:
            # Draws no random numbers; its placeholder weight is replaced right away.
            self.head = _InitLinear(config.hidden, config.vocab_size, bias=False, std=None)
            self.head.weight = self.embed.weight
        else:
            self.head = _InitLinear(
                config.hidden, config.vocab_size, bias=False, std=config.init_std
            )

    def embed_tokens(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token + position embeddings (then dropout): [B, T] ids -> [B, T, hidden]."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        t = input_ids.shape[1]
        if t > self.config.seq_len:
            raise ValueError(
                f"input_ids sequence length {t} exceeds GPTConfig.seq_len={self.config.seq_len}"
            )
        pos = self.position_ids(t, input_ids.device)
        return self.drop(self.embed(input_ids) + self.pos_embed(pos))

    def position_ids(self, t: int, device: torch.device) -> torch.Tensor:
        """Positions of the embedded tokens: 0..t-1 (a sequence-parallel model embeds a chunk)."""
        return torch.arange(t, device=device)

    def head_output(
        self, x: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Final LayerNorm and vocabulary projection: logits [B, T, V], or the mean loss."""
        logits = self.head(self.norm(x))
        if labels is None:
            return logits
        # The loss in at least fp32 (bf16/fp16 logits are upcast); a float64 model keeps float64,
        # which the tests' float64 oracle relies on.
        dtype = torch.promote_types(logits.dtype, torch.float32)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(dtype), labels.reshape(-1))

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Logits [B, T, V], or with ``labels`` (next-token targets, [B, T]) the mean
        cross-entropy over all B*T positions (positions labelled -100 are ignored). Labels
        equal to input_ids (the Hugging Face convention) are refused, in the first batches:
        tiertrain/label_conventions.py."""
        if labels is not None and not torch.compiler.is_compiling() and self.label_checks < BATCHES_CHECKED:
            self.label_checks += 1
            check_gpt_labels(input_ids, labels)
        x = self.embed_tokens(input_ids)
        for block in self.blocks:
            x = block(x)
        return self.head_output(x, labels)


def gpt_tiny(**overrides: Any) -> GPT:
    """Build the "tiny" preset (~0.84M parameters), with optional field overrides."""
    return GPT(GPTConfig.preset("tiny", **overrides))
