"""Activation checkpointing (ZeRO-R P_a / P_a+cpu, ZeRO-Infinity §3:
docs/concepts.md#zero-r-residual-memory, docs/concepts.md#transformer-memory).

Specifications:
1. Recomputing every k-th block changes no number: losses and gradients equal the
   unmodified model bit for bit, with dropout too (the recomputation redraws the same masks),
   whether the checkpoints stay on the device or go to the CPU tier.
2. It is worth it: the bytes saved for backward fall, the checkpoints are exactly the block
   inputs (2·bsz·seq·hd·nl/ci bytes at 2-byte precision, ZeRO-Infinity §3), and offloaded
   checkpoints live in the accounted host pool, not on the device, until backward.
3. It composes with ZeRO: on 2 ranks, stages 2 and 3 (with and without prefetch, and with
   stage-3 units nested inside a checkpointed block) train exactly like the same engine
   without checkpointing and like single-process PyTorch.
4. Bad input is an error naming the value and what is valid.
"""
from __future__ import annotations

import copy
import math
import weakref

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import set_checkpoint_early_stop

from reference import (Oracle, engine_train, global_batches, make_config, make_model, rank_slices,
                       reference_train)
from tiertrain.config import ActivationConfig, ConfigError
from tiertrain.blocks import model_blocks
from tiertrain.engine import default_loss
from tiertrain.estimate.formulas import infinity_activation_checkpoint_bytes
from tiertrain.offload.activations import apply_activation_checkpointing, checkpoint_memory, checkpointing_of
from tiertrain.testing import run_distributed
from tiertrain.tiling import apply_tiling

pytestmark = pytest.mark.usefixtures("one_torch_thread")

EXACT_OPT = {"eps": 1e-3, "lr": 1e-2}  # see tests/test_engine.py for why eps=1e-3 at 1e-6
CASES = [(k, off) for k in (1, 2) for off in ("none", "cpu")]


def _checkpointed(model, k, offload, recompute="block", **kw):
    apply_activation_checkpointing(model, ActivationConfig(checkpoint_every=k, offload=offload, recompute=recompute),
                                   **kw)
    return model


def _loss_and_grads(model, batch, seed=5):
    torch.manual_seed(seed)
    loss = default_loss(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


# --------------------------------------------------------------------------- 1. numerics


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dropout", [0.0, 0.1])
@pytest.mark.parametrize("k,offload", CASES)
def test_losses_and_gradients_equal_the_unmodified_model(k, offload, dropout):
    batch = global_batches(1, 4)[0]
    ref_loss, ref_grads = _loss_and_grads(make_model(dropout=dropout), batch)
    model = _checkpointed(make_model(dropout=dropout), k, offload)
    loss, grads = _loss_and_grads(model, batch)
    assert torch.equal(loss, ref_loss)
    assert all(torch.equal(grads[n], ref_grads[n]) for n in ref_grads)
    handle = checkpointing_of(model)
    assert handle.checkpointed == ["blocks.0", "blocks.1"][::k]
    assert checkpoint_memory(model).recomputations == len(handle.checkpointed)


@pytest.mark.timeout(30)
def test_dropout_equality_comes_from_the_restored_rng_state(monkeypatch):
    """Guards test 1's dropout case: with the RNG state *not* restored for the recomputation
    the forward (and loss) is unchanged but backward uses other masks, so gradients differ."""
    import functools

    import tiertrain.offload.activations as activations
    monkeypatch.setattr(activations, "checkpoint",
                        functools.partial(activations.checkpoint, preserve_rng_state=False))
    batch = global_batches(1, 4)[0]
    ref_loss, ref = _loss_and_grads(make_model(dropout=0.1), batch)
    loss, other = _loss_and_grads(_checkpointed(make_model(dropout=0.1), 1, "none"), batch)
    assert torch.equal(loss, ref_loss)
    assert not all(torch.equal(ref[n], other[n]) for n in ref)


@pytest.mark.timeout(30)
def test_training_steps_and_deepcopy_match_the_reference():
    """reference_train deep-copies the model: the copy's checkpointed forwards are bound to
    the copy's blocks, and several optimizer steps stay bit-identical."""
    cfg = make_config(optimizer=EXACT_OPT)
    batches = global_batches(3, 4)
    ref_losses, ref_params = reference_train(make_model(), cfg, batches)
    model = _checkpointed(make_model(), 1, "cpu")
    losses, params = reference_train(model, cfg, batches)
    assert losses == ref_losses
    assert all(torch.equal(params[n], ref_params[n]) for n in ref_params)
    twin = copy.deepcopy(model)
    assert twin.blocks[0].forward.module is twin.blocks[0]
    assert checkpoint_memory(twin).peak_bytes == 0  # fresh counters for the copy


@pytest.mark.timeout(30)
def test_no_grad_forward_and_remove():
    model = _checkpointed(make_model(), 1, "cpu")
    batch = global_batches(1, 2)[0]
    with torch.no_grad():
        default_loss(model, batch)
    assert checkpoint_memory(model).peak_bytes == 0  # nothing saved, nothing checkpointed
    checkpointing_of(model).remove()
    assert "forward" not in model.blocks[0].__dict__ and checkpointing_of(model) is None
    _checkpointed(model, 2, "none")  # can be applied again after remove()


# --------------------------------------------------------------------------- 2. memory


def _forward_saved_bytes(model, batch):
    """Bytes of distinct storages that autograd saved for backward *outside* the blocks'
    own checkpoint hooks (parameters excluded), counted after the forward; plus weak
    references to every block output."""
    storages = {}

    def pack(x):
        if not isinstance(x, nn.Parameter):
            s = x.untyped_storage()
            storages[s.data_ptr()] = s.nbytes()
        return x

    outputs = []
    hooks = [b.register_forward_hook(lambda m, a, out: outputs.append(weakref.ref(out))) for b in model.blocks]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        loss = default_loss(model, batch)
    for h in hooks:
        h.remove()
    return loss, sum(storages.values()), outputs


@pytest.mark.timeout(30)
@pytest.mark.parametrize("k", [1, 2])
def test_saved_activation_bytes_fall_and_checkpoints_are_the_block_inputs(k):
    shape = dict(n_layers=4, hidden=64, n_heads=4)
    bsz, seq = 8, 16
    batch = global_batches(1, bsz)[0]
    plain = make_model(**shape)
    loss, saved_plain, _ = _forward_saved_bytes(plain, batch)
    loss.backward()

    model = _checkpointed(make_model(**shape), k, "none")
    loss, saved_outside, outputs = _forward_saved_bytes(model, batch)
    mem = checkpoint_memory(model)
    expected = infinity_activation_checkpoint_bytes(bsz, seq, 64, 4, ci=k, dtype_bytes=4)
    assert mem.bytes == mem.peak_bytes == expected and mem.host_bytes == 0
    held = saved_outside + mem.bytes
    if k == 1:  # only the embedding's, the head's and the checkpoints remain
        assert held < saved_plain / 4, (held, saved_plain)
    else:
        assert held < saved_plain * 0.6, (held, saved_plain)
    # offload='none' keeps the checkpointed blocks' inputs (earlier blocks' outputs) alive
    assert all(outputs[i]() is not None for i in range(0, 3, k))
    loss.backward()
    assert checkpoint_memory(model).bytes == 0


@pytest.mark.timeout(30)
def test_offloaded_checkpoints_live_in_the_host_pool():
    shape = dict(n_layers=4, hidden=64, n_heads=4)
    bsz, seq = 8, 16
    expected = infinity_activation_checkpoint_bytes(bsz, seq, 64, 4, ci=1, dtype_bytes=4)
    model = _checkpointed(make_model(**shape), 1, "cpu")
    for step, batch in enumerate(global_batches(2, bsz)):
        loss, _, outputs = _forward_saved_bytes(model, batch)
        mem = checkpoint_memory(model)
        assert mem.bytes == mem.host_bytes == expected
        # the working-memory copies of the block inputs are gone: only the host copies remain
        assert all(outputs[i]() is None for i in range(3)), "offloaded inputs still held on the device"
        loss.backward()
        mem = checkpoint_memory(model)
        assert mem.bytes == mem.host_bytes == 0 and mem.host_peak_bytes == expected
        # the pool keeps the freed buffers: the second step allocates nothing new
        assert mem.host_reserved_bytes == expected, step
        assert mem.recomputations == 4 * (step + 1)


# --------------------------------------------------------------------------- 3. engine


def _model(tiled: bool):
    model = make_model()
    if tiled:  # stage-3 units nested inside each checkpointed block (ZeRO-Infinity tiling)
        apply_tiling(model, {"blocks.*.mlp.fc2": 2})
        for block in model.blocks:  # (p=0 anyway) so a tile's backward is the first to need a
            block.mlp.drop = nn.Identity()  # checkpoint: the tile is gathered before recomputing
    return model


def _engine_runs(rank, world, cases):
    batches = global_batches(3, 8)
    out = []
    for stage, prefetch, k, offload, recompute, tiled, early_stop in cases:
        zero = {"stage": stage, **({"prefetch_mb": prefetch} if stage == 3 else {})}
        cfg = make_config(zero=zero, batch={"micro_batch_size": 2, "grad_accum_steps": 2}, optimizer=EXACT_OPT)
        runs = []
        for prepare in (None, lambda m, topology, k=k, offload=offload, r=recompute: _checkpointed(m, k, offload, r)):
            # early_stop=False: the recomputation runs the whole block, every nested unit's hooks included
            with set_checkpoint_early_stop(early_stop):
                losses, params, engine = engine_train(rank, world, _model(tiled), cfg, batches, prepare=prepare)
                traces = engine.fetcher.traces if engine.fetcher else None
                tile = max((u.full.numel() * u.full.element_size() for u in engine.flat.units
                            if ".tiles." in u.unit.label), default=0)
                runs.append((losses, params, traces, checkpoint_memory(engine.module),
                             engine.flat.gathered_bytes(), engine.flat.peak_gathered_bytes, tile))
                # the fetcher is back at rest: a fetch outside the passes and another step still agree
                with engine.gathered_parameters():
                    pass
                engine.train_batch(rank_slices(batches[0], rank, world, 2, 2))
        out.append(runs)
    return out


ENGINE_CASES = [  # (stage, prefetch_mb, checkpoint_every, offload, recompute, early_stop)
    (2, None, 1, "cpu", "block", True),
    (3, 0, 1, "none", "block", True), (3, 0, 2, "cpu", "block", True), (3, 1, 1, "cpu", "block", True),
    (3, 1, 1, "none", "block", False),
    (2, None, 1, "cpu", "selective", True), (3, 0, 1, "none", "selective", True),
    (3, 1, 2, "cpu", "selective", True), (3, 1, 1, "none", "selective", False),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tiled", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["blocks", "nested_units"])
def test_engine_with_checkpointing_matches_reference(tiled):
    cases = [c[:5] + (tiled, c[5]) for c in ENGINE_CASES if tiled is False or c[0] == 3]
    results = run_distributed(_engine_runs, 2, cases, timeout=80)[0]
    cfg = make_config(optimizer=EXACT_OPT)
    oracle = Oracle.run(reference_train, _model(tiled), cfg, global_batches(3, 8))
    for case, (base, (losses, params, traces, mem, live, peak, tile)) in zip(cases, results, strict=True):
        base_losses, base_params, base_traces, _, _, base_peak, _ = base
        # bit-identical to the same engine without checkpointing ...
        assert losses == base_losses, case
        assert all(torch.equal(params[n], base_params[n]) for n in base_params), case
        # ... and so to single-process PyTorch within the float64 oracle's bound
        oracle.check(losses, params, f"checkpointing {case}")
        # stage 3: the recomputation left the traced order alone and released everything
        assert traces == base_traces and live == 0, case
        if case[1] == 0:  # without prefetch, recomputing adds at most one nested unit to what is gathered
            assert peak <= base_peak + tile, (case, peak, base_peak, tile)
        k, offload, recompute = case[2:5]
        n_ckpt = math.ceil(2 / k)
        inputs = n_ckpt * 2 * 16 * 32 * 4  # micro-batch 2 × seq 16 × hidden 32 fp32
        kept = n_ckpt * _kept_per_block(micro_batch=2) if recompute == "selective" else 0
        assert mem.peak_bytes == inputs + kept, case
        assert mem.bytes == 0 and mem.host_peak_bytes == (inputs if offload == "cpu" else 0), case


def _kept_per_block(micro_batch: int) -> int:
    """The estimator's bytes of the outputs a selectively checkpointed block of make_model()
    keeps (fp32)."""
    from tiertrain.estimate.dims import ModelDims
    from tiertrain.estimate.activations import gpt_activation_bytes

    return gpt_activation_bytes(ModelDims.from_gpt_config(make_model().config), micro_batch, 4).kept_at(0)


# --------------------------------------------------------------------------- 4. bad input


@pytest.mark.timeout(30)
def test_bad_input_is_named():
    model = make_model()  # 2 blocks
    with pytest.raises(ConfigError, match=r"activations\.checkpoint_every=3 is invalid.*2 block.*1\.\.2"):
        _checkpointed(model, 3, "none")
    with pytest.raises(ConfigError, match=r"activations\.checkpoint_every=-1"):
        _checkpointed(model, -1, "none")
    with pytest.raises(ConfigError, match=r"activations\.offload='nvme' is invalid.*'none', 'cpu'"):
        _checkpointed(model, 1, "nvme")
    with pytest.raises(ConfigError, match=r"activations\.offload='cpu'"):
        _checkpointed(model, 0, "cpu")
    with pytest.raises(ValueError, match=r"Sequential has no nn\.ModuleList.*blocks="):
        _checkpointed(nn.Sequential(nn.Linear(2, 2), nn.ReLU()), 1, "none")
    with pytest.raises(ValueError, match=r"'blocks\.7' is not a submodule of GPT"):
        _checkpointed(model, 1, "none", blocks=["blocks.7"])
    with pytest.raises(ValueError, match=r"'blocks\.0' and 'blocks\.0\.attn' are nested"):
        _checkpointed(model, 1, "none", blocks=["blocks.0", "blocks.0.attn"])
    with pytest.raises(ValueError, match=r"not the model itself"):
        _checkpointed(model, 1, "none", blocks=[""])
    with pytest.raises(TypeError, match=r"ActivationConfig"):
        apply_activation_checkpointing(model, {"checkpoint_every": 1})
    assert "forward" not in model.blocks[0].__dict__  # nothing was applied by the failures
    _checkpointed(model, 2, "none")
    with pytest.raises(RuntimeError, match=r"already applied.*remove\(\)"):
        _checkpointed(model, 1, "none")
    with pytest.raises(RuntimeError, match=r"blocks \['0'\] are already checkpointed"):
        _checkpointed(model.blocks, 1, "none", blocks=["0", "1"])


def test_a_model_checkpointing_its_own_layers_is_not_checkpointed_again():
    """transformers' gradient_checkpointing_enable() and the engine's checkpointing together
    would put two checkpoints around each layer (with use_reentrant=True, each recomputed
    twice): refused, naming both ways out."""
    transformers = pytest.importorskip("transformers")
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2))
    model.gradient_checkpointing_enable()
    with pytest.raises(ConfigError, match=r"checkpoint_every=1: this LlamaForCausalLM checkpoints its layers already"
                                          r".*gradient_checkpointing_disable\(\), or activations.checkpoint_every=0"):
        _checkpointed(model, 1, "none")
    model.gradient_checkpointing_disable()
    _checkpointed(model, 1, "none")


def test_memory_is_found_from_a_module_holding_checkpointed_blocks():
    """A pipeline stage holds some blocks of a checkpointed model, not the model."""
    model = _checkpointed(make_model(), 1, "cpu")
    stage = nn.ModuleDict({"1": model.blocks[1]})
    x = torch.randn(2, 16, 32, requires_grad=True)
    y = stage["1"](x)
    assert checkpoint_memory(stage).host_bytes == x.numel() * 4 == checkpoint_memory(model).host_bytes
    y.sum().backward()
    assert checkpoint_memory(stage).bytes == 0 and checkpoint_memory(nn.Linear(2, 2)).peak_bytes == 0


def test_default_blocks_are_the_outermost_modulelist_children():
    model = _model(tiled=True)  # blocks.i.mlp.fc2.tiles is a ModuleList inside each block
    assert model_blocks(model) == ["blocks.0", "blocks.1"]
    assert model_blocks(model, [model.blocks[1].mlp, "blocks.0.attn"]) == ["blocks.0.attn", "blocks.1.mlp"]
