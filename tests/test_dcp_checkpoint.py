"""A run moved from FSDP2 continues where it stopped: ``engine.load_dcp_checkpoint(path)`` reads
a torch.distributed.checkpoint directory (as ``dcp.save(get_state_dict(model, optimizer))``,
torchtitan's checkpointer and transformers' Trainer under Accelerate save it) into an engine of
any layout and tier, with each parameter's value, Adam's moments and step, the frozen values and
buffers. The checkpoints are written here by a real FSDP2 run (``fully_shard``, 2 gloo ranks)."""
from __future__ import annotations

import copy
import dataclasses
import functools
import math
import os
import pickle
import shutil

import pytest
import torch
import torch.distributed.checkpoint as dcp

import tiertrain
from tiertrain.errors import CheckpointError
from tiertrain.state.dcp_files import DcpCheckpoint
from tiertrain.state.foreign import FrozenKeptWarning
from tiertrain.state.shard_layout import unit_pieces
from tiertrain.testing import run_distributed
from tiertrain.update.protocol import SLOT_NAME

from deepspeed_models import build_llama, no_decay
from foreign_runs import batches, continued, engine_config, train_on, trainer_resumed
from reference import (Oracle, global_batches, make_config, make_model, rank_slices, reference_train, rel_distances,
                       tp_gathered)

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

FSDP2_STEPS = 3
LAYOUTS = {"nested": "{'model': ..., 'optim': ..., 'epoch': 7} from get_state_dict",
           "titan": "torchtitan's: the model's names at the top level, the optimizer's flattened",
           "trainer/checkpoint-3": "transformers' Trainer under Accelerate: pytorch_model_fsdp_0/ and optimizer_0/",
           "columns": "every matrix split by columns (a Shard(1) DTensor, as tensor parallelism saves)"}


def _fsdp2_run(rank, world, out):
    """Train the model 3 steps under FSDP2 and save it in each layout; rank 0 returns the run's
    full state (values, moments, step) as the reference."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    model = build_llama()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    trained = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = torch.optim.AdamW([{"params": [p for n, p in trained if not no_decay(n)], "weight_decay": 0.1},
                             {"params": [p for n, p in trained if no_decay(n)], "weight_decay": 0.0}], lr=1e-3)
    for batch in batches(FSDP2_STEPS, seed=5):
        mine = next(rank_slices(batch, rank, world, 4 // world, 1))
        model(**mine).loss.backward()
        opt.step()
        opt.zero_grad()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "epoch": 7}, checkpoint_id=os.path.join(out, "nested"))
    dcp.save({"model": msd}, checkpoint_id=os.path.join(out, "trainer/checkpoint-3/pytorch_model_fsdp_0"))
    dcp.save({"optimizer": osd}, checkpoint_id=os.path.join(out, "trainer/checkpoint-3/optimizer_0"))
    _, flat = get_state_dict(model, opt, options=StateDictOptions(flatten_optimizer_state_dict=True))
    dcp.save({**msd, "optimizer": flat, "train_state": {"step": torch.tensor(FSDP2_STEPS)}},
             checkpoint_id=os.path.join(out, "titan"))
    full_msd, full_osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True,
                                                                             broadcast_from_rank0=False))

    def columns(t):
        return distribute_tensor(t.detach().clone(), mesh, [Shard(t.dim() - 1)]) if t.dim() else t.clone()

    dcp.save({"model": {n: columns(v) for n, v in full_msd.items()},
              "optim": {"state": {n: {k: columns(v) for k, v in s.items()} for n, s in full_osd["state"].items()},
                        "param_groups": full_osd["param_groups"]}},
             checkpoint_id=os.path.join(out, "columns"))
    if rank:
        return None
    full = os.path.join(out, "trainer-full", "checkpoint-3")  # (Accelerate's FULL_STATE_DICT save, rank 0's)
    os.makedirs(full)
    torch.save(full_msd, os.path.join(full, "pytorch_model_fsdp.bin"))
    torch.save(full_osd, os.path.join(full, "optimizer.bin"))
    state = full_osd["state"]
    return {"masters": {n: full_msd[n].clone() for n, _ in trained},
            "frozen": {n: v.clone() for n, v in full_msd.items() if n not in dict(trained) and n != "lm_head.weight"},
            "exp_avg": {n: s["exp_avg"].clone() for n, s in state.items()},
            "exp_avg_sq": {n: s["exp_avg_sq"].clone() for n, s in state.items()},
            "step": int(next(iter(state.values()))["step"])}


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """(the directory holding the layouts, the FSDP2 run's full state)."""
    out = str(tmp_path_factory.mktemp("fsdp2"))
    expected = run_distributed(_fsdp2_run, 2, out, timeout=120)[0]
    return out, expected


def test_the_files_read_as_torchs_own_reader_reads_them(saved):
    """Every item, tensors whole and by range, and the objects, equal to what DCP's own
    FileSystemReader gives (format_utils.dcp_to_torch_save), bit for bit."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out, _ = saved
    for layout in LAYOUTS:
        for directory in _dcp_dirs(os.path.join(out, layout)):
            dcp_to_torch_save(directory, os.path.join(out, "whole.pt"))
            whole = torch.load(os.path.join(out, "whole.pt"), weights_only=False)
            checkpoint = DcpCheckpoint(directory)
            for key, item in checkpoint.tensors.items():
                value = _at(whole, item.path)
                assert torch.equal(checkpoint.whole(key), value), (layout, key)
                n = item.numel
                assert torch.equal(checkpoint.read(key, n // 3, n - 1), value.reshape(-1)[n // 3:n - 1]), key
            for key, path in checkpoint.objects.items():
                assert checkpoint.object(key) == _at(whole, path), (layout, key)


def _dcp_dirs(path: str) -> list[str]:
    if os.path.isfile(os.path.join(path, ".metadata")):
        return [path]
    return sorted(os.path.join(path, d) for d in os.listdir(path))


def _at(nested, path):
    for p in path:
        nested = nested[p]
    return nested


def _fsdp2s_model(expected: dict) -> torch.nn.Module:
    """The model as FSDP2 left it, for the reference."""
    model = build_llama()
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(expected["masters"][n] if p.requires_grad else expected["frozen"][n])
    return model


def _continued(model, config, batches, expected: dict | None):
    return continued(model, config, batches, expected, FSDP2_STEPS)


def _train_moved(rank, world, path, stage, tier, directory, batches):
    config = engine_config(stage, tier, world, directory)
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
    assert engine.load_dcp_checkpoint(path) == {} and engine.steps == FSDP2_STEPS
    return train_on(engine, rank, world, batches)


MOVES = [("nested", 3, "none", 2), ("titan", 2, "cpu", 2), ("trainer/checkpoint-3", 1, "none", 2),
         ("columns", 3, "nvme", 1), ("nested", 0, "none", 1)]


@pytest.mark.parametrize("layout,stage,tier,dp", MOVES, ids=[f"{m[0].split('/')[0]}-to-stage{m[1]}-{m[2]}-dp{m[3]}"
                                                              for m in MOVES])
def test_a_run_moved_from_fsdp2_continues_as_plain_pytorch_continues_it(saved, layout, stage, tier, dp, tmp_path):
    out, expected = saved
    data = batches(2)
    config = engine_config(stage, tier, dp, str(tmp_path))
    oracle = Oracle.run(_continued, _fsdp2s_model(expected), config, data, expected)
    path = os.path.join(out, layout)
    if dp == 1:
        losses, params = _train_moved(0, 1, path, stage, tier, str(tmp_path), data)
    else:
        losses, params = run_distributed(_train_moved, dp, path, stage, tier, str(tmp_path), data, timeout=120)[0]
    oracle.check(losses, params, f"FSDP2's {layout} moved to stage {stage}, optimizer {tier}, dp {dp}")


def test_the_engine_holds_fsdp2s_values_moments_and_step_bit_for_bit(saved, tmp_path):
    """Read back from the loaded engine (one rank, every piece a whole parameter)."""
    out, expected = saved
    config = engine_config(2, "cpu", 1, str(tmp_path))
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
    engine.load_dcp_checkpoint(os.path.join(out, "titan"))
    seen = set()
    for view, state in engine.update.optimizer.state.items():
        param = getattr(view, SLOT_NAME)
        seen.add(param)
        assert float(state["step"]) == expected["step"] == FSDP2_STEPS
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key].reshape(-1), expected[key][param].reshape(-1)), (param, key)
    assert seen == set(expected["masters"])
    values = engine.full_state_dict()
    for name, value in {**expected["masters"], **expected["frozen"]}.items():
        assert torch.equal(values[name], value), name
    engine.close()


def test_the_moments_matter_to_that_check(saved, tmp_path):
    """Continuing from the values alone (a fresh AdamW) ends far from where the moved run and
    the fp32 reference end together."""
    out, expected = saved
    data = batches(2)
    config = engine_config(2, "none", 1, str(tmp_path))
    _, reference = _continued(_fsdp2s_model(expected), config, data, expected)
    _, weights_only = _continued(_fsdp2s_model(expected), config, data, None)
    _, moved = _train_moved(0, 1, os.path.join(out, "nested"), 2, "none", str(tmp_path), data)
    moved_distance = max(rel_distances({n: moved[n] for n in reference}, reference).values())
    weights_only_distance = max(rel_distances(weights_only, reference).values())
    assert moved_distance * 100 < weights_only_distance, (moved_distance, weights_only_distance)


def _elements_read(rank, world, path):
    """(the tensor elements this rank read, those of the chunks its shards overlap)."""
    read = DcpCheckpoint._chunk
    counted = [0]

    def counting(self, item, chunk):
        value = read(self, item, chunk)
        counted[0] += value.numel() if value.dim() else 0  # (Adam's step, a scalar, is read per piece)
        return value

    DcpCheckpoint._chunk = counting
    try:
        config = engine_config(3, "none", world, "/unused")
        config.zero.persistence_threshold = 0  # (every parameter sharded, small ones too)
        engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
        engine.load_dcp_checkpoint(path)
        shards = engine.shard_description()
        engine.close()
    finally:
        DcpCheckpoint._chunk = read
    items = DcpCheckpoint(path).tensors
    overlapped = 0
    for kind, keys in (("units", ("model.{}", "optim.state.{}.exp_avg", "optim.state.{}.exp_avg_sq")),
                       ("frozen", ("model.{}",))):
        for piece in unit_pieces(rank, shards, kind):
            for key in keys:
                item = items[key.format(piece.name)]
                row = math.prod(item.shape[1:])
                overlapped += sum(math.prod(c.sizes) for c in item.chunks
                                  if c.offsets[0] * row < piece.hi and (c.offsets[0] + c.sizes[0]) * row > piece.lo)
    return counted[0], overlapped


def test_each_rank_reads_the_chunks_its_shards_overlap(saved):
    """FSDP2 saved each parameter and moment in two row blocks; an engine rank (stage 3 over 2
    ranks) reads exactly the blocks its shards overlap, not whole parameters: both ranks
    together read little more than the checkpoint once."""
    out, expected = saved
    checkpoint = sum(v.numel() for k in ("masters", "exp_avg", "exp_avg_sq", "frozen") for v in expected[k].values())
    results = run_distributed(_elements_read, 2, os.path.join(out, "nested"), timeout=120)
    for counted, overlapped in results:
        assert counted == overlapped < checkpoint, results
    assert sum(counted for counted, _ in results) < 1.25 * checkpoint, (results, checkpoint)


def _pipeline_rank(rank, world, path):
    config = make_config(zero={"stage": 1}, precision={"dtype": "fp32"}, parallel={"pp": 2},
                         batch={"micro_batch_size": 2, "grad_accum_steps": 2})
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
    engine.load_dcp_checkpoint(path)
    params = {n: v.float().clone() for n, v in engine.full_state_dict().items()}
    engine.close()
    return params


def test_a_pipeline_engine_takes_each_stage_its_parameters(saved):
    """At pp=2 each stage loads its own parameters (the last stage's copy of the tied embedding
    included) from the whole model's checkpoint."""
    out, expected = saved
    merged = {}
    for params in run_distributed(_pipeline_rank, 2, os.path.join(out, "nested"), timeout=120):
        merged.update(params)
    for param, value in {**expected["masters"], **expected["frozen"]}.items():
        assert torch.equal(merged.pop(param).reshape(-1), value.reshape(-1)), param
    assert set(merged) <= {"lm_head.weight"}, merged.keys()
    if merged:
        assert torch.equal(merged["lm_head.weight"], expected["masters"]["model.embed_tokens.weight"])


# -- checkpoints made in one process (dcp.save without a process group) ----------------------

def _tp_config():
    return make_config(parallel={"tp": 2}, precision={"dtype": "fp32"}, batch={"micro_batch_size": 4},
                       optimizer={"lr": 1e-4, "grad_clip": 1.0, "weight_decay": 0.1})


def _tp_moved(rank, world, path, batches):
    from tiertrain.parallel import apply_tensor_parallel

    config = _tp_config()
    topology = tiertrain.Topology.build(config.parallel)
    engine = tiertrain.wrap(apply_tensor_parallel(make_model(seed=5), topology), config, topology)
    engine.load_dcp_checkpoint(path)
    losses = [engine.train_batch(rank_slices(b, 0, 1, 4, 1)) for b in batches]
    params = tp_gathered(engine, {n: v.float() for n, v in engine.full_state_dict().items()})
    engine.close()
    return losses, params


def test_a_tensor_parallel_engine_takes_each_rank_its_slice_of_values_and_moments(tmp_path):
    """tiertrain's GPT trained by plain PyTorch, saved with DCP, continued at tp=2 (each rank its
    Megatron slices of the values and moments) as plain PyTorch continues it."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for batch in global_batches(2, 4, seed=7):
        model(**batch).backward()
        opt.step()
        opt.zero_grad()
    path = _save(tmp_path / "gpt", _named_state(model, opt))
    saved = {"step": 2, **{k: {n: opt.state[p][k] for n, p in model.named_parameters()}
                           for k in ("exp_avg", "exp_avg_sq")}}
    data = global_batches(2, 4, seed=8)
    oracle = Oracle.run(lambda *a: continued(*a, saved, 2), model, _tp_config(), data)
    for rank, (losses, params) in enumerate(run_distributed(_tp_moved, 2, path, data, timeout=120)):
        oracle.check(losses, params, f"a GPT saved with DCP moved to tp=2, rank {rank}")


def _adafactor(params):
    from transformers.optimization import Adafactor

    return Adafactor(params, lr=1e-2, scale_parameter=False, relative_step=False)  # (as the Trainer's optim builds it)


def _decay_groups() -> list[dict]:
    trained = [n for n, p in build_llama().named_parameters() if p.requires_grad]
    return [{"params": [n for n in trained if not no_decay(n)], "weight_decay": 0.01},
            {"params": [n for n in trained if no_decay(n)], "weight_decay": 0.0}]


def _muon_groups() -> list[dict]:
    """Muon for the hidden matrices, as its documentation asks; the embeddings and gains go to AdamW."""
    trained = [(n, p) for n, p in build_llama().named_parameters() if p.requires_grad]
    return [{"params": [n for n, p in trained if p.dim() == 2 and "embed" not in n and "lm_head" not in n]}]


def _rest_groups() -> list[dict]:
    hidden = set(_muon_groups()[0]["params"])
    return [{"params": [n for n, p in build_llama().named_parameters() if p.requires_grad and n not in hidden]}]


OTHER_OPTIMIZERS = {
    # name: ([(an optimizer factory over param groups, its groups by name)], what the engine does with them)
    "Adafactor": ([(_adafactor, _decay_groups)], "steps each parameter whole on one rank: its second moment factored"),
    "RMSprop": ([(functools.partial(torch.optim.RMSprop, lr=1e-3, momentum=0.5, centered=True), _decay_groups)],
                "elementwise"),
    "Muon+AdamW": ([(functools.partial(torch.optim.Muon, lr=1e-2), _muon_groups),
                    (functools.partial(torch.optim.AdamW, lr=1e-3), _rest_groups)],
                   "two optimizers; Muon orthogonalises each matrix whole, AdamW steps the rest by element"),
}
OTHER_MOVES = [("Adafactor", 3, "none", 2), ("Adafactor", 2, "cpu", 1), ("RMSprop", 2, "cpu", 2),
               ("Muon+AdamW", 3, "cpu", 2)]


def _other_config(stage: int, tier: str, dp: int):
    return make_config(zero={"stage": stage, "offload_optimizer": tier}, precision={"dtype": "fp32"},
                       parallel={"dp": dp}, batch={"micro_batch_size": 4 // dp}, optimizer={"grad_clip": 1.0})


class _Together:
    """Plain PyTorch's way to step two optimizers over disjoint parameters: one after the other."""

    def __init__(self, parts):
        self.parts = parts

    def step(self):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none=True):
        for part in self.parts:
            part.zero_grad(set_to_none)


def _plain_optimizers(optimizer: str, model) -> list[torch.optim.Optimizer]:
    params = dict(model.named_parameters())
    return [build([{**g, "params": [params[n] for n in g["params"]]} for g in groups()])
            for build, groups in OTHER_OPTIMIZERS[optimizer][0]]


def _other_moved(rank, world, optimizer, stage, tier, path, data):
    config = _other_config(stage, tier, world)
    parts = [(build, groups()) for build, groups in OTHER_OPTIMIZERS[optimizer][0]]
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel), optimizer=parts)
    engine.load_dcp_checkpoint(path)
    assert engine.steps == 2
    return train_on(engine, rank, world, data)


@pytest.mark.parametrize("optimizer,stage,tier,dp", OTHER_MOVES,
                         ids=[f"{m[0]}-stage{m[1]}-{m[2]}-dp{m[3]}" for m in OTHER_MOVES])
def test_a_run_with_another_optimizer_continues_with_its_state_as_plain_pytorch_continues_it(optimizer, stage, tier,
                                                                                             dp, tmp_path):
    """Not only Adam's: whatever state the run's optimizers keep (Adafactor's factored second
    moment, stepped whole; RMSprop's averages, cut with the shards; Muon's momentum beside
    AdamW's moments) loads into an engine built with the same optimizers and goes on as their
    own load_state_dict goes on."""
    model = build_llama()
    optimizers = _plain_optimizers(optimizer, model)
    for batch in batches(2, seed=5):
        model(**batch).loss.backward()
        _Together(optimizers).step()
        _Together(optimizers).zero_grad()
    path = _save(tmp_path / "run", _named_state(model, optimizers))
    saved = [o.state_dict() for o in optimizers]

    def reference(m, config, data):
        def optimizers_loaded(replica):
            parts = _plain_optimizers(optimizer, replica)
            for part, state in zip(parts, saved):
                part.load_state_dict(copy.deepcopy(state))  # (torch's own load; of a copy: it may keep the tensors)
            return _Together(parts)

        return reference_train(m, config, data, build_optimizer=optimizers_loaded, lr_scheduler=None)

    data = batches(2, seed=8)
    oracle = Oracle.run(reference, model, _other_config(stage, tier, dp), data)
    args = (optimizer, stage, tier, str(path), data)
    runs = [_other_moved(0, 1, *args)] if dp == 1 else run_distributed(_other_moved, dp, *args, timeout=120)
    oracle.check(*runs[0], f"{optimizer} ({OTHER_OPTIMIZERS[optimizer][1]}) moved to stage {stage}, {tier}, dp {dp}")


def _plain_run(model=None, optimizer=torch.optim.AdamW):
    """A model and its optimizer after one step, in one process."""
    model = model or build_llama()
    opt = optimizer([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batch = batches(1)[0]
    model(**batch).loss.backward()
    opt.step()
    return model, opt


def _save(path, state) -> str:
    dcp.save(state, checkpoint_id=path)
    return str(path)


def _engine(optimizer=None, model=None, stage=2):
    config = make_config(zero={"stage": stage}, precision={"dtype": "fp32"})
    model = model or build_llama(seed=11)
    return tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), optimizer=optimizer)


def _named_state(model, opt) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(model, opt)
    return {"model": msd, "optim": osd}


@pytest.mark.parametrize("stage", [0, 3])
def test_a_client_lr_scheduler_continues_from_the_loaded_step(stage, tmp_path):
    """wrap(lr_scheduler=) builds the scheduler at step 0; the load moves it to the saved step,
    as if stepped once per update the saved run applied."""
    import functools

    model, opt = _plain_run()
    opt.step()  # (a second update: Adam's step is 2)
    path = _save(tmp_path / "run", _named_state(model, opt))
    config = make_config(zero={"stage": stage}, precision={"dtype": "fp32"}, optimizer={"lr": 1.0})
    scheduler = functools.partial(torch.optim.lr_scheduler.LambdaLR, lr_lambda=lambda step: 0.1 * (step + 1))
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel),
                            optimizer=functools.partial(torch.optim.AdamW, lr=1.0), lr_scheduler=scheduler)
    assert engine.learning_rate() == pytest.approx(0.1)
    engine.load_dcp_checkpoint(path)
    assert engine.steps == 2 and engine.learning_rate() == pytest.approx(0.3)
    engine.train_batch(iter([batches(1)[0]]))
    assert engine.learning_rate() == pytest.approx(0.4)
    engine.close()


@pytest.mark.parametrize("stage", [1, 3])
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_a_half_precision_engine_computes_with_the_loaded_values(stage, dtype, tmp_path):
    """The masters hold the checkpoint's values and the compute copies the forward uses hold
    them rounded, not the model's values from before the load."""
    model, opt = _plain_run()
    saved = _named_state(model, opt)["model"]
    path = _save(tmp_path / "run", _named_state(model, opt))
    config = make_config(zero={"stage": stage}, precision={"dtype": dtype})
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
    engine.load_dcp_checkpoint(path)
    masters = engine.full_state_dict()
    with engine.gathered_parameters():
        for name, p in engine.module.named_parameters():
            assert p.dtype == {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype]
            assert torch.equal(p.detach(), saved[name].to(p.dtype)), name
            if p.requires_grad:
                assert torch.equal(masters[name], saved[name]), name
    engine.close()


def test_a_checkpoint_without_frozen_parameters_leaves_the_models_own_and_says_so(tmp_path):
    """Saved with the trainable parameters alone (as a LoRA run saves), the engine keeps its own
    frozen values and says so; the trained ones load."""
    model, opt = _plain_run()
    state = _named_state(model, opt)
    state["model"] = {n: v for n, v in state["model"].items() if "layers.0.mlp" not in n}
    path = _save(tmp_path / "ckpt", state)
    engine = _engine(model=build_llama(seed=11))
    own = {n: p.detach().clone() for n, p in engine.module.named_parameters() if "layers.0.mlp" in n}
    with pytest.warns(FrozenKeptWarning, match=r"holds no frozen parameter.*3 frozen parameters keep"):
        engine.load_dcp_checkpoint(path)
    values = engine.full_state_dict()
    for name, value in own.items():
        assert torch.equal(values[name], value), name
    assert torch.equal(values["model.norm.weight"], model.model.norm.weight.detach())
    engine.close()


def _with_buffer(model: torch.nn.Module) -> torch.nn.Module:
    model.model.norm.register_buffer("calibration", torch.arange(16, dtype=torch.float32))
    return model


def test_persistent_buffers_load_by_name_and_a_missing_one_is_named(tmp_path):
    model, opt = _plain_run(_with_buffer(build_llama()))
    with torch.no_grad():
        model.model.norm.calibration.mul_(3)
    path = _save(tmp_path / "with", _named_state(model, opt))
    engine = _engine(model=_with_buffer(build_llama(seed=11)))
    engine.load_dcp_checkpoint(path)
    assert torch.equal(engine.full_state_dict()["model.norm.calibration"], torch.arange(16.0) * 3)
    engine.close()
    model, opt = _plain_run()
    path = _save(tmp_path / "without", _named_state(model, opt))
    engine = _engine(model=_with_buffer(build_llama(seed=11)))
    before = engine.full_state_dict()
    with pytest.raises(CheckpointError, match=r"no value for the buffers \['model.norm.calibration'\].*nothing"):
        engine.load_dcp_checkpoint(path)
    after = engine.full_state_dict()
    assert all(torch.equal(before[n], after[n]) for n in before)
    engine.close()


def test_optimizer_state_by_number_or_of_another_rule_or_absent_is_refused_by_name(tmp_path):
    model, opt = _plain_run()
    cases = [({"model": model.state_dict(), "optim": opt.state_dict()}, r"by parameter number .*get_optimizer_state"),
             ({"model": model.state_dict()}, r"no optimizer state .*load_pretrained")]
    model_sgd, sgd = _plain_run(optimizer=lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9))
    cases.append((_named_state(model_sgd, sgd), r"state of .* is \['momentum_buffer'\]; this engine's optimizer "
                                               r"AdamW \(the default\) keeps \['exp_avg', 'exp_avg_sq', 'step'\] "
                                               r"for a [12]-D parameter"))
    for k, (state, named) in enumerate(cases):
        path = _save(tmp_path / str(k), state)
        engine = _engine()
        with pytest.raises(CheckpointError, match=named):
            engine.load_dcp_checkpoint(path)
        engine.close()
    # SGD's momentum loads into SGD, but SGD counts no steps: nothing in the DCP says how many there were
    # ... unless the saved dict records it as torchtitan does (train_state.step).
    def sgd_engine():
        return _engine(optimizer=lambda params: torch.optim.SGD(params, lr=1e-3, momentum=0.9))

    engine = sgd_engine()
    with pytest.raises(CheckpointError, match=r"counts no steps \(SGD keeps no step\).*train_state.step.*"
                                              r"TiertrainTrainer reads trainer_state.json"):
        engine.load_dcp_checkpoint(str(tmp_path / "2"))
    engine.close()
    titan = _save(tmp_path / "titan", {**_named_state(model_sgd, sgd), "train_state": {"step": torch.tensor(1)}})
    engine = sgd_engine()
    engine.load_dcp_checkpoint(titan)
    assert engine.steps == 1
    momentum = {n: sgd.state[p]["momentum_buffer"] for n, p in model_sgd.named_parameters() if p.requires_grad}
    for view, state in engine.update.optimizer.state.items():
        name = getattr(view, SLOT_NAME)
        assert torch.equal(state["momentum_buffer"].reshape(-1), momentum[name].reshape(-1)), name
    assert len(engine.update.optimizer.state) == len(momentum)
    engine.close()


def test_a_wrappers_prefix_and_an_old_non_persistent_buffer_are_taken_in_stride(tmp_path):
    """A compiled model's state dict saved as it is (``_orig_mod.`` before every name) beside
    get_optimizer_state_dict's names loads; a value of a buffer this model no longer persists
    (rotary inv_freq, as older transformers saved it) is left, not refused."""
    model, opt = _plain_run()
    state = _named_state(model, opt)
    state["model"] = {f"_orig_mod.{n}": v for n, v in state["model"].items()}
    state["model"]["_orig_mod.model.rotary_emb.inv_freq"] = model.model.rotary_emb.inv_freq.clone()
    path = _save(tmp_path / "ckpt", state)
    engine = _engine()
    engine.load_dcp_checkpoint(path)
    values = engine.full_state_dict()
    for name, param in model.named_parameters():
        assert torch.equal(values[name], param.detach()), name
    engine.close()


def test_another_model_or_engine_optimizer_is_refused_by_name(tmp_path):
    model, opt = _plain_run()
    path = _save(tmp_path / "ckpt", _named_state(model, opt))
    wider = build_llama(seed=11)
    wider.model.norm.weight = torch.nn.Parameter(torch.ones(17))
    extra = build_llama(seed=11)
    extra.model.layers[1].mlp.down_proj.bias = torch.nn.Parameter(torch.zeros(16))
    smaller = build_llama(seed=11)
    del smaller.model.layers[1].post_attention_layernorm.weight
    smaller.model.layers[1].post_attention_layernorm.weight = torch.ones(16)  # (a plain tensor: no parameter)
    for kwargs, named in [({"model": wider}, r"'model.norm.weight'.* shape \(16,\), this model has shape \(17,\)"),
                          ({"model": extra}, r"model.layers.1.mlp.down_proj.bias' is missing"),
                          ({"model": smaller}, r"model values \['model.layers.1.post_attention_layernorm.weight'\]"),
                          ({"optimizer": lambda params: torch.optim.SGD(params, lr=0.1)},
                           r"is \['exp_avg', 'exp_avg_sq', 'step'\]; this engine's optimizer SGD keeps \[\]")]:
        engine = _engine(**kwargs)
        with pytest.raises(CheckpointError, match=named):
            engine.load_dcp_checkpoint(path)
        engine.close()


def test_a_directory_that_is_no_dcp_checkpoint_or_a_truncated_one_is_named(tmp_path):
    engine = _engine()
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="holds no '.metadata' file, nor does any directory in it"):
        engine.load_dcp_checkpoint(str(tmp_path / "empty"))
    model, opt = _plain_run()
    path = _save(tmp_path / "ckpt", _named_state(model, opt))
    data = os.path.join(path, "__0_0.distcp")
    with open(data, "r+b") as f:
        f.truncate(os.path.getsize(data) // 2)
    with pytest.raises(CheckpointError, match="ends before the .* bytes .* truncated"):
        engine.load_dcp_checkpoint(path)
    for name in (".metadata", "__0_0.distcp"):  # (a FIFO would block a reader that opened it)
        os.remove(os.path.join(path, name))
        os.mkfifo(os.path.join(path, name))
        with pytest.raises(CheckpointError, match="not a regular file|does not exist"):
            engine.load_dcp_checkpoint(path)
    engine.close()


def _edited_metadata(path: str, edit) -> None:
    """Rewrite the checkpoint's .metadata with edit(metadata) applied (read here with pickle:
    the test's own file)."""
    with open(os.path.join(path, ".metadata"), "rb") as f:
        metadata = pickle.load(f)
    edit(metadata)
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(metadata, f)


def test_chunks_outside_their_tensor_overlapping_or_leaving_a_gap_are_refused(saved, tmp_path):
    """A crafted .metadata cannot make the reader copy outside a tensor, read a block twice or
    hand back elements no block wrote (torch.empty's leftovers)."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata

    out, _ = saved
    key = "model.model.embed_tokens.weight"  # (64 x 16 in two row blocks; "columns": two column blocks)

    def chunk(offsets, sizes):
        return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))

    def move_first(offsets):
        def edit(metadata):
            item = metadata.state_dict_metadata[key]
            first = item.chunks[0]
            index = next(i for i in metadata.storage_data if i.fqn == key and tuple(i.offset) == tuple(first.offsets))
            info = metadata.storage_data.pop(index)
            metadata.storage_data[dataclasses.replace(index, offset=torch.Size(offsets))] = info
            item.chunks[0] = chunk(offsets, first.sizes)
        return edit

    for layout, offsets, named in [("nested", (40, 0), "lies outside its shape"),
                                   ("nested", (16, 0), "do not cover its 64 rows once"),
                                   ("columns", (0, 4), "overlap")]:
        path = str(tmp_path / f"{layout}-{offsets[0]}")
        shutil.copytree(os.path.join(out, layout), path)
        _edited_metadata(path, move_first(offsets))
        with pytest.raises(CheckpointError, match=named):
            DcpCheckpoint(path).whole(key)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo should-not-run > /dev/null",))


def test_metadata_naming_any_other_class_is_refused_without_running_it(tmp_path):
    """DCP's own reader unpickles .metadata as it is; this one builds DCP's records only."""
    model, opt = _plain_run()
    path = _save(tmp_path / "ckpt", _named_state(model, opt))
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump({"state_dict_metadata": _Boom()}, f)
    called = []
    system = os.system
    os.system = lambda *a: called.append(a)
    try:
        with pytest.raises(CheckpointError, match=r"posix.system is not one of the DCP metadata records"):
            DcpCheckpoint(path)
    finally:
        os.system = system
    assert not called


@pytest.mark.parametrize("layout", ["trainer", "trainer-full"], ids=["SHARDED_STATE_DICT", "FULL_STATE_DICT"])
def test_trainer_resumes_a_checkpoint_that_trainer_saved_with_fsdp(saved, layout, tmp_path):
    """transformers' Trainer run with FSDP saves checkpoint-N/ beside trainer_state.json holding
    pytorch_model_fsdp_0/ and optimizer_0/ (SHARDED_STATE_DICT, DCP directories), or
    pytorch_model_fsdp.bin and optimizer.bin (FULL_STATE_DICT, FSDP1's default: the state
    dicts whole, keyed by name): TiertrainTrainer resumes either, values, moments and step."""
    out, expected = saved
    checkpoint = str(tmp_path / "checkpoint-3")
    shutil.copytree(os.path.join(out, layout, "checkpoint-3"), checkpoint)
    trainer = trainer_resumed(checkpoint, str(tmp_path / "out"), FSDP2_STEPS, FSDP2_STEPS)
    assert trainer.state.global_step == FSDP2_STEPS == trainer.engine.steps
    assert trainer.engine.learning_rate() == 0.0  # (the linear schedule at its end, not at its start)
    params = trainer.engine.full_state_dict()
    for name, value in expected["masters"].items():
        assert torch.equal(params[name], value), name
    seen = set()
    for view, state in trainer.engine.update.optimizer.state.items():
        name = getattr(view, SLOT_NAME)
        seen.add(name)
        assert float(state["step"]) == expected["step"]
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(state[key].reshape(-1), expected[key][name].reshape(-1)), (name, key)
    assert seen == set(expected["masters"])
    trainer.close()


def test_a_full_state_dict_checkpoint_without_its_optimizer_file_is_named(saved, tmp_path):
    out, _ = saved
    checkpoint = str(tmp_path / "checkpoint-3")
    shutil.copytree(os.path.join(out, "trainer-full", "checkpoint-3"), checkpoint)
    os.remove(os.path.join(checkpoint, "optimizer.bin"))
    with pytest.raises(CheckpointError, match=r"\(FSDP, FULL_STATE_DICT\) holds no optimizer.bin"):
        trainer_resumed(checkpoint, str(tmp_path / "out"), FSDP2_STEPS, FSDP2_STEPS)


def test_the_training_loop_starts_from_an_fsdp2_checkpoint_then_resumes_its_own(saved, tmp_path, capsys):
    """checkpoint.from_dcp (tiertrain train --checkpoint.from_dcp DIR): a run with nothing to
    resume starts at FSDP2's step with its state and trains on as plain PyTorch continues it;
    once it has saved, a resume takes its own checkpoint."""
    from tiertrain.config import ConfigError, from_dict
    from tiertrain.trainer import LoopConfig, Trainer

    out, expected = saved
    data = batches(2)
    engine_sections = engine_config(2, "none", 1, str(tmp_path))
    sections = {k: dataclasses.asdict(getattr(engine_sections, k))
                for k in ("zero", "precision", "parallel", "batch", "optimizer", "schedule")}

    def loop(steps, **checkpoint):
        return from_dict(LoopConfig, {**sections, "steps": steps, "logging": {"progress": False, "metrics_file": ""},
                                      "checkpoint": {"dir": str(tmp_path / "run"), **checkpoint}}).validate()

    with pytest.raises(ConfigError, match=r"checkpoint.from_dcp.*empty when checkpoint.from_deepspeed is set"):
        loop(1, from_dcp="a", from_deepspeed="b")
    start = {"from_dcp": os.path.join(out, "titan")}
    with Trainer(build_llama(seed=11), loop(FSDP2_STEPS + 1, **start), data) as trainer:
        trainer.fit()
        assert trainer.engine.steps == FSDP2_STEPS + 1
        params = {n: v.float() for n, v in trainer.engine.full_state_dict().items()}
    assert "started from FSDP2's" in capsys.readouterr().out
    Oracle.run(_continued, _fsdp2s_model(expected), engine_sections, data[:1], expected).check(
        None, params, "the loop started from FSDP2's checkpoint")
    with Trainer(build_llama(seed=11), loop(FSDP2_STEPS + 2, **start), data) as trainer:
        trainer.fit()  # (resumes its step-4 checkpoint: one more step)
        assert trainer.engine.steps == FSDP2_STEPS + 2
    out_text = capsys.readouterr().out
    assert "resumed from" in out_text and "FSDP2" not in out_text, out_text
