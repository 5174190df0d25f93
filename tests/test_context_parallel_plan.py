"""The estimator and the planner know context parallelism (issue 38, item 3): each of cp ranks
holds the activations of seq/cp tokens while ZeRO partitions the model states over dp × cp;
`tiertrain plan` splits the sequence when, and only when, the activations at that length are
what does not fit, and says why.
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from tiertrain.estimate import estimate
from tiertrain.estimate.dims import ModelDims
from tiertrain.estimate.hardware import Hardware
from tiertrain.estimate.layout import ZeroLayout
from tiertrain.estimate.plan import plan

LONG = ModelDims(n_layers=8, hidden=1024, n_heads=16, vocab=32000, seq_len=131072, bias=False)


def _lines(dims, **layout) -> dict[str, int]:
    lay = ZeroLayout(precision="bf16", micro_batch=1, backend="nccl", **layout)
    return {line.name: line.bytes for line in estimate(dims, lay, accelerator=True).lines}


def test_activations_follow_seq_over_cp_and_states_follow_dp_times_cp():
    one = _lines(LONG, dp=8, cp=1, stage=3, checkpoint_interval=1)
    for cp in (2, 4, 8):
        split = _lines(LONG, dp=8 // cp, cp=cp, stage=3, checkpoint_interval=1)
        assert split["activation checkpoints"] == one["activation checkpoints"] // cp
        assert split["activations (embedding, head, logits)"] * cp == pytest.approx(
            one["activations (embedding, head, logits)"], rel=1e-3)
        for state in ("parameters", "gradients", "master weights", "optimizer states"):
            assert split[state] == one[state], f"{state}: ZeRO partitions over all {8} ranks at cp={cp} too"


def test_a_sequence_that_cannot_be_split_evenly_is_refused():
    with pytest.raises(ValueError, match="seq_len=131072 cannot be split over cp=3"):
        _lines(LONG, dp=1, cp=3, stage=3)


def _machine(device_gib: int) -> Hardware:
    return Hardware(ranks_per_node=8, host_memory=1024 * 2**30, device_memory=device_gib * 2**30)


def test_the_planner_splits_the_sequence_when_activations_do_not_fit_and_says_why():
    p = plan(LONG, _machine(40), micro_batch=1, precision="bf16")
    assert p.fits and p.layout.cp > 1 and p.rung == f"context parallelism cp={p.layout.cp}"
    assert p.config_dict()["parallel"] == {"cp": p.layout.cp, "cp_algorithm": "ring"}
    assert any(f"parallel.cp={p.layout.cp}: at seq_len 131072" in note for note in p.notes)
    smaller = plan(LONG, _machine(40), micro_batch=1, precision="bf16", context_parallel=False)
    assert smaller.layout.cp == 1 and smaller.rung != p.rung, "without cp the planner must offload (or not fit)"


def test_the_planner_keeps_whole_sequences_when_they_fit():
    short = ModelDims(n_layers=8, hidden=1024, n_heads=16, vocab=32000, seq_len=4096, bias=False)
    p = plan(short, _machine(40), micro_batch=1, precision="bf16")
    assert p.fits and p.layout.cp == 1 and "parallel" not in p.config_dict()


@pytest.mark.timeout(120)
def test_tiertrain_plan_picks_a_cp_size_for_a_long_sequence():
    proc = subprocess.run([sys.executable, "-m", "tiertrain.cli", "plan", "--layers", "8", "--hidden", "1024", "--heads",
                           "16", "--vocab", "32000", "--seq", "131072", "--nproc", "8", "--ram", "300GB",
                           "--micro-batch", "1", "--precision", "bf16"], capture_output=True, text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    assert "rung: context parallelism cp=" in proc.stdout
    assert "parallel.cp " in proc.stdout and "at seq_len 131072" in proc.stdout


def test_a_loss_in_tiles_keeps_one_tiles_logits_in_the_estimate():
    whole = _lines(LONG, dp=2, cp=4, stage=3, checkpoint_interval=1)
    tiled = _lines(LONG, dp=2, cp=4, stage=3, checkpoint_interval=1, loss_tile_tokens=1024)
    head = "activations (embedding, head, logits)"
    saved_log_softmax = 4 * (131072 // 4) * 32000  # fp32, every token of the rank
    assert whole[head] - tiled[head] >= saved_log_softmax
    assert tiled["backward buffers"] < whole["backward buffers"]
