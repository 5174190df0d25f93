"""Model parallelism: Megatron tensor and sequence parallelism, and context parallelism
(pipeline parallelism is in :mod:`tiertrain.pipeline`).

* :mod:`tiertrain.parallel.tensor` — the f/g communication operators, column/row-parallel
  linears, vocab-parallel embedding and cross-entropy, gradient sync and norm helpers.
* :mod:`tiertrain.parallel.tp_plan` — plan-driven conversion of a model
  (:func:`parallelize_module`) and :func:`apply_tensor_parallel` for the reference GPT.
* :mod:`tiertrain.parallel.context` — attention over a sequence split across ranks: Ulysses
  (all-to-all) and ring attention (zig-zag split for causal masks).
"""
from .context import ContextParallelError, ring_attention, ulysses_attention, zigzag_positions, zigzag_split, zigzag_unsplit
from .tensor import (
    ColumnParallelLinear,
    CopyToTensorParallel,
    GatherFromSequenceParallel,
    GatherFromTensorParallel,
    ReduceFromTensorParallel,
    ReduceScatterToSequenceParallel,
    RowParallelLinear,
    ScatterToSequenceParallel,
    ScatterToTensorParallel,
    VocabParallelCrossEntropy,
    VocabParallelEmbedding,
    gather_tensor_parallel,
    tensor_parallel_grad_norm,
    tensor_parallel_grad_sync,
    vocab_parallel_cross_entropy,
)
from .tp_plan import GPT_PLAN, TensorParallelGPT, apply_tensor_parallel, parallelize_module

__all__ = [
    "ColumnParallelLinear",
    "CopyToTensorParallel",
    "GatherFromSequenceParallel",
    "GatherFromTensorParallel",
    "ReduceFromTensorParallel",
    "ReduceScatterToSequenceParallel",
    "RowParallelLinear",
    "ScatterToSequenceParallel",
    "ScatterToTensorParallel",
    "VocabParallelCrossEntropy",
    "VocabParallelEmbedding",
    "gather_tensor_parallel",
    "tensor_parallel_grad_norm",
    "tensor_parallel_grad_sync",
    "vocab_parallel_cross_entropy",
    "GPT_PLAN",
    "TensorParallelGPT",
    "apply_tensor_parallel",
    "parallelize_module",
    "ContextParallelError",
    "ring_attention",
    "ulysses_attention",
    "zigzag_positions",
    "zigzag_split",
    "zigzag_unsplit",
]
