"""Your own optimizer and schedule under pipeline parallelism: ``tiertrain.wrap(model, config,
topology, optimizer=..., param_groups=..., lr_scheduler=...)`` with ``parallel.pp > 1``.

The groups name the whole model's parameters (or hold its tensors, for an instance built on
``model.parameters()``), as at pp = 1; each pipeline rank trains its stages' share of every
group, and the last stage's copy of a tied embedding is updated in the embedding's group, so the
two stay equal. Every case trains on 2 gloo ranks (pp = 2, or dp = 2 × pp = 2 on 4) and is
checked against the single-process PyTorch reference with the same torch optimizer and
scheduler, through the float64 oracle of tests/reference.py; names that are not the model's
are refused by name before anything is built.
"""
from __future__ import annotations

import functools

import pytest
import torch

import tiertrain
from reference import (Oracle, engine_train, global_batches, make_config, make_model, rank_slices, reference_train,
                       tp_gathered)
from tiertrain.testing import RankFailure, run_distributed

LAYERS, MICRO, ACCUM, STEPS = 4, 2, 4, 3
lr_sched = torch.optim.lr_scheduler


def _groups(model, by_name=True):
    """Three groups: the model's second parameter alone (a position embedding or the first
    block's first matrix, on the first pipeline stage only: the group is empty on the other
    rank), the other matrices decayed, biases and norm gains not."""
    pick = (lambda n, p: n) if by_name else (lambda n, p: p)
    named = list(model.named_parameters())
    alone = named[1][0]
    return [{"params": [pick(n, p) for n, p in named if n == alone], "lr": 0.05},
            {"params": [pick(n, p) for n, p in named if p.dim() >= 2 and n != alone], "lr": 0.3,
             "weight_decay": 0.01},
            {"params": [pick(n, p) for n, p in named if p.dim() < 2], "lr": 0.1, "weight_decay": 0.0}]


def _by_tensors(model, groups):
    params = dict(model.named_parameters())
    return [{**g, "params": [params[n] for n in g["params"]]} for g in groups]


SGD = functools.partial(torch.optim.SGD, momentum=0.9)
STEP_LR = functools.partial(lr_sched.StepLR, step_size=1, gamma=0.7)


def _per_group(optimizer):  # (one rate function per group: group k must be the user's k-th on every rank)
    return lr_sched.LambdaLR(optimizer, [lambda s: 2.0 ** s, lambda s: 1.0 / (1 + s), lambda s: 0.5 ** s])


def _adamw_instance(model):
    return torch.optim.AdamW(_groups(model, by_name=False), lr=1e-2, betas=(0.9, 0.95), eps=1e-3)


def _hidden(model):
    """Muon's parameters, as its documentation asks: the hidden matrices (not the embeddings)."""
    return [n for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n]


MUON = functools.partial(torch.optim.Muon, lr=0.02)
ADAMW = functools.partial(torch.optim.AdamW, lr=1e-2, eps=1e-3)


def _muon_and_adamw(model):
    hidden = _hidden(model)
    return [(MUON, [{"params": hidden}]),
            (ADAMW, [{"params": [n for n, _ in model.named_parameters() if n not in hidden]}])]


class _Together:
    """Plain PyTorch's two optimizers over disjoint parameters, stepped one after the other."""

    def __init__(self, model):
        self.parts = [build(_by_tensors(model, groups)) for build, groups in _muon_and_adamw(model)]

    def step(self):
        for part in self.parts:
            part.step()

    def zero_grad(self, set_to_none=True):
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)


CASES = {
    # name: (wrap arguments from the model, reference optimizer from the model, reference scheduler)
    "sgd-groups-by-name": (lambda m: dict(optimizer=SGD, param_groups=_groups(m), lr_scheduler=STEP_LR),
                           lambda m: SGD(_by_tensors(m, _groups(m))), STEP_LR),
    "adamw-instance": (lambda m: dict(optimizer=_adamw_instance(m), lr_scheduler=_per_group),
                       _adamw_instance, _per_group),
    "config-adamw-own-schedule": (lambda m: dict(lr_scheduler=STEP_LR), None, STEP_LR),
    "muon-and-adamw": (lambda m: dict(optimizer=_muon_and_adamw(m)), _Together, None),
}
RUNS = [("sgd-groups-by-name", 1, "1f1b", 1, "gpt"), ("sgd-groups-by-name", 3, "interleaved", 2, "gpt"),
        ("adamw-instance", 2, "1f1b", 1, "gpt"), ("adamw-instance", 3, "1f1b", 1, "gpt"),
        ("config-adamw-own-schedule", 2, "interleaved", 2, "gpt"),
        ("sgd-groups-by-name", 2, "1f1b", 1, "gpt2"), ("adamw-instance", 1, "interleaved", 2, "llama")]
"""(case, zero stage, schedule, virtual stages, model: tiertrain's GPT or a Hugging Face one,
tests/hf_pipeline_models.py)."""
TIED = {"gpt": ("embed.weight", "head.weight"), "gpt2": ("transformer.wte.weight", "lm_head.weight")}


def _model(name):
    if name == "gpt":
        return make_model(n_layers=LAYERS)
    import hf_pipeline_models
    return getattr(hf_pipeline_models, name)()


def _batches(name, dp):
    batches = global_batches(STEPS, MICRO * ACCUM * dp)
    if name == "gpt":
        return batches
    from hf_pipeline_models import hf_convention
    return hf_convention(batches)


def _config(stage, schedule="1f1b", v=1, dp=1, pp=2, tier="none", nvme_path=""):
    tiers = {"offload_optimizer": tier, "offload_params": tier if stage == 3 else "none", "nvme_path": nvme_path}
    return make_config(zero={"stage": stage, "bucket_mb": 0.02, **tiers},
                       parallel={"dp": dp, "pp": pp, "schedule": schedule, "virtual_stages": v},
                       batch={"micro_batch_size": MICRO, "grad_accum_steps": ACCUM},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _run(rank, world, runs, dp, nvme_path=""):
    out = []
    for case, stage, schedule, v, name, *tier in runs:
        config = _config(stage, schedule, v, dp=dp, tier=tier[0] if tier else "none", nvme_path=nvme_path)
        losses, params, engine = engine_train(rank, world, _model(name), config,
                                              _batches(name, dp), wrap_kwargs=CASES[case][0])
        out.append((losses, tp_gathered(engine, params)))
        engine.close()
    return out


def _check(results, runs, dp=1):
    for k, (case, stage, schedule, v, name, *_) in enumerate(runs):
        _, build, scheduler = CASES[case]
        oracle = Oracle.run(reference_train, _model(name), _config(stage, pp=1), _batches(name, dp),
                            build_optimizer=build, lr_scheduler=scheduler)
        merged = {}
        for losses, params in (r[k] for r in results):
            oracle.check(losses, None, f"{runs[k]} losses")
            merged.update(params)
        if name in TIED:  # the last stage's copy of the tied embedding got the embedding's updates
            first, copy = TIED[name]
            assert torch.equal(merged.pop(copy), merged[first]), runs[k]
        assert set(merged) == set(oracle.params64)
        oracle.check(None, merged, f"{runs[k]} parameters")


@pytest.mark.timeout(150)
def test_a_pipeline_trains_like_the_same_torch_optimizer_and_scheduler():
    _check(run_distributed(_run, 2, RUNS, 1, timeout=140), RUNS)


FOUR_RANK_RUNS = [("sgd-groups-by-name", 3, "1f1b", 1, "gpt"), ("adamw-instance", 1, "interleaved", 2, "gpt"),
                  ("muon-and-adamw", 2, "1f1b", 1, "gpt"), ("muon-and-adamw", 3, "interleaved", 2, "gpt")]


@pytest.mark.timeout(150)
def test_with_data_parallelism_too():
    _check(run_distributed(_run, 4, FOUR_RANK_RUNS, 2, timeout=140), FOUR_RANK_RUNS, 2)


TIER_RUNS = [("sgd-groups-by-name", 2, "1f1b", 1, "gpt", "cpu"), ("adamw-instance", 3, "1f1b", 1, "gpt", "cpu"),
             ("muon-and-adamw", 2, "1f1b", 1, "gpt", "cpu"), ("config-adamw-own-schedule", 3, "1f1b", 1, "gpt", "nvme")]
"""(..., optimizer tier: parameters too at stage 3). The NVMe tier streams one rate for every
group (docs/optimizers.md): config AdamW under its own scheduler."""


@pytest.mark.timeout(150)
def test_on_the_cpu_and_nvme_tiers(tmp_path):
    _check(run_distributed(_run, 2, TIER_RUNS, 1, str(tmp_path), timeout=140), TIER_RUNS)


def _resume(rank, world, directory, resume):
    """SGD with momentum (its buffers) under StepLR (its count): 2 steps, a checkpoint, 2 more;
    or a model of other values loaded from that checkpoint for the last 2."""
    config = _config(3)
    model = make_model(seed=1 if resume else 0, n_layers=LAYERS)
    engine = tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), optimizer=SGD,
                            param_groups=_groups(model), lr_scheduler=STEP_LR)
    batches = global_batches(4, MICRO * ACCUM)
    if resume:
        engine.load_checkpoint(directory)
        batches = batches[2:]
    losses = []
    for batch in batches:
        losses.append(engine.train_batch(rank_slices(batch, 0, 1, MICRO, ACCUM)))
        if not resume and len(losses) == 2:
            engine.save_checkpoint(directory)
    return losses, engine.full_state_dict()


@pytest.mark.timeout(120)
def test_a_checkpoint_resumes_the_optimizer_and_scheduler_bit_for_bit(tmp_path):
    full = run_distributed(_resume, 2, str(tmp_path), False, timeout=50)
    resumed = run_distributed(_resume, 2, str(tmp_path), True, timeout=50)
    for (full_losses, full_params), (losses, params) in zip(full, resumed):
        assert losses == full_losses[2:]
        assert all(torch.equal(params[k], full_params[k]) for k in full_params)


def _bad(rank, world, what):
    config = _config(1)
    model = make_model(n_layers=LAYERS)
    groups = _groups(model)
    if what == "typo":
        groups[1]["params"][-1] += "x"
    elif what == "missing":  # (a parameter the other pipeline rank trains: still one of the model's)
        groups[2]["params"].remove("norm.weight")
    tiertrain.wrap(model, config, tiertrain.Topology.build(config.parallel), optimizer=SGD, param_groups=groups,
                   lr_scheduler=STEP_LR)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("what,message", [
    ("typo", r"names 'blocks\.3\.mlp\.fc2\.weightx', which is not a parameter of the model"),
    ("missing", r"trainable parameter 'norm\.weight' is in no group of param_groups"),
])
def test_groups_are_checked_against_the_whole_model_on_every_rank(what, message):
    with pytest.raises(RankFailure, match=message):
        run_distributed(_bad, 2, what, timeout=45)
