"""Loading a checkpoint runs no code from it (tiertrain/state/checkpoint.py: torch.load with
weights_only=True), and everything the engine saves still loads that way.

A checkpoint directory may come from anyone, and whoever writes its rank files also writes
the checksums in COMMITTED.json. So the attack tested here plants a pickle payload (an object
whose ``__reduce__`` creates a marker file when unpickled) in every file loading reads with
torch.load (each rank file; COMMITTED.json is read with json.load, which runs nothing) and
recomputes the committed checksums, so that only the unpickler stands in the way: loading
must refuse each file by name, and the marker must never appear. A control load with the
full unpickler at the end proves the planted payload would have run.

The round trips: save -> load into an engine built from another seed -> the same state
(masters, optimizer state, schedule, scaler, counters, RNG, frozen shards), for the default
AdamW, fp16's loss scaler, a client optimizer with a torch LR scheduler, the NVMe optimizer
tier, the delayed update and stage 3 with frozen parameters (2 ranks).
"""
from __future__ import annotations

import collections
import enum
import functools
import hashlib
import json
import math
import os
import pickle
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torch.optim import lr_scheduler

import tiertrain
from reference import global_batches, make_config, make_model, rank_slices
from tiertrain.state.checkpoint import MARKER, CheckpointError, json_like_extra, plain_state
from tiertrain.testing import run_distributed

MICRO = 2


class Payload:
    """Unpickled by a full unpickler, this creates ``marker`` (open(..., "w") or os.system);
    the weights-only unpickler must refuse the global it names instead."""

    def __init__(self, marker: str, how: str = "open"):
        self.marker, self.how = marker, how

    def __reduce__(self):
        if self.how == "open":
            return (open, (self.marker, "w"))
        return (os.system, (f"touch '{self.marker}'",))


def _sha256(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def _plant(step_dir: str, rank: int, put: Callable[[Any], Any]) -> str:
    """Re-save rank's file with put(state) (which adds the payload; its result is what is
    saved) by plain torch.save, and commit the new file's sha256 in the marker, as the
    saver computes it (sha256 of the file's bytes, hex, at marker["sha256"][rank])."""
    path = os.path.join(step_dir, f"rank{rank:05d}.pt")
    state = torch.load(path, weights_only=True)  # (the file as saved is plain)
    torch.save(put(state), path)
    with open(os.path.join(step_dir, MARKER)) as f:
        marker = json.load(f)
    marker["sha256"][rank] = _sha256(path)
    with open(os.path.join(step_dir, MARKER), "w") as f:
        json.dump(marker, f)
    return path


def _in_optimizer_state(marker: str, how: str) -> Callable[[dict], dict]:
    def put(state):
        state["update"]["optimizer"]["state"][0]["payload"] = Payload(marker, how)
        return state
    return put


def _in_extra(marker: str, how: str) -> Callable[[dict], dict]:
    def put(state):
        state["extra"]["note"] = [Payload(marker, how)]
        return state
    return put


def _snapshot(value: Any) -> Any:
    """A deep copy (tensors cloned) of a state, unaffected by later training."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return type(value)((k, _snapshot(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return type(value)(_snapshot(v) for v in value)
    return value


def _differences(a: Any, b: Any, path: str = "state") -> list[str]:
    """Where two states differ (types included: a tuple saved must load as a tuple)."""
    if type(a) is not type(b):
        return [f"{path}: {type(a).__name__} != {type(b).__name__}"]
    if isinstance(a, torch.Tensor):
        same = a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.cpu(), b.cpu())
        return [] if same else [f"{path}: tensors differ"]
    if isinstance(a, dict):
        if set(a) != set(b):
            return [f"{path}: keys {sorted(map(repr, a))} != {sorted(map(repr, b))}"]
        return [d for k in a for d in _differences(a[k], b[k], f"{path}[{k!r}]")]
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return [f"{path}: length {len(a)} != {len(b)}"]
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return []
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


# -- 2 ranks: every rank file poisoned; stage 3 with frozen parameters round-trips -----------

def _poisoned_load(rank: int, world: int, root: str) -> dict:
    cfg = make_config(zero={"stage": 2}, batch={"micro_batch_size": MICRO})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    engine.train_batch(rank_slices(global_batches(1, MICRO * world)[0], rank, world, MICRO, 1))
    directory = os.path.join(root, "poisoned")
    step_dir = engine.save_checkpoint(directory, extra={"next_batch": 1})
    markers = [os.path.join(root, f"PWNED_rank{r}") for r in range(world)]
    dist.barrier()
    if rank == 0:  # the attacker: a payload in every rank file, checksums recomputed
        _plant(step_dir, 0, _in_optimizer_state(markers[0], "open"))
        _plant(step_dir, 1, _in_extra(markers[1], "system"))
    dist.barrier()
    try:
        engine.load_checkpoint(directory)
        error = None
    except CheckpointError as e:
        error = str(e)
    dist.barrier()
    return {"error": error, "markers_seen": [m for m in markers if os.path.exists(m)],
            "path": os.path.join(step_dir, f"rank{rank:05d}.pt"), "marker": markers[rank]}


def _frozen_round_trip(rank: int, world: int, root: str) -> list[str]:
    from adapters import lora_llama

    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": MICRO}, optimizer={"eps": 1e-3})
    directory = os.path.join(root, "frozen")
    first = tiertrain.wrap(lora_llama(), cfg, tiertrain.Topology.build(cfg.parallel))
    batch = {"input_ids": global_batches(1, MICRO * world)[0]["input_ids"]}
    batch["labels"] = batch["input_ids"]
    first.train_batch(rank_slices(batch, rank, world, MICRO, 1))
    before = _snapshot(first.state_dict())
    assert "frozen" in before and before["frozen"]["shards"], "no frozen shards saved: not the case tested"
    first.save_checkpoint(directory)
    first.close()
    second = tiertrain.wrap(lora_llama(seed=5), cfg, tiertrain.Topology.build(cfg.parallel))
    second.load_checkpoint(directory)
    after = second.state_dict()
    second.close()
    return _differences(before, after)


def _ranks(rank: int, world: int, root: str, frozen: bool) -> dict:
    return {"poisoned": _poisoned_load(rank, world, root),
            "frozen": _frozen_round_trip(rank, world, root) if frozen else None}


def _have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> tuple[list[dict], str]:
    """One launch of 2 ranks for both 2-rank cases (process start-up dominates)."""
    root = str(tmp_path_factory.mktemp("pickle"))
    return run_distributed(_ranks, 2, root, _have_transformers(), timeout=100), root


@pytest.mark.timeout(120)
def test_every_rank_file_with_a_payload_is_refused_by_name_and_nothing_runs(two_ranks):
    results, root = two_ranks
    for rank, out in enumerate(results):
        r = out["poisoned"]
        assert r["error"] is not None, f"rank {rank} loaded a checkpoint with a pickle payload"
        assert f"{r['path']!r} is refused" in r["error"], r["error"]
        assert "corrupt" not in r["error"]  # the checksums were fixed up: the unpickler refused it
        assert "open" in r["error"] if rank == 0 else "system" in r["error"], r["error"]
        assert r["markers_seen"] == [] and not os.path.exists(r["marker"])
    # Control: the same files under the full unpickler do run the payloads.
    for rank, out in enumerate(results):
        torch.load(out["poisoned"]["path"], pickle_module=pickle)
        assert os.path.exists(out["poisoned"]["marker"]), "the planted payload is not live: the test proves nothing"


@pytest.mark.timeout(120)
def test_stage3_with_frozen_parameters_round_trips(two_ranks):
    if not _have_transformers():
        pytest.skip("transformers is not installed (tests/adapters.py lora_llama)")
    results, _ = two_ranks
    assert [out["frozen"] for out in results] == [[], []]


# -- one process: placements of a payload; what the engine saves round-trips ------------------

def _engine(cfg, seed: int = 0, **wrap_kwargs):
    return tiertrain.wrap(make_model(seed=seed), cfg, tiertrain.Topology.build(cfg.parallel), **wrap_kwargs)


@pytest.mark.parametrize("where", ["whole file", "rng part", "scaler part"])
def test_a_payload_anywhere_in_the_file_is_refused(tmp_path, where):
    marker = str(tmp_path / "PWNED")
    cfg = make_config(batch={"micro_batch_size": MICRO})
    engine = _engine(cfg)
    step_dir = engine.save_checkpoint(str(tmp_path / "ckpt"))

    def put(state):
        if where == "whole file":
            return Payload(marker)
        if where == "rng part":
            state["rng"]["cpu"] = Payload(marker, "system")
        else:
            state["scaler"]["scale"] = Payload(marker)
        return state
    path = _plant(step_dir, 0, put)
    with pytest.raises(CheckpointError, match=r"rank00000\.pt' is refused: .*unpickle"):
        engine.load_checkpoint(str(tmp_path / "ckpt"))
    assert not os.path.exists(marker)
    assert path.endswith("rank00000.pt")


SGD = functools.partial(torch.optim.SGD, lr=0.5, momentum=0.9)
ONE_CYCLE = functools.partial(lr_scheduler.OneCycleLR, max_lr=0.5, total_steps=6)

ROUND_TRIPS = {
    "adamw": ({}, {}),
    "fp16 loss scaler": ({"precision": {"dtype": "fp16"}, "zero": {"stage": 1}}, {}),
    "sgd one-cycle": ({"zero": {"stage": 2}}, {"optimizer": SGD, "lr_scheduler": ONE_CYCLE}),
    "step lr": ({"zero": {"stage": 1}}, {"optimizer": SGD, "lr_scheduler": functools.partial(
        lr_scheduler.StepLR, step_size=1, gamma=0.7)}),
    "nvme optimizer": ({"zero": {"stage": 2, "offload_optimizer": "nvme", "nvme_chunk_mb": 0.01}}, {}),
    "delayed update": ({"zero": {"stage": 2, "offload_optimizer": "cpu", "delayed_update": True,
                                 "delayed_update_warmup": 1}}, {}),
}


@pytest.mark.parametrize("case", list(ROUND_TRIPS))
def test_what_the_engine_saves_round_trips(tmp_path, case):
    sections, wrap_kwargs = ROUND_TRIPS[case]

    def config(swap: str):  # (each live engine swaps to its own directory)
        zero = {**sections.get("zero", {})}
        if zero.get("offload_optimizer") == "nvme":
            zero["nvme_path"] = str(tmp_path / swap)
        return make_config(batch={"micro_batch_size": MICRO}, **{**sections, "zero": zero})
    batches = global_batches(3, MICRO)
    first = _engine(config("swap1"), **wrap_kwargs)
    for batch in batches[:2]:
        first.train_batch(rank_slices(batch, 0, 1, MICRO, 1))
    extra = {"next_batch": 2, "sampler": {"consumed_samples": 4, "shuffle": True, "seed": None},
             "history": [1.5, (2, "x")]}
    first.save_checkpoint(str(tmp_path / "ckpt"), extra=extra)
    before = _snapshot(first.state_dict())
    second = _engine(config("swap2"), seed=5, **wrap_kwargs)
    assert second.load_checkpoint(str(tmp_path / "ckpt")) == extra
    assert _differences(before, second.state_dict()) == []
    assert second.steps == 2
    # ... and both go on alike.
    losses = [e.train_batch(rank_slices(batches[2], 0, 1, MICRO, 1)) for e in (first, second)]
    assert losses[0] == losses[1]
    first.close()
    second.close()


# -- save time: what could not load safely is never written ---------------------------------

@pytest.mark.parametrize("extra,where", [
    ({"a": {"b": torch.ones(1)}}, r"extra\['a'\]\['b'\] is torch\.Tensor"),
    ({"ids": {1, 2}}, r"extra\['ids'\] is builtins\.set"),
    ({"obj": [1, Payload("x")]}, r"extra\['obj'\]\[1\] is test_checkpoint_pickle\.Payload"),
    ({"d": {3: "x"}}, r"extra\['d'\] has the key builtins\.int"),
])
def test_an_extra_that_is_not_json_like_is_refused_at_save_naming_the_key(tmp_path, extra, where):
    engine = _engine(make_config(batch={"micro_batch_size": MICRO}))
    with pytest.raises(CheckpointError, match=where):
        engine.save_checkpoint(str(tmp_path / "ckpt"), extra=extra)
    assert not os.path.exists(tmp_path / "ckpt")  # nothing written, nothing committed


class Colour(enum.Enum):
    RED = 1


class Level(enum.IntEnum):
    HIGH = 3


def test_part_states_are_made_plain_losslessly_or_refused_by_key_path():
    numpy = pytest.importorskip("numpy")
    Pair = collections.namedtuple("Pair", "a b")
    state = {"n": numpy.float32(0.5), "i": numpy.int64(7), "level": Level.HIGH, "pair": Pair(1, numpy.bool_(True)),
             "frozen": frozenset({1}), "dd": collections.defaultdict(list, {1: [2]}), "size": torch.Size([2, 3]),
             "t": torch.ones(2), "set": {3}, "dtype": torch.bfloat16}
    plain = plain_state(state)
    assert plain == {**state, "pair": (1, True), "frozen": {1}, "dd": {1: [2]}, "t": plain["t"]}
    assert [type(plain[k]) for k in ("n", "i", "level", "pair", "frozen", "dd")] == [float, int, int, tuple, set, dict]
    assert plain["t"] is state["t"]  # tensors are not copied
    with pytest.raises(CheckpointError, match=r"state\['part'\]\['x'\]\[1\] is test_checkpoint_pickle\.Colour "
                                              r".*save its \.value"):
        plain_state({"part": {"x": [0, Colour.RED]}})
    with pytest.raises(CheckpointError, match=r"state\['a'\] is numpy\.ndarray .*torch\.from_numpy"):
        plain_state({"a": numpy.zeros(2)})
    with pytest.raises(CheckpointError, match=r"state\['f'\] is builtins\.function"):
        plain_state({"f": lambda: None})
    assert json_like_extra(None) == {}
