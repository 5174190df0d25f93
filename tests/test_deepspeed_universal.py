"""A DeepSpeed run converted to a universal checkpoint (DeepSpeed's ``ds_to_universal``, the format
its users make to change parallelism) continues where it stopped:
``engine.load_deepspeed_checkpoint(dir)`` finds it (``dir/latest_universal``, the tag given, or
the tag's folder itself) and loads each trained parameter's fp32 master, Adam's moments and
step, the frozen values, the step count, an fp16 run's loss scale and the client state, into an
engine of any stage, tier and number of ranks.

tests/deepspeed_checkpoints/<run>_universal holds what DeepSpeed 0.19.8's converter wrote of the
committed run <run> (make.py); what it holds must be what expected.pt beside <run> holds.
"""
from __future__ import annotations

import os
import shutil

import pytest
import torch

import tiertrain
from tiertrain.errors import CheckpointError
from tiertrain.state.deepspeed_universal import UniversalCheckpoint, universal_path
from tiertrain.testing import run_distributed

from deepspeed_models import as_deepspeed_left_it, build_llama
from foreign_runs import batches, continued, engine_config, train_on
from reference import Oracle, make_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_checkpoints")
CONVERTED = ["z3_bf16_w2", "z2_fp16_w2"]
DEEPSPEED_STEPS = 3
TAG = "global_step3_universal"


def _expected(run: str) -> dict:
    return torch.load(os.path.join(HERE, run, "expected.pt"), weights_only=True)


def _universal(run: str) -> str:
    return os.path.join(HERE, f"{run}_universal")


def check_read(directory: str, expected: dict) -> None:
    """The universal checkpoint in directory holds expected.pt's values, bit for bit."""
    saved = UniversalCheckpoint(universal_path(directory, None))
    values, state = saved.state["model"], saved.state["optimizer"]["state"]
    assert sorted(state) == sorted(expected["masters"])
    for param, master in expected["masters"].items():
        assert torch.equal(values[param].reshape(-1), master.reshape(-1).float()), param
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[param][key].reshape(-1), expected[key][param].reshape(-1).float()), (param, key)
        assert int(state[param]["step"]) == expected["step"]
    for param, value in expected["frozen"].items():
        assert torch.equal(values[param], value.float()), param
    assert saved.global_steps == expected["global_steps"] == DEEPSPEED_STEPS
    assert saved.client_state == {"epoch": 7}


@pytest.mark.parametrize("run", CONVERTED)
def test_the_files_hold_the_values_of_the_run_deepspeed_converted(run):
    check_read(_universal(run), _expected(run))


def _deepspeeds_model(run: str) -> torch.nn.Module:
    """The model as DeepSpeed left it (its fp32 masters and frozen values), for the reference."""
    return as_deepspeed_left_it(_expected(run))


def _train_moved(rank, world, run, stage, tier, directory, batches):
    config = engine_config(stage, tier, world, directory)
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
    client = engine.load_deepspeed_checkpoint(_universal(run))  # (its latest_universal names the tag)
    assert client == {"epoch": 7} and engine.steps == DEEPSPEED_STEPS
    return train_on(engine, rank, world, batches)


MOVES = [("z3_bf16_w2", 2, "none", 2), ("z3_bf16_w2", 3, "cpu", 1), ("z2_fp16_w2", 3, "none", 2)]


@pytest.mark.parametrize("run,stage,tier,dp", MOVES, ids=[f"{m[0]}-to-stage{m[1]}-{m[2]}-dp{m[3]}" for m in MOVES])
def test_a_converted_run_continues_as_plain_pytorch_continues_it(run, stage, tier, dp, tmp_path):
    moved = batches(2)
    config = engine_config(stage, tier, dp, str(tmp_path))
    oracle = Oracle.run(continued, _deepspeeds_model(run), config, moved, _expected(run), DEEPSPEED_STEPS)
    if dp == 1:
        losses, params = _train_moved(0, 1, run, stage, tier, str(tmp_path), moved)
    else:
        losses, params = run_distributed(_train_moved, dp, run, stage, tier, str(tmp_path), moved, timeout=120)[0]
    oracle.check(losses, params, f"DeepSpeed {run}, converted to universal, moved to stage {stage} {tier} dp {dp}")


def _loaded(directory: str, tag: str | None = None, dtype: str = "fp32") -> dict:
    """(client state, steps, every value, the scaler's state) of an engine that loaded it."""
    config = make_config(zero={"stage": 2}, precision={"dtype": dtype})
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
    client = engine.load_deepspeed_checkpoint(directory, tag)
    out = {"client": client, "steps": engine.steps, "values": engine.full_state_dict(),
           "scaler": engine.checkpoint_parts()["scaler"].state_dict()}
    engine.close()
    return out


def test_the_checkpoint_is_found_by_latest_universal_by_its_tag_or_as_the_folder_itself():
    root = _universal("z3_bf16_w2")
    expected = _expected("z3_bf16_w2")
    for directory, tag in ((root, None), (root, TAG), (os.path.join(root, TAG), None)):
        loaded = _loaded(directory, tag)
        assert loaded["client"] == {"epoch": 7} and loaded["steps"] == DEEPSPEED_STEPS, (directory, tag)
        for param, value in {**expected["masters"], **expected["frozen"]}.items():
            assert torch.equal(loaded["values"][param], value.float()), (directory, tag, param)


def test_an_fp16_engine_continues_the_converted_runs_dynamic_loss_scale():
    """ds_to_universal keeps DeepSpeed's loss scaler in zero/optimizer_state.pt: 2^8 after 3 good
    steps, hysteresis 2, as in the run's own files."""
    scaler = _loaded(_universal("z2_fp16_w2"), dtype="fp16")["scaler"]
    want = {"scale": 256.0, "good_steps": 3, "hysteresis_left": 2, "overflows": 0}
    assert {k: scaler[k] for k in want} == want


def _copy(tmp_path, run: str = "z3_bf16_w2") -> str:
    return shutil.copytree(_universal(run), os.path.join(tmp_path, f"{run}_universal"))


def test_a_parameter_without_its_value_or_a_missing_model_states_file_is_named(tmp_path):
    target = _copy(tmp_path)
    folder = os.path.join(target, TAG, "zero", "model.norm.weight")
    os.remove(os.path.join(folder, "fp32.pt"))
    with pytest.raises(CheckpointError, match=r"holds no fp32\.pt.*'model\.norm\.weight' has no value"):
        _loaded(target)
    shutil.rmtree(folder)
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight.*missing"):  # (a model's parameter not in it)
        _loaded(target)
    for name in os.listdir(os.path.join(target, TAG)):
        if name.endswith("model_states.pt"):
            os.remove(os.path.join(target, TAG, name))
    with pytest.raises(CheckpointError, match="holds no model-states file"):
        _loaded(target)


def test_a_latest_universal_naming_no_universal_checkpoint_is_named(tmp_path):
    target = _copy(tmp_path)
    with open(os.path.join(target, "latest_universal"), "w") as f:
        f.write("global_step9_universal")
    with pytest.raises(CheckpointError, match=r"latest_universal' names .*global_step9_universal.*no universal"):
        _loaded(target)


def test_another_optimizers_engine_is_refused_by_name():
    """ds_to_universal keeps Adam's state alone: an engine whose optimizer keeps another is told so."""
    config = make_config(zero={"stage": 2}, precision={"dtype": "fp32"})
    model = build_llama(seed=11)
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel),
                            optimizer=torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1,
                                                      momentum=0.9))
    with pytest.raises(CheckpointError, match=r"\['exp_avg', 'exp_avg_sq', 'step'\].*SGD keeps \['momentum_buffer'\]"):
        engine.load_deepspeed_checkpoint(_universal("z3_bf16_w2"))
    engine.close()
