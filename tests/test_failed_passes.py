"""A forward or backward that raises, caught by the training loop (an out-of-memory batch skipped,
as loops written for plain PyTorch do), loses nothing and keeps nothing of the failed pass.

Specification, on 2 gloo ranks failing alike, for ZeRO stages 0-3 (our GPT; a Hugging Face
Llama at stages 2 and 3), the CPU tiers (the step
overlapped with backward, the delayed update) and NVMe (its step inside backward), with
buckets small enough that a backward has launched reductions before it fails:

1. After a caught failure the run continues exactly as the run that skipped that batch (bit
   for bit: losses and every value), and at stage 3 no unit is left gathered. Before, a backward
   that failed midway left its partial gradients in the next step's (stages 0-2: silently
   other values), and at stage 3 the next forward stopped with a CollectiveMismatchError that
   blamed a module order.
2. The same on the first step at stage 3, whose order is being recorded.
3. With gradient accumulation, a backward failing in the window's second micro-batch drops the
   whole window (its partial gradients cannot be told apart from the first micro-batch's), the
   exception says so in a note, and the run continues as the one that skipped the window.
4. A failure on one rank only leaves the ranks out of step: they stop at their next collective
   with a CollectiveMismatchError, whose message on each rank says how many passes each
   rank dropped, and which. Before, where the dropped pass issued no collective (a forward
   at stages 0-2), the ranks went on pairing each step with the peer's step of another batch,
   found out only at the end of the run. A loop that skips the batch on every rank after one
   rank's failure (an all-reduced flag) goes on: the others' forward with no backward counts
   as a dropped pass too.
5. A pipeline cannot skip a batch on the stages that failed (the others wait for activations or
   gradients that never come, and would take the next batch's for them): after a failure in
   its schedule the engine refuses to train, naming the rank and what to do, within seconds.
   Before, the ranks hung until the transfers' timeout.
"""
from __future__ import annotations

import pytest
import torch

import tiertrain
from reference import global_batches, make_config, make_model, rank_slices
from tiertrain.collective_order import CollectiveMismatchError
from tiertrain.testing import RankFailure, run_distributed

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402

WORLD, MICRO = 2, 2


class Failure(RuntimeError):
    """What the model raises once, on every rank (as an out-of-memory error would)."""


def _failing_model(where: str, family: str = "gpt"):
    """A model whose block 1 raises once when armed: in its forward, or in its backward (our
    GPT, or a Hugging Face Llama: its decoder layer 1)."""
    if family == "gpt":
        model = make_model(n_layers=3)
        block = model.blocks[1]
    else:
        model = zoo.build("llama-gqa")
        block = model.model.layers[1]
    armed = {"now": False}

    def fail(*_):
        if armed["now"]:
            armed["now"] = False
            raise Failure(f"block 1's {where} failed")

    if where == "forward":
        block.register_forward_pre_hook(fail)
    else:
        def fail_in_backward(module, args, out):
            out = out[0] if isinstance(out, tuple) else out
            if armed["now"] and out.requires_grad:
                out.register_hook(fail)

        block.register_forward_hook(fail_in_backward)
    return model, armed


def _run(rank, world, zero, accum, where, fail_at, skip, family="gpt"):
    """Train on 4 global batches; at step fail_at the micro-batch number `fail_at[1]` fails
    (caught), or with skip that step's batch is not trained at all."""
    config = make_config(zero={"bucket_mb": 0.001, **zero}, optimizer={"eps": 1e-3},
                         batch={"micro_batch_size": MICRO, "grad_accum_steps": accum})
    model, armed = _failing_model(where, family)
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
    losses, notes = [], []
    batches = global_batches(4, MICRO * world * accum) if family == "gpt" else \
        zoo.batches("llama-gqa", 4, MICRO * world * accum)
    for step, batch in enumerate(batches):
        if step == fail_at[0] and skip:
            continue
        micro = rank_slices(batch, rank, world, MICRO, accum)
        if step != fail_at[0]:
            losses.append(engine.train_batch(micro))
            continue
        with pytest.raises(Failure) as failed:
            for k, b in enumerate(micro):
                armed["now"] = k == fail_at[1]
                engine.backward(engine(b))
        notes += getattr(failed.value, "__notes__", [])
    left = [u.unit.label for u in engine.flat.all_units if u.gathered and not u.unit.resident] \
        if engine.fetcher is not None else []
    values = engine.full_state_dict()
    engine.close()
    return losses, values, left, notes


def _compare(zero, accum=1, where="backward", fail_at=(1, 0), family="gpt"):
    failed = run_distributed(_run, WORLD, zero, accum, where, fail_at, False, family, timeout=60)
    skipped = run_distributed(_run, WORLD, zero, accum, where, fail_at, True, family, timeout=60)
    for rank, ((losses, values, left, notes), (want, want_values, _, _)) in enumerate(zip(failed, skipped)):
        assert losses == want, (rank, losses, want)
        assert all(torch.equal(values[n], want_values[n]) for n in want_values), rank
        assert left == [], f"rank {rank}: units left gathered after the failure: {left}"
    return failed[0][3]


STAGES = {"stage0": {"stage": 0}, "stage1": {"stage": 1}, "stage2": {"stage": 2}, "stage3": {"stage": 3},
          "stage3-cpu-tiers": {"stage": 3, "offload_optimizer": "cpu", "offload_params": "cpu"},
          "stage2-cpu-overlapped-step": {"stage": 2, "offload_optimizer": "cpu", "overlap_cpu_step": True},
          "stage3-cpu-delayed-update": {"stage": 3, "offload_optimizer": "cpu", "delayed_update": True,
                                        "delayed_update_warmup": 0},
          "stage3-nvme-step-in-backward": {"stage": 3, "offload_optimizer": "nvme"}}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("name", STAGES)
def test_a_caught_failure_continues_as_the_run_that_skipped_the_batch(name, where, tmp_path):
    zero = {**STAGES[name], "nvme_path": str(tmp_path)}
    assert _compare(zero, where=where, fail_at=(2, 0)) == []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["forward", "backward"])
@pytest.mark.parametrize("zero", [{"stage": 2}, {"stage": 3}], ids=lambda z: f"stage{z['stage']}")
def test_a_hugging_face_llama_continues_as_the_run_that_skipped_the_batch(zero, where):
    _compare(zero, where=where, fail_at=(2, 0), family="llama")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_failure_in_the_first_step_at_stage_3_while_its_order_is_recorded(where):
    _compare({"stage": 3}, where=where, fail_at=(0, 0))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("zero", [{"stage": 2}, {"stage": 3}, {"stage": 1}], ids=lambda z: f"stage{z['stage']}")
def test_a_backward_failing_mid_window_drops_the_window_and_says_so(zero):
    notes = _compare(zero, accum=2, fail_at=(1, 1))
    assert len(notes) == 1 and "accumulation window's gradients were dropped" in notes[0], notes
    assert "1 earlier micro-batch(es)" in notes[0], notes


def _one_rank_fails(rank, world, zero, where):
    config = make_config(zero={"bucket_mb": 0.001, **zero}, optimizer={"eps": 1e-3},
                         batch={"micro_batch_size": MICRO})
    model, armed = _failing_model(where)
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
    for step, batch in enumerate(global_batches(4, MICRO * world)):
        armed["now"] = step == 1 and rank == 0
        try:
            engine.train_batch(rank_slices(batch, rank, world, MICRO, 1))
        except Failure:
            pass
        except CollectiveMismatchError as e:
            return step, str(e)
    return None, "no mismatch"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("zero,where", [({"stage": 0}, "forward"), ({"stage": 1}, "forward"), ({"stage": 2}, "forward"),
                                        ({"stage": 2}, "backward"), ({"stage": 3}, "forward")])
def test_a_failure_on_one_rank_only_stops_the_ranks_at_once_and_says_what_that_rank_dropped(zero, where):
    (failed_at, failed), (peer_at, peer) = run_distributed(_one_rank_fails, 2, zero, where, timeout=45)
    said = (f"The ranks dropped different numbers of passes (a forward or backward that raised, caught by the loop, "
            f"or a forward with no backward; rank 0 dropped 1 (the last: its {where} of micro-batch 2 raised "
            f"Failure), rank 1 dropped none); a pass skipped on some ranks only leaves the ranks out of step")
    assert said in failed and said in peer, (failed, peer)
    # At the first collective after the dropped pass, not at the end of the run: the forward
    # dropped at stages 0-2 issues none, and the sizes would pair each step with the peer's
    # step of the batch before (the data silently mixed).
    assert failed_at == 2 and peer_at == 1, (failed_at, peer_at)


def _skipped_together(rank, world, zero):
    """Rank 0's forward fails at step 1; the loop asks every rank (an all-reduce of a flag) and
    all skip that batch, the others dropping a forward that went well."""
    import torch.distributed as dist

    config = make_config(zero={"bucket_mb": 0.001, **zero}, optimizer={"eps": 1e-3},
                         batch={"micro_batch_size": MICRO})
    model, armed = _failing_model("forward")
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
    losses = []
    for step, batch in enumerate(global_batches(4, MICRO * world)):
        armed["now"] = step == 1 and rank == 0
        b = next(rank_slices(batch, rank, world, MICRO, 1))
        try:
            loss, ok = engine(b), 1
        except Failure:
            ok = 0
        flag = torch.tensor([ok])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if not flag.item():
            continue
        engine.backward(loss)
        engine.step()
        losses.append(float(loss))
    values = engine.full_state_dict()
    engine.close()
    return losses, values


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage", [0, 2])
def test_a_batch_skipped_on_every_rank_after_one_ranks_failure_continues(stage):
    """The ranks that went well drop their pass too (a forward with no backward counts as
    dropped at the next forward), so the counts agree and the run is the one that skipped it."""
    together = run_distributed(_skipped_together, WORLD, {"stage": stage}, timeout=45)
    skipped = run_distributed(_run, WORLD, {"stage": stage}, 1, "forward", (1, 0), True, timeout=45)
    for (losses, values), (want, want_values, _, _) in zip(together, skipped):
        assert losses == want, (losses, want)
        assert all(torch.equal(values[n], want_values[n]) for n in want_values)


def _pipeline(rank, world, where):
    config = make_config(parallel={"pp": 2, "dp": 1}, optimizer={"eps": 1e-3},
                         batch={"micro_batch_size": MICRO, "grad_accum_steps": 2})
    model, armed = _failing_model(where)
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))
    for step, batch in enumerate(global_batches(3, MICRO * 2)):
        armed["now"] = step == 1
        try:
            engine.train_batch(rank_slices(batch, 0, 1, MICRO, 2))
        except Failure as e:
            assert "this pipeline cannot go on" in "".join(e.__notes__)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_pipeline_refuses_to_go_on_after_its_schedule_failed(where):
    with pytest.raises(RankFailure, match=r"pipeline rank 0 \(global rank 0\) raised Failure in its schedule at "
                                          r"step 2.*cannot skip a batch on some stages.*last checkpoint"):
        run_distributed(_pipeline, 2, where, timeout=30)
