"""A run of transformers' own Trainer continues under TiertrainTrainer: its ``checkpoint-N/``
(model.safetensors, and optimizer.pt: torch's optimizer state keyed by parameter number) is
resumed with ``train(resume_from_checkpoint=...)``, the numbers named by the Trainer's
param-group rule, checked against the groups' sizes and the states' shapes. The checkpoint is
written here by a real Trainer run; the reference for what each number names is the Trainer's
own resume (its optimizer's ``load_state_dict``); for a family whose weights transformers 5
converts on disk (a mixture of experts), the values' reference is ``from_pretrained``."""
from __future__ import annotations

import os
import shutil

import pytest
import torch

from tiertrain.config import ConfigError
from tiertrain.errors import CheckpointError
from tiertrain.state.shard_layout import unit_pieces
from tiertrain.update.protocol import SLOT_NAME

import zoo
from deepspeed_models import build_llama
from foreign_runs import batches

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

STEPS = 3


def _samples() -> list[dict]:
    return [{"input_ids": b["input_ids"][i], "labels": b["labels"][i]} for b in batches(STEPS + 2) for i in range(4)]


def _args(out: str, steps: int, **kwargs):
    return transformers.TrainingArguments(output_dir=out, per_device_train_batch_size=4, max_steps=steps,
                                          learning_rate=1e-3, weight_decay=0.1, report_to="none", disable_tqdm=True,
                                          use_cpu=True, **kwargs)


def _seeded(build, seed: int):
    torch.manual_seed(seed)
    return build()


def _trained(build, out: str, **kwargs) -> tuple[str, dict]:
    """(checkpoint-3 of a plain Trainer run of build's model, {name: the state Trainer's own
    resume gives it}); kwargs: more TrainingArguments (optim)."""
    trainer = transformers.Trainer(model=_seeded(build, 0), args=_args(out, STEPS, save_strategy="steps",
                                                                       save_steps=STEPS, **kwargs),
                                   train_dataset=_samples())
    trainer.train()
    checkpoint = os.path.join(out, f"checkpoint-{STEPS}")
    assert "optimizer.pt" in os.listdir(checkpoint)
    again = transformers.Trainer(model=_seeded(build, 11), args=_args(out, STEPS, **kwargs), train_dataset=_samples())
    optimizer = again.create_optimizer()
    optimizer.load_state_dict(torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=True))
    state = {n: optimizer.state[p] for n, p in again.model.named_parameters() if p in optimizer.state}
    return checkpoint, state


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    return _trained(build_llama, str(tmp_path_factory.mktemp("trainer")))


class _Loaded(transformers.TrainerCallback):
    """What the engine holds when the first step after the resume begins: the loaded state."""

    def __init__(self, trainer):
        self.trainer, self.values, self.state = trainer, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if self.values is None:
            engine = self.trainer.engine
            self.values = {n: v.clone() for n, v in engine.full_state_dict().items()}
            if engine.update.state_format.TAG == "nvme_stream":  # (no torch optimizer: the stream's own state)
                self.stream = engine.update.state_dict()["optimizer"]
                return
            pieces = {p.name: (p.lo, p.hi) for p in unit_pieces(0, engine.shard_description(), "units")}
            self.state = {getattr(view, SLOT_NAME): (pieces[getattr(view, SLOT_NAME)],
                                                     {k: v.clone() if torch.is_tensor(v) else v for k, v in st.items()})
                          for view, st in engine.update.optimizer.state.items()}
            self.steps, self.skipped = engine.steps, engine.skipped_steps
            self.rng = torch.get_rng_state()
            self.scaler = dict(engine.scaler.state_dict())
            self.lr = engine.learning_rate()


def _resumed(checkpoint: str, out: str, steps: int, trainer_cls=None, build=build_llama, tiertrain_config=None,
             optimizer_cls_and_kwargs=None, **kwargs):
    from tiertrain.integrations.hf_trainer import TiertrainTrainer

    trainer = (trainer_cls or TiertrainTrainer)(model=_seeded(build, 11),
                                                args=_args(out, steps, save_strategy="no", **kwargs),
                                                train_dataset=_samples(), tiertrain_config=tiertrain_config,
                                                optimizer_cls_and_kwargs=optimizer_cls_and_kwargs)
    loaded = _Loaded(trainer)
    trainer.add_callback(loaded)
    trainer.train(resume_from_checkpoint=checkpoint)
    return trainer, loaded


def _lr_after(updates: int, max_steps: int) -> float:
    """The Trainer's default schedule (linear, no warmup) after that many updates."""
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1e-3)
    scheduler = transformers.get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=max_steps)
    for _ in range(updates):
        optimizer.step()
        scheduler.step()
    return scheduler.get_last_lr()[0]


def _check_resumed(loaded, trainer, weights: dict, expected: dict) -> None:
    """The engine started from these weights, the schedule at the saved step and, for every
    parameter, the expected state, bit for bit; then trained on."""
    assert loaded.steps == STEPS and trainer.state.global_step == STEPS + 1 == trainer.engine.steps
    assert loaded.lr == pytest.approx(_lr_after(STEPS, STEPS + 1), rel=1e-12)
    assert set(weights) <= set(loaded.values)
    for name, value in weights.items():
        assert torch.equal(loaded.values[name], value.float()), name
    for name, ((lo, hi), state) in loaded.state.items():
        assert float(state["step"]) == float(expected[name]["step"]) == STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key].reshape(-1), expected[name][key].reshape(-1)[lo:hi]), (name, key)
    assert set(loaded.state) == set(expected)


def test_a_plain_trainer_checkpoint_resumes_with_its_values_moments_and_step(saved, tmp_path):
    """The engine starts from the checkpoint's weights and, for every parameter, the state the
    Trainer's own resume gives it, bit for bit; then trains on."""
    from safetensors.torch import load_file

    checkpoint, expected = saved
    trainer, loaded = _resumed(checkpoint, str(tmp_path), STEPS + 1)
    _check_resumed(loaded, trainer, load_file(os.path.join(checkpoint, "model.safetensors")), expected)
    # (and the RNG the first step draws from is the saved one, rng_state.pth, as the Trainer restores it)
    assert torch.equal(loaded.rng, torch.load(os.path.join(checkpoint, "rng_state.pth"), weights_only=False)["cpu"])
    trainer.close()


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_a_mixture_of_experts_checkpoint_resumes_its_experts_as_from_pretrained_converts_them(family, tmp_path):
    """transformers 5 stacks a layer's experts in memory and saves them one tensor each: the
    resume converts them back with transformers' own mapping, so the engine starts from what
    from_pretrained gives (experts and router included), with their moments."""
    from safetensors import safe_open

    build = getattr(zoo, family)
    checkpoint, expected = _trained(build, str(tmp_path / "saved"))
    with safe_open(os.path.join(checkpoint, "model.safetensors"), "pt") as f:
        on_disk = set(f.keys())
    in_memory = dict(build().named_parameters())
    assert [n for n in in_memory if "experts" in n and n not in on_disk], "the family's experts are not converted"
    reference = type(build()).from_pretrained(checkpoint).state_dict()
    trainer, loaded = _resumed(checkpoint, str(tmp_path / "resumed"), STEPS + 1, build=build)
    _check_resumed(loaded, trainer, {n: reference[n] for n in in_memory}, expected)
    trainer.close()


def _assert_state_as_saved(loaded, expected: dict) -> None:
    """Every parameter's state in the engine, as the Trainer's own resume gives it, bit for bit
    and in its dtype: a per-element value as this rank's piece of it (an elementwise optimizer's
    state over the flat shards; the whole of it for one stepping whole tensors), the others
    whole, numbers of the same type."""
    for name, ((lo, hi), state) in loaded.state.items():
        assert set(state) == set(expected[name]), name
        for key, value in expected[name].items():
            if not torch.is_tensor(value):
                assert type(state[key]) is type(value) and state[key] == value, (name, key)
            elif value.shape == loaded.values[name].shape and value.dim():  # (per element: this piece's)
                assert torch.equal(state[key].reshape(-1), value.reshape(-1)[lo:hi]), (name, key)
                assert state[key].dtype == value.dtype, (name, key)
            else:
                assert torch.equal(state[key], value) and state[key].dtype == value.dtype, (name, key)


OTHER_OPTIMS = {"adafactor": None, "sgd": "momentum=0.9,nesterov=True", "rmsprop": "momentum=0.5,centered=True",
                "adagrad": "lr_decay=0.01"}
"""The Trainer's other optims TiertrainTrainer builds (as the Trainer does), with optim_args it reads."""


@pytest.mark.parametrize("optim", sorted(OTHER_OPTIMS))
def test_a_run_with_another_of_the_trainers_optimizers_resumes_with_that_optimizers_state(optim, tmp_path):
    """Trained with optim adafactor, sgd, rmsprop or adagrad, the run continues under
    TiertrainTrainer with the same arguments: the engine steps the optimizer the Trainer builds,
    and every parameter starts from the state the Trainer's own resume gives it (Adafactor's
    factored moments and its step as a number, SGD's momentum and no step), bit for bit."""
    from safetensors.torch import load_file

    kwargs = {"optim": optim, "optim_args": OTHER_OPTIMS[optim]}
    checkpoint, expected = _trained(build_llama, str(tmp_path / "saved"), **kwargs)
    trainer, loaded = _resumed(checkpoint, str(tmp_path / "resumed"), STEPS + 1, **kwargs)
    built, options = transformers.Trainer.get_optimizer_cls_and_kwargs(trainer.args)
    assert type(trainer.engine.update.optimizer) is built and built.__name__.lower() == optim
    assert {k: g[k] for g in trainer.engine.update.optimizer.param_groups for k in options if k != "lr"} == \
        {k: v for k, v in options.items() if k != "lr"}
    assert loaded.steps == STEPS and trainer.state.global_step == STEPS + 1 == trainer.engine.steps
    assert loaded.lr == pytest.approx(_lr_after(STEPS, STEPS + 1), rel=1e-12)
    for name, value in load_file(os.path.join(checkpoint, "model.safetensors")).items():
        assert torch.equal(loaded.values[name], value), name
    assert set(loaded.state) == set(expected)
    assert len(expected) == sum(p.requires_grad for p in build_llama().parameters())
    _assert_state_as_saved(loaded, expected)
    trainer.close()


def test_sgds_momentum_resumes_into_the_nvme_tiers_stream(tmp_path):
    """On the NVMe tier the optimizer state lives in the stream's slots (by the optimizer's own
    names): SGD's momentum fills its one slot, the stream's step count is the run's."""
    from tiertrain.config import Config, from_dict

    kwargs = {"optim": "sgd", "optim_args": "momentum=0.9"}
    checkpoint, expected = _trained(build_llama, str(tmp_path / "saved"), **kwargs)
    config = from_dict(Config, {"zero": {"stage": 2, "offload_optimizer": "nvme", "nvme_path": str(tmp_path / "swap")}})
    trainer, loaded = _resumed(checkpoint, str(tmp_path / "resumed"), STEPS + 1, tiertrain_config=config, **kwargs)
    stream = loaded.stream
    assert stream["state_names"] == ["momentum_buffer"] and stream["step"] == STEPS
    pieces = unit_pieces(0, trainer.engine.shard_description(), "units")
    assert {p.name for p in pieces} == set(expected)
    for p in pieces:
        slot = stream["shards"][p.unit]["exp_avg"][p.start:p.start + p.hi - p.lo]  # (the first slot's name)
        assert torch.equal(slot, expected[p.name]["momentum_buffer"].reshape(-1)[p.lo:p.hi]), p.name
    assert trainer.state.global_step == STEPS + 1 == trainer.engine.steps
    trainer.close()


def test_a_checkpoint_of_another_optimizer_or_other_settings_is_refused_naming_both(saved, tmp_path):
    """AdamW's moments are no SGD momentum, nor amsgrad's maximum: refused before anything loads,
    naming what the checkpoint holds and what this engine's optimizer keeps."""
    checkpoint, _ = saved
    with pytest.raises(CheckpointError, match=r"state of '.*' is \['exp_avg', 'exp_avg_sq', 'step'\]; this engine's "
                                              r"optimizer SGD keeps \['momentum_buffer'\] for a [12]-D parameter"):
        _resumed(checkpoint, str(tmp_path / "a"), STEPS + 1, optim="sgd", optim_args="momentum=0.9")
    amsgrad = (torch.optim.AdamW, {"lr": 1e-3, "amsgrad": True})
    with pytest.raises(CheckpointError, match=r"this engine's optimizer AdamW keeps \['exp_avg', 'exp_avg_sq', "
                                              r"'max_exp_avg_sq', 'step'\]"):
        _resumed(checkpoint, str(tmp_path / "b"), STEPS + 1, optimizer_cls_and_kwargs=amsgrad)


def test_a_factored_state_of_another_shape_than_the_parameters_is_refused(tmp_path):
    """Adafactor keeps a matrix's second moment as a row and a column factor, not per element:
    their shapes follow the parameter's, and one that does not is refused naming both."""
    checkpoint, _ = _trained(build_llama, str(tmp_path / "saved"), optim="adafactor")
    path = os.path.join(checkpoint, "optimizer.pt")
    saved = torch.load(path, weights_only=True)
    row = saved["state"][0]["exp_avg_sq_row"]
    saved["state"][0]["exp_avg_sq_row"] = row[:-1].clone()
    torch.save(saved, path)
    with pytest.raises(CheckpointError, match=rf"state 'exp_avg_sq_row' of '.*' has shape \({row.numel() - 1},\); "
                                              rf"Adafactor keeps it for this \({row.numel()}, \d+\) parameter with "
                                              rf"shape \({row.numel()},\)"):
        _resumed(checkpoint, str(tmp_path / "resumed"), STEPS + 1, optim="adafactor")


def test_a_run_whose_optimizer_keeps_no_state_resumes_at_its_step(tmp_path):
    """SGD without momentum saves no state at all: the values and the step count (the Trainer's
    global step, SGD counting none) are what resumes."""
    checkpoint, expected = _trained(build_llama, str(tmp_path / "saved"), optim="sgd")
    assert expected == {}
    trainer, loaded = _resumed(checkpoint, str(tmp_path / "resumed"), STEPS + 1, optim="sgd")
    assert loaded.state == {} and loaded.steps == STEPS and trainer.engine.steps == STEPS + 1
    assert loaded.lr == pytest.approx(_lr_after(STEPS, STEPS + 1), rel=1e-12)
    trainer.close()


def test_another_grouping_rule_or_a_checkpoint_without_optimizer_state_is_refused_by_name(saved, tmp_path):
    from tiertrain.integrations.hf_trainer import TiertrainTrainer

    class DecayingAll(TiertrainTrainer):
        def get_decay_parameter_names(self, model):
            return [n for n, _ in model.named_parameters()]

    checkpoint, _ = saved
    with pytest.raises(CheckpointError, match=r"param groups hold \[\d+, \d+\] parameters; .* groups of \[\d+, 0\]"):
        _resumed(checkpoint, str(tmp_path / "a"), STEPS, trainer_cls=DecayingAll)
    bare = str(tmp_path / "bare")
    shutil.copytree(checkpoint, bare)
    os.remove(os.path.join(bare, "optimizer.pt"))
    with pytest.raises(ConfigError, match=r"no optimizer.pt \(saved by Trainer on its own\)"):
        _resumed(bare, str(tmp_path / "b"), STEPS)


def test_experts_that_do_not_fit_the_conversion_are_refused_naming_the_tensors(tmp_path):
    from safetensors.torch import load_file

    from tiertrain.state.trainer_checkpoint import model_named

    model = zoo.mixtral()
    model.save_pretrained(tmp_path)
    weights = load_file(os.path.join(tmp_path, "model.safetensors"))
    del weights["model.layers.0.block_sparse_moe.experts.2.w1.weight"]
    with pytest.raises(CheckpointError, match=r"the checkpoint X: MixtralForCausalLM's checkpoint conversion of "
                                              r"\['model.layers.0.block_sparse_moe.experts.0.w1.weight'.* into "
                                              r"'model.layers.0.mlp.experts.gate_up_proj' failed"):
        model_named(weights, model, "the checkpoint X")


def _overflowed_scaler_state() -> dict:
    """A GradScaler's state after 2 steps skipped on overflow, then 3 good ones (scaler.pt)."""
    scaler = torch.amp.GradScaler("cpu")
    p = torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([p], lr=0.1)
    for bad in (True, True, False, False, False):
        scaler.scale(p.sum()).backward()
        if bad:
            p.grad.fill_(float("inf"))
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()
    return scaler.state_dict()


def _skipping(saved, tmp_path, global_step: int, scaler_state) -> str:
    """checkpoint-3 as an fp16 run leaves it after its GradScaler skipped global_step - 3 steps:
    Adam took 3, trainer_state.json counts global_step, scaler.pt holds the scaler's state."""
    import json

    checkpoint = str(tmp_path / f"checkpoint-{global_step}")
    shutil.copytree(saved[0], checkpoint)
    state_file = os.path.join(checkpoint, "trainer_state.json")
    with open(state_file) as f:
        state = json.load(f)
    with open(state_file, "w") as f:
        json.dump({**state, "global_step": global_step}, f)
    torch.save(scaler_state, os.path.join(checkpoint, "scaler.pt"))
    return checkpoint


def test_steps_an_fp16_runs_scaler_skipped_continue_as_skipped_steps_with_its_loss_scale(saved, tmp_path):
    """The Trainer counts a step its GradScaler skipped on overflow (global_step) and neither
    Adam nor the schedule do: the engine continues at Adam's step, those steps skipped, the
    schedule where the Trainer's left it, the loss scale from scaler.pt."""
    scaler_state = _overflowed_scaler_state()
    assert scaler_state["scale"] == 2.0 ** 14 and scaler_state["_growth_tracker"] == 3
    checkpoint = _skipping(saved, tmp_path, STEPS + 2, scaler_state)
    trainer, loaded = _resumed(checkpoint, str(tmp_path / "out"), STEPS + 3, fp16=True)
    assert (loaded.steps, loaded.skipped) == (STEPS, 2)
    assert loaded.scaler["scale"] == 2.0 ** 14 and loaded.scaler["good_steps"] == 3
    scheduler = torch.load(os.path.join(checkpoint, "scheduler.pt"), weights_only=True)
    assert scheduler["last_epoch"] == STEPS  # (the Trainer's scheduler did not step on the skipped steps)
    assert loaded.lr == pytest.approx(_lr_after(STEPS, STEPS + 3), rel=1e-12)
    assert trainer.state.global_step == STEPS + 3 == trainer.engine.steps + trainer.engine.skipped_steps
    trainer.close()


def test_a_step_count_below_the_optimizers_or_a_scaler_file_of_something_else_is_refused_by_name(saved, tmp_path):
    checkpoint = _skipping(saved, tmp_path, STEPS - 1, {})
    with pytest.raises(CheckpointError, match=rf"the optimizer took {STEPS} steps but the run counted {STEPS - 1}"):
        _resumed(checkpoint, str(tmp_path / "a"), STEPS)
    checkpoint = _skipping(saved, tmp_path, STEPS, {"scale": float("nan"), "_growth_tracker": 0})
    with pytest.raises(CheckpointError, match=r"scaler.pt' is not a GradScaler's state"):
        _resumed(checkpoint, str(tmp_path / "b"), STEPS + 1)


def _lora():
    """build_llama's model (the same base weights whatever the seed, as from_pretrained gives
    them) with peft's LoRA adapters on q_proj and v_proj, initialised from the caller's seed."""
    import peft

    seed = torch.initial_seed()
    base = build_llama()
    torch.manual_seed(seed)
    return peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))


def test_a_peft_adapter_checkpoint_resumes_its_adapters_and_their_moments(tmp_path):
    """The Trainer saves a peft model's adapter alone (adapter_model.safetensors, the adapter's
    name taken out of each tensor's name) beside optimizer.pt: the engine starts from the
    adapter as peft's own loader places it, with the Trainer's moments; the base weights stay
    the model's own, as said."""
    import peft
    from safetensors.torch import load_file

    from tiertrain.state.foreign import FrozenKeptWarning

    checkpoint, expected = _trained(_lora, str(tmp_path / "saved"))
    assert "adapter_model.safetensors" in os.listdir(checkpoint) and "model.safetensors" not in os.listdir(checkpoint)
    reference = _seeded(_lora, 5)
    peft.set_peft_model_state_dict(reference, load_file(os.path.join(checkpoint, "adapter_model.safetensors")))
    adapters = {n: p.detach() for n, p in reference.named_parameters() if p.requires_grad}
    with pytest.warns(FrozenKeptWarning, match="holds no frozen parameter"):
        trainer, loaded = _resumed(checkpoint, str(tmp_path / "resumed"), STEPS + 1, build=_lora)
    _check_resumed(loaded, trainer, adapters, expected)
    trainer.close()
    with pytest.raises(CheckpointError, match=r"holds a peft adapter \(adapter_model.safetensors\) but the model is a "
                                              r"LlamaForCausalLM"):
        _resumed(checkpoint, str(tmp_path / "plain"), STEPS + 1)

    def query_only():
        import peft

        return peft.get_peft_model(build_llama(), peft.LoraConfig(r=4, target_modules=["q_proj"]))

    with pytest.raises(CheckpointError, match=r"the adapter's tensors \['base_model.model.model.layers.0.self_attn."
                                              r"v_proj.lora_A.weight'.* are none of this peft model's"):
        _resumed(checkpoint, str(tmp_path / "other"), STEPS + 1, build=query_only)


def _wide_llama() -> torch.nn.Module:
    """A Llama whose MLP matrices (64 × 128) are above bitsandbytes' min_8bit_size (4096): 8-bit states."""
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=32))


def test_a_run_with_a_bitsandbytes_8bit_optimizer_resumes_with_its_8bit_state(tmp_path):
    """A Trainer run with optimizer_cls_and_kwargs=(bitsandbytes' AdamW8bit, ...) continues under
    TiertrainTrainer with the same: its optimizer.pt nests each parameter's quantisation state
    under one key (bitsandbytes' state_dict(), for FSDP), which is read as the optimizer keeps
    it; the 8-bit states of the matrices of 4096 elements and more, and the 32-bit ones of the
    smaller tensors, start the engine's optimizer bit for bit (each parameter stepped whole)."""
    bnb = pytest.importorskip("bitsandbytes")
    from tiertrain.integrations.hf_trainer import TiertrainTrainer

    optimizer = (bnb.optim.AdamW8bit, {"lr": 1e-3})
    out = str(tmp_path / "saved")
    trainer = transformers.Trainer(model=_seeded(_wide_llama, 0), train_dataset=_samples(),
                                   args=_args(out, STEPS, save_strategy="steps", save_steps=STEPS),
                                   optimizer_cls_and_kwargs=optimizer)
    trainer.train()
    checkpoint = os.path.join(out, f"checkpoint-{STEPS}")
    again = transformers.Trainer(model=_seeded(_wide_llama, 11), args=_args(out, STEPS), train_dataset=_samples(),
                                 optimizer_cls_and_kwargs=optimizer)
    own = again.create_optimizer()
    own.load_state_dict(torch.load(os.path.join(checkpoint, "optimizer.pt"), weights_only=False))
    expected = {n: own.state[p] for n, p in again.model.named_parameters() if p in own.state}
    resumed = TiertrainTrainer(model=_seeded(_wide_llama, 11), args=_args(str(tmp_path / "resumed"), STEPS + 1),
                               train_dataset=_samples(), optimizer_cls_and_kwargs=optimizer)
    loaded = _Loaded(resumed)
    resumed.add_callback(loaded)
    resumed.train(resume_from_checkpoint=checkpoint)
    assert type(resumed.engine.update.optimizer) is bnb.optim.AdamW8bit and resumed.engine.update.plan.owned
    assert set(loaded.state) == set(expected) == {n for n, p in again.model.named_parameters() if p.requires_grad}
    _assert_state_as_saved(loaded, expected)
    assert {v.dtype for st in expected.values() for v in st.values() if torch.is_tensor(v)} >= {torch.uint8,
                                                                                               torch.float32}
    resumed.close()


def _fresh_bitsandbytes_manager():
    """bitsandbytes' GlobalOptimManager is one per process: the Trainer's embedding overrides
    (by parameter, and by group and index once stepped) would reach every later optimizer of
    this test process, as they would not in a script of its own."""
    import bitsandbytes

    bitsandbytes.optim.GlobalOptimManager.get_instance().initialize()


def _losses(trainer) -> list[float]:
    return [r["loss"] for r in trainer.state.log_history if "loss" in r]


@pytest.mark.parametrize("optim", ["adamw_bnb_8bit", "paged_lion_8bit"])
def test_the_trainers_bitsandbytes_optims_train_and_resume_as_with_the_trainer(optim, tmp_path):
    """optim="adamw_bnb_8bit" (bitsandbytes' AdamW at optim_bits 8, as the Trainer builds it):
    the Trainer keeps the embeddings' states at 32 bits and the other matrices' at 8; so does
    TiertrainTrainer (the embeddings in an optimizer of their own). The same 3 steps log the
    Trainer's losses, and a Trainer checkpoint resumes with its states bit for bit."""
    pytest.importorskip("bitsandbytes")
    from tiertrain.integrations.hf_trainer import TiertrainTrainer

    plain = transformers.Trainer(model=_seeded(_wide_llama, 0), args=_args(str(tmp_path / "plain"), STEPS, optim=optim,
                                                                          logging_steps=1), train_dataset=_samples())
    plain.train()
    _fresh_bitsandbytes_manager()
    ours = TiertrainTrainer(model=_seeded(_wide_llama, 0), args=_args(str(tmp_path / "ours"), STEPS, optim=optim,
                                                                     logging_steps=1), train_dataset=_samples())
    ours.train()
    kept = {getattr(t, SLOT_NAME): {k: v.dtype for k, v in st.items() if k == "state1"}
            for t, st in ours.engine.update.optimizer.state.items()}
    assert kept["model.embed_tokens.weight"] == {"state1": torch.float32}
    assert kept["model.layers.0.mlp.up_proj.weight"] == {"state1": torch.uint8}
    expected, got = _losses(plain), _losses(ours)
    assert len(got) == STEPS and max(abs(a - b) / abs(b) for a, b in zip(got, expected)) < 1e-5, (got, expected)
    ours.close()

    _fresh_bitsandbytes_manager()
    checkpoint, saved = _trained(_wide_llama, str(tmp_path / "saved"), optim=optim)
    _fresh_bitsandbytes_manager()
    trainer, loaded = _resumed(checkpoint, str(tmp_path / "resumed"), STEPS + 1, build=_wide_llama, optim=optim)
    assert set(loaded.state) == set(saved)
    _assert_state_as_saved(loaded, saved)
    trainer.close()
