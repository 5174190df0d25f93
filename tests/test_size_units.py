"""Stage-3 units for a model without nn.ModuleList (issue 34, item 4): a CNN or a Sequential
ResNet used to become one root unit, gathered whole, so stage 3 saved nothing and nothing said
so. Such a model is now cut by size, as FSDP's size_based_auto_wrap_policy cuts it, trains as
the single-process reference does (float64 oracle), and the run banner names the units."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import tiertrain
from reference import Oracle, engine_train, make_config, reference_train
from tiertrain.testing import run_distributed
from tiertrain.zero.plan import default_unit_modules, size_based_unit_modules

pytestmark = pytest.mark.timeout(90)


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x):
        return x + self.conv2(torch.tanh(self.conv1(x)))


class SequentialResNet(nn.Module):
    """A ResNet as nn.Sequential: a stem, four residual blocks and a head; no ModuleList."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), *[Residual(8) for _ in range(4)])
        self.head = nn.Linear(8, 5)

    def forward(self, images, labels):
        return F.cross_entropy(self.head(self.body(images).mean((2, 3))), labels)


def _batches(steps: int = 3, size: int = 8) -> list[dict]:
    g = torch.Generator().manual_seed(1)
    return [{"images": torch.randn(size, 3, 6, 6, generator=g), "labels": torch.randint(0, 5, (size,), generator=g)}
            for _ in range(steps)]


def test_the_size_policy_cuts_children_first_and_leaves_the_rest_to_the_root():
    model = SequentialResNet()
    block = sum(p.numel() for p in model.body[1].parameters())
    assert size_based_unit_modules(model, block) == ["body.1", "body.2", "body.3", "body.4"]
    assert size_based_unit_modules(model, block // 2) == [f"body.{i}.conv{j}" for i in range(1, 5) for j in (1, 2)]
    assert default_unit_modules(model) == size_based_unit_modules(model, sum(p.numel() for p in model.parameters())
                                                                  // 16)
    assert len(default_unit_modules(model)) >= 4, "no ModuleList: cut by size"


def _train(rank, world):
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 4})
    losses, params, engine = engine_train(rank, world, SequentialResNet(), cfg, _batches())
    report = engine.memory_report()
    return losses, params, report.units, report.largest_unit_share


def test_a_sequential_resnet_at_stage_3_is_cut_into_units_and_matches_the_reference():
    results = run_distributed(_train, 2, timeout=60)
    oracle = Oracle.run(reference_train, SequentialResNet(), make_config(batch={"micro_batch_size": 8}), _batches())
    losses, params, units, share = results[0]
    oracle.check(losses, params, "a Sequential ResNet at stage 3, dp 2")
    assert units >= 4 and share < 0.5, (units, share)
