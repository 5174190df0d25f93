"""Issue 34's items on Hugging Face families its other tests do not use: transformers' ResNet
(BatchNorm buffers, a model whose stage-3 units are its ModuleList's stages) and Qwen2-MoE (a
shared expert beside routed ones). One 2-rank launch, stage 3:

* item 1, buffers: each rank's running statistics start every training forward from rank 0's
  (broadcast, as DDP's broadcast_buffers): after steps on each rank's own images, one step on
  the same images leaves every rank equal; they are in full_state_dict() under state_dict's
  names, and a checkpoint restores them;
* item 2, masters: an fp32 Qwen2-MoE wrapped at bf16 and closed without a step is the model it
  was, bit for bit (the masters were copied from the rounded compute copy);
* item 5, a forward outside the engine: after training, ``model(x)`` in eval mode under
  ``no_grad`` on every rank gives the logits a plain model with full_state_dict()'s values gives.
Items 7 and 8 run on Qwen2-MoE, ViT and peft in test_pretrained/test_export/test_peft_export."""
from __future__ import annotations

import os

import pytest
import torch

import tiertrain
from reference import Oracle, engine_train, global_batches, make_config, rank_slices, reference_train
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402

WORLD, MICRO = 2, 2


def _resnet():
    torch.manual_seed(0)
    T = transformers
    return T.ResNetForImageClassification(T.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                                         depths=[1, 1], layer_type="basic", num_labels=3))


def _images(rank: int, steps: int) -> list[dict]:
    g = torch.Generator().manual_seed(10 + rank)  # (each rank its own images: statistics that differ)
    return [{"pixel_values": torch.randn(MICRO, 3, 16, 16, generator=g) * (1 + rank) + rank,
             "labels": torch.randint(0, 3, (MICRO,), generator=g)} for _ in range(steps)]


def _run(rank, world, root):
    out = {}
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": MICRO})
    topology = tiertrain.Topology.build(cfg.parallel)
    engine = tiertrain.wrap(_resnet(), cfg, topology)
    # Two steps on each rank's own images, then one on the same images everywhere: the ranks
    # end equal only if that forward started from the same statistics (rank 0's, broadcast).
    for batch in _images(rank, 2) + _images(0, 1):
        engine.train_batch(iter([batch]))
    buffers = {n for n, _ in engine.module.named_buffers()}
    full = engine.full_state_dict()
    out["buffers"] = {n: full[n].clone() for n in buffers if n in full}
    out["units"] = len(engine.flat.all_units)
    engine.save_checkpoint(os.path.join(root, "ckpt"))
    engine.close()
    fresh = tiertrain.wrap(_resnet(), cfg, topology)
    fresh.load_checkpoint(os.path.join(root, "ckpt"))
    restored = fresh.full_state_dict()
    out["restored"] = {n: restored[n].clone() for n in out["buffers"]}
    fresh.close()

    torch.manual_seed(0)
    original = {n: p.detach().clone() for n, p in zoo.qwen2_moe().named_parameters()}
    bf16 = make_config(zero={"stage": 3}, precision={"dtype": "bf16"}, batch={"micro_batch_size": MICRO})
    torch.manual_seed(0)
    engine = tiertrain.wrap(zoo.qwen2_moe(), bf16, tiertrain.Topology.build(bf16.parallel))
    model = engine.module
    engine.close()
    out["changed by wrap and close"] = [n for n, p in model.named_parameters() if not torch.equal(p, original[n])]

    torch.manual_seed(0)
    model = zoo.qwen2_moe()
    model.loss_function = zoo.causal_lm_loss
    engine = tiertrain.wrap(model, cfg, topology)
    for b in zoo.global_batches(2, MICRO * world, seq_len=zoo.SEQ):
        engine.train_batch(rank_slices({"input_ids": b["input_ids"], "labels": b["input_ids"]}, rank, world, MICRO, 1))
    probe = torch.arange(12).reshape(1, 12)
    model.eval()
    with torch.no_grad():
        out["outside"] = model(input_ids=probe).logits.clone()
    out["full"] = engine.full_state_dict()
    engine.close()
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory, one_torch_thread):
    return run_distributed(_run, WORLD, str(tmp_path_factory.mktemp("families")), timeout=100)


@pytest.mark.timeout(120)
def test_resnet_batchnorm_statistics_start_each_forward_from_rank_0s_and_survive_a_checkpoint(results):
    want = {n for n, _ in _resnet().named_buffers()}
    assert results[0]["units"] > 1, "ResNet's stages are units of their own"
    for rank, got in enumerate(results):
        assert set(got["buffers"]) == want, f"rank {rank}: full_state_dict lacks {sorted(want - set(got['buffers']))}"
        for n, v in got["buffers"].items():
            assert torch.equal(v, results[0]["buffers"][n]), f"rank {rank}: {n} is not rank 0's"
            assert torch.equal(got["restored"][n], v), f"rank {rank}: {n} not restored by the checkpoint"
    moved = results[0]["buffers"]["resnet.embedder.embedder.normalization.running_mean"]
    assert float(moved.abs().sum()) > 0, "(the statistics moved off their initial zeros)"


@pytest.mark.timeout(120)
def test_qwen2_moe_wrapped_at_bf16_keeps_its_fp32_weights(results):
    for rank, got in enumerate(results):
        assert got["changed by wrap and close"] == [], f"rank {rank}"


@pytest.mark.timeout(120)
def test_qwen2_moe_called_outside_the_engine_at_stage_3_computes_the_trained_model(results):
    torch.manual_seed(0)
    plain = zoo.qwen2_moe()
    plain.load_state_dict({k: v for k, v in results[0]["full"].items()}, strict=False)
    plain.eval()
    with torch.no_grad():
        want = plain(input_ids=torch.arange(12).reshape(1, 12)).logits
    for rank, got in enumerate(results):
        assert torch.equal(got["outside"], want), f"rank {rank}: {(got['outside'] - want).abs().max()}"


def _reformer():
    """Reformer's reversible layers keep no activations: their backward re-runs each sublayer
    (attention, feed-forward) to recover its inputs, outside the layer's forward."""
    torch.manual_seed(0)
    T = transformers
    return T.ReformerModelWithLMHead(T.ReformerConfig(
        vocab_size=256, hidden_size=32, num_attention_heads=2, attention_head_size=16, feed_forward_size=64,
        attn_layers=["local", "local"], axial_pos_embds=False, is_decoder=True, local_attn_chunk_length=8,
        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, local_attention_probs_dropout_prob=0.0,
        max_position_embeddings=64))


def _lm_batches():
    return [{"input_ids": b["input_ids"], "labels": b["input_ids"].clone()} for b in global_batches(3, 8)]


def _reformer_ranks(rank, world, stage):
    cfg = make_config(zero={"stage": stage}, batch={"micro_batch_size": 4})
    try:
        losses, params, engine = engine_train(rank, world, _reformer(), cfg, _lm_batches())
    except tiertrain.ReleasedParameterError as e:
        return str(e)
    engine.close()
    return losses, params


@pytest.mark.timeout(120)
def test_reversible_layers_train_at_stage_2_and_stage_3_says_why_it_cannot(one_torch_thread):
    """At stage 3 the backward's re-run reads a released unit: the error names the parameter,
    and reversible layers as a cause with the stage that trains them (2: within the float64
    oracle of plain PyTorch on the whole batch)."""
    for said in run_distributed(_reformer_ranks, WORLD, 3, timeout=60):
        assert "read parameter 'reformer.encoder.layers." in said, said
        assert "reversible layers" in said and "trains at zero.stage 2 or lower" in said, said
    losses, params = run_distributed(_reformer_ranks, WORLD, 2, timeout=60)[0]
    cfg = make_config(batch={"micro_batch_size": 4})
    Oracle.run(lambda m: reference_train(m, cfg, _lm_batches()), _reformer()).check(losses, params, "Reformer")
