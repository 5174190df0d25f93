"""Cut a Hugging Face model into pipeline stages automatically.

:func:`split_hf` turns a model whose forward runs *embeddings → a list of blocks → final norm +
head* into ``num_stages = p·v`` stage modules with the executor's interface
``stage(x, batch)`` (see :mod:`.stage`): the first stage embeds ``batch["input_ids"]``, the
middle ones run a contiguous range of blocks, the last one applies the final norm and the head
and returns the loss, the next-token cross-entropy of the logits against ``batch["labels"]``
(already shifted, as tiertrain's datasets give them; the mean over every position, ``-100``
ignored), the loss of tiertrain's own GPT stages.

A causal LM's last stage takes the model's own loss of ``labels`` (the tokens: its loss shifts
them) or of ``shift_labels`` (each position's next token, transformers' ``shift_labels=``, what
tiertrain's datasets give as labels): :func:`causal_targets`.

Recognised families (:func:`recognise`):

* **rotary decoders** (``model_type`` in :data:`PIPELINE_DECODERS`: Llama, Mistral, Qwen2,
  Qwen3, Gemma, OLMo, OLMo 2, Phi-3, GLM, SmolLM3, Ministral, StableLM, and others whose forward
  is one of those three): ``model.embed_tokens``, ``model.layers``, ``model.norm``, ``lm_head``, rotary
  position embeddings computed once by ``model.rotary_emb`` and given to every layer, GQA,
  tied or untied head, full or sliding-window attention per layer;
* **GPT-2**: ``transformer.wte`` + ``transformer.wpe`` (learned positions), ``transformer.h``,
  ``transformer.ln_f``, ``lm_head`` (tied to ``wte``);
* **encoder-decoder T5** (``model_type`` in :data:`ENCODER_DECODERS`,
  ``T5ForConditionalGeneration``): ``shared`` (= ``encoder/decoder.embed_tokens``),
  ``encoder.block``, ``encoder.final_layer_norm``, ``decoder.block``,
  ``decoder.final_layer_norm``, ``lm_head`` (tied to ``shared`` by default, the decoder output
  then scaled by ``d_model**-0.5`` as the model does). The blocks are numbered encoder first
  (``layers`` 0 … Le-1), then decoder (Le … Le+Ld-1); the encoder's final norm rides with its
  last block, so a stage boundary may fall anywhere, also inside either stack;
* **encoders with a masked-LM head** (``model_type`` in :data:`ENCODERS`, ``BertForMaskedLM``,
  ``RobertaForMaskedLM``): ``<base>.embeddings`` (word + position + token-type embeddings,
  LayerNorm, dropout; ``<base>`` = ``bert`` or ``roberta``), ``<base>.encoder.layer``, the MLM
  head ``cls`` (BERT) or ``lm_head`` (RoBERTa), its decoder tied to the word embeddings. The
  loss is the masked-LM cross-entropy, the model's own: labels *aligned* with the inputs (not
  shifted), ``-100`` where a token is not predicted. A batch is ``input_ids``, ``labels`` and
  optionally ``token_type_ids`` (given to the embeddings on stage 0); every block stage makes
  the bidirectional mask itself (with the batch's padding ``attention_mask``, if any). Not with a
  tensor-parallel plan yet.

Decoders and encoders: only the hidden states travel between stages, ``[batch, seq, hidden]``: every stage
that runs blocks recomputes what its blocks need besides (position ids, the rotary cos/sin, the
causal mask) from the batch, with the model's own modules and mask functions, so the maths is
the unsplit model's. A padding ``attention_mask`` (T5: and ``decoder_attention_mask``) in the
batch is not sent either: every stage gives it to the model's mask functions for its blocks
(refused for a chain of modules and under context parallelism).

Encoder-decoder (T5): a batch is ``input_ids`` [B, S] (the encoder's), ``labels`` [B, T] (the
decoder's targets, aligned with its inputs: the loss is the cross-entropy of the logits
against them, the model's own) and optionally ``decoder_input_ids`` [B, T]; without them they
are built from the labels as Hugging Face does (shifted right, ``decoder_start_token_id``
first, -100 → ``pad_token_id``), so the same batches train the unsplit model. The executor
sends one tensor per micro-batch, so the stage message is one flat tensor of
``B·S·d + B·T·d + heads·(S² + T²)`` elements (:meth:`HFStage._t5_sizes`), the same at every
boundary: the encoder's hidden states (its output once the encoder is done, which every
decoder block attends to), the decoder's hidden states (its embeddings, made on stage 0, until
the decoder starts), and the two relative position biases that block 0 of each stack computes
and its later blocks reuse (zeros until computed). Carrying the biases rather than recomputing
them keeps ``relative_attention_bias`` in one stage and its gradient exact: the later blocks'
gradient reaches it through the message. The cross-attention's bias is zero and made by every
block itself.

Tensor parallelism: convert the model with a plan first (:func:`tiertrain.parallel.parallelize_module`,
``sequence_parallel=False``), then split. What travels is the whole activation (the same on
every tp rank), so Megatron's scatter/gather of the executor applies. A ``colwise`` ``lm_head``
(vocabulary-parallel head, with a ``vocab`` embedding, tied or not) gets the vocab-parallel
cross-entropy. Refused, with the module named: sequence parallelism; T5's attention (q, k, v,
o: the bias in the message holds every head; shard its MLPs, embedding and head); rotary
q/k/v projections that would not hold whole heads per rank. Plans that work, for example::

    llama = {"model.embed_tokens": "vocab", "model.layers.*.self_attn.[qkv]_proj": "colwise",
             "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
             "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise",
             "lm_head": "colwise"}
    gpt2 = {"transformer.wte": "vocab", "lm_head": "colwise"}  # (its Conv1D blocks stay whole)
    t5 = {"shared": "vocab", "*.embed_tokens": "vocab", "*.DenseReluDense.wi": "colwise",
          "*.DenseReluDense.wo": "rowwise", "lm_head": "colwise"}

Layout: ``balance="layers"`` (default) splits the blocks evenly (the first ``L mod S`` stages
get one more; the embeddings ride with stage 0 and the head with the last);
``balance="params"`` minimises the largest stage's parameter count over the units
[embeddings, block 0, …, block L-1, norm + head] (a stage may then hold only the embeddings or
only the head). Or give the split explicitly, one list of module names per stage, in model
order, e.g. for a 4-layer Llama on 2 stages::

    split=[["model.embed_tokens", "model.layers.0"],
           ["model.layers.1", "model.layers.2", "model.layers.3", "model.norm", "lm_head"]]

Naming one module of a group places the whole group on that stage (``model.embed_tokens``:
the embeddings; ``model.norm`` or ``lm_head``: norm + head; T5: ``shared``, ``lm_head``, and
``encoder.final_layer_norm`` with the last encoder block). For a model that is **not**
recognised, an explicit split makes *sequential* stages: each stage calls its modules in the
order given, the first on ``batch["input_ids"]``, each on the previous one's output (the first
element of a tuple), and the last module's output is taken as the logits. That fits models
whose forward is such a chain; anything else needs hand-written stage modules.

Parameter names are the model's (``model.layers.3.self_attn.q_proj.weight``): a stage holds
the model's own submodules at their own paths (no copy). A weight shared by the first and the
last stage (a tied ``lm_head``) is untied in place the Megatron way: the last stage gets its
own copy, initialised equal; the stage's ``tied_names`` = (first stage's name, last stage's
name) tell :class:`~.engine.PipelineEngine` which gradients to exchange (their sum on both
sides), so the copies stay equal. With the bare :class:`~.executor.PipelineExecutor`, pass
``tied=False`` and sum those gradients yourself (:func:`~.stage.sum_tied_gradients`).
"""
from __future__ import annotations

import functools
import inspect
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..parallel.context import next_token_labels
from ..parallel.cp_plan import cp_attributes
from .hf_context import check_stage, local_tokens, token_mean_share
from .hf_cut import _balanced, _check_tensor_parallel, _explicit, _untie, uncovered
from .hf_families import ENCODER_DECODERS, ENCODERS, PIPELINE_DECODERS, Family, recognise

__all__ = ["ENCODERS", "ENCODER_DECODERS", "PIPELINE_DECODERS", "Family", "HFStage", "recognise", "split_hf"]


def _attach(root: nn.Module, path: str, module: nn.Module) -> None:
    """Register ``module`` under the dotted ``path`` of ``root``, creating empty containers."""
    *parents, leaf = path.split(".")
    node = root
    for part in parents:
        if part not in node._modules:
            node.add_module(part, nn.Module())
        node = node._modules[part]
    node.add_module(leaf, module)


def _causal_lm_loss_of(model: nn.Module):
    """The loss a Hugging Face causal LM computes from its logits and labels (its
    ``loss_function``: transformers' ForCausalLMLoss shifts the labels, ``labels =
    input_ids``, and leaves -100 out; or the one the user set), or None for a model without
    one (an encoder-decoder's and a masked-LM encoder's loss is :func:`next_token_loss`, whose
    labels are aligned with the logits as theirs are)."""
    return getattr(model, "loss_function", None) if hasattr(model, "loss_type") else None


def _shifts_labels(loss_function) -> bool:
    from transformers.loss.loss_utils import ForCausalLMLoss

    return loss_function is ForCausalLMLoss


def _head_loss(stage: "HFStage", logits: torch.Tensor, labels: torch.Tensor, shifted: bool = False) -> torch.Tensor:
    """The loss of the last stage: the model's own (issue 34, item 3: the same batch means the
    same at every pipeline size). A causal LM's is its ``loss_function`` (transformers' shifts
    the labels); an encoder-decoder's or a masked-LM encoder's is the cross-entropy against
    labels at the same positions (:func:`next_token_loss`, -100 left out, as theirs). A
    vocabulary-parallel head (``lm_head`` made a :class:`~tiertrain.parallel.ColumnParallelLinear`
    by a tensor-parallel plan, its logits [B, T, V/t]) gets the vocab-parallel cross-entropy of
    the same labels, never gathering the logits."""
    from ..parallel.tensor import ColumnParallelLinear, tp_world_size, vocab_parallel_cross_entropy
    head = getattr(stage, "lm_head", None)
    vocab = getattr(stage.hf_config, "vocab_size", None)
    loss_function = stage.loss_function
    if (isinstance(head, ColumnParallelLinear) and not head.gather_output
            and tp_world_size(head.group) > 1):
        if head.sequence_parallel:
            raise ValueError("hf_split's stages do not support sequence parallelism (the plan's "
                             "sequence_parallel=True): only the hidden states [batch, seq, hidden] travel")
        if loss_function is not None and not _shifts_labels(loss_function):
            raise ValueError(f"a vocabulary-parallel head computes transformers' causal-LM loss only; this "
                             f"model's loss_function is {getattr(loss_function, '__name__', loss_function)!r}: "
                             f"keep lm_head whole (no 'colwise' plan for it) to use it")
        if loss_function is not None and not shifted:  # (ForCausalLMLoss: position t predicts labels[t + 1])
            labels = next_token_labels(labels)
        return vocab_parallel_cross_entropy(logits, labels, head.group)
    if vocab is not None and logits.shape[-1] != vocab:
        raise ValueError(f"the head gave {logits.shape[-1]} logits per token, not vocab_size={vocab}: a "
                         f"vocabulary-split head must be lm_head converted by the tensor-parallel plan style "
                         f"'colwise' (tiertrain.parallel.parallelize_module)")
    if loss_function is not None and shifted:  # (transformers' shift_labels=: the next tokens already)
        return loss_function(logits, None, vocab_size=logits.shape[-1], shift_labels=labels)
    if loss_function is not None:
        return loss_function(logits, labels, vocab_size=logits.shape[-1])
    return next_token_loss(logits, labels)


def causal_targets(batch: dict) -> tuple[torch.Tensor, bool]:
    """A causal LM batch's targets and whether they are shifted already: ``shift_labels``
    (position t's target: transformers' ``shift_labels=``, which its loss takes instead of the
    labels), else ``labels`` (the token at each position, which its loss shifts)."""
    if batch.get("shift_labels") is not None:
        return batch["shift_labels"], True
    if "labels" not in batch:
        raise KeyError("the last pipeline stage of a causal LM needs the batch's 'labels' (the tokens: the model's "
                       "loss shifts them) or 'shift_labels' (each position's next token)")
    return batch["labels"], False


@functools.lru_cache(maxsize=None)
def _no_cache(fn) -> dict:
    """The keyword argument that tells fn (a transformers mask builder or layer forward) to use
    no KV cache: ``cache`` where it takes one (transformers 5.2x on), else ``past_key_values``
    (deprecated there, to be removed in 5.40)."""
    return {"cache": None} if "cache" in inspect.signature(fn).parameters else {"past_key_values": None}


def next_token_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The GPT's loss: mean cross-entropy of [B, T, V] logits against already-shifted labels, in
    at least fp32 (a float64 model keeps float64)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).to(dtype), labels.reshape(-1))


class HFStage(nn.Module):
    """A contiguous slice of a Hugging Face model (see the module docstring)."""

    def __init__(self, model: nn.Module, family: Family, index: int, num_stages: int, paths: list[str],
                 first: bool, last: bool):
        super().__init__()
        self.kind = family.kind
        self.masks = family.masks
        """A rotary decoder's layers' masks, as its model's forward makes them (PIPELINE_DECODERS)."""
        self.hf_config = getattr(model, "config", None)
        self._cut_from = (model,)  # (a tuple: not registered, the stage holds only its own modules)
        # what the model keeps in fp32 (tiertrain.precision.kept_in_fp32 reads it off the stages)
        self._keep_in_fp32_modules = getattr(model, "_keep_in_fp32_modules", None)
        self._keep_in_fp32_modules_strict = getattr(model, "_keep_in_fp32_modules_strict", None)
        self.loss_function = _causal_lm_loss_of(model) if family.kind in ("rotary", "gpt2") else None
        """The model's own causal-LM loss (see _head_loss); None: next_token_loss."""
        self.index, self.num_stages = index, num_stages
        self.is_first, self.is_last = first, last
        self.paths = list(paths)
        """The module paths this stage runs, in order."""
        self.tied = False
        self.tied_names: tuple[str, str] | None = None
        self.cut_tie: tuple[str, str] | None = None
        """The weight the cut untied (first stage's name, the last stage's copy), on every stage."""
        blocks = {b: i for i, b in enumerate(family.blocks)}
        self.layers = [blocks[p] for p in paths if p in blocks]
        """Global indices of the blocks this stage holds (an encoder-decoder's: encoder blocks
        first, then the decoder's)."""
        self.encoder_blocks = family.encoder_blocks
        self._blocks = list(family.blocks)
        self._stack_configs = ((model.encoder.config, model.decoder.config) if self.kind == "t5" else None)
        self._encoder_base = family.embed[0].rsplit(".", 1)[0] if self.kind == "encoder" else None
        self._encoder_config = (getattr(model.get_submodule(self._encoder_base), "config", self.hf_config)
                                if self.kind == "encoder" else None)
        run = [p for p in paths if p in blocks] if self.kind != "sequential" else list(paths)
        if (self.layers or self.kind == "t5") and self.kind != "sequential":
            run = [*family.shared, *run]
        for p in dict.fromkeys([*paths, *run]):
            _attach(self, p, model.get_submodule(p))
        self._run = [(p, model.get_submodule(p)) for p in run]  # a plain list: not registered twice
        self.activation_shape = None if self.kind == "sequential" else self.hidden_shape
        """What :class:`~.engine.PipelineEngine` sends between stages (sequential stages: unknown,
        give ``activation_shape=`` to ``wrap()``)."""
        for name, value in cp_attributes(model).items():  # a context-parallel model's (.hf_context)
            setattr(self, name, value)
        if self.cp_size > 1:
            check_stage(self, model)

    @property
    def whole_model(self) -> nn.Module:
        """The model this stage was cut from (its other stages' tensors on another rank, or on
        the meta device): its names are a checkpoint's (tiertrain.load_pretrained, save_pretrained),
        its config and class the export's config.json."""
        return self._cut_from[0]

    def hidden_shape(self, batch: dict) -> tuple[int, ...]:
        """The hidden states sent between stages for a micro-batch: [batch, seq, hidden]; for
        an encoder-decoder the flat message of :meth:`_t5_sizes`."""
        b, t = batch["input_ids"].shape
        if self.kind == "t5":
            return (sum(math.prod(s) for s in self._t5_sizes(batch)),)
        return (b, t // self.cp_size, self.hf_config.hidden_size)

    # -- encoder-decoder (T5) -------------------------------------------------------------------

    def _t5_sizes(self, batch: dict) -> list[tuple[int, ...]]:
        """The four parts of an encoder-decoder's stage message, flattened and concatenated in
        this order: the encoder's hidden states [B, S, d] (its output once the encoder is
        done), the decoder's [B, T, d] (its embeddings until the decoder starts), and the
        relative position biases block 0 of each stack computes and the later blocks reuse,
        encoder [1, heads, S, S] and decoder [1, heads, T, T] (zero until computed)."""
        b, src = batch["input_ids"].shape
        tgt = self._decoder_ids(batch).shape[1]
        d, h = self.hf_config.d_model, self.hf_config.num_heads
        return [(b, src, d), (b, tgt, d), (1, h, src, src), (1, h, tgt, tgt)]

    def _decoder_ids(self, batch: dict) -> torch.Tensor:
        """``batch["decoder_input_ids"]``, or as Hugging Face builds them from the labels: shifted
        right, ``decoder_start_token_id`` first, -100 replaced by ``pad_token_id``."""
        ids = batch.get("decoder_input_ids")
        if ids is not None:
            return ids
        labels = batch["labels"]
        cfg = self.hf_config
        start, pad = getattr(cfg, "decoder_start_token_id", None), getattr(cfg, "pad_token_id", None)
        if start is None or pad is None:
            raise ValueError("an encoder-decoder batch without decoder_input_ids needs config.decoder_start_token_id "
                             "and config.pad_token_id to build them from the labels; give decoder_input_ids")
        ids = labels.new_zeros(labels.shape)
        ids[..., 1:] = labels[..., :-1]
        ids[..., 0] = start
        return ids.masked_fill(ids == -100, pad)

    def _t5_forward(self, x: torch.Tensor | None, batch: dict) -> torch.Tensor:
        from transformers.masking_utils import create_bidirectional_mask, create_causal_mask
        enc_stack, dec_stack = self.encoder, self.decoder  # (this stage's part of each stack)
        sizes = self._t5_sizes(batch)
        if self.is_first:
            # (tied: both are `shared`; untied, Hugging Face v5 unties them too)
            enc = enc_stack.dropout(enc_stack.embed_tokens(batch["input_ids"]))
            dec = dec_stack.dropout(dec_stack.embed_tokens(self._decoder_ids(batch)))
            enc_bias = dec_bias = None
        else:
            parts = x.split([math.prod(s) for s in sizes])
            enc, dec, enc_bias, dec_bias = (part.view(s) for part, s in zip(parts, sizes))
        le = self.encoder_blocks
        for i in self.layers:
            if i < le:
                block = self.get_submodule(self._blocks[i])
                mask = create_bidirectional_mask(config=self._stack_configs[0], inputs_embeds=enc,
                                                 attention_mask=batch.get("attention_mask"))
                enc, bias, _ = block(enc, mask, None if i == 0 else enc_bias)
                if i == 0:
                    enc_bias = bias
                if i == le - 1:  # the encoder's output
                    enc = enc_stack.dropout(enc_stack.final_layer_norm(enc))
            else:
                j = i - le
                block = self.get_submodule(self._blocks[i])
                cfg = self._stack_configs[1]
                mask = create_causal_mask(config=cfg, inputs_embeds=dec,
                                          attention_mask=batch.get("decoder_attention_mask"),
                                          **_no_cache(create_causal_mask))
                cross = create_bidirectional_mask(config=cfg, inputs_embeds=dec,
                                                  attention_mask=batch.get("attention_mask"), encoder_hidden_states=enc)
                # (the cross-attention's position bias is zero, made by each block itself)
                dec, bias, _ = block(dec, mask, None if j == 0 else dec_bias, enc, cross, None)
                if j == 0:
                    dec_bias = bias
        if self.is_last:
            out = dec_stack.dropout(dec_stack.final_layer_norm(dec))
            cfg = self.hf_config  # (transformers 4 scaled whenever the head was tied)
            if getattr(cfg, "scale_decoder_outputs", getattr(cfg, "tie_word_embeddings", True)):
                out = out * (self.hf_config.d_model ** -0.5)
            return _head_loss(self, self.lm_head(out), batch["labels"])
        zeros = [torch.zeros(s, dtype=enc.dtype, device=enc.device) for s in sizes[2:]]
        enc_bias = zeros[0] if enc_bias is None else enc_bias.to(enc.dtype)
        dec_bias = zeros[1] if dec_bias is None else dec_bias.to(enc.dtype)
        return torch.cat([enc.reshape(-1), dec.reshape(-1), enc_bias.reshape(-1), dec_bias.reshape(-1)])

    def forward(self, x: torch.Tensor | None, batch: dict) -> torch.Tensor:
        # Every stage has the batch: a padding mask is not sent, each stage makes its blocks'
        # masks from it with the model's own mask functions, as the unsplit model does.
        masks = [key for key in ("attention_mask", "decoder_attention_mask") if batch.get(key) is not None]
        if masks and (self.kind == "sequential" or self.cp_size > 1):
            where = ("a chain of modules, each called on the previous one's output, cannot take it"
                     if self.kind == "sequential" else f"parallel.cp={self.cp_size} splits the sequence it masks")
            raise ValueError(f"the batch's {' and '.join(masks)} cannot be given to these pipeline stages: {where}; "
                             f"give batches without padding (input_ids and labels, -100 where not predicted)")
        if "decoder_attention_mask" in masks and self.kind != "t5":
            raise ValueError("decoder_attention_mask is for an encoder-decoder model (T5); this model has no decoder "
                             "stack to mask")
        if self.kind == "t5":
            return self._t5_forward(x, batch)
        if self.kind == "encoder":
            return self._encoder_forward(x, batch)
        ids = batch["input_ids"]
        if self.kind == "sequential":
            for i, (_, module) in enumerate(self._run):
                x = module(ids if (i == 0 and self.is_first) else x)
                if not isinstance(x, torch.Tensor):
                    x = x[0]
            return next_token_loss(x, batch["labels"]) if self.is_last else x
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device).unsqueeze(0)
        if self.kind == "rotary":
            if self.cp_size > 1:
                ids, pos = local_tokens(self, ids)
            if self.is_first:
                x = self.model.embed_tokens(ids)
            x = self._rotary_blocks(x, pos, batch.get("attention_mask"))
            if self.is_last and self.cp_size > 1:
                # transformers' causal-LM loss (labels: the tokens, shifted before the split), as the
                # converted model's forward computes it at pp = 1 (tiertrain/parallel/cp_hf.py)
                targets, shifted = causal_targets(batch)
                return token_mean_share(self, self.model.norm(x), targets,
                                        shift=self.loss_function is not None and not shifted)
            if self.is_last:
                return _head_loss(self, self.lm_head(self.model.norm(x)), *causal_targets(batch))
            return x
        if self.is_first:  # gpt2
            tr = self.transformer
            x = tr.drop(tr.wte(ids) + tr.wpe(pos))
        if self.layers:
            from transformers.masking_utils import create_causal_mask
            mask = create_causal_mask(config=self.hf_config, inputs_embeds=x,
                                      attention_mask=batch.get("attention_mask"), position_ids=pos,
                                      **_no_cache(create_causal_mask))
            for _, block in self._run:
                x = block(x, None, mask, None, encoder_attention_mask=None, use_cache=False, position_ids=pos)
        if self.is_last:
            return _head_loss(self, self.lm_head(self.transformer.ln_f(x)), *causal_targets(batch))
        return x

    def _encoder_forward(self, x: torch.Tensor | None, batch: dict) -> torch.Tensor:
        """BERT/RoBERTa: embeddings (with the batch's token_type_ids, if any), the encoder's
        layers under the bidirectional mask the model makes (with the batch's padding
        attention_mask, if any), the MLM head and the masked-LM loss, labels aligned with the
        inputs."""
        if self.is_first:
            embeddings = self.get_submodule(f"{self._encoder_base}.embeddings")
            x = embeddings(input_ids=batch["input_ids"], token_type_ids=batch.get("token_type_ids"))
        if self.layers:
            from transformers.masking_utils import create_bidirectional_mask
            mask = create_bidirectional_mask(config=self._encoder_config, inputs_embeds=x,
                                             attention_mask=batch.get("attention_mask"))
            for _, layer in self._run:
                x = layer(x, mask)
        if self.is_last:
            head = self.get_submodule(self.paths[-1])
            return _head_loss(self, head(x), batch["labels"])
        return x

    def _rotary_blocks(self, x: torch.Tensor, pos: torch.Tensor, padding: torch.Tensor | None) -> torch.Tensor:
        if not self.layers:
            return x
        from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
        cfg = self.hf_config
        rotary = self._run[0][1]
        position_embeddings = rotary(x, position_ids=pos)
        masks = {}
        for i, (_, layer) in zip(self.layers, self._run[1:]):
            kind = self._attention_type(i)
            if kind not in masks:
                fn = create_sliding_window_causal_mask if kind == "sliding_attention" else create_causal_mask
                masks[kind] = fn(config=cfg, inputs_embeds=x, attention_mask=padding, position_ids=pos, **_no_cache(fn))
            x = layer(x, attention_mask=masks[kind], position_embeddings=position_embeddings, position_ids=pos,
                      use_cache=False, **_no_cache(type(layer).forward))
        return x

    def _attention_type(self, i: int) -> str:
        """What mask layer i gets, as the model's own forward chooses it (its family's masks):
        config.layer_types (Qwen2's forward), a sliding window for every layer when
        config.sliding_window is set (Mistral's), else the causal mask (Llama's, whatever its
        config holds)."""
        if self.masks == "types":
            return self.hf_config.layer_types[i]
        if self.masks == "window" and getattr(self.hf_config, "sliding_window", None):
            return "sliding_attention"
        return "full_attention"

    def extra_repr(self) -> str:
        parts = [f"stage {self.index}/{self.num_stages}", self.kind, f"layers={self.layers}"]
        if self.tied:
            parts.append(f"tied={self.tied_names}")
        return ", ".join(parts)


def _check_covered(model: nn.Module, family: Family, paths: list[list[str]]) -> None:
    """ValueError naming the parameters of a recognised model that no stage holds (a module
    its family's forward does not run, such as an extra prediction head): they would be
    neither trained nor in a checkpoint or export."""
    missing = uncovered(model, [path for stage in paths for path in stage] + family.shared)
    if missing:
        raise ValueError(f"split_hf: {type(model).__name__}'s {', '.join(missing[:8])}"
                         f"{f' and {len(missing) - 8} more' if len(missing) > 8 else ''} are in none of its "
                         f"{family.kind} family's parts (embeddings, blocks, final norm and head), so no pipeline "
                         f"stage would train or save them; train it at parallel.pp=1")


def split_hf(model: nn.Module, num_stages: int, balance: str = "layers",
             split: list[list[str]] | None = None) -> list[HFStage]:
    """Cut ``model`` into ``num_stages`` (= p·v) :class:`HFStage` modules in model order (see the
    module docstring); ``split`` gives the cut explicitly. Keep stages ``r, r+p, …`` on
    pipeline rank ``r`` (:func:`~.stage.stages_for_rank`)."""
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"split_hf: num_stages={num_stages!r} is invalid: must be a positive int")
    try:
        family = recognise(model)
    except ValueError:
        if split is None:
            raise
        family = None
    paths = _balanced(model, family, num_stages, balance) if split is None else _explicit(model, family, split,
                                                                                           num_stages)
    if family is None:
        family = Family("sequential", [], [], [])
    else:
        _check_covered(model, family, paths)
    _check_tensor_parallel(model, family)
    tied = _untie(model, paths[0], paths[-1]) if num_stages > 1 else None
    stages = [HFStage(model, family, s, num_stages, p, s == 0, s == num_stages - 1) for s, p in enumerate(paths)]
    for st in stages:
        st.cut_tie = tied
    if tied is not None:
        for st in (stages[0], stages[-1]):
            st.tied, st.tied_names = True, tied
    return stages
