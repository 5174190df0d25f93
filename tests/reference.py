"""The single-process PyTorch reference every engine run is compared against, and the
per-rank engine run that feeds the same global batches through tiertrain."""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist

import tiertrain
from tiertrain.config import Config, from_dict
from tiertrain.engine import default_loss
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


def reference_train(model, config: Config, batches):
    """Plain PyTorch: the whole global batch in one forward (mean loss over every token),
    clip_grad_norm_, AdamW with the same param groups and schedule."""
    model = copy.deepcopy(model)
    opt = build_adamw(param_groups(model.named_parameters(), config.optimizer), config.optimizer)
    sched = build_schedule(opt, config.schedule)
    losses = []
    for batch in batches:
        loss = default_loss(model, batch)
        loss.backward()
        if config.optimizer.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), config.optimizer.grad_clip)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def rank_slices(batch, rank: int, dp: int, micro: int, accum: int):
    """This rank's micro-batches of one global batch: rows (j·dp + rank)·micro onwards."""
    for j in range(accum):
        start = (j * dp + rank) * micro
        yield {k: v[start:start + micro] for k, v in batch.items()}


def engine_train(rank, world, model, config: Config, batches, prepare=None):
    """Run the engine on this rank over the global batches; returns (mean loss over the
    data-parallel ranks per step, this rank's fp32 parameters, engine). prepare(model,
    topology) may transform the model before wrapping (e.g. tensor parallelism)."""
    topology = tiertrain.Topology.build(config.parallel)
    if prepare is not None:
        model = prepare(model, topology)
    engine = tiertrain.wrap(model, config, topology)
    dp = topology.size("dp")
    losses = []
    for batch in batches:
        loss = engine.train_batch(rank_slices(batch, topology.coord("dp"), dp,
                                              config.batch.micro_batch_size, config.batch.grad_accum_steps))
        t = torch.tensor([loss], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(t, group=topology.group("dp"))
        losses.append(float(t) / dp)
    return losses, engine.full_state_dict(), engine


def max_rel_diff(a: dict, b: dict) -> float:
    """Largest over parameters of max|a - b| / max|b|: the difference relative to each
    tensor's scale (elementwise ratios would divide by values that are merely near zero)."""
    worst = 0.0
    for name, ref in b.items():
        ref = ref.double()
        diff = (a[name].double() - ref).abs().max() / ref.abs().max().clamp_min(1e-12)
        worst = max(worst, float(diff))
    return worst
