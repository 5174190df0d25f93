"""``torch.compile`` with the engine: each block's forward compiled before ``wrap()``
(``tiertrain.compile_blocks``, docs/compile.md).

Specification, on 2 gloo ranks, for tiertrain's GPT at ZeRO stages 0–3 and a Hugging Face
Llama at stage 3, with and without activation checkpointing (whole-block and selective):

1. No graph break inside a block: every call of a block runs exactly one compiled graph (a
   break would run two or more), the recomputation of a checkpointed block one more.
2. No recompilation: the blocks compile in the first step (at stage 3, whose first forward is
   recorded eagerly under the parameter-use check, in the second step's forward or the first
   step's recomputation), and no later step compiles a graph.
3. Numerics: the compiled run trains bit for bit as the same engine uncompiled (the counting
   backend runs the captured graphs as they are; the uncompiled engine equals single-process
   PyTorch within the float64 oracle's bound elsewhere in the suite).

The graphs are counted by a backend of our own (the public ``backend=`` argument of
``torch.compile``) that runs each captured graph unchanged.
"""
from __future__ import annotations

import pytest
import torch

from tiertrain.testing import run_distributed

STEPS = 4

CASES = [  # (model, zero stage, activations)
    ("gpt", 0, {}), ("gpt", 1, {}), ("gpt", 2, {}), ("gpt", 3, {}),
    ("gpt", 3, {"checkpoint_every": 1}), ("gpt", 3, {"checkpoint_every": 1, "recompute": "selective"}),
    ("llama", 3, {}), ("llama", 3, {"checkpoint_every": 1, "recompute": "selective"}),
]


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given and the runs of each."""

    def __init__(self):
        self.graphs = 0
        self.runs = 0

    def __call__(self, graph_module, example_inputs):
        self.graphs += 1

        def run(*args):
            self.runs += 1
            return graph_module.forward(*args)
        return run


def _model(name: str):
    from reference import make_model

    if name == "gpt":
        model = make_model()
        return model, model.blocks
    import zoo

    model = zoo.build("llama-gqa")
    return model, model.model.layers


def _batches(name: str):
    from reference import global_batches

    if name == "gpt":
        return global_batches(STEPS, 4)
    import zoo

    return zoo.batches("llama-gqa", STEPS, 4)


def _train(rank, world, name, stage, activations, backend):
    import tiertrain
    from reference import make_config, rank_slices

    model, blocks = _model(name)
    if backend is not None:
        assert len(tiertrain.compile_blocks(model, backend=backend)) == len(blocks)  # (each layer of the stack)
    cfg = make_config(zero={"stage": stage}, activations=activations,
                      batch={"micro_batch_size": 2, "grad_accum_steps": 1}, optimizer={"eps": 1e-3})
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    per_step, losses = [], []
    for batch in _batches(name):
        graphs, runs = (backend.graphs, backend.runs) if backend else (0, 0)
        losses.append(engine.train_batch(rank_slices(batch, rank, world, 2, 1)))
        if backend:
            per_step.append((backend.graphs - graphs, backend.runs - runs))
    params = engine.full_state_dict()
    engine.close()
    return losses, params, per_step, len(blocks)


def _every_case(rank, world):
    out = []
    for name, stage, activations in CASES:
        torch._dynamo.reset()  # (each case compiles from nothing)
        eager = _train(rank, world, name, stage, activations, None)
        compiled = _train(rank, world, name, stage, activations, CountingBackend())
        out.append((eager, compiled))
    return out


@pytest.mark.timeout(240)
def test_compiled_blocks_run_one_graph_per_call_compile_once_and_train_as_eager():
    for by_case in run_distributed(_every_case, 2, timeout=230):
        for (name, stage, activations), (eager, compiled) in zip(CASES, by_case, strict=True):
            case = (name, stage, activations)
            losses, params, per_step, n_blocks = compiled
            assert losses == eager[0], case
            assert all(torch.equal(params[n], eager[1][n]) for n in eager[1]), case
            # compiled in the first step, or at stage 3 (whose first forward is recorded
            # eagerly) the second; after that nothing compiles and each block call runs one graph
            first = next(i for i, (graphs, _) in enumerate(per_step) if graphs)
            assert first <= (1 if stage == 3 else 0), (case, per_step)
            calls = n_blocks * (2 if activations else 1)  # (a checkpointed block runs again in backward)
            assert all(step == (0, calls) for step in per_step[first + 1:]), (case, per_step)
