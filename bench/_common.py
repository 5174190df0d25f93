"""Helpers shared by the benchmark scripts: a free port, the workers' gloo process group,
running spawned ranks, shell and /proc probes, and the machine description of a results file.

Scripts are run as ``python bench/NAME.py`` (bench/ is then on sys.path) and import this as
``from _common import ...``. Only the standard library is imported at module level and
nothing from tiertrain: torch is imported inside the functions that need it, so a driver that
keeps its own process light (plan_to_train.py plans with the RAM it leaves free) stays so.
"""
from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import socket
import subprocess
import time
from typing import Any, Callable, Sequence

GiB = 1 << 30


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world: int, port: int, *, threads: int, timeout_s: float,
              ignore: type[Warning] = FutureWarning) -> None:
    """Join a spawned rank to the gloo group: torchrun-style env (DS_ACCELERATOR=cpu unless set), threads, warnings."""
    import warnings

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      DS_ACCELERATOR=os.environ.get("DS_ACCELERATOR", "cpu"))
    torch.set_num_threads(threads)
    warnings.filterwarnings("ignore", category=ignore)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=timeout_s))


def gather_results(out: dict, result_path: str) -> None:
    """Gather every rank's result dict; rank 0 writes the list (in rank order) to result_path as JSON."""
    import torch.distributed as dist

    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out)
    if dist.get_rank() == 0:
        with open(result_path, "w") as f:
            json.dump(gathered, f, default=str)


def spawn_ranks(worker: Callable[..., Any], args: tuple, world: int, timeout_s: float, what: str) -> None:
    """Run worker(rank, *args) in `world` fresh spawned processes; kill them all and re-raise on error or timeout."""
    import torch.multiprocessing as mp

    ctx = mp.start_processes(worker, args=args, nprocs=world, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not ctx.join(timeout=2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what}: not done after {timeout_s}s")
    except BaseException:
        for proc in ctx.processes:
            if proc.is_alive():
                proc.kill()
        raise


def sh(cmd: str, timeout: float = 60) -> str:
    """A shell command's stripped stdout, or "(error)" when it cannot be run or times out."""
    try:
        return subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=timeout).stdout.strip()
    except Exception as e:  # noqa: BLE001
        return f"({e})"


def meminfo(key: str) -> int:
    """A /proc/meminfo field (MemTotal, MemAvailable, ...) in bytes; KeyError if absent."""
    with open("/proc/meminfo") as f:
        fields = dict(line.split(":", 1) for line in f)
    return int(fields[key].split()[0]) * 1024


def loadavg(fields: int = 3) -> str:
    """The first `fields` fields of /proc/loadavg (3: the 1/5/15-minute load averages), or "?"."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:fields])
    except OSError:
        return "?"


def machine_lines(*, dirs: Sequence[str] = (), packages: Sequence[str] = (), debs: Sequence[str] = (),
                  torch_threads: bool = False, lscpu_head: bool = False) -> list[str]:
    """Lines describing this machine: host, cores, CPU model, memory, versions; optionally disks of dirs and lscpu."""
    def version(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = sh("lscpu | sed -n 's/^Model name: *//p'") or platform.processor() or platform.machine()
    memory = f"{meminfo('MemTotal') / GiB:.1f} GiB total, {meminfo('MemAvailable') / GiB:.1f} GiB available"
    software = [f"python {platform.python_version()}"]
    software += [f"{name} {version(name)}" for name in ("torch", *packages)]
    for name in debs:  # Debian packages, e.g. libaio-dev for DeepSpeed's async_io op
        deb = sh("dpkg-query -W -f='${Version}' " + shlex.quote(name) + " 2>/dev/null")
        software.append(f"{name} {deb or 'not installed'}")
    if torch_threads:
        import torch

        software.append(f"{torch.get_num_threads()} torch threads, CPU capability "
                        f"{torch.backends.cpu.get_cpu_capability()}")
    lines = [f"host: {platform.node()}, {platform.platform()}",
             f"nproc: {os.cpu_count()} ({usable} usable); CPU: {cpu}",
             f"memory: {memory}",
             ", ".join(software)]
    for d in dirs:
        q = shlex.quote(d)
        lines.append(f"swap dir `{d}`: filesystem `{sh(f'df --output=fstype {q} | tail -1')}`, device "
                     f"`{sh(f'df --output=source {q} | tail -1')}`; `df -h`: `{sh(f'df -h {q} | tail -1')}`")
    if lscpu_head:
        lines += ["lscpu | head:", sh("lscpu | head")]
    return lines


def print_and_write(text: str, out: str) -> None:
    """Print a results text and, when out is a path, write it there."""
    print(text)
    if out:
        with open(out, "w") as f:
            f.write(text)
