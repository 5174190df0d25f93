"""TiertrainTrainer (tiertrain/integrations/hf_trainer.py): a transformers.Trainer script trained
on tiertrain's engine.

A tiny Llama-style causal LM is fine-tuned through the Trainer's own loop on 2 gloo ranks at
ZeRO stage 3 (gradient accumulation, clipping, weight-decay groups, a linear warmup/decay
schedule), and again with the optimizer on the CPU tier. Each run's logged losses, trained
parameters and ``evaluate()`` loss are checked against a plain single-process PyTorch
reference of the same steps (the whole global batch in one forward, torch AdamW, the Trainer's
scheduler, clip_grad_norm_) through the float64 oracle of tests/reference.py. ``save_model``
must write what ``AutoModelForCausalLM.from_pretrained`` loads, bit for bit the engine's
values; a checkpoint saved at step 2 must resume to exactly the uninterrupted run; arguments
the engine would not honour are refused by name.
"""
from __future__ import annotations

import copy
import functools
import math
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from reference import Oracle, engine_train, make_config, reference_train  # noqa: E402
from tiertrain.config import Config, ConfigError, from_dict  # noqa: E402
from tiertrain.integrations.hf_arguments import config_from_training_arguments  # noqa: E402
from tiertrain.integrations.hf_trainer import TiertrainTrainer  # noqa: E402
from tiertrain.testing import run_distributed  # noqa: E402

WORLD, SEQ, VOCAB = 2, 16, 128
STEPS = 4
LR, WEIGHT_DECAY, MAX_GRAD_NORM, WARMUP = 1e-2, 0.1, 1.0, 1
# eps 1e-3 as in tests/test_zero.py's Llama: Adam divides near-zero gradients by sqrt(v) + eps,
# and with 1e-8 it amplifies their rounding noise into lr-sized steps that no two summation
# orders agree on.
EPS = 1e-3
RUNS = {
    # name: (zero section, per-device micro-batch, gradient accumulation)
    "stage 3": ({"stage": 3}, 2, 2),
    # ... and through Trainer(optimizer_cls_and_kwargs=(torch.optim.AdamW, {...})), the same AdamW,
    # with the script's own compute_loss (a per-micro-batch mean: loss_is_scaled_for_ga=False)
    "stage 3, optimizer on the cpu tier": ({"stage": 3, "offload_optimizer": "cpu"}, 1, 4),
}
CLIENT_OPTIMIZER = (torch.optim.AdamW, {"lr": LR, "betas": (0.9, 0.999), "eps": EPS})


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=32))


def _samples(n: int, seed: int) -> list[dict]:
    """Learnable sequences: a random start, then t[i+1] = (5·t[i] + 3) mod VOCAB; labels are the
    inputs (the causal LM shifts them)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        t = torch.empty(SEQ, dtype=torch.long)
        t[0] = torch.randint(0, VOCAB, (1,), generator=g)
        for i in range(SEQ - 1):
            t[i + 1] = (5 * t[i] + 3) % VOCAB
        out.append({"input_ids": t, "labels": t.clone()})
    return out


class _List(torch.utils.data.Dataset):
    def __init__(self, items):
        self.items = items

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


def _global_batch(micro: int, accum: int) -> int:
    return micro * accum * WORLD


def _train_set(micro: int, accum: int) -> list[dict]:
    return _samples(STEPS * _global_batch(micro, accum), seed=1)


EVAL = _samples(8, seed=2)


def _args(out: str, micro: int, accum: int, **extra):
    return transformers.TrainingArguments(
        output_dir=out, per_device_train_batch_size=micro, per_device_eval_batch_size=2,
        gradient_accumulation_steps=accum, max_steps=STEPS, learning_rate=LR, weight_decay=WEIGHT_DECAY,
        adam_epsilon=EPS, max_grad_norm=MAX_GRAD_NORM, warmup_steps=WARMUP, lr_scheduler_type="linear",
        logging_steps=1, report_to="none", disable_tqdm=True, seed=0, train_sampling_strategy="sequential",
        **{"save_strategy": "no", **extra})


class OwnLoss(TiertrainTrainer):
    """A script's compute_loss override: the model called without labels, the causal LM loss
    computed from its logits (the mean over this micro-batch's predicted tokens)."""

    loss_is_scaled_for_ga = False

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        outputs = model(input_ids=inputs["input_ids"])
        logits = outputs.logits[:, :-1].float()
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), inputs["labels"][:, 1:].reshape(-1))
        return (loss, outputs) if return_outputs else loss


def _losses(trainer) -> list[float]:
    return [e["loss"] for e in trainer.state.log_history if "loss" in e and "eval_loss" not in e]


# -- per rank --------------------------------------------------------------------------------------

def _rank(rank, world, root):
    out = {}
    for name, (zero, micro, accum) in RUNS.items():
        config = from_dict(Config, {"zero": zero})
        first = name == "stage 3"
        extra = dict(save_strategy="steps", save_steps=2) if first else {}
        directory = os.path.join(root, name.replace(" ", "_").replace(",", ""))
        trainer = (TiertrainTrainer if first else OwnLoss)(model=_model(), args=_args(directory, micro, accum, **extra),
                                   train_dataset=_List(_train_set(micro, accum)), eval_dataset=_List(EVAL),
                                   tiertrain_config=config,
                                   optimizer_cls_and_kwargs=None if first else CLIENT_OPTIMIZER)
        result = trainer.train()
        run = dict(losses=_losses(trainer), params=trainer.engine.full_state_dict(),
                   train_loss=result.training_loss, eval=trainer.evaluate(),
                   lrs=[e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e],
                   grad_norms=[e["grad_norm"] for e in trainer.state.log_history if "grad_norm" in e],
                   device=str(trainer.args.device), world_size=trainer.args.world_size,
                   process_index=trainer.args.process_index)
        predicted = trainer.predict(_List(EVAL))
        run["predict"] = dict(shape=tuple(predicted.predictions.shape), loss=predicted.metrics["test_loss"],
                              labels=predicted.label_ids)
        saved = os.path.join(root, "saved", name.replace(" ", "_").replace(",", ""))
        trainer.save_model(saved)
        run["saved"] = saved
        if first:
            run["checkpoints"] = sorted(os.listdir(directory))
        trainer.close()
        run["closed_model"] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        out[name] = run
        if first:
            # A fresh trainer (other initial weights: everything comes from the checkpoint) resumed
            # at step 2 must go on exactly as the uninterrupted run.
            torch.manual_seed(7)
            other = transformers.LlamaForCausalLM(_model().config)
            resumed = TiertrainTrainer(model=other, args=_args(directory, micro, accum, **extra),
                                       train_dataset=_List(_train_set(micro, accum)), tiertrain_config=config)
            resumed.train(resume_from_checkpoint=os.path.join(directory, "checkpoint-2"))
            out["resumed"] = dict(losses=_losses(resumed), params=resumed.engine.full_state_dict())
            resumed.close()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory, one_torch_thread):  # (one thread: also for the references, in this process)
    root = str(tmp_path_factory.mktemp("hf_trainer"))
    return run_distributed(_rank, WORLD, root, timeout=110)


# -- the reference ---------------------------------------------------------------------------------

def _reference_groups(model) -> list[dict]:
    """Decay on matrices, none on the norms' gains: for this Llama, the split the Trainer's
    get_decay_parameter_names makes by name (checked below)."""
    params = list(model.named_parameters())
    return [{"params": [p for _, p in params if p.dim() >= 2], "weight_decay": WEIGHT_DECAY},
            {"params": [p for _, p in params if p.dim() < 2], "weight_decay": 0.0}]


def _reference(model, micro: int, accum: int):
    """Plain PyTorch: each global batch in one forward (mean over every token of it), the
    Trainer's optimizer, schedule and clipping."""
    data = _train_set(micro, accum)
    g = _global_batch(micro, accum)
    batches = [{k: torch.stack([s[k] for s in data[i * g:(i + 1) * g]]) for k in ("input_ids", "labels")}
               for i in range(STEPS)]
    config = make_config(optimizer={"grad_clip": MAX_GRAD_NORM})
    optimizer = lambda m: torch.optim.AdamW(_reference_groups(m), lr=LR, betas=(0.9, 0.999), eps=EPS)  # noqa: E731
    scheduler = functools.partial(transformers.get_linear_schedule_with_warmup, num_warmup_steps=WARMUP,
                                  num_training_steps=STEPS)
    return reference_train(model, config, batches, build_optimizer=optimizer, lr_scheduler=scheduler)


def _eval_loss(params: dict) -> float:
    """The eval set's mean token loss at these parameters, in their dtype, in one forward."""
    model = _model().to(next(iter(params.values())).dtype)
    model.load_state_dict(params)
    batch = {k: torch.stack([s[k] for s in EVAL]) for k in ("input_ids", "labels")}
    with torch.no_grad():
        return float(model(**batch).loss)


@functools.lru_cache(maxsize=None)
def _oracle(name: str) -> Oracle:
    _, micro, accum = RUNS[name]
    oracle = Oracle.run(_reference, _model(), micro, accum)
    assert oracle.losses64[-1] < oracle.losses64[0], f"{name}: the reference itself must learn"
    return oracle


# -- the tests -------------------------------------------------------------------------------------

@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(RUNS))
def test_trainer_loop_trains_like_the_single_process_reference(runs, name):
    run = runs[0][name]
    assert run["world_size"] == WORLD and run["process_index"] == 0
    assert torch.device(run["device"]).type == "cpu"
    assert len(run["losses"]) == STEPS, f"{name}: logged losses {run['losses']}"
    oracle = _oracle(name)
    oracle.check(run["losses"], run["params"], f"TiertrainTrainer, {name}")
    # Every rank agrees on the logged losses and holds the same full parameters.
    other = runs[1][name]
    assert other["world_size"] == WORLD and other["process_index"] == 1
    assert other["losses"] == run["losses"]
    assert all(torch.equal(other["params"][n], p) for n, p in run["params"].items())
    # The learning rates the Trainer logged are its linear warmup/decay schedule, per update.
    # (transformers' linear schedule: s / warmup during warmup, then (steps - s) / (steps - warmup))
    want = [LR * (s / WARMUP if s < WARMUP else (STEPS - s) / (STEPS - WARMUP)) for s in range(STEPS)]
    assert run["lrs"] == pytest.approx(want, rel=1e-12), run["lrs"]
    assert all(g > 0 and g == g for g in run["grad_norms"]) and len(run["grad_norms"]) == STEPS
    assert run["train_loss"] == pytest.approx(sum(run["losses"]) / STEPS, rel=1e-6)
    # close() hands the model back whole with the trained values.
    assert all(torch.equal(run["closed_model"][n], p) for n, p in run["params"].items())


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(RUNS))
def test_evaluate_returns_the_reference_eval_loss(runs, name):
    oracle = _oracle(name)
    got = runs[0][name]["eval"]["eval_loss"]
    assert runs[1][name]["eval"]["eval_loss"] == got
    ref32, ref64 = _eval_loss(oracle.params32), _eval_loss(oracle.params64)
    Oracle([ref32], {}, [ref64], {}).check([got], None, f"evaluate() after {name}")
    # predict(): the same loss, every sample's logits and labels gathered in order.
    predicted = runs[0][name]["predict"]
    assert predicted["loss"] == got and predicted["shape"] == (len(EVAL), SEQ, VOCAB)
    assert (predicted["labels"] == torch.stack([s["labels"] for s in EVAL]).numpy()).all()


@pytest.mark.timeout(150)
@pytest.mark.parametrize("name", list(RUNS))
def test_save_model_writes_what_from_pretrained_loads(runs, name):
    run = runs[0][name]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(run["saved"])
    assert type(loaded).__name__ == "LlamaForCausalLM"
    state = dict(loaded.named_parameters())
    assert state.keys() == run["params"].keys()
    differ = [n for n, p in run["params"].items() if not torch.equal(state[n].detach(), p)]
    assert not differ, f"{name}: saved parameters differ from the engine's: {differ}"


@pytest.mark.timeout(150)
def test_a_checkpoint_resumes_the_same_trajectory(runs):
    run, resumed = runs[0]["stage 3"], runs[0]["resumed"]
    assert run["checkpoints"] == ["checkpoint-2", "checkpoint-4"], run["checkpoints"]
    # (the log history of steps 1-2 comes back with trainer_state.json; steps 3-4 are new)
    assert resumed["losses"] == run["losses"], (resumed["losses"], run["losses"])
    differ = [n for n, p in run["params"].items() if not torch.equal(resumed["params"][n], p)]
    assert not differ, f"resumed parameters differ: {differ}"


def test_reference_groups_are_the_trainers_decay_split():
    model = _model()
    names = set(transformers.Trainer.get_decay_parameter_names(TiertrainTrainer.__new__(TiertrainTrainer), model))
    assert names == {n for n, p in model.named_parameters() if p.dim() >= 2}


# -- what is refused -------------------------------------------------------------------------------

REFUSED = [
    # (TrainingArguments keywords, or attributes set after construction, the name the error must give)
    (dict(fsdp="full_shard"), "fsdp"),
    (dict(optim="schedule_free_adamw"), "optim"),  # (the Trainer's optims that need another package, or the model)
    (dict(optim="galore_adamw"), "optim"),
    (dict(optim="sgd", optim_args="momentun=0.9"), "optim_args"),  # (a key the Trainer would ignore unseen)
    (dict(optim="adafactor", optim_args="beta1=0.9"), "optim_args"),  # (the Trainer reads none for adafactor)
    (dict(auto_find_batch_size=True), "auto_find_batch_size"),
    (dict(bf16_full_eval=True, use_cpu=True), "bf16_full_eval"),
]


@pytest.fixture
def deepspeed_undone(environ_kept):
    """TrainingArguments(deepspeed=...) leaves DeepSpeed on for every later Trainer of this
    process (ACCELERATE_USE_DEEPSPEED, transformers' global DeepSpeed config, accelerate's shared
    state): undo the three afterwards, as a new process would start."""
    yield
    from accelerate.state import AcceleratorState
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    AcceleratorState._reset_state(reset_partial_state=True)  # (accelerate's own tests reset it so)


@pytest.fixture
def environ_kept():
    """TrainingArguments(torch_compile=True, fsdp=...) set ACCELERATE_*/FSDP_* variables in this
    process: put the environment back afterwards."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("kwargs,argument", REFUSED, ids=[a for _, a in REFUSED])
def test_arguments_the_engine_would_not_honour_are_refused(tmp_path, environ_kept, kwargs, argument):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", **kwargs)
    with pytest.raises(ConfigError, match=rf"TrainingArguments\({argument}=") as e:
        TiertrainTrainer(model=_model(), args=args, train_dataset=_List(EVAL))
    assert "valid" in str(e.value) or "set " in str(e.value)


@pytest.mark.timeout(120)
def test_torch_compile_compiles_each_block_and_trains_as_eager(tmp_path, environ_kept):
    """TrainingArguments(torch_compile=True) compiles each decoder layer's forward (the engine's
    stage-3 hooks around it, docs/compile.md), with the arguments' backend: a hook inside a
    layer runs while dynamo traces it, and training ("eager" backend: the captured graphs run
    unchanged) is bit for bit the uncompiled trainer's."""
    data = _samples(STEPS * 2, seed=1)
    stage3 = from_dict(Config, {"zero": {"stage": 3}})

    def train(directory, **extra):
        model = _model()
        traced = []
        model.model.layers[0].mlp.register_forward_pre_hook(
            lambda module, args: traced.append(torch.compiler.is_compiling()))
        args = _args(str(tmp_path / directory), 2, 1, use_cpu=True, **extra)
        trainer = TiertrainTrainer(model=model, args=args, train_dataset=_List(data), tiertrain_config=stage3)
        trainer.train()
        params = trainer.engine.full_state_dict()
        trainer.engine.close()
        return _losses(trainer), params, traced

    eager_losses, eager_params, eager_traced = train("eager")
    losses, params, traced = train("compiled", torch_compile=True, torch_compile_backend="eager")
    assert eager_traced and not any(eager_traced)
    assert any(traced)  # (the hook ran inside the compiled layer's trace)
    assert losses == eager_losses
    assert params.keys() == eager_params.keys()  # (the parameter names are the model's own)
    assert all(torch.equal(params[n], eager_params[n]) for n in params)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kwargs", [{}, {"every_n_layers": 2, "use_reentrant": True}],
                         ids=["every-layer", "every-2nd-reentrant"])  # (offload: pinned memory, a GPU's)
def test_the_models_own_activation_checkpointing_recomputes_and_trains_the_same(tmp_path, environ_kept, kwargs):
    """TrainingArguments(activation_checkpointing=True) at stage 3: the Trainer enables the
    model's checkpointing, each checkpointed layer runs again in backward (its parameters
    gathered again), and training is bit for bit the trainer's without it. Beside the engine's
    own checkpointing (activations.checkpoint_every) it is refused: two checkpoints around each
    layer."""
    data = _samples(STEPS * 2, seed=1)
    stage3 = from_dict(Config, {"zero": {"stage": 3}})

    def train(directory, **extra):
        model = _model()
        calls = []
        for i, layer in enumerate(model.model.layers):
            layer.mlp.register_forward_pre_hook(lambda module, args, i=i: calls.append(i))
        args = _args(str(tmp_path / directory), 2, 1, use_cpu=True, **extra)
        trainer = TiertrainTrainer(model=model, args=args, train_dataset=_List(data), tiertrain_config=stage3)
        trainer.train()
        params = trainer.engine.full_state_dict()
        trainer.engine.close()
        return _losses(trainer), params, [calls.count(i) for i in range(len(model.model.layers))]

    plain_losses, plain_params, plain_calls = train("plain")
    losses, params, calls = train("checkpointed", activation_checkpointing=True,
                                  activation_checkpointing_kwargs=kwargs)
    every = kwargs.get("every_n_layers", 1)  # (layer i checkpointed where i % every == 0: run again in backward)
    assert plain_calls == [STEPS, STEPS] and calls == [STEPS * (1 + (i % every == 0)) for i in range(2)], calls
    assert losses == plain_losses
    assert all(torch.equal(params[n], plain_params[n]) for n in plain_params)
    both = from_dict(Config, {"zero": {"stage": 3}, "activations": {"checkpoint_every": 1}})
    args = _args(str(tmp_path / "both"), 2, 1, use_cpu=True, gradient_checkpointing=True)
    with pytest.raises(ConfigError, match=r"TrainingArguments\(activation_checkpointing=True\).*"
                                          r"activations.checkpoint_every=1 checkpoints the layers too"):
        TiertrainTrainer(model=_model(), args=args, train_dataset=_List(data), tiertrain_config=both)


class _Scores:
    """compute_metrics whose score peaks at the second evaluation (the best checkpoint is then
    neither the first nor the last)."""

    def __init__(self):
        self.calls = 0

    def __call__(self, prediction) -> dict:
        self.calls += 1
        return {"score": [0.0, 5.0, 1.0, 0.0][self.calls - 1]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("save_strategy,limit", [("steps", 1), ("best", None)])
def test_the_best_checkpoint_is_kept_and_loaded_at_the_end_as_the_trainer_does(tmp_path, save_strategy, limit):
    """metric_for_best_model with load_best_model_at_end: trainer_state's best_model_checkpoint,
    the checkpoints left after rotation (save_total_limit=1 keeps the best) or saved at each new
    best (save_strategy="best") are transformers' own Trainer's, and at the end the engine holds
    the best checkpoint's weights. Before, best_model_checkpoint stayed None (the rotation could
    delete the best) and load_best_model_at_end was refused."""
    data = _samples(STEPS * 2, seed=1)
    stage3 = from_dict(Config, {"zero": {"stage": 3}})
    extra = dict(use_cpu=True, eval_strategy="steps", eval_steps=1, save_strategy=save_strategy, save_steps=1,
                 save_total_limit=limit, metric_for_best_model="score", greater_is_better=True,
                 load_best_model_at_end=True)

    def train(cls, directory, **kwargs):
        trainer = cls(model=_model(), args=_args(str(tmp_path / directory), 2, 1, **extra),
                      train_dataset=_List(data), eval_dataset=_List(EVAL), compute_metrics=_Scores(), **kwargs)
        trainer.train()
        return trainer, sorted(os.listdir(tmp_path / directory))

    theirs, their_checkpoints = train(transformers.Trainer, "theirs")
    ours, our_checkpoints = train(TiertrainTrainer, "ours", tiertrain_config=stage3)
    assert our_checkpoints == their_checkpoints and "checkpoint-2" in our_checkpoints, our_checkpoints
    best = str(tmp_path / "ours" / "checkpoint-2")
    assert ours.state.best_model_checkpoint == best
    assert theirs.state.best_model_checkpoint == str(tmp_path / "theirs" / "checkpoint-2")
    from safetensors.torch import load_file

    saved = load_file(os.path.join(best, "model.safetensors"))
    held = ours.engine.full_state_dict()
    ours.engine.close()
    assert all(torch.equal(held[n], saved[n]) for n in saved), "the engine holds the best checkpoint's weights"


def test_an_epoch_that_ends_inside_an_accumulation_window_is_refused(tmp_path):
    """3 batches per epoch with gradient_accumulation_steps=2: the Trainer would take a short
    last step the engine does not (single process: refused before the engine is built)."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                          per_device_train_batch_size=1, gradient_accumulation_steps=2,
                                          num_train_epochs=1)
    trainer = TiertrainTrainer(model=_model(), args=args, train_dataset=_List(EVAL[:3]))
    with pytest.raises(ConfigError, match=r"3 batches, not a multiple of gradient_accumulation_steps=2"):
        trainer.train()
    assert trainer.engine is None


DS_CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_configs")


def test_a_deepspeed_config_sets_zero_and_the_schedule_its_auto_values_the_training_arguments(tmp_path):
    """Issue 35, item 1: TrainingArguments(deepspeed=...) needs the deepspeed package to be
    built, so the config comes as TiertrainTrainer(deepspeed=...) (or args.deepspeed, where it
    can be set). The transformers documentation's ZeRO-2 config: stage 2 with the optimizer on
    the CPU, "auto" values from the arguments, and its WarmupLR (a log warmup, then flat)."""
    import json

    from tiertrain.integrations.hf_arguments import deepspeed_schedule
    from tiertrain.optim import lr_factor

    path = os.path.join(DS_CONFIGS, "transformers_zero2.json")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", learning_rate=1e-3,
                                          warmup_steps=4, max_steps=20, max_grad_norm=0.5)
    trainer = TiertrainTrainer(model=_model(), args=args, train_dataset=_List(EVAL), deepspeed=path)
    config = trainer.tiertrain_config
    assert (config.zero.stage, config.zero.offload_optimizer.config_name) == (2, "cpu")
    assert (config.optimizer.lr, config.optimizer.grad_clip) == (1e-3, 0.5)  # ("auto": the arguments')
    schedule = deepspeed_schedule(path, args, 20)
    assert (schedule.warmup_steps, schedule.warmup_shape, schedule.decay_steps) == (4, "log", 0)
    # DeepSpeed's rates: its scheduler steps after each update, so the first two run at warmup_min_lr (0)
    assert [lr_factor(s, schedule) for s in range(6)] == [0.0, 0.0, math.log(2) / math.log(4),
                                                          math.log(3) / math.log(4), 1.0, 1.0]
    # Trained: the rates applied are the DeepSpeed schedule's (the arguments ask for a linear warmup).
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", learning_rate=1e-3,
                                          warmup_steps=4, max_steps=3, per_device_train_batch_size=2,
                                          logging_steps=1, use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = TiertrainTrainer(model=_model(), args=args, train_dataset=_List(EVAL), deepspeed=path)
    trainer.train()
    applied = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    schedule = deepspeed_schedule(path, args, 3)
    assert applied == [1e-3 * lr_factor(s, schedule) for s in range(3)], applied
    # An explicit value that disagrees with the arguments is refused, as transformers refuses it.
    with open(path) as f:
        ds = json.load(f)
    ds["optimizer"]["params"]["lr"] = 3e-4
    with pytest.raises(ConfigError, match=r"DeepSpeed optimizer.params.lr=0.0003 disagrees with "
                                          r"TrainingArguments\(learning_rate\)=0.001"):
        TiertrainTrainer(model=_model(), args=args, train_dataset=_List(EVAL), deepspeed=ds)
    # TrainingArguments(deepspeed=...) needs the deepspeed package to be built; where it is, the
    # trainer reads the config from there (here: the attribute set after construction).
    args.deepspeed = path
    assert TiertrainTrainer(model=_model(), args=args, train_dataset=_List(EVAL)).deepspeed_config == path
    args.deepspeed = None
    # A key left out takes DeepSpeed's default: no clipping.
    del ds["gradient_clipping"], ds["optimizer"]["params"]["lr"]
    config = config_from_training_arguments(args, None, ds)
    assert config.optimizer.grad_clip == 0.0 and config.zero.stage == 2
    # optim naming another optimizer than the config's block: with DeepSpeed the block would win, unseen.
    other = copy.copy(args)
    other.optim = "adafactor"
    with pytest.raises(ConfigError, match=r"TrainingArguments\(optim='adafactor'\).*optimizer block names the "
                                          r"optimizer too"):
        config_from_training_arguments(other, None, ds)
    del ds["optimizer"]
    assert config_from_training_arguments(other, None, ds).zero.stage == 2


def test_fp16_scales_the_loss_as_the_trainers_grad_scaler_does(tmp_path):
    """fp16=True: the Trainer's torch GradScaler grows the scale after 2000 good steps and backs
    off at every overflow; the engine's scaler takes those values, unless tiertrain_config or a
    DeepSpeed config (its own semantics) sets the scaling."""
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", fp16=True, use_cpu=True)
    torch_scaler = torch.amp.GradScaler("cpu")
    scaling = config_from_training_arguments(args).precision.loss_scale
    assert (scaling.initial_scale, scaling.growth_factor, scaling.backoff_factor, scaling.growth_interval) == \
        (torch_scaler.get_scale(), torch_scaler.get_growth_factor(), torch_scaler.get_backoff_factor(),
         torch_scaler.get_growth_interval())
    assert scaling.hysteresis == 1 and scaling.dynamic
    own = config_from_training_arguments(args, from_dict(Config, {"precision": {"loss_scale": {"hysteresis": 3}}}))
    assert (own.precision.loss_scale.hysteresis, own.precision.loss_scale.growth_interval) == (3, 1000)
    deepspeed = config_from_training_arguments(args, None, {"fp16": {"enabled": "auto", "hysteresis": 2}})
    assert (deepspeed.precision.loss_scale.hysteresis, deepspeed.precision.loss_scale.growth_interval) == (2, 1000)


def test_conflicting_and_unsupported_trainer_inputs_are_refused(tmp_path):
    args = transformers.TrainingArguments(output_dir=str(tmp_path), report_to="none", learning_rate=1e-3)
    # A config field both set, to different values: neither silently wins.
    with pytest.raises(ConfigError, match=r"optimizer.lr=0.5 disagrees with TrainingArguments\(learning_rate\)"):
        config_from_training_arguments(args, from_dict(Config, {"optimizer": {"lr": 0.5}}))
    with pytest.raises(ConfigError, match=r"precision.dtype='bf16' disagrees with TrainingArguments\(bf16, fp16\)"):
        config_from_training_arguments(args, from_dict(Config, {"precision": {"dtype": "bf16"}}))
    with pytest.raises(ConfigError, match=r"tiertrain_config.schedule=.*lr_scheduler_type"):
        config_from_training_arguments(args, from_dict(Config, {"schedule": {"warmup_steps": 3}}))
    with pytest.raises(ConfigError, match=r"parallel tp=2, pp=1 is not supported"):
        config_from_training_arguments(args, from_dict(Config, {"parallel": {"tp": 2}}))
    # Agreeing values and the fields TrainingArguments has no word for pass through.
    config = config_from_training_arguments(args, from_dict(Config, {"optimizer": {"lr": 1e-3},
                                                                     "zero": {"stage": 3}}))
    assert (config.optimizer.lr, config.zero.stage, config.optimizer.betas) == (1e-3, 3, (0.9, 0.999))
    assert config.optimizer.weight_decay == 0.0 and config.optimizer.grad_clip == 1.0
    model = _model()
    opt = torch.optim.AdamW(model.parameters())
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    schedulers = {r"StepLR\)\): the engine rebuilds the scheduler.*LambdaLR only": torch.optim.lr_scheduler.StepLR(opt, 2),
                  "built on another optimizer": transformers.get_constant_schedule(other)}
    stepped = transformers.get_constant_schedule(opt)
    stepped.step()
    schedulers["stepped 1 time"] = stepped
    for message, scheduler in schedulers.items():
        with pytest.raises(ConfigError, match=message):
            TiertrainTrainer(model=model, args=args, optimizers=(opt, scheduler))
    with pytest.raises(ConfigError, match=r"optimizers=\(\.\.\.\) and optimizer_cls_and_kwargs both"):
        TiertrainTrainer(model=model, args=args, optimizers=(opt, None), optimizer_cls_and_kwargs=CLIENT_OPTIMIZER)
    with pytest.raises(ConfigError, match=r"the first must be a torch.optim.Optimizer"):
        TiertrainTrainer(model=model, args=args, optimizers=("adamw", None))
    with pytest.raises(ConfigError, match=r"model_init=\.\.\.\) is not supported"):
        TiertrainTrainer(model=None, args=args, model_init=_model)
    lazy = copy.copy(args)
    lazy.lr_scheduler_type = "reduce_lr_on_plateau"
    with pytest.raises(ConfigError, match=r"lr_scheduler_type='reduce_lr_on_plateau'"):
        config_from_training_arguments(lazy)


EXPLICIT_DS = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
               "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": [0.9, 0.999], "eps": EPS,
                                                          "weight_decay": 0.0}},
               "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": LR,
                                                                 "warmup_num_steps": 2, "total_num_steps": STEPS}},
               "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", ["transformers_zero2.json", "transformers_zero3_offload.json", "explicit"])
def test_training_arguments_deepspeed_trains_like_the_cli_translation_of_the_same_file(tmp_path, name,
                                                                                      deepspeed_undone):
    """Issue 35: TrainingArguments(deepspeed=ds.json) (it needs the deepspeed package, which CI
    installs for this test) with the transformers docs' ZeRO-2 and ZeRO-3 offload configs,
    unchanged, and an explicit one, trains as tiertrain.wrap with the config `tiertrain train
    --deepspeed ds.json` builds from the same file (its "auto" values given on the command line as
    the arguments give them): both within the float64 oracle's bound of the single-process
    reference, at the DeepSpeed schedule's rates."""
    if os.environ.get("TIERTRAIN_TEST_DEEPSPEED"):  # (CI's step for this test: not found is a failure)
        import deepspeed  # noqa: F401
    else:
        pytest.importorskip("deepspeed")
    import json

    from tiertrain.cli import load_with_deepspeed
    from tiertrain.optim import lr_factor

    micro, accum, warmup = 2, 2, 2
    path = os.path.join(DS_CONFIGS, name)
    if name == "explicit":
        path = str(tmp_path / "ds.json")
        with open(path, "w") as f:
            json.dump(EXPLICIT_DS, f)
    data = _samples(STEPS * micro * accum, seed=1)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "out"), deepspeed=path, per_device_train_batch_size=micro,
        gradient_accumulation_steps=accum, max_steps=STEPS, learning_rate=LR, adam_epsilon=EPS, weight_decay=0.0,
        warmup_steps=warmup, max_grad_norm=1.0, logging_steps=1, report_to="none", disable_tqdm=True, seed=0,
        train_sampling_strategy="sequential", save_strategy="no", use_cpu=True)
    try:
        trainer = TiertrainTrainer(model=_model(), args=args, train_dataset=_List(data))
        assert torch.distributed.get_world_size() == 1  # (the world of one DeepSpeed would make)
        trainer.train()
        trainer_losses, trainer_params = _losses(trainer), trainer.engine.full_state_dict()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    rates = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    # The CLI's translation of the same file, "auto" values given as the arguments give them.
    config, _ = load_with_deepspeed(None, [
        "--steps", str(STEPS), "--optimizer.lr", str(LR), "--optimizer.eps", str(EPS), "--optimizer.weight_decay", "0",
        "--optimizer.betas", "[0.9, 0.999]", "--optimizer.grad_clip", "1.0", "--schedule.warmup_steps", str(warmup),
        "--batch.micro_batch_size", str(micro), "--batch.grad_accum_steps", str(accum)], path)
    batches = [{k: torch.stack([s[k] for s in data[i * micro * accum:(i + 1) * micro * accum]])
                for k in ("input_ids", "labels")} for i in range(STEPS)]
    losses, params, _ = engine_train(0, 1, _model(), config, batches)
    placement = lambda z: (z.stage, z.offload_optimizer.config_name, z.offload_params.config_name)  # noqa: E731
    assert placement(trainer.tiertrain_config.zero) == placement(config.zero) == \
        {"transformers_zero3_offload.json": (3, "cpu", "cpu")}.get(name, (2, "cpu", "none"))
    oracle = Oracle.run(reference_train, _model(), config, batches)
    assert oracle.losses64[-1] < oracle.losses64[0], "the reference itself must learn"
    oracle.check(trainer_losses, trainer_params, f"TrainingArguments(deepspeed={name})")
    oracle.check(losses, params, f"tiertrain.wrap with `tiertrain train --deepspeed {name}`'s config")
    assert rates == [LR * lr_factor(s, config.schedule) for s in range(STEPS)], rates
    assert lr_factor(0, config.schedule) < lr_factor(STEPS - 1, config.schedule)  # (a warmup, as each file says)


_DS_ADAMW = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "eps": "auto", "betas": "auto",
                                         "torch_adam": True}}
DEEPSPEED_RUNS = {
    # name: the DeepSpeed config; every value it leaves "auto" is the arguments'. torch's AdamW
    # (torch_adam), which DeepSpeed builds on a CPU without compiling its own kernels.
    "zero-2, log WarmupLR": {
        "zero_optimization": {"stage": 2}, "optimizer": _DS_ADAMW,
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": "auto",
                                                     "warmup_num_steps": "auto"}}},
    "zero-3, WarmupDecayLR from and back to warmup_min_lr": {
        "zero_optimization": {"stage": 3}, "optimizer": _DS_ADAMW,
        "scheduler": {"type": "WarmupDecayLR", "params": {"warmup_min_lr": LR / 10, "warmup_max_lr": "auto",
                                                          "warmup_num_steps": "auto", "total_num_steps": "auto",
                                                          "warmup_type": "linear"}}},
    "zero-1, WarmupCosineLR": {
        "zero_optimization": {"stage": 1}, "optimizer": _DS_ADAMW,
        "scheduler": {"type": "WarmupCosineLR", "params": {"warmup_min_ratio": 0.1, "cos_min_ratio": 0.2,
                                                           "warmup_num_steps": "auto", "total_num_steps": "auto"}}},
}


DS_MICRO, DS_ACCUM, DS_WARMUP, DS_DECAY = 2, 2, 3, 0.1


def _trained_on(rank, world, trainer: str, path: str, root: str) -> tuple[list[float], dict]:
    """(logged losses, trained parameters) of the DeepSpeed config at ``path`` trained by
    transformers' Trainer on DeepSpeed's engine ("deepspeed") or by TiertrainTrainer, in a process
    of its own (DeepSpeed keeps its process groups in module globals, which a second engine in
    one process would find stale)."""
    cls = transformers.Trainer if trainer == "deepspeed" else TiertrainTrainer
    args = transformers.TrainingArguments(
        output_dir=os.path.join(root, trainer), deepspeed=path, per_device_train_batch_size=DS_MICRO,
        gradient_accumulation_steps=DS_ACCUM, max_steps=STEPS, learning_rate=LR, adam_epsilon=EPS,
        weight_decay=DS_DECAY, warmup_steps=DS_WARMUP, max_grad_norm=1.0, logging_steps=1, report_to="none",
        disable_tqdm=True, seed=0, train_sampling_strategy="sequential", save_strategy="no", use_cpu=True)
    trained = cls(model=_model(), args=args, train_dataset=_List(_samples(STEPS * DS_MICRO * DS_ACCUM, seed=1)))
    trained.train()
    params = trained.engine.full_state_dict() if cls is TiertrainTrainer else \
        {n: p.detach().clone() for n, p in trained.model.named_parameters()}
    return _losses(trained), params


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(DEEPSPEED_RUNS))
def test_the_trainer_on_deepspeeds_own_engine_trains_as_tiertrain_trainer(tmp_path, name):
    """One script and DeepSpeed config trained by transformers' Trainer on DeepSpeed's own engine
    and by TiertrainTrainer: both within the float64 oracle's bound of the single-process
    reference that `tiertrain train --deepspeed` builds from the file. With an optimizer block,
    transformers hands DeepSpeed the trained parameters as one list, so biases and norms decay
    too (TiertrainTrainer used the Trainer's own split: the norms 1.6e-3 off after 4 steps); and
    every update runs at DeepSpeed's rate (its log warmup, its first update at warmup_min_lr, its
    decay back to warmup_min_lr)."""
    if os.environ.get("TIERTRAIN_TEST_DEEPSPEED"):  # (CI's step for this test: not found is a failure)
        import deepspeed  # noqa: F401
    else:
        pytest.importorskip("deepspeed")
    import json

    from tiertrain.cli import load_with_deepspeed

    path = str(tmp_path / "ds.json")
    with open(path, "w") as f:
        json.dump({"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
                   "gradient_clipping": "auto", **DEEPSPEED_RUNS[name]}, f)
    theirs, ours = (run_distributed(_trained_on, 1, trainer, path, str(tmp_path), timeout=100)[0]
                    for trainer in ("deepspeed", "tiertrain"))
    config, _ = load_with_deepspeed(None, [
        "--steps", str(STEPS), "--optimizer.lr", str(LR), "--optimizer.eps", str(EPS), "--optimizer.weight_decay",
        str(DS_DECAY), "--optimizer.betas", "[0.9, 0.999]", "--optimizer.grad_clip", "1.0", "--schedule.warmup_steps",
        str(DS_WARMUP), "--batch.micro_batch_size", str(DS_MICRO), "--batch.grad_accum_steps", str(DS_ACCUM)], path)
    assert config.optimizer.weight_decay_on == "all"
    data, per_step = _samples(STEPS * DS_MICRO * DS_ACCUM, seed=1), DS_MICRO * DS_ACCUM
    batches = [{k: torch.stack([s[k] for s in data[i * per_step:(i + 1) * per_step]]) for k in ("input_ids", "labels")}
               for i in range(STEPS)]
    oracle = Oracle.run(reference_train, _model(), config, batches)
    oracle.check(*theirs, f"transformers' Trainer on DeepSpeed's engine ({name})")
    oracle.check(*ours, f"TiertrainTrainer with the same DeepSpeed config ({name})")


@pytest.mark.timeout(120)
def test_an_optimizer_and_scheduler_built_on_the_model_train_as_with_the_trainer(tmp_path):
    """Trainer(optimizers=(AdamW(model.parameters()), get_linear_schedule_with_warmup(...))), the
    tutorials' way (was refused): the engine steps the same AdamW over its shards, from the
    instance's group and its rate before the scheduler set it to 0, and the same LambdaLR on
    it. The losses and rates logged are transformers' Trainer's own, the weights within the
    float64 oracle of plain PyTorch with that optimizer and schedule."""
    micro = 4
    data = _samples(STEPS * micro, seed=1)
    make_optimizer = lambda m: torch.optim.AdamW(m.parameters(), lr=LR, eps=EPS)  # noqa: E731
    make_scheduler = functools.partial(transformers.get_linear_schedule_with_warmup, num_warmup_steps=WARMUP,
                                       num_training_steps=STEPS)

    def train(cls, directory, **extra):
        model = _model()
        optimizer = make_optimizer(model)
        trainer = cls(model=model, args=_args(str(tmp_path / directory), micro, 1, use_cpu=True),
                      train_dataset=_List(data), optimizers=(optimizer, make_scheduler(optimizer)), **extra)
        trainer.train()
        lrs = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
        return _losses(trainer), lrs, trainer

    stage3 = from_dict(Config, {"zero": {"stage": 3}})
    losses, lrs, ours = train(TiertrainTrainer, "tiertrain", tiertrain_config=stage3)
    params = ours.engine.full_state_dict()
    ours.engine.close()
    hf_losses, hf_lrs, _ = train(transformers.Trainer, "transformers")
    assert lrs == hf_lrs and len(lrs) == STEPS and lrs[0] == 0.0  # (warmup: the instance's rate was 0 when given)
    assert losses == pytest.approx(hf_losses, rel=1e-5)
    batches = [{k: torch.stack([s[k] for s in data[i * micro:(i + 1) * micro]]) for k in ("input_ids", "labels")}
               for i in range(STEPS)]
    config = make_config(optimizer={"grad_clip": MAX_GRAD_NORM})
    oracle = Oracle.run(lambda m: reference_train(m, config, batches, build_optimizer=make_optimizer,
                                                  lr_scheduler=make_scheduler), _model())
    oracle.check(losses, params, "TiertrainTrainer(optimizers=(AdamW, LambdaLR))")


def _own_optimizer(trainer_class):
    """A script's Trainer subclass building its own optimizer, as LLaVA's does: the embeddings
    at a tenth of the rate, SGD with momentum, and a cosine schedule of its own."""

    class Own(trainer_class):
        def create_optimizer(self, model=None):
            named = list(self.model.named_parameters())
            groups = [{"params": [p for n, p in named if "embed" in n], "lr": LR / 10},
                      {"params": [p for n, p in named if "embed" not in n]}]
            self.optimizer = torch.optim.SGD(groups, lr=LR, momentum=0.9)
            return self.optimizer

        def create_scheduler(self, num_training_steps, optimizer=None):
            self.lr_scheduler = transformers.get_cosine_schedule_with_warmup(
                optimizer or self.optimizer, num_warmup_steps=1, num_training_steps=num_training_steps)
            return self.lr_scheduler

    return Own


@pytest.mark.timeout(120)
def test_a_trainer_subclass_building_its_own_optimizer_trains_with_it(tmp_path):
    """create_optimizer / create_scheduler overridden: the Trainer's way to customise them
    (per-group rates, another optimizer). TiertrainTrainer ignored both in silence and trained
    with its own AdamW and the arguments' schedule; now it calls them as the Trainer does, and
    the engine steps that optimizer over its shards: the losses and each group's rates logged
    are transformers' Trainer's with the same subclass (the engine's AdamW: other losses)."""
    data = _samples(STEPS * 4, seed=1)

    def train(cls, directory, **extra):
        trainer = _own_optimizer(cls)(model=_model(), args=_args(str(tmp_path / directory), 4, 1, use_cpu=True),
                                      train_dataset=_List(data), **extra)
        trainer.train()
        return _losses(trainer), [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]

    losses, lrs = train(TiertrainTrainer, "tiertrain", tiertrain_config=from_dict(Config, {"zero": {"stage": 3}}))
    hf_losses, hf_lrs = train(transformers.Trainer, "transformers")
    assert lrs == hf_lrs and lrs[1] == pytest.approx(LR / 10)  # (the first group's: the embeddings')
    assert losses == pytest.approx(hf_losses, rel=1e-5)


class OwnStep:
    """A script's training_step, as the Trainer's own is written: the loss divided by the
    accumulation steps where the model did not normalise it, then accelerator.backward."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if not (self.model_accepts_loss_kwargs and num_items_in_batch is not None):
            loss = loss / self.current_gradient_accumulation_steps
        self.accelerator.backward(loss)
        return loss.detach()


@pytest.mark.timeout(120)
def test_a_training_step_override_backpropagates_through_the_engine(tmp_path):
    """A Trainer subclass's own training_step calling accelerator.backward(loss) was refused
    (the gradients bypassed the engine); now that call runs the engine's backward: with
    gradient accumulation the losses equal those of transformers' Trainer with the same
    override, and of TiertrainTrainer's own training_step."""
    data = _samples(STEPS * 4, seed=1)
    stage3 = dict(tiertrain_config=from_dict(Config, {"zero": {"stage": 3}}))

    def train(cls, directory, **extra):
        trainer = cls(model=_model(), args=_args(str(tmp_path / directory), 2, 2, use_cpu=True),
                      train_dataset=_List(data), **extra)
        trainer.train()
        return _losses(trainer)

    own = train(type("Own", (OwnStep, TiertrainTrainer), {}), "own", **stage3)
    assert own == pytest.approx(train(type("HFOwn", (OwnStep, transformers.Trainer), {}), "hf"), rel=1e-5)
    assert own == pytest.approx(train(TiertrainTrainer, "plain", **stage3), rel=1e-6)
