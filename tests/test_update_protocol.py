"""The optimizer step is a protocol (tiertrain/update/protocol.py): a form written outside the
library plugs into the engine through ``update_factory`` with no edit to the engine, and the
engine never branches on which form it holds.

The fifth form here is plain SGD with momentum over the flat master shards, written in this
file. It trains under ZeRO stages 1-3 on 2 ranks (and through a pipeline) exactly like
``torch.optim.SGD`` on one process (float64 oracle of tests/reference.py), and checkpoints
through the same parts as the built-in forms.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import tiertrain
from reference import Oracle, engine_train, global_batches, make_config, make_model, rank_slices, reference_train
from tiertrain.testing import run_distributed
from tiertrain.update import OptimizerUpdate, UpdateMemory, restore_masters, scale_gradients, shard_param_groups

LR, MOMENTUM, STEPS, MICRO = 0.5, 0.9, 4, 2


class SGDUpdate(OptimizerUpdate):
    """SGD with momentum over this rank's master shards, at the schedule's rate."""

    def __init__(self, context):
        super().__init__(context.flat, context.config, context.lazy_zero)
        groups = shard_param_groups(self.flat, [u.master for u in self.flat.units],
                                    [u.grad for u in self.flat.units], weight_decay=0.0)
        self.optimizer = torch.optim.SGD(groups, lr=LR, momentum=MOMENTUM)
        self.steps_seen = []

    def step(self, grads, clip, lr, step):
        scale_gradients(grads, clip)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        self.steps_seen.append(step)
        self.publish_and_reset()

    def masters(self):
        return [u.master for u in self.flat.units]

    def memory(self):
        momentum = sum(s["momentum_buffer"].numel() * 4 for s in self.optimizer.state.values()
                       if s.get("momentum_buffer") is not None)
        return UpdateMemory(optimizer=momentum)

    def state_dict(self):
        return {"masters": [u.master.detach().clone() for u in self.flat.units],
                "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state):
        restore_masters(self.flat, self.optimizer, state)


def torch_sgd(model):
    """The single-process reference's optimizer: torch SGD with momentum over every parameter."""
    return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


def _config(stage, pp=1):
    return make_config(zero={"stage": stage, "bucket_mb": 0.02}, parallel={"pp": pp},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": 2 if pp > 1 else 1},
                       optimizer={"grad_clip": 0.05, "lr": LR})


def _run(rank, world, stage, pp, checkpoint_dir):
    cfg = _config(stage, pp)
    original = tiertrain.wrap
    tiertrain.wrap = lambda *a, **k: original(*a, update_factory=SGDUpdate, **k)
    try:
        losses, params, engine = engine_train(rank, world, make_model(n_layers=4), cfg,
                                              global_batches(STEPS, MICRO * (2 if pp > 1 else world)))
    finally:
        tiertrain.wrap = original
    assert isinstance(engine.update, SGDUpdate) and engine.update.steps_seen == list(range(STEPS))
    assert engine.memory_report().optimizer > 0
    # Its state goes through the checkpoint parts like any form's.
    saved = engine.save_checkpoint(checkpoint_dir)
    before = engine.full_state_dict()
    dp, accum = engine.topology.size("dp"), cfg.batch.grad_accum_steps
    batch = global_batches(1, MICRO * dp * accum, seed=9)[0]
    engine.train_batch(rank_slices(batch, engine.topology.coord("dp"), dp, MICRO, accum))
    moved = engine.full_state_dict()
    assert any(not torch.equal(before[n], v) for n, v in moved.items()), "the extra step changed nothing"
    engine.load_checkpoint(checkpoint_dir)
    assert all(torch.equal(before[n], v) for n, v in engine.full_state_dict().items()), saved
    params.pop("head.weight", None)  # a pipeline's last stage holds the tied copy
    return losses, params


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stage,pp", [(1, 1), (2, 1), (3, 1), (1, 2)])
def test_a_form_written_outside_the_library_trains_like_torch_sgd(stage, pp, tmp_path):
    results = run_distributed(_run, 2, stage, pp, str(tmp_path), timeout=100)
    oracle = Oracle.run(reference_train, make_model(n_layers=4), _config(stage, pp),
                        global_batches(STEPS, MICRO * 2), build_optimizer=torch_sgd)
    assert oracle.losses64[-1] < oracle.losses64[0], "the reference itself must learn"
    merged = {}
    for losses, params in results:
        oracle.check(losses, None, f"SGD form, stage {stage}, pp={pp}: losses")
        merged.update(params)
    assert set(merged) == set(oracle.params64)
    oracle.check(None, merged, f"SGD form, stage {stage}, pp={pp}: parameters")


def test_the_engine_does_not_branch_on_the_form():
    """engine.py and the training core it is built on name no form: they import only the
    protocol's factory and never ask which form they hold (no isinstance against a form, no
    attribute only one form has)."""
    import tiertrain.training_core

    source = "\n".join(Path(m.__file__).read_text() for m in (tiertrain.engine, tiertrain.training_core))
    tree = ast.parse(source)
    forms = {"InMemoryUpdate", "NVMeUpdate", "OverlappedNVMeUpdate", "DelayedUpdate", "NVMeAdamW"}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
    assert not names & forms, sorted(names & forms)
    for attribute in ("nvme_optimizer", "delayed", "_overlapped_step", "_lr_source"):
        assert f".{attribute}" not in source, attribute
