"""Frozen parameters (requires_grad=False) at ZeRO stage 3: partitioned and gathered like the
trained ones, with no gradient, master or optimizer state; counted by memory_report() and the
estimator; returned by full_state_dict(); saved in checkpoints. The model is the common case
they exist for: a pretrained backbone, frozen, under small trainable adapters (LoRA)."""
from __future__ import annotations

import pytest
import torch

import tiertrain
from tiertrain.testing import run_distributed

from reference import Oracle, engine_train, global_batches, make_config, reference_train

pytest.importorskip("transformers")
from adapters import lora_llama  # noqa: E402


def _batches(steps=3, world=2):
    return [{"input_ids": b["input_ids"], "labels": b["input_ids"]} for b in global_batches(steps, 2 * world)]


def _config(stage, **zero):
    return make_config(zero={"stage": stage, **zero}, batch={"micro_batch_size": 2}, optimizer={"eps": 1e-3})


def _train(rank, world, cases):
    out = {}
    for name, (stage, zero) in cases.items():
        losses, params, engine = engine_train(rank, world, lora_llama(), _config(stage, **zero), _batches())
        report = engine.memory_report()
        partitioned = sum(u.full.numel() * u.full.element_size() for u in engine.flat.all_units
                          if not u.unit.resident)
        out[name] = {"losses": losses, "params": params, "report": report,
                     "peak_gathered": engine.flat.peak_gathered_bytes, "partitioned": partitioned,
                     "still_gathered": [u.unit.label for u in engine.flat.all_units
                                        if u.gathered and not u.unit.resident]}
        engine.close()
    return out


# (stage 3 without prefetch, on an accelerator host too: this model is smaller than the default
# prefetch there, which would gather every unit at once and hide whether each is released)
CASES = {"stage 0": (0, {}), "stage 2": (2, {}), "stage 3": (3, {"prefetch_mb": 0}),
         "stage 3, parameters and optimizer on cpu": (3, {"offload_params": "cpu", "offload_optimizer": "cpu"})}


@pytest.fixture(scope="module")
def runs():
    return run_distributed(_train, 2, CASES, timeout=150)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", list(CASES))
def test_adapters_on_a_frozen_backbone_train_like_the_reference(runs, name):
    result = runs[0][name]
    frozen = {n for n, p in lora_llama().named_parameters() if not p.requires_grad}
    assert frozen <= set(result["params"]), "full_state_dict() must hold the frozen parameters too"
    oracle = Oracle.run(reference_train, lora_llama(), _config(CASES[name][0]), _batches())
    oracle.check(result["losses"], result["params"], f"LoRA Llama, {name}")
    for n in frozen:  # frozen weights come back exactly as built
        assert torch.equal(result["params"][n], oracle.params32[n]), n


@pytest.mark.timeout(180)
def test_stage3_holds_half_the_frozen_bytes_of_stage0(runs):
    whole = sum(p.numel() * 4 for p in lora_llama().parameters() if not p.requires_grad)
    for rank_result in runs:
        assert rank_result["stage 0"]["report"].frozen_params == whole
        sharded = rank_result["stage 3"]["report"].frozen_params
        # Each frozen unit is padded to a multiple of 2·64 elements before it is halved.
        assert whole / 2 <= sharded <= whole / 2 + 4 * 64 * 16, (sharded, whole)
        assert rank_result["stage 3"]["report"].params < rank_result["stage 0"]["report"].params / 1.9


@pytest.mark.timeout(180)
def test_frozen_units_are_released_during_backward_not_held_to_its_end(runs):
    result = runs[0]["stage 3"]
    # Gathered at once: the root (embeddings, head) and two blocks at most (one computing its
    # backward, the next gathered as the gradient of the first one's input arrives), of four.
    assert result["peak_gathered"] < 0.7 * result["partitioned"], (result["peak_gathered"], result["partitioned"])
    assert not result["still_gathered"], result["still_gathered"]


@pytest.mark.timeout(180)
def test_the_estimator_counts_frozen_parameters_as_the_engine_does(runs):
    from tiertrain.estimate.peak import simulate_peak

    for name in ("stage 0", "stage 3"):
        stage = CASES[name][0]
        with torch.device("meta"):
            model = lora_llama()
        predicted = simulate_peak(model, dp=2, stage=stage, precision_bytes=4)
        assert predicted.params == runs[0][name]["report"].params, name


def _checkpoint_round_trip(rank, world, directory):
    cfg = _config(3)
    engine = tiertrain.wrap(lora_llama(), cfg, tiertrain.Topology.build(cfg.parallel))
    before = engine.full_state_dict()
    engine.save_checkpoint(directory)
    frozen = [p for p in engine.module.parameters() if not p.requires_grad]
    with engine.gathered_parameters(frozen, modifier_rank=0):
        for p in frozen:
            p.data.add_(1.0)  # (edits by rank 0 reach every rank's shard)
    edited = engine.full_state_dict()
    engine.load_checkpoint(directory)
    after = engine.full_state_dict()
    engine.close()
    return before, edited, after


@pytest.mark.timeout(120)
def test_checkpoints_save_and_restore_the_frozen_shards(tmp_path):
    before, edited, after = run_distributed(_checkpoint_round_trip, 2, str(tmp_path), timeout=100)[1]
    frozen = [n for n, p in lora_llama().named_parameters() if not p.requires_grad]
    assert all(torch.equal(edited[n], before[n] + 1.0) for n in frozen)
    assert all(torch.equal(after[n], before[n]) for n in before)


def _built_partitioned(rank, world):
    cfg = _config(3)
    with tiertrain.partitioned_init(tiertrain.Topology.build(cfg.parallel)):
        model = lora_llama()
    held = sum(p.numel() for p in model.parameters())
    losses, params, engine = engine_train(rank, world, model, cfg, _batches())
    engine.close()
    return held, losses, params


@pytest.mark.timeout(120)
def test_a_frozen_backbone_built_partitioned_trains_like_the_reference():
    held, losses, params = run_distributed(_built_partitioned, 2, timeout=100)[0]
    whole = sum(p.numel() for p in lora_llama().parameters())
    assert held <= whole / 2 + 64, (held, whole)  # (each parameter padded to an even length)
    oracle = Oracle.run(reference_train, lora_llama(), _config(3), _batches())
    oracle.check(losses, params, "LoRA Llama built under partitioned_init, stage 3")


class _Indexed(torch.nn.Module):
    """A model whose forward reads a frozen integer parameter (an index table; a quantized
    weight is the same case): its values must reach the forward exactly."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(2048, 16)
        self.head = torch.nn.Linear(16, 1)
        self.table = torch.nn.Parameter(torch.arange(1000, 1016), requires_grad=False)

    def forward(self, rows):
        return self.head(self.embed(self.table[rows])).square().mean()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_an_integer_frozen_parameter_keeps_its_dtype_and_values(stage):
    """It was cast to the compute dtype with the floating ones: in bf16, 1001 became 1000 (so the
    forward read other rows), and close() handed back a bf16 tensor."""
    config = make_config(zero={"stage": stage}, precision={"dtype": "bf16"}, batch={"micro_batch_size": 4})
    model = _Indexed()
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel),
                            loss_fn=lambda m, batch: m(batch))
    engine.backward(engine(torch.arange(4)))
    assert engine.step()
    exact = torch.arange(1000, 1016)
    saved = engine.full_state_dict()["table"]
    assert saved.dtype == torch.int64 and torch.equal(saved, exact)
    report = engine.memory_report()
    engine.close()
    assert model.table.dtype == torch.int64 and torch.equal(model.table, exact)
    assert report.frozen_params == 16 * 8, "counted in its own dtype"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 2, 3])
def test_a_frozen_fp32_backbone_at_bf16_is_said_rounded_and_handed_back_in_its_dtype(stage):
    """Frozen parameters have no fp32 master: given in fp32 to a bf16 run, their values are
    rounded for it, which a warning names (before: silent, and close() handed them back in
    bf16 at stages 0-2 beside fp32 adapters, a model whose fp32 forward fails). Given in
    bf16, nothing is rounded and nothing is said; close() gives them back in bf16."""
    import warnings

    config = make_config(zero={"stage": stage}, precision={"dtype": "bf16"}, batch={"micro_batch_size": 2})
    for given in (torch.float32, torch.bfloat16):
        model = lora_llama(layers=2)
        for p in model.parameters():
            if not p.requires_grad:
                p.data = p.data.to(given)
        buffers = {n: b.dtype for n, b in model.named_buffers()}
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
        said = [str(w.message) for w in caught if "have no fp32 master" in str(w.message)]
        engine.train_batch(iter(_batches(1, 1)[0:1]))
        engine.close()
        frozen = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad}
        assert set(frozen.values()) == {given}, frozen
        assert {n: b.dtype for n, b in model.named_buffers()} == buffers
        assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
        if given is torch.float32:
            assert len(said) == 1 and "'model.embed_tokens.weight'" in said[0] and "torch.float32" in said[0]
            assert "from_pretrained(dtype=...)" in said[0]
        else:
            assert said == []
