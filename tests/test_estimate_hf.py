"""The estimator and planner for any Hugging Face model (tiertrain.estimate.modules).

Tiny configs of each modelled family (GQA Llama, GPT-2, BERT, T5, BART), built from code.
"""
import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from tiertrain.estimate import ZeroLayout, estimate  # noqa: E402
from tiertrain.estimate.modules import build_meta_model, dims_of_hf_config, dims_of_module  # noqa: E402
from tiertrain.estimate.hardware import Hardware  # noqa: E402
from tiertrain.estimate.plan import plan  # noqa: E402

V = 96


def _configs():
    t = transformers
    return {
        "llama-gqa": t.LlamaConfig(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=V, max_position_embeddings=128),
        "gpt2": t.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=V, n_positions=128),
        "bert": t.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=160,
                             vocab_size=V, max_position_embeddings=128),
        "t5": t.T5Config(d_model=64, d_kv=16, d_ff=160, num_layers=2, num_decoder_layers=2, num_heads=4,
                         vocab_size=V, decoder_start_token_id=0, pad_token_id=0),
        "bart": t.BartConfig(d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                             decoder_attention_heads=4, encoder_ffn_dim=160, decoder_ffn_dim=160, vocab_size=V,
                             max_position_embeddings=128),
    }


CONFIGS = _configs()


def _real(cfg):
    t = transformers
    auto = (t.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else
            t.AutoModelForMaskedLM if cfg.model_type == "bert" else t.AutoModelForCausalLM)
    torch.manual_seed(0)
    return auto.from_config(cfg)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_parameter_count_equals_the_real_model(name):
    cfg = CONFIGS[name]
    real = _real(cfg)
    d = dims_of_hf_config(cfg, seq_len=32)
    assert d.num_parameters() == sum(p.numel() for p in real.parameters())
    assert d.trainable_parameters == d.parameters
    assert next(build_meta_model(cfg).parameters()).is_meta


def _saved_bytes(model, batch):
    """Bytes autograd saves for backward in one forward: each storage once, parameters
    (weights saved by linears) excluded."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in params:
            seen.setdefault(st.data_ptr(), st.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(**batch)
    return sum(seen.values()), out


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_activation_model_matches_saved_tensors(name):
    """Predicted saved-for-backward bytes (blocks + embeddings/head + loss) against what
    saved_tensors_hooks sees in one training forward with labels, fp32. Bound 3%: what the
    model leaves out is O(b·s) and O(s²) bookkeeping (position ids, masks of ints/bools,
    rotary cos/sin tables, the loss's shifted labels), 0.5–2% at these sizes; a missing or
    extra tensor of the smallest modelled size (s·b·h) would be ≥ 3.5% of the total here."""
    cfg = CONFIGS[name]
    model = _real(cfg).train()
    s, b = 40, 3
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, V, (b, s), generator=g)
    batch = {"input_ids": ids, "labels": torch.randint(0, V, (b, s), generator=g)}
    measured, out = _saved_bytes(model, batch)
    assert out.loss is not None
    d = dims_of_module(model, seq_len=s)
    acts = d.activation_bytes(b, 4)
    predicted = sum(acts.blocks) + acts.head
    assert abs(predicted - measured) / measured < 0.03, (name, predicted, measured)
    # the blocks alone, against a model with one more block per stack
    cfg2 = cfg.__class__.from_dict({**cfg.to_dict(), **{k: v + 1 for k, v in cfg.to_dict().items() if k in (
        "num_hidden_layers", "n_layer", "num_layers", "num_decoder_layers", "encoder_layers", "decoder_layers")}})
    measured2, _ = _saved_bytes(_real(cfg2).train(), batch)
    per_block = sum(dims_of_hf_config(cfg2, seq_len=s).activation_bytes(b, 4).blocks) - sum(acts.blocks)
    assert abs(per_block - (measured2 - measured)) / (measured2 - measured) < 0.03, (name, per_block,
                                                                                     measured2 - measured)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_activation_model_in_bf16(name):
    """The same in bf16 (what the engine's 16-bit compute runs): norms keep an fp32 copy,
    SDPA's CPU math path upcasts Q, K, V and the s×s tensors to fp32. Bound 5%: the int64
    ids/labels and the small fp32 bookkeeping the model leaves out do not halve with the
    dtype, so their share doubles against the 3% of fp32; a tensor counted at the wrong
    width (2 instead of 4 bytes) on the math path would be off by ≥ 10% here."""
    model = _real(CONFIGS[name]).to(torch.bfloat16).train()
    ids = torch.randint(0, V, (3, 40), generator=torch.Generator().manual_seed(1))
    measured, _ = _saved_bytes(model, {"input_ids": ids, "labels": ids})
    acts = dims_of_module(model, seq_len=40).activation_bytes(3, 2)
    predicted = sum(acts.blocks) + acts.head
    assert abs(predicted - measured) / measured < 0.05, (name, predicted, measured)


def test_attention_path_follows_the_config():
    assert dims_of_hf_config(CONFIGS["llama-gqa"], 32).attention == "flash"  # sdpa, no dropout
    assert dims_of_hf_config(CONFIGS["bert"], 32).attention == "math"  # attention dropout 0.1
    nodrop = transformers.BertConfig(**{**CONFIGS["bert"].to_dict(), "attention_probs_dropout_prob": 0.0})
    d0, d1 = dims_of_hf_config(nodrop, 64), dims_of_hf_config(CONFIGS["bert"], 64)
    assert d0.attention == "flash"
    assert d1.activation_bytes(2, 4).block > d0.activation_bytes(2, 4).block  # the s×s tensors


def test_gqa_kv_heads_lower_the_activations():
    full = transformers.LlamaConfig(**{**CONFIGS["llama-gqa"].to_dict(), "num_key_value_heads": 4})
    gqa = dims_of_hf_config(CONFIGS["llama-gqa"], 64).activation_bytes(1, 4).block
    mha = dims_of_hf_config(full, 64).activation_bytes(1, 4).block
    assert mha - gqa == 2 * 64 * (64 - 32) * 4  # K and V: kv_dim 32 instead of 64


def test_frozen_parameters_are_counted_apart():
    model = _real(CONFIGS["llama-gqa"])
    model.model.embed_tokens.weight.requires_grad_(False)
    d = dims_of_module(model, seq_len=16)
    assert d.parameters - d.trainable_parameters == V * 64
    full = estimate(dims_of_hf_config(CONFIGS["llama-gqa"], 16), ZeroLayout(dp=2, stage=2, precision="fp32"))
    frozen = estimate(d, ZeroLayout(dp=2, stage=2, precision="fp32"))
    assert frozen.line("optimizer states").bytes < full.line("optimizer states").bytes


@pytest.mark.parametrize("name", ["llama-gqa", "t5"])
def test_estimate_and_plan_accept_hf_dims(name):
    d = dims_of_hf_config(CONFIGS[name], seq_len=64)
    est = estimate(d, ZeroLayout(dp=2, stage=3, precision="fp32", micro_batch=2))
    assert est.line("activations (blocks)").bytes > 0
    assert est.to_dict()["dims"]["model_type"] == CONFIGS[name].model_type
    p = plan(d, Hardware(ranks_per_node=2, host_memory=8 << 30), precision="fp32", micro_batch=2)
    assert p.fits and p.layout.stage == 0 and "model" not in p.config_dict()
    assert p.usage["ram"] == p.estimate.total()
    # a budget just under stage 0's peak: the planner must move on to a partitioned stage
    stage0 = p.estimate.total()
    tight = plan(d, Hardware(ranks_per_node=2, host_memory=int(stage0 * 0.99 * 2 / 0.9)), precision="fp32",
                 micro_batch=2)
    assert tight.fits and tight.layout.stage >= 1 and tight.estimate.total() < stage0


def test_plain_module_and_bad_inputs_raise_clearly(tmp_path):
    with pytest.raises(ValueError, match="cannot be modelled.*dims_of_hf_config"):
        dims_of_module(torch.nn.Linear(4, 4), seq_len=8)
    with pytest.raises(ValueError, match="no such file"):
        dims_of_hf_config(tmp_path / "missing.json")
    (tmp_path / "x.json").write_text('{"a": 1}')
    with pytest.raises(ValueError, match="model_type"):
        dims_of_hf_config(tmp_path / "x.json")
    (tmp_path / "y.json").write_text("not json")
    with pytest.raises(ValueError, match="not a JSON file"):
        dims_of_hf_config(tmp_path / "y.json")
    with pytest.raises(ValueError, match="not modelled for this family"):
        dims_of_hf_config(transformers.OPTConfig(hidden_size=32, num_hidden_layers=1, ffn_dim=64,
                                                 num_attention_heads=2, vocab_size=64), 8)
    with pytest.raises(ValueError, match="seq_len=0"):
        dims_of_hf_config(CONFIGS["gpt2"], 0)
    bert = transformers.BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   vocab_size=64).to_dict()
    for change, raised in (({"num_attention_heads": 0}, "ZeroDivisionError"),
                           ({"intermediate_size": -64}, "RuntimeError")):
        (tmp_path / "z.json").write_text(json.dumps({**bert, **change}))
        with pytest.raises(ValueError, match=rf"describes no model transformers can build \({raised}: .*\): its sizes"):
            dims_of_hf_config(tmp_path / "z.json")
    (tmp_path / "z.json").write_text(json.dumps({**bert, "model_type": {"a": 1}}))
    with pytest.raises(ValueError, match=r"is not a config transformers accepts \(TypeError"):
        dims_of_hf_config(tmp_path / "z.json")


def test_a_config_of_no_real_size_is_refused_before_or_while_it_builds(monkeypatch):
    """Found by the config fuzzer: a layer count of 2^70 built modules for hours. A depth past
    MAX_LAYERS is refused before building, any other size past MAX_MODULES while it builds."""
    from tiertrain.estimate import modules

    gpt2 = dict(n_embd=16, n_head=2, vocab_size=64, bos_token_id=0, eos_token_id=0)
    with pytest.raises(ValueError, match=r"\{'n_layer': 1180591620717411303424\} exceeds 10000 layers"):
        dims_of_hf_config(transformers.GPT2Config(**gpt2, n_layer=2 ** 70), 8)
    with pytest.raises(ValueError, match=r"num_layers': 1180591620717411303424.*exceeds 10000 layers"):
        dims_of_hf_config(transformers.T5Config(d_model=16, d_ff=32, num_heads=2, d_kv=8, vocab_size=64,
                                                num_layers=2 ** 70), 8)
    monkeypatch.setattr(modules, "MAX_MODULES", 100)
    with pytest.raises(ValueError, match=r"more than 100 modules \(\{'n_layer': 40\}\)"):
        dims_of_hf_config(transformers.GPT2Config(**gpt2, n_layer=40), 8)
    assert dims_of_hf_config(transformers.GPT2Config(**gpt2, n_layer=2), 8).n_decoder_layers == 2


def _meta(cfg, **changes):
    t = transformers
    cfg = cfg.__class__.from_dict({**cfg.to_dict(), **changes})
    auto = t.AutoModelForSeq2SeqLM if cfg.is_encoder_decoder else t.AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(cfg)


def test_the_models_own_checkpointing_is_read_from_its_layers():
    """transformers' gradient_checkpointing_enable marks the layers it checkpoints (every_n_layers
    counts them in order, an encoder-decoder's encoder then decoder): blocks 0, k, 2k, … give
    k; another pattern counts as evenly spread checkpoints no more numerous than its own."""
    from tiertrain.blocks import own_checkpoint_interval

    llama = _meta(CONFIGS["llama-gqa"], num_hidden_layers=5)
    assert own_checkpoint_interval(llama) == 0 and dims_of_module(llama, 16).own_checkpointing == 0
    for every, expected in ((1, 1), (2, 2), (3, 3), (5, 5)):
        llama.gradient_checkpointing_enable(every_n_layers=every)
        assert own_checkpoint_interval(llama) == expected
    llama.gradient_checkpointing_disable()
    llama.model.layers[1].gradient_checkpointing = True  # one checkpoint, not at block 0
    assert own_checkpoint_interval(llama) == 5
    llama.model.layers[3].gradient_checkpointing = True
    assert own_checkpoint_interval(llama) == 3  # two, spread: blocks 0 and 3
    t5 = _meta(CONFIGS["t5"])  # 2 + 2 blocks
    t5.gradient_checkpointing_enable(every_n_layers=2)
    assert dims_of_module(t5, 16).own_checkpointing == 2
    assert dims_of_hf_config(CONFIGS["t5"], 16).own_checkpointing == 0

    class Older(torch.nn.Module):  # transformers < 4.52: one flag on the model, every layer checkpointed
        is_gradient_checkpointing = True

    assert own_checkpoint_interval(Older()) == 1 and own_checkpoint_interval(torch.nn.Linear(2, 2)) == 0


@pytest.mark.parametrize("name", ["llama-gqa", "t5"])
def test_a_model_that_checkpoints_itself_is_estimated_with_its_checkpoints_and_planned_without_more(name):
    """Its blocks keep only their inputs, as with the engine's activations.checkpoint_every
    (measured in plain PyTorch, an 8-layer Llama, b·s = 4·1024, h = 512, fp32: +645 MB after
    forward with transformers' checkpointing, +604 MB with the engine's, +2072 MB with none),
    so the estimate is the one of that interval; the engine refuses to add its own beside it,
    so the plan never does, even where RAM is short for the model counted whole."""
    model = _meta(CONFIGS[name])
    plain = dims_of_module(model, seq_len=64)
    model.gradient_checkpointing_enable()
    own = dims_of_module(model, seq_len=64)
    layout = ZeroLayout(dp=2, stage=3, precision="fp32", micro_batch=2)
    counted = estimate(own, layout)
    as_engine = estimate(plain, dataclasses.replace(layout, checkpoint_interval=1))
    assert [(l.name, l.bytes) for l in counted.lines] == [(l.name, l.bytes) for l in as_engine.lines]
    assert counted.total() < estimate(plain, layout).total()
    assert any("checkpoints every 1-th block itself" in n for n in counted.notes)
    with pytest.raises(ValueError, match="checkpoint_interval=1 is invalid for this model.*checkpoint_interval=0"):
        estimate(own, dataclasses.replace(layout, checkpoint_interval=1))
    budget = (counted.total() + estimate(plain, layout).total()) // 2
    hw = Hardware(ranks_per_node=2, host_memory=int(2 * budget / 0.9))
    whole = plan(plain, hw, precision="fp32", micro_batch=2, stages=[3])
    assert whole.fits and whole.config_dict()["activations"]["checkpoint_every"] > 0  # short without them
    chosen = plan(own, hw, precision="fp32", micro_batch=2, stages=[3])
    assert chosen.fits and chosen.config_dict()["activations"]["checkpoint_every"] == 0
    assert chosen.usage["ram"] == counted.total() and any("the engine adds none" in n for n in chosen.notes)


def _cli(capsys, *args):
    """Run the CLI in this process (importing torch and transformers again per command would
    take most of this file's time budget); (exit status, stdout, stderr)."""
    from tiertrain.cli import main

    code = main(list(args))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_cli_estimate_and_plan_with_hf_config(tmp_path, capsys):
    CONFIGS["llama-gqa"].save_pretrained(tmp_path / "llama")
    path = str(tmp_path / "llama" / "config.json")
    code, out, err = _cli(capsys, "estimate", "--hf-config", path, "--seq", "64", "--stage", "2", "--dp", "2",
                          "--json")
    assert code == 0, err
    est = json.loads(out)
    assert est["parameters"] == dims_of_hf_config(path).parameters
    assert est["dims"]["seq_len"] == 64 and est["dims"]["kv_heads"] == 2
    code, out, err = _cli(capsys, "plan", "--hf-config", str(tmp_path / "llama"), "--seq", "64", "--nproc", "2",
                          "--ram", "8GiB", "--micro-batch", "2", "--out", str(tmp_path / "plan.yaml"))
    assert code == 0, err
    assert "llama decoder" in out and "FITS" in out
    assert "zero:" in (tmp_path / "plan.yaml").read_text()
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    for cmd in ("estimate", "plan"):
        code, out, err = _cli(capsys, cmd, "--hf-config", str(bad))
        assert code == 2 and str(bad) in err and "config.json" in err, err
        assert len(err.strip().splitlines()) == 1
    code, out, err = _cli(capsys, "estimate", "--hf-config", path, "--layers", "2")
    assert code == 2 and "--layers" in err
