"""The single-process PyTorch reference every engine run is compared against, the float64
oracle that turns "matches the reference" into a bound derived from this machine's rounding
noise, and the per-rank engine run that feeds the same global batches through tiertrain."""
from __future__ import annotations

import copy
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

import tiertrain
from tiertrain.config import Config, from_dict
from tiertrain.engine_contract import default_loss
from tiertrain.models.gpt import GPT, GPTConfig
from tiertrain.optim import build_adamw, build_schedule, param_groups

# bias=False: the qkv key bias has an analytically zero gradient whose rounding noise Adam
# amplifies into lr-sized steps, which no two summation orders agree on (see GPTConfig.bias).
TINY = dict(vocab_size=256, seq_len=16, n_layers=2, hidden=32, n_heads=4, bias=False)


def make_model(seed: int = 0, **overrides) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(**{**TINY, **overrides}))


def make_config(**sections) -> Config:
    """A Config from nested dicts, e.g. make_config(zero={'stage': 2}); validated."""
    base = {"schedule": {"warmup_steps": 2, "decay_steps": 4}, "optimizer": {"lr": 1e-2}}
    for k, v in sections.items():
        base[k] = {**base.get(k, {}), **v}
    return from_dict(Config, base).validate()


def global_batches(n_steps: int, global_batch: int, seq_len: int = 16, seed: int = 1):
    """Learnable sequences: a random start, then t[i+1] = (5·t[i] + 3) mod 256."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_steps):
        tokens = torch.empty(global_batch, seq_len + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, 256, (global_batch,), generator=g)
        for i in range(seq_len):
            tokens[:, i + 1] = (5 * tokens[:, i] + 3) % 256
        out.append({"input_ids": tokens[:, :-1].contiguous(), "labels": tokens[:, 1:].contiguous()})
    return out


CONFIG_SCHEDULE = "config"
"""reference_train's default lr_scheduler: config.schedule as a LambdaLR."""


def reference_train(model, config: Config, batches, build_optimizer=None, lr_scheduler=CONFIG_SCHEDULE):
    """Plain PyTorch: the whole global batch in one forward (mean loss over every token),
    clip_grad_norm_, AdamW with the same param groups and schedule (or the optimizer
    build_optimizer(model) returns). lr_scheduler: config.schedule's LambdaLR by default,
    None for each group's constant rate (a client optimizer without a scheduler), or a
    factory callable(optimizer) -> LRScheduler, stepped after every update."""
    model = copy.deepcopy(model)
    if build_optimizer is None:
        opt = build_adamw(param_groups(model.named_parameters(), config.optimizer), config.optimizer)
    else:
        opt = build_optimizer(model)
    if lr_scheduler == CONFIG_SCHEDULE:
        sched = build_schedule(opt, config.schedule)
    else:
        sched = None if lr_scheduler is None else lr_scheduler(opt)
    dtype = next(model.parameters()).dtype
    losses = []
    for batch in batches:
        loss = default_loss(model, _floats_to(batch, dtype))
        loss.backward()
        if config.optimizer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
        opt.step()
        if sched is not None:
            sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _floats_to(batch, dtype):
    """Floating-point inputs in the model's dtype (a float64 reference gets float64 inputs), as
    the engine casts them to its compute dtype."""
    if isinstance(batch, torch.Tensor):
        return batch.to(dtype) if batch.is_floating_point() else batch
    if isinstance(batch, dict):
        return {k: _floats_to(v, dtype) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(_floats_to(v, dtype) for v in batch)
    return batch


def tp_gathered(engine, local: dict) -> dict:
    """This rank's fp32 parameters (``local``, e.g. what engine_train returns) with every
    tensor-parallel shard gathered over the tp group: whole parameters (of this pipeline
    stage's only, with pp > 1), comparable with the reference's."""
    from tiertrain.parallel.tensor import gather_tensor

    group = engine.topology.group("tp")
    out = {}
    for name, tensor in local.items():
        p = engine.flat.params.get(name)
        if p is None:  # (with pp > 1, full_state_dict also holds the other stages' tensors: theirs to gather)
            if engine.topology.size("pp") == 1:
                out[name] = tensor
            continue
        out[name] = gather_tensor(tensor, p.tp_shard_dim, group) if getattr(p, "tp_sharded", False) else tensor
    return out


def rank_slices(batch, rank: int, dp: int, micro: int, accum: int):
    """This rank's micro-batches of one global batch: rows (j·dp + rank)·micro onwards."""
    for j in range(accum):
        start = (j * dp + rank) * micro
        yield {k: v[start:start + micro] for k, v in batch.items()}


def mean_over_ranks(losses: list[float], world: int) -> list[float]:
    """Each step's loss averaged over the ranks (every rank calls it; as is in one process)."""
    if not dist.is_initialized():
        return losses
    t = torch.tensor(losses, dtype=torch.float64)
    dist.all_reduce(t)
    return (t / world).tolist()


def fp32_parameters(engine) -> dict:
    """The engine's full parameters as fp32 copies (collective at stage 3)."""
    return {n: p.detach().float().clone() for n, p in engine.full_state_dict().items()}


def engine_train(rank, world, model, config: Config, batches, prepare=None, wrap_kwargs=None):
    """Run the engine on this rank over the global batches; returns (mean loss over the
    data-parallel ranks per step, this rank's fp32 parameters, engine). prepare(model,
    topology) may transform the model before wrapping (e.g. tensor parallelism).
    wrap_kwargs: more arguments of tiertrain.wrap (e.g. optimizer=, lr_scheduler=), or a
    function of the model returning them (an optimizer built on its parameters)."""
    topology = tiertrain.Topology.build(config.parallel)
    if prepare is not None:
        model = prepare(model, topology)
    if callable(wrap_kwargs):
        wrap_kwargs = wrap_kwargs(model)
    engine = tiertrain.wrap(model, config, topology, **(wrap_kwargs or {}))
    dp = topology.size("dp")
    losses = []
    for batch in batches:
        loss = engine.train_batch(rank_slices(batch, topology.coord("dp"), dp,
                                              config.batch.micro_batch_size, config.batch.grad_accum_steps))
        t = torch.tensor([loss], dtype=torch.float64)
        if dist.is_initialized():  # (dp × cp: each context-parallel rank returns its share of the loss)
            dist.all_reduce(t, group=topology.group("dp_cp"))
        losses.append(float(t) / topology.size("dp_cp"))
    return losses, engine.full_state_dict(), engine


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest over parameters of max|a - b| / max|b|: the difference relative to each
    tensor's scale (elementwise ratios would divide by values that are merely near zero)."""
    return max(rel_distances(a, b).values(), default=0.0)


# -- the float64 oracle ---------------------------------------------------------------------
#
# A fixed bound such as 1e-6 is a statement about one CPU: how far two fp32 runs that sum in
# different orders drift apart depends on the kernels ATen picks (AVX-512, AVX2, default) and
# on the model. The oracle measures that drift instead. The reference runs twice, in fp32 and
# in float64 (same seed, same data, same schedule); the float64 run stands for the exact result
# (its own rounding is ~1e-16). The fp32 reference's distance to it is the rounding noise of
# this machine and model; the engine, another fp32 computation of the same function in another
# summation order, must land within NOISE_MULTIPLE times that noise, plus a floor of a few ulps.
# A real bug (a lost rank, a missing 1/dp, a stale shard) moves results by 1e-3 or more, orders
# of magnitude above either term; see the mutation checks in tests/test_oracle.py.

EPS32 = torch.finfo(torch.float32).eps  # 2^-23: one ulp at 1.0
# Two fp32 computations of one function in different summation orders scatter around the
# exact value with the same spread; the engine's worst tensor is compared with the reference's
# worst tensor. Measured ratio of the two (tests/ORACLE.md, every family, ATen's AVX2 and
# default kernels): at most 1.58 for parameters. 2x leaves room for the spread of that ratio.
NOISE_MULTIPLE = 2.0
# Where the reference happens to land almost exactly on the float64 value (the first loss is one
# forward, accurate to an ulp), the noise term vanishes: allow 4 ulps of the largest element
# (relative 4·2^-23 ≈ 4.8e-7 of the largest loss or parameter magnitude).
FLOOR = 4 * EPS32


def rel_distances(a: dict, b: dict) -> dict[str, float]:
    """Per parameter: max|a - b| / max|b| (float64 arithmetic)."""
    out = {}
    for name, ref in b.items():
        ref = ref.detach().double()
        out[name] = float((a[name].detach().double() - ref).abs().max() / ref.abs().max().clamp_min(1e-300))
    return out


def loss_distances(a, b) -> list[float]:
    """Per step: |a - b| / |b|."""
    return [abs(x - y) / abs(y) for x, y in zip(a, b, strict=True)]


@dataclass
class Oracle:
    """One reference run in fp32 and the same run in float64; check() bounds an engine run by
    the fp32 run's distance to float64 (the measured rounding noise)."""

    losses32: list[float]
    params32: dict
    losses64: list[float]
    params64: dict
    buffers: frozenset = frozenset()
    """The reference model's persistent buffers, which an engine's full_state_dict holds beside
    the parameters and check() leaves out (tests/test_buffers.py checks buffers against DDP)."""

    @classmethod
    def run(cls, reference_fn, model, *args, **kwargs) -> "Oracle":
        """reference_fn(model, *args, **kwargs) -> (losses, params) runs in the model's dtype
        (everything it builds follows the parameters): once as given (fp32), once on a
        float64 copy."""
        losses32, params32 = reference_fn(model, *args, **kwargs)
        losses64, params64 = reference_fn(copy.deepcopy(model).double(), *args, **kwargs)
        buffers = frozenset(model.state_dict()) - {n for n, _ in model.named_parameters(remove_duplicate=False)}
        return cls(losses32, params32, losses64, params64, buffers)

    def widened(self, runs32) -> "Oracle":
        """This oracle with the largest rounding noise among its own fp32 run and other fp32 runs
        ``(losses, params)`` of the same reference (the batch's rows summed in other orders): for
        arithmetic that amplifies a rounding difference (a bf16 or 8-bit quantisation step that a
        last-bit change of its input can flip), one fp32 run's distance to float64 is luck."""
        runs = [self, *(Oracle(losses, params, self.losses64, self.params64, self.buffers) for losses, params in runs32)]
        return Oracle(max(runs, key=Oracle.loss_noise).losses32, max(runs, key=lambda o: o.param_noise).params32,
                      self.losses64, self.params64, self.buffers)

    def loss_noise(self, steps: int | None = None) -> float:
        """The fp32 reference's largest loss distance over the first `steps` steps (all)."""
        steps = len(self.losses64) if steps is None else steps
        return max(loss_distances(self.losses32[:steps], self.losses64[:steps]))

    @property
    def param_noise(self) -> float:
        return max(rel_distances(self.params32, self.params64).values())

    def check(self, losses, params, what: str = "", multiple: float = NOISE_MULTIPLE,
              key=lambda name: name) -> None:
        """Every loss and every parameter of the engine run within multiple × noise + FLOOR of
        the float64 run. losses may be the first steps only; params may hold a subset of the
        reference's names (key maps an engine name to the reference's, e.g. a tied copy's)."""
        parts = []
        if losses is not None:
            losses = list(losses)
            parts.append(("losses", loss_distances(losses, self.losses64[:len(losses)]),
                          self.loss_noise(len(losses))))
        if params is not None:
            params = {n: v for n, v in params.items() if key(n) not in self.buffers}
            dist = rel_distances(params, {n: self.params64[key(n)] for n in params})
            parts.append(("parameters", list(dist.values()), self.param_noise))
        for kind, distances, noise in parts:
            worst = max(distances)
            bound = multiple * noise + FLOOR
            _log(what, kind, worst, noise)
            if worst > bound:
                where = ""
                if kind == "parameters":
                    where = f" (worst: {max(dist, key=dist.get)})"
                else:
                    where = f" (worst: step {distances.index(worst)})"
                raise AssertionError(
                    f"{what}: {kind} are {worst:.3e} from the float64 reference{where}; the fp32 "
                    f"reference is {noise:.3e} from it (ratio {worst / max(noise, 1e-300):.2f}); "
                    f"bound {multiple:g} x noise + {FLOOR:.2e} = {bound:.3e}")


def check_tensors(actual: dict, ref32: dict, ref64: dict, what: str) -> None:
    """The oracle's bound for tensors computed once (no training trajectory): each of actual
    within NOISE_MULTIPLE × (ref32's distance to ref64) + FLOOR of ref64."""
    Oracle([], ref32, [], ref64).check(None, actual, what)


def _log(what, kind, worst, noise):
    """TIERTRAIN_ORACLE_LOG=path appends every check's distances (one JSON line each): the
    measurements behind NOISE_MULTIPLE, kept out of the assertions themselves."""
    path = os.environ.get("TIERTRAIN_ORACLE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
                                "what": what, "kind": kind, "engine": worst, "noise": noise,
                                "capability": torch.backends.cpu.get_cpu_capability()}) + "\n")


# -- operator-level bounds ------------------------------------------------------------------

U32 = 2.0**-24  # fp32 unit roundoff


def gamma(n: int) -> float:
    """γ_n = n·u / (1 - n·u): the relative error bound of an n-term fp32 sum or dot product."""
    return n * U32 / (1 - n * U32)


def assert_within_rounding(actual: torch.Tensor, exact: torch.Tensor, abs_terms: torch.Tensor,
                           n_terms: int, what: str) -> float:
    """The classic bound for any order of summing n_terms fp32 products (Higham, "Accuracy and
    Stability of Numerical Algorithms", §3.1): |fl(Σ aᵢbᵢ) - Σ aᵢbᵢ| ≤ γ_n · Σ|aᵢbᵢ|, elementwise.
    exact and abs_terms (Σ|aᵢbᵢ|) are computed in float64 from the same fp32 inputs. Returns the
    worst ratio of error to bound (≤ 1)."""
    err = (actual.detach().double() - exact).abs()
    bound = gamma(n_terms) * abs_terms
    ratio = float((err / bound.clamp_min(1e-300)).max())
    if not bool((err <= bound).all()):
        worst = int((err - bound).argmax())
        raise AssertionError(
            f"{what}: element {worst} is {float(err.flatten()[worst]):.3e} from the float64 result; "
            f"the rounding bound gamma_{n_terms} * sum|terms| is {float(bound.flatten()[worst]):.3e} "
            f"(worst error/bound {ratio:.2f})")
    return ratio
