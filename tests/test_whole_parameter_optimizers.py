"""Optimizers that need whole tensors train as in one process (issue 37, item 1).

Muon orthogonalises each hidden matrix and Adafactor factors each matrix's second moment, so
neither may step the flat pieces ZeRO gives each rank. tiertrain finds such an optimizer by
what it does (tiertrain/optim_probe.py) and updates each of its parameters whole on one
owning rank (tiertrain/update/whole.py), the rest (Muon's AdamW for embeddings, norms and
biases) on the flat shards. Every case below is checked against single-process torch with
the same optimizers through the float64 oracle of tests/reference.py: the recipe users run
(torch.optim.Muon on the 2-D hidden weights + AdamW for the rest), Adafactor, and a user's
own Muon-style class under a name tiertrain cannot know, at ZeRO stages 0-3, on the CPU and
NVMe optimizer tiers, on 2 and 3 ranks (3 ranks: ownership uneven), with gradient
accumulation (one orthogonalisation per optimizer step), under partitioned_init, and across
a checkpoint resharded from 2 ranks to 3.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch
import torch.distributed as dist

import tiertrain
import zoo
from reference import Oracle, global_batches, make_config, make_model, rank_slices, reference_train
from tiertrain.config import ConfigError
from tiertrain.optim import client_optimizer
from tiertrain.testing import run_distributed
from tiertrain.update.ownership import exchange, owners
from tiertrain.zero.construct import full_shape
from tiertrain.zero.layout import bucket_layout

STEPS, GLOBAL = 4, 12  # (rows: 6 per rank on 2 ranks, 4 on 3; halves of those with accumulation)


def hidden(name: str, p: torch.Tensor) -> bool:
    """Muon's parameters: the 2-D weights of the blocks (tiertrain's GPT: blocks.*, a Hugging
    Face Llama: model.layers.*), not the embeddings or the head."""
    return p.ndim == 2 and _in_block(name)


def _in_block(name: str) -> bool:
    return name.startswith("blocks.") or name.startswith("model.layers.")


MUON = dict(lr=0.02, weight_decay=0.01)
ADAMW = dict(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-3)
"""eps 1e-3, as tests/reference.py's runs: with eps far below |g|, an embedding row's tiny
gradient turns a rounding difference (an AVX2 machine's, not an AVX-512 one's) into an lr-sized
step of either sign."""


def muon_adamw(model) -> list[torch.optim.Optimizer]:
    """The recipe of torch's Muon documentation, Moonlight and Kimi K2."""
    named = list(model.named_parameters())
    return [torch.optim.Muon([p for n, p in named if hidden(n, p)], **MUON),
            torch.optim.AdamW([p for n, p in named if not hidden(n, p)], **ADAMW)]


def muon_adamw_by_name(model) -> list[tuple]:
    """The same as (class, groups by name) pairs: under partitioned_init a parameter holds only
    its shard, which Muon's constructor refuses (it takes 2-D tensors only)."""
    named = [(n, full_shape(p)) for n, p in model.named_parameters()]
    return [(torch.optim.Muon, [{"params": [n for n, s in named if len(s) == 2 and _in_block(n)], **MUON}]),
            (torch.optim.AdamW, [{"params": [n for n, s in named if not (len(s) == 2 and _in_block(n))], **ADAMW}])]


def adafactor(model) -> torch.optim.Optimizer:
    return torch.optim.Adafactor(model.parameters(), lr=1e-2)


class NormalisedSteps(torch.optim.Optimizer):
    """A user's Muon-style optimizer under a name tiertrain cannot know: momentum, then a step
    of lr along the momentum divided by its norm over the whole tensor."""

    def __init__(self, params, lr=0.01, momentum=0.9):
        super().__init__(params, dict(lr=lr, momentum=momentum))

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                buf = self.state[p].setdefault("momentum", torch.zeros_like(p))
                buf.mul_(group["momentum"]).add_(p.grad)
                p.add_(buf / (buf.norm() + 1e-12), alpha=-group["lr"])


def normalised(model) -> torch.optim.Optimizer:
    return NormalisedSteps(model.parameters(), lr=0.01)


OPTIMIZERS = {"muon+adamw": muon_adamw, "adafactor": adafactor, "normalised": normalised}


@dataclass(frozen=True)
class Case:
    optimizer: str
    stage: int
    zero: dict = field(default_factory=dict)
    accum: int = 1
    partitioned_init: bool = False
    model: str = "gpt"
    """tiertrain's GPT, or a model of tests/zoo.py."""

    @property
    def name(self) -> str:
        extra = f" {self.model}" if self.model != "gpt" else ""
        extra += "".join(f" {k}={v}" for k, v in self.zero.items())
        extra += f" accum={self.accum}" if self.accum > 1 else ""
        extra += " partitioned_init" if self.partitioned_init else ""
        return f"{self.optimizer} stage {self.stage}{extra}"


CPU, NVME = {"offload_optimizer": "cpu"}, {"offload_optimizer": "nvme"}
CASES_2 = [
    *(Case("muon+adamw", s) for s in (0, 1, 2, 3)),
    Case("muon+adamw", 2, CPU), Case("muon+adamw", 3, CPU),
    Case("muon+adamw", 2, NVME), Case("muon+adamw", 3, {**NVME, "offload_params": "nvme"}),
    Case("muon+adamw", 2, accum=2), Case("muon+adamw", 3, CPU, accum=2),
    Case("muon+adamw", 3, partitioned_init=True),
    *(Case("adafactor", s) for s in (1, 2, 3)), Case("adafactor", 3, CPU), Case("adafactor", 3, NVME),
    *(Case("normalised", s) for s in (1, 2, 3)),
    Case("muon+adamw", 3, model="llama-gqa"), Case("adafactor", 2, CPU, model="llama-gqa"),
]
CASES_3 = [Case("muon+adamw", s) for s in (1, 2, 3)] + [Case("muon+adamw", 3, NVME), Case("adafactor", 2, CPU)]


def _config(case: Case | None, world: int, nvme_path: str = ""):
    if case is None:
        return make_config(optimizer={"grad_clip": 1.0})
    zero = {"stage": case.stage, "bucket_mb": 0.02, **case.zero}
    if "nvme" in case.zero.values():
        zero["nvme_path"] = nvme_path
    micro = GLOBAL // world // case.accum
    return make_config(zero=zero, optimizer={"grad_clip": 1.0},
                       batch={"micro_batch_size": micro, "grad_accum_steps": case.accum})


def _train(engine, batches, config) -> list[float]:
    dp, rank = engine.topology.size("dp"), engine.topology.coord("dp")
    losses = []
    for batch in batches:
        loss = engine.train_batch(rank_slices(batch, rank, dp, config.batch.micro_batch_size,
                                              config.batch.grad_accum_steps))
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t)
        losses.append(float(t) / dp)
    return losses


def _wrap(case: Case, world: int, nvme_path: str):
    config = _config(case, world, nvme_path)
    topology = tiertrain.Topology.build(config.parallel)
    if case.partitioned_init:
        with tiertrain.partitioned_init(topology):
            model = _model(case.model)
    else:
        model = _model(case.model)
    optimizer = muon_adamw_by_name(model) if case.partitioned_init else OPTIMIZERS[case.optimizer](model)
    return tiertrain.wrap(model, config, topology, optimizer=optimizer), config


def _model(name: str):
    return make_model() if name == "gpt" else zoo.build(name)


def _batches(model: str):
    return global_batches(STEPS, GLOBAL) if model == "gpt" else zoo.batches(model, STEPS, GLOBAL)


def _rank(rank, world, cases, nvme_path, checkpoint_dir):
    out = {}
    for case in cases:
        batches = _batches(case.model)
        engine, config = _wrap(case, world, nvme_path)
        losses = _train(engine, batches, config)
        owned = sum(o.numel for o in engine.update.plan.owned)
        counter = engine.counter.snapshot()
        out[case.name] = (losses, engine.full_state_dict(), owned, counter.get("all_to_all", 0))
        if world == 2 and case == Case("muon+adamw", 2):
            engine.close()
            engine, config = _wrap(case, world, nvme_path)
            _train(engine, batches[:2], config)
            engine.save_checkpoint(checkpoint_dir)
            engine.close()
            engine, config = _wrap(case, world, nvme_path)
            engine.load_checkpoint(checkpoint_dir)
            resumed_losses = _train(engine, batches[2:], config)
            resumed = engine.full_state_dict()
            out["resumed at the same layout"] = (
                [f"losses {losses[2:]} != {resumed_losses}"] if losses[2:] != resumed_losses else []) + [
                n for n, v in out[case.name][1].items() if not torch.equal(v, resumed[n])]
        engine.close()
    return out if rank == 0 else None


def _resumed_on_3(rank, world, checkpoint_dir, nvme_path):
    """The checkpoint of 2 ranks at stage 2 loaded by 3 ranks at stage 3, NVMe tier."""
    case = Case("muon+adamw", 3, NVME)
    engine, config = _wrap(case, world, nvme_path)
    engine.load_checkpoint(checkpoint_dir)
    assert engine.steps == 2
    losses = _train(engine, global_batches(STEPS, GLOBAL)[2:], config)
    params = engine.full_state_dict()
    engine.close()
    return (losses, params) if rank == 0 else None


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("whole")
    two = run_distributed(_rank, 2, CASES_2, str(root / "nvme"), str(root / "ckpt"), timeout=150)[0]
    three = run_distributed(_rank, 3, CASES_3, str(root / "nvme3"), str(root / "unused"), timeout=150)[0]
    resumed = run_distributed(_resumed_on_3, 3, str(root / "ckpt"), str(root / "nvme4"), timeout=120)[0]
    return {2: two, 3: three, "resumed": resumed}


@functools.lru_cache(maxsize=None)
def _oracle(optimizer: str, model: str = "gpt") -> Oracle:
    """The float64 oracle. torch's Muon orthogonalises in bfloat16 (its Newton-Schulz iteration
    casts the momentum to bf16), so even its float64 run rounds to 8 bits there, and a change
    of summation order in the gradient (what data parallelism changes) can flip a bf16
    rounding: its rounding noise is the larger distance to float64 of two fp32 runs that
    differ only in that order (the batch's rows reversed)."""
    batches = _batches(model)
    oracle = Oracle.run(reference_train, _model(model), _config(None, 1), batches,
                        build_optimizer=_reference(optimizer), lr_scheduler=None)
    assert oracle.losses64[-1] < oracle.losses64[0], f"{optimizer}: the reference itself must learn"
    if optimizer == "muon+adamw":
        reversed_rows = [{k: v.flip(0) for k, v in batch.items()} for batch in batches]
        oracle = oracle.widened([reference_train(_model(model), _config(None, 1), reversed_rows,
                                                 build_optimizer=_reference(optimizer), lr_scheduler=None)])
    return oracle


def _reference(optimizer: str):
    if optimizer != "muon+adamw":
        return OPTIMIZERS[optimizer]
    from tiertrain.optimizer_list import OptimizerList
    return lambda model: OptimizerList(muon_adamw(model))


RUNS = [(2, c) for c in CASES_2] + [(3, c) for c in CASES_3]


@pytest.mark.timeout(450)
@pytest.mark.parametrize("world,case", RUNS, ids=[f"{w} ranks, {c.name}" for w, c in RUNS])
def test_trains_as_the_same_optimizers_in_one_process(runs, world, case):
    losses, params, owned, _ = runs[world][case.name]
    assert owned > 0, "the whole-parameter path must have run, with parameters owned by every rank"
    _oracle(case.optimizer, case.model).check(losses, params, f"{case.name}, {world} ranks")


@pytest.mark.timeout(450)
def test_a_checkpoint_resumes_the_same_trajectory_bit_for_bit(runs):
    assert runs[2]["resumed at the same layout"] == []


@pytest.mark.timeout(450)
def test_a_checkpoint_of_2_ranks_resumes_on_3_with_the_optimizer_state_resharded(runs):
    losses, params = runs["resumed"]
    assert len(losses) == 2
    _oracle("muon+adamw").check(None, params, "2 steps on 2 ranks at stage 2, 2 on 3 ranks at stage 3 (NVMe)")


# -- ownership and refusals (one process) -------------------------------------------------------


def test_each_parameter_has_one_owner_and_owners_share_the_elements_evenly():
    model = make_model()
    layout_of = functools.partial(bucket_layout, list(model.named_parameters()), bucket_numel=5000)
    layout = layout_of(3)
    names = {n for n, p in model.named_parameters() if hidden(n, p)}
    owner_of = owners(layout.units, names, 3)
    assert set(owner_of) == names
    sizes = dict((n, p.numel()) for n, p in model.named_parameters())
    loads = [sum(sizes[n] for n, r in owner_of.items() if r == k) for k in range(3)]
    even, largest = sum(loads) / 3, max(sizes[n] for n in names)
    assert all(abs(load - even) <= largest for load in loads), loads
    for world in (3, 12):  # (12 ranks: more than the 8 matrices, so some own nothing)
        plans = [exchange(layout_of(world).units, names, world, r) for r in range(world)]
        for sender in range(world):
            for receiver in range(world):
                assert plans[sender].send_splits[receiver] == plans[receiver].receive_splits[sender]
        assert sum(p.owned_numel for p in plans) == sum(sizes[n] for n in names)
        assert sorted(o.name for p in plans for o in p.owned) == sorted(names)


def test_a_parameter_one_rank_holds_whole_is_owned_there_and_never_moves():
    """Stages 1-2 cut the model into large buckets: most matrices lie inside one rank's shard,
    and their owner is that rank (bench/results/muon.md: a quarter of the bytes of owners
    chosen by size alone)."""
    model = make_model()
    layout = bucket_layout(list(model.named_parameters()), 2, bucket_numel=10**6)
    names = {n for n, p in model.named_parameters() if hidden(n, p)}
    plans = [exchange(layout.units, names, 2, r) for r in range(2)]
    moved = sum(p.send_splits[1 - r] for r, p in enumerate(plans))
    whole_here = [n for n in names for u in layout.units for s in u.slots if s.name == n
                  and any(u.shard_range(r)[0] <= s.offset and s.end <= u.shard_range(r)[1] for r in range(2))]
    assert len(whole_here) >= len(names) - 2
    assert moved <= max(p.numel() for n, p in model.named_parameters() if n in names) * 2
    assert moved < sum(p.numel() for n, p in model.named_parameters() if n in names) / 4


def test_muon_and_adafactor_take_the_whole_parameter_path_and_adamw_does_not():
    model = make_model()
    client = client_optimizer(model, make_config(), optimizer=muon_adamw(model))
    assert client.whole_groups == (0,) and "other values" in client.why_whole or "raised" in client.why_whole
    assert client_optimizer(model, make_config(), optimizer=adafactor(model)).whole_groups == (0,)
    assert client_optimizer(model, make_config(), optimizer=normalised(model)).whole_groups == (0,)
    assert client_optimizer(model, make_config(), optimizer=torch.optim.AdamW).whole_groups == ()


def test_an_optimizer_that_needs_more_than_gradients_is_refused_by_name():
    with pytest.raises(ConfigError, match=r"optimizer LBFGS \(it minimises .*closure\) cannot train"):
        client_optimizer(make_model(), make_config(), optimizer=torch.optim.LBFGS)


def test_a_list_of_optimizers_must_cover_every_parameter_once():
    model = make_model()
    named = list(model.named_parameters())
    muon = torch.optim.Muon([p for n, p in named if hidden(n, p)], lr=0.02)
    with pytest.raises(ConfigError, match=r"embed.weight.* in no group"):
        client_optimizer(model, make_config(), optimizer=[muon, torch.optim.AdamW([named[2][1]])])
    with pytest.raises(ConfigError, match=r"a parameter belongs to one group"):
        client_optimizer(model, make_config(), optimizer=[muon, torch.optim.AdamW(model.parameters())])


def test_what_the_whole_parameter_path_cannot_do_is_refused_by_name():
    from tiertrain.update.factory import UpdateContext, _check_whole

    model = make_model()
    config = make_config(parallel={"tp": 2})
    client = client_optimizer(model, config, optimizer=muon_adamw(model))

    class Topology:
        def size(self, axis):
            return 2 if axis == "tp" else 1
    with pytest.raises(ConfigError, match=r"needs whole tensors .*parallel.tp=2"):
        _check_whole(UpdateContext(None, config, Topology(), None, None, False, False, optimizer=client))

    class OneRank(Topology):
        def size(self, axis):
            return 1
    for section, match in (({"zero": {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True}},
                            r"delayed_update: false"),
                           ({"optimizer": {"impl": "compiled"}}, r"impl=compiled is the default AdamW's kernel")):
        with pytest.raises(ConfigError, match=r"needs whole tensors .*" + match):
            _check_whole(UpdateContext(None, make_config(**section), OneRank(), None, None, False, False,
                                       optimizer=client))


class CountsItsSteps(NormalisedSteps):
    """A user's optimizer whose step size depends on how often step() ran: stepping tensors
    one at a time (the NVMe tier's per-tensor streaming) would change what it does."""

    def __init__(self, params, lr=0.01):
        super().__init__(params, lr)
        self.calls = 0

    @torch.no_grad()
    def step(self):
        self.calls += 1
        for group in self.param_groups:
            group["lr"] = 0.01 / self.calls
        super().step()


def test_the_nvme_tier_refuses_an_optimizer_that_cannot_step_one_tensor_at_a_time(tmp_path):
    model = make_model()
    nvme = make_config(zero={"stage": 2, "offload_optimizer": "nvme", "nvme_path": str(tmp_path)})
    with pytest.raises(ConfigError, match=r"offload_optimizer=nvme: CountsItsSteps stepped on two matrices one at "
                                          r"a time gives other values.*offload_optimizer=cpu"):
        client_optimizer(model, nvme, optimizer=CountsItsSteps)
    assert client_optimizer(model, nvme, optimizer=muon_adamw(model)).whole_groups == (0,)
    assert client_optimizer(model, make_config(zero={"stage": 2, "offload_optimizer": "cpu"}),
                            optimizer=CountsItsSteps).whole_groups == (0,)
