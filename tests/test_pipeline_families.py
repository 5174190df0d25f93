"""Every rotary-decoder family the pipeline cuts (tiertrain/pipeline/hf_families.py
PIPELINE_DECODERS) runs its stages as its own model: two stages chained in one process, in
float64, give the model's loss and gradients, for a tied and an untied head, a left-padded batch,
and a config that asks for sliding windows (which only the families whose forward reads them
apply: the stages must follow the model's forward, not the config). Four of them also train at
pp = 2 through the engine within the float64 oracle of one process."""
from __future__ import annotations

import copy

import pytest
import torch

from reference import Oracle, engine_train, global_batches, make_config, reference_train
from tiertrain.pipeline.hf_families import PIPELINE_DECODERS
from tiertrain.pipeline.hf_split import split_hf
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the references: see conftest.py

SMALL = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, vocab_size=256, max_position_embeddings=64, pad_token_id=0)
VARIANTS = ("untied", "tied", "padded", "windows")
BOUND = 1e-12
"""Two float64 computations of the same operations (measured: 0). Another mask moves the loss by
far more: with the mask rule the stages used before, the "windows" variant's loss is 7e-5 to
3e-3 off (relative) for 24 of the 28 families."""


def _model(model_type, variant="untied", dtype=torch.float64):
    config = transformers.AutoConfig.for_model(model_type, **SMALL)
    for key, value in list(vars(config).items()):
        if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
            setattr(config, key, 0.0)
    config.tie_word_embeddings = variant == "tied"
    if variant == "windows":  # (set whether or not the family's forward reads them)
        config.sliding_window = 4
        if hasattr(config, "use_sliding_window"):
            config.use_sliding_window = True
        config.layer_types = ["sliding_attention", "full_attention"] * 2
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).to(dtype).train()


def _batch(variant):
    ids = torch.randint(1, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    if variant == "padded":  # left padding, as generation-style batches come
        mask = torch.ones_like(ids)
        mask[1, :5] = 0
        batch = {**batch, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    return batch


def _gradients(named):
    return {n: p.grad for n, p in named if p.grad is not None}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model_type", sorted(PIPELINE_DECODERS))
def test_two_chained_stages_are_the_model_in_float64(model_type):
    for variant in VARIANTS:
        model = _model(model_type, variant)
        if variant == "windows" and getattr(model.config, "sliding_window", None) != 4:
            continue  # (a config that keeps no window)
        batch = _batch(variant)
        whole = copy.deepcopy(model)
        expected = whole(**batch).loss
        expected.backward()
        stages = split_hf(model, 2)
        loss = stages[1](stages[0](None, batch), batch)
        loss.backward()
        grads = _gradients(p for s in stages for p in s.named_parameters())
        if stages[0].tied:  # the last stage's copy: its gradient is the embedding's other half
            first, last = stages[0].tied_names
            grads[first] = grads[first] + grads.pop(last)
        wanted = _gradients(whole.named_parameters())
        what = f"{model_type} ({variant})"
        assert set(grads) == set(wanted), what
        assert abs(loss.item() - expected.item()) <= BOUND * abs(expected.item()), what
        for name, g in wanted.items():
            assert float((grads[name] - g).abs().max()) <= BOUND * float(g.abs().max()), (what, name)


ENGINE_CASES = [("gemma", 1), ("olmo2", 3), ("phi3", 2), ("ministral", 1)]
"""(family, ZeRO stage): a tied head with its embedding scaled inside its module (Gemma),
normalisation after attention and the MLP with norms on the queries and keys (OLMo 2), a
sliding window on every layer (Phi-3), per-layer sliding and full attention (Ministral)."""

MICRO, ACCUM, STEPS = 2, 2, 2


def _config(stage, pp=2):
    return make_config(zero={"stage": stage, "bucket_mb": 0.02}, parallel={"pp": pp},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": ACCUM},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _variant(model_type):
    return "tied" if model_type == "gemma" else "windows"


def _batches():
    return [{"input_ids": b["input_ids"], "labels": b["input_ids"]} for b in global_batches(STEPS, MICRO * ACCUM)]


def _train(rank, world):
    out = []
    for model_type, stage in ENGINE_CASES:
        model = _model(model_type, _variant(model_type), torch.float32)
        losses, params, engine = engine_train(rank, world, model, _config(stage), _batches())
        out.append((losses, params))
        engine.close()
    return out


@pytest.mark.timeout(120)
def test_new_families_train_at_pp2_within_the_oracle():
    results = run_distributed(_train, 2, timeout=100)
    for k, (model_type, stage) in enumerate(ENGINE_CASES):
        oracle = Oracle.run(reference_train, _model(model_type, _variant(model_type), torch.float32),
                            _config(stage, pp=1), _batches())
        for losses, params in (r[k] for r in results):
            oracle.check(losses, None, f"{model_type} losses")
            if model_type == "gemma":
                assert torch.equal(params.pop("lm_head.weight"), params["model.embed_tokens.weight"])
            oracle.check(None, params, f"{model_type} parameters")


def test_a_family_whose_forward_does_more_is_refused_and_a_part_no_stage_holds_is_named():
    """Granite's forward multiplies the embeddings and divides the logits by config values that
    the stages would skip; a parameter outside the family's parts (an extra head) would be
    neither trained nor saved by any stage."""
    granite = transformers.GraniteForCausalLM(transformers.GraniteConfig(**{**SMALL, "head_dim": 8}))
    with pytest.raises(ValueError, match=r"GraniteForCausalLM \(model_type='granite'\) has the Llama layout"):
        split_hf(granite, 2)
    llama = _model("llama", dtype=torch.float32)
    llama.extra_head = torch.nn.Linear(32, 4)
    with pytest.raises(ValueError, match=r"extra_head.weight, extra_head.bias are in none of its rotary family's "
                                         r"parts .* train it at parallel.pp=1"):
        split_hf(llama, 2)
