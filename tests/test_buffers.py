"""Buffers are model state (issue 34, item 1): a BatchNorm CNN's running statistics evolve at
every ZeRO stage as under DDP (rank 0's broadcast before each forward, within the float64
oracle's bound), are in ``full_state_dict``, survive a checkpoint (also resharded to another
data-parallel size), and a checkpoint saved before buffers were checkpointed still loads.
They used to be in no checkpoint: zeros after a resume, and different on every rank. Under
pipeline parallelism each stage's buffers start every step from its data-parallel rank 0's."""
from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tiertrain
from reference import build_adamw, build_schedule, make_config, param_groups, rank_slices
from tiertrain.testing import run_distributed

pytestmark = pytest.mark.timeout(90)
WORLD, MICRO, STEPS = 2, 4, 3
BUFFERS = ("bn.running_mean", "bn.running_var", "bn.num_batches_tracked")


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.bn = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, images, labels):
        return F.cross_entropy(self.head(F.relu(self.bn(self.conv(images))).mean((2, 3))), labels)


def cnn(dtype=torch.float32) -> SmallCNN:
    torch.manual_seed(0)
    return SmallCNN().to(dtype)


def batches(steps: int = STEPS) -> list[dict]:
    g = torch.Generator().manual_seed(3)
    return [{"images": torch.randn(WORLD * MICRO, 3, 6, 6, generator=g) * 2 + 1,
             "labels": torch.randint(0, 3, (WORLD * MICRO,), generator=g)} for _ in range(steps)]


def _config(stage: int, **zero):
    return make_config(zero={"stage": stage, **zero}, batch={"micro_batch_size": MICRO})


def _ddp(rank, world, dtype):
    """DDP (broadcast_buffers=True), the same AdamW, schedule and per-rank batches."""
    cfg = _config(0)
    model = nn.parallel.DistributedDataParallel(cnn(dtype))
    opt = build_adamw(param_groups(model.module.named_parameters(), cfg.optimizer), cfg.optimizer)
    sched = build_schedule(opt, cfg.schedule)
    for batch in batches():
        local = next(rank_slices(batch, rank, world, MICRO, 1))
        model(local["images"].to(dtype), local["labels"]).backward()
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.double() for k, v in model.module.state_dict().items() if k in BUFFERS}


def _engine(rank, world, stage, broadcast=True):
    cfg = _config(stage, broadcast_buffers=broadcast)
    engine = tiertrain.wrap(cnn(), cfg, tiertrain.Topology.build(cfg.parallel))
    for batch in batches():
        engine.train_batch(rank_slices(batch, rank, world, MICRO, 1))
    state = engine.full_state_dict()
    return {k: state[k].double() for k in BUFFERS}


@pytest.fixture(scope="module")
def ddp():
    """Every rank's buffers under DDP in fp32 and float64 (the oracle)."""
    return (run_distributed(_ddp, WORLD, torch.float32, timeout=60),
            run_distributed(_ddp, WORLD, torch.float64, timeout=60))


def _assert_within_oracle(mine: dict, fp32: dict, exact: dict, what: str) -> None:
    for name in BUFFERS:
        noise = (fp32[name] - exact[name]).abs().max()
        ulps = 4 * 2.0**-24 * exact[name].abs().max()
        distance = (mine[name] - exact[name]).abs().max()
        assert distance <= 2 * noise + ulps, (f"{what}, {name}: the engine is {float(distance):.3e} from the "
                                              f"float64 DDP run, fp32 DDP is {float(noise):.3e}")


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_running_statistics_evolve_on_every_rank_as_under_ddp(ddp, stage):
    """Rank 0's statistics are broadcast before each forward; each rank's forward then updates
    them with its own batch, as under DDP."""
    fp32, exact = ddp
    for rank, mine in enumerate(run_distributed(_engine, WORLD, stage, timeout=60)):
        _assert_within_oracle(mine, fp32[rank], exact[rank], f"rank {rank}")
        assert int(mine["bn.num_batches_tracked"]) == STEPS


def test_without_broadcast_each_rank_keeps_its_own(ddp):
    fp32, exact = ddp
    ranks = run_distributed(_engine, WORLD, 2, False, timeout=60)
    _assert_within_oracle(ranks[0], fp32[0], exact[0], "rank 0")  # (rank 0's are its own either way)
    far = (ranks[1]["bn.running_mean"] - exact[1]["bn.running_mean"]).abs().max()
    assert far > 1e-3, "rank 1 kept its own statistics, not DDP's"


def _train_and_save(rank, world, stage, directory):
    cfg = _config(stage)
    engine = tiertrain.wrap(cnn(), cfg, tiertrain.Topology.build(cfg.parallel))
    for batch in batches():
        engine.train_batch(rank_slices(batch, rank, world, MICRO, 1))
    engine.save_checkpoint(directory)
    return {k: v.clone() for k, v in engine.full_state_dict().items() if k in BUFFERS}


def _resume(rank, world, stage, directory):
    cfg = _config(stage)
    engine = tiertrain.wrap(cnn(), cfg, tiertrain.Topology.build(cfg.parallel))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(directory)
    state = engine.full_state_dict()
    return {k: state[k] for k in BUFFERS}, [str(w.message) for w in caught]


@pytest.mark.parametrize("stage,resume_world", [(1, 2), (3, 2), (2, 1)])
def test_a_checkpoint_restores_the_buffers(tmp_path, stage, resume_world):
    directory = str(tmp_path / "ckpt")
    saved = run_distributed(_train_and_save, WORLD, stage, directory, timeout=60)
    resumed = run_distributed(_resume, resume_world, stage, directory, timeout=60)
    for rank, (buffers, _) in enumerate(resumed):
        for name in BUFFERS:
            assert torch.equal(buffers[name], saved[rank][name]), f"rank {rank}: {name} is not what was saved"
    assert float(resumed[0][0]["bn.running_mean"].abs().sum()) > 0, "(the statistics moved off their init)"


def test_a_checkpoint_saved_before_buffers_were_saved_still_loads(tmp_path):
    directory = str(tmp_path / "ckpt")
    cfg = _config(1)
    engine = tiertrain.wrap(cnn(), cfg, tiertrain.Topology.build(cfg.parallel))
    engine.train_batch(rank_slices(batches(1)[0], 0, 1, MICRO, 1))
    parts = engine.checkpoint_parts
    engine.checkpoint_parts = lambda: {k: v for k, v in parts().items() if k != "buffers"}  # the old format
    engine.save_checkpoint(directory)
    del engine.checkpoint_parts
    fresh = tiertrain.wrap(cnn(), cfg, tiertrain.Topology.build(cfg.parallel))
    with pytest.warns(UserWarning, match="holds no buffers .* keep their current values"):
        fresh.load_checkpoint(directory)
    assert fresh.steps == 1


def test_full_state_dict_names_the_buffers_as_state_dict_does():
    cfg = _config(0)
    engine = tiertrain.wrap(cnn(), cfg, tiertrain.Topology.build(cfg.parallel))
    assert sorted(engine.full_state_dict()) == sorted(cnn().state_dict())


def test_save_pretrained_and_export_write_the_trained_buffers(tmp_path):
    from safetensors.torch import load_file

    from tiertrain.state.consolidate import export_checkpoint

    cfg = _config(3)
    engine = tiertrain.wrap(cnn(), cfg, tiertrain.Topology.build(cfg.parallel))
    engine.train_batch(rank_slices(batches(1)[0], 0, 1, MICRO, 1))
    trained = {k: v for k, v in engine.full_state_dict().items() if k in BUFFERS}
    engine.save_pretrained(str(tmp_path / "live"))
    engine.save_checkpoint(str(tmp_path / "ckpt"))
    export_checkpoint(str(tmp_path / "ckpt"), str(tmp_path / "offline"))
    for where in ("live", "offline"):
        written = load_file(str(tmp_path / where / "model.safetensors"))
        for name in BUFFERS:
            assert torch.equal(written[name].to(trained[name].dtype), trained[name]), f"{where}: {name}"


# --------------------------------------------------------------------------- pipeline parallelism

FEATURES, HIDDEN, CLASSES, PP_MICRO, PP_ACCUM, PP_STEPS = 3, 4, 2, 2, 2, 3
PP_BUFFERS = ("norm_in.running_mean", "norm_in.running_var", "norm_in.num_batches_tracked",
              "norm_out.running_mean", "norm_out.running_var", "norm_out.num_batches_tracked")


class FirstStage(nn.Module):
    """Normalises the raw features: its running statistics depend on the data alone, so the
    test can compute them (reference_norm_in)."""

    def __init__(self):
        super().__init__()
        self.norm_in = nn.BatchNorm1d(FEATURES)
        self.fc_in = nn.Linear(FEATURES, HIDDEN)

    def forward(self, x, batch):
        return self.fc_in(self.norm_in(batch["features"]))


class LastStage(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm_out = nn.BatchNorm1d(HIDDEN)
        self.fc_out = nn.Linear(HIDDEN, CLASSES)

    def forward(self, x, batch):
        return F.cross_entropy(self.fc_out(F.relu(self.norm_out(x))), batch["labels"])


def pp_batches() -> list[dict]:
    """Global batches whose data-parallel halves differ in scale and offset, so that each dp
    rank's running statistics would drift their own way."""
    g = torch.Generator().manual_seed(5)
    rows = 2 * PP_MICRO * PP_ACCUM
    out = []
    for _ in range(PP_STEPS):
        features = torch.randn(rows, FEATURES, generator=g)
        replica = torch.arange(rows) // PP_MICRO % 2  # (the dp rank rank_slices gives each row to)
        out.append({"features": features * (1 + 3 * replica[:, None]) + 2 * replica[:, None],
                    "labels": torch.randint(0, CLASSES, (rows,), generator=g)})
    return out


def reference_norm_in(micro_batches) -> nn.BatchNorm1d:
    """The first stage's BatchNorm after a training forward of each micro-batch, in order."""
    norm = nn.BatchNorm1d(FEATURES)
    with torch.no_grad():
        for b in micro_batches:
            norm(b["features"])
    return norm


def _pipeline_with_norms(rank, world, directory):
    cfg = make_config(parallel={"pp": 2, "dp": 2, "schedule": "1f1b"},
                      batch={"micro_batch_size": PP_MICRO, "grad_accum_steps": PP_ACCUM})
    topology = tiertrain.Topology.build(cfg.parallel)
    pp, dp = topology.coord("pp"), topology.coord("dp")
    torch.manual_seed(0)
    stages = [FirstStage(), LastStage()]
    engine = tiertrain.wrap([stages[pp]], cfg, topology, activation_shape=(PP_MICRO, HIDDEN))
    seen = []  # the buffers the first micro-batch's forward of each step sees

    def first_forward_of_the_step(module, args):
        if len(seen) == engine.steps:
            seen.append({k: v.clone() for k, v in module.state_dict().items() if k in PP_BUFFERS})
    stages[pp].register_forward_pre_hook(first_forward_of_the_step)
    for batch in pp_batches():
        engine.train_batch(rank_slices(batch, dp, 2, PP_MICRO, PP_ACCUM))
    trained = engine.full_state_dict()
    engine.save_checkpoint(directory)
    resumed = tiertrain.wrap([[FirstStage(), LastStage()][pp]], cfg, topology, activation_shape=(PP_MICRO, HIDDEN))
    resumed.load_checkpoint(directory)
    return pp, dp, seen, {k: trained[k] for k in PP_BUFFERS}, resumed.full_state_dict()


@pytest.mark.timeout(120)
def test_pipeline_stages_start_every_step_from_data_parallel_rank_0s_buffers(tmp_path):
    """pp = 2 × dp = 2: each stage's buffers are broadcast over the stage's data-parallel group
    before the step's first forward, as DDP's broadcast_buffers (once per step: the schedule
    interleaves the micro-batches' forwards). They used to stay each rank's own: the dp
    ranks of a stage drifted apart, each following its own data. They are in
    full_state_dict (the whole pipeline's, on every rank) and in the checkpoint."""
    results = run_distributed(_pipeline_with_norms, 4, str(tmp_path / "ckpt"), timeout=100)
    by_stage = {}
    for pp, dp, seen, trained, resumed in results:
        by_stage.setdefault(pp, {})[dp] = seen
        assert sorted(trained) == sorted(PP_BUFFERS), "full_state_dict holds both stages' buffers"
        for name in PP_BUFFERS:  # (what each rank saved, its own after its last step, is what it resumes)
            assert torch.equal(resumed[name], trained[name]), f"stage {pp}, dp rank {dp}: {name} after a resume"
        assert int(trained["norm_in.num_batches_tracked"]) == PP_STEPS * PP_ACCUM
        # After training: rank 0's statistics up to the last step, then this rank's own last step.
        rank0_micro = [m for b in pp_batches()[:-1] for m in rank_slices(b, 0, 2, PP_MICRO, PP_ACCUM)]
        own_last = list(rank_slices(pp_batches()[-1], dp, 2, PP_MICRO, PP_ACCUM))
        expected = reference_norm_in(rank0_micro + own_last)
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(trained[f"norm_in.{name}"], getattr(expected, name), rtol=1e-6, atol=1e-7)
    for pp, ranks in by_stage.items():
        assert len(ranks[0]) == len(ranks[1]) == PP_STEPS
        for step, (zero, one) in enumerate(zip(ranks[0], ranks[1])):
            for name in zero:
                assert torch.equal(zero[name], one[name]), (f"stage {pp}, step {step}: dp rank 1's {name} is not "
                                                             f"dp rank 0's at the step's first forward")
    for step, seen in enumerate(by_stage[0][0]):  # dp rank 0's, which it always keeps
        rank0_micro = [m for b in pp_batches()[:step] for m in rank_slices(b, 0, 2, PP_MICRO, PP_ACCUM)]
        expected = reference_norm_in(rank0_micro)
        for name in ("running_mean", "running_var"):
            torch.testing.assert_close(seen[f"norm_in.{name}"], getattr(expected, name), rtol=1e-6, atol=1e-7)
