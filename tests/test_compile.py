"""``torch.compile`` with the engine, in every form users write it (docs/compile.md):
``tiertrain.compile_blocks(model)``, ``block.compile()``, ``torch.compile(block)`` wrappers,
``torch.compile(model)`` and ``model.compile()``.

Specification, on 2 gloo ranks, for tiertrain's GPT (4 blocks) at ZeRO stages 0–3 and a Hugging
Face Llama at stage 3, with and without activation checkpointing (whole-block and selective):

1. No graph break inside a block: every call of a block runs exactly one compiled graph (a
   break would run two or more), the recomputation of a checkpointed block one more; a
   compiled model runs a few more for the code around its blocks (the engine's hooks at the
   blocks' edges run eagerly between them: :data:`AROUND`), or one graph for all where there
   are none.
2. No recompilation: the graphs compile in the first step (at stage 3, whose first forward is
   recorded eagerly under the parameter-use check, in the first two), and no later step
   compiles one.
3. The model's own names: parameters keep their names (a wrapper's ``_orig_mod`` is not in
   them), so checkpoints and exports are those of the uncompiled model.
4. Numerics: the compiled run trains bit for bit as the same engine uncompiled (the counting
   backend runs the captured graphs as they are; the uncompiled engine equals single-process
   PyTorch within the float64 oracle's bound elsewhere in the suite).
5. Evaluation between steps (the model called directly under ``torch.no_grad()``, which at
   stage 3 gathers its units outside the engine) gives the uncompiled model's logits, and the
   next training step compiles nothing again.
6. ``.compile()`` of a module whose blocks are checkpointed is refused, naming the block and the
   fix: torch's checkpoint would run the block outside the compiled call, silently eagerly.

The graphs are counted by a backend of our own (the public ``backend=`` argument of
``torch.compile``) that runs each captured graph unchanged.
"""
from __future__ import annotations

import pytest
import torch

from tiertrain.config import ConfigError
from tiertrain.testing import run_distributed

STEPS = 4
WHOLE, SELECTIVE = {"checkpoint_every": 1}, {"checkpoint_every": 1, "recompute": "selective"}
AROUND = {"gpt": 2, "llama": 3}
"""Graphs a compiled model runs besides its blocks' at stage 3, where the engine's hooks at each
block's edges run eagerly: the code before the blocks and after them (and, in the Llama, the
resumed loop between its layers). A graph break inside each block would add one per block."""
BLOCK_FORMS = ("compile_blocks", "block.compile()", "torch.compile(block)")
MODEL_FORMS = ("torch.compile(model)", "model.compile()")

CASES = [  # (model, zero stage, activations, form)
    ("gpt", 0, {}, "compile_blocks"), ("gpt", 0, {}, "torch.compile(model)"),
    ("gpt", 2, {}, "block.compile()"), ("gpt", 2, {}, "torch.compile(block)"),
    *[("gpt", 3, {}, form) for form in BLOCK_FORMS + MODEL_FORMS],
    ("gpt", 3, WHOLE, "compile_blocks"), ("gpt", 3, WHOLE, "torch.compile(block)"),
    ("gpt", 3, WHOLE, "torch.compile(model)"), ("gpt", 3, SELECTIVE, "compile_blocks"),
    ("llama", 3, {}, "compile_blocks"), ("llama", 3, {}, "block.compile()"), ("llama", 3, {}, "torch.compile(model)"),
    ("llama", 3, SELECTIVE, "torch.compile(block)"),
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
        model = make_model(n_layers=4)
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


def compiled(model, blocks, form: str, backend):
    """model compiled in the given form."""
    import tiertrain

    if form == "compile_blocks":
        assert len(tiertrain.compile_blocks(model, backend=backend)) == len(blocks)  # (each layer of the stack)
    elif form == "block.compile()":
        for block in blocks:
            block.compile(backend=backend)
    elif form == "torch.compile(block)":
        for i, block in enumerate(blocks):
            blocks[i] = torch.compile(block, backend=backend)
    elif form == "torch.compile(model)":
        return torch.compile(model, backend=backend)
    else:
        model.compile(backend=backend)
    return model


def _train(rank, world, name, stage, activations, form, backend):
    import tiertrain
    from reference import make_config, rank_slices

    model, blocks = _model(name)
    n_blocks = len(blocks)
    if backend is not None:
        model = compiled(model, blocks, form, backend)
    cfg = make_config(zero={"stage": stage}, activations=activations,
                      batch={"micro_batch_size": 2, "grad_accum_steps": 1}, optimizer={"eps": 1e-3})
    engine = tiertrain.wrap(model, cfg, tiertrain.Topology.build(cfg.parallel))
    per_step, losses, evaluated = [], [], []
    for batch in _batches(name):
        graphs, runs = (backend.graphs, backend.runs) if backend else (0, 0)
        mine = list(rank_slices(batch, rank, world, 2, 1))
        losses.append(engine.train_batch(iter(mine)))
        if backend:
            per_step.append((backend.graphs - graphs, backend.runs - runs))
        with torch.no_grad():
            out = model(input_ids=torch.cat([b["input_ids"] for b in mine]))
        evaluated.append(out if isinstance(out, torch.Tensor) else out.logits)
    params = engine.full_state_dict()
    engine.close()
    return (losses, evaluated), params, per_step, n_blocks


def _every_case(rank, world):
    eager, out = {}, []
    for name, stage, activations, form in CASES:
        key = (name, stage, str(activations))
        if key not in eager:
            eager[key] = _train(rank, world, name, stage, activations, form, None)
        torch._dynamo.reset()  # (each case compiles from nothing)
        out.append((eager[key], _train(rank, world, name, stage, activations, form, CountingBackend())))
    return out


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_every_form_runs_one_graph_per_block_call_compiles_once_and_trains_as_eager():
    for by_case in run_distributed(_every_case, 2, timeout=290):
        for case, (eager, compiled_run) in zip(CASES, by_case, strict=True):
            name, stage, activations, form = case
            losses, params, per_step, n_blocks = compiled_run
            assert losses[0] == eager[0][0], case
            assert all(torch.equal(a, b) for a, b in zip(losses[1], eager[0][1], strict=True)), case  # (evaluation)
            assert params.keys() == eager[1].keys(), case  # (no _orig_mod in the names)
            assert all(torch.equal(params[n], eager[1][n]) for n in params), case
            settled = 2 if stage == 3 else 1  # (stage 3 records its first forward eagerly)
            assert sum(graphs for graphs, _ in per_step[:settled]) > 0, (case, per_step)
            assert all(graphs == 0 for graphs, _ in per_step[settled:]), (case, per_step)  # no recompiles
            calls = n_blocks * (2 if activations else 1)  # (a checkpointed block runs again in backward)
            runs = [r for _, r in per_step[settled:]]
            if form in MODEL_FORMS:  # one graph per block call and the code around them, or one in all
                assert all(r <= calls + AROUND[name] for r in runs), (case, per_step)  # (no hooks below stage 3)
            else:
                assert all(r == calls for r in runs), (case, per_step)


def test_compiling_a_module_with_compile_above_checkpointed_blocks_is_refused():
    from reference import make_model

    from tiertrain.config import ActivationConfig
    from tiertrain.offload.activations import apply_activation_checkpointing

    for compile_it in (lambda m: m.blocks[1].compile(), lambda m: m.compile()):
        model = make_model()
        compile_it(model)
        with pytest.raises(ConfigError, match=r"activation checkpointing of block 'blocks\.[01]'.*compiled with "
                                               r"\.compile\(\).*tiertrain\.compile_blocks"):
            apply_activation_checkpointing(model, ActivationConfig(checkpoint_every=1))
