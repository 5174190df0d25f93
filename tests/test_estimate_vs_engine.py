"""The estimator must not drift from the engine.

:mod:`tiertrain.estimate.peak` re-derives by hand what tiertrain's engine allocates
(``zero/flat.py``'s flat buffers, ``zero/reducer.py``, the update forms of ``update/`` and
``update/nvme/optimizer.py``). This file specifies that the two agree, to the byte, wherever
both count the same thing. A tiny GPT (sizes that need padding) trains two real steps on 2
gloo ranks under each configuration of :data:`CASES` — every ZeRO stage 0–3, the stage-1/2
post-step parameter all-gather with and without ``zero.overlap_param_gather``, optimizer and
parameters on the CPU tier, and on NVMe — and then:

* per rank, ``engine.memory_report()``'s model states — parameters (compute dtype), fp32
  gradients, optimizer (fp32 masters + Adam moments) — equal
  :func:`~tiertrain.estimate.peak.simulate_peak`'s, rank by rank (ranks differ by the
  padding of the last shard), and their split by tier (``cpu_tier``, ``nvme_tier``, the rest
  on the device) equals the tiers the estimator gives those states;
* the estimate's model-state lines (what ``tiertrain estimate`` and the planner read), from
  :meth:`ZeroLayout.from_config` of the very Config the engine ran, hold the largest rank's
  bytes, in the same tiers;
* stage 3: the most parameter bytes the engine held gathered at once
  (``FlatParameters.peak_gathered_bytes``) equal the estimator's model-state working memory
  (:func:`~tiertrain.estimate.units.stage3_gathered_bytes`), and nothing stays gathered
  between steps;
* activation checkpoints: the engine's peak of saved block inputs (and its CPU-tier share),
  plus the outputs selective recomputation keeps, equals the estimator's checkpoint bytes.

So a change to the engine's persistent buffers that the estimator does not follow fails
here. The transient buffers (buckets and reductions in flight, activations) are not
compared: the engine does not account them; they are checked against measured peaks in
bench/results/estimate_accuracy.md.
"""
from __future__ import annotations

import pytest

from tiertrain.estimate import ModelDims, ZeroLayout, estimate
from tiertrain.tiers import Tier

TINY_GPT = dict(n_layers=2, hidden=40, n_heads=2, seq_len=24, vocab_size=100)
"""Units padded to 2·64 elements: the last shard holds padding (no Adam state off NVMe)."""

MICRO_BATCH = 2

CASES = {
    "stage0": ["--zero.stage=0"],
    "stage1 buckets": ["--zero.stage=1", "--zero.bucket_mb=0.01"],
    "stage1 bf16 overlapped gather": ["--zero.stage=1", "--precision.dtype=bf16", "--zero.overlap_param_gather=true"],
    "stage2 bf16": ["--zero.stage=2", "--precision.dtype=bf16"],
    "stage2 buckets overlapped gather": ["--zero.stage=2", "--zero.bucket_mb=0.01",
                                         "--zero.overlap_param_gather=true"],
    "stage2 optimizer on cpu": ["--zero.stage=2", "--zero.offload_optimizer=cpu"],
    "stage2 bf16 optimizer on nvme": ["--zero.stage=2", "--precision.dtype=bf16", "--zero.offload_optimizer=nvme"],
    "stage2 checkpoints on cpu": ["--zero.stage=2", "--activations.checkpoint_every=1",
                                  "--activations.offload=cpu"],
    "stage3": ["--zero.stage=3"],
    "stage3 fp32 all on cpu": ["--zero.stage=3", "--zero.offload_optimizer=cpu", "--zero.offload_params=cpu"],
    "stage3 bf16 all on cpu": ["--zero.stage=3", "--precision.dtype=bf16", "--zero.offload_optimizer=cpu",
                               "--zero.offload_params=cpu"],
    "stage3 bf16 all on nvme": ["--zero.stage=3", "--precision.dtype=bf16", "--zero.offload_optimizer=nvme",
                                "--zero.offload_params=nvme"],
    # fp32 shards on NVMe are the optimizer's masters: one copy, counted with the parameters
    "stage3 fp32 all on nvme": ["--zero.stage=3", "--precision.dtype=fp32", "--zero.offload_optimizer=nvme",
                                "--zero.offload_params=nvme"],
    "stage3 checkpoints": ["--zero.stage=3", "--activations.checkpoint_every=1"],
    "stage3 selective checkpoints on cpu": ["--zero.stage=3", "--activations.checkpoint_every=1",
                                            "--activations.offload=cpu", "--activations.recompute=selective"],
}
"""Name -> config overrides (an NVMe case gets ``zero.nvme_path`` under pytest's tmp_path)."""

MODEL_STATE_LINES = ("parameters", "gradients", "master weights", "optimizer states")


def _config(name: str, swap_dir: str):
    from tiertrain.config import Config, load

    overrides = list(CASES[name])
    if any("nvme" in o for o in overrides):
        overrides.append(f"--zero.nvme_path={swap_dir}/{name.replace(' ', '_')}")
    return load(Config, None, [f"--batch.micro_batch_size={MICRO_BATCH}", *overrides])


def _train_every_case(rank, world, swap_dir):
    """On this rank, for each case: wrap a fresh tiny GPT, train two steps (the second in the
    steady state: Adam moments exist, gradients lazily zeroed), report, close."""
    import torch

    from tiertrain.models.gpt import GPT, GPTConfig
    from tiertrain.offload.activations import apply_activation_checkpointing
    from tiertrain.topology import Topology
    from tiertrain.wrapping import wrap

    g = GPTConfig(**TINY_GPT)
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for name in CASES:
        cfg = _config(name, swap_dir)
        topo = Topology.build(cfg.parallel)
        torch.manual_seed(0)
        model = GPT(g)
        if cfg.activations.checkpoint_every:
            apply_activation_checkpointing(model, cfg.activations, device=topo.device)
        engine = wrap(model, cfg, topo)
        try:
            for _ in range(2):
                ids = torch.randint(0, g.vocab_size, (MICRO_BATCH, g.seq_len), generator=gen)
                engine.train_batch(iter([{"input_ids": ids, "labels": ids.roll(-1, 1)}]))  # (next-token labels)
            r = engine.memory_report()
            out[name] = {"params": r.params, "gathered_params": r.gathered_params, "grads": r.grads,
                         "optimizer": r.optimizer, "cpu_tier": r.cpu_tier, "nvme_tier": r.nvme_tier,
                         "peak_gathered": engine.flat.peak_gathered_bytes,
                         "checkpoints": r.activation_checkpoints, "checkpoints_cpu": r.activation_checkpoints_cpu}
        finally:
            engine.close()
    return out


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """{case: [rank 0's report, rank 1's]}: every case in one 2-rank run (one process start)."""
    from tiertrain.testing import run_distributed

    swap = tmp_path_factory.mktemp("swap")
    per_rank = run_distributed(_train_every_case, 2, str(swap), timeout=90)
    return {name: [r[name] for r in per_rank] for name in CASES}


def _dims() -> ModelDims:
    from tiertrain.models.gpt import GPTConfig

    return ModelDims.from_gpt_config(GPTConfig(**TINY_GPT))


def _predicted(name: str, rank: int):
    """(layout, simulate_peak's breakdown for this rank) of a case, from its Config."""
    from tiertrain.estimate.peak import simulate_peak
    from tiertrain.estimate.units import gpt_meta_model
    from tiertrain.estimate.lines import PRECISION_BYTES

    lay = ZeroLayout.from_config(_config(name, "/unused"), 2)
    pk = simulate_peak(gpt_meta_model(_dims()), dp=lay.dp, stage=lay.stage,
                       precision_bytes=PRECISION_BYTES[lay.precision], param_tier=lay.param_tier,
                       optimizer_tier=lay.optimizer_tier, bucket_mb=lay.bucket_mb,
                       persistence_threshold=lay.persistence_threshold, backend=lay.backend, rank=rank)
    return lay, pk


def _engine_by_tier(rep: dict) -> dict[Tier, int]:
    states = rep["params"] + rep["grads"] + rep["optimizer"]  # (gathered parameters are transient)
    return {Tier.DEVICE: states - rep["cpu_tier"] - rep["nvme_tier"], Tier.CPU: rep["cpu_tier"],
            Tier.NVME: rep["nvme_tier"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_model_states_equal_the_engines_rank_by_rank(reports, name):
    for rank, rep in enumerate(reports[name]):
        _, pk = _predicted(name, rank)
        predicted = {"params": pk.params, "grads": pk.grads, "optimizer": pk.master + pk.moments}
        assert predicted == {k: rep[k] for k in predicted}, f"rank {rank}"
        by_tier = dict.fromkeys(Tier, 0)
        for tier, nbytes in ((pk.param_tier, pk.params), (pk.grad_tier, pk.grads),
                             (pk.optimizer_tier, pk.master + pk.moments)):
            by_tier[tier] += nbytes
        assert by_tier == _engine_by_tier(rep), f"rank {rank}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", list(CASES))
def test_the_estimates_model_state_lines_are_the_largest_ranks(reports, name):
    lay, _ = _predicted(name, 0)
    est = estimate(_dims(), lay)
    lines = {l.name: l for l in est.lines if l.name in MODEL_STATE_LINES}
    assert set(lines) == set(MODEL_STATE_LINES)
    reps = reports[name]
    assert lines["parameters"].bytes == max(r["params"] for r in reps)
    assert lines["gradients"].bytes == max(r["grads"] for r in reps)
    assert lines["master weights"].bytes + lines["optimizer states"].bytes == max(r["optimizer"] for r in reps)
    by_tier = dict.fromkeys(Tier, 0)
    for line in lines.values():
        assert isinstance(line.tier, Tier)
        by_tier[line.tier] += line.bytes
    largest = max(reps, key=lambda r: r["optimizer"])
    assert by_tier == _engine_by_tier(largest)
    assert lay.grad_tier is lines["gradients"].tier


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [n for n in CASES if n.startswith("stage3")])
def test_stage3_gathered_parameters_are_the_model_state_working_memory(reports, name):
    from tiertrain.estimate.units import gpt_meta_model, stage3_gathered_bytes
    from tiertrain.estimate.lines import PRECISION_BYTES

    lay = ZeroLayout.from_config(_config(name, "/unused"), 2)
    mswm = stage3_gathered_bytes(gpt_meta_model(_dims()), PRECISION_BYTES[lay.precision], lay.dp,
                                 lay.persistence_threshold)
    for rep in reports[name]:
        assert rep["peak_gathered"] == mswm
        assert rep["gathered_params"] == 0  # released after backward; nothing prefetched (CPU default)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", [n for n in CASES if "checkpoints" in n])
def test_activation_checkpoints_equal_the_engines(reports, name):
    from tiertrain.estimate.lines import PRECISION_BYTES
    from tiertrain.estimate.activations import gpt_activation_bytes

    lay = ZeroLayout.from_config(_config(name, "/unused"), 2)
    dims = _dims()
    n_checkpoints = len(range(0, dims.n_layers, lay.checkpoint_interval))
    acts = gpt_activation_bytes(dims, lay.micro_batch, PRECISION_BYTES[lay.precision])
    inputs = acts.checkpoint * n_checkpoints
    kept = acts.kept_at(0) * n_checkpoints if lay.recompute == "selective" else 0  # (on the device)
    est = estimate(dims, lay)
    assert est.line("activation checkpoints").tier is lay.checkpoint_tier
    for rep in reports[name]:
        assert rep["checkpoints"] == inputs + kept
        assert rep["checkpoints_cpu"] == (inputs if lay.checkpoint_tier is Tier.CPU else 0)
