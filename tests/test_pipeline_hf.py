"""Pipeline stages cut automatically from Hugging Face models (tiertrain/pipeline/hf_split.py).

A tiny Llama (GQA, rotary, RMSNorm, untied head), a tiny GPT-2 (learned positions, Conv1D,
head tied to the token embedding), a tiny Qwen2 (rotary, GQA, tied head) and a tiny T5
(encoder-decoder, relative position bias, head tied to the shared embedding, decoder 12
tokens against an encoder of 16, decoder inputs built from the labels) and a tiny BERT
(BertForMaskedLM: bidirectional encoder, token-type embeddings, MLM head tied to the word
embeddings, labels aligned with the inputs and -100 where not masked) are handed to
``tiertrain.wrap`` at pp=2 as they are: the engine splits them, trains them with 1F1B or the
interleaved schedule (v=2: 4 blocks → 4 chunks, 2 per rank), and the losses and the
parameters gathered from both stages must equal the single-process run of the same steps on
the whole model within the float64 oracle's bound (tests/reference.py; AdamW eps=1e-3 and an
active grad_clip as in test_engine_pp). The loss is the model's own at every layout: the
decoders get Hugging Face's batches (labels = input_ids, which their loss shifts), T5 and BERT
theirs (labels aligned with the logits).
GPT-2, Qwen2, T5 and BERT check the
tied-weight exchange between the first and last stage (interleaved: chunk 0 of rank 0 and
chunk 1 of rank 1); an explicit, unbalanced split checks ``split=``. Padded batches (a padding
``attention_mask``, T5's ``decoder_attention_mask``) train as the unsplit model does on them.

Layouts (dp, tp, pp): (1,1,2) on 2 ranks; (2,1,2) and (1,2,2) on 4, one launch each with
every case in it. At tp=2 the models are converted by tensor-parallel plans first
(``parallelize_module``): the Llama fully (attention and MLP column/row-parallel, a
vocabulary-parallel embedding and head), GPT-2 its tied embedding and head (vocabulary
parallel on the first and the last stage), T5 its MLPs and its tied embedding and head; and
the boundary message goes by Megatron's scatter/gather (each tp rank sends 1/2 of it): the
bytes are counted, and one case is run again without it and must train bit for bit the same.
"""
from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.nn as nn

import tiertrain

from hf_pipeline_models import CAUSAL_LMS, T5_TARGET, TIED as HF_TIED, hf_convention, mlm as _mlm
from hf_pipeline_models import bert as _bert, gpt2 as _gpt2, llama as _llama, qwen2_tied as _qwen2_tied, t5 as _t5
from hf_pipeline_models import qwen3 as _qwen3
from reference import Oracle, engine_train, global_batches, make_config, rank_slices, reference_train, tp_gathered
from tiertrain.parallel import parallelize_module
from tiertrain.pipeline import pipeline_stages
from tiertrain.pipeline.hf_split import next_token_loss, split_hf
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the references: see conftest.py

MICRO, ACCUM, STEPS = 2, 4, 3
LLAMA_SPLIT = [["model.embed_tokens", "model.layers.0"],
               ["model.layers.1", "model.layers.2", "model.layers.3", "model.norm", "lm_head"]]


class _Chain(nn.Module):
    """Not a recognised family: embedding → two blocks → head tied to the embedding."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(256, 16)
        self.body = nn.ModuleList([nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(2)])
        self.out = nn.Linear(16, 256, bias=False)
        self.out.weight = self.embed.weight

    def forward(self, input_ids, labels):
        x = self.embed(input_ids)
        for block in self.body:
            x = block(x)
        return next_token_loss(self.out(x), labels)


MODELS = {"llama": _llama, "gpt2": _gpt2, "qwen2-tied": _qwen2_tied, "chain": _Chain, "t5": _t5, "bert": _bert,
          "qwen3": _qwen3}
TIED = {**HF_TIED, "chain": ("embed.weight", "out.weight")}

TP_PLANS = {  # (tiertrain.parallel.parallelize_module)
    "llama": {"model.embed_tokens": "vocab", "model.layers.*.self_attn.[qkv]_proj": "colwise",
              "model.layers.*.self_attn.o_proj": "rowwise", "model.layers.*.mlp.gate_proj": "colwise",
              "model.layers.*.mlp.up_proj": "colwise", "model.layers.*.mlp.down_proj": "rowwise",
              "lm_head": "colwise"},
    "gpt2": {"transformer.wte": "vocab", "lm_head": "colwise"},
    "t5": {"shared": "vocab", "*.embed_tokens": "vocab", "*.DenseReluDense.wi": "colwise",
           "*.DenseReluDense.wo": "rowwise", "lm_head": "colwise"},
}


def _config(stage, pp, schedule="1f1b", v=1, dp=1, tp=1):
    return make_config(zero={"stage": stage, "bucket_mb": 0.02},
                       parallel={"dp": dp, "tp": tp, "pp": pp, "schedule": schedule, "virtual_stages": v},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": ACCUM},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _batches(name="llama", dp=1, steps=STEPS):
    batches = global_batches(steps, MICRO * ACCUM * dp)
    if name == "t5":  # a decoder shorter than the encoder; decoder inputs built from the labels
        return [{"input_ids": b["input_ids"], "labels": b["labels"][:, :T5_TARGET].contiguous()} for b in batches]
    if name == "bert":
        return [_mlm(b) for b in batches]
    if name in CAUSAL_LMS:
        return hf_convention(batches)
    return batches


SPLITS = {"llama": LLAMA_SPLIT, "chain": [["embed", "body.0"], ["body.1", "out"]]}


def _split_prepare(name):
    return lambda model, topology: pipeline_stages(model, topology, 1, split=SPLITS[name])


CASES = [  # (model, zero stage, schedule, virtual stages, explicit split)
    ("llama", 1, "1f1b", 1, False),
    ("gpt2", 2, "1f1b", 1, False),
    ("gpt2", 1, "interleaved", 2, False),
    ("llama", 2, "interleaved", 2, False),
    ("qwen2-tied", 1, "1f1b", 1, False),
    ("llama", 0, "1f1b", 1, True),
    ("chain", 1, "1f1b", 1, True),  # not recognised: sequential stages, tied head
    ("t5", 1, "1f1b", 1, False),
    ("t5", 2, "interleaved", 2, False),
    ("bert", 1, "1f1b", 1, False),  # encoder: masked-LM loss, labels not shifted
    ("bert", 2, "interleaved", 2, False),
    ("qwen3", 2, "1f1b", 1, False),  # (issue 34's labels, items 3 and 10, on a family not used before)
]

GRID_CASES = [  # (model, zero stage, schedule, virtual stages) at (2,1,2) and (1,2,2)
    ("llama", 1, "1f1b", 1),
    ("llama", 2, "interleaved", 2),
    ("gpt2", 2, "1f1b", 1),
    ("gpt2", 1, "interleaved", 2),
    ("t5", 1, "1f1b", 1),
    ("t5", 0, "interleaved", 2),
]
GRID_STEPS = 2


def _run(rank, world, cases):
    out = []
    for name, stage, schedule, v, split in cases:
        wrap_kwargs = {"activation_shape": (MICRO, 16, 16)} if name == "chain" else None
        losses, params, engine = engine_train(rank, world, MODELS[name](), _config(stage, 2, schedule, v),
                                              _batches(name), _split_prepare(name) if split else None, wrap_kwargs)
        out.append((losses, params, [s.layers for s in engine.stages]))
        engine.close()
    return out


def _check(results, cases, oracle_of, what):
    """Every rank's losses and the parameters merged over the ranks against the float64 oracle."""
    for k, case in enumerate(cases):
        name = case[0]
        oracle = oracle_of(case)
        merged = {}
        for losses, params, *_ in (r[k] for r in results):
            oracle.check(losses, None, f"{what} {case} losses")
            merged.update(params)
        if name in TIED:  # the last stage's copy stayed equal to the embedding
            first, last = TIED[name]
            assert torch.equal(merged.pop(last), merged[first]), case
        assert set(merged) == set(oracle.params64), case
        oracle.check(None, merged, f"{what} {case} parameters")


@pytest.mark.timeout(120)
def test_models_split_automatically_match_single_process():
    results = run_distributed(_run, 2, CASES, timeout=100)
    _check(results, CASES, lambda c: Oracle.run(reference_train, MODELS[c[0]](), _config(c[1], 1), _batches(c[0])),
           "(1,1,2)")
    layers = [[r[k][2] for r in results] for k in range(len(CASES))]
    assert layers[0] == [[[0, 1]], [[2, 3]]]  # balanced by layer count
    assert layers[2] == [[[0], [2]], [[1], [3]]]  # interleaved: stages r, r+p on rank r
    assert layers[3] == [[[0], [2]], [[1], [3]]]
    assert layers[5] == [[[0]], [[1, 2, 3]]]  # the explicit split
    assert layers[7] == [[[0, 1]], [[2, 3]]]  # T5: the encoder's 2 blocks, then the decoder's
    assert layers[8] == [[[0], [2]], [[1], [3]]]
    assert layers[9] == [[[0, 1]], [[2, 3]]]  # BERT's encoder.layer
    assert layers[10] == [[[0], [2]], [[1], [3]]]


LENGTHS = (16, 11)
"""Tokens of each row of a micro-batch after its padding (the same in every micro-batch)."""


def _left_padding(lengths: torch.Tensor, seq: int) -> torch.Tensor:
    return (torch.arange(seq)[None, :] >= seq - lengths).long()


def _padded(name, batches):
    """The batches padded on the left (as a tokenizer pads for a decoder: right padding would
    change nothing a causal mask lets a token see): the pad positions hold token 0 under
    attention_mask 0 and are not predicted (-100); T5's decoder padded the same way, under its
    own decoder_attention_mask."""
    out = []
    for batch in batches:
        rows, seq = batch["input_ids"].shape
        lengths = torch.tensor(LENGTHS * (rows // len(LENGTHS)))[:, None]
        keep = _left_padding(lengths, seq)
        padded = {**batch, "input_ids": batch["input_ids"] * keep, "attention_mask": keep,
                  "labels": batch["labels"].masked_fill(keep[:, -batch["labels"].shape[1]:] == 0, -100)}
        if name == "t5":
            padded["decoder_attention_mask"] = _left_padding(lengths - 4, batch["labels"].shape[1])
            padded["labels"] = batch["labels"].masked_fill(padded["decoder_attention_mask"] == 0, -100)
        out.append(padded)
    return out


def _micro_batch_reference(model, config, batches):
    """Plain PyTorch with the pipeline's convention: each step's loss the mean over its ACCUM
    micro-batches of each one's loss (the model's own token mean), then clip, AdamW and the
    schedule as in reference_train."""
    from reference import _floats_to
    from tiertrain.optim import build_adamw, build_schedule, param_groups

    model = copy.deepcopy(model)
    opt = build_adamw(param_groups(model.named_parameters(), config.optimizer), config.optimizer)
    sched = build_schedule(opt, config.schedule)
    dtype, losses = next(model.parameters()).dtype, []
    for batch in batches:
        loss = sum(model(**_floats_to(m, dtype)).loss for m in rank_slices(batch, 0, 1, MICRO, ACCUM)) / ACCUM
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


PADDED_CASES = [("llama", 1, "1f1b", 1, False), ("gpt2", 2, "interleaved", 2, False), ("t5", 1, "1f1b", 1, False),
                ("bert", 3, "1f1b", 1, False)]


def _run_padded(rank, world, cases):
    out = []
    for name, stage, schedule, v, _ in cases:
        losses, params, engine = engine_train(rank, world, MODELS[name](), _config(stage, 2, schedule, v),
                                              _padded(name, _batches(name)))
        out.append((losses, params))
        engine.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_padded_batches_train_as_the_unsplit_model_under_its_padding_mask():
    """A batch's attention_mask (and T5's decoder_attention_mask) reaches every stage's blocks
    through the model's own mask functions: decoders (Llama's rotary blocks, GPT-2), T5's
    encoder, decoder and cross-attention, BERT's bidirectional encoder train as the unsplit
    model does on the same padded micro-batches."""
    results = run_distributed(_run_padded, 2, PADDED_CASES, timeout=100)
    _check(results, PADDED_CASES, lambda c: Oracle.run(_micro_batch_reference, MODELS[c[0]](), _config(c[1], 1),
                                                       _padded(c[0], _batches(c[0]))), "padded (1,1,2)")


def _shift_labels(batches):
    """Causal-LM batches with each position's next token as transformers' shift_labels, which its
    loss takes instead of the labels (what `tiertrain train --model.hf` gives at pp > 1:
    tiertrain's datasets' labels)."""
    return [{"input_ids": b["input_ids"], "labels": b["input_ids"], "shift_labels": b["labels"]} for b in batches]


SHIFTED_CASES = [("llama", 2, "1f1b", 1, False), ("gpt2", 1, "interleaved", 2, False)]


def _run_shifted(rank, world, cases):
    out = []
    for name, stage, schedule, v, _ in cases:
        losses, params, engine = engine_train(rank, world, MODELS[name](), _config(stage, 2, schedule, v),
                                              _shift_labels(global_batches(STEPS, MICRO * ACCUM)))
        out.append((losses, params))
        engine.close()
    return out


@pytest.mark.timeout(120)
def test_shift_labels_train_as_the_model_given_them():
    """A causal LM's last stage computes the model's own loss of the batch's shift_labels, as
    ``model(input_ids=..., labels=..., shift_labels=...)`` does, for every position (labels
    alone would lose the last: the model's loss shifts them)."""
    results = run_distributed(_run_shifted, 2, SHIFTED_CASES, timeout=100)
    _check(results, SHIFTED_CASES, lambda c: Oracle.run(_micro_batch_reference, MODELS[c[0]](), _config(c[1], 1),
                                                        _shift_labels(global_batches(STEPS, MICRO * ACCUM))),
           "shift_labels (1,1,2)")


def _train_and_save(rank, world, directory, cases):
    out = []
    for name, stage, schedule, v in cases:
        config = _config(stage, 2, schedule, v)
        engine = tiertrain.wrap(MODELS[name](), config, tiertrain.Topology.build(config.parallel))
        for batch in _batches(name)[:2]:
            engine.train_batch(rank_slices(batch, 0, 1, MICRO, ACCUM))
        engine.save_checkpoint(f"{directory}/{name}")
        out.append({k: v.detach().cpu().clone() for k, v in engine.full_state_dict().items()})
        engine.close()
    return out


EXPORT_CASES = [("llama", 1, "1f1b", 1), ("gpt2", 2, "interleaved", 2), ("t5", 3, "1f1b", 1), ("bert", 1, "1f1b", 1)]


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_pipeline_checkpoint_exports_as_a_directory_from_pretrained_loads(tmp_path):
    """`tiertrain export` of a pipeline run's checkpoint: config.json of the model's class, every
    tensor under its Hugging Face name (a tied head written once, as save_pretrained does), the
    trained values bit for bit; before, it wrote the stages' tensors without a config."""
    from tiertrain.state.consolidate import export_checkpoint

    trained = run_distributed(_train_and_save, 2, str(tmp_path / "ckpt"), EXPORT_CASES, timeout=100)[0]
    for (name, *_), whole in zip(EXPORT_CASES, trained):
        out = tmp_path / "export" / name
        export_checkpoint(tmp_path / "ckpt" / name, out)
        config = json.loads((out / "config.json").read_text())
        loaded = getattr(transformers, config["architectures"][0]).from_pretrained(out)
        assert type(loaded) is type(MODELS[name]())
        state = loaded.state_dict()
        assert set(whole) <= set(state), (name, set(whole) - set(state))
        for key, value in whole.items():
            assert torch.equal(state[key], value), (name, key)
        if name in TIED:
            assert TIED[name][1] not in safetensors_keys(out), "the tied head is written once, as the embedding"


def safetensors_keys(directory):
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


def _qwen3_whole(rank, world):
    model = _qwen3()
    expected = {k: v.detach().clone() for k, v in model.state_dict().items()}
    engine = tiertrain.wrap(model, _config(3, 2), tiertrain.Topology.build(_config(3, 2).parallel))
    full = engine.full_state_dict()
    return expected, full, len(engine.flat.params)


@pytest.mark.timeout(60)
def test_full_state_dict_of_a_qwen3_at_pp2_is_the_whole_model_on_every_rank():
    """Issue 34, item 10 on Qwen3 at stage 3: every rank gets every tensor, the values the model
    was built with, though each rank holds only its stage."""
    for expected, full, local in run_distributed(_qwen3_whole, 2, timeout=50):
        assert sorted(full) == sorted(expected) and local < len(expected)
        assert all(torch.equal(full[k], expected[k]) for k in expected)


def _message_numel(name):
    """The elements of one boundary message of a micro-batch (decoders: [micro, seq, hidden];
    T5: its encoder and decoder states and both position biases, flattened)."""
    seq = 16
    if name != "t5":
        return MICRO * seq * 32
    return MICRO * (seq + T5_TARGET) * 32 + 4 * (seq * seq + T5_TARGET * T5_TARGET)


def _grid_run(rank, world, dp, tp, cases):
    out = []
    for name, stage, schedule, v in cases:
        prepare = None
        if tp > 1:
            prepare = lambda m, topo, name=name: parallelize_module(m, topo.group("tp"), TP_PLANS[name])  # noqa: E731
        losses, local, engine = engine_train(rank, world, MODELS[name](), _config(stage, 2, schedule, v, dp, tp),
                                             _batches(name, dp, GRID_STEPS), prepare)
        sharded = sorted(n for s in engine.stages for n, p in s.named_parameters() if getattr(p, "tp_sharded", False))
        out.append((losses, tp_gathered(engine, local), engine.executor.scatter_gather,
                    engine.executor.stats["bytes_sent"], sharded))
        if (name, schedule) == ("llama", "1f1b") and tp > 1:  # once more without scatter/gather
            engine.close()
            topology = engine.topology
            whole = MODELS[name]()
            engine = tiertrain.wrap(prepare(whole, topology), _config(stage, 2, schedule, v, dp, tp), topology)
            engine.executor.scatter_gather = False
            plain = [engine.train_batch(rank_slices(b, 0, 1, MICRO, ACCUM)) for b in _batches(name, dp, GRID_STEPS)]
            out[-1] += (plain, tp_gathered(engine, engine.full_state_dict()), engine.executor.stats["bytes_sent"])
        engine.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize("dp,tp", [(2, 1), (1, 2)], ids=["dp2_tp1_pp2", "dp1_tp2_pp2"])
def test_four_rank_layouts_match_single_process(dp, tp):
    results = run_distributed(_grid_run, 4, dp, tp, GRID_CASES, timeout=140)
    _check(results, GRID_CASES, lambda c: Oracle.run(reference_train, MODELS[c[0]](), _config(c[1], 1),
                                                     _batches(c[0], dp, GRID_STEPS)), f"({dp},{tp},2)")
    for k, (name, stage, schedule, v) in enumerate(GRID_CASES):
        # per micro-batch each of the p=2 ranks sends 2(S-1)/p boundary tensors (S = 2v stages):
        # the activations and the gradients; at tp=2 each tp rank sends half of each
        expected = ACCUM * (2 * v - 1) * _message_numel(name) * 4 // tp  # bytes per rank and step
        for r in results:
            assert r[k][2] == (tp > 1), (name, schedule)  # scatter/gather on at tp > 1
            assert r[k][3] == expected, (name, schedule, r[k][3], expected)
        # the plan was applied: every rank holds tensor-parallel shards at tp=2, the last stage
        # the vocabulary-parallel head (its loss from the vocab-sharded logits)
        sharded = [n for r in results for n in r[k][4]]
        assert bool(sharded) == (tp > 1) and (tp == 1 or all(r[k][4] for r in results)), (name, sharded)
        assert (tp > 1) == ("lm_head.weight" in sharded), (name, sharded)
    if tp > 1:  # the same case without scatter/gather: twice the bytes, the same training bit for bit
        k = GRID_CASES.index(("llama", 1, "1f1b", 1))
        for r in results:
            losses, params, _, sent, _, plain, plain_params, plain_sent = r[k]
            assert plain_sent == 2 * sent
            assert losses == plain
            assert all(torch.equal(params[n], plain_params[n]) for n in params)


# -- single-process: the split itself -----------------------------------------------------------

class _Topology:
    """What pipeline_stages reads of a topology: the pp size and this rank's coordinate."""

    def __init__(self, pp, rank):
        self.pp, self.rank = pp, rank

    def size(self, axis):
        return self.pp if axis == "pp" else 1

    def coord(self, axis):
        return self.rank if axis == "pp" else 0


@pytest.mark.timeout(30)
def test_an_unrecognised_model_is_a_clear_error_naming_what_was_found():
    with pytest.raises(ValueError, match=r"cannot split _Chain.*found children: embed: Embedding, "
                                         r"body: ModuleList, out: Linear.*split="):
        pipeline_stages(_Chain(), _Topology(2, 0))
    with pytest.raises(ValueError, match=r"Gemma2ForCausalLM \(model_type='gemma2'\) has the Llama layout.*cannot "
                                         r"be cut into pipeline stages yet: train it at parallel.pp=1") as refused:
        split_hf(_gemma2(), 2)  # (its logits soft-capped by the causal LM's forward)
    assert "split=" not in str(refused.value), "its own advice must not be a split that cannot run"


def _gemma2():
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=8))


def _granite():
    """Its forward scales the embeddings and the logits by config multipliers: not admitted."""
    return transformers.GraniteForCausalLM(transformers.GraniteConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, pad_token_id=0))


def _opt():
    return transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=64, hidden_size=16, ffn_dim=32, num_hidden_layers=2, num_attention_heads=2,
        word_embed_proj_dim=16, max_position_embeddings=32))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("build,split,layer", [
    (_gemma2, [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]],
     "model.layers.0"),
    (_granite, [["model.embed_tokens", "model.layers.0"], ["model.layers.1", "model.norm", "lm_head"]],
     "model.layers.0"),
    (_opt, [["model.decoder.embed_tokens", "model.decoder.embed_positions", "model.decoder.layers.0"],
            ["model.decoder.layers.1", "model.decoder.final_layer_norm", "lm_head"]], "model.decoder.embed_positions"),
])
def test_a_split_that_cannot_run_is_refused_naming_the_layer_and_what_it_lacks(build, split, layer):
    """Issue 34, item 9: the refusal for Gemma2 and Phi-3 (now cut: tests/test_pipeline_families.py;
    Granite here) said to pass split=; doing so failed at
    the first forward (no position embeddings reach the layer), OPT with a shape error, and the
    other rank waited for the timeout. A layer that takes inputs from its model's own forward
    cannot run in a chain: the split is refused before anything runs."""
    model = build()
    with pytest.raises(ValueError, match=rf"split: '{layer}' \(\w+\) takes \w+.*cannot be cut into pipeline "
                                         rf"stages; train it at parallel.pp=1"):
        split_hf(model, 2, split=split)


@pytest.mark.timeout(30)
def test_explicit_split_of_an_unrecognised_chain_runs_its_modules_in_order():
    batch = global_batches(1, 2)[0]
    expected = _Chain()(**batch)
    split = [["embed", "body.0"], ["body.1", "out"]]
    stages = [pipeline_stages(_Chain(), _Topology(2, r), split=split) for r in range(2)]
    # each rank builds its own model; chain rank 0's stage into rank 1's (same weights, same seed)
    x = stages[0][0](None, batch)
    assert torch.equal(stages[1][0](x, batch), expected)
    # the head's weight, shared with the embedding, got its own copy on the last stage
    assert stages[0][0].tied_names == ("embed.weight", "out.weight") == stages[1][0].tied_names
    assert stages[1][0].is_last and not stages[1][0].is_first
    assert {n for n, _ in stages[1][0].named_parameters()} == {"body.1.0.weight", "body.1.0.bias", "out.weight"}
    with pytest.raises(ValueError, match=r"parameters in none of the named modules.*body.1.0.weight"):
        split_hf(_Chain(), 2, split=[["embed", "body.0"], ["out"]])
    # a padding mask cannot reach modules called each on the previous one's output
    with pytest.raises(ValueError, match=r"attention_mask cannot be given to these pipeline stages: a chain of "
                                         r"modules"):
        stages[0][0](None, {**batch, "attention_mask": torch.ones_like(batch["input_ids"])})


@pytest.mark.timeout(30)
def test_explicit_split_of_a_recognised_model_is_checked():
    with pytest.raises(ValueError, match=r"in model order"):
        split_hf(_llama(), 2, split=[["model.embed_tokens", "model.layers.1"],
                                     ["model.layers.0", "model.layers.2", "model.layers.3", "lm_head"]])
    with pytest.raises(ValueError, match=r"'model.layers.9' is not a module of LlamaForCausalLM"):
        split_hf(_llama(), 2, split=[["model.embed_tokens", "model.layers.9"], ["lm_head"]])
    with pytest.raises(ValueError, match=r"give 4 non-empty lists"):
        pipeline_stages(_llama(), _Topology(2, 0), virtual_stages=2, split=LLAMA_SPLIT)
    # balance="params": the embeddings and the head (the largest units here) get stages of their own
    stages = split_hf(_llama(), 6, balance="params")
    assert [s.layers for s in stages] == [[], [0], [1], [2], [3], []]
    batch = global_batches(1, 2)[0]
    x = None
    for s in stages:
        x = s(x, batch)
    assert torch.equal(x, _llama()(**batch).loss)


@pytest.mark.timeout(30)
def test_t5_stages_chained_in_one_process_equal_the_model():
    """Any cut of the encoder-decoder (the encoder/decoder boundary inside a stage, stages of the
    embeddings or the head alone), with decoder_input_ids given or built from the labels: the
    chained stages give the model's own loss and, summed over the tied copies, its gradients."""
    batch = _batches("t5", steps=1)[0]
    batch = {k: v[:2] for k, v in batch.items()}
    with_ids = dict(batch, decoder_input_ids=torch.randint(0, 256, batch["labels"].shape,
                                                           generator=torch.Generator().manual_seed(3)))
    for tie, b, stages_of in [(True, batch, lambda m: split_hf(m, 3)),
                              (False, with_ids, lambda m: split_hf(m, 6, balance="params")),
                              (True, with_ids, lambda m: split_hf(m, 2, split=[
                                  ["shared", "encoder.block.0"],
                                  ["encoder.block.1", "encoder.final_layer_norm", "decoder.block.0",
                                   "decoder.block.1", "lm_head"]]))]:
        ref = _t5(tie)
        expected = ref(**b).loss
        expected.backward()
        stages = stages_of(_t5(tie))
        x = None
        for s in stages:
            x = s(x, b)
            if not s.is_last:
                assert x.shape == s.hidden_shape(b)
        assert torch.equal(x, expected)
        x.backward()
        grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
        assert stages[0].tied == tie == stages[-1].tied
        if tie:
            assert stages[0].tied_names == ("shared.weight", "lm_head.weight")
            grads["shared.weight"] = grads["shared.weight"] + grads.pop("lm_head.weight")
        reference = dict(ref.named_parameters())
        assert set(grads) == set(reference)
        for n, g in grads.items():
            if g is None and reference[n].grad is None:  # (untied: `shared` itself is not used)
                continue
            torch.testing.assert_close(g, reference[n].grad, rtol=1e-5, atol=1e-6, msg=n)
    assert [s.layers for s in split_hf(_t5(), 3)] == [[0, 1], [2], [3]]
    assert split_hf(_t5(), 2)[0].paths[-1] == "encoder.final_layer_norm"  # rides with the last encoder block


@pytest.mark.timeout(30)
@pytest.mark.parametrize("family", ["bert", "roberta"])
def test_masked_lm_encoder_stages_chained_in_one_process_equal_the_model(family):
    """BERT/RoBERTa cut anywhere (stages of the embeddings or the MLM head alone too): the chained
    stages give the model's own masked-LM loss exactly (labels aligned, not shifted; token types
    used) and, summed over the tied copies, its gradients."""
    batch = _batches("bert", steps=1)[0]
    batch = {k: v[:4] for k, v in batch.items()}
    ref = _bert(family)
    expected = ref(**batch).loss
    expected.backward()
    base, head = ("bert", "cls.predictions") if family == "bert" else ("roberta", "lm_head")
    for stages in (split_hf(_bert(family), 2), split_hf(_bert(family), 3),
                   split_hf(_bert(family), 6, balance="params")):
        x = None
        for s in stages:
            x = s(x, batch)
            if not s.is_last:
                assert x.shape == (4, 16, 32) == s.hidden_shape(batch)
        assert torch.equal(x, expected)
        x.backward()
        first, last = f"{base}.embeddings.word_embeddings.weight", f"{head}.decoder.weight"
        assert stages[0].tied_names == (first, last) == stages[-1].tied_names
        grads = {n: p.grad for s in stages for n, p in s.named_parameters()}
        grads[first] = grads[first] + grads.pop(last)
        reference = dict(ref.named_parameters())
        assert set(grads) == set(reference)
        for n, g in grads.items():
            torch.testing.assert_close(g, reference[n].grad, rtol=1e-5, atol=1e-6, msg=n)
    assert [s.layers for s in split_hf(_bert(family), 3)] == [[0, 1], [2], [3]]
    assert split_hf(_bert(family), 6, balance="params")[-1].paths == [head.split(".")[0]]
    # padded: the stages make the model's mask from the batch's attention_mask
    padded = dict(batch, attention_mask=_left_padding(torch.tensor([[16], [11], [7], [16]]), 16))
    x = None
    for s in split_hf(_bert(family), 2):
        x = s(x, padded)
    assert torch.equal(x, ref(**padded).loss)


@pytest.mark.timeout(30)
def test_what_the_stages_cannot_run_is_refused_clearly():
    bart = transformers.BartForConditionalGeneration(transformers.BartConfig(
        vocab_size=64, d_model=16, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
        decoder_attention_heads=2, encoder_ffn_dim=32, decoder_ffn_dim=32, max_position_embeddings=32))
    with pytest.raises(ValueError, match=r"cannot split BartForConditionalGeneration \(model_type='bart'\).*"
                                         r"T5ForConditionalGeneration.*split="):
        split_hf(bart, 2)
    t5 = parallelize_module(_t5(), None, {"*.SelfAttention.q": "colwise"})
    with pytest.raises(ValueError, match=r"encoder.block.0.layer.0.SelfAttention.q: T5's attention is not split"):
        split_hf(t5, 2)
    llama = parallelize_module(_llama(), None, TP_PLANS["llama"], sequence_parallel=True)
    with pytest.raises(ValueError, match=r"model.embed_tokens is sequence parallel"):
        split_hf(llama, 2)
    llama = parallelize_module(_llama(), None, TP_PLANS["llama"])
    llama.model.layers[1].self_attn.k_proj.out_per_rank = 4  # as at tp=4: half a key/value head of 8
    with pytest.raises(ValueError, match=r"model.layers.1.self_attn.k_proj: 4 output features per "
                                         r"tensor-parallel rank is not a whole number of heads of 8"):
        split_hf(llama, 2)
    bert = parallelize_module(_bert(), None, {"cls.predictions.transform.dense": "colwise"})
    with pytest.raises(ValueError, match=r"cls.predictions.transform.dense: the masked-LM encoders' pipeline "
                                         r"stages .* tensor-parallel plan"):
        split_hf(bert, 2)
    classifier = transformers.BertForSequenceClassification(transformers.BertConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ValueError, match=r"cannot split BertForSequenceClassification.*BertForMaskedLM.*split="):
        split_hf(classifier, 2)
    with pytest.raises(ValueError, match=r"decoder_attention_mask is for an encoder-decoder model \(T5\)"):
        split_hf(_llama(), 2)[0](None, dict(_batches("llama", steps=1)[0], decoder_attention_mask=torch.ones(8, 16)))
