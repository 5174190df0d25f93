"""The gradient reducer's subscriptions (tiertrain/zero/reducer.py): hooks are called in the
order they subscribed, a removed subscription is never called again, and an update form that
subscribes for one step (the NVMe step overlapped with backward, ZeRO-Infinity §6) leaves no
subscriber behind, whether the step commits or is cancelled."""
from __future__ import annotations

import pytest

from reference import global_batches, make_config, make_model, rank_slices
from tiertrain.testing import run_distributed

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]


def _subscriptions(rank, world, nvme_path):
    import tiertrain
    from tiertrain.zero.stage3 import ParameterFetcher

    calls: list[tuple[str, int]] = []
    engine_hook = ParameterFetcher.on_unit_grads_done

    def fetcher_done(self, index):  # the engine's hook, subscribed when the engine was built
        calls.append(("fetcher", index))
        return engine_hook(self, index)
    ParameterFetcher.on_unit_grads_done = fetcher_done
    cfg = make_config(zero={"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme", "nvme_path": nvme_path,
                            "bucket_mb": 0.02, "overlap_nvme_step": True},
                      batch={"micro_batch_size": 2, "grad_accum_steps": 1}, optimizer={"grad_clip": 0.0})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    reducer, store = engine.reducer, engine.flat.shards
    keep = store.keep_for_step

    def keep_for_step(index, carry_over=False):  # the NVMe step's hook, subscribed per step
        calls.append(("keep", index))
        return keep(index, carry_over=carry_over)
    store.keep_for_step = keep_for_step
    base = reducer.subscriber_count
    first = reducer.subscribe(unit_done=lambda i: calls.append(("first", i)),
                              reduced=lambda i: calls.append(("first reduced", i)))
    second = reducer.subscribe(unit_done=lambda i: calls.append(("second", i)))
    batches = iter(global_batches(3, 4))
    engine.backward(engine(next(rank_slices(next(batches), rank, world, 2, 1))))
    during = reducer.subscriber_count
    first.remove()
    first.remove()  # (harmless)
    engine.step()
    order, calls[:] = list(calls), []
    after_step = reducer.subscriber_count
    with reducer.subscribe(unit_done=lambda i: calls.append(("scoped", i))) as scoped:
        assert scoped.active
    engine.backward(engine(next(rank_slices(next(batches), rank, world, 2, 1))))
    second.remove()
    in_flight = engine.update.in_flight is not None and reducer.subscriber_count
    engine.update.cancel()  # the overlapped step is abandoned: its hooks go with it
    after_cancel = reducer.subscriber_count
    second_backward = list(calls)
    ParameterFetcher.on_unit_grads_done = engine_hook
    engine.close()
    return {"base": base, "order": order, "during": during, "after_step": after_step, "in_flight": in_flight,
            "after_cancel": after_cancel, "second_backward": second_backward}


def test_subscribers_run_in_order_unsubscribe_and_a_cancelled_step_leaves_none(tmp_path):
    r = run_distributed(_subscriptions, 1, str(tmp_path / "swap"), timeout=90)[0]
    assert r["base"] == 1  # the engine's stage-3 fetcher
    assert r["during"] == r["base"] + 3  # + two here + the overlapped NVMe step's
    assert r["after_step"] == r["base"] + 1  # the step's went when it committed; "first" removed
    assert r["in_flight"] == r["base"] + 1  # the second step's ("second" removed)
    assert r["after_cancel"] == r["base"]
    order = r["order"]
    done = [name for name, _ in order if name != "first reduced"]
    units = [i for name, i in order if name == "fetcher"]
    # in subscription order: the engine's (at build), the two here, the step's (at its backward)
    assert units and done == [name for _ in units for name in ("fetcher", "first", "second", "keep")]
    assert [i for name, i in order if name == "keep"] == units
    assert sorted(i for name, i in order if name == "first reduced") == sorted(units)
    # removed ones ("first", the scoped one) are not called again
    assert {name for name, _ in r["second_backward"]} == {"fetcher", "second", "keep"}


def _values_offered(rank, world):
    import torch

    import tiertrain

    cfg = make_config(zero={"stage": 2, "offload_optimizer": "cpu", "bucket_mb": 0.02, "accumulate_on_device": "off"},
                      batch={"micro_batch_size": 2, "grad_accum_steps": 2}, optimizer={"grad_clip": 0.0})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    order, values = [], {}

    def value_hook(index, value):
        order.append(("value", index))
        values[index] = value.detach().clone()
    batches = iter(global_batches(2, 4 * world))
    engine.train_batch(rank_slices(next(batches), rank, world, 2, 2))  # (after a step the shards are stale)
    engine.reducer.subscribe(reduced_value=value_hook, reduced=lambda index: order.append(("reduced", index)))
    result = []
    for micro_batch in rank_slices(next(batches), rank, world, 2, 2):
        order.clear()
        values.clear()
        engine.backward(engine(micro_batch))
        engine.reducer.wait()
        result.append({
            "units": sorted(u.unit.index for u in engine.flat.units if u.trainable),
            "offered": sorted(values),
            "reduced": sorted(i for kind, i in order if kind == "reduced"),
            "value_first": all(order.index(("value", i)) < order.index(("reduced", i)) for i in values),
            "equal_to_landed": all(torch.equal(v, engine.flat.units[i].grad) for i, v in values.items())})
    engine.step()
    engine.close()
    return result


def test_reduced_value_offers_exactly_what_a_copying_landing_lands_and_nothing_for_an_adding_one():
    """The first landing since a step copies the reduced shard into the CPU tier's gradient:
    its value is offered (before ``reduced``) and equals what landed; the next micro-batch's
    landing adds into the shard, so no single value holds it and none is offered."""
    first, second = run_distributed(_values_offered, 1, timeout=90)[0]
    assert first["offered"] == first["units"] == first["reduced"]
    assert first["value_first"] and first["equal_to_landed"]
    assert second["offered"] == [] and second["reduced"] == second["units"]
