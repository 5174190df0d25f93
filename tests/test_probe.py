"""Specification of tiertrain.estimate.probe: what a hardware probe measures, how it
fails, and its JSON file."""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
import torch

import tiertrain.estimate.probe as probe_module
from tiertrain.estimate import probe_hardware
from tiertrain.estimate.probe import HardwareProbe, load_probe, probe, read_meminfo


def test_quick_probe_of_a_swap_dir_measures_everything_in_under_3_seconds(tmp_path):
    t0 = time.perf_counter()
    p = probe(tmp_path, quick=True)
    assert time.perf_counter() - t0 < 3.0
    assert p.quick and p.cpu_count >= 1
    assert 0 < p.ram_available_bytes <= p.ram_total_bytes
    assert p.host_copy_gbps > 0
    assert p.swap_dir == str(tmp_path) and p.swap_free_bytes > 0
    assert p.swap_write_gbps > 0 and p.swap_read_gbps > 0
    assert isinstance(p.swap_o_direct, bool)
    if not p.swap_o_direct:
        assert any("O_DIRECT" in n for n in p.notes)
    assert list(tmp_path.iterdir()) == []  # the temporary file is removed


def test_probe_without_swap_dir_leaves_swap_fields_empty():
    p = probe_hardware(quick=True)
    assert (p.swap_dir, p.swap_free_bytes, p.swap_write_gbps, p.swap_read_gbps, p.swap_o_direct) == (
        None, None, None, None, None)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only answer")
def test_without_cuda_the_device_fields_are_none():
    p = probe(None, quick=True)
    assert (p.cuda_device, p.cuda_memory_bytes, p.h2d_gbps, p.d2h_gbps, p.bf16_matmul_tflops) == (
        None, None, None, None, None)
    assert any("CUDA not available" in n for n in p.notes)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_with_cuda_the_device_fields_are_measured():
    p = probe(None, quick=True)
    assert p.cuda_memory_bytes > 0 and 0 < p.cuda_free_bytes <= p.cuda_memory_bytes
    assert p.h2d_gbps > 0 and p.d2h_gbps > 0 and p.bf16_matmul_tflops > 0


def test_filesystem_without_o_direct_falls_back_with_a_note(tmp_path, monkeypatch):
    """tmpfs (before Linux 6.6) rejects O_DIRECT with EINVAL: buffered I/O is used instead."""
    real_open = os.open

    def no_direct(path, flags, *args):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(probe_module.os, "open", no_direct)
    p = probe(tmp_path, quick=True)
    assert p.swap_o_direct is False and p.swap_write_gbps > 0 and p.swap_read_gbps > 0
    assert any("O_DIRECT unsupported" in n and str(tmp_path) in n for n in p.notes)


def test_missing_swap_dir_is_named(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(ValueError, match=rf"swap_dir='{missing}'.*does not exist"):
        probe(missing, quick=True)


def test_swap_dir_that_is_a_file_is_named(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match=rf"swap_dir='{f}'.*not a directory"):
        probe(f, quick=True)


def test_unwritable_swap_dir_is_named(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_module.os, "access", lambda path, mode: False)
    with pytest.raises(ValueError, match=rf"swap_dir='{tmp_path}'.*not writable"):
        probe(tmp_path, quick=True)


@pytest.mark.skipif(os.geteuid() == 0, reason="root can write to a read-only directory")
def test_read_only_swap_dir_is_named(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir(mode=0o500)
    with pytest.raises(ValueError, match=rf"swap_dir='{ro}'.*not writable"):
        probe(ro, quick=True)


def test_save_and_load_round_trip(tmp_path):
    p = probe(None, quick=True)
    path = p.save(tmp_path / "probe.json")
    assert json.loads(path.read_text())["cpu_count"] == p.cpu_count
    assert load_probe(path) == p == HardwareProbe.load(path)


def test_load_rejects_missing_and_foreign_files(tmp_path):
    with pytest.raises(ValueError, match="no such file"):
        load_probe(tmp_path / "absent.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"cpu_count": 2, "gpu_count": 8}))
    with pytest.raises(ValueError, match=r"unknown fields \['gpu_count'\]"):
        load_probe(bad)
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not JSON"):
        load_probe(bad)


def test_meminfo_values_are_bytes(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       2048 kB\nMemAvailable:   1024 kB\nHugePages_Total:       0\n")
    assert read_meminfo(str(f)) == {"MemTotal": 2048 * 1024, "MemAvailable": 1024 * 1024,
                                    "HugePages_Total": 0}
