"""ZeRO-Offload and ZeRO-Infinity: optimizer state (and, at stage 3, parameter shards) on
the CPU or NVMe tier trains exactly like keeping everything on the device (docs/concepts.md#zero-offload,
docs/concepts.md#zero-infinity). On a machine without an accelerator the device and CPU tiers are both host memory
and the same copies run; the NVMe tier is swap files in a temporary directory."""
from __future__ import annotations

import pytest
import torch

from reference import engine_train, global_batches, make_config, make_model
from tiertrain.testing import run_distributed

CASES = [  # (stage, offload_optimizer, offload_params, dtype, activation checkpoints, grad_clip)
    (2, "cpu", "none", "fp32", "none", 0.05), (2, "cpu", "none", "bf16", "none", 0.05),
    (2, "cpu", "none", "fp32", "cpu", 0.05), (3, "cpu", "none", "fp32", "none", 0.05),
    (3, "none", "cpu", "fp32", "none", 0.05), (3, "cpu", "cpu", "fp32", "none", 0.05),
    (3, "cpu", "cpu", "bf16", "none", 0.05), (3, "cpu", "cpu", "fp32", "cpu", 0.05),
    (3, "none", "nvme", "fp32", "none", 0.05), (3, "cpu", "nvme", "fp32", "none", 0.05),
    (3, "cpu", "nvme", "bf16", "none", 0.05), (3, "cpu", "nvme", "fp32", "cpu", 0.05),
    # The NVMe optimizer with clipping steps after backward; without, it updates each unit
    # during backward as soon as its gradient is reduced (tiertrain/update/nvme/overlapped_step.py).
    (2, "nvme", "none", "fp32", "none", 0.05), (2, "nvme", "none", "fp32", "none", 0.0),
    (2, "nvme", "none", "bf16", "cpu", 0.0), (3, "nvme", "cpu", "fp32", "none", 0.05),
    (3, "nvme", "cpu", "fp32", "none", 0.0), (3, "nvme", "nvme", "fp32", "none", 0.05),
    (3, "nvme", "nvme", "fp32", "none", 0.0), (3, "nvme", "nvme", "bf16", "cpu", 0.0),
]


def _runs(rank, world, stage, offload_optimizer, offload_params, dtype, checkpoints, clip, nvme_path):
    out = []
    for opt, par, ckpt in (("none", "none", "none"), (offload_optimizer, offload_params, checkpoints)):
        activations = {"checkpoint_every": 1, "offload": "cpu"} if ckpt == "cpu" else {}
        # (small stage-2 buckets: several units, so some reductions land during backward)
        cfg = make_config(zero={"stage": stage, "offload_optimizer": opt, "offload_params": par,
                                "nvme_path": nvme_path, "bucket_mb": 0.02}, activations=activations,
                          precision={"dtype": dtype}, batch={"micro_batch_size": 2, "grad_accum_steps": 2},
                          optimizer={"grad_clip": clip})
        losses, params, engine = engine_train(rank, world, make_model(), cfg, global_batches(3, 8))
        out.append((losses, params, engine.memory_report(), engine.last_overlapped_step))
    return out


@pytest.mark.timeout(60)
@pytest.mark.parametrize("stage,offload_optimizer,offload_params,dtype,checkpoints,clip", CASES)
def test_offloaded_run_is_identical_to_device_run(tmp_path, stage, offload_optimizer, offload_params, dtype,
                                                  checkpoints, clip):
    (base_losses, base_params, base_mem, _), (losses, params, mem, overlapped) = run_distributed(
        _runs, 2, stage, offload_optimizer, offload_params, dtype, checkpoints, clip, str(tmp_path / "swap"),
        timeout=50)[0]
    assert losses == base_losses
    assert all(torch.equal(params[k], base_params[k]) for k in params)
    if offload_optimizer == "nvme" and clip == 0:  # units were declared ready during backward
        assert overlapped["shards"] > 1 and 0 < overlapped["shards_ready"] < overlapped["shards"]
    else:
        assert overlapped is None
    assert base_mem.cpu_tier == 0
    in_cpu = {"grads": offload_optimizer != "none", "optimizer": offload_optimizer == "cpu",
              "params": offload_params == "cpu"}
    in_nvme = {"optimizer": offload_optimizer == "nvme", "params": offload_params == "nvme"}
    assert mem.cpu_tier == sum(getattr(mem, kind) for kind, where in in_cpu.items() if where)
    assert mem.nvme_tier == sum(getattr(mem, kind) for kind, where in in_nvme.items() if where)
    if offload_optimizer == "nvme" and offload_params == "nvme" and dtype == "fp32":
        assert mem.optimizer == 2 * mem.grads  # the moments: each fp32 master is its parameter shard, counted once
    elif offload_optimizer == "nvme":  # fp32 master, exp_avg and exp_avg_sq of each gradient element
        assert mem.optimizer == 3 * mem.grads
    assert base_mem.activation_checkpoints == 0
    if checkpoints == "cpu":  # every block's input, [micro_batch, seq, hidden] in the compute dtype
        tiny = make_model().config
        expected = tiny.n_layers * 2 * tiny.seq_len * tiny.hidden * (4 if dtype == "fp32" else 2)
        assert mem.activation_checkpoints == mem.activation_checkpoints_cpu == expected


def _nvme_engine(nvme_path, **zero):
    import tiertrain

    cfg = make_config(zero={"stage": 3, "offload_params": "nvme", "nvme_path": nvme_path, **zero},
                      batch={"micro_batch_size": 2})
    return tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))


def test_unusable_nvme_path_is_refused_at_wrap_naming_it(tmp_path):
    from tiertrain.io import SwapDirError

    not_a_dir = tmp_path / "file"
    not_a_dir.write_bytes(b"x")
    with pytest.raises(SwapDirError, match=str(not_a_dir)):
        _nvme_engine(str(not_a_dir))


def test_truncated_parameter_swap_file_is_an_error_naming_it(tmp_path):
    import os

    from tiertrain.io import SwapError

    engine = _nvme_engine(str(tmp_path), nvme_kept_units=0)
    batch = global_batches(1, 2)[0]
    engine.train_batch(iter([batch]))
    files = sorted(p for p in (tmp_path / "rank0").iterdir() if p.name.endswith(".swp"))
    assert files, "parameter shards are in swap files"
    # Every file: the end of a step prefetches the next forward's reads, which may have landed
    # already; backward reads every unit again (none kept in RAM).
    for path in files:
        os.truncate(path, 0)
    with pytest.raises(SwapError, match="|".join(p.name for p in files)):
        engine.train_batch(iter([batch]))


@pytest.mark.parametrize("masters", [False, True], ids=["shard-files", "optimizer-masters"])
def test_parameter_shards_are_read_from_nvme_ahead_of_use(tmp_path, masters):
    """After the first (traced) step, each gather finds its shard's read already started
    (ZeRO-Infinity's prefetch: reads for the next units overlap the current one), straight into
    the staging tensor it then takes (no copy out of the swap pool): from the units' own files,
    or from the optimizer's master records when those are the shards."""
    zero = {"offload_optimizer": "nvme", "nvme_in_place": True} if masters else {}
    engine = _nvme_engine(str(tmp_path), **zero)
    store = engine.flat.shards
    assert store.holds_masters(engine.flat.units[-1].unit.index) == masters
    batch = global_batches(1, 2)[0]
    engine.train_batch(iter([batch]))
    assert store.read_ahead_taken == 0  # the first step records the order
    reused_before = store.values_reused
    copies_before = engine.swapper.cpu_seconds["copy"]
    engine.train_batch(iter([batch]))
    units = sum(not u.unit.resident for u in engine.flat.units)
    # forward and backward each gather every unit; those backward takes from the staging of
    # forward's last gathers read nothing, and every read is prefetched but possibly
    # backward's first (the end of the step starts the next forward's first reads)
    reused = store.values_reused - reused_before
    assert reused < 2 * units and (reused > 0 or engine.flat.streams.defer)  # (the deferred-copy harness keeps none)
    assert store.read_ahead_taken >= 2 * units - reused - 1
    if masters and not engine.flat.streams.defer:  # (shard files: the step's shard writes copy into the pool)
        assert engine.swapper.cpu_seconds["copy"] == copies_before  # (the reads landed in the staging)


def test_backward_takes_the_last_forward_units_from_ram_and_a_step_invalidates_them(tmp_path):
    """At the turn from forward to backward, the units forward gathered last are gathered
    again first: their values are still in the kept staging tensors, so they are not read from
    NVMe again (zero.nvme_kept_units per shard size). After the optimizer step those values are
    stale, and the next forward reads every unit (the run's numerics are checked against the
    device run by test_offloaded_run_is_identical_to_device_run)."""
    import collections

    engine = _nvme_engine(str(tmp_path))
    store = engine.flat.shards
    batch = global_batches(1, 2)[0]
    sizes = collections.Counter(u.unit.shard_numel for u in engine.flat.units if not u.unit.resident)
    kept = sum(min(count, store.kept_units) for count in sizes.values())  # (every unit is among the last of its size here)
    for _ in range(2):
        before = store.values_reused
        engine.train_batch(iter([batch]))
        if engine.flat.streams.defer:  # (the deferred-copy harness hands each gather a copy of its own)
            assert store.values_reused == 0
        else:  # (stale values taken by the next forward would count too)
            assert store.values_reused - before == kept
    assert kept > 0


def test_parameters_edited_in_place_are_not_served_from_the_kept_staging(tmp_path):
    """fp32 shards that are the in-place NVMe optimizer's masters, edited outside training
    (gathered_parameters with a modifier rank): the next gathers see the edit, not the values
    the staging tensors kept from before it."""
    engine = _nvme_engine(str(tmp_path), offload_optimizer="nvme", nvme_in_place=True)
    assert engine.flat.shards.holds_masters(engine.flat.units[-1].unit.index)
    batch = global_batches(1, 2)[0]
    engine.train_batch(iter([batch]))
    params = list(engine.module.parameters())
    with engine.gathered_parameters(params):
        before = [p.detach().clone() for p in params]
    with engine.gathered_parameters(params, modifier_rank=0):
        for p in params:
            p.data.add_(1.0)
    with engine.gathered_parameters(params):
        assert all(torch.equal(p.detach(), b + 1.0) for p, b in zip(params, before))


def _masters_from_gathers_run(rank, world, nvme_path, kept_units, chunk_mb):
    runs = []
    for zero in ({}, {"offload_params": "nvme", "offload_optimizer": "nvme", "nvme_in_place": True,
                      "nvme_kept_units": kept_units, "nvme_chunk_mb": chunk_mb}):
        # (small chunks: several per unit, so that most of a unit's chunks are read after its
        # gradient is complete, when backward's gather has just read its masters)
        cfg = make_config(zero={"stage": 3, "nvme_path": nvme_path, **zero}, optimizer={"grad_clip": 0.0},
                          batch={"micro_batch_size": 2})
        steps = []

        def record(engine):
            store, stats = engine.flat.shards, engine.update.nvme.last_stats
            steps.append({"handed": store.masters_handed, "from_ram": stats.masters_from_ram,
                          "in_place": stats.masters_updated_in_ram, "chunks": stats.chunks,
                          "carry_copies": store.copy_cpu_seconds > 0, "step_copies": stats.master_copy_cpu_seconds > 0, "bytes_read": stats.bytes_read,
                          "state_bytes": engine.update.nvme.state_bytes, "defer": engine.flat.streams.defer})
        losses, params, engine = engine_train(rank, world, make_model(), cfg, global_batches(3, 4))
        if zero:
            record(engine)
        runs.append((losses, params, steps))
    return runs


PAGE_CHUNK_MB = 1024 * 12 / 2**20
"""nvme_chunk_mb of 1024 elements (master + moments): chunks cut at page boundaries of the shard
(the tiny model's parameters start at multiples of 64 elements, except 32-element ones that no
cut falls in)."""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kept_units,chunk_mb", [(2, PAGE_CHUNK_MB), (2, 0.01), (0, PAGE_CHUNK_MB)],
                         ids=["page-chunks", "unaligned-chunks", "nothing-kept"])
def test_the_step_in_backward_takes_the_masters_backwards_gathers_read(tmp_path, kept_units, chunk_mb):
    """fp32 parameters and the in-place optimizer on NVMe: as each unit's gradient completes,
    the staging its backward gather read (its pre-step masters) goes to the step running in
    backward, which then reads only the chunks' moments (8 bytes per element, not 12). A chunk
    at a page boundary of that staging is updated in it and its master written from it, with
    no copy (page-sized chunks: every one; 832-element chunks: only a shard's first, the others
    are copied into the step's buffer). The run is the device run bit for bit; with no kept
    units nothing is handed over and every chunk reads its master from disk."""
    (base_losses, base_params, _), (losses, params, steps) = run_distributed(
        _masters_from_gathers_run, 2, str(tmp_path / "swap"), kept_units, chunk_mb, timeout=50)[0]
    assert losses == base_losses
    assert all(torch.equal(params[k], base_params[k]) for k in params)
    (last,) = steps
    if kept_units == 0 or last["defer"]:  # (the deferred-copy harness gathers from copies of the staging)
        assert last["handed"] == 0 and last["from_ram"] == 0
        assert last["bytes_read"] == last["state_bytes"]  # every chunk: master + moments
    else:
        assert last["handed"] > 0 and 0 < last["from_ram"] <= last["chunks"]
        assert last["bytes_read"] < last["state_bytes"]  # the masters of those chunks were not read
        if chunk_mb == PAGE_CHUNK_MB:
            assert last["in_place"] == last["from_ram"] and not last["step_copies"]
            assert not last["carry_copies"]  # (the carried units were updated in their staging)
        else:
            assert last["in_place"] < last["from_ram"] and last["step_copies"]


def test_the_next_forward_takes_the_units_the_step_updated_last_from_ram(tmp_path):
    """The units whose gradients complete last in backward are the first the next forward
    gathers: the step running in backward leaves their updated masters in the staging it took
    them from, and once it has committed the next forward's gathers take them from RAM. With
    as many kept units as units here, that is every unit: the forward reads nothing from disk
    (the numerics of runs that do this are checked against the device run above)."""
    import tiertrain

    cfg = make_config(zero={"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_in_place": True,
                            "nvme_path": str(tmp_path), "nvme_kept_units": 8, "nvme_chunk_mb": 0.01},
                      optimizer={"grad_clip": 0.0}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    store, batch = engine.flat.shards, global_batches(1, 2)[0]
    units = sum(store.holds_masters(u.unit.index) for u in engine.flat.units)
    assert 0 < units <= store.kept_units
    engine.train_batch(iter([batch]))
    for _ in range(2):
        reused, reads = store.values_reused, engine.swapper.stats["swap_in"]
        loss = engine(batch)
        if engine.flat.streams.defer:  # (the deferred-copy harness gathers from copies of the staging)
            assert store.values_reused == reused
        else:
            assert store.values_reused - reused == units
            assert engine.swapper.stats["swap_in"] == reads
        engine.backward(loss)
        assert engine.step()


def test_staging_handed_to_the_step_comes_back_to_be_reused_not_reallocated(tmp_path):
    """A staging tensor handed to the step leaves a gap that the next gather fills with a new
    tensor; when it comes back it is kept among the spares (within kept + handed + the one
    being read), so after the first steps every gather reuses a tensor: none is allocated (a
    new one faults its pages in again, at the gather's read)."""
    import tiertrain

    cfg = make_config(zero={"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_in_place": True,
                            "nvme_path": str(tmp_path), "nvme_kept_units": 1, "nvme_chunk_mb": 0.01},
                      optimizer={"grad_clip": 0.0}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    store, batch = engine.flat.shards, global_batches(1, 2)[0]
    for _ in range(2):
        engine.train_batch(iter([batch]))
    for _ in range(3):
        allocated, handed = store.staging_allocated, store.masters_handed
        engine.train_batch(iter([batch]))
        if not engine.flat.streams.defer:  # (the deferred-copy harness gathers from copies of the staging)
            assert store.masters_handed > handed
            assert store.staging_allocated == allocated


def test_with_no_kept_units_every_gather_reads_the_disk(tmp_path):
    engine = _nvme_engine(str(tmp_path), nvme_kept_units=0)
    batch = global_batches(1, 2)[0]
    engine.train_batch(iter([batch]))  # (its end starts the next forward's first reads: counted in it)
    for _ in range(2):
        reads = engine.swapper.stats["swap_in"]
        engine.train_batch(iter([batch]))
        assert engine.swapper.stats["swap_in"] - reads == 2 * sum(not u.unit.resident for u in engine.flat.units)
    assert engine.flat.shards.values_reused == 0


def test_nvme_gathers_reuse_their_staging_and_the_swap_cpu_is_counted(tmp_path):
    """The read of every gather after the first few lands in a staging tensor an earlier gather
    returned (no fresh pages to fault in per read), and the CPU time of the swap layer's copies
    and checksums is counted (bench/scale.py reports it as a share of the step's CPU)."""
    engine = _nvme_engine(str(tmp_path))
    batch = global_batches(1, 2)[0]
    store = engine.flat.shards
    engine.train_batch(iter([batch]))
    first = store.staging_reused
    engine.train_batch(iter([batch]))
    units = sum(not u.unit.resident for u in engine.flat.units)
    if engine.flat.streams.defer:  # (the deferred-copy harness hands each gather a copy of its own)
        assert store.staging_reused == 0
    else:
        assert store.staging_reused - first >= 2 * units - 2 * store.kept_units  # forward and backward reads
    assert engine.swapper.cpu_seconds["copy"] > 0 and engine.swapper.aio.cpu_seconds["checksum"] > 0
    assert engine.swapper.aio.checksum == "xxh3"
