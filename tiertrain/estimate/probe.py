"""Measure this machine's figures the planner needs (ZeRO-Infinity §4 bandwidths).

:func:`probe` reports CPU count, RAM (``/proc/meminfo``, plus a cgroup limit if one is
set), host memory bandwidth (a timed torch tensor copy, STREAM "copy" convention: read +
written bytes per second), free space and sequential O_DIRECT write/read bandwidth of a
swap directory (the NVMe tier), and, only when CUDA is available, device memory,
host<->device bandwidth over pinned memory and bf16 matmul TFLOP/s. GB/s is 1e9 bytes/s.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import platform
import shutil
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

__all__ = ["HardwareProbe", "probe", "load_probe", "read_meminfo", "measure_host_copy_gbps",
           "measure_direct_io", "measure_cpu_matmul_gflops"]


@dataclass
class HardwareProbe:
    """What :func:`probe` measured; saved to and loaded from a small JSON file."""

    cpu_count: int
    """CPUs this process may run on (scheduler affinity)."""
    ram_total_bytes: int
    """MemTotal from /proc/meminfo."""
    ram_available_bytes: int
    """MemAvailable from /proc/meminfo (capped by the cgroup limit when one is set)."""
    cgroup_memory_limit_bytes: int | None
    """cgroup v2 memory.max (or v1 limit_in_bytes); None when unlimited or unknown."""
    host_copy_gbps: float
    """Host memory bandwidth, GB/s: 2·bytes / time of the best large tensor copy."""
    swap_dir: str | None = None
    """Directory probed as the NVMe tier; None when not asked for."""
    swap_free_bytes: int | None = None
    """Free space of ``swap_dir`` (shutil.disk_usage)."""
    swap_write_gbps: float | None = None
    """Sequential write bandwidth of ``swap_dir``, GB/s (fsync included)."""
    swap_read_gbps: float | None = None
    """Sequential read bandwidth of ``swap_dir``, GB/s."""
    swap_o_direct: bool | None = None
    """Whether O_DIRECT worked there; False means buffered I/O (see ``notes``)."""
    cuda_device: str | None = None
    """CUDA device name, None without CUDA."""
    cuda_memory_bytes: int | None = None
    """Total device memory."""
    cuda_free_bytes: int | None = None
    """Free device memory when probed."""
    h2d_gbps: float | None = None
    """Pinned host -> device copy bandwidth, GB/s."""
    d2h_gbps: float | None = None
    """Device -> pinned host copy bandwidth, GB/s."""
    bf16_matmul_tflops: float | None = None
    """Achieved bf16 square-matmul throughput, TFLOP/s (the planner's peak)."""
    cpu_matmul_gflops: float | None = None
    """Achieved fp32 square-matmul throughput on the CPU with torch's threads, GFLOP/s (the
    planner's peak without an accelerator)."""
    framework_overhead_bytes: int | None = None
    """Peak-RSS increase of a training rank beyond its tensors (gloo, BLAS, autograd,
    allocator metadata), from a 2-rank run of a negligible GPT (tiertrain.estimate.measure)."""
    allocator_retention: float | None = None
    """Fraction of a rank's transient bytes (activations, buckets) the host allocator keeps
    resident on top of them (glibc heap fragmentation), from a 2-rank run of the small GPT."""
    quick: bool = False
    """Small sizes were used (fast, noisier numbers)."""
    host: str = ""
    """Hostname the probe ran on."""
    torch_version: str = ""
    """torch.__version__ at probe time."""
    notes: list[str] = field(default_factory=list)
    """Fallbacks and caveats, in words."""

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready dict of the fields."""
        return asdict(self)

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Write the probe as JSON to ``path``; return the path."""
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return p

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "HardwareProbe":
        """Read a probe saved by :meth:`save`; ValueError on missing file or bad content."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"HardwareProbe.load path={str(p)!r} is invalid: no such file")
        try:
            data = json.loads(p.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"HardwareProbe.load path={str(p)!r} is not JSON: {e}") from e
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names)
        if unknown:
            raise ValueError(f"HardwareProbe.load path={str(p)!r}: unknown fields {unknown}")
        try:
            return cls(**data)
        except TypeError as e:  # missing required fields
            raise ValueError(f"HardwareProbe.load path={str(p)!r}: {e}") from e


def load_probe(path: str | os.PathLike[str]) -> HardwareProbe:
    """Same as :meth:`HardwareProbe.load`."""
    return HardwareProbe.load(path)


# --------------------------------------------------------------------------- host


def read_meminfo(path: str = "/proc/meminfo") -> dict[str, int]:
    """/proc/meminfo as {key: bytes} (kB values converted)."""
    out: dict[str, int] = {}
    with open(path) as f:
        for line in f:
            key, _, rest = line.partition(":")
            parts = rest.split()
            if parts and parts[0].isdigit():
                out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    return out


def ram_available(mem: dict[str, int] | None = None, limit: int | None = None) -> int:
    """Bytes of host RAM a job may take now: MemAvailable (MemFree where the kernel has none),
    capped by the cgroup memory limit; ``mem`` and ``limit`` when already read."""
    mem = read_meminfo() if mem is None else mem
    limit = _cgroup_memory_limit() if limit is None else limit
    available = mem.get("MemAvailable", mem.get("MemFree", 0))
    return min(available, limit) if limit else available


def _cgroup_memory_limit() -> int | None:
    """cgroup memory limit in bytes, or None when unlimited / not visible."""
    for p in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            text = Path(p).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < (1 << 60):
            return int(text)
    return None


def measure_host_copy_gbps(nbytes: int, repeats: int = 3) -> float:
    """GB/s of ``dst.copy_(src)`` for ``nbytes`` tensors, best of ``repeats``, counting
    read + written bytes (2·nbytes) as STREAM's copy kernel does."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # fault the pages in before timing
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * nbytes / best / 1e9


def measure_cpu_matmul_gflops(n: int, repeats: int = 3) -> float:
    """GFLOP/s of an fp32 n×n matmul on the CPU with torch's current threads, best of repeats."""
    a = torch.randn(n, n)
    b = torch.randn(n, n)
    torch.matmul(a, b)  # warm up (BLAS thread pool, page faults)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.matmul(a, b)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


# --------------------------------------------------------------------------- swap dir


def _write_all(fd: int, buf: memoryview) -> None:
    """os.write until the whole buffer is written."""
    done = 0
    while done < len(buf):
        n = os.write(fd, buf[done:])
        if n <= 0:
            raise OSError(errno.EIO, "short write")
        done += n


def measure_direct_io(directory: str | os.PathLike[str], nbytes: int, block: int) -> tuple[float, float, bool, str | None]:
    """(write GB/s, read GB/s, used O_DIRECT, note) for a temporary ``nbytes`` file in
    ``directory`` written and read sequentially in ``block``-byte requests through a
    page-aligned (mmap) buffer. Falls back to buffered I/O + fsync + fadvise(DONTNEED)
    when the filesystem rejects O_DIRECT (tmpfs: EINVAL); the note says so."""
    page = mmap.PAGESIZE
    block = max(page, block // page * page)
    nblocks = max(1, nbytes // block)
    path = os.path.join(os.fspath(directory), f".tiertrain-probe-{os.getpid()}-{time.monotonic_ns()}")
    buf = mmap.mmap(-1, block)
    buf.write(os.urandom(min(block, 1 << 20)) * (block // min(block, 1 << 20)))
    view = memoryview(buf)
    direct = hasattr(os, "O_DIRECT")
    note = None if direct else "O_DIRECT not available on this OS: buffered I/O used"
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        try:
            fd = os.open(path, flags | (os.O_DIRECT if direct else 0), 0o600)
        except OSError as e:
            if not direct or e.errno != errno.EINVAL:
                raise
            direct = False
            note = (f"O_DIRECT unsupported on the filesystem of {os.fspath(directory)!r} "
                    "(EINVAL, e.g. tmpfs): buffered I/O with fsync and fadvise(DONTNEED) used; "
                    "the read figure may come from the page cache")
            fd = os.open(path, flags, 0o600)
        try:
            t0 = time.perf_counter()
            for _ in range(nblocks):
                _write_all(fd, view)
            os.fsync(fd)
            t_write = time.perf_counter() - t0
        finally:
            os.close(fd)
        fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if direct else 0))
        try:
            if not direct and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            got = 0
            while got < nblocks * block:
                n = os.readv(fd, [view])
                if n <= 0:
                    break
                got += n
            t_read = time.perf_counter() - t0
        finally:
            os.close(fd)
    finally:
        view.release()
        buf.close()
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
    total = nblocks * block
    return total / t_write / 1e9, got / t_read / 1e9, direct, note


def _check_swap_dir(swap_dir: str | os.PathLike[str]) -> str:
    """The directory as a string; ValueError naming it when missing, not a directory or
    not writable."""
    d = os.fspath(swap_dir)
    if not os.path.exists(d):
        raise ValueError(f"probe swap_dir={d!r} is invalid: it does not exist")
    if not os.path.isdir(d):
        raise ValueError(f"probe swap_dir={d!r} is invalid: not a directory")
    if not os.access(d, os.W_OK | os.X_OK):
        raise ValueError(f"probe swap_dir={d!r} is invalid: not writable by this process")
    return d


# --------------------------------------------------------------------------- cuda


def _probe_cuda(result: HardwareProbe, quick: bool) -> None:
    """Fill the CUDA fields of ``result`` (device 0)."""
    dev = torch.device("cuda", 0)
    props = torch.cuda.get_device_properties(dev)
    result.cuda_device = props.name
    result.cuda_memory_bytes = int(props.total_memory)
    result.cuda_free_bytes = int(torch.cuda.mem_get_info(dev)[0])
    nbytes = (32 if quick else 512) << 20
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    device = torch.empty(nbytes, dtype=torch.uint8, device=dev)

    def timed(fn, reps: int) -> float:
        fn()
        torch.cuda.synchronize(dev)
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize(dev)
            best = min(best, time.perf_counter() - t0)
        return best

    result.h2d_gbps = nbytes / timed(lambda: device.copy_(host, non_blocking=True), 3) / 1e9
    result.d2h_gbps = nbytes / timed(lambda: host.copy_(device, non_blocking=True), 3) / 1e9
    del host, device
    n = 2048 if quick else 8192
    a = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    reps = 3 if quick else 10

    def mm() -> None:
        for _ in range(reps):
            torch.matmul(a, b)

    result.bf16_matmul_tflops = 2 * n**3 * reps / timed(mm, 2) / 1e12


# --------------------------------------------------------------------------- entry point


def probe(swap_dir: str | os.PathLike[str] | None = None, quick: bool = False,
          overhead: bool | None = None) -> HardwareProbe:
    """Measure this machine. ``swap_dir``: directory to probe as the NVMe tier (a
    temporary file is written there and removed). ``quick``: small sizes, for tests
    (a few seconds at most); the full probe copies 512 MiB of RAM and writes up to 1 GiB.
    ``overhead`` (default: not quick; Linux): also measure a training rank's process
    overhead with two short 2-rank runs (tiertrain.estimate.measure.calibrate_overhead,
    ~15 s on 2 cores)."""
    d = _check_swap_dir(swap_dir) if swap_dir is not None else None
    mem = read_meminfo()
    limit = _cgroup_memory_limit()
    result = HardwareProbe(
        cpu_count=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1,
        ram_total_bytes=mem.get("MemTotal", 0),
        ram_available_bytes=ram_available(mem, limit),
        cgroup_memory_limit_bytes=limit,
        host_copy_gbps=0.0,
        quick=bool(quick),
        host=platform.node(),
        torch_version=str(torch.__version__),
    )
    copy_bytes = (64 << 20) if quick else min(512 << 20, max(64 << 20, result.ram_available_bytes // 8))
    result.host_copy_gbps = measure_host_copy_gbps(copy_bytes, repeats=3 if quick else 5)
    result.cpu_matmul_gflops = measure_cpu_matmul_gflops(256 if quick else 1024)
    if d is not None:
        result.swap_dir = os.path.abspath(d)
        result.swap_free_bytes = shutil.disk_usage(d).free
        size = (16 << 20) if quick else (1 << 30)
        size = min(size, max(result.swap_free_bytes // 4, 1 << 20))
        if size < (1 << 20):
            raise ValueError(f"probe swap_dir={d!r} is invalid: only {result.swap_free_bytes} bytes free")
        try:
            w, r, direct, note = measure_direct_io(d, size, (1 << 20) if quick else (8 << 20))
        except PermissionError as e:
            raise ValueError(f"probe swap_dir={d!r} is invalid: not writable ({e})") from e
        result.swap_write_gbps, result.swap_read_gbps, result.swap_o_direct = w, r, direct
        if note:
            result.notes.append(note)
    if overhead if overhead is not None else not quick:
        if os.path.exists("/proc/self/clear_refs"):
            from tiertrain.estimate.measure import calibrate_overhead

            cal = calibrate_overhead()
            result.framework_overhead_bytes = cal["framework_bytes"]
            result.allocator_retention = cal["retention"]
            result.notes.append(f"overhead calibration: framework run peaks {cal['framework_run']['peak']} B "
                                f"(tensors {cal['framework_run']['tensors']} B); 6 × 512 GPT stage-2 run peaks "
                                f"{cal['retention_run']['peak']} B (tensors {cal['retention_run']['tensors']} B, "
                                f"transient {cal['retention_run']['transient']} B)")
        else:
            result.notes.append("overhead not measured: needs Linux /proc (VmHWM reset)")
    if torch.cuda.is_available():
        _probe_cuda(result, quick)
    else:
        result.notes.append("CUDA not available: device memory, host<->device bandwidth and matmul peak not measured")
    return result
