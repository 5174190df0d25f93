"""Killed supervisors leave nothing that lasts (issue 32, item 8): a worker dies with its torchrun
agent or local launcher, and what a killed launcher could not remove (its launch directory, the
swap files and unfinished checkpoint saves its ranks registered) is removed by the next launch
or by ``tiertrain clean``, which names each thing it removed."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import pytest

from tiertrain import cli
from tiertrain.cleanup import LAUNCH_PREFIX, remove_abandoned_launches
from tiertrain.testing import another_job_holding

TINY = ["--model.n_layers", "1", "--model.hidden", "32", "--model.n_heads", "2", "--model.seq_len", "32",
        "--batch.micro_batch_size", "2", "--logging.progress", "false", "--logging.metrics_file", ""]


def _env(tmp_path) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1", TMPDIR=str(tmp_path / "tmp"))
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    os.makedirs(env["TMPDIR"], exist_ok=True)
    return env


def _children(pid: int) -> list[int]:
    out = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            out += [int(c) for c in f.read().split()]
    return out


def _exited(pid: int) -> bool:
    """Reaped, or a zombie whose every thread has exited: a killed process's leader can show
    as a zombie while another of its threads (one blocked in a disk write) still holds its
    files, and so its flocks."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().split(")")[-1].split()[0] != "Z":
                return False
        return os.listdir(f"/proc/{pid}/task") == [str(pid)]
    except FileNotFoundError:
        return True


def _gone(pids, within: float) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        alive = [pid for pid in pids if not _exited(pid)]
        if not alive:
            return True
        time.sleep(0.2)
    return False


def _wait_for(predicate, within: float, what: str):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"{what} did not happen within {within} s")


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_killed_launcher_takes_its_workers_along_and_the_next_run_removes_what_it_left(tmp_path):
    env, swap, ckpt = _env(tmp_path), tmp_path / "swap", tmp_path / "ckpt"
    swap.mkdir()
    job = subprocess.Popen(
        [sys.executable, "-m", "tiertrain.cli", "train", "--nproc", "2", *TINY, "--steps", "100000",
         "--zero.stage", "3", "--zero.offload_params", "nvme", "--zero.nvme_path", str(swap),
         "--checkpoint.dir", str(ckpt), "--checkpoint.interval", "1", "--data.cache_dir", str(tmp_path / "cache")],
        env=env, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(lambda: any(os.scandir(swap)) if swap.exists() else False, 60, "the ranks' swap files")
        _wait_for(lambda: ckpt.exists() and any(n.startswith("step_") for n in os.listdir(ckpt)), 60,
                  "a checkpoint")
        workers = [c for c in _children(job.pid)]
        assert workers
        launch_dirs = [n for n in os.listdir(env["TMPDIR"]) if n.startswith(f"{LAUNCH_PREFIX}{job.pid}-")]
        assert len(launch_dirs) == 1
    finally:
        job.send_signal(signal.SIGKILL)
        job.wait()
    assert _gone(workers, within=30), "the workers outlived their launcher"
    assert (tmp_path / "tmp" / launch_dirs[0]).exists(), "a SIGKILL-ed launcher removes nothing"

    removed = remove_abandoned_launches(env["TMPDIR"])  # (what the next launch does first)
    assert any(line.startswith(f"launch directory {env['TMPDIR']}/{launch_dirs[0]}") for line in removed)
    assert not (tmp_path / "tmp" / launch_dirs[0]).exists()
    assert not swap.exists() or not [d for d in os.listdir(swap) if d.startswith("rank")]


def _dead_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def test_an_abandoned_launch_directory_is_removed_with_what_its_ranks_registered(tmp_path):
    """Ranks killed before they could unwind leave their swap files and a half-written step;
    their launch directory lists both. A launch directory whose launcher lives is left alone."""
    from tiertrain.state.checkpoint import CLEANUP_PREFIX
    from tiertrain.io.swap_dir import CLEANUP_ENV  # noqa: F401 (the registrations' home)

    tmp = tmp_path / "tmp"
    abandoned, live = tmp / f"{LAUNCH_PREFIX}{_dead_pid()}-abcd", tmp / f"{LAUNCH_PREFIX}{os.getppid()}-efgh"
    for d in (abandoned, live):
        d.mkdir(parents=True)
    rank_dir = tmp_path / "swap" / "rank0"
    rank_dir.mkdir(parents=True)
    (rank_dir / ".lock").write_text("")
    (rank_dir / "param_shard3.swp").write_bytes(b"0" * 4096)
    (abandoned / "swap-999-1").write_text(f"{rank_dir}\n\n")
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_00000002").mkdir(parents=True)
    (ckpt / "step_00000002" / "rank00001.pt.x1.tmp").write_bytes(b"0" * 100)
    (ckpt / "step_00000001").mkdir()
    (ckpt / "step_00000001" / "rank00000.pt").write_bytes(b"0" * 10)
    (abandoned / f"{CLEANUP_PREFIX}x").write_text(str(ckpt))
    removed = remove_abandoned_launches(str(tmp))
    assert f"swap directory {rank_dir}" in removed
    assert any("bytes of unfinished checkpoint saves" in line for line in removed)
    assert any(line.startswith(f"launch directory {abandoned}") for line in removed)
    assert not abandoned.exists() and not rank_dir.exists() and not (ckpt / "step_00000001").exists()
    assert live.exists(), "a live launcher's directory is not touched"


def test_a_swap_directory_still_locked_keeps_its_registration_for_the_next_launch(tmp_path):
    """The launcher is gone but some process still holds a rank's swap directory (the killed
    rank's last thread, blocked in a write, has not closed its files): it is left alone, and so
    is the launch directory that names it, until a later launch finds it free."""
    tmp = tmp_path / "tmp"
    abandoned = tmp / f"{LAUNCH_PREFIX}{_dead_pid()}-abcd"
    abandoned.mkdir(parents=True)
    rank_dir = tmp_path / "swap" / "rank0"
    rank_dir.mkdir(parents=True)
    (rank_dir / ".lock").write_text("")
    (abandoned / "swap-999-1").write_text(f"{rank_dir}\n\n")
    holder = subprocess.Popen(
        [sys.executable, "-c", "import fcntl, sys; f = open(sys.argv[1]); fcntl.flock(f, fcntl.LOCK_EX); "
                               "print('locked', flush=True); sys.stdin.read()", str(rank_dir / ".lock")],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        assert remove_abandoned_launches(str(tmp)) == []
        assert rank_dir.exists() and (abandoned / "swap-999-1").exists()
    finally:
        holder.kill()
        holder.wait()
    removed = remove_abandoned_launches(str(tmp))
    assert f"swap directory {rank_dir}" in removed and not rank_dir.exists() and not abandoned.exists()


AGENT = ("import os, subprocess, sys, socket, time\n"
         "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
         "env = dict(os.environ, RANK='0', WORLD_SIZE='1', LOCAL_RANK='0', LOCAL_WORLD_SIZE='1',\n"
         "           MASTER_ADDR='127.0.0.1', MASTER_PORT=str(port))\n"
         "subprocess.Popen([sys.executable, '-c', sys.argv[1]], env=env)\n"
         "time.sleep(600)\n")
"""A stand-in for torchrun's agent: starts the worker script (argv[1]) as rank 0 of 1, then waits."""


@contextlib.contextmanager
def _agent_running(tmp_path, worker: str):
    """The stand-in agent running ``worker`` until the block ends, then SIGKILLed."""
    agent = subprocess.Popen([sys.executable, "-c", AGENT, worker], env=_env(tmp_path))
    try:
        yield agent
    finally:
        agent.send_signal(signal.SIGKILL)
        agent.wait()


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_worker_dies_with_its_torchrun_agent(tmp_path):
    """Under torchrun, tiertrain.launch.run asks for a signal when the parent (the agent) dies."""
    marker = tmp_path / "worker.pid"
    worker = (f"import os, time, tiertrain.launch as l\n"
              f"def fn():\n"
              f"    open({str(marker)!r}, 'w').write(str(os.getpid()))\n"
              f"    time.sleep(600)\n"
              f"l.run(fn, timeout=60)\n")
    with _agent_running(tmp_path, worker):
        _wait_for(marker.exists, 40, "the worker's start")
        time.sleep(0.5)
        pid = int(marker.read_text())
    assert _gone([pid], within=20), "the worker outlived its torchrun agent"


@pytest.mark.timeout(60)
def test_a_repeated_parent_death_signal_lets_the_worker_unwind(tmp_path):
    """A dying multi-threaded parent (torchrun's agent) can send the parent-death signal once
    per thread, as the worker passes from one to the next. The second used to end the worker by
    the default action (its SIGTERM handler had turned itself off after the first), before it
    removed its swap files. Now the first raises Terminated and the others are ignored."""
    marker, unwound = tmp_path / "worker.json", tmp_path / "unwound"
    worker = (f"import ctypes, json, os, time, tiertrain.launch as l\n"
              f"def fn():\n"
              f"    sig = ctypes.c_int()\n"
              f"    ctypes.CDLL('libc.so.6').prctl(2, ctypes.byref(sig))  # PR_GET_PDEATHSIG\n"
              f"    open({str(marker)!r}, 'w').write(json.dumps([os.getpid(), sig.value]))\n"
              f"    try:\n"
              f"        time.sleep(600)\n"
              f"    finally:\n"
              f"        time.sleep(1.0)  # (while the other signals arrive)\n"
              f"        open({str(unwound)!r}, 'w').write('yes')\n"
              f"l.run(fn, timeout=60)\n")
    with _agent_running(tmp_path, worker):
        _wait_for(lambda: marker.exists() and marker.read_text().endswith("]"), 40, "the worker's start")
        pid, death_signal = json.loads(marker.read_text())
        assert death_signal != 0, "the worker asked for a signal when its parent dies"
        for _ in range(5):
            os.kill(pid, death_signal)
            time.sleep(0.1)
        assert _gone([pid], within=20), "the worker did not stop"
    assert unwound.exists(), "the worker was ended by a repeated signal before its finally blocks ran"


def test_tiertrain_clean_settles_a_checkpoint_directory_and_names_what_it_removed(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_00000004").mkdir(parents=True)  # a save killed before its commit
    (ckpt / "step_00000004" / "rank00000.pt").write_bytes(b"0" * 100)
    assert cli.main(["clean", str(ckpt)]) == 0
    out = capsys.readouterr().out
    assert f"removed unfinished checkpoint step {ckpt / 'step_00000004'}" in out
    assert not (ckpt / "step_00000004").exists()
    assert cli.main(["clean", str(ckpt)]) == 0 and "nothing to remove" in capsys.readouterr().out


def test_tiertrain_clean_refuses_a_directory_a_live_job_holds(tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    (ckpt / "step_00000004").mkdir(parents=True)
    with another_job_holding(str(ckpt)) as pid:
        assert cli.main(["clean", str(ckpt)]) == 1
        assert f"pid {pid}" in capsys.readouterr().err
        assert (ckpt / "step_00000004").exists()
