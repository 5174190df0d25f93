"""tiertrain.load_pretrained: a Hugging Face safetensors checkpoint streamed into an engine at any
ZeRO stage and tier, into a model built under partitioned_init, or into a plain module, each
rank reading only what it keeps (ZeRO-Infinity §5.3, ease of use), bit for bit."""
from __future__ import annotations

import json
import os
import re

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import load_file, save_file, save_model

import tiertrain
from reference import Oracle, global_batches, make_config, make_model, rank_slices, reference_train
from tiertrain.state.pretrained import PretrainedMismatchError
from tiertrain.testing import run_distributed

import zoo  # noqa: E402  (tests/zoo.py: its MoE builders)
from tiertrain.zero.construct import full_shape, is_partitioned

T = transformers


# -- small Hugging Face models (no download), each built from a seed -----------------------------

def _llama_config(**overrides):
    return T.LlamaConfig(**{**dict(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                   tie_word_embeddings=False), **overrides})


def _build(name: str, seed: int) -> torch.nn.Module:
    """Llama with grouped-query attention, GPT-2 and BERT with tied heads, T5 and BART (one
    embedding shared by encoder, decoder and head), from small configs."""
    torch.manual_seed(seed)
    if name == "llama":
        return T.LlamaForCausalLM(_llama_config())
    if name == "gpt2":
        return T.GPT2LMHeadModel(T.GPT2Config(vocab_size=256, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                              resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    if name == "bert":
        return T.BertForMaskedLM(T.BertConfig(
            vocab_size=256, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0))
    if name == "t5":
        return T.T5ForConditionalGeneration(T.T5Config(
            vocab_size=256, d_model=32, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4, d_kv=8,
            relative_attention_num_buckets=8, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0))
    if name == "bart":
        return T.BartForConditionalGeneration(T.BartConfig(
            vocab_size=256, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
            decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
            dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
            eos_token_id=2, decoder_start_token_id=2))
    if name in CONVERTED:
        return CONVERTED[name]()
    if name == "gpt":  # tiertrain's own GPT (embedding tied to the head)
        return make_model(seed)
    raise ValueError(name)


def _vit():
    return T.ViTForImageClassification(T.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                                   intermediate_size=64, image_size=16, patch_size=4, num_labels=3))


CONVERTED = {"mixtral": zoo.mixtral, "qwen2_moe": zoo.qwen2_moe, "vit": _vit}
"""Families whose checkpoints transformers converts on load (issue 34, item 7): experts one
tensor each on disk and stacked in memory (Mixtral, Qwen2-MoE), layers renamed (ViT)."""
ARCHS = ("llama", "gpt2", "bert", "t5", "bart", *CONVERTED)

# (label, architecture, checkpoint directory, zero section, precision section, frozen prefixes)
ENGINE_CASES = [
    ("llama sharded, stage 3", "llama", "llama_sharded", {"stage": 3}, {}, ()),
    ("gpt2 tied, stage 3", "gpt2", "gpt2", {"stage": 3}, {}, ()),
    ("bert tied, stage 3, embeddings and layer 0 frozen (frozen units)", "bert", "bert", {"stage": 3}, {},
     ("bert.embeddings.", "bert.encoder.layer.0.")),
    ("t5 shared, stage 3", "t5", "t5", {"stage": 3}, {}, ()),
    ("bart shared, stage 3", "bart", "bart", {"stage": 3}, {}, ()),
    ("llama bf16, stage 1 (resident units), layer 0 frozen (plain parameters)", "llama", "llama", {"stage": 1},
     {"dtype": "bf16"}, ("model.layers.0.",)),
    ("gpt2, stage 3, params+optimizer on cpu, small params persistent", "gpt2", "gpt2",
     {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu", "persistence_threshold": 64}, {}, ()),
    ("llama bf16, stage 3, params+optimizer on nvme", "llama", "llama",
     {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_chunk_mb": 0.01}, {"dtype": "bf16"},
     ()),
    # (fp32 shards on NVMe are the optimizer's masters: one write of each)
    ("mixtral experts, stage 3", "mixtral", "mixtral", {"stage": 3}, {}, ()),
    ("qwen2 moe, stage 1, bf16", "qwen2_moe", "qwen2_moe", {"stage": 1}, {"dtype": "bf16"}, ()),
    ("qwen2 moe, stage 3, params+optimizer on nvme", "qwen2_moe", "qwen2_moe",
     {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_chunk_mb": 0.01}, {}, ()),
    ("vit renamed layers, stage 3", "vit", "vit", {"stage": 3}, {}, ()),
    ("gpt2 tied, stage 3, params+optimizer on nvme in place", "gpt2", "gpt2",
     {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_chunk_mb": 0.01, "nvme_in_place": True},
     {}, ()),
]


def _save_checkpoints(root: str) -> None:
    """Every model built with seed 0 and saved as Hugging Face saves it; one sharded."""
    for name in ARCHS:
        _build(name, 0).save_pretrained(os.path.join(root, name), safe_serialization=True)
    _build("llama", 0).save_pretrained(os.path.join(root, "llama_sharded"), safe_serialization=True,
                                       max_shard_size="20KB")
    os.makedirs(os.path.join(root, "gpt"))
    save_model(_build("gpt", 0), os.path.join(root, "gpt", "model.safetensors"))  # (drops the tied copy)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, one_torch_thread):
    root = str(tmp_path_factory.mktemp("pretrained"))
    _save_checkpoints(root)
    return root


def _state(name: str) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in _build(name, 0).state_dict().items()}


def _report(r: tiertrain.LoadReport) -> dict:
    return dict(bytes_read=r.bytes_read, largest_read=r.largest_read, loaded=len(r.loaded), missing=r.missing,
                unexpected=r.unexpected, files=len(r.files))


# -- per rank: every engine case in one launch ---------------------------------------------------

def _engine_cases(rank, world, root):
    out = {}
    for label, arch, ckpt, zero, precision, frozen in ENGINE_CASES:
        zero = dict(zero, nvme_path=os.path.join(root, "swap", str(len(out)))) if "nvme" in str(zero) else zero
        cfg = make_config(zero=zero, precision=precision, batch={"micro_batch_size": 2})
        topology = tiertrain.Topology.build(cfg.parallel)
        model = _build(arch, 1)  # another seed: other weights
        for name, p in model.named_parameters():
            p.requires_grad_(not name.startswith(frozen) if frozen else True)
        engine = tiertrain.wrap(model, cfg, topology)
        report = tiertrain.load_pretrained(engine, os.path.join(root, ckpt))
        with engine.gathered_parameters():  # the compute-dtype values the forward will use
            compute = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        if frozen:
            out["frozen units"] = out.get("frozen units", 0) + len(engine.flat.all_units) - len(engine.flat.units)
            in_layout = {s.name for u in engine.flat.all_units for s in u.unit.slots}
            out["plain frozen"] = out.get("plain frozen", 0) + sum(
                not p.requires_grad and n not in in_layout for n, p in engine.module.named_parameters())
        buffers = {n: b.detach().clone() for n, b in engine.module.named_buffers()}
        params = {n: v for n, v in engine.full_state_dict().items() if n not in buffers}  # (it holds buffers too)
        out[label] = dict(params=params, compute=compute, report=_report(report), buffers=buffers)
        engine.close()

    # A strict failure raises on every rank before anything is written.
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(_build("gpt2", 1), cfg, tiertrain.Topology.build(cfg.parallel))
    before = engine.full_state_dict()
    try:
        tiertrain.load_pretrained(engine, os.path.join(root, "llama"))
        out["error"] = None
    except PretrainedMismatchError as e:
        out["error"] = str(e)
    after = engine.full_state_dict()
    out["untouched"] = all(torch.equal(before[n], after[n]) for n in before)
    engine.close()
    return out


def _partitioned_models(rank, world, root):
    """A model built under partitioned_init, loaded before wrapping; then wrapped at stage 3
    and trained: it trains as the reference does from the checkpoint's weights."""
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2})
    topology = tiertrain.Topology.build(cfg.parallel)
    with tiertrain.partitioned_init(topology):
        llama = _build("llama", 1)
    tiertrain.load_pretrained(llama, os.path.join(root, "llama_sharded"), topology=topology)
    llama_shards = {n: (p.detach().clone(), tuple(full_shape(p))) for n, p in llama.named_parameters()
                    if is_partitioned(p)}
    with tiertrain.partitioned_init(topology):
        model = _build("gpt", 1)
    report = tiertrain.load_pretrained(model, os.path.join(root, "gpt"), topology=topology)
    shards = {n: (p.detach().clone(), tuple(full_shape(p))) for n, p in model.named_parameters()
              if is_partitioned(p)}
    engine = tiertrain.wrap(model, cfg, topology)
    loaded = engine.full_state_dict()
    losses = []
    for batch in global_batches(2, 2 * world):
        loss = engine.train_batch(rank_slices(batch, rank, world, 2, 1))
        t = torch.tensor([loss], dtype=torch.float64)
        torch.distributed.all_reduce(t)
        losses.append(float(t) / world)
    return dict(shards=shards, llama_shards=llama_shards, report=_report(report), loaded=loaded, losses=losses,
                trained=engine.full_state_dict())


def _check_shards(shards: dict, ref: torch.nn.Module, rank: int, what: str) -> None:
    """Each parameter holds flat elements [rank·n, (rank+1)·n) of the reference's (n its size)."""
    flat = {n: p.detach().reshape(-1) for n, p in ref.named_parameters()}
    assert shards.keys() == flat.keys(), f"{what}: parameters left whole: {sorted(flat.keys() - shards.keys())}"
    for n, (shard, shape) in shards.items():
        per = shard.numel()
        want = flat[n][rank * per:(rank + 1) * per]
        assert shape == tuple(ref.get_parameter(n).shape)
        assert torch.equal(shard[:want.numel()], want), f"{what}, rank {rank}: shard of {n}"


# -- the tests -----------------------------------------------------------------------------------

@pytest.mark.timeout(120)
def test_engine_at_every_stage_and_tier_gets_the_checkpoint_bit_for_bit(checkpoints):
    per_rank = run_distributed(_engine_cases, 2, checkpoints, timeout=110)
    results = per_rank[0]
    assert per_rank[0]["frozen units"] > 0 and per_rank[0]["plain frozen"] > 0, "no frozen case exercised"
    references = {arch: _state(arch) for arch in ARCHS}
    for label, arch, ckpt, zero, precision, frozen in ENGINE_CASES:
        got, ref = results[label], references[arch]
        params = got["params"]
        # (frozen parameters keep only their compute-dtype value: no fp32 master)
        want = {n: ref[n].to(torch.bfloat16).float() if precision and n.startswith(frozen) else ref[n] for n in params}
        differ = sorted(n for n in params if not torch.equal(params[n], want[n]))
        assert not differ, f"{label}: parameters differ from the checkpoint: {differ}"
        missing = sorted(n for n, _ in _build(arch, 0).named_parameters() if n not in params)
        assert not missing, f"{label}: not in full_state_dict: {missing}"
        for n, b in got["buffers"].items():
            if n in ref:  # persistent buffers come from the checkpoint too
                assert torch.equal(b, ref[n].to(b.dtype)), f"{label}: buffer {n} differs"
        for n, p in got["compute"].items():  # (bf16: the checkpoint rounded once)
            assert torch.equal(p, ref[n].to(p.dtype)), f"{label}: compute-dtype {n} differs"
        assert got["compute"].keys() == params.keys(), label
        assert got["report"]["missing"] == [] and got["report"]["unexpected"] == []
    assert results["llama sharded, stage 3"]["report"]["files"] > 2  # really read from several shards
    bf16 = results["llama bf16, stage 3, params+optimizer on nvme"]["compute"]
    assert {p.dtype for p in bf16.values()} == {torch.bfloat16}

    # Memory: no read is larger than the largest tensor, and at stage 3 each rank reads about half.
    for label, arch, ckpt, zero, _, _ in ENGINE_CASES:
        ref = references[arch]
        largest = max(t.numel() * t.element_size() for t in ref.values())
        total = sum(os.path.getsize(os.path.join(checkpoints, ckpt, f)) for f in os.listdir(os.path.join(checkpoints, ckpt))
                    if f.endswith(".safetensors"))
        for rank, rank_results in enumerate(per_rank):
            r = rank_results[label]["report"]
            assert r["largest_read"] <= largest, f"{label}, rank {rank}: a read of {r['largest_read']} bytes"
            if zero["stage"] == 3 and arch not in CONVERTED:  # (a converted tensor is read whole)
                assert r["bytes_read"] < 0.6 * total, f"{label}, rank {rank}: read {r['bytes_read']} of {total}"
            assert r["bytes_read"] <= total, f"{label}, rank {rank}: read {r['bytes_read']} of {total}"
        if zero["stage"] == 3:
            assert sum(rr[label]["report"]["bytes_read"] for rr in per_rank) >= 0.95 * total - 8 * 1024
        else:
            assert all(rr[label]["report"]["bytes_read"] >= 0.95 * total - 8 * 1024 for rr in per_rank)

    message = results["error"]
    assert message is not None and per_rank[1]["error"] == message
    assert "shapes differ" in message or "missing from the checkpoint" in message, message
    assert results["untouched"], "a failed strict load changed the engine's parameters"


@pytest.mark.timeout(90)
def test_partitioned_init_model_loads_its_shards_and_trains_like_the_reference(checkpoints):
    per_rank = run_distributed(_partitioned_models, 2, checkpoints, timeout=80)
    ref = _build("gpt", 0)
    numel = sum(p.numel() for p in ref.parameters())
    for rank, got in enumerate(per_rank):
        _check_shards(got["shards"], ref, rank, "GPT")
        _check_shards(got["llama_shards"], _build("llama", 0), rank, "Llama from a sharded checkpoint")
        assert got["report"]["bytes_read"] < 0.6 * numel * 4
    loaded = per_rank[0]["loaded"]
    assert all(torch.equal(loaded[n], p) for n, p in dict(ref.named_parameters()).items())
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2})
    oracle = Oracle.run(reference_train, ref, cfg, global_batches(2, 4))
    oracle.check(per_rank[0]["losses"], per_rank[0]["trained"], "GPT loaded under partitioned_init")


# -- plain modules, in this process --------------------------------------------------------------

@pytest.mark.timeout(60)
def test_plain_modules_single_file_and_dtype_cast(checkpoints, tmp_path):
    for arch in ("gpt2", "t5"):
        model = _build(arch, 1)
        report = tiertrain.load_pretrained(model, os.path.join(checkpoints, arch, "model.safetensors"))
        ref = _state(arch)
        assert all(torch.equal(v, ref[k]) for k, v in model.state_dict().items()), arch
        assert report.missing == [] and report.unexpected == []
    # A bf16 checkpoint into an fp32 model: cast.
    state = {k: v.to(torch.bfloat16) for k, v in _build("gpt", 0).state_dict().items() if k != "head.weight"}
    save_file(state, str(tmp_path / "bf16.safetensors"))
    model = _build("gpt", 1)
    report = tiertrain.load_pretrained(model, tmp_path / "bf16.safetensors")
    assert all(torch.equal(p, state[n].float()) for n, p in model.named_parameters()), report
    assert report.bytes_read == sum(v.numel() * 2 for v in state.values())


@pytest.mark.timeout(60)
def test_base_model_prefix_either_way(tmp_path):
    torch.manual_seed(0)
    base = T.LlamaModel(_llama_config())
    base.save_pretrained(tmp_path / "base", safe_serialization=True)
    head = _build("llama", 1)
    with pytest.raises(PretrainedMismatchError, match=r"missing from the checkpoint \(1\): lm_head\.weight"):
        tiertrain.load_pretrained(head, tmp_path / "base")
    with pytest.warns(tiertrain.PretrainedMissingWarning, match=r"keep their initial \(random\) values: lm_head.weight"):
        report = tiertrain.load_pretrained(head, tmp_path / "base", strict=False)
    assert report.missing == ["lm_head.weight"] and report.name_mapping == "without prefix model."
    assert all(torch.equal(p, head.get_parameter("model." + n)) for n, p in base.named_parameters())

    head.save_pretrained(tmp_path / "head", safe_serialization=True)
    torch.manual_seed(1)
    other = T.LlamaModel(_llama_config())
    report = tiertrain.load_pretrained(other, tmp_path / "head")  # strict: the head's tensor is no error
    assert report.ignored == ["lm_head.weight"] and report.name_mapping == "with prefix model."
    assert all(torch.equal(p, head.get_parameter("model." + n)) for n, p in other.named_parameters())


def test_a_checkpoint_trained_untied_is_refused_by_a_model_that_ties_the_two(tmp_path):
    """A model whose config ties the head to the embeddings, given a checkpoint holding both with
    different values (trained untied, or converted from another framework), loaded the embeddings
    into the one shared tensor and ignored the head in silence: a model with another output layer.
    transformers unties such a model; tiertrain's engine cannot, so it names both and the fix."""
    def llama(tied: bool, seed: int):
        torch.manual_seed(seed)
        return T.LlamaForCausalLM(_llama_config(tie_word_embeddings=tied))
    llama(False, 0).save_pretrained(tmp_path / "untied")
    model = llama(True, 1)
    before = {n: v.clone() for n, v in model.state_dict().items()}
    for strict in (True, False):
        with pytest.raises(PretrainedMismatchError, match=r"hold different values in the checkpoint \(model\."
                                                          r"embed_tokens\.weight and lm_head\.weight\).*"
                                                          r"tie_word_embeddings=False"):
            tiertrain.load_pretrained(model, tmp_path / "untied", strict=strict)
    assert all(torch.equal(v, model.state_dict()[n]) for n, v in before.items())
    llama(True, 0).save_pretrained(tmp_path / "tied")  # (written once: save_pretrained drops the tied copy)
    torch.save(llama(True, 0).state_dict(), tmp_path / "both.bin")  # (both names, the same values)
    for path in (tmp_path / "tied", tmp_path / "both.bin"):
        tiertrain.load_pretrained(model, path)
        assert torch.equal(model.lm_head.weight, llama(True, 0).lm_head.weight)


@pytest.mark.timeout(60)
def test_a_converted_checkpoint_loads_into_a_plain_module_and_strict_false_names_what_stays_random(tmp_path):
    """Issue 34, item 7: transformers writes Mixtral's experts one tensor each; the model stacks
    them. The load converts with transformers' own mapping; before, it raised naming every
    expert, and its hint (strict=False) left every expert and router at random values silently."""
    torch.manual_seed(0)
    saved = zoo.mixtral()
    saved.save_pretrained(tmp_path / "mixtral", safe_serialization=True)
    with safe_open(str(tmp_path / "mixtral" / "model.safetensors"), framework="pt") as f:
        assert "model.layers.0.block_sparse_moe.experts.1.w3.weight" in set(f.keys())  # (what is on disk)
    torch.manual_seed(1)
    model = zoo.mixtral()
    report = tiertrain.load_pretrained(model, tmp_path / "mixtral")
    assert report.conversion.startswith("transformers' checkpoint conversion of MixtralForCausalLM: 4 tensors")
    want = saved.state_dict()
    assert all(torch.equal(t, want[n]) for n, t in model.state_dict().items())

    # A checkpoint without layer 1's experts: strict names them; strict=False warns naming them.
    tensors = load_file(tmp_path / "mixtral" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".layers.1." not in k or ".experts." not in k},
              str(tmp_path / "partial.safetensors"))
    gone = ["model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj"]
    with pytest.raises(PretrainedMismatchError, match="missing from the checkpoint"):
        tiertrain.load_pretrained(zoo.mixtral(), tmp_path / "partial.safetensors")
    with pytest.warns(tiertrain.PretrainedMissingWarning) as warned:
        report = tiertrain.load_pretrained(zoo.mixtral(), tmp_path / "partial.safetensors", strict=False)
    assert sorted(report.missing) == gone
    assert all(name in str(warned[0].message) for name in gone), warned[0].message


@pytest.mark.timeout(60)
def test_mismatches_raise_naming_the_tensors(checkpoints, tmp_path):
    state = {k: v for k, v in _build("gpt", 0).state_dict().items() if k != "head.weight"}
    save_file({k: v for k, v in state.items() if k != "blocks.1.mlp.fc1.weight"}, str(tmp_path / "missing.safetensors"))
    with pytest.raises(PretrainedMismatchError, match=r"missing from the checkpoint \(1\): blocks\.1\.mlp\.fc1\.weight"):
        tiertrain.load_pretrained(_build("gpt", 1), tmp_path / "missing.safetensors")
    model = _build("gpt", 1)
    before = model.get_parameter("blocks.1.mlp.fc1.weight").detach().clone()
    with pytest.warns(tiertrain.PretrainedMissingWarning, match=r"values: blocks\.1\.mlp\.fc1\.weight$"):
        report = tiertrain.load_pretrained(model, tmp_path / "missing.safetensors", strict=False)
    assert report.missing == ["blocks.1.mlp.fc1.weight"]
    assert torch.equal(model.get_parameter("blocks.1.mlp.fc1.weight"), before)  # kept as it was

    save_file({**state, "extra.weight": torch.zeros(3)}, str(tmp_path / "extra.safetensors"))
    with pytest.raises(PretrainedMismatchError, match=r"not in the model \(1\): extra\.weight"):
        tiertrain.load_pretrained(_build("gpt", 1), tmp_path / "extra.safetensors")

    wide = {**state, "blocks.0.mlp.fc1.weight": torch.zeros(7, 32)}
    save_file(wide, str(tmp_path / "shape.safetensors"))
    model = _build("gpt", 1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    shape = tuple(model.get_parameter("blocks.0.mlp.fc1.weight").shape)
    with pytest.raises(PretrainedMismatchError,
                       match=rf"blocks\.0\.mlp\.fc1\.weight .*checkpoint \(7, 32\), model {re.escape(str(shape))}"):
        tiertrain.load_pretrained(model, tmp_path / "shape.safetensors", strict=False)
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())  # nothing written


@pytest.mark.timeout(60)
def test_bad_paths_name_the_directory_and_the_expected_files(checkpoints, tmp_path):
    with pytest.raises(FileNotFoundError, match=r"'/no/such/dir' does not exist.*model\.safetensors"):
        tiertrain.load_pretrained(_build("gpt", 1), "/no/such/dir")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=r"no model\.safetensors, model\.safetensors\.index\.json, "
                                                r"pytorch_model\.bin or pytorch_model\.bin\.index\.json in "
                                                r"'.*empty' \(it holds config\.json\)"):
        tiertrain.load_pretrained(_build("gpt", 1), tmp_path / "empty")
    (tmp_path / "broken").mkdir()
    index = json.loads(open(os.path.join(checkpoints, "llama_sharded", "model.safetensors.index.json")).read())
    (tmp_path / "broken" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(FileNotFoundError, match=r"lists shard files missing from .*model-00001-of-"):
        tiertrain.load_pretrained(_build("llama", 1), tmp_path / "broken")
    (tmp_path / "weights.txt").write_text("")
    with pytest.raises(ValueError, match=r"neither a \.safetensors file nor a torch\.save file"):
        tiertrain.load_pretrained(_build("gpt", 1), tmp_path / "weights.txt")


def test_a_safetensors_header_that_overruns_its_file_is_refused_naming_the_file(tmp_path):
    """Issue 32, item 9: a malformed header (offsets past the file's end) ended in the
    safetensors library's own error, naming no file."""
    import struct

    from tiertrain.state.pretrained import load_pretrained

    path = tmp_path / "model.safetensors"
    save_file({"weight": torch.ones(4, 4)}, str(path))
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header["weight"]["data_offsets"] = [0, 1 << 20]
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])
    with pytest.raises(ValueError, match=r"load_pretrained: '.*model\.safetensors' is not a valid safetensors file"):
        load_pretrained(torch.nn.Linear(4, 4, bias=False), str(tmp_path))


def _loads_with_a_nan(rank, world, root):
    """Stage 3: the NaN is in the rows one rank reads; partitioned_init: in one rank's shard."""
    errors = {}
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2})
    topology = tiertrain.Topology.build(cfg.parallel)
    try:
        tiertrain.load_pretrained(tiertrain.wrap(_build("llama", 1), cfg, topology), root)
    except tiertrain.NonFiniteWeightsError as e:
        errors["engine"] = str(e)
    with tiertrain.partitioned_init(topology):
        model = _build("llama", 1)
    try:
        tiertrain.load_pretrained(model, root, topology=topology)
    except tiertrain.NonFiniteWeightsError as e:
        errors["partitioned"] = str(e)
    return errors


def test_inf_or_nan_in_a_parameter_of_the_checkpoint_is_refused_on_every_rank(tmp_path):
    """A NaN in a checkpoint's weights (a broken conversion) trained into NaN losses from the first
    step, nothing naming the checkpoint. Now the load raises NonFiniteWeightsError naming the
    tensor on the rank that read it, and on every rank that shares the load (those whose part
    was finite too: none is left to train alone). A buffer's -inf (a mask) is its value."""
    torch.manual_seed(0)
    model = _build("llama", 0)
    model.register_buffer("mask", torch.tensor([0.0, float("-inf")]))
    model.save_pretrained(tmp_path / "mask")
    loaded = _build("llama", 1)
    loaded.register_buffer("mask", torch.zeros(2))
    assert tiertrain.load_pretrained(loaded, tmp_path / "mask").nonfinite == {"mask": 1}
    assert torch.equal(loaded.mask, model.mask)

    tensors = {n: v.clone().contiguous() for n, v in _build("llama", 0).state_dict().items()}
    name = "model.layers.1.mlp.down_proj.weight"  # (the last layer: one rank's rows at stage 3)
    tensors[name][-1, :3] = torch.tensor([float("nan"), float("inf"), float("nan")])
    (tmp_path / "nan").mkdir()
    save_file(tensors, tmp_path / "nan" / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(tiertrain.NonFiniteWeightsError, match=rf"holds inf or NaN in {name} \(3 values\): training "
                                                              r"from it gives NaN losses"):
        tiertrain.load_pretrained(_build("llama", 1), tmp_path / "nan")
    tied = _build("llama", 0).state_dict()  # (tied copies, both with the NaN: not "trained untied")
    tied["model.embed_tokens.weight"][0, 0] = float("nan")
    tied["lm_head.weight"] = tied["model.embed_tokens.weight"].clone()
    torch.save(tied, tmp_path / "tied_nan.bin")
    with pytest.raises(tiertrain.NonFiniteWeightsError, match=r"holds inf or NaN in model.embed_tokens.weight \(1 "
                                                              r"value\):"):
        tiertrain.load_pretrained(T.LlamaForCausalLM(_llama_config(tie_word_embeddings=True)),
                                  tmp_path / "tied_nan.bin")
    per_rank = run_distributed(_loads_with_a_nan, 2, str(tmp_path / "nan"), timeout=60)
    for label in ("engine", "partitioned"):
        said = [errors[label] for errors in per_rank]
        assert sum(name in s for s in said) == 1 and sum("rank(s) [" in s for s in said) == 1, (label, said)
