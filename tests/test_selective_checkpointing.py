"""Selective activation checkpointing (``activations.recompute = "selective"``,
docs/concepts.md#selective-activation-checkpointing).

Specifications:
1. It changes no number: losses and gradients equal the unmodified model bit for bit, for
   tiertrain's GPT (every k, both tiers, with dropout) and for Hugging Face families
   (tests/zoo.py: decoders with GQA, tied heads, a sliding window; encoder; encoder-decoder;
   MoE; LoRA). (Composition with ZeRO stages 2 and 3, prefetch and nested stage-3 units:
   tests/test_activation_checkpointing.py's engine cases, which include selective ones; tensor and
   pipeline parallelism here.)
2. It is worth it: backward recomputes no matrix multiplication or attention (its FLOPs equal
   those of the model without checkpointing; full-block recomputation's exceed them by the
   checkpointed blocks' forward), for the bytes the estimator predicts: the kept outputs of
   every checkpointed block, exactly, for the GPT and each modelled Hugging Face family, in
   fp32 and bf16; all released after backward.
3. Bad input and a block that cannot be recomputed selectively are errors naming the cause.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.flop_counter import FlopCounterMode

from reference import global_batches, make_model
from tiertrain.config import ActivationConfig, Config, ConfigError, load
from tiertrain.engine import default_loss
from tiertrain.estimate import ZeroLayout, estimate
from tiertrain.estimate.dims import ModelDims
from tiertrain.estimate.activations import gpt_activation_bytes
from tiertrain.offload.activations import apply_activation_checkpointing, checkpoint_memory, checkpointing_of

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _checkpointed(model, k=1, offload="none", recompute="selective"):
    apply_activation_checkpointing(model, ActivationConfig(checkpoint_every=k, offload=offload, recompute=recompute))
    return model


def _loss_and_grads(model, batch, loss_fn=default_loss, seed=5):
    torch.manual_seed(seed)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(a, b):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    assert torch.equal(loss_a, loss_b)
    assert grads_a.keys() == grads_b.keys()
    for n in grads_a:
        assert torch.equal(grads_a[n], grads_b[n]), n


# --------------------------------------------------------------------------- 1. numerics


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("k,offload", [(1, "none"), (2, "cpu"), (1, "cpu")])
def test_gpt_losses_and_gradients_equal_the_unmodified_model(k, offload, dropout):
    batch = global_batches(1, 4)[0]
    reference = _loss_and_grads(make_model(dropout=dropout), batch)
    model = _checkpointed(make_model(dropout=dropout), k, offload)
    _assert_same(_loss_and_grads(model, batch), reference)
    assert checkpoint_memory(model).recomputations == len(checkpointing_of(model).checkpointed)


transformers = pytest.importorskip("transformers")

import zoo  # noqa: E402
from test_estimate_hf import CONFIGS as MODELLED, V, _real  # noqa: E402  (the estimator's tiny families)


def _hf_model(name, dtype=torch.float32):
    return _real(MODELLED[name]).to(dtype).train()  # (dropout on where the config has it)


def _hf_batch(b=3, s=40):
    g = torch.Generator().manual_seed(0)
    return {"input_ids": torch.randint(0, V, (b, s), generator=g), "labels": torch.randint(0, V, (b, s), generator=g)}


def _hf_loss(model, batch):
    return model(**batch).loss


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(zoo.MODELS))
def test_hugging_face_families_equal_the_unmodified_model(name):
    """Within the float64 oracle's bound of the unmodified model (bit-equal on an AVX-512 Xeon;
    on an AVX2 EPYC, T5's and Switch's gradients differ in their last bits, also under
    ATEN_CPU_CAPABILITY=default: in the BLAS, whose rounding the recomputed inputs change)."""
    from reference import check_tensors

    batch = zoo.batches(name, 1, 4)[0]

    def loss_and_grads(model):
        loss, grads = _loss_and_grads(model, batch, _hf_loss)
        return {"loss": loss.reshape(1), **grads}
    reference = loss_and_grads(zoo.build(name))
    exact = loss_and_grads(zoo.build(name).double())
    model = _checkpointed(zoo.build(name))
    actual = loss_and_grads(model)
    assert actual.keys() == reference.keys()
    check_tensors(actual, reference, exact, f"{name}, selective recomputation")
    assert checkpoint_memory(model).recomputations == len(checkpointing_of(model).checkpointed) > 0


def test_a_hugging_face_model_trains_without_its_cache_while_checkpointed():
    """A KV cache written in forward would be found changed by the recomputation (Hugging
    Face's own gradient checkpointing turns it off too): a training forward runs with every
    config's use_cache off (an encoder-decoder's decoder stack holds its own), even when the
    caller asks for the cache; evaluation and the config itself are left as they were."""
    model = _hf_model("t5")
    configs = list({id(m.config): m.config for m in model.modules() if getattr(m, "config", None) is not None}.values())
    before = [c.use_cache for c in configs]
    assert before.count(True) >= 2  # the model's and the decoder stack's
    handle = apply_activation_checkpointing(model, ActivationConfig(checkpoint_every=1, recompute="selective"))
    batch = _hf_batch(b=2, s=8)
    out = model(**batch, use_cache=True)
    assert out.past_key_values is None and [c.use_cache for c in configs] == before
    out.loss.backward()
    with torch.no_grad():
        assert model(**batch).past_key_values is not None
    handle.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks


PARALLEL = {  # name -> (parallel section, tensor-parallel preparation)
    "tp=2": ({"tp": 2}, False), "tp=2 sequence parallel": ({"tp": 2}, True), "pp=2 1f1b": ({"pp": 2}, None),
}


def _parallel_runs(rank, world):
    """Each layout trained twice on this rank, without and with selective recomputation."""
    from reference import engine_train, make_config
    from tiertrain.parallel import apply_tensor_parallel

    out = {}
    for name, (parallel, sequence_parallel) in PARALLEL.items():
        prepare = None if sequence_parallel is None else (
            lambda m, topo, sp=sequence_parallel: apply_tensor_parallel(m, topo, sequence_parallel=sp))
        for activations in ({}, {"checkpoint_every": 1, "recompute": "selective"}):
            cfg = make_config(zero={"stage": 1}, parallel={"dp": 1, **parallel}, activations=activations,
                              batch={"micro_batch_size": 2, "grad_accum_steps": 2}, optimizer={"eps": 1e-3})
            losses, params, engine = engine_train(rank, world, make_model(n_layers=4), cfg, global_batches(2, 4),
                                                  prepare=prepare)
            out[name, bool(activations)] = (losses, params, engine.memory_report().activation_checkpoints)
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tensor_and_pipeline_parallel_runs_are_unchanged():
    """Megatron's tensor parallelism (its collectives inside the block are recomputed, the
    linears' local outputs kept) and a 1F1B pipeline (each stage checkpoints its own blocks)
    train bit for bit as without checkpointing."""
    from tiertrain.testing import run_distributed

    for by_rank in run_distributed(_parallel_runs, 2, timeout=110):
        for name in PARALLEL:
            (losses, params, held), (plain_losses, plain_params, _) = by_rank[name, True], by_rank[name, False]
            assert held > 0, name  # (block inputs and kept outputs: the blocks were checkpointed)
            assert losses == plain_losses, name
            assert params.keys() == plain_params.keys()
            assert all(torch.equal(params[n], plain_params[n]) for n in params), name


# --------------------------------------------------------------------------- 2. what it saves


def _backward_flops(model, batch, loss_fn=default_loss):
    loss = loss_fn(model, batch)
    kept = checkpoint_memory(model)
    with FlopCounterMode(display=False) as counter:
        loss.backward()
    return counter.get_total_flops(), kept


@pytest.mark.timeout(30)
def test_backward_recomputes_no_matmul_and_holds_what_the_estimator_predicts():
    batch = global_batches(1, 4)[0]  # 4 sequences of make_model()'s seq_len
    plain, _ = _backward_flops(make_model(), batch)
    block, block_mem = _backward_flops(_checkpointed(make_model(), recompute="block"), batch)
    model = _checkpointed(make_model())
    selective, mem = _backward_flops(model, batch)
    assert selective == plain < block
    acts = gpt_activation_bytes(ModelDims.from_gpt_config(model.config), 4, 4)
    n_blocks = len(model.blocks)
    assert mem.saved_op_bytes == n_blocks * acts.kept_at(0)
    assert mem.bytes == n_blocks * (acts.checkpoint + acts.kept_at(0)) == block_mem.bytes + mem.saved_op_bytes
    after = checkpoint_memory(model)
    assert after.bytes == after.saved_op_bytes == 0 and after.peak_bytes == mem.bytes


@pytest.mark.timeout(60)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("name", sorted(MODELLED))
def test_kept_outputs_of_hugging_face_blocks_are_the_estimators(name, dtype):
    from tiertrain.estimate.modules import dims_of_module

    model = _hf_model(name, dtype)
    batch = _hf_batch(b=3, s=40)
    acts = dims_of_module(model, seq_len=40).activation_bytes(3, 2 if dtype == torch.bfloat16 else 4)
    _checkpointed(model)
    loss = _hf_loss(model, batch)
    assert checkpoint_memory(model).saved_op_bytes == sum(acts.kept)
    loss.backward()
    assert checkpoint_memory(model).saved_op_bytes == 0


@pytest.mark.timeout(30)
def test_the_estimate_counts_the_kept_outputs_on_the_device():
    dims = ModelDims.from_gpt_config(make_model().config)
    base = dict(checkpoint_interval=1, checkpoint_tier="cpu", micro_batch=4, precision="fp32")
    block = estimate(dims, ZeroLayout(**base))
    selective = estimate(dims, ZeroLayout(**base, recompute="selective"))
    kept = selective.line("activations kept by selective recompute")
    assert kept.tier.value == "device"
    assert kept.bytes > 0 and selective.total() > block.total()
    assert selective.line("activation checkpoints").bytes == block.line("activation checkpoints").bytes
    # with tensor parallelism (the papers' per-layer lines): the kept outputs are split like the linears
    kept_per_block = gpt_activation_bytes(dims, 4, 4).kept_at(0)
    split = estimate(dims, ZeroLayout(**base, tp=2, recompute="selective"))
    assert split.line("activations kept by selective recompute").bytes == dims.n_layers * kept_per_block // 2
    with pytest.raises(ValueError, match=r"recompute='selective' is invalid with checkpoint_interval=0"):
        ZeroLayout(recompute="selective").validate()
    with pytest.raises(ValueError, match=r"recompute='tile' is invalid: must be 'block' or 'selective'"):
        ZeroLayout(checkpoint_interval=1, recompute="tile").validate()


def test_tiertrain_estimate_takes_the_choice(capsys):
    import json

    from tiertrain import cli

    args = ["estimate", "--preset", "small", "--ci", "1", "--micro-batch", "4", "--json"]
    assert cli.main(args + ["--recompute", "selective"]) == 0
    lines = {line["name"]: line for line in json.loads(capsys.readouterr().out)["lines"]}
    assert lines["activations kept by selective recompute"]["bytes"] > 0
    assert cli.main(args) == 0
    assert "activations kept by selective recompute" not in capsys.readouterr().out
    assert cli.main(["estimate", "--preset", "small", "--recompute", "selective"]) == 2
    assert "recompute='selective' is invalid with checkpoint_interval=0" in capsys.readouterr().err


# --------------------------------------------------------------------------- 3. errors


def test_bad_configuration_is_named():
    with pytest.raises(ConfigError, match=r"activations\.recompute='ops' is invalid: expected one of 'block', "
                                          r"'selective'"):
        load(Config, None, ["--activations.checkpoint_every=1", "--activations.recompute=ops"])
    with pytest.raises(ConfigError, match=r"activations\.recompute='selective' is invalid: expected 'block' while "
                                          r"activations\.checkpoint_every=0"):
        load(Config, None, ["--activations.recompute=selective"])
    assert load(Config, None, ["--activations.checkpoint_every=2",
                               "--activations.recompute=selective"]).activations.recompute == "selective"
    with pytest.raises(ConfigError, match=r"activations\.recompute='all' is invalid: expected 'block' or 'selective'"):
        _checkpointed(make_model(), recompute="all")


class _CountingBlock(nn.Module):
    """A block whose forward depends on how often it ran: not a function of its inputs."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        y = self.linear(x)
        return y.relu() if self.calls % 2 else y.sigmoid()


@pytest.mark.timeout(30)
def test_a_block_that_recomputes_other_ops_is_named():
    model = nn.Sequential()
    model.blocks = nn.ModuleList([_CountingBlock(), _CountingBlock()])
    _checkpointed(model)
    x = torch.randn(4, 8, requires_grad=True)
    y = model.blocks[1](model.blocks[0](x))
    with pytest.raises(RuntimeError, match=r"selective recomputation of block 'blocks\.1' failed.*"
                                           r"depend on its inputs only.*recompute=block"):
        y.sum().backward()
