"""Where :func:`~tiertrain.pipeline.hf_split.split_hf` cuts a model: each stage's module paths
balanced by layers or parameters, a user's explicit split checked (whole groups, model order, a
plain chain for an unrecognised model), a weight tied across the first and last stage untied,
and the tensor-parallel conversions the stages cannot run refused.
"""
from __future__ import annotations

import inspect

import torch.nn as nn

from .hf_families import PIPELINE_DECODERS, Family, _children, _units
from .stage import _min_max_partition

__all__ = ["PARENT_INPUTS", "uncovered"]


def _params(model: nn.Module, paths: list[str]) -> int:
    seen = {id(p): p.numel() for path in paths for p in model.get_submodule(path).parameters()}
    return sum(seen.values())


def _balanced(model: nn.Module, family: Family, num_stages: int, balance: str) -> list[list[str]]:
    L = len(family.blocks)
    units = _units(family)
    if balance == "layers":
        if num_stages > L:
            raise ValueError(f"split_hf: num_stages={num_stages} is invalid with balance='layers': more stages "
                             f"than the {L} blocks")
        base, extra = divmod(L, num_stages)
        sizes = [base + (s < extra) for s in range(num_stages)]
        out, start = [], 1
        for s, size in enumerate(sizes):
            out.append([p for u in units[start:start + size] for p in u])
            start += size
        out[0] = family.embed + out[0]
        out[-1] = out[-1] + family.head
        return out
    if balance == "params":
        if num_stages > L + 2:
            raise ValueError(f"split_hf: num_stages={num_stages} is invalid with balance='params': more stages "
                             f"than the {L + 2} units (embeddings, {L} blocks, head)")
        # the head counted in full even when tied (the last stage gets its own copy)
        weights = [_params(model, family.embed)] + [_params(model, u) for u in units[1:-1]]
        weights.append(sum(_params(model, [h]) for h in family.head))
        out, start = [], 0
        for size in _min_max_partition(weights, num_stages):
            out.append([p for u in units[start:start + size] for p in u])
            start += size
        return out
    raise ValueError(f"split_hf: balance={balance!r} is invalid: valid values are 'layers', 'params'")


PARENT_INPUTS = ("position_embeddings", "attention_mask", "position_ids", "cache_position", "encoder_hidden_states")
"""Inputs a Hugging Face layer takes from its parent model's forward (rotary cos/sin, the causal
or padding mask, positions): a chain of modules, each run on the previous one's output, cannot
give them."""


def _check_chainable(model: nn.Module, name: str, module: nn.Module) -> None:
    """ValueError when ``module`` needs more than the previous module's output: an unrecognised
    model is split as a plain chain (kind "sequential"), and such a layer would fail at the first
    forward (no position embeddings) or, worse, run without its causal mask."""
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return
    needed = [p.name for p in parameters[1:] if p.name in PARENT_INPUTS]
    if needed:
        raise ValueError(
            f"split: {name!r} ({type(module).__name__}) takes {', '.join(needed)} from "
            f"{type(model).__name__}'s own forward, which a split of an unrecognised model cannot give (each "
            f"stage runs its modules on the previous one's output only): {type(model).__name__} cannot be cut into "
            f"pipeline stages; train it at parallel.pp=1 (ZeRO and tensor parallelism apply), or use a recognised "
            f"family ({', '.join(sorted(PIPELINE_DECODERS))}, gpt2, t5, bert, roberta)")


def uncovered(model: nn.Module, paths: list[str]) -> list[str]:
    """The names of model's parameters in none of the modules at these paths (a stage would
    neither train nor save them)."""
    covered = {id(p) for path in paths for p in model.get_submodule(path).parameters()}
    return [n for n, p in model.named_parameters() if id(p) not in covered]


def _explicit(model: nn.Module, family: Family | None, split: list[list[str]], num_stages: int) -> list[list[str]]:
    """Check a user's split (see the module docstring); returns each stage's paths, groups whole."""
    if len(split) != num_stages or any(not isinstance(s, (list, tuple)) or not s for s in split):
        raise ValueError(f"split: give {num_stages} non-empty lists of module names (one per stage, p*v of "
                         f"them), got {split!r}")
    names = dict(model.named_modules())
    for name in (n for s in split for n in s):
        if name not in names or not name:
            raise ValueError(f"split: {name!r} is not a module of {type(model).__name__}; its children: "
                             f"{_children(model)}")
    if family is None:
        flat = [n for s in split for n in s]
        if len(set(flat)) != len(flat):
            raise ValueError(f"split: a module is named twice: {flat}")
        for name in flat:
            _check_chainable(model, name, names[name])
        missing = uncovered(model, flat)
        if missing:
            raise ValueError(f"split: parameters in none of the named modules would not be trained: {missing[:8]}"
                             f"{' ...' if len(missing) > 8 else ''}")
        return [list(s) for s in split]
    L = len(family.blocks)
    units = _units(family)
    unit = {p: k for k, u in enumerate(units) for p in u}
    order, stage_units = [], []
    for s in split:
        got = []
        for name in s:
            if name not in unit:
                raise ValueError(f"split: {name!r} is not a unit of this {family.kind} model; units: "
                                 f"{family.embed} (embeddings), {family.blocks[0]} … {family.blocks[-1]}, "
                                 f"{family.head} (norm + head)")
            if not got or got[-1] != unit[name]:
                got.append(unit[name])
        stage_units.append(got)
        order += got
    if order != list(range(L + 2)):
        raise ValueError(f"split: the stages must cover embeddings, every block once and the head, in model order "
                         f"(a group may not span two stages); got {split!r}")
    return [[p for k in got for p in units[k]] for got in stage_units]


def _untie(model: nn.Module, first: list[str], last: list[str]) -> tuple[str, str] | None:
    """Give the last stage its own copy of a parameter it shares with the first stage; returns
    (first stage's name, last stage's name) or None. Other sharing across stages is refused."""
    def owned(paths):
        out = {}
        for path in paths:
            for n, p in model.get_submodule(path).named_parameters(prefix=path):
                out.setdefault(id(p), (n, p))
        return out
    a, b = owned(first), owned(last)
    shared = [k for k in b if k in a]
    if not shared:
        return None
    if len(shared) > 1:
        raise ValueError(f"split: the first and last stage share {len(shared)} parameters "
                         f"({[b[k][0] for k in shared]}); only one tied weight is supported")
    (first_name, tied), (last_name, _) = a[shared[0]], b[shared[0]]
    owner_path, attr = last_name.rsplit(".", 1)
    copy = nn.Parameter(tied.detach().clone(), requires_grad=tied.requires_grad)
    vars(copy).update(vars(tied))
    setattr(model.get_submodule(owner_path), attr, copy)
    return first_name, last_name


def _check_tensor_parallel(model: nn.Module, family: Family) -> None:
    """Refuse the tensor-parallel conversions these stages cannot run (see the module docstring)."""
    from ..parallel.tensor import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    parallel = (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)
    for name, m in model.named_modules():
        if not isinstance(m, parallel):
            continue
        if family.kind == "encoder":
            raise ValueError(f"{name}: the masked-LM encoders' pipeline stages (BERT, RoBERTa) do not take a "
                             f"tensor-parallel plan yet; split the model unconverted (tp=1)")
        if m.sequence_parallel:
            raise ValueError(f"{name} is sequence parallel: hf_split's stages do not support sequence parallelism "
                             f"(they run the whole sequence between the tensor-parallel blocks); convert the model "
                             f"with sequence_parallel=False")
        leaf = name.rsplit(".", 1)[-1]
        if family.kind == "t5" and leaf in ("q", "k", "v", "o"):
            raise ValueError(f"{name}: T5's attention is not split over tensor-parallel ranks by hf_split's stages "
                             f"(the relative position bias they carry between stages holds every head); give T5's "
                             f"tensor-parallel plan its MLPs (*.DenseReluDense.wi colwise, *.wo rowwise), its "
                             f"embedding (shared, *.embed_tokens: vocab) and lm_head (colwise) only")
        if family.kind == "rotary" and leaf in ("q_proj", "k_proj", "v_proj") and isinstance(m, ColumnParallelLinear):
            head_dim = model.get_submodule(name.rsplit(".", 1)[0]).head_dim
            if m.out_per_rank % head_dim:
                raise ValueError(f"{name}: {m.out_per_rank} output features per tensor-parallel rank is not a whole "
                                 f"number of heads of {head_dim}: the heads (and key/value heads) must divide by tp")
