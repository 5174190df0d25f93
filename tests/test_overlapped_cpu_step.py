"""The CPU tier's step overlapped with backward (zero.overlap_cpu_step, tiertrain/update/overlapped_host.py):
each unit's shard is updated on a worker thread once its reduction lands at the boundary
backward, into a second set of buffers; step() swaps them in when the speculation holds (no
clip, or a clip coefficient of 1) and drops them otherwise. Either way the run is the
synchronous step's bit for bit, also across cancels (a forward, a save, a skipped step before
step()) and with a parameter no rank used; what cannot overlap is refused by name."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn
from reference import Oracle, engine_train, global_batches, make_config, make_model, reference_train

import tiertrain
from tiertrain.config import ConfigError
from tiertrain.testing import run_distributed
from tiertrain.update.overlapped_host import OverlappedHostUpdate

pytestmark = pytest.mark.timeout(120)
STEPS, MICRO = 4, 2
WIDE = {"hidden": 256}
"""Wide enough that most pieces of a shard take the compiled kernel of their own (the worker
updates those; pieces under 64 Ki elements wait for step(), as update/host_adamw.py steps them)."""


def _config(stage, overlap, dtype="fp32", accum=2, params="none", clip=0.0, **optimizer):
    return make_config(zero={"stage": stage, "bucket_mb": 0.02, "offload_optimizer": "cpu", "offload_params": params,
                             "overlap_cpu_step": overlap},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": accum}, precision={"dtype": dtype},
                       optimizer={"lr": 1e-2, "grad_clip": clip, "impl": "compiled", **optimizer})


# (stage, dtype, offload_params, clip): 5.0 is above these runs' gradient norm (the speculation
# is committed), 0.05 below it (dropped, and the step clipped).
VARIANTS = [(2, "fp32", "none", 0.0), (2, "bf16", "none", 5.0), (3, "fp32", "cpu", 0.05), (3, "bf16", "cpu", 5.0)]


def _runs(rank, world, variants):
    out = []
    for stage, dtype, params, clip in variants:
        runs = []
        for overlap in (True, False):
            cfg = _config(stage, overlap, dtype, params=params, clip=clip)
            losses, final, engine = engine_train(rank, world, make_model(**WIDE), cfg, global_batches(STEPS, MICRO * 2 * world))
            update = engine.update
            runs.append((losses, final, type(update), update.last_overlapped_step, getattr(update, "speculation", None)))
            engine.close()
        out.append(runs)
    return out


@pytest.mark.timeout(100)
@pytest.mark.parametrize("variants", [VARIANTS[1:3], pytest.param(VARIANTS[::3], marks=pytest.mark.slow)],
                         ids=["stage 2 bf16 committed, stage 3 fp32 clipped", "stage 2 unclipped, stage 3 bf16"])
def test_the_overlapped_step_is_the_synchronous_step_bit_for_bit(variants):
    world = 2
    out = run_distributed(_runs, world, variants, timeout=90)[0]
    for (stage, dtype, params, clip), ((losses, final, form, progress, speculation), (sync_losses, sync_final,
                                                                                       sync_form, *_)) in zip(variants, out):
        what = f"stage {stage} {dtype} params={params} clip={clip}"
        assert form is OverlappedHostUpdate and sync_form is not OverlappedHostUpdate, what
        # Units were handed to the worker during backward, before step() began.
        assert 0 < progress["units_ready"] <= progress["units"], (what, progress)
        if clip == 0.05:  # the norm exceeds the clip: every speculation dropped (or stopped before it began)
            assert speculation["committed"] == 0, (what, speculation)
        else:
            assert speculation == {"committed": STEPS, "discarded": 0}, (what, speculation)
        assert losses == sync_losses, what
        assert all(torch.equal(final[k], sync_final[k]) for k in sync_final), what
        if dtype == "fp32":  # and so equal to plain PyTorch within the float64 oracle's bound
            cfg = _config(stage, True, dtype, params=params, clip=clip)
            Oracle.run(reference_train, make_model(**WIDE), cfg, global_batches(STEPS, MICRO * 2 * world)).check(
                losses, final, what)


@pytest.mark.parametrize("stage", [2, 3])
def test_with_gradients_accumulated_on_the_device(stage):
    """zero.accumulate_on_device reduces each unit once, at the boundary's backward: the step
    overlaps that backward, as without it."""
    finals = []
    for overlap in (True, False):
        cfg = make_config(zero={"stage": stage, "offload_optimizer": "cpu", "overlap_cpu_step": overlap,
                                "accumulate_on_device": "on"}, batch={"micro_batch_size": MICRO, "grad_accum_steps": 3},
                          optimizer={"lr": 1e-2, "grad_clip": 100.0, "impl": "compiled"})
        engine = tiertrain.wrap(make_model(**WIDE), cfg, tiertrain.Topology.build(cfg.parallel))
        assert engine.plan.accumulation.on
        for batch in global_batches(2, 3 * MICRO):
            engine.train_batch(iter([{k: v[i * MICRO:(i + 1) * MICRO] for k, v in batch.items()} for i in range(3)]))
        if overlap:
            assert engine.update.speculation == {"committed": 2, "discarded": 0}
        finals.append(engine.full_state_dict())
        engine.close()
    assert _same(*finals)


FOREIGN = ["switch-nested-experts", "t5", "mixtral-moe", "llama-lora-frozen"]
"""Hugging Face families from tests/zoo.py: experts no token reaches (left for step()), an
encoder parameter whose gradient completes only after the last block's backward, adapters on a
frozen backbone."""


def _foreign_runs(rank, world, names):
    import zoo
    from tiertrain.update import host_adamw

    host_adamw.SMALL_PIECE = 1  # (the zoo's models are tiny: every piece takes the compiled kernel, so the worker has work)
    out = []
    for name in names:
        runs = []
        for overlap in (True, False):
            cfg = make_config(zero={"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu",
                                    "overlap_cpu_step": overlap}, batch={"micro_batch_size": MICRO},
                              optimizer={"eps": 1e-3, "grad_clip": 100.0, "impl": "compiled"})
            losses, final, engine = engine_train(rank, world, zoo.build(name), cfg, zoo.batches(name, 3, MICRO * world))
            runs.append((losses, final, getattr(engine.update, "speculation", None)))
            engine.close()
        out.append(runs)
    return out


@pytest.mark.slow
@pytest.mark.timeout(200)
def test_hugging_face_models_step_as_the_synchronous_step():
    pytest.importorskip("transformers")
    names = FOREIGN
    out = run_distributed(_foreign_runs, 2, names, timeout=190)[0]
    for name, ((losses, final, speculation), (sync_losses, sync_final, _)) in zip(names, out):
        assert speculation == {"committed": 3, "discarded": 0}, (name, speculation)
        assert losses == sync_losses, name
        assert _same(final, sync_final), name


def _tensor_parallel_runs(rank, world, sequence_parallel):
    from reference import tp_gathered
    from tiertrain.parallel import apply_tensor_parallel

    out = []
    for overlap in (True, False):
        cfg = make_config(zero={"stage": 2, "bucket_mb": 0.02, "offload_optimizer": "cpu", "overlap_cpu_step": overlap},
                          parallel={"dp": 1, "tp": 2}, batch={"micro_batch_size": MICRO, "grad_accum_steps": 2},
                          optimizer={"lr": 1e-2, "grad_clip": 100.0, "impl": "compiled"})
        try:
            losses, local, engine = engine_train(
                rank, world, make_model(**WIDE), cfg, global_batches(3, MICRO * 2),
                prepare=lambda m, topo: apply_tensor_parallel(m, topo, sequence_parallel=sequence_parallel))
        except ConfigError as e:
            out.append(str(e))
            continue
        out.append((losses, tp_gathered(engine, local), getattr(engine.update, "speculation", None)))
        engine.close()
    return out


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_tensor_parallel_steps_as_the_synchronous_step_and_sequence_parallel_is_refused():
    """tp slices step like any piece (the norm sums over tp at step()); sequence parallelism's
    partial gradients are summed over tp after their reduction, which the worker cannot wait for."""
    (overlapped, synchronous), _ = run_distributed(_tensor_parallel_runs, 2, False, timeout=110)
    assert overlapped[2] == {"committed": 3, "discarded": 0}
    assert overlapped[0] == synchronous[0] and _same(overlapped[1], synchronous[1])
    (refused, _), _ = run_distributed(_tensor_parallel_runs, 2, True, timeout=110)
    assert "overlap_cpu_step" in refused and "sequence parallelism" in refused


def _engine(overlap, model=None, **optimizer):
    cfg = _config(2, overlap, accum=1, **optimizer)
    return tiertrain.wrap(model or make_model(**WIDE), cfg, tiertrain.Topology.build(cfg.parallel))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_worker_stops_once_the_norms_taken_exceed_the_clip(monkeypatch):
    """A landed unit goes to the worker first and its norm is taken beside the update; before
    each unit the worker adds the norms taken so far and stops speculating once this rank's
    share exceeds the clip. With a clip far below any unit's norm it stops, each step, at the
    first unit to land (if that unit's norm was taken before the worker looked) or at the
    second (the first's norm is taken before the second lands); the step is the synchronous one."""
    seen = []
    real = OverlappedHostUpdate._speculate

    def spying(self, flight, index, used_here):
        real(self, flight, index, used_here)
        seen.append(flight.stopped_at)
    monkeypatch.setattr(OverlappedHostUpdate, "_speculate", spying)
    results = []
    for overlap in (True, False):
        engine = _engine(overlap, clip=1e-6)
        for batch in global_batches(2, MICRO):
            engine.train_batch(iter([batch]))
            if overlap:  # (more units landed than the worker looked at)
                assert engine.update.last_overlapped_step["units_ready"] > 2
        results.append(engine.full_state_dict())
        if overlap:
            assert engine.update.speculation["committed"] == 0
        engine.close()
    stop = "this rank's share of the gradient norm exceeds optimizer.grad_clip"
    per_step = "".join("s" if why == stop else "-" if why is None else "?" for why in seen)
    assert per_step in {"ss", "-ss", "s-s", "-s-s"}, seen
    assert _same(*results)


class WithUnused(nn.Module):
    """The tiny GPT and a matrix no forward uses: torch's AdamW leaves it (no .grad), and so
    must an update that runs before step() knows which parameters went unused."""

    def __init__(self):
        super().__init__()
        self.gpt = make_model(**WIDE)
        self.unused = nn.Parameter(torch.randn(300, 300))  # (large enough for a kernel of its own)

    def forward(self, input_ids, labels=None):
        return self.gpt(input_ids, labels=labels)


def test_a_parameter_no_rank_used_is_left_unchanged():
    torch.manual_seed(0)
    model = WithUnused()
    before = model.unused.detach().clone()
    engine = _engine(True, model, weight_decay=0.1)
    for batch in global_batches(2, MICRO):
        engine.train_batch(iter([batch]))
    after = engine.full_state_dict()
    assert engine.update.speculation["committed"] == 2
    assert torch.equal(after["unused"], before)
    assert not torch.equal(after["gpt.blocks.0.mlp.fc1.weight"], make_model(**WIDE).state_dict()["blocks.0.mlp.fc1.weight"])
    engine.close()


class BatchNormNet(nn.Module):
    """A user's model, not ours: fp32 weights, BatchNorm running statistics (buffers), no
    ModuleList (its units are the whole model at stage 3), its own loss from named inputs."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(64, 512)
        self.norm = nn.BatchNorm1d(512)
        self.out = nn.Linear(512, 256)

    def forward(self, features, target):
        return nn.functional.mse_loss(self.out(torch.relu(self.norm(self.inp(features)))).float(), target)


@pytest.mark.parametrize("stage", [2, 3])
def test_a_batchnorm_model_with_no_module_list_steps_as_the_synchronous_step(stage, monkeypatch):
    """Wrapped at bf16, with the optimizer (and at stage 3 the parameters) on the CPU tier: the
    worker updates its pieces during backward, the speculation is committed every step, and
    parameters and buffers equal the synchronous step's bit for bit."""
    from tiertrain.update import host_adamw

    monkeypatch.setattr(host_adamw, "SMALL_PIECE", 0)  # (every piece takes the worker's kernel)
    g = torch.Generator().manual_seed(5)
    batches = [{"features": torch.randn(8, 64, generator=g), "target": torch.randn(8, 256, generator=g)}
               for _ in range(3)]
    states = []
    for overlap in (True, False):
        torch.manual_seed(0)
        cfg = make_config(zero={"stage": stage, "offload_optimizer": "cpu", "offload_params": "cpu" if stage == 3 else "none",
                                "overlap_cpu_step": overlap},
                          batch={"micro_batch_size": 8}, precision={"dtype": "bf16"},
                          optimizer={"lr": 1e-2, "grad_clip": 10.0, "impl": "compiled"})
        engine = tiertrain.wrap(BatchNormNet(), cfg, tiertrain.Topology.build(cfg.parallel))
        for batch in batches:
            engine.train_batch(iter([batch]))
        if overlap:  # (committed: the worker had updated units, which step() swapped in)
            assert engine.update.speculation == {"committed": 3, "discarded": 0}
        states.append(engine.full_state_dict())
        engine.close()
    assert "norm.running_mean" in states[0] and int(states[0]["norm.num_batches_tracked"]) == 3
    assert _same(*states)


def _wait_for_updated_units(engine) -> None:
    deadline = time.monotonic() + 30
    while not engine.update._in_flight.updated:
        assert time.monotonic() < deadline, "the worker updated no unit during backward"
        time.sleep(0.005)


def _interrupted(overlap: bool, tmp_path) -> tuple[dict, dict, dict]:
    """A step interrupted by a save and by a forward between the last backward and step(),
    then stepped: the state saved, the state after that step, after the next one."""
    engine = _engine(overlap, clip=100.0)  # (clipping, with a coefficient of 1)
    batches = global_batches(3, MICRO)
    engine.train_batch(iter([batches[0]]))
    engine.backward(engine(batches[1]))
    if overlap:
        _wait_for_updated_units(engine)
    engine.save_checkpoint(str(tmp_path / f"saved-{overlap}"))  # cancels what ran ahead: saves the last step
    saved = engine.full_state_dict()
    engine.backward(engine(batches[1]))  # a forward before step() (and a second backward adding to the first)
    assert engine.step()
    stepped = engine.full_state_dict()
    engine.train_batch(iter([batches[2]]))
    after = engine.full_state_dict()
    if overlap:
        assert engine.update.speculation == {"committed": 3, "discarded": 1}
    engine.close()
    return saved, stepped, after


def test_a_save_or_a_forward_before_step_drops_what_ran_ahead(tmp_path):
    overlapped, synchronous = _interrupted(True, tmp_path), _interrupted(False, tmp_path)
    for a, b in zip(overlapped, synchronous):
        assert _same(a, b)
    resumed = _engine(True)
    resumed.load_checkpoint(str(tmp_path / "saved-True"))
    assert _same(resumed.full_state_dict(), overlapped[0])
    resumed.close()


def _poisoned_step(overlap: bool, names) -> tuple[bool, dict, dict, int]:
    engine = _engine(overlap, clip=5.0)
    batch = global_batches(1, MICRO)[0]
    engine.train_batch(iter([batch]))
    before = engine.full_state_dict()
    hooks = [p.register_hook(lambda g: g * float("inf")) for n, p in engine.module.named_parameters()
             if n in names or names == "all"]
    engine.backward(engine(batch))
    if overlap and names != "all":
        _wait_for_updated_units(engine)
    stepped = engine.step()
    for h in hooks:
        h.remove()
    skipped = engine.full_state_dict()
    assert _same(before, skipped)
    engine.train_batch(iter([batch]))  # the run goes on
    after = engine.full_state_dict()
    engine.close()
    return stepped, skipped, after, engine.train_state.skipped_steps


@pytest.mark.parametrize("names", ["all", ["embed.weight"]], ids=["first unit", "last unit"])
def test_a_non_finite_gradient_skips_the_step_as_the_synchronous_step_does(names):
    # "all": the first unit to land is not finite (the worker stops at once); the embedding's
    # unit lands last, after the worker updated others.
    overlapped, synchronous = _poisoned_step(True, names), _poisoned_step(False, names)
    assert overlapped[0] is synchronous[0] is False
    assert overlapped[3] == synchronous[3] == 1
    assert _same(overlapped[2], synchronous[2])


def test_memory_report_counts_the_second_buffers():
    sizes = {}
    for overlap in (True, False):
        engine = _engine(overlap)
        engine.train_batch(iter(global_batches(1, MICRO)))
        sizes[overlap] = engine.memory_report()
        engine.close()
    extra = sizes[True].cpu_tier - sizes[False].cpu_tier
    shard = sum(p.numel() for p in make_model(**WIDE).parameters())
    assert 0 < extra <= 12 * shard + 4 * 1024  # (the masters' padding, and pieces torch steps in place)
    assert sizes[True].optimizer - sizes[False].optimizer == extra


def test_the_estimator_counts_the_second_set_the_engine_holds():
    """Masters + moments again on the CPU tier; the engine's second buffers (which leave out the
    pieces torch steps in place) are within that, and most of it."""
    from tiertrain.estimate import estimate
    from tiertrain.estimate.layout import ZeroLayout

    cfg = _config(2, True, accum=1)
    name = "optimizer state, second set (overlap_cpu_step)"
    on = estimate(make_model(**WIDE), ZeroLayout.from_config(cfg, 1))
    off = estimate(make_model(**WIDE), ZeroLayout.from_config(_config(2, False, accum=1), 1))
    line = on.line(name)
    assert line.tier == "cpu" and name not in [x.name for x in off.lines]
    assert line.bytes == on.line("master weights").bytes + on.line("optimizer states").bytes
    assert on.total("cpu") == off.total("cpu") + line.bytes
    engines = {}
    for overlap in (True, False):
        engine = _engine(overlap)
        engine.train_batch(iter(global_batches(1, MICRO)))
        engines[overlap] = engine.memory_report().cpu_tier
        engine.close()
    assert 0.9 * line.bytes <= engines[True] - engines[False] <= line.bytes


@pytest.mark.parametrize("zero, other, message", [
    ({"overlap_cpu_step": True}, {"optimizer": {"impl": "fused"}}, "impl='fused'"),
    ({"overlap_cpu_step": True}, {"precision": {"dtype": "fp16"}}, "fp16"),
    ({"overlap_cpu_step": True, "offload_optimizer": "none"}, {}, "offload_optimizer='none'"),
    ({"overlap_cpu_step": True, "delayed_update": True}, {}, "delayed_update=True"),
    ({"overlap_cpu_step": True, "offload": "auto"}, {}, "offload='auto'.*offload='manual'"),
])
def test_what_cannot_overlap_is_refused_by_name(zero, other, message):
    sections = {"zero": {"stage": 2, "offload_optimizer": "cpu", **zero}}
    for k, v in other.items():
        sections[k] = {**sections.get(k, {}), **v}
    with pytest.raises(ConfigError, match=message):
        make_config(**sections)


def test_a_client_optimizer_is_refused_by_name():
    cfg = _config(2, True, accum=1)
    model = make_model()
    with pytest.raises(ConfigError, match="overlap_cpu_step.*optimizer brought to wrap"):
        tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel),
                       optimizer=torch.optim.SGD(model.parameters(), lr=0.1))


def test_default_is_off():
    assert make_config(zero={"stage": 2, "offload_optimizer": "cpu"}).zero.overlap_cpu_step is False
