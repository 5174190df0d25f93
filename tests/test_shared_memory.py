"""Tensors over a parameter's memory are refused at wrap(), naming both (tiertrain/shared_memory.py).

The engine moves each parameter into flat buffers of its own. A tie made through ``.data``
(two parameters over one memory) came apart, and a tensor a module kept over a parameter's
memory (``self.w_t = self.w.t()`` at build) went on reading the initial values while the
parameter trained: 4 steps of the model below reached loss 2.81 where plain PyTorch reaches
2.49, with nothing said. Parameters cut from one tensor without overlapping train alike either
way and are accepted.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import tiertrain
from tiertrain.config import ConfigError
from reference import Oracle, engine_train, make_config, reference_train

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("one_torch_thread")]

WIDTH, STEPS, BATCH = 4, 3, 4


class Model(nn.Module):
    """Two blocks and an input weight; kept: how a tensor over the weight's memory is kept."""

    def __init__(self, kept: str = ""):
        super().__init__()
        torch.manual_seed(0)
        self.w = nn.Parameter(torch.randn(WIDTH, WIDTH) / 2)
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)])
        if kept == "attribute":
            self.w_t = self.w.t()
        elif kept == "buffer":
            self.register_buffer("first_row", self.w.detach()[0])
        elif kept == "listed":
            self.views = [self.w.detach()[1:]]
        elif kept == "copy":
            self.w_t = self.w.detach().t().clone()
        elif kept == "tied through data":
            self.blocks[1].weight.data = self.blocks[0].weight.data
        elif kept == "tied":
            self.blocks[1].weight = self.blocks[0].weight

    def forward(self, x, y):
        h = torch.tanh(x @ self.w.t())
        for block in self.blocks:
            h = torch.tanh(block(h))
        return (h - y).square().mean()


class CutFromOne(nn.Module):
    """Two parameters over one tensor's memory, side by side (no element shared)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        whole = torch.randn(2 * WIDTH * WIDTH) / 2
        self.a = nn.Parameter(whole[:WIDTH * WIDTH].view(WIDTH, WIDTH))
        self.b = nn.Parameter(whole[WIDTH * WIDTH:].view(WIDTH, WIDTH))
        self.blocks = nn.ModuleList([nn.Linear(WIDTH, WIDTH)])

    def forward(self, x, y):
        return (torch.tanh(self.blocks[0](torch.tanh(x @ self.a) @ self.b)) - y).square().mean()


def _batches():
    g = torch.Generator().manual_seed(2)
    return [{"x": torch.randn(BATCH, WIDTH, generator=g), "y": torch.randn(BATCH, WIDTH, generator=g)}
            for _ in range(STEPS)]


def _wrap(model, stage):
    config = make_config(zero={"stage": stage}, batch={"micro_batch_size": BATCH})
    return tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel))


@pytest.mark.parametrize("stage", [0, 3])
@pytest.mark.parametrize("kept, named", [
    ("attribute", r"attribute 'w_t' views the memory of parameter 'w'"),
    ("buffer", r"buffer 'first_row' views the memory of parameter 'w'"),
    ("listed", r"attribute 'views\[0\]' views the memory of parameter 'w'"),
    ("tied through data", r"parameters 'blocks\.0\.weight' and 'blocks\.1\.weight' share memory"),
])
def test_a_tensor_over_a_parameters_memory_is_refused_naming_both(kept, named, stage):
    model = Model(kept)
    with pytest.raises(ConfigError, match=named + r".*would keep reading its initial values.*"
                                                  r"b\.weight = a\.weight.*compute views of a parameter in forward"):
        _wrap(model, stage)
    assert all(type(p) is nn.Parameter for p in model.parameters()), "the refused model is left as it was"


@pytest.mark.parametrize("kept", ["copy", "tied"])
def test_a_copy_or_a_tie_as_one_parameter_is_accepted(kept):
    _wrap(Model(kept), 3).close()


def test_parameters_cut_from_one_tensor_without_overlap_train_as_in_one_process():
    config = make_config(zero={"stage": 3}, batch={"micro_batch_size": BATCH})
    oracle = Oracle.run(lambda model: reference_train(model, config, _batches()), CutFromOne())
    losses, params, engine = engine_train(0, 1, CutFromOne(), config, _batches())
    engine.close()
    oracle.check(losses, params, "parameters cut from one tensor")
