"""Every parameter starts at a multiple of SLOT_ALIGN elements of its flat unit
(tiertrain/zero/layout.py), as in an allocation of its own, and a checkpoint saved when the
slots were packed end to end still resumes.

Packed end to end, a parameter after one of odd size (a bias of 5, a scalar gate) started at an
odd offset: ``torch.view_as_complex`` of it (S4D's and FNO's (..., 2) weights) failed with
"Tensor must have a storage_offset divisible by 2" (tests/test_complex_parameters.py trains
such a model), and aligned vector kernels saw misaligned pointers. The gaps are padding: zero,
reduced and stepped as zeros, like a unit's tail.
"""
from __future__ import annotations

import os

import pytest
import torch
import torch.nn as nn

import tiertrain
from tiertrain.state.checkpoint import CheckpointError
from tiertrain.testing import run_distributed
from tiertrain.zero import layout
from reference import Oracle, make_config, rank_slices, reference_train

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("one_torch_thread")]

STEPS, SAVED_AT, GLOBAL_BATCH = 3, 2, 8


class OddBlock(nn.Module):
    """Sizes that are no multiple of 8: packed end to end, most parameters start unaligned."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(6, 5)
        self.down = nn.Linear(5, 6)
        self.gate = nn.Parameter(torch.full((1,), 0.5))

    def forward(self, h):
        return h + self.gate * self.down(torch.tanh(self.up(h)))


class OddNet(nn.Module):
    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(3, 6)
        self.blocks = nn.ModuleList([OddBlock(), OddBlock()])
        self.out = nn.Linear(6, 1)

    def forward(self, x, y):
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return nn.functional.mse_loss(self.out(h), y)


def _batches():
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(GLOBAL_BATCH, 3, generator=g), "y": torch.randn(GLOBAL_BATCH, 1, generator=g)}
            for _ in range(STEPS)]


def _config(zero: dict, world: int = 2):
    return make_config(zero={**zero, "bucket_mb": 0.0002}, batch={"micro_batch_size": GLOBAL_BATCH // world})


def test_slots_start_aligned_and_the_gaps_and_the_tail_are_the_units_padding():
    named = [(name, torch.empty(n)) for name, n in (("d", 1), ("c", 8), ("b", 3), ("a", 5))]
    unit, = layout.bucket_layout(named, num_shards=2, bucket_numel=10 ** 6).units  # (reverse order: a first)
    assert [(s.name, s.offset) for s in unit.slots] == [("a", 0), ("b", 8), ("c", 16), ("d", 24)]
    assert unit.numel == 17 and unit.padded_numel == 128
    assert unit.padding == [(5, 8), (11, 16), (25, 128)]


@pytest.mark.parametrize("stage", [2, 3])
def test_every_parameter_starts_at_a_multiple_of_slot_align(stage):
    config = _config({"stage": stage}, world=1)
    engine = tiertrain.wrap(OddNet(), config, tiertrain.Topology.build(config.parallel))
    slots = [slot for unit in engine.flat.layout.all_units for slot in unit.slots]
    assert len(slots) == len(dict(OddNet().named_parameters())), "every parameter in the layout"
    assert all(slot.offset % layout.SLOT_ALIGN == 0 for slot in slots), [(s.name, s.offset) for s in slots]
    units = engine.flat.layout.all_units
    assert any(end < unit.padded_numel for unit in units for _, end in unit.padding), \
        "the model's sizes leave gaps between slots: the case tests something"
    engine.close()


def _save_then_resume(rank, world, directory, zero, saved_align):
    """SAVED_AT steps with slots aligned to saved_align (1: packed, as before SLOT_ALIGN) and a
    checkpoint; then a model of another seed at today's alignment loads it (refused without
    resharding, naming why) and trains the remaining steps."""
    config = _config(zero, world)
    batches = [rank_slices(b, rank, world, GLOBAL_BATCH // world, 1) for b in _batches()]
    aligned, layout.SLOT_ALIGN = layout.SLOT_ALIGN, saved_align
    engine = tiertrain.wrap(OddNet(), config, tiertrain.Topology.build(config.parallel))
    losses = [engine.train_batch(batch) for batch in batches[:SAVED_AT]]
    saved = [s.offset for u in engine.flat.layout.units for s in u.slots]
    engine.save_checkpoint(directory)
    engine.close()
    layout.SLOT_ALIGN = aligned
    engine = tiertrain.wrap(OddNet(seed=7), config, tiertrain.Topology.build(config.parallel))
    assert saved != [s.offset for u in engine.flat.layout.units for s in u.slots], "the layouts differ"
    with pytest.raises(CheckpointError, match=r"packed end to end.*load it with reshard=True"):
        engine.load_checkpoint(directory, reshard=False)
    engine.load_checkpoint(directory)
    losses += [engine.train_batch(batch) for batch in batches[SAVED_AT:]]
    params = engine.full_state_dict()
    engine.close()
    return losses, params


@pytest.mark.parametrize("zero", [{"stage": 2}, {"stage": 3, "offload_params": "cpu", "offload_optimizer": "cpu"}],
                         ids=["stage2", "stage3-cpu"])
def test_a_checkpoint_saved_with_packed_slots_resumes_at_the_aligned_layout(zero, tmp_path):
    oracle = Oracle.run(lambda model: reference_train(model, _config({}), _batches()), OddNet())
    results = run_distributed(_save_then_resume, 2, os.fspath(tmp_path / "ckpt"), zero, 1, timeout=90)
    losses = [sum(rank[0][k] for rank in results) / 2 for k in range(STEPS)]
    oracle.check(losses, results[0][1], f"packed checkpoint resumed aligned, {zero}")
