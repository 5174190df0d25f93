"""Per-rank peak memory of tiertrain's engine, buffer by buffer (what the engine allocates,
not the papers' round numbers).

The model states come from the engine's own layout functions (``tiertrain.zero.layout``)
applied to the model's parameter shapes (a GPT built on the meta device, or any module):
flat units padded to a multiple of ``num_shards·64`` elements, stage-0–2 units cut into
``zero.bucket_mb`` buckets, stage-3 units one per transformer block plus the root. Per unit
and rank, exactly as ``tiertrain.zero.flat.FlatParameters`` stores it:

* params: the whole unit in the compute dtype (resident units) or this rank's shard (stage 3);
* grads: fp32, the whole unit at stages 0–1 (``grad_full``), the shard at stages 2–3;
* master: fp32 shard, absent when the shard already is fp32 in the same memory;
* Adam moments: 2 × fp32 per *real* element of the shard (padding has no optimizer state),
  except on NVMe, whose swap files hold master and moments for the whole shard
  (``tiertrain.offload.nvme_optimizer.NVMeAdamW.state_bytes``).

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

Activation sizes are those of ``tiertrain.models.gpt.GPT`` (pre-LN blocks, fused SDPA that
keeps its output and log-sum-exp instead of the s×s scores, GELU, tied head), counted with
``torch.autograd.graph.saved_tensors_hooks`` on this code: per block (8 + 2·ffn_mult)·s·b·h
elements of the compute dtype (x, ln1 out, qkv (3), attention out, x + attn, ln2 out, fc1
out (f), GELU out (f)), LayerNorm mean/rstd (4·b·s) and the fp32 log-sum-exp (b·a·s).
Activation checkpointing (``tiertrain.offload.activations``) keeps only the input of every
k-th block (blocks 0, k, 2k, …) and recomputes that block in backward.

Any other model described by :class:`tiertrain.estimate.modules.HFModelDims` (a Hugging Face
transformer) brings its own :class:`ActivationBytes` (per block, from the transformers
modeling code) and its own module for the layout; its blocks are the top-level stage-3
units (children of ModuleLists not nested in another: ``model.layers.i``,
``encoder.block.i``, …), taken in registration order.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..zero.plan import default_unit_modules, parameter_aliases
from ..zero.flat import NVME_READ_AHEAD, swap_pool_bytes
from .lines import PRECISION_BYTES, EstimateLine, Tier, masters_are_param_shards, second_generation_lines

__all__ = ["ActivationBytes", "PeakBreakdown", "HostOverhead", "gpt_activation_bytes", "gpt_meta_model",
           "engine_units", "simulate_peak", "stage3_gathered_bytes", "tile_plan", "engine_estimate_lines",
           "DEFAULT_OVERHEAD_BYTES", "DEFAULT_RETENTION", "BuildPeak", "simulate_build_peak",
           "builds_partitioned", "MMAP_THRESHOLD_MAX", "engine_build_peak", "engine_grad_tier"]

DEFAULT_OVERHEAD_BYTES = 18 * 2**20
"""Process memory a training rank holds besides tensors (allocator metadata, gloo and
oneDNN/BLAS buffers, the autograd engine, Python objects), when nothing better is known. It
does not grow with the model, so it is calibrated on the smallest run that trains (a 1-block,
32-wide GPT on 2 gloo ranks: peak-RSS increase less its tensors); the default is that
calibration on the reference CPU machine, recorded in bench/results/estimate_accuracy.md
("Process overhead", "Calibration runs"). ``tiertrain probe`` measures it on the machine at
hand (``framework_overhead_bytes``, tiertrain.estimate.measure.calibrate_overhead)."""

DEFAULT_RETENTION = 0.5
"""Share of a rank's transient bytes (activations, buckets, gathered units) that glibc's
heap keeps resident on top of them, when nothing better is known. Freed holes in the heap stay
resident (with ``zero.retain_host_memory`` on, the default: mmap threshold 32 MiB, trim
threshold 256 MiB from wrap() on), and where they fall varies from run to run, so a single round
figure near the calibration is used: a 6 × 512 GPT at stage 2, micro-batch 4, on the reference
CPU machine; bench/results/estimate_accuracy.md records that calibration, its spread over runs
and the share each of its runs implies ("What the retention is, measured").
``tiertrain probe`` measures it (``allocator_retention``)."""


# --------------------------------------------------------------------------- activations


@dataclass(frozen=True)
class ActivationBytes:
    """Bytes of one micro-batch's activations in tiertrain's GPT (per rank)."""

    block: int
    """Saved for backward by one block that is not checkpointed."""
    checkpoint: int
    """Saved by one checkpointed block: its input only."""
    head: int
    """Saved outside the blocks: final-LN input, head input, LN stats, fp32 log-softmax
    output, position ids, plus the micro-batch's input ids and labels (int64)."""
    logits_in_flight: int
    """Forward end: the logits (compute dtype) and, with 16-bit compute, their fp32 copy."""
    head_backward: int
    """Start of backward: gradient of the log-softmax output and of its input (fp32), and the
    16-bit cast of it when the compute dtype is not fp32."""
    block_backward: int
    """Inside one block's backward: gradient of the MLP inner activation (f·s·b·h), the
    residual-stream gradient (s·b·h) and the largest weight gradient (f·h², compute dtype)."""
    tied_head_grad: int
    """The head's weight gradient (V·h, compute dtype) held from the head's backward until
    the embedding's gradient arrives, when the weights are tied (0 otherwise)."""
    blocks: tuple[int, ...] = ()
    """Per block, in registration order, when blocks differ (an encoder-decoder's decoder
    blocks also keep cross-attention); empty: every block keeps ``block``."""
    kept: tuple[int, ...] = ()
    """Per block (one entry: every block), the outputs a selectively checkpointed block keeps
    besides its input (``activations.recompute = "selective"``): its matrix multiplications
    and fused attention (tiertrain.offload.activations.SELECTIVE_SAVED_OPS)."""
    kept_unused: int = 0
    """Of a block's ``kept`` bytes, those its backward never reads (the outputs of the
    projections back to the residual stream, and of Q/K before rotary): the recomputed block
    shares the rest with the cache, so these are what recomputation holds on top of ``block``'s
    other tensors."""

    def block_at(self, i: int) -> int:
        """Bytes saved by block ``i`` (not checkpointed)."""
        return self.blocks[i] if i < len(self.blocks) else self.block

    def kept_at(self, i: int) -> int:
        """Bytes block ``i`` keeps besides its input when checkpointed selectively."""
        return self.kept[min(i, len(self.kept) - 1)] if self.kept else 0

    def recompute_working(self, i: int, selective: bool) -> int:
        """Bytes the recomputation of block ``i`` adds while its backward runs: every tensor
        the block saves, less the kept outputs it takes from the cache (already held)."""
        if not selective:
            return self.block_at(i)
        return self.block_at(i) - (self.kept_at(i) - self.kept_unused)


def gpt_activation_bytes(dims: Any, micro_batch: int, precision_bytes: int) -> ActivationBytes:
    """:class:`ActivationBytes` of ``tiertrain.models.gpt.GPT`` with ``dims``
    (:class:`~tiertrain.estimate.memory.ModelDims`) at ``micro_batch`` sequences."""
    D = precision_bytes
    s, b, h, a, V, f = dims.seq_len, micro_batch, dims.hidden, dims.n_heads, dims.vocab, dims.ffn_mult
    sbh = s * b * h
    drop = 1 if dims.dropout else 0
    # x, ln1 out, qkv (3), attention out, x + attn, ln2 out, fc1 out (f), gelu out (f);
    # LN mean/rstd (2 per LN, compute dtype), SDPA log-sum-exp (fp32); dropout masks (bool)
    block = (8 + 2 * f) * sbh * D + 4 * b * s * D + 4 * b * a * s + 2 * drop * sbh
    head = 2 * sbh * D + 2 * b * s * D + 4 * s * b * V + 8 * s + 2 * 8 * b * s + drop * sbh
    logits = s * b * V * D + (4 * s * b * V if D != 4 else 0)
    head_bwd = 2 * 4 * s * b * V + (s * b * V * D if D != 4 else 0)
    block_bwd = (f + 1) * sbh * D + f * h * h * D
    tied = V * h * D if dims.tie_embeddings else 0
    # selective: qkv (3), proj, fc1 (f), fc2 outputs, and the fused SDPA's output and lse
    # (with attention dropout SDPA takes the math path: nothing of it is kept)
    kept = (5 + f) * sbh * D + (0 if drop else sbh * D + 4 * b * a * s)
    return ActivationBytes(block=block, checkpoint=sbh * D, head=head, logits_in_flight=logits,
                           head_backward=head_bwd, block_backward=block_bwd, tied_head_grad=tied,
                           kept=(kept,), kept_unused=2 * sbh * D)


# --------------------------------------------------------------------------- the layout


def gpt_meta_model(dims: Any, tile_factor: int = 1) -> nn.Module:
    """tiertrain's GPT with ``dims`` on the meta device (nothing allocated); with
    ``tile_factor`` > 1 each block's qkv, fc1 and fc2 become TiledLinear (tiertrain.tiling)."""
    from tiertrain.models.gpt import GPT, GPTConfig

    config = GPTConfig(vocab_size=dims.vocab, seq_len=dims.seq_len, n_layers=dims.n_layers,
                       hidden=dims.hidden, n_heads=dims.n_heads, ffn_mult=dims.ffn_mult,
                       tie_embeddings=dims.tie_embeddings, dropout=0.1 if dims.dropout else 0.0,
                       bias=getattr(dims, "bias", True))
    with torch.device("meta"):
        model = GPT(config)
        if tile_factor > 1:
            from tiertrain.tiling import apply_tiling

            apply_tiling(model, tile_plan(tile_factor))
    model._tiertrain_tile_factor = tile_factor
    return model


def tile_plan(tile_factor: int) -> dict[str, int]:
    """The linears tiertrain tiles for a tile factor: each block's qkv, fc1 and fc2 (the
    (h→3h), (h→4h), (4h→h) operators, ZeRO-Infinity §5.1.3)."""
    return {"blocks.*.attn.qkv": tile_factor, "blocks.*.mlp.fc1": tile_factor,
            "blocks.*.mlp.fc2": tile_factor}


_LAYOUTS: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()


def engine_units(model: nn.Module, stage: int, dp: int, bucket_mb: float = 25.0,
                 persistence_threshold: int = 0):
    """The engine's FlatLayout for ``model`` (any device, meta included): exactly what
    ``tiertrain.zero.plan.default_plan`` lays out for the engine (cached per module; the module
    must not change)."""
    from tiertrain.zero.layout import bucket_layout, module_layout

    key = (stage, dp if stage else 1, float(bucket_mb) if stage < 3 else 0.0,
           persistence_threshold if stage == 3 else 0)
    cache = _LAYOUTS.setdefault(model, {})
    if key not in cache:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if stage == 3:
            frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
            cache[key] = module_layout(named, default_unit_modules(model), dp, persistence_threshold,
                                       frozen_params=frozen, aliases=parameter_aliases(model))
        else:
            bucket_numel = max(1, int(bucket_mb * 2**20) // 4)
            cache[key] = bucket_layout(named, 1 if stage == 0 else dp, bucket_numel)
    return cache[key]


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


def engine_grad_tier(stage: int, optimizer_tier: Tier) -> Tier:
    """Where the engine keeps the fp32 gradients: whole units on the device at stages 0–1;
    from stage 2 the gradient shards live with the optimizer (``zero.flat.Placement``), in
    RAM when the optimizer is on NVMe (its swap files hold masters and moments only)."""
    optimizer_tier = Tier(optimizer_tier)
    if stage < 2:
        return Tier.DEVICE
    return Tier.CPU if optimizer_tier is Tier.NVME else optimizer_tier


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
                  recompute: str = "block") -> PeakBreakdown:
    """Simulate one training step of tiertrain's engine on ``model`` (meta is fine) and
    return what one rank holds at the peak. ``acts``: the model's activation sizes (None:
    activations not modelled, model states and engine buffers only). ``rank``: the rank
    to account (None: rank 0, the largest: ranks differ only in the Adam moments of their
    shard's real elements, and each unit's padding sits at its end). ``recompute``:
    ``activations.recompute`` ("selective": checkpointed blocks also keep their kept
    outputs, on the device whatever ``checkpoint_tier``)."""
    if rank is None:
        rank = 0  # every rank holds the same buffers; the padding (no Adam state) is at the end
    param_tier, optimizer_tier, checkpoint_tier = Tier(param_tier), Tier(optimizer_tier), Tier(checkpoint_tier)
    D = precision_bytes
    layout = engine_units(model, stage, dp, bucket_mb, persistence_threshold)
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
    # Frozen parameters: stage 3's frozen units as shards, the rest whole on every rank
    # (no gradient, master or moments either way).
    params += D * sum(u.shard_numel for u in layout.frozen)
    in_frozen_units = {s_.name for u in layout.frozen for s_ in u.slots}
    params += D * sum(p.numel() for n, p in model.named_parameters()
                      if not p.requires_grad and n not in in_frozen_units)
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


# --------------------------------------------------------------------------- building the model

MMAP_THRESHOLD_MAX = 32 * 2**20
"""glibc's DEFAULT_MMAP_THRESHOLD_MAX on 64-bit Linux: a block larger than this is always
mmapped and goes back to the OS when freed; smaller ones may come from the heap, whose freed
holes stay resident (before wrap() glibc's dynamic threshold rises to the largest block
freed; from wrap() on ``zero.retain_host_memory`` fixes it at this value, so every block up
to it comes from the heap)."""


def builds_partitioned(stage: int, tile_factor: int = 1, tp: int = 1) -> bool:
    """Whether ``tiertrain train`` builds the model under ``tiertrain.zero.partitioned_init``
    (tiertrain.train.build_model): at ZeRO stage 3, untiled, without tensor parallelism.
    Otherwise every rank builds the whole model in fp32 before wrap() flattens it."""
    return stage == 3 and tile_factor == 1 and tp == 1


@dataclass
class BuildPeak:
    """What one rank holds at the peak of building the model and wrapping it (before step 1)."""

    partitioned: bool
    """Built under partitioned_init (each rank materialises one module at a time)."""
    host: int
    """Bytes of host RAM at the build's peak (the whole rank on a machine without an
    accelerator), including the framework bytes of the process."""
    device: int
    """Most bytes on the accelerator during the build (0 without one: they are in ``host``)."""
    where: str
    """The phase of the build where host RAM peaks."""
    items: dict[str, int] = field(default_factory=dict)
    """What is live at the peak, by item (bytes)."""

    @property
    def total(self) -> int:
        return self.host + self.device


def simulate_build_peak(model: nn.Module, *, dp: int, stage: int, precision_bytes: int,
                        param_tier: Tier = Tier.DEVICE, optimizer_tier: Tier = Tier.DEVICE, bucket_mb: float = 25.0,
                        persistence_threshold: int = 0, partitioned: bool | None = None,
                        accelerator: bool = False, framework_bytes: int = 0,
                        nvme_chunk_bytes: int = 24 << 20, nvme_buffers: int = 4,
                        grads_released: bool = False) -> BuildPeak:
    """Per-rank peak of building ``model`` (meta is fine) the way ``tiertrain train`` does
    and wrapping it with the engine, before the first step:

    1. **construction** in fp32 on the host: the whole model on every rank
       (``partitioned=False``), or under ``partitioned_init``: the fp32 shards
       (⌈n/dp⌉ per parameter) plus the module being initialised, whole;
    2. **wrap** (``tiertrain.zero.flat.FlatParameters``), unit by unit in layout order: the
       unit's full flat buffer (compute dtype), a gathered parameter (partitioned builds),
       its shard on the parameter tier, its fp32 master (where separate) and its fp32
       gradient (zeroed at once, except with the optimizer on NVMe, whose gradient pages
       are first written after the masters leave); then the unit's original fp32 tensors
       are freed;
    3. the NVMe optimizer's setup: its ring of ``nvme_buffers`` chunk buffers; the masters
       are dropped and the gradient shards zeroed (``grads_released``: left without memory
       until their first reduction, as the in-place step running in backward does).

    Freed blocks: a block of at most :data:`MMAP_THRESHOLD_MAX` (32 MiB) may sit in glibc's
    heap, whose holes stay resident, so such freed originals and masters are counted as
    still held until the end of the build (an upper bound: later allocations can reuse
    some of them); larger blocks are mmapped and return to the OS when freed. Buffer pools
    (NVMe staging) are counted whole. The accelerator's bytes go to ``device`` when
    ``accelerator``; otherwise every byte is host RAM."""
    if partitioned is None:
        partitioned = builds_partitioned(stage, getattr(model, "_tiertrain_tile_factor", 1))
    param_tier, optimizer_tier = Tier(param_tier), Tier(optimizer_tier)
    D = precision_bytes
    layout = engine_units(model, stage, dp, bucket_mb, persistence_threshold)
    units = layout.units
    numel = {n: p.numel() for n, p in model.named_parameters() if p.requires_grad}
    HOLES = "freed heap blocks still resident (glibc, < 32 MiB)"
    host: dict[str, int] = {}
    dev: dict[str, int] = {}

    def alloc(tier: Tier, name: str, nbytes: int, touched: bool = True) -> int:
        """Allocate (host blocks ≤ 32 MiB reuse freed heap holes first); returns the bytes
        that became resident later when the block is touched (0 if touched now)."""
        nbytes = int(nbytes)
        if accelerator and tier is Tier.DEVICE:
            dev[name] = dev.get(name, 0) + nbytes
            return 0
        reused = min(host.get(HOLES, 0), nbytes) if nbytes <= MMAP_THRESHOLD_MAX else 0
        host[HOLES] = host.get(HOLES, 0) - reused
        host[name] = host.get(name, 0) + (nbytes if touched else reused)
        return 0 if touched else nbytes - reused

    def free(tier: Tier, name: str, nbytes: int) -> None:
        nbytes = int(nbytes)
        if accelerator and tier is Tier.DEVICE:
            dev[name] -= nbytes
            return
        host[name] -= nbytes
        if nbytes <= MMAP_THRESHOLD_MAX:
            host[HOLES] = host.get(HOLES, 0) + nbytes

    best: tuple[int, str, dict[str, int]] = (-1, "", {})  # host RAM's peak
    best_dev: tuple[int, dict[str, int]] = (0, {})  # the accelerator's (its own moment)

    def point(where: str, extra_host: dict[str, int] | None = None, extra_dev: dict[str, int] | None = None):
        nonlocal best, best_dev
        h = {k: v for k, v in host.items() if v}
        d = {k: v for k, v in dev.items() if v}
        for k, v in (extra_host or {}).items():
            h[k] = h.get(k, 0) + v
        for k, v in (extra_dev or {}).items():
            d[k] = d.get(k, 0) + v
        if sum(h.values()) > best[0]:
            best = (sum(h.values()), where, h)
        if sum(d.values()) > best_dev[0]:
            best_dev = (sum(d.values()), d)

    if framework_bytes:
        alloc(Tier.CPU, "framework overhead", framework_bytes)
    # ---- 1. construction (fp32, host)
    ORIG = "model parameters as built (fp32)" if not partitioned else "fp32 parameter shards (partitioned_init)"
    if partitioned:
        original = {n: 4 * -(-k // dp) for n, k in numel.items()}
        leaves: dict[str, int] = {}
        for n, k in numel.items():
            leaf = n.rsplit(".", 1)[0] if "." in n else ""
            leaves[leaf] = leaves.get(leaf, 0) + 4 * k
        for n in original:
            alloc(Tier.CPU, ORIG, original[n])
        point("construction (partitioned_init)", {"module being initialised (fp32, whole)": max(leaves.values())})
    else:
        original = {n: 4 * k for n, k in numel.items()}
        for n in original:
            alloc(Tier.CPU, ORIG, original[n])
        point("construction (whole model, fp32)")
    # ---- 2. wrap: the engine's swap pool, then FlatParameters unit by unit
    opt_tier = Tier.DEVICE if optimizer_tier is Tier.DEVICE else Tier.CPU
    if stage == 3 and param_tier is Tier.NVME:  # the parameter swapper's pool, used by the shard writes
        pool_bytes = swap_pool_bytes(max(u.shard_numel for u in units) * D)
        written = sum(D * u.shard_numel for u in units if not u.resident)
        alloc(Tier.CPU, "NVMe staging buffers", min(pool_bytes, written))
    masters: list[int] = []
    untouched_grads = 0
    for u in units:
        shard_tier = Tier.DEVICE if u.resident else param_tier
        th: dict[str, int] = {}
        td: dict[str, int] = {}
        if u.resident:
            alloc(Tier.DEVICE, "flat parameters", D * u.padded_numel)
        else:
            (td if accelerator else th)["unit being flattened (compute dtype)"] = D * u.padded_numel
            if shard_tier is Tier.NVME:
                th["shard being written to NVMe"] = D * u.shard_numel
            else:
                alloc(shard_tier, "flat parameters", D * u.shard_numel)
        if partitioned:
            th["parameter gathered from its shards (fp32)"] = max(4 * numel[s.name] for s in u.slots)
        if not (D == 4 and optimizer_tier == shard_tier):
            alloc(opt_tier, "master weights (fp32)", 4 * u.shard_numel)
            masters.append(4 * u.shard_numel)
        if stage <= 1:
            alloc(Tier.DEVICE, "gradients (fp32)", 4 * u.padded_numel)
        else:
            untouched_grads += alloc(opt_tier, "gradients (fp32)", 4 * u.shard_numel,
                                     touched=optimizer_tier is not Tier.NVME)
        point(f"wrap: flattening unit {u.label}", th, td)
        for s_ in u.slots:  # the unit's original tensors are freed
            free(Tier.CPU, ORIG, original.pop(s_.name, 0))
    point("wrap: units flattened")
    # ---- 3. the NVMe optimizer: its ring; the masters leave, the gradient shards are zeroed
    if optimizer_tier is Tier.NVME:
        from tiertrain.offload.nvme_optimizer import BYTES_PER_ELEM

        chunk = min(max(1024, nvme_chunk_bytes // BYTES_PER_ELEM), max(u.shard_numel for u in units))
        alloc(Tier.CPU, "NVMe optimizer chunk buffers", nvme_buffers * BYTES_PER_ELEM * chunk)
        # fp32 shards on NVMe are their own masters: the optimizer's first records are read
        # from their files, one unit's shard at a time, instead of from masters in RAM
        read_back = max((4 * u.shard_numel for u in units if not u.resident), default=0) \
            if D == 4 and param_tier is Tier.NVME and stage == 3 else 0
        point("wrap: NVMe optimizer set up (the masters in RAM, if any, still there)",
              {"shard read back for the optimizer's records": read_back} if read_back else None)
        for m in masters:
            free(opt_tier, "master weights (fp32)", m)
        if not grads_released:
            host["gradients (fp32)"] = host.get("gradients (fp32)", 0) + untouched_grads
        point("wrap: masters dropped, gradient shards " + ("released" if grads_released else "zeroed"))
    _, where, h = best
    items = dict(h)
    for k, v in best_dev[1].items():
        items[f"{k} (device, at its own peak)"] = v
    return BuildPeak(partitioned=partitioned, host=sum(h.values()), device=best_dev[0], where=where,
                     items=items)


# --------------------------------------------------------------------------- process overhead


@dataclass(frozen=True)
class HostOverhead:
    """Process memory besides tensors, added to the estimate of a rank's peak.

    ``framework_bytes`` is a constant per process (gloo, BLAS/oneDNN workspaces, the
    autograd engine, allocator metadata, Python objects). ``retention`` is the fraction of
    the transient bytes at the peak that the host allocator keeps resident on top of them:
    activations, buckets and gathered units of up to 32 MiB come from glibc's heap (with
    ``zero.retain_host_memory``, the default, from wrap() on; otherwise once the dynamic mmap
    threshold has risen), whose freed holes stay resident and fragment: it is there from
    the first step, grows over the next ones, and varies from run to run (the spread is
    measured in bench/results/estimate_accuracy.md). 0 on CUDA devices,
    whose caching allocator is not modelled here."""

    framework_bytes: int = DEFAULT_OVERHEAD_BYTES
    """Constant bytes per rank process."""
    retention: float = DEFAULT_RETENTION
    """Fraction of the peak's transient bytes (activations and engine buffers) the host
    allocator holds on top of them."""
    source: str = "defaults measured on the reference machine (bench/results/estimate_accuracy.md)"
    """Where the figures come from."""

    @classmethod
    def none(cls) -> "HostOverhead":
        """No overhead: tensor bytes only."""
        return cls(0, 0.0, "none (tensor bytes only)")

    @classmethod
    def for_device(cls, device: str) -> "HostOverhead":
        """The defaults for a compute device: "cpu" (host allocator retention applies to the
        transient bytes) or "cuda" (they live in the caching allocator: not modelled, 0)."""
        return cls() if device == "cpu" else cls(DEFAULT_OVERHEAD_BYTES, 0.0, "default framework bytes; CUDA "
                                                 "caching allocator not modelled")


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
    elif hasattr(dims, "activation_bytes"):  # tiertrain.estimate.modules.HFModelDims
        acts = dims.activation_bytes(lay.micro_batch, D)
        notes.append(f"activations: {dims.model_type} ({dims.kind}, {dims.attention} attention) modelled per block "
                     "from the transformers modeling code (tiertrain.estimate.modules)")
    else:
        acts = gpt_activation_bytes(dims, lay.micro_batch, D)
    if acts is None:
        notes.append("activations not modelled (no GPT dims): model states and engine buffers only")
    elif dims.dropout and not hasattr(dims, "activation_bytes"):
        notes.append("dropout: its 1-byte masks are counted; the attention-dropout path of SDPA is not")
    if lay.checkpoint_interval and dims is not None and lay.checkpoint_interval > dims.n_layers:
        raise ValueError(f"ZeroLayout.checkpoint_interval={lay.checkpoint_interval} is invalid: the model has "
                         f"{dims.n_layers} blocks; expected 0 (off) or 1..{dims.n_layers}")
    param_tier = Tier(lay.param_tier) if lay.stage == 3 else Tier.DEVICE
    optimizer_tier = Tier(lay.optimizer_tier)
    pk = simulate_peak(module, dp=lay.dp, stage=lay.stage, precision_bytes=D, param_tier=param_tier,
                       optimizer_tier=optimizer_tier, bucket_mb=lay.bucket_mb, prefetch_mb=lay.prefetch_mb,
                       persistence_threshold=lay.persistence_threshold, backend=lay.backend, acts=acts,
                       checkpoint_every=lay.checkpoint_interval, checkpoint_tier=lay.checkpoint_tier,
                       recompute=lay.recompute)
    layout = engine_units(module, lay.stage, lay.dp, lay.bucket_mb, lay.persistence_threshold)
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
                     "the gradient shards and the streaming buffers of tiertrain.offload.NVMeAdamW")
    shared_masters = (sum(D * u.shard_numel for u in layout.units if not u.resident)
                      if masters_are_param_shards(lay) else 0)  # (on NVMe as parameters, in both generations)
    lines += second_generation_lines(lay, pk.master + pk.moments + shared_masters)
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
        try:
            from tiertrain.offload.nvme_optimizer import DEFAULT_CHUNK_BYTES
        except Exception:  # pragma: no cover - the module is optional here
            DEFAULT_CHUNK_BYTES = 24 << 20
        add("NVMe staging buffers", 4 * DEFAULT_CHUNK_BYTES, Tier.CPU,
            "NVMeAdamW ring: 4 buffers × chunk_bytes (master + m + v of one chunk)")
        if param_tier is Tier.NVME and D != 4:  # (fp32: the step's writes are the shards' own)
            add("NVMe parameter write staging", max(u.shard_numel for u in layout.units) * D, Tier.CPU,
                "one unit's updated shard assembled for its swap write (zero.flat.ShardWriter); "
                "live during backward when the step overlaps it (zero.overlap_nvme_step)")
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


def engine_build_peak(module: nn.Module | None, dims: Any, lay: Any, overhead: HostOverhead | None = None,
                      accelerator: bool = False) -> BuildPeak:
    """:func:`simulate_build_peak` of a layout (:class:`~tiertrain.estimate.memory.ZeroLayout`),
    built as ``tiertrain train`` builds it (partitioned at stage 3 untiled with tp = 1)."""
    if module is None:
        module = dims.meta_model() if hasattr(dims, "meta_model") else gpt_meta_model(dims, lay.tile_factor)
    ov = overhead if overhead is not None else HostOverhead()
    return simulate_build_peak(
        module, dp=lay.dp, stage=lay.stage, precision_bytes=PRECISION_BYTES[lay.precision],
        param_tier=lay.param_tier if lay.stage == 3 else Tier.DEVICE, optimizer_tier=lay.optimizer_tier,
        bucket_mb=lay.bucket_mb, persistence_threshold=lay.persistence_threshold,
        # a Hugging Face model is built by its owner (from_config / from_pretrained): whole
        partitioned=builds_partitioned(lay.stage, getattr(module, "_tiertrain_tile_factor", lay.tile_factor), lay.tp)
        and not hasattr(dims, "activation_bytes"),
        accelerator=accelerator, framework_bytes=int(ov.framework_bytes),
        # (the in-place NVMe step running in backward frees each gradient shard it consumed,
        # so the engine gives them memory only at their first reduction)
        grads_released=Tier(lay.optimizer_tier) is Tier.NVME and lay.nvme_in_place and lay.stage >= 2)


def stage3_gathered_bytes(module: nn.Module, precision_bytes: int, dp: int = 2,
                          persistence_threshold: int = 0) -> int:
    """Most stage-3 parameter bytes gathered at once in a step (compute dtype): the root unit
    (gathered from the start of forward to the end of backward) plus the largest block-level
    unit plus its largest nested unit (a tile). ZeRO-Infinity's MSWM for tiertrain's units;
    memory-centric tiling lowers it (tiertrain.tiling)."""
    layout = engine_units(module, 3, dp, persistence_threshold=persistence_threshold)
    root = sum(u.padded_numel for u in layout.units if not u.resident and u.label == "<root>")
    blocks: dict[str, int] = {}
    nested: dict[str, int] = {}
    for u in layout.units:
        if u.resident or u.label == "<root>":
            continue
        top = ".".join(u.label.split(".")[:2])
        if u.label.count(".") == 1:
            blocks[top] = blocks.get(top, 0) + u.padded_numel
        else:
            nested[top] = max(nested.get(top, 0), u.padded_numel)
    block = max((blocks.get(k, 0) + nested.get(k, 0) for k in set(blocks) | set(nested)), default=0)
    return precision_bytes * (root + block)
