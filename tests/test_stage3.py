"""Stage 3 specifics: persistent small parameters, reading and editing full parameters
outside forward, and the prefetch and live-parameter budgets."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn as nn

import tiertrain
from reference import Oracle, engine_train, global_batches, make_config, make_model, rank_slices, reference_train
from tiertrain.testing import RankFailure, run_distributed


def _config(**zero):
    return make_config(zero={"stage": 3, **zero}, batch={"micro_batch_size": 2}, optimizer={"eps": 1e-3})


def _train(rank, world, zero):
    losses, params, engine = engine_train(rank, world, make_model(n_layers=3), _config(**zero), global_batches(3, 4))
    resident = [u.unit.label for u in engine.flat.units if u.unit.resident]
    return losses, params, resident, engine.flat.peak_gathered_bytes


def _oracle():
    return Oracle.run(reference_train, make_model(n_layers=3), _config(), global_batches(3, 4))


@pytest.mark.timeout(60)
def test_persistent_small_parameters_stay_whole_and_train_identically():
    losses, params, resident, _ = run_distributed(_train, 2, {"persistence_threshold": 64}, timeout=50)[0]
    assert resident == ["<persistent>"], "layer norms (32 elements) form one resident unit"
    _oracle().check(losses, params, "persistent small parameters")


@pytest.mark.timeout(90)
def test_prefetch_gathers_ahead_within_the_live_budget():
    unit_bytes = 12 * 32 * 32 * 4  # one block's parameters (bias-free)
    _, no_prefetch_params, _, no_prefetch_peak = run_distributed(_train, 2, {"prefetch_mb": 0.0}, timeout=50)[0]
    _, prefetch_params, _, prefetch_peak = run_distributed(_train, 2, {"prefetch_mb": 1.0}, timeout=50)[0]
    cap = 1.5 * unit_bytes + no_prefetch_peak
    _, capped_params, _, capped_peak = run_distributed(
        _train, 2, {"prefetch_mb": 1.0, "max_live_mb": cap / 2**20}, timeout=50)[0]
    assert prefetch_peak > no_prefetch_peak, "prefetching holds the next units while the current one runs"
    assert capped_peak <= cap, "prefetch never exceeds max_live_mb"
    for params in (prefetch_params, capped_params):
        assert all(torch.equal(params[k], no_prefetch_params[k]) for k in params), "prefetch changes no value"


def _edit_full_parameters(rank, world):
    cfg = _config()
    model = make_model(n_layers=3)
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    engine.train_batch(rank_slices(global_batches(1, 4)[0], rank, world, 2, 1))
    before = engine.full_state_dict()
    weight = model.blocks[1].mlp.fc1.weight
    assert weight.untyped_storage().size() == 0, "outside forward a partitioned parameter holds no storage"
    with engine.gathered_parameters([weight], modifier_rank=0):
        seen = weight.detach().clone()
        if rank == 0:
            weight.data.fill_(0.5)  # only rank 0's edit counts: it is broadcast on exit
        else:
            weight.data.fill_(-1.0)
    after = engine.full_state_dict()
    released = weight.untyped_storage().size() == 0
    loss = engine.train_batch(rank_slices(global_batches(2, 4)[1], rank, world, 2, 1))
    return seen, before["blocks.1.mlp.fc1.weight"], after, released, loss


@pytest.mark.timeout(60)
def test_gathered_parameters_reads_and_writes_back_full_values():
    for seen, before, after, released, loss in run_distributed(_edit_full_parameters, 2, timeout=50):
        assert torch.equal(seen, before), "inside the context the full parameter is readable"
        assert torch.equal(after["blocks.1.mlp.fc1.weight"], torch.full_like(before, 0.5))
        assert released, "leaving the context releases the gathered unit again"
        assert torch.isfinite(torch.tensor(loss))


# -- ranks that leave the traced order after the first step ----------------------------------
#
# The first forward, backward and step are recorded with an agreement before every
# collective; later ones are checked locally against the recording (zero/stage3.py). A rank
# that deviates raises CollectiveMismatchError before its next collective; the launcher then
# stops the others, which wait in the collective it skipped: the run ends in seconds, blaming
# the deviating rank.

BLOCKS = [0, 1, 2]


def _plan(name: str, call: int, rank: int) -> list[int]:
    """The blocks forward number `call` (0-based, one per micro-batch) runs on `rank`."""
    later = call >= 2  # the first step (calls 0-1 with accumulation, 0 without) is traced
    if name == "skip" and later and rank == 1:
        return [0, 2]
    if name == "extra" and later and rank == 1:
        return [0, 1, 2, 2]
    if name == "swap" and later and rank == 1:
        return [1, 0, 2]
    if name == "repeat":  # block 0 twice per forward, once on rank 1 from the third forward
        return [0, 1, 2] if later and rank == 1 else [0, 0, 1, 2]
    if name == "accum_skip" and call == 1 and rank == 1:  # 2nd micro-batch of the traced step
        return [0, 2]
    if name in ("all_change", "all_change_retrace") and later:  # alike on every rank
        return [0, 2]
    return BLOCKS


class Planned(nn.Module):
    """Runs the GPT's blocks in the order _plan gives for each forward."""

    def __init__(self, model, rank, plan):
        super().__init__()
        self.model, self.rank, self.plan, self.calls = model, rank, plan, 0

    def forward(self, input_ids, labels):
        order = _plan(self.plan, self.calls, self.rank)
        self.calls += 1
        x = self.model.embed_tokens(input_ids)
        for i in order:
            x = self.model.blocks[i](x)
        return self.model.head_output(x, labels)


def _planned_run(rank, world, plan, steps=4, accum=1, check="traced", hook=None):
    cfg = make_config(zero={"stage": 3, "stage3_check": check},
                      batch={"micro_batch_size": 2, "grad_accum_steps": accum}, optimizer={"eps": 1e-3})
    model = Planned(make_model(n_layers=3), rank, plan)
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    assert engine.fetcher.check == check
    losses = []
    for step, batch in enumerate(global_batches(steps, 2 * world * accum)):
        if hook is not None:
            hook(engine, step, rank)
        losses.append(engine.train_batch(rank_slices(batch, rank, world, 2, accum)))
    return losses, engine.full_state_dict()


def _expect_rank1_deviation(plan, **kwargs):
    start = time.monotonic()
    with pytest.raises(RankFailure) as failure:
        run_distributed(_planned_run, 2, plan, timeout=30, **kwargs)
    assert failure.value.rank == 1 and failure.value.exc_type == "CollectiveMismatchError", failure.value
    assert "rank 1 reached" in failure.value.message and "where the trace" in failure.value.message
    assert time.monotonic() - start < 30
    return failure.value.message


@pytest.mark.timeout(60)
@pytest.mark.parametrize("plan, reached, expected", [
    ("skip", "the forward of unit 'model.blocks.2'", "the forward of unit 'model.blocks.1'"),
    ("extra", "the forward of unit 'model.blocks.2'", "the end of the forward of unit '<root>'"),
    ("swap", "the forward of unit 'model.blocks.1'", "the forward of unit 'model.blocks.0'"),
    ("repeat", "the forward of unit 'model.blocks.1'", "the forward of unit 'model.blocks.0'"),
])
def test_rank_leaving_the_traced_order_fails_alone_and_fast(plan, reached, expected):
    message = _expect_rank1_deviation(plan)
    assert f"reached {reached}" in message and f"has {expected}" in message, message


@pytest.mark.timeout(60)
def test_deviation_inside_the_first_accumulation_window_is_caught():
    """With accumulation the first micro-batch is recorded and the second already checked."""
    message = _expect_rank1_deviation("accum_skip", steps=2, accum=2)
    assert "forward pass #2" in message


def _skip_backward_on_rank1(engine, step, rank):
    if step == 2 and rank == 1:
        engine(next(rank_slices(global_batches(1, 4)[0], rank, 2, 2, 1)))  # forward, no backward


def _gather_on_rank1(engine, step, rank):
    if step == 2 and rank == 1:
        with engine.gathered_parameters([engine.module.model.blocks[0].mlp.fc1.weight]):
            pass


@pytest.mark.timeout(60)
@pytest.mark.parametrize("hook, said", [
    (_skip_backward_on_rank1, "rank 1 dropped 1 (the last: its forward of micro-batch 3 had no backward)"),
    (_gather_on_rank1, "issued the gather of unit 'model.blocks.0' outside the engine's passes "
                       "(gathered_parameters(), or the model called directly: evaluation, generate) but other ranks "
                       "of its group issued the start of a forward pass"),
])
def test_different_passes_on_some_ranks_fail_together(hook, said):
    """What a segment is (a fetch outside the passes, a forward, a backward) is agreed by every
    rank; a forward one rank ran with no backward is named as the pass it dropped."""
    with pytest.raises(RankFailure, match="ranks executed different modules|the ranks run different code") as failure:
        run_distributed(_planned_run, 2, "none", hook=hook, timeout=30)
    message = failure.value.message if failure.value.rank == 1 else failure.value.others[0]
    assert said in message, message


@pytest.mark.timeout(60)
def test_order_changed_alike_on_every_rank_fails_clearly_unless_retraced():
    with pytest.raises(RankFailure, match="retrace") as failure:
        run_distributed(_planned_run, 2, "all_change", timeout=30)
    assert failure.value.exc_type == "CollectiveMismatchError"
    every = run_distributed(_planned_run, 2, "all_change", check="every", timeout=30)[0]
    retraced = run_distributed(_planned_run, 2, "all_change_retrace", hook=_retrace_at_2, timeout=30)[0]
    assert retraced[0] == every[0]
    assert all(torch.equal(retraced[1][k], every[1][k]) for k in every[1])


def _retrace_at_2(engine, step, rank):
    if step == 2:
        engine.fetcher.retrace()


def _eval_between_steps(engine, step, rank):
    if step in (1, 2):
        with torch.no_grad():
            engine(next(rank_slices(global_batches(1, 4)[0], rank, 2, 2, 1)))


@pytest.mark.timeout(60)
def test_identical_eval_forwards_and_checks_change_nothing():
    """A forward without gradients on every rank is a segment of its own kind; training
    results are identical whether collectives are checked per segment, one by one, or not."""
    traced = run_distributed(_planned_run, 2, "none", hook=_eval_between_steps, timeout=30)[0]
    for check in ("every", "off"):
        other = run_distributed(_planned_run, 2, "none", check=check, timeout=30)[0]
        assert traced[0] == other[0]
        assert all(torch.equal(traced[1][k], other[1][k]) for k in other[1])


class Pair(nn.Module):
    """A unit returning two outputs: on rank 1 both reach the loss, so its backward visits
    the unit twice (the second visit finds it gathered and issues no collective)."""

    def __init__(self, block):
        super().__init__()
        self.block = block

    def forward(self, x):
        y = self.block(x)
        return y, y.clone()


class PairModel(nn.Module):
    def __init__(self, model, rank):
        super().__init__()
        self.model, self.rank = model, rank
        self.pairs = nn.ModuleList(Pair(b) for b in model.blocks)
        del self.model.blocks

    def forward(self, input_ids, labels):
        x = self.model.embed_tokens(input_ids)
        for pair in self.pairs:
            a, b = pair(x)
            x = a + (b - b.detach() if self.rank == 1 else 0)
        return self.model.head_output(x, labels)


def _pair_run(rank, world):
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(PairModel(make_model(n_layers=2), rank), cfg, tiertrain.Topology.build(cfg.parallel))
    for batch in global_batches(2, 4):
        engine.train_batch(rank_slices(batch, rank, world, 2, 1))


@pytest.mark.timeout(60)
def test_first_step_events_without_collectives_are_compared_by_digest():
    with pytest.raises(RankFailure, match="sequences of partitioned modules they ran before it differ"):
        run_distributed(_pair_run, 2, timeout=30)


def _forward_outside_the_engine(rank, world, tiers, check, swap):
    cfg = make_config(zero={"stage": 3, "offload_params": tiers, "stage3_check": check, "nvme_path": swap},
                      batch={"micro_batch_size": 2}, optimizer={"eps": 1e-3})
    model = make_model(n_layers=3)
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    batches = global_batches(4, 4)
    engine.train_batch(rank_slices(batches[0], rank, world, 2, 1))
    held_out = next(rank_slices(batches[3], rank, world, 2, 1))
    out = {"engine.evaluate": float(engine.evaluate(held_out))}
    model.eval()
    with torch.no_grad():
        out["model(x) under no_grad"] = float(model(**held_out))
    model.train()
    loss = model(**held_out)  # (grad enabled: the forward runs, its backward cannot)
    out["model(x) with grad"] = float(loss)
    try:
        loss.backward()
        out["backward"] = "ran"
    except RuntimeError as e:
        out["backward"] = str(e)
    out["released after"] = all(p.untyped_storage().size() == 0 for p in model.blocks[1].parameters())

    def fail(module, args):
        raise ValueError("the user's own hook fails")

    failing = model.blocks[1].register_forward_pre_hook(fail)
    with torch.no_grad(), pytest.raises(ValueError, match="own hook fails"):
        model(**held_out)
    failing.remove()
    out["released after a failed forward"] = [u.unit.label for u in engine.flat.all_units
                                              if u.gathered and not u.unit.resident]
    with torch.no_grad():
        out["model(x) after a failed forward"] = float(model(**held_out))
    out["next step"] = engine.train_batch(rank_slices(batches[1], rank, world, 2, 1))
    return out


def _uninterrupted(rank, world):
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2}, optimizer={"eps": 1e-3})
    engine = tiertrain.wrap(make_model(n_layers=3), cfg, tiertrain.Topology.build(cfg.parallel))
    batches = global_batches(4, 4)
    return [engine.train_batch(rank_slices(batches[i], rank, world, 2, 1)) for i in (0, 1)]


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tiers,check", [("none", "traced"), ("nvme", "every")])
def test_a_forward_outside_the_engine_gathers_unit_by_unit(tmp_path, tiers, check):
    """Issue 34, item 5: model(x) after training, outside the engine, raised "ranks executed
    different modules" (a wrong diagnosis); the only way was gathered_parameters(), which
    gathers the whole model. Now each unit is gathered around its module, as DeepSpeed's
    ZeRO-3 inference does, and released after (also when the forward raises midway); a
    backward through such a forward is refused by name; training goes on as if it had not
    happened."""
    expected = run_distributed(_uninterrupted, 2, timeout=60)
    for rank, out in enumerate(run_distributed(_forward_outside_the_engine, 2, tiers, check, str(tmp_path), timeout=60)):
        assert out["model(x) under no_grad"] == out["engine.evaluate"] == out["model(x) with grad"]
        assert "a forward run outside the engine at ZeRO stage 3" in out["backward"]
        assert out["released after"], "the units are released after an outside forward"
        assert out["released after a failed forward"] == [], "and after one that raised midway"
        assert out["model(x) after a failed forward"] == out["engine.evaluate"]
        assert out["next step"] == expected[rank][1], "training continues bit for bit"
