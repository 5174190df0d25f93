"""The Hugging Face model families :mod:`~tiertrain.pipeline.hf_split` cuts into pipeline stages
automatically: which ``config.model_type`` values are known to run unchanged, where a recognised
model keeps its embeddings, blocks and head (:class:`Family`), and :func:`recognise`, which finds
them or names what it found instead.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch.nn as nn

__all__ = ["ENCODERS", "ENCODER_DECODERS", "PIPELINE_DECODERS", "Family", "recognise"]

PIPELINE_DECODERS: dict[str, str] = {
    **dict.fromkeys(("llama", "apertus", "apertus1p5_text", "arcee", "bitnet", "diffllama", "ernie4_5", "exaone",
                     "gemma", "glm", "glm4", "helium", "hunyuan_v1_dense", "internlm3", "iquestcoder", "jais2",
                     "nemotron", "olmo", "olmo2", "seed_oss", "stablelm"), "causal"),
    **dict.fromkeys(("mistral", "ministral3", "phi3"), "window"),
    **dict.fromkeys(("qwen2", "qwen3", "ministral", "smollm3"), "types"),
}
"""``config.model_type`` values cut as rotary decoders, each with the mask its model's forward
gives its layers, which the stages give them too: "causal" (one causal mask, Llama's forward),
"window" (a sliding-window mask for every layer when config.sliding_window is set, Mistral's),
"types" (config.layer_types[i] for layer i, Qwen2's). A family is listed when its base model's
and causal LM's forwards (transformers 5.24) are one of those three up to names: embed_tokens →
rotary cos/sin and the mask → every layer → norm → lm_head → the model's own loss, nothing else
(no embedding multiplier or dropout outside its modules, no logit scaling or soft-cap, no
auxiliary loss). tests/test_pipeline_families.py checks every one against its model in float64."""

ENCODER_DECODERS = frozenset({"t5"})
"""``config.model_type`` values split as encoder-decoders (T5ForConditionalGeneration)."""

ENCODERS = frozenset({"bert", "roberta"})
"""``config.model_type`` values split as bidirectional encoders with a masked-LM head
(``BertForMaskedLM``, ``RobertaForMaskedLM``): embeddings → encoder.layer → MLM head."""



@dataclass
class Family:
    """Where a recognised model keeps its parts (module paths)."""

    kind: str  # "rotary", "gpt2", "t5", "encoder" or "sequential"
    embed: list[str]  # the embedding group: stage 0
    blocks: list[str]  # one path per block, in order
    head: list[str]  # final norm + head: the last stage
    shared: list[str] = field(default_factory=list)  # parameter-free modules every block stage uses
    after: dict[str, list[str]] = field(default_factory=dict)  # modules riding with a block (T5: the
    # encoder's final norm with its last block)
    encoder_blocks: int = 0  # encoder-decoder: blocks[:encoder_blocks] are the encoder's
    masks: str = "causal"  # rotary decoders: the layers' masks (PIPELINE_DECODERS)


def _units(family: Family) -> list[list[str]]:
    """The indivisible pieces a split distributes, in model order: the embeddings, each block
    (with what rides with it), the final norm + head."""
    return [family.embed] + [[b, *family.after.get(b, [])] for b in family.blocks] + [family.head]


def _children(model: nn.Module) -> str:
    return ", ".join(f"{n}: {type(m).__name__}" for n, m in model.named_children()) or "none"


def _how() -> str:
    return ("give the split explicitly: split=[[module names of stage 0], [of stage 1], ...] in model order "
            "(tiertrain.pipeline.pipeline_stages(model, topology, virtual_stages, split=...), then "
            "tiertrain.wrap(stages, config, topology, activation_shape=...)); see tiertrain.pipeline.hf_split")


def recognise(model: nn.Module) -> Family:
    """The :class:`Family` of ``model``, or a ValueError naming what was found."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    base, head = getattr(model, "model", None), getattr(model, "lm_head", None)
    if (base is not None and head is not None
            and all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb"))
            and isinstance(base.layers, nn.ModuleList)):
        if model_type not in PIPELINE_DECODERS:
            # (not "give split=": its layers take the rotary embeddings and the mask from the
            # model's forward, which an explicit split of an unrecognised model cannot carry)
            raise ValueError(f"{type(model).__name__} (model_type={model_type!r}) has the Llama layout "
                             f"(model.embed_tokens, model.layers, model.norm, model.rotary_emb, lm_head) but is not "
                             f"a family known to run it unchanged ({', '.join(sorted(PIPELINE_DECODERS))}: "
                             f"embeddings → layers → norm → head and nothing else, where others scale the "
                             f"embeddings or soft-cap the logits); it cannot be cut into pipeline stages yet: train "
                             f"it at parallel.pp=1 (ZeRO and tensor parallelism apply)")
        n = len(base.layers)
        return Family("rotary", ["model.embed_tokens"], [f"model.layers.{i}" for i in range(n)],
                      ["model.norm", "lm_head"], ["model.rotary_emb"], masks=PIPELINE_DECODERS[model_type])
    if model_type in ENCODER_DECODERS and head is not None and all(
            hasattr(model, a) for a in ("shared", "encoder", "decoder")):
        enc, dec = model.encoder, model.decoder
        parts = ("embed_tokens", "block", "final_layer_norm", "dropout")
        if all(hasattr(stack, a) for stack in (enc, dec) for a in parts):
            le, ld = len(enc.block), len(dec.block)
            last_enc = f"encoder.block.{le - 1}"
            return Family("t5", ["shared", "encoder.embed_tokens", "decoder.embed_tokens"],
                          [f"encoder.block.{i}" for i in range(le)] + [f"decoder.block.{i}" for i in range(ld)],
                          ["decoder.final_layer_norm", "lm_head"], ["encoder.dropout", "decoder.dropout"],
                          after={last_enc: ["encoder.final_layer_norm"]}, encoder_blocks=le)
    if model_type in ENCODERS:
        prefix = getattr(model, "base_model_prefix", None) or model_type
        enc_base = getattr(model, prefix, None)
        mlm = "cls" if hasattr(model, "cls") else "lm_head"
        layers = getattr(getattr(enc_base, "encoder", None), "layer", None)
        if (type(model).__name__.endswith("ForMaskedLM") and hasattr(enc_base, "embeddings")
                and isinstance(layers, nn.ModuleList) and getattr(model, mlm, None) is not None
                and getattr(enc_base, "pooler", None) is None):
            if getattr(config, "is_decoder", False) or getattr(config, "add_cross_attention", False):
                raise ValueError(f"{type(model).__name__} with is_decoder=True or add_cross_attention=True is not "
                                 f"split automatically (only the bidirectional masked-LM encoder is); {_how()}")
            return Family("encoder", [f"{prefix}.embeddings"],
                          [f"{prefix}.encoder.layer.{i}" for i in range(len(layers))], [mlm])
    tr = getattr(model, "transformer", None)
    if (model_type == "gpt2" and tr is not None and head is not None
            and all(hasattr(tr, a) for a in ("wte", "wpe", "drop", "h", "ln_f"))):
        if getattr(config, "add_cross_attention", False):
            raise ValueError(f"{type(model).__name__} with add_cross_attention=True is not split automatically; "
                             f"{_how()}")
        return Family("gpt2", ["transformer.wte", "transformer.wpe", "transformer.drop"],
                      [f"transformer.h.{i}" for i in range(len(tr.h))], ["transformer.ln_f", "lm_head"])
    raise ValueError(f"cannot split {type(model).__name__} (model_type={model_type!r}) into pipeline stages "
                     f"automatically: recognised are Hugging Face causal LMs of the rotary-decoder families "
                     f"({', '.join(sorted(PIPELINE_DECODERS))}: model.embed_tokens/layers/norm/rotary_emb + "
                     f"lm_head)"
                     f", GPT-2 (transformer.wte/wpe/h/ln_f + lm_head), the masked-LM encoders "
                     f"BertForMaskedLM/RobertaForMaskedLM (bert/roberta.embeddings, encoder.layer, cls/lm_head) "
                     f"and the encoder-decoder "
                     f"T5ForConditionalGeneration (shared, encoder/decoder.block, lm_head); "
                     f"found children: {_children(model)}; "
                     f"{_how()}")
