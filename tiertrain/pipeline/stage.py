"""Cut a GPT into pipeline stages.

:func:`split_gpt` turns a :class:`~tiertrain.models.gpt.GPT` into ``num_stages = p·v``
:class:`GPTStage` modules, in model order. Stage ``s`` runs on pipeline rank ``s % p``
(:func:`stages_for_rank`). Every stage has the executor's stage interface::

    stage(x, batch) -> activation, or the mean loss on the last stage

where ``x`` is the activation received from the previous stage (``None`` on the first
stage, which reads ``batch["input_ids"]``) and the last stage reads ``batch["labels"]``.
Any model whose stages follow that interface can be pipelined.

Parameter names are those of the GPT: stage blocks sit in an ``nn.ModuleDict`` keyed by
their global index, so a stage's ``named_parameters()`` yields e.g.
``blocks.5.attn.qkv.weight``, and the union over stages is the GPT's parameter set (plus
``head.weight`` for a tied model, see below). The stages *share* the model's submodules
(no copy): build the full model on every rank, keep the stages of this rank, drop the rest.

Tied embeddings (the Megatron way)
----------------------------------
GPT-2 ties ``head.weight`` to ``embed.weight``; with ``num_stages > 1`` the embedding lives
on the first stage and the head on the last. As in Megatron-LM, the last stage gets its own
``head.weight`` parameter *initialised equal* to the embedding (the model's head is untied
in place, keeping its module, so a tensor-parallel head stays vocab-parallel), and after every backward
:func:`tied_weight_grad_sync` replaces both gradients by their sum (what the tied model's
single parameter receives), exchanged point-to-point between the first and last pipeline
rank. Identical gradients and identical optimizer steps keep the two copies equal, so the
run matches the tied single-process model. (ZeRO/data parallelism then treats the two
copies as ordinary, distinct parameters of their stages.)
"""
from __future__ import annotations

import datetime

import torch
import torch.distributed as dist
import torch.nn as nn

from ..comm import run_timeout
from ..models.gpt import GPT
from ..parallel.cp_plan import cp_attributes

__all__ = ["GPTStage", "split_gpt", "stage_boundaries", "stages_for_rank", "sum_tied_gradients", "tied_weight_grad_sync",
           "pipeline_grad_norm", "norm_parameters", "TIED_FIRST", "TIED_LAST"]

TIED_FIRST = "embed.weight"
"""Name of the tied weight on the first stage."""
TIED_LAST = "head.weight"
"""Name of its copy on the last stage."""


class GPTStage(nn.Module):
    """A contiguous slice of a GPT: [embeddings] + blocks + [final norm, head, loss]."""

    def __init__(self, model: GPT, index: int, num_stages: int, layers: list[int],
                 first: bool, last: bool, tied_copy: bool):
        super().__init__()
        self.config = model.config
        self.arch = type(model)
        """The model's class, whose embedding and head a stage runs (GPT, or TensorParallelGPT)."""
        self.tp_group = getattr(model, "tp_group", None)
        self.sequence_parallel = getattr(model, "sequence_parallel", False)
        # A context-parallel model's (cp_plan): its embed_tokens and head_output split the batch's
        # tokens and score this rank's share by these.
        for name, value in cp_attributes(model).items():
            setattr(self, name, value)
        self.index = index
        self.num_stages = num_stages
        self.layers = list(layers)
        """Global (0-based) indices of the blocks this stage holds."""
        self.is_first = first
        self.is_last = last
        self.tied = model.config.tie_embeddings and num_stages > 1 and (first or last)
        """True when this stage holds one side of a weight tied across stages."""
        if first:
            self.embed = model.embed
            self.pos_embed = model.pos_embed
            self.drop = model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.norm = model.norm
            if tied_copy:
                # The model's own head module (for a tensor-parallel model its vocab-parallel
                # head, with its group) gets a parameter of its own, a copy of the embedding:
                # the model is untied in place, and no random numbers are drawn, so the RNG
                # stream stays that of the unsplit model.
                # Attributes set on the parameter (tensor-parallel sharding marks) come along.
                tied = model.embed.weight
                model.head.weight = nn.Parameter(tied.detach().clone(), requires_grad=tied.requires_grad)
                vars(model.head.weight).update(vars(tied))
            self.head = model.head

    # The model class's embed_tokens / position_ids / head_output read only config, embed,
    # pos_embed, drop, norm, head (and tp_group, sequence_parallel, the cp_* attributes), which a stage carries
    # under the same names: reuse them so the maths is identical to the unsplit model's.
    def position_ids(self, t: int, device: torch.device) -> torch.Tensor:
        return self.arch.position_ids(self, t, device)

    def forward(self, x: torch.Tensor | None, batch: dict) -> torch.Tensor:
        if self.is_first:
            x = self.arch.embed_tokens(self, batch["input_ids"])
        for block in self.blocks.values():
            x = block(x)
        if self.is_last:
            return self.arch.head_output(self, x, batch["labels"])
        return x

    def extra_repr(self) -> str:
        parts = [f"stage {self.index}/{self.num_stages}", f"layers={self.layers}"]
        if self.is_first:
            parts.append("embeddings")
        if self.is_last:
            parts.append("norm+head+loss")
        if self.tied:
            parts.append("tied")
        return ", ".join(parts)


def _items(model: GPT) -> list[int]:
    """Parameter counts of the cuttable units: [embeddings, block 0 … block L-1, norm+head]."""
    n = lambda mod: sum(p.numel() for p in mod.parameters())  # noqa: E731
    emb = n(model.embed) + n(model.pos_embed)
    head = n(model.norm) + model.head.weight.numel()  # counted even when tied (the last stage's copy)
    return [emb] + [n(b) for b in model.blocks] + [head]


def _min_max_partition(weights: list[int], k: int) -> list[int]:
    """Cut ``weights`` into ``k`` non-empty contiguous groups with the smallest largest sum,
    then, among those, the smallest sum of squares. Returns the group sizes."""
    n = len(weights)
    prefix = [0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    INF = float("inf")
    # best_max[j][i]: smallest possible max over j groups covering the first i items
    best_max = [[INF] * (n + 1) for _ in range(k + 1)]
    best_max[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            best_max[j][i] = min(max(best_max[j - 1][a], prefix[i] - prefix[a]) for a in range(j - 1, i))
    cap = best_max[k][n]
    sq = [[INF] * (n + 1) for _ in range(k + 1)]
    back = [[-1] * (n + 1) for _ in range(k + 1)]
    sq[0][0] = 0
    for j in range(1, k + 1):
        for i in range(j, n + 1):
            for a in range(j - 1, i):
                w = prefix[i] - prefix[a]
                if w <= cap and sq[j - 1][a] + w * w < sq[j][i]:
                    sq[j][i], back[j][i] = sq[j - 1][a] + w * w, a
    sizes, i = [], n
    for j in range(k, 0, -1):
        a = back[j][i]
        sizes.append(i - a)
        i = a
    return sizes[::-1]


def stage_boundaries(model: GPT, num_stages: int, balance: str = "layers") -> list[list[int]]:
    """The block indices of each stage.

    ``balance="layers"``: blocks split as evenly as possible (the first ``L mod S`` stages get
    one extra); needs ``L >= S``. ``balance="params"``: the cut over the units [embeddings,
    block 0, …, block L-1, norm+head] whose largest stage parameter count is smallest (ties:
    most even); a stage may then hold only the embeddings or only the head."""
    L = model.config.n_layers
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
        raise ValueError(f"split_gpt: num_stages={num_stages!r} is invalid: must be a positive int")
    if balance == "layers":
        if num_stages > L:
            raise ValueError(f"split_gpt: num_stages={num_stages} is invalid with balance='layers': "
                             f"more stages than n_layers={L}")
        base, extra = divmod(L, num_stages)
        out, start = [], 0
        for s in range(num_stages):
            size = base + (1 if s < extra else 0)
            out.append(list(range(start, start + size)))
            start += size
        return out
    if balance == "params":
        if num_stages > L + 2:
            raise ValueError(f"split_gpt: num_stages={num_stages} is invalid with balance='params': "
                             f"more stages than n_layers + 2 = {L + 2} cuttable units")
        sizes = _min_max_partition(_items(model), num_stages)
        out, start = [], 0  # start: unit index; unit u >= 1 is block u-1
        for size in sizes:
            units = range(start, start + size)
            out.append([u - 1 for u in units if 1 <= u <= L])
            start += size
        return out
    raise ValueError(f"split_gpt: balance={balance!r} is invalid: valid values are 'layers', 'params'")


def split_gpt(model: GPT, num_stages: int, balance: str = "layers") -> list[GPTStage]:
    """Cut ``model`` into ``num_stages`` (= p·v) stages, in model order (see module doc).

    The first stage holds the embeddings, the last the final norm, head and loss. A tied
    model gets a separate ``head.weight`` on the last stage, initialised equal to the
    embedding: call :func:`tied_weight_grad_sync` after backward."""
    parts = stage_boundaries(model, num_stages, balance)
    tied_copy = model.config.tie_embeddings and num_stages > 1
    return [GPTStage(model, s, num_stages, layers, s == 0, s == num_stages - 1, tied_copy)
            for s, layers in enumerate(parts)]


def stages_for_rank(stages: list, p: int, rank: int) -> list:
    """The stages pipeline rank ``rank`` of ``p`` runs: ``rank, rank+p, …`` (Megatron interleaving)."""
    if len(stages) % p:
        raise ValueError(f"stages_for_rank: {len(stages)} stages do not divide over p={p} ranks")
    return list(stages[rank::p])


def _tied(stages, name: str, want_first: bool):
    for st in stages:
        if getattr(st, "tied", False) and (st.is_first if want_first else st.is_last):
            return dict(st.named_parameters())[name]
    return None


def tied_weight_grad_sync(stages: list, topology, timeout: float | None = None) -> None:
    """Make the gradients of the tied embedding (first stage) and its head copy (last stage)
    both equal to their sum, the gradient of the single tied weight (a missing gradient
    counts as zero). Call on every pipeline rank after the step's backward (the executor
    does it when told ``tied=True``); ranks holding neither side return at once."""
    first = _tied(stages, TIED_FIRST, True)
    last = _tied(stages, TIED_LAST, False)
    for p in (first, last):
        if p is not None and p.grad is None:
            p.grad = torch.zeros_like(p)
    sum_tied_gradients(first.grad if first is not None else None, last.grad if last is not None else None,
                       topology, timeout)


def sum_tied_gradients(first: torch.Tensor | None, last: torch.Tensor | None, topology,
                       timeout: float | None = None) -> None:
    """In place, ``first`` (the embedding's gradient, on the first pipeline rank) and ``last``
    (its head copy's, on the last) both become ``first + last``; pass None for a side this
    rank does not hold. The first and last pipeline ranks exchange their gradients with
    isend/irecv (no extra process group is needed) and add them; ``a + b == b + a`` in
    floating point, so both copies get bit-identical gradients. When one rank holds both
    sides (p = 1) they are summed locally."""
    if first is None and last is None:
        return
    if first is not None and last is not None:
        first.add_(last)
        last.copy_(first)
        return
    mine = first if first is not None else last
    pp_ranks = topology.ranks("pp")
    peer = pp_ranks[-1] if first is not None else pp_ranks[0]
    group = topology.group("pp")
    g = mine.contiguous()
    other = torch.empty_like(g)
    wait = datetime.timedelta(seconds=run_timeout() if timeout is None else timeout)
    send = dist.isend(g, dst=peer, group=group, tag=_TIED_TAG)
    recv = dist.irecv(other, src=peer, group=group, tag=_TIED_TAG)
    recv.wait(timeout=wait)
    send.wait(timeout=wait)
    mine.copy_(g + other if first is not None else other + g)


_TIED_TAG = 0x7E1ED


def norm_parameters(stages: list):
    """This rank's (name, parameter) pairs that count towards the model's gradient norm: all
    of them except the last stage's copy of a tied weight (its gradient, after
    :func:`tied_weight_grad_sync`, duplicates the embedding's)."""
    for st in stages:
        for name, p in st.named_parameters():
            if getattr(st, "tied", False) and st.is_last and not st.is_first and name == TIED_LAST:
                continue
            yield name, p


def pipeline_grad_norm(stages: list, topology) -> float:
    """The L2 norm of the whole model's gradient when this rank holds ``stages``: local sum of
    squares over :func:`norm_parameters` (in fp64), summed over the ``pp`` group, square root.
    Equals ``clip_grad_norm_``'s total norm on the unsplit model. With data parallelism the dp
    replicas agree after the gradient all-reduce; with ZeRO partitions sum each rank's
    partition over dp as well (and over tp for tensor-sharded parameters, counting replicated
    ones once) before the square root."""
    sq = torch.zeros((), dtype=torch.float64)
    for _, p in norm_parameters(stages):
        if p.grad is not None:
            sq += p.grad.detach().double().pow(2).sum().cpu()
    group = topology.group("pp")
    if group is not None and topology.size("pp") > 1:
        dev = next((p.device for st in stages for p in st.parameters()), torch.device("cpu"))
        t = sq.reshape(1).to(dev)
        dist.all_reduce(t, group=group)
        sq = t.cpu().reshape(())
    return float(sq.sqrt())


def _grad(p: torch.Tensor) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)
