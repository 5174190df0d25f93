"""bitsandbytes' 8-bit optimizers train as in one process.

``AdamW8bit`` keeps its moments in 8 bits, quantised in blocks of 256 elements counted from
each tensor's first element (32-bit below ``min_8bit_size`` elements): its arithmetic depends on
where a tensor begins, so stepping ZeRO's flat shards would quantise across parameters. The
optimizer probe finds that (tiertrain/optim_probe.py, its large round) and each parameter is
stepped whole by one owning rank (tiertrain/update/whole.py), as single-process bitsandbytes
steps it. Checked against that reference through the float64 oracle (bitsandbytes steps
float64 parameters with the same 8-bit states) at stages 2 and 3, the CPU and NVMe tiers, and
across a checkpoint of 2 ranks at stage 2 resumed by 3 at stage 3.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist

import tiertrain
from reference import Oracle, global_batches, make_config, make_model, rank_slices, reference_train
from tiertrain.config import ConfigError
from tiertrain.optim import client_optimizer
from tiertrain.testing import run_distributed

bnb = pytest.importorskip("bitsandbytes")

STEPS, GLOBAL = 4, 12
OPTIONS = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-3, min_8bit_size=256)
"""min_8bit_size 256: the test GPT's matrices (1 024 elements and more) keep 8-bit states."""
ADAMW8 = functools.partial(bnb.optim.AdamW8bit, **OPTIONS)
CASES = {"stage 2": {"stage": 2}, "stage 3, CPU tier": {"stage": 3, "offload_optimizer": "cpu"},
         "stage 3, NVMe tier": {"stage": 3, "offload_optimizer": "nvme", "offload_params": "cpu"}}


def _config(world: int, zero: dict | None, nvme_path: str = ""):
    if zero is None:
        return make_config(optimizer={"grad_clip": 1.0})
    zero = {**zero, "bucket_mb": 0.02, **({"nvme_path": nvme_path} if "nvme" in zero.values() else {})}
    return make_config(zero=zero, optimizer={"grad_clip": 1.0}, batch={"micro_batch_size": GLOBAL // world})


def _train(engine, batches, config) -> list[float]:
    dp, rank = engine.topology.size("dp"), engine.topology.coord("dp")
    losses = []
    for batch in batches:
        t = torch.tensor([engine.train_batch(rank_slices(batch, rank, dp, config.batch.micro_batch_size, 1))],
                         dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / dp)
    return losses


def _wrap(world: int, zero: dict, nvme_path: str):
    config = _config(world, zero, nvme_path)
    engine = tiertrain.wrap(make_model(), config, tiertrain.Topology.build(config.parallel), optimizer=ADAMW8)
    return engine, config


def _rank(rank, world, nvme_path, checkpoint_dir):
    out = {}
    batches = global_batches(STEPS, GLOBAL)
    for name, zero in CASES.items():
        engine, config = _wrap(world, zero, nvme_path)
        losses = _train(engine, batches, config)
        whole = getattr(engine.update, "plan", None) is not None  # (the whole-parameter path)
        state = next(iter(engine.update.optimizer.state.values()), {}) if whole else {}
        out[name] = (losses, engine.full_state_dict(), sorted(k for k, v in state.items() if torch.is_tensor(v)
                                                             and v.dtype == torch.uint8))
        engine.close()
    engine, config = _wrap(world, CASES["stage 2"], nvme_path)
    _train(engine, batches[:2], config)
    engine.save_checkpoint(checkpoint_dir)
    engine.close()
    return out if rank == 0 else None


def _resumed_on_3(rank, world, checkpoint_dir, nvme_path):
    engine, config = _wrap(world, {"stage": 3}, nvme_path)
    engine.load_checkpoint(checkpoint_dir)
    losses = _train(engine, global_batches(STEPS, GLOBAL)[2:], config)
    params = engine.full_state_dict()
    engine.close()
    return (losses, params) if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("bnb")
    two = run_distributed(_rank, 2, str(root / "nvme"), str(root / "ckpt"), timeout=120)[0]
    resumed = run_distributed(_resumed_on_3, 3, str(root / "ckpt"), str(root / "nvme3"), timeout=120)[0]
    return {**two, "resumed": resumed}


def _reference(m):
    return bnb.optim.AdamW8bit(m.parameters(), **OPTIONS)


@pytest.fixture(scope="module")
def oracle():
    """The float64 oracle, its noise the largest distance to float64 of the fp32 reference over
    the batch's rows in every cyclic order and reversed: an 8-bit state rounds a moment to one
    of 256 levels of its block, and a last-bit change in a gradient's sum (what the number of
    ranks changes) can move it to the next level, a 1/127-of-the-block change that the steps
    carry on (measured: rows rotated by 3 put blocks.0.attn.qkv.weight 1.7e-3 from float64, the
    given order 1e-4)."""
    batches = global_batches(STEPS, GLOBAL)
    o = Oracle.run(reference_train, make_model(), _config(1, None), batches, build_optimizer=_reference,
                   lr_scheduler=None)
    assert o.losses64[-1] < o.losses64[0], "the reference itself must learn"
    orders = [lambda v: v.flip(0)] + [functools.partial(torch.roll, shifts=k, dims=0) for k in range(1, GLOBAL)]
    return o.widened([reference_train(make_model(), _config(1, None), [{k: order(v) for k, v in b.items()}
                                                                       for b in batches],
                                      build_optimizer=_reference, lr_scheduler=None) for order in orders])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_adamw8bit_trains_as_in_one_process(runs, oracle, case):
    losses, params, uint8_states = runs[case]
    oracle.check(losses, params, f"AdamW8bit, {case}, 2 ranks")
    if "NVMe" not in case:  # (there the states live in the swap files between steps)
        assert uint8_states == ["state1", "state2"]  # (the owners' states are bitsandbytes' 8-bit ones)


@pytest.mark.timeout(300)
def test_its_checkpoint_of_2_ranks_resumes_on_3_at_stage_3(runs, oracle):
    losses, params = runs["resumed"]
    assert len(losses) == 2
    oracle.check(None, params, "AdamW8bit, 2 steps on 2 ranks at stage 2, 2 on 3 ranks at stage 3")


def test_an_8bit_instance_with_settings_outside_its_defaults_is_refused_and_its_factory_taken():
    model = make_model()
    with pytest.raises(ConfigError, match=r"AdamW8bit instance keeps settings .*'min_8bit_size': 256.*"
                                          r"functools\.partial\(bitsandbytes\.optim\.adamw\.AdamW8bit"):
        client_optimizer(model, make_config(), optimizer=bnb.optim.AdamW8bit(model.parameters(), **OPTIONS))
    assert client_optimizer(model, make_config(), optimizer=ADAMW8).whole_groups == (0,)
    assert client_optimizer(model, make_config(), optimizer=bnb.optim.AdamW8bit(model.parameters())).whole_groups == (0,)


def test_an_instance_with_per_parameter_overrides_is_refused():
    """bitsandbytes' GlobalOptimManager keys its overrides by the instance's parameters (here the
    embeddings at 32 bits, as transformers' Trainer sets them), which the engine's optimizer
    does not step: refused, naming the override, instead of dropped."""
    model = make_model()
    manager = bnb.optim.GlobalOptimManager.get_instance()
    try:
        optimizer = bnb.optim.AdamW8bit(model.parameters(), lr=1e-2)
        manager.register_module_override(model.embed, "weight", {"optim_bits": 32})
        with pytest.raises(ConfigError, match=r"AdamW8bit instance keeps settings .*mng = .*'weight'"):
            client_optimizer(model, make_config(), optimizer=optimizer)
    finally:
        manager.initialize()  # (the manager is one per process)
