"""The cost model of one 3D layout (t, p, d) of a Megatron PTD-P run: its bandwidth
assumptions (:class:`Interconnect`), the 3D search's thresholds (:class:`Policy3D`), the
candidate (:class:`Layout3D`), and its predicted memory per rank and time per step, which
:mod:`tiertrain.estimate.layout3d` searches over.

**Memory per rank** (the heaviest pipeline stage, first or last), in the engine's dtypes
(:func:`~tiertrain.estimate.layout.engine_model_state_bytes`: params in the compute dtype,
fp32 gradients, fp32 master weights for 16-bit compute, fp32 Adam moments; master and
moments divided by d at ZeRO stage 1):

* Ψ of a rank = (nl/p)·(block parameters)/t, plus on the first stage the token embedding
  V·h/t (vocab-parallel) and the position table seq·h, plus on the last stage the final
  LayerNorm and the head V·h/t (the tied copy, or the untied head); the replicated
  LayerNorms and row-parallel biases are counted as split by t (≪ 1 %);
* activations: the layers' worth the schedule holds on that rank, ``max_in_flight`` of
  the engine's own schedule (tiertrain.pipeline.schedule) × (nl/(p·v)) layers: nl on the
  first stage under 1F1B (p micro-batches of nl/p layers, §2.2), nl·(1 + (p−1)/(p·v))
  interleaved; one layer is :func:`~tiertrain.estimate.formulas.activation_bytes_per_layer`
  (Korthikanti §4.1 with t); the last stage adds the embedding-side and logits activations
  (:func:`~tiertrain.estimate.formulas.activation_bytes_head`, logits over V/t). With
  recomputation a held layer keeps only its input (D·s·b·h bytes) and one layer's
  activations are live while it is recomputed;
* a fixed allowance per rank: ``Policy3D.device_overhead`` (CUDA context, cuBLAS
  workspace, NCCL buffers; 1 GiB) and two gradient buckets (2·zero.bucket_mb).

**Communication and time** (per step, per rank, no overlap: an upper bound; for the table,
not for the choice), with :class:`Interconnect`'s stated bandwidths:

* compute: Megatron's FLOPs per step 72·B·s·nl·h²·(1 + s/(6h) + V/(16·nl·h)) (96 with
  recomputation, §5.1 eq. 3) over N ranks at the achieved FLOP/s, times (1 + bubble);
* tp: 4 all-reduces of b·s·h elements per layer per micro-batch (f and g, forward and
  backward; 6 with recomputation), ring traffic 2(t−1)/t of the message, on intra-node
  links (rule 1);
* pp: one activation forward and one gradient backward of b·s·h elements per micro-batch
  per chunk (v× with interleaving), on inter-node links when K > 1 (pp is the outermost
  axis), without the scatter/gather optimisation of §4.1;
* dp: once per step a reduce-scatter of the fp32 gradients and an all-gather of the
  updated parameters, (d−1)/d·Ψ_rank·(4 + D) bytes, on inter-node links when the data-
  parallel group spans nodes (t·d > G), else intra-node.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from tiertrain.estimate.dims import ModelDims
from tiertrain.estimate.formulas import activation_bytes_head, activation_bytes_per_layer
from tiertrain.estimate.hardware import Hardware
from tiertrain.estimate.layout import engine_model_state_bytes
from tiertrain.estimate.lines import PRECISION_BYTES

__all__ = ["Interconnect", "Policy3D", "Layout3D", "rank_memory", "step_time", "held_micro_batches"]

GiB = 2**30


@dataclass
class Interconnect:
    """Bandwidth assumptions of the communication model (bytes/s per rank, stated, not measured)."""

    intra_node_bw: float = 150e9
    """Within a node: NVLink/NVSwitch, an A100's 300 GB/s per direction of which about half is
    reached as all-reduce bus bandwidth."""
    inter_node_bw: float = 25e9
    """Across nodes: one 200 Gb/s HDR InfiniBand adapter per GPU (a DGX A100 has eight)."""
    default_flops: float = 150e12
    """Achieved FLOP/s per rank when Hardware.peak_flops is not given (Megatron PTD-P reports
    163 TFLOP/s per A100, 52 % of its bf16 peak, at 1T parameters)."""

    def validate(self) -> "Interconnect":
        for name in ("intra_node_bw", "inter_node_bw", "default_flops"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Interconnect.{name}={value!r} is invalid: must be a number > 0")
        return self


@dataclass
class Policy3D:
    """Thresholds and switches of the 3D search (the rules of :mod:`tiertrain.estimate.layout3d`)."""

    interleave_above: float = 0.10
    """Bubble fraction (p−1)/m above which interleaving (v > 1) is used when possible (rule 5)."""
    max_bubble: float = 0.5
    """Layouts whose smallest achievable bubble exceeds this are rejected (m ≫ p, rule 5)."""
    recompute: bool = True
    """Allow full activation recomputation when nothing fits without it (rule 6)."""
    offload_fallback: bool = True
    """Run the ZeRO-Infinity placement ladder at t = p = 1 when no 3D layout fits (rule 8)."""
    device_overhead: int = GiB
    """Bytes per rank outside the tensors modelled: CUDA context, cuBLAS workspace, NCCL buffers."""
    bucket_mb: float = 25.0
    """zero.bucket_mb of the written config; two buckets of fp32 gradients are counted per rank."""
    max_virtual_stages: int = 8
    """Largest v considered (each chunk adds p2p messages and a schedule slot)."""

    def validate(self) -> "Policy3D":
        for name in ("interleave_above", "max_bubble"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"Policy3D.{name}={value!r} is invalid: must be a fraction > 0")
        if isinstance(self.device_overhead, bool) or not isinstance(self.device_overhead, int) \
                or self.device_overhead < 0:
            raise ValueError(f"Policy3D.device_overhead={self.device_overhead!r} is invalid: must be bytes >= 0")
        if not self.bucket_mb > 0:
            raise ValueError(f"Policy3D.bucket_mb={self.bucket_mb!r} is invalid: must be > 0")
        if isinstance(self.max_virtual_stages, bool) or not isinstance(self.max_virtual_stages, int) \
                or self.max_virtual_stages < 1:
            raise ValueError(f"Policy3D.max_virtual_stages={self.max_virtual_stages!r} is invalid: must be an int >= 1")
        return self


@dataclass
class Layout3D:
    """One (t, p, d) candidate: its schedule, memory, bubble and time, and the verdict."""

    t: int
    """Tensor-parallel size (parallel.tp)."""
    p: int
    """Pipeline-parallel size (parallel.pp)."""
    d: int
    """Data-parallel size (parallel.dp)."""
    m: int | None = None
    """Micro-batches per rank per step (batch.grad_accum_steps); None when B/b does not split over d."""
    v: int = 1
    """Virtual stages per pipeline rank (parallel.virtual_stages)."""
    stage: int = 1
    """ZeRO stage over d (1: Megatron's distributed optimizer; 0 when d = 1)."""
    checkpoint_every: int = 0
    """activations.checkpoint_every: 0 none, 1 every block recomputed."""
    memory: dict[str, int] = field(default_factory=dict)
    """Bytes per rank of the heaviest stage, by item (empty when not evaluated)."""
    budget: int = 0
    """Device bytes per rank available (Hardware.budget)."""
    bubble: float | None = None
    """Pipeline bubble (p−1)/(m·v); 0 at p = 1."""
    time: dict[str, float] = field(default_factory=dict)
    """Predicted seconds per step by component (compute incl. bubble, tp, pp, dp, total)."""
    status: str = "rejected"
    """"chosen", "fits" (fits but ranked after the choice) or "rejected"."""
    kind: str = ""
    """Rejection kind: DIVISIBILITY, TP_ACROSS_NODES, DOES_NOT_FIT, BUBBLE; "" otherwise."""
    reason: str = ""
    """The verdict in words (for rejections: what failed and by how much)."""

    @property
    def peak(self) -> int:
        """Predicted bytes per rank (sum of ``memory``)."""
        return sum(self.memory.values())

    @property
    def schedule(self) -> str:
        """parallel.schedule: 1f1b, or interleaved when v > 1."""
        return "interleaved" if self.v > 1 else "1f1b"

    def label(self) -> str:
        return f"t={self.t} p={self.p} d={self.d}"

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"peak": self.peak, "schedule": self.schedule}


# --------------------------------------------------------------------------- memory


def _stage_parameters(dims: ModelDims, t: int, p: int) -> tuple[int, int]:
    """Parameters of one rank of the first and of the last pipeline stage (equal at p = 1)."""
    h, V = dims.hidden, dims.vocab
    blocks = dims.n_layers // p * dims.block_parameters()
    embed = -(-V * h // t) + dims.seq_len * h  # vocab-parallel token table, replicated positions
    head = 2 * h + -(-V * h // t)  # final LayerNorm + head (the tied copy or the untied head)
    if p == 1:
        whole = -(-blocks // t) + embed + 2 * h + (0 if dims.tie_embeddings else -(-V * h // t))
        return whole, whole
    return -(-blocks // t) + embed, -(-blocks // t) + head


def held_micro_batches(p: int, m: int, v: int, rank: int) -> int:
    """(micro-batch, chunk) activations held at once on pipeline ``rank`` under the engine's
    schedule (tiertrain.pipeline.schedule: 1F1B for v = 1, interleaved 1F1B for v > 1): its
    warm-up forwards plus the first steady-state forward, capped by the m·v forwards of a
    step — ``max_in_flight`` of that schedule, in closed form (the schedule of a large m is
    not built for every candidate)."""
    if p == 1:
        return 1  # gradient accumulation: one micro-batch's activations at a time
    if v == 1:
        return min(p - rank, m)  # warm-up p−r−1, then one forward before each backward
    return min((p - rank - 1) * 2 + (v - 1) * p + 1, m * v)


def rank_memory(dims: ModelDims, t: int, p: int, d: int, m: int, v: int, micro_batch: int, precision: str,
                stage: int, checkpoint_every: int, policy: Policy3D) -> dict[str, int]:
    """Bytes per rank of the heavier of the first and last pipeline stage, by item (see the
    module docstring, "Memory per rank")."""
    dt = PRECISION_BYTES[precision]
    s, b, h, a = dims.seq_len, micro_batch, dims.hidden, dims.n_heads
    layer = activation_bytes_per_layer(s, b, h, a, dt, t, dims.dropout, dims.stores_attention_scores)
    chunk_layers = dims.n_layers // (p * v)
    head_acts = math.ceil(activation_bytes_head(s, b, h, -(-dims.vocab // t), dt, dims.dropout))
    first_params, last_params = _stage_parameters(dims, t, p)
    ranks = [(0, first_params, p == 1)] + ([(p - 1, last_params, True)] if p > 1 else [])
    best: dict[str, int] = {}
    for rank, psi, has_head in ranks:  # the first stage holds the most activations, the last the logits
        ms = engine_model_state_bytes(psi, d, stage, precision)
        held_layers = held_micro_batches(p, m, v, rank) * chunk_layers
        if checkpoint_every:
            acts = dt * s * b * h * held_layers + math.ceil(layer)  # block inputs + one recomputed block
        else:
            acts = math.ceil(held_layers * layer)
        lines = {"parameters": ms.params, "gradients": ms.grads, "master weights": ms.master,
                 "optimizer states": ms.optimizer,
                 "activation checkpoints and working memory" if checkpoint_every else "activations": acts,
                 "activations (embedding, head, logits)": head_acts if has_head else 0,
                 "gradient buckets": int(2 * policy.bucket_mb * 2**20),
                 "device overhead (context, workspaces)": policy.device_overhead}
        if sum(lines.values()) > sum(best.values()):
            best = lines
    return best


# --------------------------------------------------------------------------- time


def step_time(dims: ModelDims, hw: Hardware, net: Interconnect, lay: Layout3D, global_batch: int,
              micro_batch: int, precision: str, psi_rank: int) -> dict[str, float]:
    """Predicted seconds per step by component (module docstring, "Communication and time")."""
    dt = PRECISION_BYTES[precision]
    s, h, nl, V = dims.seq_len, dims.hidden, dims.n_layers, dims.vocab
    k = 96 if lay.checkpoint_every else 72
    flops = k * global_batch * s * nl * h * h * (1 + s / (6 * h) + V / (16 * nl * h))
    peak = hw.peak_flops or net.default_flops
    bubble = lay.bubble or 0.0
    compute = flops / (hw.ranks * peak) * (1 + bubble)
    msg = micro_batch * s * h * dt
    m = lay.m or 1
    allreduces = 6 if lay.checkpoint_every else 4
    tp = allreduces * m * (nl // lay.p) * 2 * (lay.t - 1) / lay.t * msg / net.intra_node_bw
    pp_bw = net.inter_node_bw if hw.nodes > 1 else net.intra_node_bw
    pp = 0.0 if lay.p == 1 else 2 * m * lay.v * msg / pp_bw
    dp_bw = net.inter_node_bw if lay.t * lay.d > hw.ranks_per_node else net.intra_node_bw
    dp = (lay.d - 1) / lay.d * psi_rank * (4 + dt) / dp_bw
    return {"compute": compute, "tp": tp, "pp": pp, "dp": dp, "total": compute + tp + pp + dp}
