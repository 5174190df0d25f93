"""A pipeline rank builds and loads only its own stages (tiertrain/pipeline/materialize.py,
``tiertrain.load_pretrained`` of a PipelineEngine): a Hugging Face model built on the meta device
is cut by ``wrap()``, each rank gives values only to its stages' tensors, and the checkpoint is
read after ``wrap()`` by the whole model's names, as Megatron's and DeepSpeed's pipelines build
only their stage's layers. The run equals the float64 oracle of the same model trained in one
process; a tensor no initialiser covers, a checkpoint that does not fit the model (on any
rank's stages) and bad values on one rank are refused on every rank, by name."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tiertrain
from hf_pipeline_models import T5_TARGET, TIED, hf_convention, mlm
from hf_pipeline_models import bert, gpt2, llama, qwen2_tied, t5
from reference import Oracle, global_batches, make_config, rank_slices, reference_train
from tiertrain.config import ConfigError
from tiertrain.models.gpt import GPT, GPTConfig
from tiertrain.state.pretrained import NonFiniteWeightsError, PretrainedMismatchError
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_torch_thread")  # the references: see conftest.py

MICRO, ACCUM, STEPS = 2, 2, 2
MODELS = {"llama": llama, "gpt2": gpt2, "qwen2-tied": qwen2_tied, "t5": t5, "bert": bert}


def _config(stage, pp=2, v=1, tp=1, dp=1):
    return make_config(zero={"stage": stage, "bucket_mb": 0.02},
                       parallel={"pp": pp, "tp": tp, "dp": dp, "virtual_stages": v,
                                 "schedule": "interleaved" if v > 1 else "1f1b"},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": ACCUM},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _batches(name, dp=1):
    batches = global_batches(STEPS, MICRO * ACCUM * dp)
    if name == "t5":
        return [{"input_ids": b["input_ids"], "labels": b["labels"][:, :T5_TARGET].contiguous()} for b in batches]
    return [mlm(b) for b in batches] if name == "bert" else hf_convention(batches)


def _on_meta(name, edit=None):
    with torch.device("meta"):
        model = MODELS[name]()
        if edit is not None:
            edit(model)
    return model


def _wrapped(name, stage, v=1, edit=None, dp=1):
    """(the model built on the meta device, its engine at pp=2)."""
    config = _config(stage, v=v, dp=dp)
    model = _on_meta(name, edit)
    return model, tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))


def _train_from_checkpoint(rank, world, cases):
    """Each case: what this rank built (non-meta parameters of the model), what its stages
    hold, what it read from the checkpoint, its losses and the whole model after training."""
    out = []
    for name, stage, v, directory in cases:
        model, engine = _wrapped(name, stage, v)
        loaded = tiertrain.load_pretrained(engine, directory).loaded
        built = {n for n, p in model.named_parameters() if not p.is_meta}
        held = {n for s in engine.stages for n, _ in s.named_parameters()}
        losses = [engine.train_batch(rank_slices(b, 0, 1, MICRO, ACCUM)) for b in _batches(name)]
        out.append((built, held, set(loaded), losses, engine.full_state_dict()))
        engine.close()
    return out


CASES = [  # (model, zero stage, virtual stages)
    ("llama", 1, 1),
    ("qwen2-tied", 3, 1),  # a tied head: the last stage's copy read from the embedding's tensor
    ("gpt2", 2, 2),  # interleaved, tied, Conv1D blocks
    ("t5", 3, 1),  # encoder-decoder: `shared` under three names, relative position biases
    ("bert", 1, 1),  # derived buffers (position ids) made by the model's own initialisation
]


@pytest.mark.timeout(150)
def test_a_model_built_on_the_meta_device_loads_its_stages_after_wrap_and_trains_as_one_process(tmp_path):
    cases = []
    for name, stage, v in CASES:
        MODELS[name]().save_pretrained(tmp_path / name)
        cases.append((name, stage, v, str(tmp_path / name)))
    results = run_distributed(_train_from_checkpoint, 2, cases, timeout=130)
    for k, (name, stage, v, _) in enumerate(cases):
        whole = {n for n, _ in MODELS[name]().named_parameters(remove_duplicate=False)}
        oracle = Oracle.run(reference_train, MODELS[name](), _config(stage, pp=1), _batches(name))
        for built, held, loaded, losses, merged in (r[k] for r in results):
            assert built == held and built < whole, (name, "a rank built only its own stages")
            assert held <= loaded, (name, "and read them from the checkpoint")
            oracle.check(losses, None, f"{name} losses")
        if name in TIED:
            first, last = TIED[name]
            assert torch.equal(merged.pop(last), merged[first]), name
        oracle.check(None, {n: t for n, t in merged.items() if n in oracle.params64}, f"{name} parameters")
        assert {n for n in merged if n in oracle.params64} == set(oracle.params64), name
    built = [r[0][0] for r in results]
    assert len(built[0]) + len(built[1]) == len({n for n, _ in llama().named_parameters()})


GPT_TIED = GPTConfig(n_layers=2, hidden=16, n_heads=2, vocab_size=256, seq_len=16, tie_embeddings=True)


def _initialised(rank, world, name):
    """A tied model built on the meta device and trained without a checkpoint."""
    torch.manual_seed(rank)  # (the initialisation draws from this rank's generator)
    if name == "gpt":
        config = _config(1)
        with torch.device("meta"):
            model = GPT(GPT_TIED)
        engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
        batches = global_batches(STEPS, MICRO * ACCUM)
    else:
        model, engine = _wrapped(name, 1)
        batches = _batches(name)
    whole = engine.full_state_dict()
    losses = [engine.train_batch(rank_slices(b, 0, 1, MICRO, ACCUM)) for b in batches]
    engine.close()
    return whole, losses


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", ["qwen2-tied", "gpt"])
def test_without_a_checkpoint_each_stage_starts_from_the_models_own_initialisation(name):
    """transformers' own _init_weights (initializer_range 0.02, norms at one, rotary frequencies
    recomputed) or tiertrain's GPT's reset_parameters (N(0, 0.02), the residual projections
    scaled by 1/sqrt(2·layers)); the last stage's copy of the tied embedding sent from the
    first stage, where a GPT's head copy draws nothing itself."""
    (whole, losses), _ = run_distributed(_initialised, 2, name, timeout=50)
    reference = GPT(GPT_TIED) if name == "gpt" else qwen2_tied()
    first, last = ("embed.weight", "head.weight") if name == "gpt" else TIED[name]
    assert set(whole) == set(reference.state_dict()) | {last}
    assert torch.equal(whole[last], whole[first])
    for key, value in whole.items():
        assert torch.isfinite(value).all(), key
        if value.dim() == 1 and key.endswith("weight"):  # norms
            assert torch.equal(value, torch.ones_like(value)), key
        elif value.dim() == 2:
            std = 0.02 / (2 * GPT_TIED.n_layers) ** 0.5 if key.endswith(("proj.weight", "fc2.weight")) and \
                name == "gpt" else 0.02
            assert 0.7 * std < float(value.std()) < 1.3 * std, (key, float(value.std()), std)
    assert all(torch.isfinite(torch.tensor(losses))), losses


class _Scale(nn.Module):
    """A module with a parameter and no reset_parameters, which transformers' init does not know;
    with_mask: also a boolean mask made in __init__, not saved (on the meta device, nothing would
    make it again)."""

    def __init__(self, with_mask=False):
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))
        if with_mask:
            self.register_buffer("keep", torch.ones(4, dtype=torch.bool), persistent=False)


def _with_scale(with_mask=False):
    return lambda model: model.model.layers[3].add_module("scale", _Scale(with_mask))


def _refusals(rank, world, directory, bad_directory, scaled_directory):
    said = {}

    def attempt(what, fn):
        try:
            return fn()
        except (ConfigError, PretrainedMismatchError, NonFiniteWeightsError, TypeError) as e:
            said[what] = f"{type(e).__name__}: {e}"

    batches = list(rank_slices(_batches("llama")[0], 0, 1, MICRO, ACCUM))
    for with_mask in (False, True):
        _, engine = _wrapped("llama", 1, edit=_with_scale(with_mask))
        attempt(f"unset{' mask' * with_mask}", lambda: engine.train_batch(batches))
        attempt(f"unset{' mask' * with_mask} eval", lambda: engine.evaluate_each(batches))
        attempt(f"unset{' mask' * with_mask} export", lambda: engine.save_pretrained(f"{scaled_directory}-export"))
        attempt(f"unset{' mask' * with_mask} save", lambda: engine.save_checkpoint(f"{scaled_directory}-ckpt"))
        tiertrain.load_pretrained(engine, scaled_directory)  # (the gain, saved; the mask is not)
        said[f"loaded{' mask' * with_mask}"] = attempt(f"after load{' mask' * with_mask}",
                                                        lambda: engine.train_batch(batches))
        engine.close()
    _, engine = _wrapped("llama", 1)
    attempt("missing", lambda: tiertrain.load_pretrained(engine, directory))
    attempt("nan", lambda: tiertrain.load_pretrained(engine, bad_directory))
    engine.close()
    config = _config(1)
    gpt = tiertrain.wrap(GPT(GPTConfig(n_layers=2, hidden=16, n_heads=2, vocab_size=256, seq_len=16)), config,
                         tiertrain.Topology.build(config.parallel))
    attempt("gpt stages", lambda: tiertrain.load_pretrained(gpt, directory))
    gpt.close()
    return said


@pytest.mark.timeout(60)
def test_what_a_rank_cannot_build_or_load_is_refused_on_every_rank_by_name(tmp_path):
    """A parameter no initialiser covers (on the rank that builds it): no training, evaluation,
    export or checkpoint (they would hold whatever memory it was given) until a checkpoint gives
    it its value; a checkpoint without a tensor only the other rank holds (every rank checks the
    whole model's names); NaN in a tensor only rank 1 reads (the ranks agree before training)."""
    model = llama()
    state = model.state_dict()
    missing = {k: v for k, v in state.items() if k != "model.layers.3.mlp.up_proj.weight"}
    model.save_pretrained(tmp_path / "missing", state_dict=missing)
    state["model.layers.2.self_attn.q_proj.weight"][0, 0] = float("nan")
    model.save_pretrained(tmp_path / "nan", state_dict=state)
    scaled = llama()
    _with_scale()(scaled)
    scaled.save_pretrained(tmp_path / "scaled")
    said = run_distributed(_refusals, 2, str(tmp_path / "missing"), str(tmp_path / "nan"), str(tmp_path / "scaled"),
                           timeout=50)
    for what in ("unset", "unset eval", "unset export", "unset save"):  # (block 3 is the second stage's)
        assert "no initialiser gave model.layers.3.scale.gain a value" in said[1][what], said[1]
        assert "load a checkpoint holding them" in said[1][what] and "reset_parameters" in said[1][what]
        assert "global rank(s) [1] hold tensors no initialiser gave a value" in said[0][what], said[0]
    for rank in (0, 1):
        assert said[rank]["loaded"] > 0 and "after load" not in said[rank], "the checkpoint gave the gain its value"
        assert said[rank]["loaded mask"] is None and "after load mask" in said[rank], "a mask no checkpoint holds"
    mask = said[1]["after load mask"]
    assert "model.layers.3.scale.keep a value" in mask and "booleans" in mask
    for rank in (0, 1):
        assert "model.layers.3.mlp.up_proj.weight" in said[rank]["missing"], said[rank]
        assert said[rank]["missing"].startswith("PretrainedMismatchError"), said[rank]
        assert said[rank]["nan"].startswith("NonFiniteWeightsError"), said[rank]
    assert "model.layers.2.self_attn.q_proj.weight" in said[1]["nan"]
    assert "rank(s) [1]" in said[0]["nan"]
    assert all(r["gpt stages"].startswith("TypeError") and "tiertrain's GPT" in r["gpt stages"] for r in said)


def _four_ranks(rank, world, directory):
    """dp=2 × pp=2: trained from the checkpoint; tp=2 × pp=2: refused."""
    _, engine = _wrapped("qwen2-tied", 3, dp=2)
    tiertrain.load_pretrained(engine, directory)
    topology = engine.topology
    losses = []
    for batch in _batches("qwen2-tied", dp=2):
        loss = torch.tensor([engine.train_batch(rank_slices(batch, topology.coord("dp"), 2, MICRO, ACCUM))],
                            dtype=torch.float64)
        torch.distributed.all_reduce(loss, group=topology.group("dp"))
        losses.append(float(loss) / 2)
    whole = engine.full_state_dict()
    engine.close()
    config = _config(1, tp=2)
    try:
        with torch.device("meta"):
            model = qwen2_tied()
        tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
        refused = None
    except ConfigError as e:
        refused = str(e)
    return losses, whole, refused


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_data_parallel_replicas_of_a_stage_load_alike_and_tensor_parallel_slices_are_refused(tmp_path):
    """Every data-parallel replica of a stage reads the same tensors (within the oracle, the tied
    copy equal); a meta-device model with parallel.tp > 1 is refused before anything is built
    (tensor-parallel slices have no checkpoint to load from)."""
    qwen2_tied().save_pretrained(tmp_path)
    results = run_distributed(_four_ranks, 4, str(tmp_path), timeout=100)
    oracle = Oracle.run(reference_train, qwen2_tied(), _config(3, pp=1), _batches("qwen2-tied", dp=2))
    for losses, whole, refused in results:
        oracle.check(losses, None, "dp2 x pp2 losses")
        first, last = TIED["qwen2-tied"]
        assert torch.equal(whole.pop(last), whole[first])
        oracle.check(None, whole, "dp2 x pp2 parameters")
        assert "parallel.tp=2" in refused and "tensor-parallel slices" in refused
