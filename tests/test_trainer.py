"""The training loop for any model (tiertrain.trainer.Trainer), as a specification:

* it trains a model exactly as the single-process PyTorch reference does (float64-oracle
  bounds of tests/reference.py), from an iterable of batches or a Dataset sharded by dp
  rank, with a factory built partitioned at stage 3, and its evaluation is the reference's
  loss on the held-out batches;
* a run stopped and resumed from its checkpoint continues bit for bit;
* its metrics hold the loss, eval loss and perplexity, tokens/s, TFLOP/s, bytes per tier
  beside the estimator's prediction, and the step-time breakdown;
* ``zero.offload: auto`` is planned for any model (never ignored: wrap() refuses it);
* bad use is a clear error.
"""
from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F

import tiertrain
from reference import Oracle, global_batches, make_model, reference_train
from tiertrain.config import ConfigError, from_dict
from tiertrain.data import ShardedSampler
from tiertrain.testing import run_distributed
from tiertrain.trainer import LoopConfig, Trainer

STEPS, MICRO, WORLD = 4, 2, 2
pytestmark = pytest.mark.timeout(90)


def loop_config(**sections) -> LoopConfig:
    base = {"schedule": {"warmup_steps": 2, "decay_steps": 4}, "optimizer": {"lr": 1e-2}, "steps": STEPS,
            "batch": {"micro_batch_size": MICRO}, "logging": {"progress": False, "metrics_file": "",
                                                               "log_interval": 1}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v} if isinstance(v, dict) else v
    return from_dict(LoopConfig, base).validate()


def micro_batches_of(global_batches_: list[dict], dp: int) -> list[dict]:
    """Each global batch as dp consecutive micro-batches: what every rank is given (rank r
    takes batches r, r + dp, ...: its slice of each global batch)."""
    out = []
    for g in global_batches_:
        n = g["input_ids"].shape[0] // dp
        out += [{k: v[r * n:(r + 1) * n] for k, v in g.items()} for r in range(dp)]
    return out


def reference_with_eval(model, config, batches, held_out):
    """The reference's losses, then its mean token loss on the held-out batches."""
    losses, params = reference_train(model, config, batches)
    model = copy.deepcopy(model)  # (reference_train trains a copy: load what it trained)
    model.load_state_dict(params, strict=False)
    model.eval()
    with torch.no_grad():
        total = sum(float(model(**b)) * b["input_ids"].numel() for b in held_out)
    return losses + [total / sum(b["input_ids"].numel() for b in held_out)], params


# --------------------------------------------------------------------------- numerics


def _train_with_trainer(rank, world, config, batches, held_out, factory):
    model = make_model if factory else make_model()
    with Trainer(model, config, batches, held_out) as trainer:
        trainer.fit()
        losses = [r["loss"] for r in trainer.records if "loss" in r]
        evals = [r["eval_loss"] for r in trainer.records if "eval_loss" in r]
        params = trainer.engine.full_state_dict()
    return losses + evals, params


@pytest.mark.parametrize("stage,factory,pp", [(3, True, 1), (2, False, 1), (3, True, 2)])
def test_matches_the_reference_and_evaluates_its_held_out_loss(stage, factory, pp):
    """pp = 2: the two ranks are one pipeline (dp = 1) running each step's two micro-batches
    through the schedule; it evaluates held-out batches of twice the rows by the forward-only
    schedule, two at a time (grad_accum_steps), asked for five of the three there are: two
    pipelined, then the last alone when the data ends."""
    config = loop_config(zero={"stage": stage}, eval={"every": STEPS, "batches": 3 if pp == 1 else 5},
                         parallel={"pp": pp}, batch={"grad_accum_steps": pp})
    batches = global_batches(STEPS, MICRO * WORLD)
    held_out = global_batches(3, MICRO * WORLD, seed=7)
    oracle = Oracle.run(reference_with_eval, make_model(), config, batches, held_out)
    assert oracle.losses64[STEPS - 1] < oracle.losses64[0], "the reference itself must learn"
    losses, params = run_distributed(_train_with_trainer, WORLD, config, micro_batches_of(batches, WORLD),
                                     micro_batches_of(held_out, WORLD // pp), factory, timeout=45)[0]
    assert len(losses) == STEPS + 1  # every step logged, one evaluation after the last
    oracle.check(losses, None, f"stage {stage}, pp {pp}: losses and the eval loss")
    oracle.check(None, {k: v for k, v in params.items() if k in oracle.params64},
                 f"stage {stage}, pp {pp}: parameters")


class TokenSamples(torch.utils.data.Dataset):
    """A map-style dataset of single sequences (what a user's Dataset returns per index)."""

    def __init__(self, batch: dict):
        self.batch = batch

    def __len__(self):
        return self.batch["input_ids"].shape[0]

    def __getitem__(self, i):
        return {k: v[i] for k, v in self.batch.items()}


def test_a_dataset_is_sharded_by_rank_in_the_global_sample_order():
    """Rank r takes positions r, r + dp, ... of one seeded global stream, so step k trains on
    the stream's positions [k·B, (k+1)·B): the reference run on exactly those samples."""
    config = loop_config(zero={"stage": 1})
    samples = global_batches(1, 24)[0]
    order = ShardedSampler(24, 1, 0, seed=config.seed).global_indices(0, STEPS * MICRO * WORLD)
    gb = MICRO * WORLD
    steps = [{k: v[order[i * gb:(i + 1) * gb]] for k, v in samples.items()} for i in range(STEPS)]
    oracle = Oracle.run(reference_train, make_model(), config, steps)
    losses, params = run_distributed(_train_with_trainer, WORLD, config, TokenSamples(samples), None, False,
                                     timeout=45)[0]
    oracle.check(losses, params, "a Dataset sharded by rank")


# --------------------------------------------------------------------------- resume, metrics


def _run(rank, world, config, samples, held_out):
    with Trainer(make_model(), config, TokenSamples(samples), TokenSamples(held_out)) as trainer:
        summary = trainer.fit()
        return [r.get("loss") for r in trainer.records if "loss" in r], summary


@pytest.mark.slow
def test_a_resumed_run_continues_bit_for_bit(tmp_path):
    samples, held_out = global_batches(1, 24)[0], global_batches(1, 8, seed=3)[0]
    def config(directory: str, **more) -> LoopConfig:
        return loop_config(checkpoint={"dir": str(tmp_path / directory), "interval": 2}, zero={"stage": 2},
                           eval={"every": 2, "batches": 1}, **more)

    whole = run_distributed(_run, WORLD, config("whole"), samples, held_out, timeout=45)[0][0]
    run_distributed(_run, WORLD, config("ckpt", steps=2), samples, held_out, timeout=45)
    resumed, summary = run_distributed(_run, WORLD, config("ckpt"), samples, held_out, timeout=45)[0]
    assert summary["steps_run"] == STEPS - 2
    assert resumed == whole[2:], "steps 3-4 after the resume are those of the uninterrupted run"


def test_a_resume_that_would_change_the_global_batch_is_refused_naming_the_numbers(tmp_path):
    """Issue 35, item 5: resumed with another accumulation (or process count), the global batch
    changed silently (16 -> 8). The Trainer refuses, naming both; `tiertrain train --resume`
    changes the accumulation instead (tests/test_faults_config.py)."""
    samples = global_batches(1, 24)[0]
    config = loop_config(checkpoint={"dir": str(tmp_path / "ckpt")}, steps=1, batch={"grad_accum_steps": 2})
    with Trainer(make_model(), config, TokenSamples(samples)) as trainer:
        trainer.fit()
    config = loop_config(checkpoint={"dir": str(tmp_path / "ckpt")}, steps=2)
    with Trainer(make_model(), config, TokenSamples(samples)) as trainer:
        with pytest.raises(ConfigError, match=rf"global batch of {2 * MICRO} samples; this run's is {MICRO}"):
            trainer.fit()


def test_metrics_name_loss_eval_throughput_tiers_and_step_time(tmp_path):
    metrics = tmp_path / "metrics.jsonl"
    config = loop_config(zero={"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
                         eval={"every": 2, "batches": 1}, logging={"metrics_file": str(metrics),
                                                                     "peak_tflops": 0.5})
    samples, held_out = global_batches(1, 24)[0], global_batches(1, 8, seed=3)[0]
    run_distributed(_run, WORLD, config, samples, held_out, timeout=45)
    records = [json.loads(line) for line in metrics.read_text().splitlines()]
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert r["eval_ppl"] == pytest.approx(math.exp(r["eval_loss"])) and r["eval_tokens"] == WORLD * MICRO * 16  # eval.batches=1 per rank
    last = train[-1]
    # Everything is on the CPU tier, and the estimator says so to the byte (flat shard padding).
    assert last["bytes_device"] == 0 and last["bytes_nvme"] == 0
    assert last["bytes_cpu"] == pytest.approx(last["predicted_bytes_cpu"], rel=0.01)
    assert last["predicted_bytes_device"] == 0
    # FLOPs: 6 per trained matmul weight + 12·L·h·s per token, against the stated peak.
    model = make_model()
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    flops = 6 * weights + 12 * 2 * 32 * 16
    assert last["tflops"] == pytest.approx(flops * last["tokens_per_s"] / WORLD / 1e12, rel=1e-6)
    assert last["mfu"] == pytest.approx(last["tflops"] / 0.5, rel=1e-6)
    times = {k: last[k] for k in last if k.startswith("time_")}
    assert set(times) == {"time_data_s", "time_forward_s", "time_backward_s", "time_optimizer_s",
                          "time_io_wait_s", "time_comm_wait_s"}
    assert all(v >= 0 for v in times.values()) and times["time_comm_wait_s"] > 0  # stage 3 gathers
    # Phases exclude the waits inside them: together they are the step, nothing counted twice.
    step_wall = WORLD * MICRO * 16 / last["tokens_per_s"]  # one step's tokens over the logged rate
    assert 0.5 * step_wall < sum(times.values()) <= 1.02 * step_wall


# --------------------------------------------------------------------------- offload: auto


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))


def llama_loss(model, batch):
    return F.cross_entropy(model(input_ids=batch["input_ids"]).logits.flatten(0, 1), batch["labels"].flatten())


def _auto(rank, world):
    config = loop_config(zero={"offload": "auto"}, steps=2)
    batches = micro_batches_of(global_batches(2, MICRO * WORLD), WORLD)
    with Trainer(_tiny_llama, config, batches, loss_fn=llama_loss) as trainer:
        summary = trainer.fit()
        return trainer.config.zero.offload, summary["last_loss"]


def test_offload_auto_is_planned_for_any_model_and_wrap_refuses_it():
    planned, loss = run_distributed(_auto, WORLD, timeout=45)[0]
    assert planned == "manual" and math.isfinite(loss)  # the planner's choice was applied
    config = loop_config(zero={"offload": "auto"})
    with pytest.raises(ConfigError, match="zero.offload='auto'.*Trainer"):
        tiertrain.wrap(make_model(), config.engine_config(), tiertrain.Topology.build(config.parallel))


def _auto_for_a_model_that_checkpoints_itself(rank, world):
    """The planner's choice for a Llama that checkpoints its own layers, where host RAM lies
    between what it needs (its checkpoints counted) and what it would need without them."""
    import dataclasses

    import tiertrain.estimate.probe as probe
    from tiertrain.estimate.modules import dims_of_module
    from tiertrain.trainer import plan_for

    config = loop_config(zero={"offload": "auto"}, steps=2)
    model = _tiny_llama()
    model.gradient_checkpointing_enable()
    own = dims_of_module(model, 16)
    plain = dataclasses.replace(own, own_checkpointing=0)
    probe.ram_available = lambda: 1 << 40
    need_own, need_plain = (plan_for(config, d, world).usage["ram"] for d in (own, plain))
    probe.ram_available = lambda: int((need_own + need_plain) / 2 / 0.9)  # (the plan keeps 10 % in reserve)
    without_it = plan_for(config, plain, world).config_dict()["activations"]["checkpoint_every"]
    batches = [{k: v[:, :16] for k, v in b.items()} for b in micro_batches_of(global_batches(2, MICRO), 1)]
    with Trainer(model, config, batches, loss_fn=llama_loss) as trainer:
        summary = trainer.fit()
        return own.own_checkpointing, without_it, trainer.config.activations.checkpoint_every, summary["last_loss"]


def test_offload_auto_plans_a_model_that_checkpoints_itself_with_its_checkpoints():
    """transformers' gradient_checkpointing_enable is the model's own checkpointing: the plan
    counts it and adds none (the engine refuses two checkpoints around a layer). Before, the
    planner counted the model's activations whole and, short of RAM, chose
    activations.checkpoint_every, which wrap then refused."""
    own, without_it, chosen, loss = run_distributed(_auto_for_a_model_that_checkpoints_itself, 1, timeout=45)[0]
    assert own == 1 and without_it > 0  # the RAM given is short for the model counted without its checkpoints
    assert chosen == 0 and math.isfinite(loss)


# --------------------------------------------------------------------------- errors


def test_bad_use_is_a_clear_error():
    config = loop_config()
    with pytest.raises(TypeError, match="LoopConfig"):
        Trainer(make_model(), config.engine_config(), [])
    with pytest.raises(ConfigError, match="eval.every=2 but no eval_data"):
        Trainer(make_model(), loop_config(eval={"every": 2}), [])
    one_shot = iter(micro_batches_of(global_batches(1, MICRO), 1))
    with Trainer(make_model(), loop_config(steps=3), one_shot) as trainer:
        with pytest.raises(RuntimeError, match="ran out after 1 batches.*one-shot"):
            trainer.fit()


def test_an_iterable_is_read_again_each_epoch():
    batches = micro_batches_of(global_batches(1, MICRO), 1)  # one batch: every step is a new epoch
    with Trainer(copy.deepcopy(make_model()), loop_config(steps=3), batches) as trainer:
        assert trainer.fit()["steps_run"] == 3


@pytest.mark.slow
def test_the_quickstart_example_trains_evaluates_and_resumes(tmp_path):
    """examples/trainer_quickstart.py (a user's own nn.Module in under 30 lines): trains with
    evaluation and metrics, and a second launch resumes from its checkpoint."""
    import os
    import subprocess
    import sys

    example = os.path.join(os.path.dirname(__file__), "..", "examples", "trainer_quickstart.py")

    def launch(steps: int) -> str:
        done = subprocess.run([sys.executable, example, "--steps", str(steps), "--eval.every", "10",
                               "--logging.progress", "false"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=100)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    assert "20 run, 20 total" in launch(20)
    assert "10 run, 30 total" in launch(30)  # continued from step 20's checkpoint
    records = [json.loads(line) for line in (tmp_path / "runs/quickstart/metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "eval_loss" in r] == [10, 20, 30]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses[-1] < losses[0]


def _tensor_parallel(rank, world):
    from tiertrain.parallel import apply_tensor_parallel

    config = loop_config(parallel={"tp": 2}, steps=1)
    topology = tiertrain.Topology.build(config.parallel)

    def sliced():
        model = make_model()
        apply_tensor_parallel(model, topology)
        return model

    with Trainer(sliced, config, micro_batches_of(global_batches(1, MICRO), 1), topology=topology) as trainer:
        trainer.fit()
        report = trainer.engine.memory_report()
        return trainer.flops_per_token, trainer.predicted_bytes["device"], report.total


@pytest.mark.timeout(60)
def test_flops_and_predicted_bytes_of_a_tensor_parallel_model_are_the_whole_models():
    """At tp = 2 each rank builds its slice: the FLOPs per token are still the whole model's
    (a slice's weights count tp times) and the predicted bytes are the slice's, not half of it."""
    whole = Trainer(make_model(), loop_config(steps=1), micro_batches_of(global_batches(1, MICRO), 1))
    for flops, predicted, measured in run_distributed(_tensor_parallel, 2, timeout=50):
        assert flops == whole.flops_per_token
        assert predicted == measured
