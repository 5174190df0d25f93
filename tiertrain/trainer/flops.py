"""Model FLOPs per token and the peak they are measured against: achieved TFLOP/s and MFU.

Training FLOPs per token (Megatron-LM's and PaLM's "model FLOPs", Narayanan et al. 2021 §5.1,
Chowdhery et al. 2022 App. B; activation recomputation is *not* counted, so MFU does not
reward it):

* every weight used in a matmul costs 2 FLOPs per token forward and 4 backward (the input
  gradient and the weight gradient): 6·W for trained weights. A frozen weight still needs
  the input gradient backward (when anything before it trains): 4·W for frozen weights.
  The matmul weights are those of ``nn.Linear``, tiertrain's tensor-parallel linears (a
  slice counted tp times) and Hugging Face's ``Conv1D`` (GPT-2); an
  embedding lookup is no matmul, but a head tied to the embedding is an ``nn.Linear``
  (Hugging Face, tiertrain's GPT) and counted there.
* attention's two seq × seq products, 2·2·s·h FLOPs per token and layer forward, ×3 with
  backward: 12·L·h·s for a model whose config says its layers (L), width (h) and sequence
  length (s); a decoder layer of an encoder-decoder also attends over the encoder (counted
  as a second attention). A module without such a config gets the weight term only.

The peak, per rank, at the compute dtype: ``logging.peak_tflops`` when stated; else a probe
file's (``tiertrain probe``) measured bf16 matmul TFLOP/s with an accelerator, or its CPU
matmul GFLOP/s shared by the ranks of the node; else none (MFU is not reported).
"""
from __future__ import annotations

import os
from typing import Any

import torch.nn as nn

__all__ = ["flops_per_token", "peak_flops_per_rank"]


def _matmul_weights(model: nn.Module, tp: int) -> tuple[int, int]:
    """(trained, frozen) elements of the weights of the model's matmul modules, whole: a
    tensor-parallel slice (``tp_sharded``) counts tp times. A weight shared by two such
    modules is two matmuls and counted twice; one shared with an embedding (a tied head) is
    counted once, for the head."""
    from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear

    trained = frozen = 0
    for module in model.modules():
        if isinstance(module, (nn.Linear, ColumnParallelLinear, RowParallelLinear)) \
                or type(module).__name__ == "Conv1D":
            w = module.weight
            n = w.numel() * (tp if getattr(w, "tp_sharded", False) else 1)
            if w.requires_grad:
                trained += n
            else:
                frozen += n
    return trained, frozen


def _attention_layers(config: Any) -> tuple[int, int] | None:
    """(attention layers, counting a decoder layer of an encoder-decoder twice, width) read
    from a Hugging Face config or tiertrain's GPTConfig; None when the config says neither."""
    if config is None:
        return None
    width = next((getattr(config, k) for k in ("hidden_size", "d_model", "n_embd", "hidden")
                  if isinstance(getattr(config, k, None), int)), None)
    layers = next((getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers", "n_layers",
                                                 "encoder_layers")
                   if isinstance(getattr(config, k, None), int)), None)
    if width is None or layers is None:
        return None
    if getattr(config, "is_encoder_decoder", False):
        decoder = next((getattr(config, k) for k in ("num_decoder_layers", "decoder_layers")
                        if isinstance(getattr(config, k, None), int)), layers)
        layers += 2 * decoder  # self-attention and cross-attention
    return layers, width


def flops_per_token(model: nn.Module, seq_len: int, tp: int = 1) -> float:
    """Training FLOPs per token of a whole (unpartitioned, or meta-device) model at
    sequence length seq_len, whose tensor-parallel slices are one of tp; see the module
    docstring."""
    trained, frozen = _matmul_weights(model, tp)
    attention = _attention_layers(getattr(model, "config", None))
    flops = 6.0 * trained + 4.0 * frozen
    if attention is not None:
        layers, width = attention
        flops += 12.0 * layers * width * seq_len
    return flops


def peak_flops_per_rank(stated_tflops: float, accelerator: bool, ranks_per_node: int,
                        probe_path: str | None = None) -> tuple[float | None, str]:
    """(peak FLOP/s of one rank, where it comes from); (None, why) when unknown."""
    if stated_tflops > 0:
        return stated_tflops * 1e12, "logging.peak_tflops"
    from ..estimate.probe import HardwareProbe

    path = probe_path or os.environ.get("TIERTRAIN_PROBE") or "runs/hardware_probe.json"
    if not os.path.isfile(path):
        return None, f"no logging.peak_tflops and no probe file {path!r} (run `tiertrain probe`)"
    try:
        probe = HardwareProbe.load(path)
    except ValueError as e:
        return None, f"probe file unreadable: {e}"
    if accelerator and probe.bf16_matmul_tflops:
        return probe.bf16_matmul_tflops * 1e12, f"probe file {path} (bf16 matmul)"
    if not accelerator and probe.cpu_matmul_gflops:
        return probe.cpu_matmul_gflops * 1e9 / max(ranks_per_node, 1), \
            f"probe file {path} (CPU matmul / {ranks_per_node} ranks)"
    return None, f"probe file {path} has no matmul peak for this device"
