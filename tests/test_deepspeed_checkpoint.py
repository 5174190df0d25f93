"""A run moved from DeepSpeed continues where it stopped: ``engine.load_deepspeed_checkpoint(dir)``
reads a DeepSpeed ZeRO checkpoint (stages 1-3, any number of ranks) into an engine of any layout
and tier, with the fp32 masters, Adam's moments and step, the frozen values and DeepSpeed's
step count. tests/deepspeed_checkpoints/ holds checkpoints written by DeepSpeed 0.19.8 itself
(make.py) and, beside each, the values DeepSpeed's own converters find in it (expected.pt)."""
from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import subprocess
import sys
import warnings

import pytest
import torch

import tiertrain
from tiertrain.errors import CheckpointError
from tiertrain.state.deepspeed_checkpoint import DeepSpeedCheckpoint, FrozenKeptWarning
from tiertrain.state.shard_layout import unit_pieces
from tiertrain.testing import run_distributed
from tiertrain.update.protocol import SLOT_NAME

from deepspeed_models import as_deepspeed_left_it, build_llama
from foreign_runs import batches, continued, engine_config, train_on, trainer_resumed
from reference import Oracle, make_config, rel_distances

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)  # (the gated test has DeepSpeed write four checkpoints: ~45 s)

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_checkpoints")
SAVED = ["z1_bf16_w2", "z2_bf16_w2", "z3_bf16_w2", "z2_fp32_w1", "z2_fp16_w2"]
DEEPSPEED_STEPS = 3


def _expected(name: str) -> dict:
    return torch.load(os.path.join(HERE, name, "expected.pt"), weights_only=True)


@pytest.mark.parametrize("name", SAVED)
def test_the_files_hold_what_deepspeeds_own_converters_find(name):
    """Every trained parameter's master and moments bit for bit as DeepSpeed's accessor and its
    universal-checkpoint converter give them, the step, the frozen values, the client state."""
    _check_read(os.path.join(HERE, name))


@pytest.mark.skipif(not os.environ.get("TIERTRAIN_TEST_DEEPSPEED"),
                    reason="writes checkpoints with the deepspeed package (the CI's last step installs it)")
def test_checkpoints_deepspeed_writes_now_read_as_the_committed_ones(tmp_path):
    """The installed DeepSpeed's format, not only the committed files': written afresh, read the same
    (and the universal checkpoints its converter makes of them: tests/test_deepspeed_universal.py;
    the run with SGD: tests/test_deepspeed_sgd.py)."""
    from test_deepspeed_sgd import check_read as check_sgd
    from test_deepspeed_universal import CONVERTED, check_read

    made = subprocess.run([sys.executable, os.path.join(HERE, "make.py"), str(tmp_path)], timeout=900,
                          env={**os.environ, "DS_ACCELERATOR": "cpu"}, capture_output=True, text=True)
    assert made.returncode == 0, f"make.py exited with {made.returncode}:\n{made.stderr[-4000:]}"
    # (DeepSpeed runs fp16 on a CPU only where oneDNN has fp16 kernels: elsewhere make.py writes
    # the other runs, says so, and the committed fp16 files are what the other tests read)
    written = [name for name in os.listdir(tmp_path) if os.path.isdir(os.path.join(tmp_path, name))]
    fp16 = "z2_fp16_w2" in written
    if not fp16:
        assert "this DeepSpeed does not run fp16 on this CPU" in made.stderr, made.stderr[-4000:]
        warnings.warn("DeepSpeed does not run fp16 on this CPU: its fp16 checkpoints were not written afresh")
    for name in SAVED:
        if fp16 or "fp16" not in name:
            _check_read(os.path.join(tmp_path, name))
    for name in CONVERTED:
        if fp16 or "fp16" not in name:
            expected = torch.load(os.path.join(tmp_path, name, "expected.pt"), weights_only=True)
            check_read(os.path.join(tmp_path, f"{name}_universal"), expected)
    check_sgd(os.path.join(tmp_path, "z2_sgd_w2"))
    if fp16:
        check_stage0_refused_and_its_weights_load(os.path.join(tmp_path, "z0_fp16_w2"))


def _check_read(directory: str) -> None:
    saved = DeepSpeedCheckpoint(directory)
    expected = torch.load(os.path.join(directory, "expected.pt"), weights_only=True)
    assert sorted(saved.shapes) == sorted(expected["masters"])
    for param in expected["masters"]:
        assert torch.equal(saved.value(param), expected["masters"][param].reshape(-1).float()), param
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(saved.value(param, key), expected[key][param].reshape(-1).float()), (param, key)
        assert saved.step(param) == expected["step"]
    assert sorted(saved.frozen_shapes) == sorted(expected["frozen"])
    for param, value in expected["frozen"].items():
        assert torch.equal(saved.frozen_value(param), value), param
    assert saved.global_steps == expected["global_steps"] == DEEPSPEED_STEPS
    assert saved.client_state == {"epoch": 7}
    assert saved.stage == int(os.path.basename(directory)[1])  # (the names: z<stage>_...)


def _batches(n: int) -> list[dict]:
    return batches(n)


def _config(stage: int, tier: str, dp: int, directory: str):
    return engine_config(stage, tier, dp, directory)


def _continued(model, config, batches, expected: dict | None):
    """Plain PyTorch continuing DeepSpeed's run: the model holding its masters, AdamW holding its
    moments and step (expected None: a fresh AdamW), the schedule at its step."""
    return continued(model, config, batches, expected, DEEPSPEED_STEPS)


def _deepspeeds_model(name: str) -> torch.nn.Module:
    """The model as DeepSpeed left it (its fp32 masters and frozen values), for the reference."""
    return as_deepspeed_left_it(_expected(name))


def _train_moved(rank, world, name, stage, tier, directory, batches):
    config = _config(stage, tier, world, directory)
    topology = tiertrain.Topology.build(config.parallel)
    engine = tiertrain.wrap(build_llama(seed=11), config, topology)  # (other initial values: all are loaded)
    client = engine.load_deepspeed_checkpoint(os.path.join(HERE, name))
    assert client == {"epoch": 7} and engine.steps == DEEPSPEED_STEPS
    return train_on(engine, rank, world, batches)


MOVES = [("z3_bf16_w2", 3, "none", 2), ("z1_bf16_w2", 2, "cpu", 2), ("z2_fp32_w1", 1, "none", 2),
         ("z2_bf16_w2", 3, "nvme", 1), ("z3_bf16_w2", 0, "none", 1)]


@pytest.mark.parametrize("name,stage,tier,dp", MOVES, ids=[f"{m[0]}-to-stage{m[1]}-{m[2]}-dp{m[3]}" for m in MOVES])
def test_a_run_moved_from_deepspeed_continues_as_plain_pytorch_continues_it(name, stage, tier, dp, tmp_path):
    batches = _batches(2)
    config = _config(stage, tier, dp, str(tmp_path))
    oracle = Oracle.run(_continued, _deepspeeds_model(name), config, batches, _expected(name))
    if dp == 1:
        losses, params = _train_moved(0, 1, name, stage, tier, str(tmp_path), batches)
    else:
        losses, params = run_distributed(_train_moved, dp, name, stage, tier, str(tmp_path), batches, timeout=120)[0]
    oracle.check(losses, params, f"DeepSpeed {name} moved to stage {stage}, optimizer {tier}, dp {dp}")


def test_the_engine_holds_deepspeeds_moments_and_step_bit_for_bit(tmp_path):
    """Read back from the loaded engine's optimizer (one rank, every piece a whole parameter)."""
    name = "z1_bf16_w2"
    expected = _expected(name)
    config = _config(2, "cpu", 1, str(tmp_path))
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
    engine.load_deepspeed_checkpoint(os.path.join(HERE, name))
    seen = set()
    for view, state in engine.update.optimizer.state.items():
        param = getattr(view, SLOT_NAME)
        seen.add(param)
        assert float(state["step"]) == expected["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key].reshape(-1), expected[key][param].reshape(-1).float()), (param, key)
    assert seen == set(expected["masters"])
    engine.close()


def _pipeline_rank(rank, world, name):
    config = make_config(zero={"stage": 1}, precision={"dtype": "fp32"}, parallel={"pp": 2},
                         batch={"micro_batch_size": 2, "grad_accum_steps": 2})
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
    assert engine.load_deepspeed_checkpoint(os.path.join(HERE, name)) == {"epoch": 7}
    params = {n: v.float().clone() for n, v in engine.full_state_dict().items()}
    engine.close()
    return params


def test_a_pipeline_engine_takes_each_stage_its_parameters():
    """At pp=2 each stage loads its own parameters (the last stage's copy of the tied embedding
    included) from the whole model's checkpoint."""
    name = "z3_bf16_w2"
    expected = _expected(name)
    merged = {}
    for params in run_distributed(_pipeline_rank, 2, name, timeout=120):
        merged.update(params)
    for param, value in {**expected["masters"], **{n: v.float() for n, v in expected["frozen"].items()}}.items():
        assert torch.equal(merged.pop(param).reshape(-1), value.reshape(-1)), param
    assert set(merged) <= {"lm_head.weight"}, merged.keys()  # (the tied copy)
    if merged:
        embedding = expected["masters"]["model.embed_tokens.weight"]
        assert torch.equal(merged["lm_head.weight"].reshape(-1), embedding.reshape(-1))


def _elements_read(rank, world, name):
    counted = {"master": 0, "exp_avg": 0, "exp_avg_sq": 0}
    read = DeepSpeedCheckpoint.read

    def counting(self, source, key, offset, numel):
        counted[key] += numel
        return read(self, source, key, offset, numel)

    DeepSpeedCheckpoint.read = counting
    try:
        config = _config(3, "none", world, "/unused")
        config.zero.persistence_threshold = 0  # (every parameter sharded, small ones too)
        engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
        engine.load_deepspeed_checkpoint(os.path.join(HERE, name))
        held = sum(p.hi - p.lo for p in unit_pieces(rank, engine.shard_description(), "units"))
        engine.close()
    finally:
        DeepSpeedCheckpoint.read = read
    return counted, held


def test_each_rank_reads_only_what_its_shards_hold():
    """Of DeepSpeed's buffers a rank reads the elements of its own shards (at stage 3 over 2
    ranks: half of every trained parameter), not whole parameters: moving a large run reads the
    checkpoint about once in all, not once per rank."""
    name = "z2_bf16_w2"
    trained = sum(t.numel() for t in _expected(name)["masters"].values())
    results = run_distributed(_elements_read, 2, name, timeout=120)
    assert sum(held for _, held in results) == trained
    for counted, held in results:
        assert counted == {"master": held, "exp_avg": held, "exp_avg_sq": held}, (counted, held, trained)


def test_an_fp16_engine_continues_deepspeeds_dynamic_loss_scale():
    """DeepSpeed's fp16 run left its loss scale at 2^8 after 3 good steps, hysteresis 2 (its
    scaler's state in the file); an fp16 engine continues from that, an fp32 one scales nothing."""
    for dtype, scale in (("fp16", {"scale": 256.0, "good_steps": 3, "hysteresis_left": 2, "overflows": 0}),
                         ("fp32", {"scale": 1.0})):
        config = make_config(zero={"stage": 2}, precision={"dtype": dtype})
        engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
        engine.load_deepspeed_checkpoint(os.path.join(HERE, "z2_fp16_w2"))
        state = engine.checkpoint_parts()["scaler"].state_dict()
        assert {k: state[k] for k in scale} == scale, (dtype, state)
        engine.close()


def test_the_moments_matter_to_that_check(tmp_path):
    """Continuing from the masters alone (a fresh AdamW, as loading only the weights would) ends
    far from where the moved run and the fp32 reference end together (the oracle tests above
    fail too without the moments: checked)."""
    name, batches = "z2_bf16_w2", _batches(2)
    config = _config(2, "none", 1, str(tmp_path))
    _, reference = _continued(_deepspeeds_model(name), config, batches, _expected(name))
    _, weights_only = _continued(_deepspeeds_model(name), config, batches, None)
    _, moved = _train_moved(0, 1, name, 2, "none", str(tmp_path), batches)
    moved_distance = max(rel_distances({n: moved[n] for n in reference}, reference).values())
    weights_only_distance = max(rel_distances(weights_only, reference).values())
    assert moved_distance * 100 < weights_only_distance, (moved_distance, weights_only_distance)


def _without_frozen(target: str) -> None:
    """What save_checkpoint(exclude_frozen_parameters=True) writes (DeepSpeed 0.19.8, checked):
    no frozen values in the module's state dict, no frozen shapes or fragments."""
    step = os.path.join(target, "global_step3")
    for name in os.listdir(step):
        if name.endswith("model_states.pt"):
            path = os.path.join(step, name)
            model = torch.load(path, weights_only=False)
            frozen = set(_expected(os.path.basename(target))["frozen"])
            model["module"] = {k: v for k, v in model["module"].items() if k not in frozen}
            model["frozen_param_shapes"] = model["frozen_param_fragments"] = None
            torch.save(model, path)


@pytest.mark.parametrize("name,stage", [("z2_bf16_w2", 2), ("z3_bf16_w2", 3)])
def test_a_checkpoint_saved_without_frozen_parameters_leaves_the_models_own_and_says_so(name, stage, tmp_path):
    """A LoRA run saves with exclude_frozen_parameters=True: the frozen weights are the pretrained
    ones the script loads first. They keep their values (held whole, or in stage 3's shards), the
    trained ones are DeepSpeed's, and a warning names what was kept."""
    target = _copy(tmp_path, name)
    _without_frozen(target)
    expected = _expected(name)
    config = _config(stage, "none", 1, str(tmp_path))
    model = _deepspeeds_model(name)  # (its frozen values: as if loaded from the pretrained weights)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(1.0)  # (the trained ones must come from the checkpoint)
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
    with pytest.warns(FrozenKeptWarning, match=r"holds no frozen parameter.*3 frozen parameters keep"):
        engine.load_deepspeed_checkpoint(target)
    params = engine.full_state_dict()
    for param, value in {**expected["masters"], **expected["frozen"]}.items():
        assert torch.equal(params[param].reshape(-1), value.reshape(-1).to(params[param].dtype)), param
    engine.close()


def _with_buffer(model: torch.nn.Module) -> torch.nn.Module:
    model.model.norm.register_buffer("calibration", torch.zeros(3))  # (persistent: in the state dict)
    return model


def test_persistent_buffers_load_by_name_and_a_missing_one_is_named(tmp_path):
    """DeepSpeed keeps the persistent buffers (BatchNorm's statistics, a counter) in the module's
    state dict and lists them in buffer_names, as the files of a model with one hold them; a
    checkpoint without this model's buffer is refused before anything is loaded."""
    target = _copy(tmp_path)
    path = os.path.join(target, "global_step3", "mp_rank_00_model_states.pt")
    model = torch.load(path, weights_only=False)
    model["buffer_names"] = ["model.norm.calibration"]
    model["module"]["model.norm.calibration"] = torch.tensor([1.0, 2.0, 3.0])
    torch.save(model, path)
    engine = _engine(model=_with_buffer(build_llama(seed=11)))
    engine.load_deepspeed_checkpoint(target)
    assert torch.equal(engine.module.model.norm.calibration, torch.tensor([1.0, 2.0, 3.0]))
    engine.close()
    engine = _engine(model=_with_buffer(build_llama(seed=11)))
    before = {n: v.clone() for n, v in engine.full_state_dict().items()}
    with pytest.raises(CheckpointError, match=r"no value for the buffers \['model.norm.calibration'\].*nothing"):
        engine.load_deepspeed_checkpoint(os.path.join(HERE, "z2_bf16_w2"))
    after = engine.full_state_dict()
    assert all(torch.equal(after[n], v) for n, v in before.items())  # (refused before anything was loaded)
    engine.close()


def test_a_checkpoint_missing_some_frozen_parameters_is_refused(tmp_path):
    target = _copy(tmp_path)
    path = os.path.join(target, "global_step3", "mp_rank_00_model_states.pt")
    model = torch.load(path, weights_only=False)
    for key in ("module", "frozen_param_shapes", "frozen_param_fragments"):
        del model[key]["model.layers.0.mlp.up_proj.weight"]
    torch.save(model, path)
    engine = _engine()
    with pytest.raises(CheckpointError, match=r"no value for the frozen parameters \['model.layers.0.mlp.up_proj"):
        engine.load_deepspeed_checkpoint(target)
    engine.close()


# -- what is refused, by name -------------------------------------------------------------------

def _engine(optimizer=None, model=None):
    config = _config(2, "none", 1, "/unused")
    model = build_llama(seed=11) if model is None else model
    kwargs = {} if optimizer is None else {"optimizer": optimizer(model)}
    return tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), **kwargs)


def _copy(tmp_path, name="z2_bf16_w2") -> str:
    target = os.path.join(tmp_path, name)
    shutil.copytree(os.path.join(HERE, name), target)
    return target


def test_a_missing_rank_file_or_latest_is_named(tmp_path):
    target = _copy(tmp_path)
    os.remove(os.path.join(target, "global_step3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"))
    with pytest.raises(CheckpointError, match="model states hold|2 data-parallel ranks but holds 1"):
        DeepSpeedCheckpoint(target)
    os.remove(os.path.join(target, "latest"))
    with pytest.raises(CheckpointError, match=r"no 'latest' file.*give tag=.*global_step3"):
        DeepSpeedCheckpoint(target)
    with pytest.raises(CheckpointError, match="global_step9.*does not exist"):
        DeepSpeedCheckpoint(target, tag="global_step9")


@pytest.mark.timeout(30)
def test_a_fifo_in_place_of_a_file_is_refused_not_waited_on(tmp_path):
    """(Opening a FIFO blocks until a writer comes: the reader refuses what is not a regular file.)"""
    directory = _copy(tmp_path)
    path = os.path.join(directory, "global_step3", "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt")
    os.remove(path)
    os.mkfifo(path)
    with pytest.raises(CheckpointError, match="is not a regular file"):
        DeepSpeedCheckpoint(directory)


def test_tensor_and_pipeline_parallel_checkpoints_are_refused_by_name(tmp_path):
    for extra, what in (("mp_rank_01_model_states.pt", "tensor-parallel"), ("layer_01-model_states.pt", "pipeline")):
        target = _copy(tmp_path / what)
        open(os.path.join(target, "global_step3", extra), "wb").close()
        with pytest.raises(CheckpointError, match=f"{what} DeepSpeed checkpoint"):
            DeepSpeedCheckpoint(target)


def check_stage0_refused_and_its_weights_load(directory: str) -> None:
    """Without ZeRO, DeepSpeed keeps the optimizer state by index with no record of which
    parameter each index was: refused, naming the file whose module values load_pretrained reads."""
    with pytest.raises(CheckpointError, match=r"without ZeRO \(stage 0\).*param_shapes is None.*load_pretrained") as e:
        DeepSpeedCheckpoint(directory)
    path = os.path.join(directory, "global_step3", "mp_rank_00_model_states.pt")
    assert repr(path) in str(e.value), str(e.value)
    config = make_config(batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
    report = tiertrain.load_pretrained(engine, path)
    expected = torch.load(os.path.join(directory, "expected.pt"), weights_only=True)
    assert not report.missing and not report.unexpected, report
    state = engine.full_state_dict()
    for name, master in {**expected["masters"], **expected["frozen"]}.items():
        assert torch.equal(state[name], master.half().float()), name  # (the fp16 module: masters rounded)


def test_a_run_without_zero_is_refused_naming_how_its_weights_load():
    check_stage0_refused_and_its_weights_load(os.path.join(HERE, "z0_fp16_w2"))


def test_a_file_that_is_no_deepspeed_checkpoint_is_named(tmp_path):
    target = _copy(tmp_path)
    path = os.path.join(target, "global_step3", "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt")
    torch.save({"optimizer_state_dict": {"state": {}}}, path)
    with pytest.raises(CheckpointError, match=r"neither ZeRO stage 1-2's .* nor stage 3's"):
        DeepSpeedCheckpoint(target)
    with open(path, "wb") as f:
        f.write(b"not a pickle")
    with pytest.raises(CheckpointError, match="bf16_zero_pp_rank_0.*not a DeepSpeed checkpoint file"):
        DeepSpeedCheckpoint(target)


class _RecordedObject:
    """An object of a DeepSpeed class read back without DeepSpeed (the suite runs without it):
    it keeps how it was built and its state, and is pickled again under the same class name."""

    def __new__(cls, *args):
        obj = object.__new__(cls)
        obj._args, obj._called, obj._state = args, False, None
        return obj

    def __init__(self, *args):
        self._called = True  # (built by calling the class, not by __new__ alone)

    def __setstate__(self, state):
        self._state = state

    def __reduce_ex__(self, protocol):
        import copyreg

        cls = type(self)
        return (cls, self._args, self._state) if self._called else (copyreg.__newobj__, (cls, *self._args), self._state)


def _deepspeed_classes_recorded(monkeypatch, files: list[str]) -> None:
    """Stand-ins (_RecordedObject) for the DeepSpeed classes the files' pickles name, as modules
    of the same names, for this test only."""
    import pickletools
    import types
    import zipfile

    for path in files:
        with zipfile.ZipFile(path) as z:
            ops = list(pickletools.genops(z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))))
        named = [(ops[k - 2][1], ops[k - 1][1]) for k, (op, _, _) in enumerate(ops) if op.name == "STACK_GLOBAL"]
        named += [tuple(arg.split(" ", 1)) for op, arg, _ in ops if op.name == "GLOBAL"]
        for module, name in named:
            if module.split(".")[0] != "deepspeed":
                continue
            for k in range(1, module.count(".") + 2):
                prefix = ".".join(module.split(".")[:k])
                if not isinstance(sys.modules.get(prefix), types.ModuleType) or not getattr(
                        sys.modules[prefix], "_recorded", False):
                    fake = types.ModuleType(prefix)
                    fake._recorded = True
                    monkeypatch.setitem(sys.modules, prefix, fake)
            cls = type(name, (_RecordedObject,), {"__module__": module, "__qualname__": name})
            setattr(sys.modules[module], name, cls)


def test_files_in_torchs_legacy_format_read_the_same(tmp_path, monkeypatch):
    """(Memory-mapped reading needs torch's zip format; a file in the older one is read whole.)"""
    target = _copy(tmp_path)
    step = os.path.join(target, "global_step3")
    files = [os.path.join(step, name) for name in os.listdir(step)]
    with monkeypatch.context() as patched:
        _deepspeed_classes_recorded(patched, files)
        for path in files:
            torch.save(torch.load(path, weights_only=False), path, _use_new_zipfile_serialization=False)
    shutil.copy(os.path.join(HERE, "z2_bf16_w2", "expected.pt"), os.path.join(target, "expected.pt"))
    _check_read(target)


def test_other_objects_in_the_client_state_are_read_inert_and_named(tmp_path):
    """Megatron-DeepSpeed keeps its argparse Namespace in the client state: read without running
    any of its code, kept as a placeholder holding what it was built from, and named."""
    target = _copy(tmp_path)
    path = os.path.join(target, "global_step3", "mp_rank_00_model_states.pt")
    model = torch.load(path, weights_only=False)
    model["args"] = argparse.Namespace(lr=0.5)
    torch.save(model, path)
    with pytest.warns(UserWarning, match=r"argparse.Namespace.*inert placeholders"):
        saved = DeepSpeedCheckpoint(target)
    assert saved.client_state["epoch"] == 7 and saved.client_state["args"].state == {"lr": 0.5}


def test_a_misread_layout_fails_on_deepspeeds_own_fragment_record(tmp_path):
    """DeepSpeed records where each rank's fragment of each parameter lies (stages 1-2); the
    reading is checked against it, so a layout this version misreads fails before training."""
    target = _copy(tmp_path)
    path = os.path.join(target, "global_step3", "mp_rank_00_model_states.pt")
    model = torch.load(path, weights_only=False)
    first = model["param_shapes"][0]
    names = list(first)
    model["param_shapes"][0] = {names[1]: first[names[1]], names[0]: first[names[0]],
                                **{n: first[n] for n in names[2:]}}
    torch.save(model, path)
    with pytest.raises(CheckpointError, match="records .* at \\(start, numel\\)"):
        DeepSpeedCheckpoint(target)


def test_another_optimizer_or_model_is_refused_by_name():
    engine = _engine(lambda m: torch.optim.SGD([p for p in m.parameters() if p.requires_grad], lr=0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match=r"is \['exp_avg', 'exp_avg_sq', 'step'\]; this engine's optimizer SGD "
                                              r"keeps \['momentum_buffer'\]"):
        engine.load_deepspeed_checkpoint(os.path.join(HERE, "z2_bf16_w2"))
    engine.close()
    config = _config(2, "none", 1, "/unused")
    for change, named in ((lambda m: m.model.norm.weight.requires_grad_(False), "model.norm.weight"),
                          (lambda m: m.model.layers[1].mlp.requires_grad_(False), "model.layers.1.mlp"),
                          (lambda m: m.model.layers[0].mlp.requires_grad_(True), "model.layers.0.mlp")):
        model = build_llama(seed=11)
        change(model)
        engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
        with pytest.raises(CheckpointError, match=named):
            engine.load_deepspeed_checkpoint(os.path.join(HERE, "z2_bf16_w2"))
        engine.close()


def test_trainer_resumes_a_checkpoint_that_trainer_saved_with_deepspeed(tmp_path):
    """transformers' Trainer run with DeepSpeed saves checkpoint-N/ holding DeepSpeed's files
    (latest, global_stepN/) beside trainer_state.json: TiertrainTrainer resumes from it."""
    checkpoint = os.path.join(_copy(tmp_path), "")
    expected = _expected("z2_bf16_w2")
    for steps in (DEEPSPEED_STEPS, DEEPSPEED_STEPS + 1):
        trainer = trainer_resumed(checkpoint, str(tmp_path / "out"), steps, DEEPSPEED_STEPS)
        assert trainer.state.global_step == steps == trainer.engine.steps
        assert trainer.engine.learning_rate() == 0.0  # (the linear schedule's end: it went on from DeepSpeed's step)
        params = trainer.engine.full_state_dict()
        if steps == DEEPSPEED_STEPS:  # (nothing left to train: the engine holds DeepSpeed's masters)
            for name, value in expected["masters"].items():
                assert torch.equal(params[name].float(), value), name
        trainer.close()


def test_the_training_loop_starts_from_a_deepspeed_checkpoint_then_resumes_its_own(tmp_path, capsys):
    """checkpoint.from_deepspeed (tiertrain train --checkpoint.from_deepspeed DIR): a run with
    nothing to resume starts at DeepSpeed's step with its state and trains on as plain PyTorch
    continues it; once it has saved, a resume takes its own checkpoint, not DeepSpeed's."""
    from tiertrain.config import from_dict
    from tiertrain.trainer import LoopConfig, Trainer

    name, batches = "z2_bf16_w2", _batches(2)
    engine_sections = _config(2, "none", 1, str(tmp_path))
    sections = {section: getattr(engine_sections, section) for section in ("zero", "precision", "parallel", "batch",
                                                                             "optimizer", "schedule")}

    def loop(steps):
        base = {k: dataclasses.asdict(v) for k, v in sections.items()}
        base.update(steps=steps, logging={"progress": False, "metrics_file": ""},
                    checkpoint={"dir": str(tmp_path / "run"), "from_deepspeed": os.path.join(HERE, name)})
        return from_dict(LoopConfig, base).validate()

    with Trainer(build_llama(seed=11), loop(DEEPSPEED_STEPS + 1), batches) as trainer:
        trainer.fit()
        assert trainer.engine.steps == DEEPSPEED_STEPS + 1
        params = {n: v.float() for n, v in trainer.engine.full_state_dict().items()}
    assert "started from DeepSpeed's" in capsys.readouterr().out
    oracle = Oracle.run(_continued, _deepspeeds_model(name), engine_sections, batches[:1], _expected(name))
    oracle.check(None, params, "the loop started from DeepSpeed's checkpoint")
    with Trainer(build_llama(seed=11), loop(DEEPSPEED_STEPS + 2), batches) as trainer:
        trainer.fit()  # (resumes its step-4 checkpoint: one more step)
        assert trainer.engine.steps == DEEPSPEED_STEPS + 2
    out = capsys.readouterr().out
    assert "resumed from" in out and "DeepSpeed" not in out, out
