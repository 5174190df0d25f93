"""A DeepSpeed run whose optimizer is not Adam continues with its own state: the reader takes
whatever per-element state DeepSpeed's optimizer kept in its flat buffers (and its step, where it
counts one), and the engine's optimizer must keep the same (tiertrain/state/optimizer_state.py).

tests/deepspeed_checkpoints/z2_sgd_w2: DeepSpeed 0.19.8, ZeRO-2, bf16, 2 ranks, torch's SGD with
momentum 0.9 as its client optimizer (make.py); expected.pt holds each parameter's momentum as
DeepSpeed's own ``safe_get_full_optimizer_state`` gives it.
"""
from __future__ import annotations

import os

import pytest
import torch

import tiertrain
from tiertrain.errors import CheckpointError
from tiertrain.state.deepspeed_checkpoint import DeepSpeedCheckpoint
from tiertrain.testing import run_distributed
from tiertrain.update.protocol import SLOT_NAME

from deepspeed_models import build_llama
from foreign_runs import engine_config

pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(120)

RUN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "deepspeed_checkpoints", "z2_sgd_w2")


def _expected(directory: str = RUN) -> dict:
    return torch.load(os.path.join(directory, "expected.pt"), weights_only=True)


def check_read(directory: str) -> None:
    """The SGD run in directory holds the momentum expected.pt beside it holds, bit for bit."""
    saved, expected = DeepSpeedCheckpoint(directory), _expected(directory)
    assert saved.state_keys == ("momentum_buffer",) and not saved.counts_steps  # (SGD counts no step)
    for param, master in expected["masters"].items():
        assert torch.equal(saved.value(param), master.reshape(-1).float()), param
        want = expected["momentum_buffer"][param].reshape(-1).float()
        assert torch.equal(saved.value(param, "momentum_buffer"), want), param


def test_the_files_hold_the_momentum_deepspeeds_accessor_finds():
    check_read(RUN)


def _loaded(rank, world, stage, tier, directory):
    """An engine with SGD(momentum=0.9) loads the run: its momentum by parameter (this rank's
    pieces, with where they start), its values, its step count."""
    config = engine_config(stage, tier, world, directory)
    model = build_llama(seed=11)
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2, momentum=0.9)
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), optimizer=optimizer)
    client = engine.load_deepspeed_checkpoint(RUN)
    pieces = [(getattr(view, SLOT_NAME), state["momentum_buffer"].reshape(-1).clone())
              for view, state in engine.update.optimizer.state.items()]
    out = {"client": client, "steps": engine.steps, "pieces": pieces, "values": engine.full_state_dict()}
    engine.close()
    return out


@pytest.mark.parametrize("stage,tier,dp", [(2, "cpu", 1), (3, "none", 1), (1, "none", 2)])
def test_an_sgd_engine_holds_deepspeeds_momentum_bit_for_bit(stage, tier, dp, tmp_path):
    expected = _expected()
    results = run_distributed(_loaded, dp, stage, tier, str(tmp_path), timeout=90) if dp > 1 else \
        [_loaded(0, 1, stage, tier, str(tmp_path))]
    held: dict[str, int] = {}
    for out in results:
        assert out["client"] == {"epoch": 7} and out["steps"] == 3
        for param, value in {**expected["masters"], **expected["frozen"]}.items():
            assert torch.equal(out["values"][param], value.float()), param
        for param, piece in out["pieces"]:
            whole = expected["momentum_buffer"][param].reshape(-1).float()
            if piece.numel() == whole.numel():
                assert torch.equal(piece, whole), param
            else:  # (a rank's piece of the parameter: somewhere in it, bit for bit)
                assert any(torch.equal(piece, whole[a:a + piece.numel()])
                           for a in range(whole.numel() - piece.numel() + 1)), param
            held[param] = held.get(param, 0) + piece.numel()
    assert held == {n: v.numel() for n, v in expected["momentum_buffer"].items()}, "every element, once"


def test_an_adam_engine_is_refused_naming_both_optimizers_states(tmp_path):
    config = engine_config(2, "none", 1, str(tmp_path))
    engine = tiertrain.wrap(build_llama(seed=11), config, tiertrain.Topology.build(config.parallel))
    with pytest.raises(CheckpointError, match=r"\['momentum_buffer'\].*keeps \['exp_avg', 'exp_avg_sq', 'step'\]"):
        engine.load_deepspeed_checkpoint(RUN)
    engine.close()
