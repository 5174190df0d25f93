"""The run plan (tiertrain/run_plan.py), as a specification: what each ZeRO stage partitions
(ZeRO §5), which parameter store, swapper and optimizer-step form each stage × tier
combination gets, the factory's order of choice, and that an engine built from a config runs
on the plan resolved from that config.

All single-process (the plan is a function of the config, the client optimizer and this
rank's place); the engines trained from these plans are checked against the single-process
reference in tests/test_zero.py, test_offload.py, test_nvme_optimizer.py and the others.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

import tiertrain
from reference import make_config, make_model
from tiertrain.config import ConfigError
from tiertrain.offload.shard_store import DeviceShards, HostShards, NVMeShards
from tiertrain.run_plan import RunPlan, resolve_run_plan
from tiertrain.tiers import Tier
from tiertrain.update.delayed import DelayedUpdate
from tiertrain.update import OptimizerUpdate
from tiertrain.update.factory import UpdateContext, build_update, choose_form
from tiertrain.update.in_memory import InMemoryUpdate
from tiertrain.update.nvme.form import NVMeUpdate, OverlappedNVMeUpdate
from tiertrain.update.whole import WholeParameterUpdate
from tiertrain.zero.plan import GradientPlan, default_plan
from tiertrain.zero.stages import GradientReduction, ZeroStage

# -- the stages (ZeRO §5) -------------------------------------------------------------------

STAGES = {  # stage: (P_os, P_g, P_p, keeps full gradients, reduction, shards over dp=4, paper name)
    0: (False, False, False, True, GradientReduction.ALL_REDUCE, 1, "DP"),
    1: (True, False, False, True, GradientReduction.SCATTER_IN_PLACE, 4, "P_os"),
    2: (True, True, False, False, GradientReduction.SCATTER_INTO_SHARD, 4, "P_os+g"),
    3: (True, True, True, False, GradientReduction.SCATTER_INTO_SHARD, 4, "P_os+g+p"),
}


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_each_stage_partitions_what_the_paper_says(stage):
    s = ZeroStage.of(make_config(zero={"stage": stage}))
    assert s is ZeroStage(stage) and s.value == stage
    assert (s.partitions_optimizer_states, s.partitions_gradients, s.partitions_parameters, s.keeps_full_gradients,
            s.gradient_reduction, s.shards_over(4), s.paper_name) == STAGES[stage]
    assert s.replicates_states == (stage == 0)
    assert str(s) == f"stage {stage} ({STAGES[stage][-1]})"


def test_a_stage_is_not_an_int():
    """Runtime code asks the stage by name: an int comparison is an error, not a silent False."""
    with pytest.raises(TypeError):
        ZeroStage.GRADIENTS >= 2  # noqa: B015
    with pytest.raises(ValueError):
        ZeroStage(4)


# -- stage × tier → store, swapper, form ----------------------------------------------------

def _tiers():
    """Every (stage, optimizer tier, parameter tier) the config accepts."""
    for stage in range(4):
        for opt in ("device", "cpu", "nvme"):
            for params in ("device", "cpu", "nvme"):
                if (opt != "device" and stage < 2) or (params != "device" and stage != 3):
                    continue
                yield stage, opt, params


STORE = {"device": DeviceShards, "cpu": HostShards, "nvme": NVMeShards}


def _config(tmp_path, stage, opt="device", params="device", zero=None, **sections):
    """No clipping unless asked (the default clips: a global change of the gradients)."""
    sections["optimizer"] = {"grad_clip": 0.0, **sections.get("optimizer", {})}
    return make_config(zero={"stage": stage, "offload_optimizer": opt, "offload_params": params,
                             "nvme_path": str(tmp_path), "bucket_mb": 0.02, **(zero or {})}, **sections)


def _resolve(config, client=None, gradient_plan: GradientPlan | None = None, tp_size=1) -> RunPlan:
    model = make_model(n_layers=2)
    return resolve_run_plan(config, client, gradient_plan or default_plan(model, config, 1),
                            dp_rank=0, tp_rank=0, tp_size=tp_size)


@pytest.mark.parametrize("stage,opt,params", list(_tiers()))
def test_each_stage_and_tier_gets_its_store_swapper_and_form(tmp_path, stage, opt, params):
    plan = _resolve(_config(tmp_path, stage, opt, params, zero={"overlap_nvme_step": False}))
    assert plan.stage is ZeroStage(stage)
    assert (plan.optimizer_tier, plan.param_tier) == (Tier(opt), Tier(params))
    assert plan.store is STORE[params]
    assert plan.needs_swapper == ("nvme" in (opt, params))
    assert plan.update is (NVMeUpdate if opt == "nvme" else InMemoryUpdate)
    assert plan.lazy_zero and not plan.global_gradient_changes  # (no clipping, fp32, one model)
    assert plan.gradients_final_at_landing and not plan.gradient_views_held
    line = plan.describe()
    assert "\n" not in line and str(plan) == line
    assert f"zero stage {stage}" in line and plan.update.__name__ in line and STORE[params].__name__ in line


# -- the factory's order of choice ----------------------------------------------------------

@pytest.mark.parametrize("whole,nvme,overlap,lazy,global_change,delayed,expected", [
    # whole-tensor groups come first, whatever else is asked
    (True, True, True, True, False, False, WholeParameterUpdate),
    (True, False, False, True, False, True, WholeParameterUpdate),
    # the NVMe optimizer overlaps backward only when all three allow it
    (False, True, True, True, False, False, OverlappedNVMeUpdate),
    (False, True, False, True, False, False, NVMeUpdate),
    (False, True, True, False, False, False, NVMeUpdate),
    (False, True, True, True, True, False, NVMeUpdate),
    # then ZeRO-Offload's delayed update, then AdamW in memory
    (False, False, True, True, False, True, DelayedUpdate),
    (False, False, True, True, False, False, InMemoryUpdate),
])
def test_the_factory_chooses_in_its_order(tmp_path, whole, nvme, overlap, lazy, global_change, delayed, expected):
    opt = "nvme" if nvme else "cpu"
    config = _config(tmp_path, 2, opt, zero={"overlap_nvme_step": overlap, "delayed_update": delayed})
    assert choose_form(config, whole_groups=whole, lazy_zero=lazy, global_gradient_changes=global_change) \
        is expected


@pytest.mark.parametrize("sections,final_at_landing", [
    ({"optimizer": {"grad_clip": 1.0}}, True),  # (clipping scales by the norm of the landed gradients)
    ({"precision": {"dtype": "fp16"}}, False),  # (the unscale changes them after landing)
])
def test_a_global_gradient_change_keeps_the_nvme_step_out_of_backward(tmp_path, sections, final_at_landing):
    overlapped = _resolve(_config(tmp_path, 3, "nvme", "nvme"))
    assert overlapped.update is OverlappedNVMeUpdate and not overlapped.global_gradient_changes
    changed = _resolve(_config(tmp_path, 3, "nvme", "nvme", **sections))
    assert changed.global_gradient_changes and changed.gradients_final_at_landing == final_at_landing
    assert changed.update is NVMeUpdate


def test_reductions_launched_by_a_schedule_keep_the_nvme_step_out_of_backward(tmp_path):
    """A pipeline's gradient plan launches its own reductions (launch_when_ready=False)."""
    config = _config(tmp_path, 2, "nvme")
    gradient_plan = dataclasses.replace(default_plan(make_model(n_layers=2), config, 1), launch_when_ready=False)
    plan = _resolve(config, gradient_plan=gradient_plan)
    assert not plan.lazy_zero and plan.update is NVMeUpdate


def test_a_norm_over_some_gradients_holds_views_of_them(tmp_path):
    config = _config(tmp_path, 2, "cpu")
    gradient_plan = dataclasses.replace(default_plan(make_model(n_layers=2), config, 1),
                                        counts_in_norm=lambda name: name != "pos_embed.weight")
    plan = _resolve(config, gradient_plan=gradient_plan)
    assert plan.gradient_pieces.counted and plan.gradient_views_held and not plan.gradients_final_at_landing
    assert not plan.global_gradient_changes and plan.update is InMemoryUpdate


def test_a_form_build_update_does_not_build_is_refused_by_name(tmp_path):
    context = UpdateContext(None, _config(tmp_path, 2), None, None, None, lazy_zero=True,
                            global_gradient_changes=False, form=OptimizerUpdate)
    with pytest.raises(ValueError, match=r"form=.*OptimizerUpdate.*one of WholeParameterUpdate, .*InMemoryUpdate"):
        build_update(context)


# -- the engine runs on the plan ------------------------------------------------------------

ENGINES = [(0, "device", "device", {}), (1, "device", "device", {}), (2, "cpu", "device", {}),
           (2, "cpu", "device", {"delayed_update": True}), (3, "nvme", "cpu", {}), (3, "cpu", "nvme", {})]


def _engine(config, **kwargs):
    return tiertrain.wrap(make_model(n_layers=2), config, tiertrain.Topology.build(config.parallel, "cpu"), **kwargs)


@pytest.mark.parametrize("stage,opt,params,zero", ENGINES)
def test_an_engine_runs_on_the_plan_of_its_config(tmp_path, stage, opt, params, zero):
    config = _config(tmp_path, stage, opt, params, zero=zero)
    engine = _engine(config)
    try:
        assert engine.plan == _resolve(config)
        plan = engine.plan
        assert type(engine.update) is plan.update
        assert type(engine.flat.shards) is plan.store
        assert (engine.swapper is not None) == plan.needs_swapper
        assert engine.reducer.stage is plan.stage and engine.stage == stage  # (the user's int stays an int)
        assert (engine.fetcher is not None) == plan.stage.partitions_parameters
        assert all((u.grad_full is not None) == plan.stage.keeps_full_gradients for u in engine.flat.units)
        with pytest.raises(AttributeError):
            engine.plan = plan
    finally:
        engine.close()


def test_a_custom_factory_sees_the_planned_form(tmp_path):
    """update_factory= (UpdateContext → OptimizerUpdate) is unchanged; its context carries the
    plan's form, and build_update without it chooses the same one."""
    seen = []

    def factory(context):
        seen.append(context.form)
        return build_update(dataclasses.replace(context, form=None))
    engine = _engine(_config(tmp_path, 3, "nvme", "nvme"), update_factory=factory)
    try:
        assert seen == [OverlappedNVMeUpdate] and type(engine.update) is OverlappedNVMeUpdate
    finally:
        engine.close()


def test_a_client_optimizer_with_whole_groups_is_stepped_whole(tmp_path):
    config = _config(tmp_path, 2, "cpu")
    engine = _engine(config, optimizer=lambda params: torch.optim.Adafactor(params, lr=1e-2))
    try:
        assert engine.plan.update is WholeParameterUpdate and type(engine.update) is WholeParameterUpdate
    finally:
        engine.close()
    with pytest.raises(ConfigError, match=r"zero\.delayed_update.*set zero\.delayed_update: false"):
        _engine(_config(tmp_path, 2, "cpu", zero={"delayed_update": True}),
                optimizer=lambda params: torch.optim.Adafactor(params, lr=1e-2))
