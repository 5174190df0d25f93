"""Describe any Hugging Face model (or any nn.Module) for the estimator and the planner.

:class:`HFModelDims` is the sibling of :class:`~tiertrain.estimate.dims.ModelDims` for
models tiertrain did not write: :func:`~tiertrain.estimate.memory.estimate`, the peak
simulation (:mod:`tiertrain.estimate.peak`) and :func:`~tiertrain.estimate.plan.plan`
accept either. Its parameter count is exact (the model is built on the meta device from
its config, ``Module.parameters()`` deduplicating tied weights; trainable vs frozen read
from ``requires_grad``), and its activations are modelled per block from the operations of
the transformers modeling code (``transformers/models/<family>/modeling_*.py``, v5), each
tensor autograd saves for backward counted once, as ``torch.autograd.graph.
saved_tensors_hooks`` sees it on CPU (tests/test_estimate_hf.py checks it so):

* **sublayer** (attention or MLP, residual around it). Pre-norm (Llama, Mistral, Qwen2,
  GPT-2, T5): the residual input x, the norm's internals (RMSNorm: the fp32 input 4 B and
  x·rsqrt in the compute dtype, plus rsqrt 4·b·s; LayerNorm: mean/rstd 2·D·b·s) and its
  output (the linear's input). Post-norm (BERT, BART): the previous LayerNorm's output
  (the linear's input) and the residual sum the next LayerNorm keeps (+ its stats). Hidden
  dropout adds its mask after the sublayer (CPU ``torch.dropout`` keeps the scaled noise in
  the input's dtype: D bytes per element, not a 1-byte mask).
* **attention**, on ``q_dim = heads·head_dim`` and ``kv_dim = kv_heads·head_dim``: Q (after
  rotary where used), K and V, and the output (the o-projection's input). SDPA on CPU
  without attention dropout runs the fused flash kernel: + its fp32 log-sum-exp 4·b·a·s,
  no s×s tensor; with GQA and no padding mask transformers passes ``enable_gqa`` so K and V
  stay kv_dim wide (``integrations/sdpa_attention.use_gqa_in_sdpa``). With attention
  dropout > 0 (BERT, GPT-2 defaults), or an additive bias that needs a gradient (T5's
  relative position bias), SDPA falls back to the math path, which keeps the softmax, the
  dropout noise and the dropped probabilities: 3·a·s·s_kv·b elements (1 without dropout),
  in fp32 on CPU (16-bit Q, K, V are upcast, and those fp32 copies are what it keeps);
  eager attention keeps the fp32 softmax (+ its cast when D ≠ 4, + noise and dropped).
* **MLP**: SwiGLU (``gate·up``: gate out, up out, act out, product: 4 tensors of width
  ``intermediate``); a plain MLP keeps what its activation saves (GELU/ReLU/SiLU one
  tensor, GPT-2's ``gelu_new`` four: x, tanh, 1+tanh, 0.5·x) plus the second linear's
  input, plus T5's / BART's inner dropout noise.
* **outside the blocks**: embedding dropout noise (and the embedding LayerNorm's input of
  BERT/BART), the final norm, BERT's MLM transform (dense → GELU → LayerNorm), the encoder
  output the decoder's cross-attention keeps, then the loss as in tiertrain's GPT: fp32
  log-softmax 4·s·b·V plus the int64 ids and labels.

Encoder-decoder blocks are listed encoder first (registration order), so the backward
walks the decoder's blocks, last first, then the encoder's — as the peak simulation does.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any

import torch
import torch.nn as nn
from torch.nn.modules.module import register_module_module_registration_hook

from ..blocks import own_checkpoint_interval
from ..errors import TiertrainError
from .activations import ActivationBytes

__all__ = ["HFModelDims", "dims_of_hf_config", "dims_of_module", "load_hf_config", "SUPPORTED_FAMILIES",
           "build_meta_model"]

_LLAMA_LIKE = ("llama", "mistral", "qwen2")
SUPPORTED_FAMILIES = {
    "decoder": _LLAMA_LIKE + ("gpt2",),
    "encoder": ("bert", "roberta"),
    "encoder-decoder": ("t5", "bart"),
}
"""model_type values whose activations are modelled, by kind of model."""

_ACT_SAVED = {"silu": 1, "swish": 1, "gelu": 1, "gelu_pytorch_tanh": 1, "relu": 1, "gelu_new": 4,
              "gelu_fast": 4, "quick_gelu": 2}
"""Tensors of the MLP's inner width an activation function saves for backward (its input
or its output; ``gelu_new`` = 0.5·x·(1 + tanh(√(2/π)(x + 0.044715x³))) saves x, tanh,
1 + tanh and 0.5·x). Unknown activations count 4 (conservative)."""


@dataclass
class HFModelDims:
    """Shape, parameter count and activation model of a Hugging Face transformer (or of a
    given module), accepted wherever :class:`~tiertrain.estimate.dims.ModelDims` is."""

    model_type: str
    """The config's ``model_type`` (llama, mistral, qwen2, gpt2, bert, roberta, t5, bart)."""
    kind: str
    """"decoder", "encoder" or "encoder-decoder"."""
    n_encoder_layers: int
    """Encoder blocks (0 for a decoder-only model)."""
    n_decoder_layers: int
    """Decoder blocks (0 for an encoder-only model)."""
    hidden: int
    """Model width h (hidden_size / n_embd / d_model)."""
    n_heads: int
    """Query heads a."""
    kv_heads: int
    """Key/value heads (num_key_value_heads; = n_heads without GQA)."""
    head_dim: int
    """Width of one head (T5: d_kv, which need not be hidden / n_heads)."""
    intermediate: int
    """MLP inner width f (intermediate_size / n_inner / d_ff / ffn_dim)."""
    vocab: int
    """Vocabulary size V."""
    seq_len: int
    """Tokens per sequence s (the encoder's, for an encoder-decoder)."""
    decoder_seq_len: int
    """Decoder tokens per sequence (= seq_len unless set)."""
    parameters: int
    """Exact distinct parameters of the model (tied weights once)."""
    trainable_parameters: int
    """Of which ``requires_grad`` (the rest is frozen: no gradient, master or Adam state)."""
    norm: str = "layernorm"
    """"rms" (Llama/T5 RMSNorm) or "layernorm"."""
    pre_norm: bool = True
    """Norm before each sublayer (False: BERT/BART's post-norm, after the residual sum)."""
    gated_mlp: bool = False
    """gate·up MLP (SwiGLU, T5 v1.1's gated-gelu)."""
    activation: str = "gelu"
    """The MLP's activation function (config name)."""
    attention: str = "flash"
    """What attention keeps: "flash" (fused SDPA: output + log-sum-exp), "math" (SDPA's
    fallback: softmax, dropout noise, dropped probabilities) or "eager"."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    hidden_dropout: float = 0.0
    """Dropout after each sublayer (and on the embeddings)."""
    inner_dropout: float = 0.0
    """Dropout inside the MLP, after the activation (T5 dropout_rate, BART activation_dropout)."""
    final_dropout: bool = False
    """Dropout after the final norm (T5)."""
    embedding_norm: bool = False
    """A LayerNorm right after the embeddings (BERT, BART)."""
    mlm_transform: bool = False
    """BERT's MLM head transform (dense → act → LayerNorm) before the decoder."""
    tie_embeddings: bool = True
    """The output head shares the token-embedding weight."""
    own_checkpointing: int = 0
    """k when the model checkpoints blocks 0, k, 2k, … itself (gradient_checkpointing_enable;
    tiertrain.estimate.own_checkpointing), 0 when it does not."""
    config: Any = field(default=None, repr=False, compare=False)
    """The transformers PretrainedConfig described (None for a hand-built description)."""
    module: Any = field(default=None, repr=False, compare=False)
    """The module measured (dims_of_module), else None: :meth:`meta_model` builds one."""
    source: str = ""
    """Where the description came from (a config path, a class name)."""

    # -- the attributes ModelDims users read ----------------------------------------------

    @property
    def n_layers(self) -> int:
        """All blocks, encoder and decoder."""
        return self.n_encoder_layers + self.n_decoder_layers

    @property
    def dropout(self) -> bool:
        """Any dropout active in training."""
        return max(self.hidden_dropout, self.attention_dropout, self.inner_dropout) > 0

    @property
    def stores_attention_scores(self) -> bool:
        """Attention keeps s×s tensors (math or eager path)."""
        return self.attention != "flash"

    @property
    def ffn_mult(self) -> float:
        """intermediate / hidden (informational)."""
        return self.intermediate / self.hidden

    @property
    def bias(self) -> bool:
        """Linear layers carry biases (not in Llama-style models or T5)."""
        return self.model_type not in _LLAMA_LIKE + ("t5",)

    def validate(self) -> "HFModelDims":
        """Raise ValueError naming the first invalid field; return self when valid."""
        for name in ("hidden", "n_heads", "kv_heads", "head_dim", "intermediate", "vocab", "seq_len",
                     "decoder_seq_len", "parameters"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"HFModelDims.{name}={v!r} is invalid: must be an int >= 1")
        if self.n_layers < 1:
            raise ValueError(f"HFModelDims has {self.n_layers} blocks: must have at least one")
        k = self.own_checkpointing
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= self.n_layers:
            raise ValueError(f"HFModelDims.own_checkpointing={k!r} is invalid: must be 0 (none) or 1..{self.n_layers}")
        if self.kind not in SUPPORTED_FAMILIES:
            raise ValueError(f"HFModelDims.kind={self.kind!r} is invalid: must be one of {sorted(SUPPORTED_FAMILIES)}")
        if self.attention not in ("flash", "math", "eager"):
            raise ValueError(f"HFModelDims.attention={self.attention!r} is invalid: must be flash, math or eager")
        if self.n_heads % self.kv_heads:
            raise ValueError(f"HFModelDims.kv_heads={self.kv_heads} is invalid: must divide n_heads={self.n_heads}")
        return self

    def num_parameters(self) -> int:
        """Exact distinct parameters (counted on the built model)."""
        return self.parameters

    def largest_operator_elements(self) -> int:
        """Weight elements of the largest linear: max(f·h, V·h, q_dim·h)."""
        h = self.hidden
        return max(self.intermediate * h, self.vocab * h, self.n_heads * self.head_dim * h)

    def meta_model(self) -> nn.Module:
        """The module the engine's layout is computed on: the given one, else the model
        built from :attr:`config` on the meta device (cached)."""
        if self.module is None:
            if self.config is None:
                raise ValueError("HFModelDims has neither a module nor a config: build it with dims_of_hf_config "
                                 "or dims_of_module")
            self.module = build_meta_model(self.config)
        return self.module

    def model_section(self) -> dict[str, Any]:
        """What a plan writes about the model (not a GPT model section)."""
        return {"hf_model_type": self.model_type, "hf_source": self.source, "parameters": self.parameters,
                "seq_len": self.seq_len}

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready fields (without the config and module objects), with n_layers."""
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("config", "module")}
        out["n_layers"] = self.n_layers
        return out

    # -- activations ------------------------------------------------------------------------

    def _norm(self, tokens: int, D: int) -> int:
        """A pre-norm's saved bytes besides its output and the residual: RMSNorm the fp32
        input (4 B; the residual itself when D = 4) + x·rsqrt (D) + rsqrt (4/token) beyond
        the residual's D; LayerNorm mean and rstd (2·D/token)."""
        h = self.hidden
        if self.norm == "rms":
            # T5LayerNorm multiplies the 16-bit input itself by the fp32 rsqrt: it keeps it too
            t5 = tokens * h * D if self.model_type == "t5" and D != 4 else 0
            return tokens * h * (4 - D) + tokens * h * D + 4 * tokens + t5
        return 2 * D * tokens

    def _attention(self, s_q: int, s_kv: int, b: int, D: int) -> int:
        """Bytes one attention keeps besides its input: Q, K, V, the output, and the
        flash log-sum-exp or the math/eager s×s tensors."""
        a, qd, kvd = self.n_heads, self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        if self.attention != "flash":
            kvd = qd  # repeat_kv: the math path attends over the repeated heads
        scores = a * s_q * s_kv * b
        if self.attention == "flash":
            return (2 * s_q * qd + 2 * s_kv * kvd) * b * D + 4 * b * a * s_q
        drop = self.attention_dropout > 0
        if self.attention == "math":  # on CPU it computes in fp32 (16-bit inputs upcast): Q, K, V, s×s
            return (s_q * qd + 2 * s_kv * kvd) * b * 4 + s_q * qd * b * D + scores * 4 * (3 if drop else 1)
        return (2 * s_q * qd + 2 * s_kv * kvd) * b * D + scores * (4 + (D if D != 4 else 0) + (2 * D if drop else 0))

    def mlp_saved_bytes(self, tokens: int, D: int) -> int:
        """Bytes the MLP keeps besides its input: all f wide, none kept when it runs in tiles
        (tiertrain.estimate.activations.tiled_mlp_activation_bytes)."""
        return self._mlp(tokens, D)

    def _mlp(self, tokens: int, D: int) -> int:
        """Bytes the MLP keeps besides its input (inner width f per token)."""
        act = _ACT_SAVED.get(self.activation, 4)
        n = act + (3 if self.gated_mlp else 1) + (1 if self.inner_dropout > 0 else 0)
        return n * tokens * self.intermediate * D

    def _sublayer(self, body: int, tokens: int, D: int) -> int:
        """A residual sublayer: its input (+ norm internals and output when pre-norm; the
        residual sum + LayerNorm stats when post-norm) + body + the dropout noise."""
        th = tokens * self.hidden
        mask = th * D if self.hidden_dropout > 0 else 0
        if self.pre_norm:
            return 2 * th * D + self._norm(tokens, D) + body + mask
        return 2 * th * D + 2 * D * tokens + body + mask

    def _attention_kept(self, s_q: int, s_kv: int, b: int, D: int) -> int:
        """Outputs one attention keeps under selective recomputation: the Q, K, V and output
        projections, and the fused SDPA's output and log-sum-exp (the math and eager paths
        run batched matmuls, which are recomputed)."""
        h, a, qd, kvd = self.hidden, self.n_heads, self.n_heads * self.head_dim, self.kv_heads * self.head_dim
        fused = (s_q * qd * b * D + 4 * b * a * s_q) if self.attention == "flash" else 0
        return (s_q * qd + 2 * s_kv * kvd + s_q * h) * b * D + fused

    def _mlp_kept(self, tokens: int, D: int) -> int:
        """Outputs the MLP keeps under selective recomputation: its linears (gate and up, or
        the first, then the down projection)."""
        return tokens * ((2 if self.gated_mlp else 1) * self.intermediate + self.hidden) * D

    def kept_bytes(self, micro_batch: int, precision_bytes: int) -> list[int]:
        """Outputs each block keeps besides its input when checkpointed selectively
        (``activations.recompute = "selective"``), in registration order."""
        b, D = micro_batch, precision_bytes
        s, sd = self.seq_len, self.decoder_seq_len
        if self.kind == "encoder-decoder":
            enc = self._attention_kept(s, s, b, D) + self._mlp_kept(b * s, D)
            dec = self._attention_kept(sd, sd, b, D) + self._attention_kept(sd, s, b, D) + self._mlp_kept(b * sd, D)
            return [enc] * self.n_encoder_layers + [dec] * self.n_decoder_layers
        return [self._attention_kept(s, s, b, D) + self._mlp_kept(b * s, D)] * self.n_layers

    def _kept_unused(self, micro_batch: int, D: int) -> int:
        """Of the largest block's kept outputs, those its backward never reads: the
        projections back to the residual stream (and Q/K before rotary)."""
        tokens = micro_batch * (self.decoder_seq_len if self.kind == "encoder-decoder" else self.seq_len)
        projections = 3 if self.kind == "encoder-decoder" else 2
        rotary = (self.n_heads + self.kv_heads) * self.head_dim if self.model_type in _LLAMA_LIKE else 0
        return tokens * (projections * self.hidden + rotary) * D

    def block_bytes(self, micro_batch: int, precision_bytes: int) -> list[int]:
        """Saved-for-backward bytes of each block, in registration order (encoder first)."""
        b, D = micro_batch, precision_bytes
        s, sd = self.seq_len, self.decoder_seq_len
        if self.kind == "encoder-decoder":
            enc = (self._sublayer(self._attention(s, s, b, D), b * s, D)
                   + self._sublayer(self._mlp(b * s, D), b * s, D))
            dec = (self._sublayer(self._attention(sd, sd, b, D), b * sd, D)
                   + self._sublayer(self._attention(sd, s, b, D), b * sd, D)
                   + self._sublayer(self._mlp(b * sd, D), b * sd, D))
            return [enc] * self.n_encoder_layers + [dec] * self.n_decoder_layers
        one = self._sublayer(self._attention(s, s, b, D), b * s, D) + self._sublayer(self._mlp(b * s, D), b * s, D)
        return [one] * self.n_layers

    def _ends(self, tokens: int, D: int) -> int:
        """Embeddings (+ their LayerNorm, dropout noise) and the stack's final norm of one
        side (encoder or decoder), the final output included."""
        th = tokens * self.hidden
        mask = th * D if self.hidden_dropout > 0 else 0
        out = mask + (th * D + 2 * D * tokens if self.embedding_norm else 0)
        if self.pre_norm:  # final norm: the residual, internals, its output (or noise + dropped)
            out += 2 * th * D + self._norm(tokens, D) + (mask if self.final_dropout else 0)
        else:  # the last block's LayerNorm output, kept by the head / cross-attention
            out += th * D
        return out

    def activation_bytes(self, micro_batch: int, precision_bytes: int) -> ActivationBytes:
        """:class:`~tiertrain.estimate.activations.ActivationBytes` of one micro-batch (per rank),
        with ``blocks`` listing each block's bytes."""
        b, D = micro_batch, precision_bytes
        s, sd, h, V, f = self.seq_len, self.decoder_seq_len, self.hidden, self.vocab, self.intermediate
        blocks = self.block_bytes(b, D)
        s_out = sd if self.kind == "encoder-decoder" else s
        ids = 8 * b * s * (3 if self.kind == "encoder-decoder" else 2)  # input ids, labels (+ decoder ids)
        head = self._ends(b * s, D) + ids + 4 * s_out * b * V
        if self.kind == "encoder-decoder":
            head += self._ends(b * sd, D)
            if self.model_type == "t5":
                head += 8 * s * s + 8 * sd * sd  # relative-position buckets (int64), encoder and decoder
        if self.mlm_transform:
            head += 3 * b * s * h * D + 2 * D * b * s  # dense out, act out, LayerNorm out (+ stats)
        logits = s_out * b * V * D + (4 * s_out * b * V if D != 4 else 0)
        head_bwd = 2 * 4 * s_out * b * V + (s_out * b * V * D if D != 4 else 0)
        scores_bwd = 2 * self.n_heads * s_out * s_out * b * D if self.attention != "flash" else 0
        block_bwd = (f + h) * b * s_out * D + scores_bwd + max(f, self.n_heads * self.head_dim) * h * D
        tied = V * h * D if self.tie_embeddings else 0
        return ActivationBytes(block=max(blocks), checkpoint=b * s * h * D, head=head, logits_in_flight=logits,
                               head_backward=head_bwd, block_backward=block_bwd, tied_head_grad=tied,
                               blocks=tuple(blocks), kept=tuple(self.kept_bytes(b, D)),
                               kept_unused=self._kept_unused(b, D))


# --------------------------------------------------------------------------- building


class UnmodelledFamily(TiertrainError, ValueError):
    """A Hugging Face family whose activations the estimator does not model (its model states
    can still be estimated from the module or a parameter count)."""


def load_hf_config(path_or_config: Any):
    """A transformers PretrainedConfig from a config, a ``config.json`` path or a
    directory holding one; ValueError naming the value and what is valid otherwise."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(path_or_config, PretrainedConfig):
        return path_or_config
    if not isinstance(path_or_config, (str, os.PathLike)):
        raise ValueError(f"hf config {path_or_config!r} is invalid: must be a transformers PretrainedConfig, a "
                         "config.json path or a directory holding one")
    path = os.fspath(path_or_config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"--hf-config {os.fspath(path_or_config)!r}: no such file; expected a Hugging Face "
                         "config.json (or the directory holding it)")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"--hf-config {path!r} is not a JSON file ({e}); "
                         "expected a Hugging Face config.json") from None
    if not isinstance(data, dict) or "model_type" not in data:
        raise ValueError(f"--hf-config {path!r} has no \"model_type\": not a Hugging Face config.json (write one "
                         "with config.save_pretrained(dir) or config.to_json_file(path))")
    try:
        return AutoConfig.for_model(**data)
    except (ValueError, KeyError) as e:
        raise ValueError(f"--hf-config {path!r}: model_type {data['model_type']!r} is unknown to transformers "
                         f"({e})") from None
    except Exception as e:  # (transformers' own checks of the values: TypeError, its validation errors)
        raise ValueError(f"--hf-config {path!r} is not a config transformers accepts ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]})") from None


def _kind(config: Any) -> str:
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder"
    if config.model_type in SUPPORTED_FAMILIES["encoder"] or any(
            "MaskedLM" in a for a in (getattr(config, "architectures", None) or [])):
        return "encoder"
    return "decoder"


MAX_MODULES = 200_000
"""Modules a meta model may have. The largest models on the Hub have tens of thousands
(DeepSeek-V3's 61 layers of 256 experts: about 60 000); a config whose sizes would build more
(a layer count of 2^70, which the config fuzzer wrote) is refused while it builds, not hours later."""


MAX_LAYERS = 10_000
"""Layers a config may give (the deepest models have a few hundred)."""


def _counts(config: Any, *words: str) -> dict[str, int]:
    """The config's integer fields whose names hold one of ``words`` (its layer or expert counts)."""
    return {k: v for k, v in vars(config).items()
            if isinstance(v, int) and not isinstance(v, bool) and any(w in k for w in words)}


def build_meta_model(config: Any) -> nn.Module:
    """The model of ``config`` on the meta device (nothing allocated): the LM-head class
    of its kind (AutoModelForCausalLM / ForMaskedLM / ForSeq2SeqLM). ValueError past
    MAX_MODULES modules."""
    import transformers

    auto = {"decoder": transformers.AutoModelForCausalLM, "encoder": transformers.AutoModelForMaskedLM,
            "encoder-decoder": transformers.AutoModelForSeq2SeqLM}[_kind(config)]
    layers = {k: v for k, v in _counts(config, "layer").items() if v > MAX_LAYERS}
    if layers:  # (before building: the module count below would find it only after seconds)
        raise ValueError(f"the config's {layers} exceeds {MAX_LAYERS} layers: no model of that depth exists")
    built = 0

    def count(module: nn.Module, name: str, submodule: nn.Module | None) -> None:
        nonlocal built
        built += 1
        if built > MAX_MODULES:
            raise ValueError(f"the config describes a model of more than {MAX_MODULES} modules "
                             f"({_counts(config, 'layer', 'expert')}): no model of that size exists; check its "
                             f"layer and expert counts")

    handle = register_module_module_registration_hook(count)
    try:
        with torch.device("meta"):
            return auto.from_config(config)
    finally:
        handle.remove()


def _spec(config: Any) -> dict[str, Any]:
    """The family-specific fields of :class:`HFModelDims` read from ``config``."""
    t = config.model_type
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    g = lambda *names, default=None: next((getattr(config, n) for n in names  # noqa: E731
                                          if getattr(config, n, None) is not None), default)
    if t in _LLAMA_LIKE:
        h, a = config.hidden_size, config.num_attention_heads
        d = dict(hidden=h, n_heads=a, kv_heads=g("num_key_value_heads", default=a),
                 head_dim=g("head_dim", default=h // a), intermediate=config.intermediate_size,
                 norm="rms", gated_mlp=True, activation=config.hidden_act,
                 attention_dropout=float(g("attention_dropout", default=0.0)),
                 n_decoder_layers=config.num_hidden_layers)
    elif t == "gpt2":
        h = config.n_embd
        d = dict(hidden=h, n_heads=config.n_head, kv_heads=config.n_head, head_dim=h // config.n_head,
                 intermediate=config.n_inner or 4 * h, activation=config.activation_function,
                 attention_dropout=config.attn_pdrop, hidden_dropout=max(config.resid_pdrop, config.embd_pdrop),
                 n_decoder_layers=config.n_layer)
    elif t in ("bert", "roberta"):
        h, a = config.hidden_size, config.num_attention_heads
        d = dict(hidden=h, n_heads=a, kv_heads=a, head_dim=h // a, intermediate=config.intermediate_size,
                 activation=config.hidden_act, attention_dropout=config.attention_probs_dropout_prob,
                 hidden_dropout=config.hidden_dropout_prob, pre_norm=False, embedding_norm=True,
                 mlm_transform=True, n_encoder_layers=config.num_hidden_layers)
    elif t == "t5":
        d = dict(hidden=config.d_model, n_heads=config.num_heads, kv_heads=config.num_heads, head_dim=config.d_kv,
                 intermediate=config.d_ff, norm="rms", gated_mlp=bool(config.is_gated_act),
                 activation=config.dense_act_fn, attention_dropout=config.dropout_rate,
                 hidden_dropout=config.dropout_rate, inner_dropout=config.dropout_rate, final_dropout=True,
                 n_encoder_layers=config.num_layers, n_decoder_layers=config.num_decoder_layers)
        impl = "math" if impl == "sdpa" else impl  # the position bias needs a gradient: SDPA's math path
    elif t == "bart":
        h = config.d_model
        d = dict(hidden=h, n_heads=config.encoder_attention_heads, kv_heads=config.encoder_attention_heads,
                 head_dim=h // config.encoder_attention_heads, intermediate=config.encoder_ffn_dim,
                 activation=config.activation_function, attention_dropout=config.attention_dropout,
                 hidden_dropout=config.dropout, inner_dropout=config.activation_dropout, pre_norm=False,
                 embedding_norm=True, n_encoder_layers=config.encoder_layers,
                 n_decoder_layers=config.decoder_layers)
        if (config.decoder_ffn_dim, config.decoder_attention_heads) != (config.encoder_ffn_dim,
                                                                         config.encoder_attention_heads):
            raise ValueError("bart config with different encoder and decoder widths is not modelled: "
                             f"encoder_ffn_dim={config.encoder_ffn_dim}, decoder_ffn_dim={config.decoder_ffn_dim}")
    else:
        valid = sorted(x for v in SUPPORTED_FAMILIES.values() for x in v)
        raise UnmodelledFamily(f"model_type={t!r}: activations are not modelled for this family; supported are {valid}. "
                         "For model states only, pass the module (or a parameter count) to "
                         "tiertrain.estimate.estimate(...) instead")
    if impl == "sdpa":
        impl = "math" if d.get("attention_dropout", 0.0) > 0 else "flash"
    elif impl not in ("eager", "math", "flash"):
        impl = "flash"  # flash_attention_2 / flex: fused kernels keep output + log-sum-exp
    d["attention"] = impl
    d.setdefault("n_encoder_layers", 0)
    d.setdefault("n_decoder_layers", 0)
    d["tie_embeddings"] = bool(getattr(config, "tie_word_embeddings", True))
    return d


def _dims(config: Any, module: nn.Module, seq_len: int | None, decoder_seq_len: int | None,
          source: str) -> HFModelDims:
    spec = _spec(config)
    if seq_len is None:
        seq_len = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
        if not seq_len:
            raise ValueError(f"seq_len=None is invalid for model_type={config.model_type!r}: its config has no "
                             "max_position_embeddings; pass seq_len (an int >= 1)")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len={seq_len!r} is invalid: must be an int >= 1")
    params = list(module.parameters())
    return HFModelDims(
        model_type=config.model_type, kind=_kind(config), vocab=config.vocab_size, seq_len=seq_len,
        decoder_seq_len=decoder_seq_len or seq_len, parameters=sum(p.numel() for p in params),
        trainable_parameters=sum(p.numel() for p in params if p.requires_grad), config=config, module=module,
        source=source, own_checkpointing=own_checkpoint_interval(module), **spec).validate()


def dims_of_hf_config(path_or_config: Any, seq_len: int | None = None) -> HFModelDims:
    """:class:`HFModelDims` of a Hugging Face model given by its config (a PretrainedConfig,
    a ``config.json`` path or its directory), counted on the meta device. ``seq_len``:
    tokens per sequence (None: the config's max_position_embeddings / n_positions)."""
    config = load_hf_config(path_or_config)
    source = os.fspath(path_or_config) if isinstance(path_or_config, (str, os.PathLike)) else type(config).__name__
    try:
        _spec(config)  # an unsupported family fails before building anything
        module = build_meta_model(config)
    except ValueError:
        raise
    except Exception as e:  # (sizes of no model: zero heads, a string width, a negative dimension)
        raise ValueError(f"hf config {source!r} describes no model transformers can build ({type(e).__name__}: "
                         f"{' '.join(str(e).split())[:300]}): its sizes must be positive integers") from None
    return _dims(config, module, seq_len, None, source)


def dims_of_module(module: nn.Module, seq_len: int) -> HFModelDims:
    """:class:`HFModelDims` of a model about to be trained: a transformers PreTrainedModel
    of a supported family (its ``.config`` read; parameters, trainable and frozen, counted
    on ``module`` itself, which the engine's layout is then computed on). ValueError for a
    module whose activations cannot be modelled (no transformers config, or an unsupported
    family), saying what to pass instead."""
    if not isinstance(module, nn.Module):
        raise ValueError(f"dims_of_module: module={type(module).__name__} is invalid: must be an nn.Module")
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "model_type") or not hasattr(config, "to_dict"):
        raise ValueError(
            f"dims_of_module: activations of {type(module).__name__} cannot be modelled (it is not a Hugging Face "
            "PreTrainedModel with a .config); plan with an explicit description instead — "
            "tiertrain.estimate.ModelDims for a GPT-shaped model, dims_of_hf_config(config) for a transformers "
            "architecture — or estimate model states only with tiertrain.estimate.estimate(module, layout)")
    return _dims(config, module, seq_len, None, type(module).__name__)
