"""Tensor and sequence parallelism compute exactly what the unsplit model computes.

Each specification runs the tensor-parallel code on 2 (or 4) gloo ranks and compares it with
the same math done by plain PyTorch in one process: the f/g and sequence-parallel operators
(forward and backward), the column/row-parallel linear pair, the vocab-parallel embedding
and cross-entropy, and the reference GPT under ``apply_tensor_parallel`` (loss, every
gathered gradient, the gradient norm, a few optimizer steps).

Bounds (fp32), none of them a library default: copies, gathers and splits must be exact;
sums over the ranks lie within the rounding bound γ_world·Σ|terms| of the exact sum; the
split matmuls add their partial sums in a different order than one matmul does, so layers,
the GPT's loss, gradients, norm and logits, and training trajectories are bounded by the
float64 oracle of tests/reference.py (2 × the fp32 reference's distance to a float64 run of
the same math, plus 4 ulps). Assertions run inside the ranks, so a failure reports the rank's
traceback.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from reference import TINY, Oracle, assert_within_rounding, check_tensors, global_batches, max_rel_diff
from tiertrain.config import ParallelConfig
from tiertrain.models.gpt import GPT, GPTConfig
from tiertrain.parallel import (
    ColumnParallelLinear,
    CopyToTensorParallel,
    GatherFromSequenceParallel,
    GatherFromTensorParallel,
    ReduceFromTensorParallel,
    ReduceScatterToSequenceParallel,
    RowParallelLinear,
    ScatterToSequenceParallel,
    ScatterToTensorParallel,
    TensorParallelGPT,
    VocabParallelEmbedding,
    apply_tensor_parallel,
    gather_tensor_parallel,
    parallelize_module,
    tensor_parallel_grad_norm,
    tensor_parallel_grad_sync,
    vocab_parallel_cross_entropy,
)
from tiertrain.parallel.tensor import gather_tensor
from tiertrain.testing import run_distributed
from tiertrain.topology import Topology

def _exact(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=0, atol=0, msg=lambda m: f"{what}: {m}")


def _sum_of(actual, terms, what):
    """actual is the sum of terms, in some order: within γ_n·Σ|terms| of the exact sum."""
    stacked = torch.stack(terms).double()
    assert_within_rounding(actual, stacked.sum(0), stacked.abs().sum(0), len(terms), what)


def _rand(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _chunk(t, dim, rank, world):
    return t.chunk(world, dim=dim)[rank]


# --------------------------------------------------------------------------- operators and layers


def _operators(rank, world, group):
    # f: identity forward; backward sums every rank's gradient.
    x = _rand(0, 2, 4, 6).requires_grad_()
    y = CopyToTensorParallel.apply(x, group)
    _exact(y, x, "f forward")
    (y * _rand(10 + rank, 2, 4, 6)).sum().backward()
    _sum_of(x.grad, [_rand(10 + r, 2, 4, 6) for r in range(world)], "f backward")

    # g: all-reduce forward; identity backward.
    x = _rand(20 + rank, 2, 4, 6).requires_grad_()
    y = ReduceFromTensorParallel.apply(x, group)
    _sum_of(y, [_rand(20 + r, 2, 4, 6) for r in range(world)], "g forward")
    y.backward(_rand(30, 2, 4, 6))
    _exact(x.grad, _rand(30, 2, 4, 6), "g backward")

    seq = 4 * world
    full = _rand(40, 2, seq, 6)
    ups = [_rand(50 + r, 2, seq, 6) for r in range(world)]
    # All-gather along the sequence; backward reduce-scatter (or split).
    for reduce in (True, False):
        x = _chunk(full, 1, rank, world).clone().requires_grad_()
        y = GatherFromSequenceParallel.apply(x, group, 1, reduce)
        _exact(y, full, "sequence all-gather forward")
        y.backward(ups[rank])
        if reduce:
            _sum_of(x.grad, [_chunk(u, 1, rank, world) for u in ups], "sequence all-gather backward (reduce)")
        else:
            _exact(x.grad, _chunk(ups[rank], 1, rank, world), "sequence all-gather backward (split)")
    # Split along the sequence; backward all-gather.
    x = full.clone().requires_grad_()
    y = ScatterToSequenceParallel.apply(x, group, 1)
    _exact(y, _chunk(full, 1, rank, world), "sequence scatter forward")
    y.backward(_chunk(ups[0], 1, rank, world))
    _exact(x.grad, ups[0], "sequence scatter backward")
    # Reduce-scatter along the sequence; backward all-gather.
    x = ups[rank].clone().requires_grad_()
    y = ReduceScatterToSequenceParallel.apply(x, group, 1)
    _sum_of(y, [_chunk(u, 1, rank, world) for u in ups], "sequence reduce-scatter forward")
    y.backward(_chunk(full, 1, rank, world))
    _exact(x.grad, full, "sequence reduce-scatter backward")
    # Along the hidden dimension: gather (backward split) and scatter (backward gather).
    hid = _rand(60, 2, 3, 2 * world)
    x = _chunk(hid, -1, rank, world).clone().requires_grad_()
    y = GatherFromTensorParallel.apply(x, group)
    _exact(y, hid, "hidden all-gather forward")
    y.backward(_rand(61, 2, 3, 2 * world))
    _exact(x.grad, _chunk(_rand(61, 2, 3, 2 * world), -1, rank, world), "hidden all-gather backward")
    x = hid.clone().requires_grad_()
    y = ScatterToTensorParallel.apply(x, group)
    _exact(y, _chunk(hid, -1, rank, world), "hidden scatter forward")
    y.backward(_chunk(_rand(62, 2, 3, 2 * world), -1, rank, world))
    _exact(x.grad, _rand(62, 2, 3, 2 * world), "hidden scatter backward")


def _linear_pair(rank, world, group, bias, sequence_parallel, gather_between):
    """fc2(gelu(fc1(x))) with fc1 column- and fc2 row-parallel equals the nn.Linear pair."""
    torch.manual_seed(1)
    fc1, fc2 = nn.Linear(8, 4 * world, bias=bias), nn.Linear(4 * world, 8, bias=bias)
    if bias:  # nn.Linear's biases are uniform; make them count
        nn.init.normal_(fc1.bias), nn.init.normal_(fc2.bias)
    x_full, r_full = _rand(2, 3, 2 * world, 8), _rand(3, 3, 2 * world, 8)
    local = (lambda t: _chunk(t, 1, rank, world)) if sequence_parallel else (lambda t: t)

    def reference(dtype):
        """The unsplit pair in dtype; what this rank's results must equal."""
        f1, f2 = copy.deepcopy(fc1).to(dtype), copy.deepcopy(fc2).to(dtype)
        x_ref = x_full.to(dtype).clone().requires_grad_()
        y_ref = f2(F.gelu(f1(x_ref)))
        (y_ref * r_full.to(dtype)).sum().backward()
        # sequence parallel: each rank held a chunk of the input, so its grad is that chunk's
        out = {"output": local(y_ref.detach()), "input grad": local(x_ref.grad),
               "fc1 weight grad": f1.weight.grad, "fc2 weight grad": f2.weight.grad}
        if bias:
            out.update({"fc1 bias grad": f1.bias.grad, "fc2 bias grad": f2.bias.grad})
        return out

    col = ColumnParallelLinear.from_linear(fc1, group, gather_output=gather_between,
                                           sequence_parallel=sequence_parallel)
    row = RowParallelLinear.from_linear(fc2, group, input_is_parallel=not gather_between,
                                        sequence_parallel=sequence_parallel)
    x = local(x_full).clone().requires_grad_()
    y = row(F.gelu(col(x)))
    what = f"linear pair (bias={bias}, sp={sequence_parallel}, gather={gather_between})"
    (y * local(r_full)).sum().backward()
    if sequence_parallel and bias:
        tensor_parallel_grad_sync([row.bias], group)
    mine = {"output": y.detach(), "input grad": x.grad,
            "fc1 weight grad": gather_tensor(col.weight.grad, 0, group),
            "fc2 weight grad": gather_tensor(row.weight.grad, 1, group)}
    if bias:
        mine.update({"fc1 bias grad": gather_tensor(col.bias.grad, 0, group), "fc2 bias grad": row.bias.grad})
        assert getattr(row.bias, "tp_partial_grad", False) == sequence_parallel
    check_tensors(mine, reference(torch.float32), reference(torch.float64), what)


def _constructors(rank, world, group):
    """The plain constructors draw the full weight like nn.Linear/nn.Embedding and keep a slice."""
    for cls, dim in ((ColumnParallelLinear, 0), (RowParallelLinear, 1)):
        torch.manual_seed(5)
        full = nn.Linear(8, 4 * world)
        torch.manual_seed(5)
        mine = cls(8, 4 * world, True, group)
        _exact(gather_tensor(mine.weight, dim, group), full.weight, f"{cls.__name__} init weight")
        bias = gather_tensor(mine.bias, 0, group) if dim == 0 else mine.bias
        _exact(bias, full.bias, f"{cls.__name__} init bias")
    torch.manual_seed(6)
    full = nn.Embedding(4 * world, 8)
    torch.manual_seed(6)
    mine = VocabParallelEmbedding(4 * world, 8, group)
    _exact(gather_tensor(mine.weight, 0, group), full.weight, "VocabParallelEmbedding init")


def _embedding(rank, world, group, sequence_parallel):
    torch.manual_seed(7)
    full = nn.Embedding(16 * world, 8)
    ids = torch.randint(0, 16 * world, (3, 2 * world), generator=torch.Generator().manual_seed(8))
    up = _rand(9, 3, 2 * world, 8)
    refs = {}
    for dtype in (torch.float32, torch.float64):
        ref = copy.deepcopy(full).to(dtype)
        out_ref = ref(ids)
        (out_ref * up.to(dtype)).sum().backward()
        refs[dtype] = (out_ref.detach(), ref.weight.grad)
    emb = VocabParallelEmbedding.from_embedding(full, group, sequence_parallel=sequence_parallel)
    out = emb(ids)
    local = (lambda t: _chunk(t, 1, rank, world)) if sequence_parallel else (lambda t: t)
    _exact(out, local(refs[torch.float32][0]), f"vocab embedding forward (sp={sequence_parallel})")
    (out * local(up)).sum().backward()
    grads = {dtype: {"weight grad": g} for dtype, (_, g) in refs.items()}
    check_tensors({"weight grad": gather_tensor(emb.weight.grad, 0, group)}, grads[torch.float32],
                  grads[torch.float64], f"vocab embedding grad (sp={sequence_parallel})")


def _cross_entropy(rank, world, group):
    vocab = 16 * world
    g = torch.Generator().manual_seed(11)
    for shape, scale, ignored in (((24,), 1.0, 0), ((3, 8), 1.0, 5), ((24,), 300.0, 7)):
        logits_full = torch.randn(*shape, vocab, generator=g) * scale
        labels = torch.randint(0, vocab, shape, generator=g)
        labels.view(-1)[torch.randperm(labels.numel(), generator=g)[:ignored]] = -100
        refs = []
        for dtype in (torch.float32, torch.float64):
            logits = logits_full.to(dtype).clone().requires_grad_()
            ref = F.cross_entropy(logits.reshape(-1, vocab), labels.reshape(-1))
            (3.0 * ref).backward()
            refs.append({"loss": ref.detach(), "grad": _chunk(logits.grad, -1, rank, world)})
        shard = _chunk(logits_full, -1, rank, world).clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(shard, labels, group)
        what = f"vocab-parallel CE {shape} x{scale} ignored={ignored}"
        (3.0 * loss).backward()
        check_tensors({"loss": loss.detach(), "grad": shard.grad}, *refs, what)
        if ignored:
            assert shard.grad.reshape(-1, vocab // world)[labels.reshape(-1) == -100].abs().max() == 0


def _layers(rank, world):
    group = Topology.build(ParallelConfig(tp=world)).group("tp")
    _operators(rank, world, group)
    for bias in (True, False):
        for sp in (False, True):
            _linear_pair(rank, world, group, bias, sp, gather_between=False)
    _linear_pair(rank, world, group, True, False, gather_between=True)
    _constructors(rank, world, group)
    _embedding(rank, world, group, False)
    _embedding(rank, world, group, True)
    _cross_entropy(rank, world, group)
    return True


@pytest.mark.timeout(40)
@pytest.mark.parametrize("tp", [2, 4])
def test_operators_and_layers_match_single_process_math(tp):
    assert run_distributed(_layers, tp, timeout=35) == [True] * tp


# --------------------------------------------------------------------------- the GPT


def _gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def _batch(seed=3, batch=2, seq=16, n_ignored=5):
    b = global_batches(1, batch, seq, seed=seed)[0]
    b["labels"].view(-1)[torch.randperm(batch * seq, generator=torch.Generator().manual_seed(seed))[:n_ignored]] = -100
    return b


def _gpt_one_step(rank, world, variants, tp=None):
    tp = tp or world
    topology = Topology.build(ParallelConfig(tp=tp))
    out = []
    for sp, tied, bias in variants:
        what = f"GPT sp={sp} tied={tied} bias={bias}"
        ref = _gpt(tie_embeddings=tied, bias=bias)
        if bias:  # zero-initialised biases would hide a bias bug: draw them
            gen = torch.Generator().manual_seed(123)
            with torch.no_grad():
                for n, p in ref.named_parameters():
                    if n.endswith("bias") and ".ln" not in n and not n.startswith("norm"):
                        p.normal_(0, 0.02, generator=gen)
        model = apply_tensor_parallel(copy.deepcopy(ref), topology, sequence_parallel=sp)
        assert isinstance(model, TensorParallelGPT)
        assert (model.head.weight is model.embed.weight) == tied, what
        start = gather_tensor_parallel(model, topology)
        assert max_rel_diff(start, dict(ref.named_parameters())) == 0, f"{what}: not the tp=1 weights"

        batch = _batch()
        expected = {}  # dtype: the unsplit model's loss, gradients, gradient norm and logits
        for dtype in (torch.float32, torch.float64):
            dense = ref if dtype == torch.float32 else copy.deepcopy(ref).to(dtype)
            dense_loss = dense(**batch)
            dense_loss.backward()
            with torch.no_grad():
                logits = dense(batch["input_ids"])
            expected[dtype] = {"loss": dense_loss.detach(), "logits": logits,
                               "grad norm": torch.nn.utils.get_total_norm([p.grad for p in dense.parameters()]),
                               **{f"grad {n}": p.grad for n, p in dense.named_parameters()}}
        loss = model(**batch)
        loss.backward()
        tensor_parallel_grad_sync(model, topology)
        grads = gather_tensor_parallel(model, topology, grads=True)
        assert grads.keys() == dict(ref.named_parameters()).keys(), what
        with torch.no_grad():
            logits = model(batch["input_ids"])
        mine = {"loss": loss.detach(), "logits": logits, "grad norm": tensor_parallel_grad_norm(model, topology),
                **{f"grad {n}": g for n, g in grads.items()}}
        check_tensors(mine, expected[torch.float32], expected[torch.float64], what)
        err = max_rel_diff(mine, expected[torch.float64])
        # Replicated parameters must have equal gradients on every tp rank (after the sync).
        for n, p in model.named_parameters():
            if not getattr(p, "tp_sharded", False):
                mine = p.grad.detach().clone()
                theirs = [torch.empty_like(mine) for _ in range(tp)]
                dist.all_gather(theirs, mine, group=topology.group("tp"))
                assert all(torch.equal(t, mine) for t in theirs), f"{what}: {n} grad differs across tp ranks"
        out.append(err)
    return out


VARIANTS = [(sp, tied, bias) for sp in (False, True) for tied in (True, False) for bias in (True, False)]


@pytest.mark.timeout(40)
def test_gpt_loss_and_gradients_match_tp1():
    errs = run_distributed(_gpt_one_step, 2, VARIANTS, timeout=35)
    assert len(errs[0]) == len(VARIANTS)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tp", [4, 2])
def test_gpt_on_four_ranks_matches_tp1(tp):
    """tp=4, and tp=2 × dp=2 (the tp group is then a sub-group of the world)."""
    run_distributed(_gpt_one_step, 4, [(True, True, True), (False, False, True)], tp, timeout=25)


def _train(model, batches, opt_name, topology=None):
    params = list(model.parameters())
    opt = (torch.optim.SGD(params, lr=0.5) if opt_name == "sgd"
           else torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1))
    losses = []
    for batch in batches:
        loss = model(**batch)
        loss.backward()
        if topology is None:
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        else:
            tensor_parallel_grad_sync(model, topology)
            norm = tensor_parallel_grad_norm(model, topology)
            for p in params:  # clip_grad_norm_ with the global norm: same coefficient as torch's
                p.grad.mul_(torch.clamp(1.0 / (norm + 1e-6), max=1.0))
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _gpt_training(rank, world):
    topology = Topology.build(ParallelConfig(tp=world))
    batches = global_batches(4, 4)
    for opt_name in ("sgd", "adamw"):
        for sp in (False, True):
            what = f"{opt_name} sp={sp}"
            ref = _gpt()
            model = apply_tensor_parallel(copy.deepcopy(ref), topology, sequence_parallel=sp)
            ref64 = copy.deepcopy(ref).double()
            oracle = Oracle(_train(ref, batches, opt_name), dict(ref.named_parameters()),
                            _train(ref64, batches, opt_name), dict(ref64.named_parameters()))
            assert oracle.losses64[-1] < oracle.losses64[0], f"{what}: the reference must learn"
            losses = _train(model, batches, opt_name, topology)
            oracle.check(losses, gather_tensor_parallel(model, topology), what)
    return True


@pytest.mark.timeout(40)
def test_training_steps_track_tp1():
    assert run_distributed(_gpt_training, 2, timeout=35) == [True, True]


# --------------------------------------------------------------------------- plans and errors


def test_single_process_plan_is_the_identity():
    """group=None (tp=1): the converted GPT computes bit-for-bit what the original does."""
    ref = _gpt(bias=True)
    model = apply_tensor_parallel(copy.deepcopy(ref), Topology.build(), sequence_parallel=True)
    batch = _batch()
    assert torch.equal(model(**batch), ref(**batch))
    assert torch.equal(model(batch["input_ids"]), ref(batch["input_ids"]))
    assert type(copy.deepcopy(model)) is TensorParallelGPT
    with pytest.raises(TypeError, match="already tensor-parallel"):
        apply_tensor_parallel(model, None)
    with pytest.raises(TypeError, match="not constructed directly"):
        TensorParallelGPT(GPTConfig(**TINY))


def test_plan_errors_name_the_problem():
    model = _gpt()
    with pytest.raises(ValueError, match="matches no module"):
        parallelize_module(copy.deepcopy(model), None, {"blocks.*.nope": "colwise"})
    with pytest.raises(ValueError, match="unknown"):
        parallelize_module(copy.deepcopy(model), None, {"head": "diagonal"})
    with pytest.raises(TypeError, match="needs an Linear"):
        parallelize_module(copy.deepcopy(model), None, {"norm": "colwise"})
    with pytest.raises(ValueError, match="head.weight is tied"):  # tied head left out of the plan
        parallelize_module(copy.deepcopy(model), None, {"embed": "vocab"})
    with pytest.raises(ValueError, match="tied to a parameter sharded along dim 0"):
        parallelize_module(copy.deepcopy(model), None, {"embed": "vocab", "head": "rowwise"})


def _indivisible(rank, world):
    topology = Topology.build(ParallelConfig(tp=world))
    with pytest.raises(ValueError, match="n_heads=2 is not divisible"):
        apply_tensor_parallel(_gpt(n_heads=2, hidden=32), topology)
    model = apply_tensor_parallel(_gpt(), topology, sequence_parallel=True)
    with pytest.raises(ValueError, match="divisible by the tensor-parallel size"):
        model(torch.zeros(1, 6, dtype=torch.long))
    return True


@pytest.mark.timeout(30)
def test_indivisible_shapes_are_refused():
    assert run_distributed(_indivisible, 4, timeout=25) == [True] * 4


class _Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm, self.up, self.down, self.out = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8), nn.Linear(8, 4)

    def forward(self, x):
        return self.out(self.down(F.gelu(self.up(self.norm(x)))))


def test_plan_for_another_model():
    """A plan for any module tree: styles by glob, a callable style, params marked for the engine."""
    torch.manual_seed(0)
    ref = _Tiny()
    seen = []

    def custom(module, group, sequence_parallel):
        seen.append((type(module).__name__, group, sequence_parallel))
        return copy.deepcopy(module)

    plan = {"norm": "sequence", "up": "colwise", "dow?": "rowwise", "out": custom}
    model = parallelize_module(copy.deepcopy(ref), None, plan, sequence_parallel=True)
    assert isinstance(model.up, ColumnParallelLinear) and isinstance(model.down, RowParallelLinear)
    assert seen == [("Linear", None, True)]
    assert model.up.weight.tp_sharded and model.up.weight.tp_shard_dim == 0
    assert model.down.weight.tp_sharded and model.down.weight.tp_shard_dim == 1
    assert model.norm.weight.tp_partial_grad and model.down.bias.tp_partial_grad
    assert not getattr(model.out.weight, "tp_sharded", False)
    x = _rand(0, 2, 4, 8)
    assert torch.equal(model(x), ref(x))
