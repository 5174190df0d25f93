"""Train your own nn.Module with tiertrain: ``wrap()`` needs no changes to the model.

    python examples/train_custom_model.py                 # 2 local gloo processes, ZeRO-3
    python examples/train_custom_model.py --nproc 1 --stage 0
    torchrun --nproc-per-node 2 examples/train_custom_model.py --stage 2

The model is an ordinary residual MLP classifier; the task a synthetic one (labels from a
fixed random "teacher" network), so the example needs no data and runs in seconds on a CPU.
What tiertrain needs from you:

* a ``Config`` (here built in code; ``tiertrain.config.load(Config, "file.yaml", argv)``
  reads one from YAML/TOML and ``--section.key VALUE`` overrides),
* a ``Topology`` for the current process group (``Topology.build(config.parallel)``),
* ``loss_fn(model, batch) -> scalar`` when calling the model on the batch does not already
  return the loss,
* for ZeRO-3, the units gathered together: by default every child of an ``nn.ModuleList``
  (pass ``unit_modules=[...]`` to choose others).
"""
from __future__ import annotations

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import tiertrain
from tiertrain import launch
from tiertrain.config import BatchConfig, Config, LoggingConfig, OptimizerConfig, ScheduleConfig, ZeroConfig


class ResidualMLP(nn.Module):
    """x -> Linear -> [x + MLP(LayerNorm(x))] * depth -> LayerNorm -> Linear -> logits."""

    def __init__(self, dim_in: int = 32, width: int = 128, depth: int = 4, classes: int = 10):
        super().__init__()
        self.inp = nn.Linear(dim_in, width)
        self.blocks = nn.ModuleList(  # each block becomes one ZeRO-3 gather unit
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
            for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(self.norm(x))


def loss_fn(model: nn.Module, batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x).float(), y)


def synthetic_batches(rank: int, batch_size: int, dim_in: int = 32, classes: int = 10):
    """Endless (x, y) batches, different on every data-parallel rank, labelled by a fixed teacher."""
    teacher = torch.randn(dim_in, classes, generator=torch.Generator().manual_seed(1234))
    gen = torch.Generator().manual_seed(1000 + rank)
    while True:
        x = torch.randn(batch_size, dim_in, generator=gen)
        yield x, (x @ teacher).argmax(dim=1)


def train(stage: int, steps: int, dtype: str) -> dict:
    """Runs on every rank (or alone)."""
    config = Config(
        zero=ZeroConfig(stage=stage),
        precision=tiertrain.config.PrecisionConfig(dtype=dtype),
        optimizer=OptimizerConfig(lr=3e-3, weight_decay=0.0),
        schedule=ScheduleConfig(warmup_steps=5),
        batch=BatchConfig(micro_batch_size=64),
        logging=LoggingConfig(progress=False),
    ).validate()
    topology = tiertrain.Topology.build(config.parallel)
    torch.manual_seed(0)  # the same initial model on every rank
    model = ResidualMLP()
    engine = tiertrain.wrap(model, config, topology, loss_fn=loss_fn)
    batches = synthetic_batches(topology.coord("dp"), config.batch.micro_batch_size)

    first = last = None
    for step in range(1, steps + 1):
        loss = engine(next(batches))  # forward (ZeRO-3 gathers each block just in time)
        engine.backward(loss)  # gradients are reduced (ZeRO-2/3: reduce-scattered) during backward
        lr = engine.learning_rate()  # (the rate this step applies: config.schedule's)
        engine.step()  # AdamW on this rank's shard, then parameters are republished
        value = float(loss.detach())
        first = value if first is None else first
        last = value
        if topology.rank == 0 and (step == 1 or step % 20 == 0 or step == steps):
            print(f"step {step:4d}  loss {value:.4f}  lr {lr:.2e}  "
                  f"model states/rank {engine.memory_report().total / 2**20:.2f} MiB", flush=True)

    state = engine.full_state_dict()  # collective: every rank takes part, all get full tensors
    if topology.rank == 0:
        restored = ResidualMLP()
        restored.load_state_dict(state)  # the trained weights, usable without tiertrain
        print(f"done: loss {first:.3f} -> {last:.3f}; full state dict has {len(state)} tensors")
    return {"first": first, "last": last}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nproc", type=int, default=2, help="local processes (ignored under torchrun)")
    p.add_argument("--stage", type=int, default=3, choices=[0, 1, 2, 3], help="ZeRO stage")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    a = p.parse_args()
    if launch.under_torchrun():
        launch.run(train, a.stage, a.steps, a.dtype)  # torchrun started the ranks
    elif a.nproc == 1:
        train(a.stage, a.steps, a.dtype)
    else:
        launch.launch_local(train, a.nproc, a.stage, a.steps, a.dtype)


if __name__ == "__main__":
    main()
