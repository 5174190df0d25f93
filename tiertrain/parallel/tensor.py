"""Megatron-style tensor and sequence parallelism: communication operators and layers.

Megatron-LM (Shoeybi et al., 2019) §3 splits a transformer's matrix multiplies across the
``t`` ranks of a tensor-parallel group with two conjugate operators:

* **f** (:class:`CopyToTensorParallel`): identity forward, all-reduce backward. It stands in
  front of a column-parallel linear, whose every rank consumes the full input.
* **g** (:class:`ReduceFromTensorParallel`): all-reduce forward, identity backward. It stands
  after a row-parallel linear, whose ranks each produce a partial sum of the output.

Sequence parallelism (Korthikanti et al., 2022) replaces each all-reduce by a reduce-scatter
along the sequence plus an all-gather, so the LayerNorm and dropout regions between the
tensor-parallel blocks hold only ``1/t`` of the sequence:

* **g** becomes :class:`ReduceScatterToSequenceParallel` (reduce-scatter forward, all-gather
  backward) and
* **f** becomes :class:`GatherFromSequenceParallel` (all-gather forward, reduce-scatter
  backward).

:class:`ScatterToSequenceParallel` (split forward, all-gather backward) enters the sequence
parallel region from a replicated tensor, and :class:`GatherFromTensorParallel` /
:class:`ScatterToTensorParallel` move along the hidden (last) dimension.

Every function takes its process group explicitly (``group=None`` means *no* tensor
parallelism, the single-process case where :meth:`tiertrain.Topology.group` returns None:
every operator is then the identity) and waits on every work handle it starts.
Activations are batch-first, ``[batch, seq, hidden]``, so the sequence dimension defaults to
1 (Megatron's own layout is ``[seq, batch, hidden]``: pass ``seq_dim=0`` for that).

Layers: :class:`ColumnParallelLinear`, :class:`RowParallelLinear`,
:class:`VocabParallelEmbedding` and :func:`vocab_parallel_cross_entropy`, which computes the
mean cross-entropy from vocab-sharded logits without ever gathering them.

``tensor_parallel_grad_sync``, ``tensor_parallel_grad_norm`` and ``gather_tensor_parallel``
accept the tp group or a :class:`tiertrain.Topology` (whose ``"tp"`` group they use).

Parameter bookkeeping (read by :func:`tensor_parallel_grad_sync`,
:func:`tensor_parallel_grad_norm` and, later, the engine):

* ``param.tp_sharded = True`` and ``param.tp_shard_dim = d``: a slice along ``d`` of the full
  parameter; ranks hold disjoint slices in rank order.
* no ``tp_sharded`` attribute: replicated, every tp rank holds the same full tensor.
* ``param.tp_partial_grad = True`` (replicated parameters only): under sequence parallelism
  each rank sees only its part of the sequence, so its gradient is a partial sum that must be
  all-reduced over tp (:func:`tensor_parallel_grad_sync`) before the optimizer step.

Initialisation: a tensor-parallel run must start from exactly the weights of a tp=1 run with
the same seed. ``from_linear`` / ``from_embedding`` slice an existing full module (the
recipe :func:`tiertrain.parallel.tp_plan.apply_tensor_parallel` uses). The plain constructors
follow Megatron's CPU initialisation (``_initialize_affine_weight_cpu``): every rank draws the
*full* master weight from the global RNG and keeps its slice, so ranks seeded alike agree with
a tp=1 model that draws the same tensor. Both briefly hold one full weight per layer; a
memory-frugal construction (drawing only the local slice from a forked RNG stream, or
constructing on the meta device and loading shards) is left for later. With an explicit
``init_method`` (called on the full weight) biases start at zero, as in Megatron; without one
the layers draw exactly what ``nn.Linear`` / ``nn.Embedding`` would.

Memory note: under sequence parallelism autograd keeps the all-gathered input of each
column-parallel linear for its weight gradient; Megatron instead keeps the local chunk and
all-gathers again in backward. That optimisation (and overlapping the all-gather with the
input-gradient matmul) is not done here.
"""
from __future__ import annotations

import math
from typing import Callable, Iterable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "CopyToTensorParallel",
    "ReduceFromTensorParallel",
    "GatherFromTensorParallel",
    "ScatterToTensorParallel",
    "GatherFromSequenceParallel",
    "ScatterToSequenceParallel",
    "ReduceScatterToSequenceParallel",
    "ColumnParallelLinear",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "VocabParallelCrossEntropy",
    "vocab_parallel_cross_entropy",
    "resolve_group",
    "tp_world_size",
    "tp_rank",
    "shard_tensor",
    "gather_tensor",
    "mark_sharded",
    "tensor_parallel_grad_sync",
    "tensor_parallel_grad_norm",
    "gather_tensor_parallel",
]

# all_gather_into_tensor / reduce_scatter_tensor are deprecated aliases in torch 2.13.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


# --------------------------------------------------------------------------- group helpers


def resolve_group(group_or_topology):
    """The tp process group from a group, ``None``, or a :class:`tiertrain.Topology`."""
    if hasattr(group_or_topology, "group") and callable(getattr(group_or_topology, "group")):
        return group_or_topology.group("tp")
    return group_or_topology


def tp_world_size(group: dist.ProcessGroup | None) -> int:
    """Ranks in the tensor-parallel group (1 for ``None``)."""
    return 1 if group is None else dist.get_world_size(group)


def tp_rank(group: dist.ProcessGroup | None) -> int:
    """This rank's index in the tensor-parallel group (0 for ``None``)."""
    return 0 if group is None else dist.get_rank(group)


def _divide(n: int, parts: int, what: str) -> int:
    if n % parts != 0:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {parts}")
    return n // parts


def _all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce of a contiguous tensor; waits for completion."""
    dist.all_reduce(t, op=op, group=group, async_op=True).wait()
    return t


def _all_gather(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` in rank order."""
    world = tp_world_size(group)
    if world == 1:
        return x
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((world * front.shape[0],) + tuple(front.shape[1:]), dtype=x.dtype, device=x.device)
    _all_gather_single(out, front, group=group, async_op=True).wait()
    return out.movedim(0, dim).contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Sum ``x`` over the ranks and keep this rank's chunk along ``dim``."""
    world = tp_world_size(group)
    if world == 1:
        return x
    _divide(x.shape[dim], world, f"reduce-scatter dimension {dim} of size")
    front = x.movedim(dim, 0).contiguous()
    out = torch.empty((front.shape[0] // world,) + tuple(front.shape[1:]), dtype=x.dtype, device=x.device)
    _reduce_scatter_single(out, front, op=dist.ReduceOp.SUM, group=group, async_op=True).wait()
    return out.movedim(0, dim).contiguous()


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's chunk of ``x`` along ``dim`` (no communication)."""
    world = tp_world_size(group)
    if world == 1:
        return x
    size = _divide(x.shape[dim], world, f"split dimension {dim} of size")
    return x.narrow(dim, tp_rank(group) * size, size).contiguous()


# --------------------------------------------------------------------------- autograd operators


class CopyToTensorParallel(torch.autograd.Function):
    """Megatron's **f** (``copy_to_tensor_model_parallel_region``): identity forward,
    all-reduce of the gradient backward. Placed before a column-parallel linear."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if tp_world_size(ctx.group) == 1:
            return grad, None
        return _all_reduce(grad.contiguous().clone(), ctx.group), None


class ReduceFromTensorParallel(torch.autograd.Function):
    """Megatron's **g** (``reduce_from_tensor_model_parallel_region``): all-reduce forward,
    identity backward. Placed after a row-parallel linear (and a vocab-parallel embedding)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        if tp_world_size(group) == 1:
            return x.view_as(x)
        return _all_reduce(x.contiguous().clone(), group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


class GatherFromTensorParallel(torch.autograd.Function):
    """Megatron's ``gather_from_tensor_model_parallel_region``: all-gather along the last
    dimension forward, keep this rank's slice backward (``gather_output=True``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _all_gather(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _split(grad, grad.dim() - 1, ctx.group), None


class ScatterToTensorParallel(torch.autograd.Function):
    """Megatron's ``scatter_to_tensor_model_parallel_region``: keep this rank's slice of the
    last dimension forward, all-gather backward (``input_is_parallel=False``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        return _split(x, x.dim() - 1, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, grad.dim() - 1, ctx.group), None


class GatherFromSequenceParallel(torch.autograd.Function):
    """Megatron's ``gather_from_sequence_parallel_region`` (the sequence-parallel **f**):
    all-gather along the sequence forward; backward reduce-scatter when the output feeds a
    tensor-parallel region (``tensor_parallel_output_grad=True``: each rank's gradient is then
    a partial sum), else just keep this rank's chunk."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, seq_dim: int = 1,
                tensor_parallel_output_grad: bool = True) -> torch.Tensor:
        ctx.group, ctx.seq_dim, ctx.reduce = group, seq_dim, tensor_parallel_output_grad
        return _all_gather(x, seq_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.reduce:
            return _reduce_scatter(grad, ctx.seq_dim, ctx.group), None, None, None
        return _split(grad, ctx.seq_dim, ctx.group), None, None, None


class ScatterToSequenceParallel(torch.autograd.Function):
    """Megatron's ``scatter_to_sequence_parallel_region``: keep this rank's chunk of the
    sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, seq_dim: int = 1) -> torch.Tensor:
        ctx.group, ctx.seq_dim = group, seq_dim
        return _split(x, seq_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.seq_dim, ctx.group), None, None


class ReduceScatterToSequenceParallel(torch.autograd.Function):
    """Megatron's ``reduce_scatter_to_sequence_parallel_region`` (the sequence-parallel
    **g**): reduce-scatter along the sequence forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, seq_dim: int = 1) -> torch.Tensor:
        ctx.group, ctx.seq_dim = group, seq_dim
        return _reduce_scatter(x, seq_dim, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _all_gather(grad, ctx.seq_dim, ctx.group), None, None


# --------------------------------------------------------------------------- sharding helpers


def shard_tensor(full: torch.Tensor, dim: int, group) -> torch.Tensor:
    """A detached copy of this rank's contiguous slice of ``full`` along ``dim``."""
    world = tp_world_size(group)
    size = _divide(full.shape[dim], world, f"dimension {dim} of size")
    return full.detach().narrow(dim, tp_rank(group) * size, size).clone()


def gather_tensor(shard: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The full tensor from every rank's slice along ``dim`` (no autograd)."""
    return _all_gather(shard.detach(), dim, group)


def mark_sharded(param: torch.Tensor, dim: int) -> torch.Tensor:
    """Record that ``param`` is this rank's slice along ``dim`` of a tensor-parallel weight."""
    param.tp_sharded = True
    param.tp_shard_dim = dim
    return param


def _init_full_then_shard(shape: tuple[int, ...], dim: int, group, init: Callable[[torch.Tensor], None],
                          device=None, dtype=None) -> nn.Parameter:
    """Megatron's CPU init: draw the full weight from the global RNG, keep this rank's slice."""
    full = torch.empty(shape, device=device, dtype=dtype)
    init(full)
    return mark_sharded(nn.Parameter(shard_tensor(full, dim, group)), dim)


def _default_linear_init(weight: torch.Tensor) -> None:
    nn.init.kaiming_uniform_(weight, a=math.sqrt(5))  # nn.Linear's default


def _default_bias_init(fan_in: int) -> Callable[[torch.Tensor], None]:
    bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0.0
    return lambda b: nn.init.uniform_(b, -bound, bound)


# --------------------------------------------------------------------------- layers


class ColumnParallelLinear(nn.Module):
    """Y = X Aᵀ + b with A split along its output dimension: rank r holds rows
    ``[r·out/t, (r+1)·out/t)`` of the weight and the matching slice of the bias.

    Input: the full X (``sequence_parallel=False``: preceded by **f**), or this rank's
    sequence chunk, which is all-gathered first (``sequence_parallel=True``). Output: this
    rank's slice of the output features, or the full output when ``gather_output``.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, *,
                 gather_output: bool = False, sequence_parallel: bool = False, seq_dim: int = 1,
                 init_method: Callable[[torch.Tensor], None] | None = None, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.sequence_parallel, self.seq_dim = gather_output, sequence_parallel, seq_dim
        world = tp_world_size(group)
        self.out_per_rank = _divide(out_features, world, "ColumnParallelLinear out_features")
        self.weight = _init_full_then_shard((out_features, in_features), 0, group,
                                            init_method or _default_linear_init, device, dtype)
        if bias:
            init_bias = _default_bias_init(in_features) if init_method is None else nn.init.zeros_
            self.bias = _init_full_then_shard((out_features,), 0, group, init_bias, device, dtype)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs) -> "ColumnParallelLinear":
        """This rank's slice of an existing full ``nn.Linear`` (same weights as the tp=1 model)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.group = group
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.gather_output = kwargs.pop("gather_output", False)
        module.sequence_parallel = kwargs.pop("sequence_parallel", False)
        module.seq_dim = kwargs.pop("seq_dim", 1)
        if kwargs:
            raise TypeError(f"ColumnParallelLinear.from_linear got unexpected arguments {sorted(kwargs)}")
        module.out_per_rank = _divide(linear.out_features, tp_world_size(group), "ColumnParallelLinear out_features")
        module.weight = mark_sharded(nn.Parameter(shard_tensor(linear.weight, 0, group),
                                                  requires_grad=linear.weight.requires_grad), 0)
        if linear.bias is not None:
            module.bias = mark_sharded(nn.Parameter(shard_tensor(linear.bias, 0, group),
                                                    requires_grad=linear.bias.requires_grad), 0)
        else:
            module.register_parameter("bias", None)
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            x = GatherFromSequenceParallel.apply(x, self.group, self.seq_dim, True)
        else:
            x = CopyToTensorParallel.apply(x, self.group)
        y = F.linear(x, self.weight, self.bias)
        if self.gather_output:
            y = GatherFromTensorParallel.apply(y, self.group)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} "
                f"({self.out_per_rank} per rank), bias={self.bias is not None}, "
                f"gather_output={self.gather_output}, sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """Y = X Aᵀ + b with A split along its input dimension: rank r holds columns
    ``[r·in/t, (r+1)·in/t)`` of the weight; the bias is replicated and added once, after
    the partial products are summed.

    Input: this rank's slice of the input features (``input_is_parallel=True``, the output
    of a column-parallel linear), or the full input, which is split first. Output: the full
    Y (all-reduce, **g**), or with ``sequence_parallel`` this rank's sequence chunk
    (reduce-scatter); the bias gradient is then partial (``bias.tp_partial_grad``).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, group=None, *,
                 input_is_parallel: bool = True, sequence_parallel: bool = False, seq_dim: int = 1,
                 init_method: Callable[[torch.Tensor], None] | None = None, device=None, dtype=None):
        super().__init__()
        self.group = group
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.sequence_parallel, self.seq_dim = input_is_parallel, sequence_parallel, seq_dim
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        self.in_per_rank = _divide(in_features, tp_world_size(group), "RowParallelLinear in_features")
        self.weight = _init_full_then_shard((out_features, in_features), 1, group,
                                            init_method or _default_linear_init, device, dtype)
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
            (_default_bias_init(in_features) if init_method is None else nn.init.zeros_)(self.bias.data)
            self._mark_bias()
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group, **kwargs) -> "RowParallelLinear":
        """This rank's slice of an existing full ``nn.Linear`` (same weights as the tp=1 model)."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.group = group
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.input_is_parallel = kwargs.pop("input_is_parallel", True)
        module.sequence_parallel = kwargs.pop("sequence_parallel", False)
        module.seq_dim = kwargs.pop("seq_dim", 1)
        if kwargs:
            raise TypeError(f"RowParallelLinear.from_linear got unexpected arguments {sorted(kwargs)}")
        if module.sequence_parallel and not module.input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel requires input_is_parallel=True")
        module.in_per_rank = _divide(linear.in_features, tp_world_size(group), "RowParallelLinear in_features")
        module.weight = mark_sharded(nn.Parameter(shard_tensor(linear.weight, 1, group),
                                                  requires_grad=linear.weight.requires_grad), 1)
        if linear.bias is not None:
            module.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=linear.bias.requires_grad)
            module._mark_bias()
        else:
            module.register_parameter("bias", None)
        return module

    def _mark_bias(self) -> None:
        if self.sequence_parallel:
            self.bias.tp_partial_grad = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = ScatterToTensorParallel.apply(x, self.group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = ReduceScatterToSequenceParallel.apply(y, self.group, self.seq_dim)
        else:
            y = ReduceFromTensorParallel.apply(y, self.group)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} ({self.in_per_rank} per rank), "
                f"out_features={self.out_features}, bias={self.bias is not None}, "
                f"input_is_parallel={self.input_is_parallel}, sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: rank r holds ids
    ``[r·V/t, (r+1)·V/t)``. Ids outside the slice look up zeros; the partial lookups are
    summed by an all-reduce (**g**), or with ``sequence_parallel`` by a reduce-scatter along
    the sequence, so the output is then this rank's sequence chunk."""

    def __init__(self, num_embeddings: int, embedding_dim: int, group=None, *,
                 sequence_parallel: bool = False, seq_dim: int = 1,
                 init_method: Callable[[torch.Tensor], None] | None = None, device=None, dtype=None):
        super().__init__()
        self._setup(num_embeddings, embedding_dim, group, sequence_parallel, seq_dim)
        self.weight = _init_full_then_shard((num_embeddings, embedding_dim), 0, group,
                                            init_method or nn.init.normal_, device, dtype)

    def _setup(self, num_embeddings, embedding_dim, group, sequence_parallel, seq_dim) -> None:
        self.group = group
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.sequence_parallel, self.seq_dim = sequence_parallel, seq_dim
        per_rank = _divide(num_embeddings, tp_world_size(group), "VocabParallelEmbedding num_embeddings")
        self.vocab_start = tp_rank(group) * per_rank
        self.vocab_end = self.vocab_start + per_rank

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group, *, sequence_parallel: bool = False,
                       seq_dim: int = 1) -> "VocabParallelEmbedding":
        """This rank's vocabulary slice of an existing full ``nn.Embedding``."""
        if embedding.padding_idx is not None or embedding.max_norm is not None or embedding.sparse:
            raise ValueError("VocabParallelEmbedding.from_embedding supports plain embeddings only "
                             "(no padding_idx, max_norm or sparse)")
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module._setup(embedding.num_embeddings, embedding.embedding_dim, group, sequence_parallel, seq_dim)
        module.weight = mark_sharded(nn.Parameter(shard_tensor(embedding.weight, 0, group),
                                                  requires_grad=embedding.weight.requires_grad), 0)
        return module

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if tp_world_size(self.group) > 1:
            outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = torch.where(outside, torch.zeros_like(ids), ids - self.vocab_start)
            out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        else:
            out = F.embedding(ids, self.weight)
        if self.sequence_parallel:
            return ReduceScatterToSequenceParallel.apply(out, self.group, self.seq_dim)
        return ReduceFromTensorParallel.apply(out, self.group)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, vocab slice "
                f"[{self.vocab_start}, {self.vocab_end}), sequence_parallel={self.sequence_parallel}")


# --------------------------------------------------------------------------- cross-entropy


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Megatron's ``_VocabParallelCrossEntropy``: the mean cross-entropy over tokens from
    logits split along the vocabulary, never materialising the full logits.

    Forward (fp32): the global max of each row (all-reduce MAX), the sum of exp(logit − max)
    (all-reduce SUM) and the target's shifted logit, contributed by the one rank whose slice
    holds it (all-reduce SUM); loss = log Σexp − target. Backward: softmax − one-hot on the
    local slice, scaled by the incoming gradient over the number of counted tokens. Tokens
    labelled ``ignore_index`` count neither in the loss nor in the mean (as F.cross_entropy).
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group, ignore_index: int = -100):
        vocab_local = logits.shape[-1]
        start = tp_rank(group) * vocab_local
        x = logits.float()
        row_max = x.max(dim=-1).values
        if tp_world_size(group) > 1:
            _all_reduce(row_max, group, dist.ReduceOp.MAX)
        shifted = x - row_max.unsqueeze(-1)

        ignored = labels == ignore_index
        outside = (labels < start) | (labels >= start + vocab_local) | ignored
        local = torch.where(outside, torch.zeros_like(labels), labels - start)
        target = shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)

        exp = shifted.exp()
        sum_exp = exp.sum(dim=-1)
        if tp_world_size(group) > 1:
            both = torch.stack([target, sum_exp])  # one all-reduce for both sums
            _all_reduce(both, group)
            target, sum_exp = both[0], both[1]

        losses = (sum_exp.log() - target).masked_fill(ignored, 0.0)
        count = (~ignored).sum()
        loss = losses.sum() / count

        exp.div_(sum_exp.unsqueeze(-1))  # softmax on the local slice, kept for backward
        ctx.save_for_backward(exp, local, outside, ignored, count)
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss: torch.Tensor):
        softmax, local, outside, ignored, count = ctx.saved_tensors
        grad = softmax  # reused in place: backward runs once (no retain_graph double backward)
        flat = grad.view(-1, grad.shape[-1])
        rows = torch.arange(flat.shape[0], device=flat.device)
        flat[rows, local.reshape(-1)] -= (~outside).reshape(-1).to(flat.dtype)
        grad.masked_fill_(ignored.unsqueeze(-1), 0.0)
        grad.mul_(grad_loss / count)
        return grad.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group,
                                 ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``labels`` ([N...], global vocabulary ids) under the
    vocab-sharded ``logits`` ([N..., V/t], this rank's slice); equal to
    ``F.cross_entropy(full_logits.float().reshape(-1, V), labels.reshape(-1))`` and the same
    value on every tp rank. Positions labelled ``ignore_index`` are left out of the mean."""
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits {tuple(logits.shape)} do not match "
                         f"labels {tuple(labels.shape)} (expected labels of shape logits.shape[:-1])")
    return VocabParallelCrossEntropy.apply(logits, labels, group, ignore_index)


# --------------------------------------------------------------------------- gradients and norms


def tensor_parallel_grad_sync(params: Iterable[torch.Tensor] | nn.Module, group) -> None:
    """All-reduce (sum) over the tp group the gradients of replicated parameters whose
    gradient is partial (``param.tp_partial_grad``: LayerNorms, row-parallel biases and
    position embeddings under sequence parallelism). Call after backward (after the last
    micro-batch is enough, since the sum is linear), before clipping and the optimizer step.
    One coalesced all-reduce; a no-op when nothing is partial or tp is 1."""
    group = resolve_group(group)
    if isinstance(params, nn.Module):
        params = params.parameters()
    grads = [p.grad for p in params if getattr(p, "tp_partial_grad", False) and p.grad is not None]
    if not grads or tp_world_size(group) == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for same in by_dtype.values():
        flat = torch.cat([g.reshape(-1) for g in same])
        _all_reduce(flat, group)
        offset = 0
        for g in same:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()


def tensor_parallel_grad_norm(params: Iterable[torch.Tensor] | nn.Module, group,
                              norm_type: float = 2.0) -> torch.Tensor:
    """The L2 norm of the *full* model's gradient, from tensor-parallel shards: sharded
    parameters contribute their local squares (summed over tp by an all-reduce), replicated
    ones are counted once (on tp rank 0), like Megatron's
    ``param_is_not_tensor_parallel_duplicate``. Call after :func:`tensor_parallel_grad_sync`.
    Other axes (dp under ZeRO, pp) add their own all-reduce of the squared norm."""
    if norm_type != 2.0:
        raise ValueError("tensor_parallel_grad_norm supports the L2 norm only")
    group = resolve_group(group)
    params = list(params.parameters() if isinstance(params, nn.Module) else params)
    first = tp_rank(group) == 0
    local = [p.grad.detach().float().pow(2).sum() for p in params
             if p.grad is not None and (getattr(p, "tp_sharded", False) or first)]
    device = params[0].device if params else torch.device("cpu")
    squares = torch.stack(local).sum().reshape(1) if local else torch.zeros(1, device=device)
    if tp_world_size(group) > 1:
        _all_reduce(squares, group)
    return squares.sqrt()[0]


@torch.no_grad()
def gather_tensor_parallel(model: nn.Module, group, *, grads: bool = False) -> dict[str, torch.Tensor]:
    """The full (tp=1) tensors of ``model.named_parameters()`` — or of their gradients with
    ``grads=True`` (parameters without a gradient are left out): sharded ones all-gathered
    along their ``tp_shard_dim``, replicated ones copied. Collective: every tp rank must call
    it. Names are those of the tp=1 model, since the plans keep module names. For
    checkpoints, tests and inspection."""
    group = resolve_group(group)
    out = {}
    for name, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            continue
        out[name] = gather_tensor(t, p.tp_shard_dim, group) if getattr(p, "tp_sharded", False) else t.detach().clone()
    return out
