"""Per-rank peak memory of tiertrain's engine, buffer by buffer (what the engine allocates,
not the papers' round numbers).

The model states come from the engine's own layout functions (``tiertrain.zero.layout``,
through :func:`tiertrain.estimate.units.engine_units`) applied to the model's parameter
shapes (a GPT built on the meta device, or any module): flat units padded to a multiple of
``num_shards·64`` elements, stage-0–2 units cut into ``zero.bucket_mb`` buckets, stage-3
units one per transformer block plus the root. Per unit and rank, exactly as
``tiertrain.zero.flat.FlatParameters`` stores it:

* params: the whole unit in the compute dtype (resident units) or this rank's shard (stage 3);
* grads: fp32, the whole unit at stages 0–1 (``grad_full``), the shard at stages 2–3;
* master: fp32 shard, absent when the shard already is fp32 in the same memory;
* Adam moments: 2 × fp32 per *real* element of the shard (padding has no optimizer state),
  except on NVMe, whose swap files hold master and moments for the whole shard
  (``tiertrain.update.nvme.optimizer.NVMeAdamW.state_bytes``).

Transient memory is simulated over one step in the order the engine runs it, and the peak
is the largest total at any point:

* forward end: every block's saved activations, the head's, and the logits in flight;
* start of backward (the loss): the head's backward buffers;
* the backward of each block, last first: the saved activations of the blocks not yet
  processed, one block's backward buffers (gradient of the MLP input and the largest
  weight gradient), the stage-3 gathered units (the root stays gathered through forward
  and backward, plus the block being processed), and the gradient reduction state: at
  stages 2–3 the fp32 bucket being filled plus up to ``max_in_flight`` (2) reduced buckets
  in flight, momentarily 3 (``tiertrain.zero.reducer``: a bucket lives until its
  collective is waited on; the reduction lands straight in the lazily zeroed gradient
  shard, through a shard-sized output only when the shard is off the bucket's device); at
  stage 1, which reduce-scatters in place into the full gradient, every unit's shard-sized
  receive buffer, kept until the optimizer step waits for the reductions; gloo with more
  than 2 ranks receives full-size copies instead;
* the optimizer step (no activations): the reductions have been waited on, so only the
  squared-gradient temporary of the global norm and, on gloo with more than 2 ranks, the
  replicated send buffers of the post-step all-gather (stages 1–2).

Activation sizes come from :mod:`tiertrain.estimate.activations` (tiertrain's GPT) or, for
any other model described by :class:`tiertrain.estimate.modules.HFModelDims` (a Hugging Face
transformer), from its own :class:`~tiertrain.estimate.activations.ActivationBytes` and its
own module for the layout; its blocks are the top-level stage-3 units (children of
ModuleLists not nested in another: ``model.layers.i``, ``encoder.block.i``, …), taken in
registration order.

Beside this module: the layout (:mod:`tiertrain.estimate.units`), the peak of building the
model (:mod:`tiertrain.estimate.build_peak`) and the process overhead
(:mod:`tiertrain.estimate.overhead`). :func:`engine_estimate_lines`, which
:func:`tiertrain.estimate.memory.estimate` calls, turns the simulated peak into its lines.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..precision import DTYPES, held_as_stored, kept_in_fp32, named_in
from ..zero.plan import default_unit_modules
from ..zero.flat import NVME_READ_AHEAD, swap_pool_bytes
from ..zero.upload import CHUNK, SLOTS, upload_buffer_bytes
from ..parallel.context import tokens_multiple
from .activations import (ActivationBytes, context_parallel_activation_bytes, gpt_activation_bytes,
                          tiled_mlp_activation_bytes)
from .lines import (PRECISION_BYTES, EstimateLine, Tier, accumulator_line, landing_line,
                    masters_are_param_shards, overlap_second_set_lines, second_generation_lines)
from .overhead import HostOverhead
from .units import engine_grad_tier, engine_units, gpt_meta_model

__all__ = ["PeakBreakdown", "simulate_peak", "engine_estimate_lines"]


# --------------------------------------------------------------------------- simulation


@dataclass
class PeakBreakdown:
    """What one rank holds at its predicted peak, by item (bytes), and where the peak is."""

    params: int
    """Parameters (compute dtype): resident units whole, stage-3 units as this rank's shard."""
    grads: int
    """fp32 gradients (whole units at stages 0–1, shards at 2–3)."""
    master: int
    """fp32 master shards (0 where the fp32 shard is its own master)."""
    moments: int
    """Adam m and v (fp32) of the real elements of this rank's shards."""
    param_tier: Tier
    grad_tier: Tier
    optimizer_tier: Tier
    items: dict[str, int] = field(default_factory=dict)
    """Transient and activation bytes live at the peak, by item name."""
    cpu_items: dict[str, int] = field(default_factory=dict)
    """Bytes held in the CPU tier besides model states (offloaded activation checkpoints)."""
    where: str = ""
    """The point of the step where the peak falls."""
    unit_bytes: dict[str, int] = field(default_factory=dict)
    """Sizes used: largest unit (compute dtype), bucket, etc. (for the formulas)."""

    @property
    def model_states(self) -> int:
        return self.params + self.grads + self.master + self.moments

    @property
    def transient(self) -> int:
        return sum(self.items.values()) + sum(self.cpu_items.values())

    @property
    def total(self) -> int:
        return self.model_states + self.transient


def _block_index(name: str, blocks: dict[str, int]) -> int | None:
    """Block number of a parameter name (the longest matching block prefix), else None."""
    best = None
    for prefix, i in blocks.items():
        if name.startswith(prefix + ".") and (best is None or len(prefix) > len(best[0])):
            best = (prefix, i)
    return None if best is None else best[1]


def _top_level_units(model: nn.Module) -> list[str]:
    """The stage-3 unit prefixes not nested in another (the transformer blocks: ``blocks.i``
    of tiertrain's GPT, ``model.layers.i``, ``encoder.block.i`` …; not tiles or the sub-lists
    inside a block), in registration order."""
    prefixes = default_unit_modules(model)
    return [p for p in prefixes if not any(p.startswith(q + ".") for q in prefixes)]


def simulate_peak(model: nn.Module, *, dp: int, stage: int, precision_bytes: int,
                  param_tier: Tier = Tier.DEVICE, optimizer_tier: Tier = Tier.DEVICE,
                  bucket_mb: float = 25.0, prefetch_mb: float = 0.0, persistence_threshold: int = 0,
                  backend: str = "gloo", rank: int | None = None,
                  acts: ActivationBytes | None = None, checkpoint_every: int = 0,
                  checkpoint_tier: Tier = Tier.DEVICE, max_in_flight: int = 2,
                  recompute: str = "block", compute: torch.dtype | None = None) -> PeakBreakdown:
    """Simulate one training step of tiertrain's engine on ``model`` (meta is fine) and
    return what one rank holds at the peak. ``acts``: the model's activation sizes (None:
    activations not modelled, model states and engine buffers only). ``rank``: the rank
    to account (None: rank 0, the largest: ranks differ only in the Adam moments of their
    shard's real elements, and each unit's padding sits at its end). ``recompute``:
    ``activations.recompute`` ("selective": checkpointed blocks also keep their kept
    outputs, on the device whatever ``checkpoint_tier``). ``compute``: the compute dtype, which
    decides what a Hugging Face model keeps in fp32 (default: fp32 at 4 precision bytes, else bf16)."""
    if rank is None:
        rank = 0  # every rank holds the same buffers; the padding (no Adam state) is at the end
    param_tier, optimizer_tier, checkpoint_tier = Tier(param_tier), Tier(optimizer_tier), Tier(checkpoint_tier)
    D = precision_bytes
    if compute is None:
        compute = torch.float32 if D == 4 else torch.bfloat16
    layout = engine_units(model, stage, dp, bucket_mb, persistence_threshold, compute)
    units = layout.units
    shard_rank = rank if layout.num_shards > 1 else 0
    # ---- persistent model states (FlatParameters + AdamW state)
    params = grads = master = moments = 0
    for u in units:
        params += (u.padded_numel if u.resident else u.shard_numel) * D
        grads += 4 * (u.padded_numel if stage <= 1 else u.shard_numel)
        shard_tier = Tier.DEVICE if u.resident else param_tier
        if not (D == 4 and optimizer_tier == shard_tier):  # (on NVMe: OptimizerMasterShards)
            master += 4 * u.shard_numel
        if optimizer_tier is Tier.NVME:  # NVMeAdamW's chunks tile the whole shard, padding included
            moments += 8 * u.shard_numel
        else:
            moments += 8 * sum(b - a for _, a, b in u.shard_pieces(shard_rank))
    # Frozen parameters: stage 3's frozen units as shards, the rest whole on every rank, those
    # the model keeps in fp32 in fp32 (no gradient, master or moments either way).
    params += D * sum(u.shard_numel for u in layout.frozen)
    in_frozen_units = {s_.name for u in layout.frozen for s_ in u.slots}
    kept = kept_in_fp32(model, compute)
    params += sum((max(D, 4) if named_in(kept, n) else p.element_size() if held_as_stored(p, compute) else D)
                  * p.numel() for n, p in model.named_parameters() if not p.requires_grad and n not in in_frozen_units)
    out = PeakBreakdown(params=params, grads=grads, master=master, moments=moments,
                        param_tier=param_tier if stage == 3 else Tier.DEVICE,
                        grad_tier=engine_grad_tier(stage, optimizer_tier),
                        optimizer_tier=optimizer_tier)
    full_bytes = {u.index: u.padded_numel * D for u in units}
    # gloo with > 2 ranks stages a full-size copy for reduce-scatter (fp32) and all-gather
    staging = backend == "gloo" and dp > 2
    # stages 2-3: a reduction lands straight in the gradient shard (lazily zeroed after the
    # step) when the shard is on the bucket's device; with an accelerator and the optimizer
    # off it, the shard is host memory and the reduction goes through a device output first
    direct = backend == "gloo" or optimizer_tier is Tier.DEVICE

    def reduction_temporary(u) -> int:
        """fp32 bytes unit u's reduce-scatter allocates until it is waited on, besides its
        bucket (tiertrain.zero.reducer._launch, tiertrain.comm.Collectives.reduce_scatter):
        gloo with > 2 ranks receives every rank's copy of this rank's chunk (full size);
        otherwise stage 1 (in place into the full gradient) receives the peer's copy in a
        shard-sized buffer, and stages 2-3 need a shard-sized output only when not direct."""
        if staging:
            return 4 * u.padded_numel + (0 if stage == 1 or direct else 4 * u.shard_numel)
        return 0 if stage >= 2 and direct else 4 * u.shard_numel

    out.unit_bytes = {"largest_unit": max(u.padded_numel for u in units),
                      "largest_shard": max(u.shard_numel for u in units)}

    # ---- the step (no activations): every reduction was waited on (and its temporaries
    # freed) before the gradient norm, so only the step's own buffers are live
    step_items = {"global-norm temporary": 4 * max(u.shard_numel for u in units)}  # g.pow(2) of a grad shard
    if stage in (1, 2) and staging:
        step_items["all-gather staging"] = sum(D * u.padded_numel for u in units if u.num_shards > 1)
    best_items, best_where = dict(step_items), "optimizer step"

    cpu_items: dict[str, int] = {}
    if acts is not None:
        # ---- blocks: which parameters belong to which block (unit prefixes of ModuleLists)
        prefixes = _top_level_units(model)  # blocks.i (model.layers.i, ...), not tiles or sub-lists
        top = set(prefixes)
        blocks = {p: i for i, p in enumerate(prefixes)}
        n_blocks = len(prefixes)
        ckpt = set(range(0, n_blocks, checkpoint_every)) if checkpoint_every > 0 else set()
        selective = recompute == "selective"
        ckpt_bytes = acts.checkpoint * len(ckpt)
        if checkpoint_tier is Tier.CPU and ckpt:  # the host pool keeps every checkpoint's buffer
            cpu_items["activation checkpoints (CPU pool)"] = ckpt_bytes

        def act_items(alive_blocks: int) -> dict[str, int]:
            live = range(alive_blocks)
            d = {"activations (blocks)": sum(acts.block_at(i) for i in live if i not in ckpt)}
            if ckpt and checkpoint_tier is not Tier.CPU:
                d["activation checkpoints"] = acts.checkpoint * sum(1 for i in live if i in ckpt)
            if ckpt and selective:
                d["kept outputs (selective recompute)"] = sum(acts.kept_at(i) for i in live if i in ckpt)
            return d

        # stage 3: units (by index) of the root and of each block; gathered state
        root_units = [u.index for u in units if not u.resident and u.label == "<root>"]
        unit_of_block: dict[int, list[int]] = {}
        for u in units:
            if stage == 3 and not u.resident and u.label != "<root>":
                i = _block_index(u.label + ".x", blocks)
                if i is not None:
                    unit_of_block.setdefault(i, []).append(u.index)
        root_full = sum(full_bytes[i] for i in root_units) if stage == 3 else 0
        prefetch = int(prefetch_mb * 2**20)

        def gathered_block(i: int) -> int:
            """Largest stage-3 working set inside block i: the block's own unit plus its
            largest nested unit (tiles are gathered one at a time), plus prefetch budget."""
            if stage != 3:
                return 0
            us = unit_of_block.get(i, [])
            own = [full_bytes[x] for x in us if units[x].label in top]
            nested = [full_bytes[x] for x in us if units[x].label not in top]
            return sum(own) + (max(nested) if nested else 0) + min(prefetch, max(full_bytes.values()))

        points: list[tuple[str, dict[str, int]]] = []
        # forward end and start of backward
        fwd = act_items(n_blocks)
        fwd["activations (embedding, head, logits)"] = acts.head + acts.logits_in_flight
        if stage == 3:
            fwd["gathered parameters (stage 3)"] = root_full
        points.append(("end of forward", fwd))
        head = act_items(n_blocks)
        head["activations (embedding, head, logits)"] = acts.head
        head["backward buffers"] = acts.head_backward + acts.tied_head_grad
        if stage == 3:
            head["gathered parameters (stage 3)"] = root_full

        # ---- backward, parameter by parameter in reverse registration order
        named = [n for n, p in model.named_parameters() if p.requires_grad]
        slot_unit = {}
        for u in units:
            for s_ in u.slots:
                slot_unit[s_.name] = u.index
        remaining = {u.index: len(u.slots) for u in units}
        launch_order = ([u.index for u in units if not u.resident][1:][::-1]
                        + [u.index for u in units if not u.resident][:1]
                        + [u.index for u in units if u.resident]) if stage == 3 \
            else [u.index for u in units]
        next_launch = 0
        filling: dict[int, int] = {}      # unit -> bucket bytes (stages 2-3)
        in_flight: list[int] = []         # bytes of each launched, not yet waited reduction
        kept_outputs = 0                  # stage 1: reduce-scatter temporaries until the step
        first_root_grad = True

        def engine_items(block: int | None) -> dict[str, int]:
            d = {}
            if stage >= 2:
                d["gradient buckets and reductions in flight"] = sum(filling.values()) + sum(in_flight)
            elif stage == 1:
                d["gradient buckets and reductions in flight"] = kept_outputs
            if stage == 3:
                d["gathered parameters (stage 3)"] = root_full + (gathered_block(block) if block is not None else 0)
            return d

        def block_point(b: int, gathered: bool = True) -> dict[str, int]:
            """Inside block b's backward (b = -1: after the last block, the embeddings')."""
            d = act_items(b + 1)
            d["backward buffers"] = (acts.block_backward if b >= 0 else 0) + acts.tied_head_grad
            if b in ckpt:  # recomputation: the block's activations again (+ its fetched input)
                d["activation working memory (recompute)"] = acts.recompute_working(b, selective) + (
                    acts.checkpoint if checkpoint_tier is Tier.CPU else 0)
            d.update(engine_items(b if gathered and b >= 0 else None))
            return d

        current_block = None
        for name in reversed(named):
            b = _block_index(name, blocks)
            index = slot_unit[name]
            u = units[index]
            if stage >= 2 and index not in filling:  # a bucket opens at its first gradient
                filling[index] = 4 * u.padded_numel
            if b is None and current_block is not None:
                current_block = -1  # past the blocks: the embeddings' backward
            elif b is not None and b != current_block:
                current_block = b
                points.append((f"backward of block {b}", block_point(b)))
            if first_root_grad and b is None:
                first_root_grad = False
                if stage >= 2:  # the root's bucket opens during the head's backward
                    head["gradient buckets and reductions in flight"] = 4 * u.padded_numel
            remaining[index] -= 1
            # launch every unit that is complete, in the fixed launch order
            while next_launch < len(launch_order) and remaining[launch_order[next_launch]] == 0:
                li = launch_order[next_launch]
                lu = units[li]
                next_launch += 1
                if stage == 0:
                    continue
                cost = reduction_temporary(lu)
                if stage == 1:
                    kept_outputs += cost
                else:
                    in_flight.append(filling.pop(li, 0) + cost)
                if current_block is None:
                    d = dict(head)
                    d.update(engine_items(None))
                else:  # a whole block's unit is released (on_unit_grads_done) before its launch
                    d = block_point(current_block, gathered=current_block >= 0 and lu.label not in top)
                points.append((f"reduction of unit {lu.label}", d))
                while stage >= 2 and len(in_flight) > max_in_flight:
                    in_flight.pop(0)
        points.insert(1, ("start of backward", head))
        for where, d in points:
            if sum(d.values()) > sum(best_items.values()):
                best_items, best_where = d, where
    else:
        # no activations: the engine's own buffers at their largest (a bucket plus in-flight
        # reductions, or the stage-1 temporaries), stage-3 gathered: the two largest units
        d = {}
        if stage >= 2:
            biggest = sorted((4 * u.padded_numel + reduction_temporary(u) for u in units), reverse=True)
            d["gradient buckets and reductions in flight"] = sum(biggest[:max_in_flight + 1]) + (
                4 * max(u.padded_numel for u in units))
        if stage == 1:
            d["gradient buckets and reductions in flight"] = sum(reduction_temporary(u) for u in units)
        if stage == 3:
            d["gathered parameters (stage 3)"] = sum(sorted(full_bytes.values(), reverse=True)[:2])
        if sum(d.values()) > sum(best_items.values()):
            best_items, best_where = d, "backward (activations not modelled)"
    out.items = {k: v for k, v in best_items.items() if v}
    out.cpu_items = cpu_items
    out.where = best_where
    return out


# --------------------------------------------------------------------------- estimate lines

_ITEM_LINES = {
    # item name -> (line name, formula)
    "activations (blocks)": ("activations (blocks)",
                             "(8+2f)·s·b·h·D + LN stats 4·b·s·D + fp32 lse 4·b·a·s per block not yet "
                             "through backward (tiertrain GPT, fused SDPA; saved_tensors_hooks count)"),
    "activation checkpoints": ("activation checkpoints",
                               "s·b·h·D per checkpointed block (its input; blocks 0, ci, 2ci, …)"),
    "kept outputs (selective recompute)": ("activations kept by selective recompute",
                                           "per checkpointed block not yet through backward: its matmul and "
                                           "fused-attention outputs, on the device (activations.recompute="
                                           "selective; tiertrain.offload.activations.SELECTIVE_SAVED_OPS)"),
    "activations (embedding, head, logits)": ("activations (embedding, head, logits)",
                                              "2·s·b·h·D + 4·s·b·V (fp32 log-softmax) + ids/labels; at forward "
                                              "end + logits s·b·V·D (+ fp32 copy)"),
    "activation working memory (recompute)": ("activation working memory",
                                              "one checkpointed block recomputed in backward: (8+2f)·s·b·h·D "
                                              "(ZeRO-Infinity §3 AWM, engine blocks)"),
    "backward buffers": ("backward buffers",
                         "(f+1)·s·b·h·D activation gradients + f·h²·D weight gradient (+ tied head "
                         "gradient V·h·D held until the embedding's)"),
    "gradient buckets and reductions in flight": ("gradient buckets and reductions in flight",
                                                  "stages 2–3: filling fp32 bucket + ≤3 reduced buckets in "
                                                  "flight (landing straight in the gradient shard; a shard "
                                                  "output only when the shard is off the bucket's device); "
                                                  "stage 1: every unit's shard-sized receive buffer (in-place "
                                                  "reduce-scatter) until the step waits; gloo > 2 ranks: "
                                                  "full-size receives (tiertrain.zero.reducer, comm)"),
    "gathered parameters (stage 3)": ("model-state working memory",
                                      "gathered stage-3 units, compute dtype: the root (embeddings, final LN) "
                                      "through forward and backward + the block in use (+ one nested tile unit, "
                                      "+ prefetch)"),
    "global-norm temporary": ("step buffers", "optimizer step: squared-gradient temporary of the largest unit"),
    "all-gather staging": ("step buffers", "gloo with > 2 ranks: replicated send buffers of the "
                                           "post-step all-gather"),
}


_HF_LINES = {
    "activations (blocks)": "per block not yet through backward: sublayers (input, norm, body, dropout noise) "
                            "+ attention Q/K/V/out (+ lse, or s×s softmax/noise/dropped on the math path) + MLP "
                            "(tiertrain.estimate.modules, from the transformers modeling code)",
    "activations (embedding, head, logits)": "embeddings (+ LayerNorm, noise), final norm / MLM transform, encoder "
                                             "output, 4·s·b·V fp32 log-softmax + ids/labels; at forward end + "
                                             "logits s·b·V·D (+ fp32 copy)",
    "backward buffers": "(f+h)·s·b·D activation gradients (+ 2·a·s²·b·D on the math path) "
                        "+ max(f, q_dim)·h·D weight gradient (+ tied head gradient V·h·D)",
}


def engine_estimate_lines(module: nn.Module | None, dims: Any, lay: Any, overhead: HostOverhead | None = None):
    """(lines, notes, peak_at) of :func:`tiertrain.estimate.memory.estimate` for engine
    accounting: tiertrain's buffers at the simulated peak of one step."""
    notes: list[str] = []
    D = PRECISION_BYTES[lay.precision]
    if module is None:
        module = dims.meta_model() if hasattr(dims, "meta_model") else gpt_meta_model(dims, lay.tile_factor)
    elif lay.tile_factor > 1 and getattr(module, "_tiertrain_tile_factor", 1) != lay.tile_factor:
        notes.append("tile_factor ignored for a given module: tile it with tiertrain.tiling before estimating")
    if dims is None:
        acts = None
    elif lay.cp > 1:
        multiple = tokens_multiple(lay.cp, lay.cp_algorithm)
        if dims.seq_len % multiple:
            raise ValueError(f"seq_len={dims.seq_len} cannot be split over cp={lay.cp} ({lay.cp_algorithm} needs a "
                             f"multiple of {multiple})")
        acts = context_parallel_activation_bytes(dims, lay.micro_batch, D, lay.cp, lay.cp_algorithm,
                                                 lay.loss_tile_tokens, lay.mlp_tile_tokens)
        notes.append(f"context parallelism: each rank holds the activations of {dims.seq_len // lay.cp} of the "
                     f"{dims.seq_len} tokens of every sequence, and {lay.cp_algorithm} attention's own "
                     f"(tiertrain.estimate.activations.context_parallel_activation_bytes)")
    elif hasattr(dims, "activation_bytes"):  # tiertrain.estimate.modules.HFModelDims
        acts = dims.activation_bytes(lay.micro_batch, D)
        notes.append(f"activations: {dims.model_type} ({dims.kind}, {dims.attention} attention) modelled per block "
                     "from the transformers modeling code (tiertrain.estimate.modules)")
    else:
        acts = gpt_activation_bytes(dims, lay.micro_batch, D)
    if acts is not None and lay.cp == 1:
        acts = tiled_mlp_activation_bytes(acts, dims, lay.micro_batch, D, lay.mlp_tile_tokens)
    if acts is not None and lay.mlp_tile_tokens and lay.mlp_tile_tokens < dims.seq_len // lay.cp:
        notes.append(f"the MLP in tiles of {lay.mlp_tile_tokens} tokens: no block keeps its intermediates, a "
                     f"block's backward one tile's (tiertrain.estimate.activations.tiled_mlp_activation_bytes)")
    if acts is None:
        notes.append("activations not modelled (no GPT dims): model states and engine buffers only")
    elif dims.dropout and not hasattr(dims, "activation_bytes"):
        notes.append("dropout: its 1-byte masks are counted; the attention-dropout path of SDPA is not")
    if lay.checkpoint_interval and dims is not None and lay.checkpoint_interval > dims.n_layers:
        raise ValueError(f"ZeroLayout.checkpoint_interval={lay.checkpoint_interval} is invalid: the model has "
                         f"{dims.n_layers} blocks; expected 0 (off) or 1..{dims.n_layers}")
    param_tier = Tier(lay.param_tier) if lay.stage == 3 else Tier.DEVICE
    optimizer_tier = Tier(lay.optimizer_tier)
    pk = simulate_peak(module, dp=lay.zero_ranks, stage=lay.stage, precision_bytes=D, param_tier=param_tier,
                       optimizer_tier=optimizer_tier, bucket_mb=lay.bucket_mb, prefetch_mb=lay.prefetch_mb,
                       persistence_threshold=lay.persistence_threshold, backend=lay.backend, acts=acts,
                       checkpoint_every=lay.checkpoint_interval, checkpoint_tier=lay.checkpoint_tier,
                       recompute=lay.recompute, compute=DTYPES[lay.precision])
    layout = engine_units(module, lay.stage, lay.zero_ranks, lay.bucket_mb, lay.persistence_threshold,
                          DTYPES[lay.precision])
    n_units = len(layout.units)
    kind = ("one unit per block + root" if lay.stage == 3 else
            f"{n_units} bucket(s) of ≤{lay.bucket_mb:g} MiB fp32")
    pad = f"{n_units} flat units ({kind}) padded to {layout.num_shards}·64 elements"
    part = "this rank's shard" if layout.num_shards > 1 else "whole"
    grad_tier = engine_grad_tier(lay.stage, optimizer_tier)
    grads, grads_formula = pk.grads, f"4·Σ units ({'shards, ZeRO §5.2 P_g' if lay.stage >= 2 else 'whole fp32 buffers'})"
    if optimizer_tier is Tier.NVME and lay.nvme_in_place and lay.nvme_grads_in_ram_mb and lay.stage >= 2:
        # the in-place step frees each shard it consumed; reductions wait beyond the cap
        largest = 4 * max((u.shard_numel for u in layout.units), default=0)
        cap = int(lay.nvme_grads_in_ram_mb * 2**20) + largest
        if cap < grads:
            grads, grads_formula = cap, (f"zero.nvme_grads_in_ram_mb ({lay.nvme_grads_in_ram_mb:g} MiB) + the largest "
                                         f"unit's shard: the in-place NVMe step frees the shards it consumed")
    lines = [
        EstimateLine("parameters", pk.params, param_tier,
                     f"{D}·Σ units ({'shards, ZeRO §5.3 P_p' if lay.stage == 3 else 'whole, replicated'}); {pad}"),
        EstimateLine("gradients", grads, grad_tier, grads_formula),
        EstimateLine("master weights", pk.master, optimizer_tier,
                     f"4·Σ shards ({part}; none where the fp32 shard is its own master)"),
        EstimateLine("optimizer states", pk.moments, optimizer_tier,
                     f"8·(elements of {part}) (Adam m+v fp32, ZeRO §5.1 P_os; in NVMe swap files, padding "
                     f"included)" if optimizer_tier is Tier.NVME else
                     f"8·(real elements of {part}) (Adam m+v fp32, ZeRO §5.1 P_os; padding excluded)"),
    ]
    if optimizer_tier is Tier.NVME:
        notes.append("optimizer on NVMe: master weights and Adam moments live in swap files; RAM holds "
                     "the gradient shards and the streaming buffers of tiertrain.update.nvme.NVMeAdamW")
    shared_masters = (sum(D * u.shard_numel for u in layout.units if not u.resident)
                      if masters_are_param_shards(lay) else 0)  # (on NVMe as parameters, in both generations)
    lines += second_generation_lines(lay, pk.master + pk.moments + shared_masters)
    lines += overlap_second_set_lines(lay, pk.master, pk.moments, sum(u.shard_numel for u in layout.units))
    if lay.accumulate_on_device:
        lines.append(accumulator_line(4 * sum(u.padded_numel for u in layout.units), f"; {pad}"))
        notes.append("zero.accumulate_on_device: every unit's fp32 bucket is kept over the micro-batches (the "
                     "accumulators line); the buckets and reductions in flight at the peak are counted as without "
                     "it, which counts the bucket being filled twice")
    if lay.landing_buffers:
        lines.append(landing_line(4 * sum(u.shard_numel for u in layout.units), f"; {pad}"))
    # transient lines at the peak (device tier); standard activation lines always listed
    merged: dict[str, list] = {}
    order: list[str] = []

    def add(name: str, nbytes: int, tier: Tier, formula: str) -> None:
        if name not in merged:
            merged[name] = [0, tier, formula]
            order.append(name)
        merged[name][0] += nbytes

    if acts is not None:
        add("activations (blocks)", 0, Tier.DEVICE, _ITEM_LINES["activations (blocks)"][1])
        if lay.checkpoint_interval:
            add("activation checkpoints", 0, lay.checkpoint_tier, _ITEM_LINES["activation checkpoints"][1])
        add("activations (embedding, head, logits)", 0, Tier.DEVICE,
            _ITEM_LINES["activations (embedding, head, logits)"][1])
        if lay.checkpoint_interval and lay.recompute == "selective":
            name, formula = _ITEM_LINES["kept outputs (selective recompute)"]
            add(name, 0, Tier.DEVICE, formula)
        if lay.checkpoint_interval:
            add("activation working memory", 0, Tier.DEVICE, _ITEM_LINES["activation working memory (recompute)"][1]
                if lay.recompute == "block" else "one checkpointed block recomputed selectively in backward: what "
                "the block saves less the kept outputs it reads from the cache")
    if lay.stage == 3:
        add("model-state working memory", 0, Tier.DEVICE, _ITEM_LINES["gathered parameters (stage 3)"][1])
    transient_device = 0
    for item, nbytes in pk.items.items():
        name, formula = _ITEM_LINES.get(item, (item, item))
        add(name, nbytes, Tier.DEVICE, formula)
        transient_device += nbytes
    for item, nbytes in pk.cpu_items.items():
        add("activation checkpoints", nbytes, Tier.CPU,
            "s·b·h·D per checkpointed block, in the host pool (offload='cpu'; kept for reuse)")
    # NVMe staging buffers in RAM
    if param_tier is Tier.NVME:
        largest = max(u.shard_numel for u in layout.units) * D
        pool = swap_pool_bytes(largest)
        add("NVMe staging buffers", pool, Tier.CPU,
            "parameter swap pool max(64 MiB, 2·3·largest shard) (tiertrain.zero.flat.swap_pool_bytes)")
        kept = max(1, lay.nvme_kept_units) + 1 + NVME_READ_AHEAD + 1
        formula = (f"zero.nvme_kept_units kept (at least 1 reused) + the one lent to the all-gather + "
                   f"{NVME_READ_AHEAD + 1} being read ahead (tiertrain.zero.flat.NVME_READ_AHEAD + the next)")
        if masters_are_param_shards(lay):
            kept += lay.nvme_kept_units
            formula += " + as many handed to the step running in backward (its masters)"
        add("NVMe staging buffers", kept * largest, Tier.CPU,
            f"gather staging: {formula}, of the largest shard (tiertrain/offload/shard_store.py "
            "NVMeShards, OptimizerMasterShards)")
    if optimizer_tier is Tier.NVME:
        from tiertrain.update.nvme.plan import DEFAULT_CHUNK_BYTES
        add("NVMe staging buffers", 4 * DEFAULT_CHUNK_BYTES, Tier.CPU,
            "NVMeAdamW ring: 4 buffers × chunk_bytes (master + m + v of one chunk)")
        if param_tier is Tier.NVME and D != 4:  # (fp32: the step's writes are the shards' own)
            add("NVMe parameter write staging", max(u.shard_numel for u in layout.units) * D, Tier.CPU,
                "one unit's updated shard assembled for its swap write (zero.flat.ShardWriter); "
                "live during backward when the step overlaps it (zero.overlap_nvme_step)")
    if optimizer_tier is Tier.CPU and (param_tier is Tier.DEVICE or any(u.resident for u in layout.units)):
        add("upload buffers", upload_buffer_bytes(max(u.shard_numel for u in layout.units), D), Tier.CPU,
            f"{SLOTS} pinned chunks of min({CHUNK}, largest shard) elements, through which the CPU tier's step "
            "sends the updated shards to the device (tiertrain/zero/upload.py)")
    ov = overhead if overhead is not None else HostOverhead()
    if ov.framework_bytes:
        add("framework overhead", int(ov.framework_bytes), Tier.CPU,
            f"per process: gloo/BLAS workspaces, autograd, allocator metadata ({ov.source})")
    if ov.retention:
        add("allocator retention", int(ov.retention * transient_device), Tier.DEVICE,
            f"{ov.retention:g} × transient bytes at the peak: glibc heap fragmentation ({ov.source})")
    if hasattr(dims, "activation_bytes"):
        for name, formula in _HF_LINES.items():
            if name in merged:
                merged[name][2] = formula
    for name in order:
        nbytes, tier, formula = merged[name]
        lines.append(EstimateLine(name, int(nbytes), tier, formula))
    notes.append(f"engine accounting: tiertrain's own buffers (zero/layout.py, flat.py, reducer.py, stage3.py) "
                 f"at the simulated per-rank peak ({pk.where}); transient lines are what is live there")
    return lines, notes, pk.where
