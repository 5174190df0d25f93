"""``model.load_state_dict(sd)`` after ``wrap()`` loads as it did before: every stage, tier and
dtype ends up holding sd (fp32 masters from sd's own values) and trains exactly as a run whose
model held sd at ``wrap()``.

Before, torch's copy reached only the engine's compute copy: at bf16 the next step rewrote
the parameters from the fp32 masters it had (the load was lost without a word), and at stage 3
the copy met a released parameter. Data-parallel ranks that load different values, or a load
on one rank only, fail on every rank naming it (each rank writes its own shards from what it
was given).
"""
from __future__ import annotations

import os
import re
import time

import pytest
import torch
import transformers

import tiertrain
from reference import global_batches, make_config, make_model, rank_slices
from tiertrain.module_load import LoadedValuesDifferError
from tiertrain.testing import RankFailure, run_distributed

pytestmark = pytest.mark.usefixtures("one_torch_thread")

CASES = [
    ("stage 0, bf16", {"stage": 0}, "bf16"),
    ("stage 1, bf16", {"stage": 1}, "bf16"),
    ("stage 2, bf16, optimizer on cpu", {"stage": 2, "offload_optimizer": "cpu"}, "bf16"),
    ("stage 3, fp32", {"stage": 3}, "fp32"),
    ("stage 3, bf16, params+optimizer on cpu", {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"},
     "bf16"),
    ("stage 3, bf16, params+optimizer on nvme", {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme",
                                                  "nvme_chunk_mb": 0.01}, "bf16"),
]


def _wrap(model, zero, dtype, swap):
    zero = dict(zero, nvme_path=swap) if "nvme" in str(zero) else zero
    cfg = make_config(zero=zero, precision={"dtype": dtype}, batch={"micro_batch_size": 2})
    return tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))


def _train(engine, rank, world, steps=2):
    for batch in global_batches(steps, 2 * world):
        engine.train_batch(rank_slices(batch, rank, world, 2, 1))
    return engine.full_state_dict()


def _loaded_and_wrapped(rank, world, root):
    """Per case: sd loaded after wrap() (then trained), and the same model wrapped holding sd."""
    sd = make_model(seed=7).state_dict()
    out = {}
    for k, (label, zero, dtype) in enumerate(CASES):
        engine = _wrap(make_model(seed=0), zero, dtype, os.path.join(root, f"a{k}"))
        result = engine.module.load_state_dict(sd)
        loaded = engine.full_state_dict()
        with engine.gathered_parameters():  # the compute-dtype values the next forward uses
            compute = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        trained = _train(engine, rank, world)
        engine.close()
        holding = _wrap(make_model(seed=7), zero, dtype, os.path.join(root, f"b{k}"))
        out[label] = dict(keys=(result.missing_keys, result.unexpected_keys), loaded=loaded, compute=compute,
                          trained=trained, reference=_train(holding, rank, world))
        holding.close()
    return out, sd


@pytest.mark.timeout(150)
def test_a_state_dict_loaded_after_wrap_trains_exactly_as_one_held_at_wrap(tmp_path):
    per_rank = run_distributed(_loaded_and_wrapped, 2, str(tmp_path), timeout=140)
    results, sd = per_rank[0]
    for label, _, dtype in CASES:
        got = results[label]
        assert got["keys"] == ([], []), f"{label}: {got['keys']}"
        assert got["loaded"].keys() <= sd.keys() and len(got["loaded"]) >= len(sd) - 1  # (the tied head once)
        differ = sorted(n for n in got["loaded"] if not torch.equal(got["loaded"][n], sd[n]))
        assert not differ, f"{label}: after the load the engine does not hold sd (fp32) for {differ}"
        compute_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
        differ = sorted(n for n, p in got["compute"].items() if not torch.equal(p, sd[n].to(compute_dtype)))
        assert not differ, f"{label}: the compute copy is not sd's values for {differ}"
        for rank in (0, 1):
            trained, reference = per_rank[rank][0][label]["trained"], per_rank[rank][0][label]["reference"]
            differ = sorted(n for n in reference if not torch.equal(trained[n], reference[n]))
            assert not differ, f"{label}, rank {rank}: trained unlike the model wrapped holding sd: {differ}"


def _loads(rank, world, how):
    """how: 'different' (rank 1 loads other values), 'rank 0 only' (rank 1 trains on)."""
    engine = _wrap(make_model(seed=0), {"stage": 2}, "bf16", None)
    before = engine.full_state_dict()
    if how == "different":
        try:
            engine.module.load_state_dict(make_model(seed=7 + rank).state_dict())
        except LoadedValuesDifferError as e:
            after = engine.full_state_dict()
            return str(e), all(torch.equal(before[n], after[n]) for n in before)
        return None, None
    if rank == 0:
        engine.module.load_state_dict(make_model(seed=7).state_dict())
    _train(engine, rank, world, steps=1)


@pytest.mark.timeout(60)
def test_ranks_loading_different_values_fail_together_naming_the_parameters():
    per_rank = run_distributed(_loads, 2, "different", timeout=50)
    for rank, (message, untouched) in enumerate(per_rank):
        assert message is not None, f"rank {rank} loaded without a word"
        assert re.search(r"the data-parallel ranks load different values for 10 of the \d+ parameters", message) \
            and "blocks.0.attn.qkv.weight" in message, message
        assert untouched, f"rank {rank}: the refused load changed the engine's parameters"


@pytest.mark.timeout(60)
def test_a_load_on_rank_0_only_fails_within_seconds_naming_it():
    """The DDP-era habit ``if rank == 0: model.load_state_dict(sd)``: each rank writes its own
    shards, so rank 1 would have trained on with the old weights beside rank 0's new ones."""
    start = time.monotonic()
    with pytest.raises(RankFailure) as caught:
        run_distributed(_loads, 2, "rank 0 only", timeout=45)
    first_line = str(caught.value).splitlines()[0]
    assert caught.value.exc_type == "CollectiveMismatchError", first_line
    assert re.search(r"rank 0 .*\(model\.load_state_dict\(\)\)", first_line), first_line
    assert time.monotonic() - start < 30, "named within seconds, not at the timeout"


@pytest.mark.timeout(60)
def test_strict_false_and_mismatches_report_as_torch_does():
    """A partial load changes only what it holds and returns torch's missing and unexpected
    keys; a value of another shape is torch's error, naming it."""
    sd = make_model(seed=7).state_dict()
    partial = {"norm.weight": sd["norm.weight"] + 0.25, "blocks.0.attn.qkv.weight": sd["blocks.0.attn.qkv.weight"],
               "not.a.key": torch.zeros(1)}
    plain = make_model(seed=0)
    want = plain.load_state_dict(partial, strict=False)
    engine = _wrap(make_model(seed=0), {"stage": 3}, "bf16", None)
    before = engine.full_state_dict()
    got = engine.module.load_state_dict(partial, strict=False)
    assert (sorted(got.missing_keys), got.unexpected_keys) == (sorted(want.missing_keys), want.unexpected_keys)
    after = engine.full_state_dict()
    changed = sorted(n for n in before if not torch.equal(before[n], after[n]))
    assert changed == ["blocks.0.attn.qkv.weight", "norm.weight"], changed
    assert torch.equal(after["norm.weight"], partial["norm.weight"])
    with pytest.raises(RuntimeError, match=r"size mismatch for norm\.weight"):
        engine.module.load_state_dict({**sd, "norm.weight": torch.zeros(3)})
    engine.close()


@pytest.mark.timeout(60)
def test_inside_gathered_parameters_the_gathered_copies_load_and_the_modifier_writes_them_back():
    """The documented way before this change still means what it meant: the load reaches the
    gathered compute-dtype copies, and modifier_rank writes them (rounded to bf16) back."""
    sd = make_model(seed=7).state_dict()
    engine = _wrap(make_model(seed=0), {"stage": 3}, "bf16", None)
    with engine.gathered_parameters(modifier_rank=0):
        engine.module.load_state_dict(sd)
    after = engine.full_state_dict()
    assert all(torch.equal(after[n], sd[n].to(torch.bfloat16).float()) for n in after)
    engine.close()


@pytest.mark.timeout(60)
def test_a_hugging_face_model_and_a_submodule_load_after_wrap():
    """A Llama at stage 3 (bf16): the whole model's state dict, then one layer's own (loaded
    on the submodule, with its own key names), each land in the fp32 masters exactly."""
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    torch.manual_seed(7)
    sd = transformers.LlamaForCausalLM(config).state_dict()
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    engine = _wrap(model, {"stage": 3}, "bf16", None)
    model.load_state_dict(sd)
    after = engine.full_state_dict()
    assert all(torch.equal(after[n], sd[n]) for n in after if n in sd)
    torch.manual_seed(3)
    layer = transformers.LlamaForCausalLM(config).model.layers[1].state_dict()
    model.model.layers[1].load_state_dict(layer)
    after = engine.full_state_dict()
    assert all(torch.equal(after["model.layers.1." + n], v) for n, v in layer.items())
    assert torch.equal(after["model.layers.0.mlp.up_proj.weight"], sd["model.layers.0.mlp.up_proj.weight"])
    engine.close()
    model.load_state_dict(sd)  # closed: a plain module again, no hook left
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, sd["model.layers.1.mlp.up_proj.weight"])


@pytest.mark.timeout(60)
def test_a_copy_of_the_wrapped_model_loads_as_a_plain_module():
    """copy.deepcopy (an EMA's copy) and torch.save of the model while wrapped: the copy is held
    by no engine, and its load_state_dict is torch's."""
    import copy

    sd = make_model(seed=7).state_dict()
    engine = _wrap(make_model(seed=0), {"stage": 2}, "bf16", None)
    before = engine.full_state_dict()
    twin = copy.deepcopy(engine.module)
    twin.load_state_dict(sd)
    assert torch.equal(twin.blocks[0].mlp.fc1.weight, sd["blocks.0.mlp.fc1.weight"].to(torch.bfloat16))
    assert all(torch.equal(v, before[n]) for n, v in engine.full_state_dict().items()), "the copy's load reached the engine"
    engine.close()


def _pipeline_loads(rank, world):
    out = []
    sd = make_model(seed=7, n_layers=4).state_dict()
    for stage in (1, 3):
        cfg = make_config(zero={"stage": stage}, precision={"dtype": "bf16"},
                          parallel={"dp": 1, "tp": 1, "pp": 2, "schedule": "1f1b"},
                          batch={"micro_batch_size": 2, "grad_accum_steps": 2})
        model = make_model(seed=0, n_layers=4)
        engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
        model.load_state_dict(sd)  # (the whole model's, on every pipeline rank: each keeps its stages')
        full = engine.full_state_dict()
        out.append(sorted(n for n in full if not torch.equal(full[n], sd[n])))
        engine.close()
    return out


@pytest.mark.timeout(60)
def test_under_pipeline_parallelism_each_rank_loads_its_stages():
    for rank, differ in enumerate(run_distributed(_pipeline_loads, 2, timeout=50)):
        assert differ == [[], []], f"rank {rank}: {differ}"


@pytest.mark.timeout(60)
def test_a_peft_adapter_loaded_after_wrap_lands_in_the_masters():
    """peft's set_peft_model_state_dict (how an adapter checkpoint is loaded) calls the model's
    load_state_dict(strict=False): at stage 2, bf16, the adapter's values reach the fp32 masters."""
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)

    def build(seed):
        torch.manual_seed(0)
        base = transformers.LlamaForCausalLM(config)
        torch.manual_seed(seed)  # (lora_B random too: an adapter that has trained)
        return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"],
                                                         init_lora_weights=False))

    donor = build(7)
    model = build(0)
    engine = _wrap(model, {"stage": 2}, "bf16", None)
    peft.set_peft_model_state_dict(model, peft.get_peft_model_state_dict(donor))
    after, want = engine.full_state_dict(), donor.state_dict()
    adapters = [n for n in after if "lora_" in n]
    assert len(adapters) == 8 and all(torch.equal(after[n], want[n]) for n in adapters)
    engine.close()


class _Normed(torch.nn.Module):
    """A model of the user's own with BatchNorm buffers and no ModuleList (cut into units by size)."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(),
                                        torch.nn.Linear(16, 4))

    def forward(self, x, y):
        return torch.nn.functional.cross_entropy(self.body(x), y)


def _normed(seed):
    torch.manual_seed(seed)
    model = _Normed()
    model(torch.randn(8, 8), torch.randint(0, 4, (8,)))  # (running statistics away from their start)
    return model


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 3])
def test_buffers_load_too_and_the_engine_holds_what_one_wrapped_around_sd_holds(stage):
    """Parameters and BatchNorm's running statistics of sd, loaded after wrap() at bf16: the
    engine's full state is exactly that of an engine wrapped around a model holding sd (fp32
    masters from sd's own values; buffers, kept in the compute dtype, rounded as at wrap())."""
    sd = _normed(7).state_dict()
    loaded = _wrap(_normed(0), {"stage": stage}, "bf16", None)
    loaded.module.load_state_dict(sd)
    held = _wrap(_normed(7), {"stage": stage}, "bf16", None)
    got, want = loaded.full_state_dict(), held.full_state_dict()
    assert sorted(got) == sorted(want) == sorted(sd)
    assert all(torch.equal(got[n], want[n]) for n in want), [n for n in want if not torch.equal(got[n], want[n])]
    assert all(torch.equal(got[n], sd[n]) for n in sd if "running" not in n)  # (the masters: sd exactly)
    loaded.close()
    held.close()
