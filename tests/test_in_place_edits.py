"""A parameter changed in place after ``wrap()`` is refused by name before the change is lost.

After ``wrap()`` a parameter is the engine's compute copy and its value lives in the fp32
master. ``nn.init.normal_(p)``, ``p.copy_(w)`` or ``p.mul_(0.5)`` on it reached the compute copy
only: at bf16 (or with the masters on the CPU) the next step wrote the masters back over it and
every checkpoint, export and ``full_state_dict()`` left it out, without a word. Now the first
forward and every save compare the compute copies with the masters, on every data-parallel
rank, and raise :class:`tiertrain.InPlaceEditError` naming the parameter and the ways that reach the
masters; those ways work; ``close()``, which hands back the masters' values, warns; and where
the master is the compute copy itself (fp32 on the device, stage 0) the change is kept and
nothing is raised.
"""
from __future__ import annotations

import pytest
import torch

import tiertrain
from reference import global_batches, make_config, make_model
from tiertrain.testing import RankFailure, run_distributed

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

EDITED = r"parameter 'norm\.weight' was changed in place after wrap\(\)"
SEPARATE_MASTERS = [(0, "bf16", "none"), (1, "bf16", "none"), (2, "fp32", "cpu"), (2, "bf16", "nvme")]
"""(Stage 3 releases its parameters outside forward: an edit there is refused as it happens,
tiertrain/zero/released.py.)"""


def _trained_one_step(stage: int, dtype: str, offload: str, nvme_path: str = ""):
    cfg = make_config(zero={"stage": stage, "offload_optimizer": offload, "nvme_path": nvme_path},
                      batch={"micro_batch_size": 2}, precision={"dtype": dtype})
    model = make_model()
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    engine.backward(engine(global_batches(1, 2)[0]))
    assert engine.step()
    return model, engine


@pytest.mark.parametrize("stage,dtype,offload", SEPARATE_MASTERS)
def test_an_edit_after_a_step_is_refused_by_every_save_and_by_full_state_dict(tmp_path, stage, dtype, offload):
    """(The NVMe optimizer's masters are read from its files, one unit at a time.)"""
    model, engine = _trained_one_step(stage, dtype, offload, str(tmp_path / "nvme"))
    with torch.no_grad():
        model.norm.weight.mul_(0.5)
    for save in (engine.full_state_dict, lambda: engine.save_checkpoint(str(tmp_path / "ckpt")),
                 lambda: engine.save_pretrained(str(tmp_path / "hf"))):
        with pytest.raises(tiertrain.InPlaceEditError, match=EDITED + r".*model\.load_state_dict\(\{name: value\}, "
                                                            r"strict=False\).*gathered_parameters\(modifier_rank=0\)"):
            save()
    assert not (tmp_path / "ckpt").exists() or not any((tmp_path / "ckpt").iterdir()), "nothing was saved"
    engine.close()


def test_an_init_applied_after_wrap_is_refused_at_the_first_forward():
    cfg = make_config(zero={"stage": 2}, batch={"micro_batch_size": 2}, precision={"dtype": "bf16"})
    model = make_model()
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    torch.nn.init.normal_(model.blocks[1].mlp.fc2.weight)
    with pytest.raises(tiertrain.InPlaceEditError,
                       match=r"parameter 'blocks\.1\.mlp\.fc2\.weight' was changed in place after wrap\(\) .*before "
                             r"the first step"):
        engine(global_batches(1, 2)[0])
    engine.close()


@pytest.mark.parametrize("stage,dtype,offload", SEPARATE_MASTERS)
def test_the_ways_the_error_names_reach_the_masters(tmp_path, stage, dtype, offload):
    """load_state_dict and gathered_parameters(modifier_rank=0) write the change into the
    masters: full_state_dict holds it (bit for bit: the values are exact in bf16) and nothing
    is refused."""
    model, engine = _trained_one_step(stage, dtype, offload, str(tmp_path / "nvme"))
    before = engine.full_state_dict()
    half = before["norm.weight"].bfloat16().float() * 0.5
    model.load_state_dict({"norm.weight": half}, strict=False)
    assert torch.equal(engine.full_state_dict()["norm.weight"], half)
    with engine.gathered_parameters([model.norm.bias], modifier_rank=0):
        with torch.no_grad():
            model.norm.bias.fill_(0.25)
    after = engine.full_state_dict()
    assert torch.equal(after["norm.bias"], torch.full_like(after["norm.bias"], 0.25))
    engine.backward(engine(global_batches(2, 2)[1]))
    assert engine.step()
    engine.close()


def test_close_hands_back_the_masters_and_warns_of_an_edit_it_leaves_out():
    """close() is often in a finally block, where an error would hide the first: it warns."""
    model, engine = _trained_one_step(2, "bf16", "none")
    masters = engine.full_state_dict()
    with torch.no_grad():
        model.norm.weight.mul_(0.5)
    with pytest.warns(RuntimeWarning, match=EDITED + r" and before close\(\): the model close\(\) hands back holds "
                                                     r"the engine's fp32 masters"):
        engine.close()
    assert torch.equal(model.norm.weight, masters["norm.weight"])


def test_where_the_master_is_the_compute_copy_the_edit_is_kept():
    """fp32 on the device at stage 0: the parameter is the master; the edit is the model's."""
    model, engine = _trained_one_step(0, "fp32", "none")
    with torch.no_grad():
        model.norm.weight.mul_(0.5)
    edited = model.norm.weight.detach().clone()
    assert torch.equal(engine.full_state_dict()["norm.weight"], edited)
    engine.close()


def _edit_on_rank_0_only(rank, world):
    cfg = make_config(zero={"stage": 2}, batch={"micro_batch_size": 2}, precision={"dtype": "bf16"})
    model = make_model()
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    if rank == 0:
        with torch.no_grad():
            model.norm.weight.mul_(0.5)
    try:
        engine.full_state_dict()
    except tiertrain.InPlaceEditError as e:
        return str(e)
    finally:
        engine.close()
    return None


def test_an_edit_on_one_rank_fails_on_every_rank():
    """The ranks' copies differ: every rank raises, naming the parameter (the rank whose own
    shard holds it, if it made the edit, as changed; the others as differing)."""
    try:
        errors = run_distributed(_edit_on_rank_0_only, 2, timeout=40)
    except RankFailure as e:
        pytest.fail(str(e))
    assert all(e is not None and "parameter 'norm.weight'" in e for e in errors), errors
    assert any("parameter 'norm.weight' differs between the data-parallel ranks: changed in place after wrap() on "
               "some ranks only" in e for e in errors), errors
