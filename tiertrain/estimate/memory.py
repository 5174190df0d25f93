"""Memory model of a training run: :func:`estimate`, the per-rank lines of either accounting.

* With ``accounting="paper"`` the lines follow the papers' formulas
  (:mod:`tiertrain.estimate.formulas`: ZeRO §5 Table 1 / Table 2, ZeRO-Infinity §3, and
  activations after Korthikanti et al. 2022 §4, an approximation).
* With engine accounting they describe what *tiertrain's engine* keeps, byte for byte
  (:func:`~tiertrain.estimate.layout.engine_model_state_bytes`). With a model given as
  ModelDims (:mod:`tiertrain.estimate.dims`), HFModelDims (:mod:`tiertrain.estimate.modules`:
  any Hugging Face model of a modelled family) or a module (tp = pp = 1), :func:`estimate` goes
  further, through :mod:`tiertrain.estimate.peak`: the engine's own layout (bucket and unit
  padding), the activations of tiertrain's GPT (or of the Hugging Face model), the engine's
  transient buffers at the simulated peak of a step, and the process overhead — the per-rank
  peak, checked against real runs in bench/results/estimate_accuracy.md (and _hf.md).

The layout estimated is a :class:`~tiertrain.estimate.layout.ZeroLayout`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch
import torch.nn as nn

from .lines import (PRECISION_BYTES, TIERS, EstimateLine, Tier, accumulator_line, landing_line,
                    masters_are_param_shards, overlap_second_set_lines, second_generation_lines)
from .activations import gpt_activation_bytes
from .build_peak import engine_build_peak
from .dims import ModelDims, module_parameter_sizes
from .formulas import activation_bytes_head, activation_bytes_per_layer, infinity_awm_bytes, infinity_mswm_bytes
from .layout import ZeroLayout, engine_model_state_bytes
from .own_checkpointing import with_own_checkpointing
from .peak import engine_estimate_lines

__all__ = [
    "PRECISION_BYTES",
    "TIERS",
    "Tier",
    "Estimate",
    "EstimateLine",
    "estimate",
    "estimate_from_args",
]


# --------------------------------------------------------------------------- estimate


@dataclass
class Estimate:
    """Result of :func:`estimate`: labelled per-rank lines plus totals per tier."""

    parameters: int
    """Ψ, parameters of the whole model."""
    layout: ZeroLayout
    """The layout estimated."""
    dims: ModelDims | None
    """Model shape when known (activation lines need it), else None."""
    lines: list[EstimateLine] = field(default_factory=list)
    """The labelled items, per rank."""
    notes: list[str] = field(default_factory=list)
    """Assumptions and omissions, in words."""
    peak_at: str = ""
    """Engine accounting: the point of the training step where the per-rank peak falls
    (the transient lines are what is live there); empty for the papers' accounting."""
    build: Any = None
    """Engine accounting: the per-rank peak of building the model and wrapping it, as
    ``tiertrain train`` does (:class:`~tiertrain.estimate.build_peak.BuildPeak`: whole in fp32 on
    every rank, or under partitioned_init at stage 3 untiled); None otherwise."""

    def build_by_tier(self) -> dict[Tier, int] | None:
        """Bytes per rank at the build's peak: {CPU: host RAM, DEVICE: accelerator, NVME: 0}
        (None when not estimated). On a machine without an accelerator all is CPU."""
        if self.build is None:
            return None
        return {Tier.DEVICE: self.build.device, Tier.CPU: self.build.host, Tier.NVME: 0}

    def by_tier(self) -> dict[Tier, int]:
        """Bytes per rank in each tier (every tier present, 0 when unused)."""
        out = {t: 0 for t in TIERS}
        for line in self.lines:
            out[line.tier] += line.bytes
        return out

    def per_node(self) -> dict[Tier, int]:
        """Bytes per node in each tier: per-rank bytes x ``layout.node_ranks``."""
        return {t: b * self.layout.node_ranks for t, b in self.by_tier().items()}

    def total(self, tier: Tier | str | None = None) -> int:
        """Bytes per rank, in one tier (a Tier, or a spelling it accepts) or (None) across all tiers."""
        tier = None if tier is None else Tier(tier)
        return sum(l.bytes for l in self.lines if tier is None or l.tier is tier)

    def line(self, name: str) -> EstimateLine:
        """The line called ``name``; ValueError listing the names when absent."""
        for l in self.lines:
            if l.name == name:
                return l
        raise ValueError(f"Estimate.line name={name!r} is unknown: lines are {[l.name for l in self.lines]}")

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: parameters, layout, dims, lines, per-rank and per-node tiers."""
        return {
            "parameters": self.parameters,
            "layout": asdict(self.layout),
            "dims": (self.dims.to_dict() if hasattr(self.dims, "to_dict") else asdict(self.dims))
            if self.dims else None,
            "lines": [asdict(l) for l in self.lines],
            "per_rank": self.by_tier(),
            "per_node": self.per_node(),
            "ranks_per_node": self.layout.node_ranks,
            "notes": list(self.notes),
            "peak_at": self.peak_at,
            "build_peak": None if self.build is None else {
                "partitioned": self.build.partitioned, "where": self.build.where,
                "per_rank": {"host": self.build.host, "device": self.build.device},
                "per_node": {"host": self.build.host * self.layout.node_ranks,
                             "device": self.build.device * self.layout.node_ranks},
                "items": dict(self.build.items)},
        }


ModelSpec = ModelDims | int | Sequence[int] | nn.Module | Callable[[], nn.Module]


def _resolve_model(model: ModelSpec) -> tuple[int, list[int], ModelDims | None, nn.Module | None]:
    """(Ψ, per-tensor sizes, dims or None, module or None) of any accepted model description."""
    if isinstance(model, ModelDims):
        psi = model.validate().num_parameters()
        return psi, [psi], model, None
    if hasattr(model, "activation_bytes") and hasattr(model, "meta_model"):  # modules.HFModelDims
        module = model.validate().meta_model()
        return model.num_parameters(), module_parameter_sizes(module), model, module
    if isinstance(model, int) and not isinstance(model, bool):
        if model <= 0:
            raise ValueError(f"estimate.model={model!r} is invalid: a parameter count must be > 0")
        return model, [model], None, None
    if isinstance(model, (list, tuple)):
        return sum(model), [int(n) for n in model], None, None
    if isinstance(model, nn.Module) or callable(model):
        if isinstance(model, nn.Module):
            module = model
        else:
            with torch.device("meta"):
                module = model()
        sizes = module_parameter_sizes(module)
        config = getattr(module, "config", None)
        dims = None
        if config is not None and all(hasattr(config, a) for a in ("n_layers", "hidden", "vocab_size")):
            dims = ModelDims.from_gpt_config(config)
        return sum(sizes), sizes, dims, module
    raise ValueError(
        f"estimate.model={model!r} is invalid: must be ModelDims, a parameter count, a list "
        "of tensor sizes, an nn.Module or a factory returning one"
    )


def _model_state_lines(psi: int, sizes: list[int], lay: ZeroLayout) -> list[EstimateLine]:
    """Params / grads / master / optimizer lines for ``lay.accounting``."""
    mp = lay.tp * lay.pp
    nd = lay.zero_ranks
    if lay.accounting == "paper":
        p = psi / mp
        return [
            EstimateLine("parameters", math.ceil(2 * p / (nd if lay.stage >= 3 else 1)), lay.param_tier,
                         "2Ψ/N_d (ZeRO §5.3, P_os+g+p)" if lay.stage >= 3 else "2Ψ (ZeRO §3.1, fp16 params)"),
            EstimateLine("gradients", math.ceil(2 * p / (nd if lay.stage >= 2 else 1)), lay.grad_tier,
                         "2Ψ/N_d (ZeRO §5.2, P_os+g)" if lay.stage >= 2 else "2Ψ (ZeRO §3.1, fp16 grads)"),
            EstimateLine("optimizer states", math.ceil(12 * p / (nd if lay.stage >= 1 else 1)),
                         lay.optimizer_tier,
                         "K·Ψ/N_d (ZeRO §5.1, P_os; K=12)" if lay.stage >= 1 else "K·Ψ (ZeRO §3.1, K=12)"),
        ]
    if mp > 1:  # Megatron: each model-parallel rank holds ~Ψ/(t·p) (replicated LNs ignored)
        sizes = [-(-psi // mp)]
    separate = lay.precision != "fp32" or lay.optimizer_tier != lay.param_tier
    ms = engine_model_state_bytes(sizes, nd, lay.stage, lay.precision, lay.alignment, separate)
    pb = PRECISION_BYTES[lay.precision]
    shard = "⌈Ψ'/N_d⌉" if lay.alignment == 1 else f"⌈Ψ'/(N_d·{lay.alignment})⌉·{lay.alignment}"

    def part(partitioned: bool) -> str:
        return shard if partitioned else "Ψ'"

    master = (f"4·{part(lay.stage >= 1)} (fp32 master"
              + (", ZeRO §5.1 P_os)" if lay.stage >= 1 else ", replicated)") if separate
              else "0 (fp32 params on the optimizer's tier are their own master)")
    return [
        EstimateLine("parameters", ms.params, lay.param_tier,
                     f"{pb}·{part(lay.stage >= 3)} ({lay.precision} params"
                     + (", ZeRO §5.3 P_p)" if lay.stage >= 3 else ", replicated)")),
        EstimateLine("gradients", ms.grads, lay.grad_tier,
                     f"4·{part(lay.stage >= 2)} (fp32 grads"
                     + (", ZeRO §5.2 P_g)" if lay.stage >= 2 else ", replicated)")),
        EstimateLine("master weights", ms.master, lay.optimizer_tier, master),
        EstimateLine("optimizer states", ms.optimizer, lay.optimizer_tier,
                     f"8·{part(lay.stage >= 1)} (Adam m+v fp32"
                     + (", ZeRO §5.1 P_os)" if lay.stage >= 1 else ", replicated)")),
        *second_generation_lines(lay, ms.master + ms.optimizer + (ms.params if masters_are_param_shards(lay) else 0)),
        *([accumulator_line(4 * sum(sizes))] if lay.accumulate_on_device else []),
        *overlap_second_set_lines(lay, ms.master, ms.optimizer, ms.grads // 4),  # (stages 2-3: grads are the shard, fp32)
        *([landing_line(ms.grads)] if lay.landing_buffers else []),
    ]



def _activation_lines(d: ModelDims, lay: ZeroLayout) -> list[EstimateLine]:
    """Activations (or checkpoints + AWM) and MSWM lines; all need the model's shape."""
    paper = lay.accounting == "paper"
    dt = 2 if paper else PRECISION_BYTES[lay.precision]
    drop = True if paper else d.dropout
    scores = True if paper else d.stores_attention_scores
    s, b, h, a, nl, ci = d.seq_len // lay.cp, lay.micro_batch, d.hidden, d.n_heads, d.n_layers, lay.checkpoint_interval
    layer = activation_bytes_per_layer(s, b, h, a, dt, lay.tp, drop, scores)
    m = 1 if drop else 0
    dense_c = f"{4 * dt + 2 * m + 12 * dt / lay.tp:g}"
    score_c = f"{((2 * dt + m) if drop else dt) / lay.tp:g}" if scores else "0"
    layer_f = f"s·b·h·{dense_c}" + (f" + a·s²·b·{score_c}" if scores else "")
    lines = [EstimateLine("activations (embedding, head, logits)",
                          math.ceil(activation_bytes_head(s, b, h, d.vocab, dt, drop)), Tier.DEVICE,
                          "s·b·h·(m+2D) + s·b·V·(D+4) (≈, Korthikanti 2022 §4.3)")]
    if ci == 0:
        lines.insert(0, EstimateLine("activations (blocks)", math.ceil(nl * layer), Tier.DEVICE,
                                     f"nl·({layer_f}) (≈ Korthikanti 2022 §4.1; D={dt} B)"))
    else:
        n_ckpt = math.ceil(nl / ci)
        lines.insert(0, EstimateLine("activation checkpoints", dt * b * s * h * n_ckpt, lay.checkpoint_tier,
                                     f"{dt}·bsz·seq·hd·⌈nl/ci⌉ (ZeRO-Infinity §3)"))
        if lay.recompute == "selective":  # the kept outputs: on the device, split like the linears (÷t)
            acts = (d.activation_bytes(b, dt) if hasattr(d, "activation_bytes")
                    else gpt_activation_bytes(d, b, dt))
            lines.insert(1, EstimateLine("activations kept by selective recompute",
                                         math.ceil(n_ckpt * acts.kept_at(0) / lay.tp),
                                         Tier.DEVICE, "⌈nl/ci⌉ × the matmul and fused-attention outputs of a "
                                         "block, ÷t (activations.recompute=selective)"))
        awm = (infinity_awm_bytes(b, s, ci, h, a) if paper else math.ceil(min(ci, nl) * layer))
        lines.insert(1, EstimateLine("activation working memory", awm, Tier.DEVICE,
                                     "bsz·seq·ci·(16·hd+2·attn_heads·seq) (ZeRO-Infinity §3 AWM)" if paper
                                     else f"ci·({layer_f}) (ZeRO-Infinity §3 AWM; layer ≈ Korthikanti 2022)"))
    if lay.stage == 3:
        if paper:
            mswm, f = infinity_mswm_bytes(h, lay.tile_factor), "4·hd·4hd/tile (ZeRO-Infinity §3 MSWM, §5.1.3 tiling)"
        else:
            pb = PRECISION_BYTES[lay.precision]
            mswm = (pb + 4) * d.largest_operator_elements() / (lay.tile_factor * lay.tp)
            f = f"({pb}+4)·max(f·hd², V·hd)/(tile·t) (ZeRO-Infinity §3 MSWM, engine dtypes)"
        lines.append(EstimateLine("model-state working memory", math.ceil(mswm), Tier.DEVICE, f))
    return lines


def estimate(model: ModelSpec, layout: ZeroLayout | None = None, overhead: Any = None, *,
             accelerator: bool = False) -> Estimate:
    """Per-rank memory of training ``model`` under ``layout``, one labelled line per item.

    ``model`` is ModelDims (all lines), a :class:`~tiertrain.estimate.modules.HFModelDims`
    (any Hugging Face model of a supported family: all lines, its activations modelled per
    block), a parameter count or list of tensor sizes (model states only), or an nn.Module /
    factory (counted on the meta device; a ``.config`` with GPTConfig's fields also yields
    dims). Model-parallel ranks hold Ψ/(t·p).

    With engine accounting, a model given as ModelDims or a module, and tp = pp = 1, the
    lines are tiertrain's engine buffer by buffer (:mod:`tiertrain.estimate.peak`): model
    states from the engine's own layout (padding, buckets, stage-3 units), and the
    activations and transient buffers live at the simulated per-rank peak (``peak_at``),
    plus the process overhead ``overhead`` (:class:`~tiertrain.estimate.overhead.HostOverhead`;
    None: the defaults measured on the reference machine; ``HostOverhead.none()``: 0).
    Then ``total()`` is the predicted peak per rank, and ``build`` the peak of building the
    model and wrapping it as ``tiertrain train`` does (``accelerator``: the flat buffers
    are on an accelerator, so only the construction and the host tiers count as host RAM).
    """
    lay = (layout or ZeroLayout()).validate()
    psi, sizes, dims, module = _resolve_model(model)
    lay, own = with_own_checkpointing(lay, dims)
    est = Estimate(parameters=psi, layout=lay, dims=dims)
    if own:
        est.notes.append(own)
    if lay.accounting == "engine" and lay.tp * lay.pp == 1 and (module is not None or dims is not None):
        lines, notes, where = engine_estimate_lines(module, dims, lay, overhead)
        est.lines.extend(lines)
        est.notes.extend(notes)
        est.peak_at = where
        est.build = engine_build_peak(module, dims, lay, overhead, accelerator=accelerator)
        return est
    est.lines.extend(_model_state_lines(psi, sizes, lay))
    if dims is not None:
        est.lines.extend(_activation_lines(dims, lay))
    else:
        est.notes.append("activation and working-memory lines omitted: model dims unknown")
    if lay.tp * lay.pp > 1:
        est.notes.append("model-parallel ranks assumed to hold Ψ/(t·p) each (Megatron §2)")
    if lay.pp > 1 and dims is not None:
        est.notes.append("activations are for pipeline stage 0: under 1F1B it holds p in-flight "
                         "micro-batches of nl/p layers, i.e. nl layers' worth (Korthikanti 2022 §4.2.3)")
    if lay.accounting == "engine":
        est.notes.append("Ψ' = Ψ/(t·p), the parameters of one model-parallel rank; engine dtypes: "
                         "params in compute dtype, fp32 grads/master/Adam; "
                         "temporary buffers (buckets, gathered layers) and allocator overhead not included")
    return est


_ALIASES: Mapping[str, str] = MappingProxyType(
    {"ci": "checkpoint_interval", "bsz": "micro_batch", "seq": "seq_len", "layers": "n_layers",
     "heads": "n_heads", "vocab_size": "vocab", "tile": "tile_factor"}
)


def estimate_from_args(overhead: Any = None, accelerator: bool = False, **kwargs: Any) -> Estimate:
    """Keyword front end for a CLI: ModelDims fields (n_layers, hidden, n_heads, vocab,
    seq_len, ...) or ``params=`` a count or ``module=`` an nn.Module/factory, plus any
    ZeroLayout field. Aliases: ci, bsz, seq, layers, heads, vocab_size, tile. ``overhead``
    and ``accelerator`` as for :func:`estimate`."""
    args = {_ALIASES.get(k, k): v for k, v in kwargs.items() if v is not None}
    dim_names = {f.name for f in fields(ModelDims)}
    lay_names = {f.name for f in fields(ZeroLayout)}
    unknown = sorted(set(args) - dim_names - lay_names - {"params", "module"})
    if unknown:
        raise ValueError(
            f"estimate_from_args: unknown argument(s) {unknown}; valid are "
            f"{sorted(dim_names | lay_names | {'params', 'module'} | set(_ALIASES))}"
        )
    layout = ZeroLayout(**{k: v for k, v in args.items() if k in lay_names})
    dim_args = {k: v for k, v in args.items() if k in dim_names}
    if "module" in args:
        model: ModelSpec = args["module"]
    elif "params" in args:
        model = args["params"]
    elif dim_args:
        model = ModelDims(**dim_args)
    else:
        raise ValueError("estimate_from_args: give model dims (n_layers, hidden, ...), params= or module=")
    return estimate(model, layout, overhead, accelerator=accelerator)
