"""Your own nn.Module trained with tiertrain.Trainer: progress bar, metrics (JSONL, add
TensorBoard with --logging.tensorboard_dir DIR), evaluation, checkpoints and resume, ZeRO-3.

    python examples/trainer_quickstart.py                      # 2 local gloo processes
    python examples/trainer_quickstart.py --zero.offload_optimizer cpu --steps 400
    tiertrain plot runs/quickstart                             # loss, eval loss, throughput, memory

Run it twice: the second run finds the checkpoint in runs/quickstart/ckpt and continues.
Any LoopConfig field can be overridden as --section.key VALUE.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

import tiertrain
from tiertrain import launch


class Classifier(nn.Module):  # any model: here a residual MLP over 32 features, 10 classes
    def __init__(self, width: int = 128, depth: int = 4):
        super().__init__()
        self.inp, self.out = nn.Linear(32, width), nn.Linear(width, 10)
        self.blocks = nn.ModuleList(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())
                                    for _ in range(depth))  # each block: one ZeRO-3 gather unit

    def forward(self, x):
        x = self.inp(x)
        for block in self.blocks:
            x = x + block(x)
        return self.out(x)


def make_data(n: int, seed: int):  # a Dataset: samples labelled by a fixed "teacher"
    x = torch.randn(n, 32, generator=torch.Generator().manual_seed(seed))
    y = (x @ torch.randn(32, 10, generator=torch.Generator().manual_seed(1234))).argmax(1)
    return torch.utils.data.TensorDataset(x, y)


def train(argv):
    config = tiertrain.config.load(tiertrain.LoopConfig, None, [
        "--zero.stage", "3", "--steps", "200", "--eval.every", "50", "--optimizer.lr", "3e-3",
        "--batch.micro_batch_size", "64", "--logging.metrics_file", "runs/quickstart/metrics.jsonl",
        "--checkpoint.dir", "runs/quickstart/ckpt", "--checkpoint.interval", "50", *argv])
    loss_fn = lambda model, batch: F.cross_entropy(model(batch[0]).float(), batch[1])  # noqa: E731
    with tiertrain.Trainer(Classifier, config, make_data(20_000, 0), make_data(2_000, 1), loss_fn=loss_fn) as t:
        return t.fit()


if __name__ == "__main__":
    launch.launch_local(train, 2, sys.argv[1:]) if not launch.under_torchrun() else launch.run(train, sys.argv[1:])
