#!/usr/bin/env python
"""Soak test (issues 18 and 32): tiny ZeRO-3 NVMe training jobs, again and again, with random
faults and resumes, checking that nothing is lost, nothing hangs and nothing is left behind.

Every job is ``tiertrain train --nproc 2`` (run as ``python -m tiertrain.cli train``) on a tiny
GPT at ZeRO stage 3 with parameters and optimizer state on NVMe (a swap directory of its own
under a temporary directory), metrics for every step (``--logging.log_interval 1``) and a short
``--timeout``. Some invocations run under torchrun instead (``python -m torch.distributed.run
--nproc-per-node 2 --standalone -m tiertrain.cli train ...``, without ``--nproc``; its
``OMP_NUM_THREADS`` set to what tiertrain's own launcher gives each rank, so that losses compare
bit for bit). Each chain (below) draws one **variant** (``--variants``):

* ``interval2``  ``--checkpoint.interval 2 --checkpoint.keep_last 3`` (the soak of issue 18);
* ``interval1``  ``--checkpoint.interval 1 --checkpoint.keep_last 1``: a save after every step,
  rotation deleting the previous one each time;
* ``skipped``    fp16 with an initial loss scale of 2**22 (``--skip-scale``): the first steps
  overflow and are skipped (the same steps every run), so the optimizer step count, which
  names the ``step_N`` directory, stands still while saves go on (interval 1, keep_last 1):
  each save of those steps writes ``step_N.next`` beside the committed ``step_N`` and exchanges
  the two (tiertrain/state/checkpoint.py ``_replace_committed``). A kill then must not lose step_N.

1. A **reference** run per variant without faults (run twice: if the two differ, training itself
   is not deterministic and every later mismatch of that variant is reported as such) records
   the loss of each step and the steps skipped so far (metrics ``skipped``), hence which
   ``step_N`` the save of each step writes (N = step - skipped). The ``skipped`` variant must
   really skip steps and save one ``step_N`` more than once, else the soak stops.
2. Then, until ``--minutes`` have passed, **chains**: a variant, a fresh checkpoint and swap
   directory, and invocations of the same command (``--checkpoint.resume true``, the default)
   until one finishes all steps. Each invocation, until ``--max-faults`` faults were injected
   into the chain, gets one random fault (seeded RNG, ``--seed``; ``--faults`` limits the kinds
   drawn), fired at a random step read from the invocation's metrics file:

   * ``rank_kill``    SIGKILL to one worker (a child of the launcher, from
     ``/proc/PID/task/*/children``);
   * ``job_kill``     SIGKILL to the whole process group (the job runs in a session of its own);
   * ``save_kill``    SIGKILL to the whole group the moment a save is seen unfinished: a new
     ``step_*`` directory without ``COMMITTED.json``, or a ``step_N.next`` without it (a save of
     a step already committed; polled every few ms; "hit" when it was still uncommitted after
     the kill, else the save won the race);
   * ``sigterm`` / ``sigint``   to the launcher only;
   * ``corrupt_swap`` flip bytes in one ``*.swp`` file of the running job's swap directory: the
     job must fail with an error naming that file, or finish with every loss identical to the
     reference (the file was rewritten before it was read again); finishing with other
     losses is training on garbage;
   * ``agent_kill``   the invocation runs under torchrun; SIGKILL to the torchrun agent alone
     (its workers are in sessions of their own: nothing else is signalled). The workers must be
     gone within ``AGENT_GRACE_S`` (they get SIGTERM when their parent dies, tiertrain.launch
     ``run``); "hit" when they were. A SIGKILLed agent runs no cleanup: what is left is residue,
     as after ``job_kill`` (under torchrun no launcher removes a worker's swap files: the next
     run of the same rank in the same swap directory does);
   * ``second_job``   after the invocation's first logged step, a second identical invocation on
     the same checkpoint directory (its own metrics file and log; the swap directory the same or
     a second one, ``--second-swap``). It is started with the invocation, with torch and
     tiertrain imported, and waits for the go (a cold start takes longer than the rest of a tiny
     job). It must exit non-zero within ``SECOND_QUICK_S`` with an error line naming the pid the
     checkpoint directory's lock file (``.tiertrain.lock``) records, a process of the first job,
     and no traceback ("hit"); the first job must finish as if alone (exit 0, bit-identical). A
     second job that trains beside the first, hangs or exits 0 while the lock's holder lives is
     a failure; one that finds the directory free (the first had ended) is a fault not fired.

3. **Checks**, after every invocation (every one has a hard wall-clock limit, ``--hang-factor``
   × the variant's reference time + ``--timeout``; reaching it is a *hang*, the job is killed):

   * *resume*: an invocation that starts with a committed checkpoint ``step_N`` in the
     directory logs as its first step one more than a step whose save writes ``step_N`` (the
     reference says which: N itself unless steps were skipped);
   * *no lost checkpoint*: the newest committed step after a fault is >= the newest one seen
     committed before it; and a run resumes at or after the newest step whose save is known to
     have committed (saves are synchronous: a step's save committed once the next step was
     logged). A ``step_N.next`` / ``step_N.old`` side directory is not a committed step (it
     counts only where ``step_N`` itself has no marker, as tiertrain's ``_step_path`` reads it);
   * *bit-identical continuation*: every (step, loss) an invocation logged equals the
     variant's reference exactly (floats compared as parsed from JSON, i.e. bit for bit);
   * *no leaks*: no process of the job alive (any process whose command line names the chain's
     directory), no bytes in the swap directories, no ``*.tmp`` file, no uncommitted ``step_N``
     and no side directory in the checkpoint directory. A kill that leaves no process able to
     clean up (``job_kill``, ``save_kill``, ``agent_kill``) leaves *residue*, which must be gone
     after the next invocation (the next run clears stale swap files and unfinished saves);
     anything left after any other ending is a *leak*.
   * a *fault-free* invocation (the last of a chain) must exit 0.

The harness's own errors (an exception in this script) are listed separately and never
counted as tiertrain failures. Writes a markdown table to ``--out``.

Usage:
    python bench/soak.py --minutes 30 --out bench/results/soak.md
    python bench/soak.py --minutes 3 --out /tmp/soak.md          # a quick check
    python bench/soak.py --minutes 4 --faults agent_kill,second_job --variants skipped
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from typing import NamedTuple

from _common import loadavg, machine_lines

FAULTS = ("rank_kill", "job_kill", "save_kill", "sigterm", "sigint", "corrupt_swap", "agent_kill", "second_job")
NO_CLEANUP = ("job_kill", "save_kill", "agent_kill")
"""Kills after which no process of the job is left to clean up: what they leave is residue."""
POLL_S = 0.01
AGENT_GRACE_S = 5.0
"""How long the workers of a SIGKILLed torchrun agent may take to be gone."""
SECOND_QUICK_S = 10.0
"""How long a second job on a directory in use may take from its go to its refusal."""
SIDE_DIR = re.compile(r"^step_(\d+)(\.next|\.old)$")  # tiertrain/state/checkpoint.py _SIDE_DIR
STEP_DIR = re.compile(r"^step_(\d+)$")
PREWARM = ("import sys, torch, torch._dynamo, tiertrain.cli, tiertrain.launch, tiertrain.train\n"
           "sys.exit(tiertrain.cli.main(sys.argv[1:]) if sys.stdin.readline() == 'go\\n' else 0)")
"""The second job of ``second_job``: tiertrain's CLI with its imports done, run on 'go'."""


class Variant(NamedTuple):
    """A chain's configuration: the options added to every invocation of its job."""

    name: str
    about: str
    args: tuple
    interval: int


def variants(skip_scale: float) -> dict[str, Variant]:
    return {v.name: v for v in (
        Variant("interval2", "interval 2, keep_last 3",
                ("--checkpoint.interval", "2", "--checkpoint.keep_last", "3"), 2),
        Variant("interval1", "interval 1, keep_last 1",
                ("--checkpoint.interval", "1", "--checkpoint.keep_last", "1"), 1),
        Variant("skipped", f"fp16, initial loss scale {skip_scale:g}: the first steps overflow and are skipped "
                           f"(their saves rewrite one step_N through step_N.next); interval 1, keep_last 1",
                ("--checkpoint.interval", "1", "--checkpoint.keep_last", "1", "--precision.dtype", "fp16",
                 "--precision.loss_scale.initial_scale", repr(float(skip_scale))), 1),
    )}


# ----------------------------------------------------------------------------- /proc helpers


def children(pid: int) -> list[int]:
    """Direct children of pid, from /proc/PID/task/*/children."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for t in tasks:
        try:
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
        except OSError:
            pass
    return sorted(set(out))


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running (not gone, not a zombie: a zombie holds no lock and no file)."""
    return proc_state(pid) not in (None, "Z", "X")


def processes_naming(text: str) -> list[int]:
    """Live (not zombie) processes, other than this one, whose command line contains text."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            with open(f"/proc/{name}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if text in cmd and alive(int(name)):
            found.append(int(name))
    return found


def wait_gone(pids, grace_s: float) -> float | None:
    """Seconds until every pid is gone (or a zombie), None when some outlive grace_s."""
    t0 = time.monotonic()
    while any(alive(p) for p in pids):
        if time.monotonic() - t0 > grace_s:
            return None
        time.sleep(POLL_S)
    return time.monotonic() - t0


def tree_bytes(path: str, pattern=None) -> tuple[int, list[str]]:
    """Total size and list of regular files under path (those whose name pattern(name) accepts)."""
    total, files = 0, []
    for root, _, names in os.walk(path):
        for n in names:
            if pattern is not None and not pattern(n):
                continue
            p = os.path.join(root, n)
            try:
                total += os.lstat(p).st_size
            except OSError:
                continue
            files.append(p)
    return total, files


def _marked(path: str) -> bool:
    """A COMMITTED.json that parses as JSON."""
    try:
        with open(os.path.join(path, "COMMITTED.json")) as f:
            json.load(f)
        return True
    except (OSError, ValueError):
        return False


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def committed_steps(ckpt_dir: str) -> list[int]:
    """Steps whose step_N directory holds a COMMITTED.json that parses as JSON. A side directory
    (step_N.next, step_N.old) counts only where step_N has no marker: a save of a committed step
    between the two renames of a system without an atomic exchange, which the next run puts in
    step_N's place (tiertrain's _step_path / _settle_side_dirs). With step_N committed, a side
    directory is a leftover, never a second copy of the step."""
    names = _listdir(ckpt_dir)
    steps = {int(m.group(1)) for n in names if (m := STEP_DIR.match(n)) and _marked(os.path.join(ckpt_dir, n))}
    steps |= {int(m.group(1)) for n in names if (m := SIDE_DIR.match(n)) and int(m.group(1)) not in steps
              and _marked(os.path.join(ckpt_dir, n))}
    return sorted(steps)


def unfinished_saves(ckpt_dir: str, newest: int | None) -> list[str]:
    """Saves under way: step_N without a marker above the newest committed step, and step_N.next
    without one (a save of a step already committed, written beside it)."""
    out = []
    for n in _listdir(ckpt_dir):
        m = STEP_DIR.match(n) or SIDE_DIR.match(n)
        if not m or _marked(os.path.join(ckpt_dir, n)):
            continue
        if n.endswith(".next") or (STEP_DIR.match(n) and (newest is None or int(m.group(1)) > newest)):
            out.append(n)
    return sorted(out)


def stray_dirs(ckpt_dir: str) -> list[str]:
    """What no finished run may leave in a checkpoint directory: step_N without a marker (a save
    that never committed) and side directories (step_N.next / step_N.old), committed or not."""
    return sorted(os.path.join(ckpt_dir, n) for n in _listdir(ckpt_dir)
                  if SIDE_DIR.match(n) or (STEP_DIR.match(n) and not os.path.exists(
                      os.path.join(ckpt_dir, n, "COMMITTED.json"))))


def read_records(path: str) -> list[dict]:
    """Every complete JSON line (a killed job may leave a partial last line) with a step."""
    out = []
    try:
        with open(path) as f:
            lines = f.read().split("\n")
    except OSError:
        return out
    for line in lines:
        if not line.strip():
            continue
        try:
            r = json.loads(line)
            r["step"] = int(r["step"])
        except (ValueError, KeyError, TypeError):
            continue
        out.append(r)
    return out


def read_metrics(path: str) -> list[tuple[int, float | None]]:
    """(step, loss) of every complete JSON line."""
    return [(r["step"], r.get("loss")) for r in read_records(path)]


# ----------------------------------------------------------------------------- the job


def _rank_threads() -> str:
    """The threads tiertrain's launcher gives each of 2 local ranks (launch._threads_per_rank),
    for torchrun's workers (torchrun would set 1): the same count, so the losses are the same."""
    if "OMP_NUM_THREADS" in os.environ:
        return os.environ["OMP_NUM_THREADS"]
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return str(max(1, cpus // 2))


class Job:
    """The command of a chain, and one invocation of it."""

    def __init__(self, args, chain_dir: str, cache_dir: str, variant: Variant):
        self.args = args
        self.variant = variant
        self.dir = chain_dir
        self.ckpt = os.path.join(chain_dir, "ckpt")
        self.swap = os.path.join(chain_dir, "swap")
        self.swap2 = os.path.join(chain_dir, "swap2")  # a second job's own swap directory
        self.cache = cache_dir
        self.n = 0

    def train_args(self, metrics: str, swap: str | None = None) -> list[str]:
        """`train` and its options, without --nproc."""
        a = self.args
        return ["train", "--timeout", str(a.timeout),
                "--steps", str(a.steps), "--seed", str(a.train_seed),
                "--model.n_layers", str(a.layers), "--model.hidden", str(a.hidden),
                "--model.n_heads", str(a.heads), "--model.seq_len", str(a.seq),
                "--batch.micro_batch_size", str(a.micro_batch),
                "--zero.stage", "3", "--zero.offload_params", "nvme", "--zero.offload_optimizer", "nvme",
                "--zero.nvme_path", swap or self.swap, "--zero.nvme_create", "true",
                "--checkpoint.dir", self.ckpt, *self.variant.args,
                "--checkpoint.resume", "true",
                "--logging.metrics_file", metrics, "--logging.log_interval", "1", "--logging.progress", "false",
                "--data.cache_dir", self.cache]

    def command(self, metrics: str, torchrun: bool = False) -> list[str]:
        """An invocation's command line: under tiertrain's own launcher (--nproc 2), or torchrun's."""
        args = self.train_args(metrics)
        if torchrun:  # (its log directory in the chain's: torchrun leaves one behind after every run)
            return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone",
                    "--log-dir", os.path.join(self.dir, "torchelastic"), "-m", "tiertrain.cli", *args]
        return [sys.executable, "-m", "tiertrain.cli", args[0], "--nproc", "2", *args[1:]]

    def start(self, torchrun: bool = False):
        self.n += 1
        metrics = os.path.join(self.dir, f"metrics_{self.n:03d}.jsonl")
        log = os.path.join(self.dir, f"log_{self.n:03d}.txt")
        cmd = self.command(metrics, torchrun)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if torchrun:
            env["OMP_NUM_THREADS"] = _rank_threads()
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=self.dir, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return proc, metrics, log

    def second_command(self, metrics: str, own_swap: bool) -> list[str]:
        """The second job's command line: PREWARM, then the same `train` options as an invocation."""
        args = self.train_args(metrics, self.swap2 if own_swap else self.swap)
        return [sys.executable, "-c", PREWARM, args[0], "--nproc", "2", *args[1:]]

    def start_second(self, own_swap: bool):
        """The second job of a second_job fault (of the invocation start() starts next),
        imported and waiting for 'go' on its stdin; its metrics file and log ride on the Popen."""
        metrics = os.path.join(self.dir, f"second_metrics_{self.n + 1:03d}.jsonl")
        log = os.path.join(self.dir, f"second_log_{self.n + 1:03d}.txt")
        with open(log, "wb") as out:
            proc = subprocess.Popen(self.second_command(metrics, own_swap), cwd=self.dir, stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.PIPE,
                                    env=dict(os.environ, PYTHONUNBUFFERED="1"), start_new_session=True)
        proc.soak_paths = (metrics, log)
        return proc


def kill_group(proc) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except OSError:
        pass


def error_line(log: str) -> str:
    """The job's error line ('error: ...'), else its last non-empty line."""
    try:
        with open(log, errors="replace") as f:
            lines = [ln.rstrip() for ln in f if ln.strip()]
    except OSError:
        return "(no log)"
    errs = [ln for ln in lines if ln.startswith("error:")]
    return (errs[0] if errs else (lines[-1] if lines else "(empty output)"))[:400]


def rank_pids(proc, torchrun: bool) -> list[int]:
    """The job's workers: forked ranks (children with the launcher's command line), or under
    torchrun the agent's children running tiertrain."""
    if torchrun:
        return [k for k in children(proc.pid) if b"tiertrain.cli" in (_cmdline(k) or b"")]
    return [k for k in children(proc.pid) if _cmdline(k) == _cmdline(proc.pid)]


def lock_holder(ckpt: str) -> str:
    """What the checkpoint directory's lock file says of its holder (tiertrain's claim_directory)."""
    try:
        with open(os.path.join(ckpt, ".tiertrain.lock"), errors="replace") as f:
            return f.read().strip()
    except OSError:
        return ""


def _pid_in(text: str) -> int | None:
    m = re.search(r"\bpid (\d+)", text)
    return int(m.group(1)) if m else None


def run_invocation(job: Job, fault: str | None, rng: random.Random, limit_s: float, start_step: int,
                   start_dir: int | None, second_own_swap: bool = False) -> dict:
    """Start the job, inject `fault` (or none), wait for the end (hard limit), return a record.
    start_step: the step the run should continue after; start_dir: the newest committed step_N."""
    torchrun = fault == "agent_kill"
    rec = {"fault": fault, "fired": False, "detail": "", "hang": False, "torchrun": torchrun}
    rec["newest_before"] = start_dir
    target = rng.randint(start_step + 1, max(start_step + 1, job.args.steps - 1))
    if fault == "second_job":
        target = start_step + 1  # after the first logged step: as long as possible beside the first
    rec["target_step"] = target if fault else None
    second = job.start_second(second_own_swap) if fault == "second_job" else None
    rec["stale"] = set(unfinished_saves(job.ckpt, start_dir))  # (a killed save's, until the run removes it)
    proc, metrics, log = job.start(torchrun)
    rec["log"], rec["metrics"] = log, metrics
    t0 = time.monotonic()
    workers: set[int] = set()
    newest_seen = start_dir
    try:
        while proc.poll() is None:
            now = time.monotonic()
            if now - t0 > limit_s:
                rec["hang"] = True
                rec["detail"] += f"no exit within {limit_s:.0f} s (hard limit): killed. "
                kill_job(job, proc)
                break
            kids = rank_pids(proc, torchrun)
            workers.update(kids)
            steps = committed_steps(job.ckpt)
            if steps:
                newest_seen = max(newest_seen if newest_seen is not None else -1, steps[-1])
            _watch_corruption(rec)
            if second is not None and rec["fired"] and "exit" not in rec["second"]:
                _watch_second(rec, second, proc, t0)
            if fault and not rec["fired"] and not rec.get("gave_up"):
                logged = read_metrics(metrics)
                last = logged[-1][0] if logged else start_step
                if fault == "save_kill":
                    _save_kill(job, proc, rec, start_dir)
                elif last >= target:
                    rec["fired"] = True
                    rec["fired_at_step"] = last
                    if fault == "second_job":
                        second_go(rec, second, job, proc, workers, t0)
                    else:
                        FIRE[fault](job, proc, rec, rng, last, kids)
            time.sleep(POLL_S)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_job(job, proc)
            proc.wait(timeout=30)
        rec["wall_s"] = time.monotonic() - t0
        if torchrun and rec["fired"]:
            gone = wait_gone(rec["agent_workers"], AGENT_GRACE_S)
            rec["workers_gone_s"] = gone
            rec["hit"] = gone is not None and bool(rec["agent_workers"])
            rec["detail"] += (f"its workers {rec['agent_workers']} were gone {gone:.2f} s later. " if gone is not None
                              else f"its workers {rec['agent_workers']} outlived it by {AGENT_GRACE_S:g} s. ")
    finally:
        if second is not None:
            end_second(rec, second, proc, t0, limit_s)
    if "rewritten_after_s" in rec:
        rec["detail"] += f"the job {rec['rewrite_kind']} the corrupted file {rec['rewritten_after_s']:.2f} s later. "
    rec.pop("watch", None)
    rec.pop("stale", None)
    rec["rc"] = proc.returncode
    rec["workers"] = sorted(workers)
    rec["newest_seen"] = newest_seen
    rec["logged"] = read_metrics(metrics)
    rec["error"] = error_line(log) if proc.returncode else ""
    if proc.returncode == -signal.SIGKILL and not rec["hang"]:
        rec["error"] = "(SIGKILL by the soak)"
    return rec


def kill_job(job: Job, proc) -> None:
    """SIGKILL the job's process group, and every process naming the chain's directory (torchrun's
    workers run in sessions of their own, as does a second job)."""
    kill_group(proc)
    kill_pids(processes_naming(job.dir))


def _watch_corruption(rec: dict) -> None:
    """Whether the job rewrote (or removed) the file corrupt_swap flipped bytes of, and when."""
    if not rec.get("watch") or "rewritten_after_s" in rec:
        return
    path, offs, flipped, t_flip = rec["watch"]
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            now_bytes = [os.pread(fd, 1, off) for off in offs]
        finally:
            os.close(fd)
        if any(b != bytes([v]) for b, v in zip(now_bytes, flipped)):
            rec["rewritten_after_s"] = time.monotonic() - t_flip
            rec["rewrite_kind"] = "rewrote"
    except OSError:
        rec["rewritten_after_s"] = time.monotonic() - t_flip
        rec["rewrite_kind"] = "removed"


def _save_kill(job: Job, proc, rec: dict, start_dir: int | None) -> None:
    """Kill the group once a save of this run is seen unfinished. What an earlier killed save
    left is not one until this run removed it (the same name may come back as this run's)."""
    now = unfinished_saves(job.ckpt, start_dir)
    rec["stale"] &= set(now)
    fresh = [d for d in now if d not in rec["stale"]]
    if not fresh:
        return
    kill_group(proc)
    rec["fired"] = True
    hit = [d for d in fresh if d in unfinished_saves(job.ckpt, start_dir)]  # (still uncommitted after the kill)
    resave = " (a save beside the committed step)" if fresh[0].endswith(".next") else ""
    rec["detail"] += (f"killed while {fresh[0]} uncommitted{resave}" if hit else
                      f"{fresh[0]} committed before the kill landed") + ". "
    rec["save_hit"] = bool(hit)
    rec["resave_hit"] = bool(hit) and bool(resave)


def _fire_rank_kill(job, proc, rec, rng, last, kids) -> None:
    if not kids:
        rec["fired"] = False
        rec["detail"] += "no worker found. "
        return
    victim = rng.choice(kids)
    try:
        os.kill(victim, signal.SIGKILL)
        rec["detail"] += f"SIGKILL worker pid {victim} at step {last}. "
    except OSError as e:
        rec["fired"] = False
        rec["detail"] += f"worker {victim} gone before the kill ({e}). "


def _fire_job_kill(job, proc, rec, rng, last, kids) -> None:
    kill_group(proc)
    rec["detail"] += f"SIGKILL process group at step {last}. "


def _fire_signal(job, proc, rec, rng, last, kids) -> None:
    sig = signal.SIGTERM if rec["fault"] == "sigterm" else signal.SIGINT
    try:
        os.kill(proc.pid, sig)
        rec["detail"] += f"{sig.name} to launcher at step {last}. "
    except OSError:
        rec["fired"] = False


def _fire_corrupt_swap(job, proc, rec, rng, last, kids) -> None:
    _, files = tree_bytes(job.swap, lambda n: n.endswith(".swp"))
    files = [f for f in files if os.path.getsize(f) > 0] if files else []
    if not files:
        rec["fired"] = False  # try again at the next poll (files may appear)
        return
    victim = rng.choice(sorted(files))
    try:
        size = os.path.getsize(victim)
        fd = os.open(victim, os.O_RDWR)
        try:
            offs = sorted({rng.randrange(size) for _ in range(8)})
            flipped = []
            for off in offs:
                b = os.pread(fd, 1, off)
                if b:
                    os.pwrite(fd, bytes([b[0] ^ 0xFF]), off)
                    flipped.append(b[0] ^ 0xFF)
            os.fsync(fd)
        finally:
            os.close(fd)
        rec["corrupted"] = victim
        rec["watch"] = (victim, offs, flipped, time.monotonic())
        rec["detail"] += (f"flipped {len(offs)} bytes of {os.path.relpath(victim, job.dir)} "
                          f"({size} B) at step {last}. ")
    except OSError as e:
        rec["fired"] = False
        rec["detail"] += f"could not corrupt {victim}: {e}. "


def _fire_agent_kill(job, proc, rec, rng, last, kids) -> None:
    """SIGKILL to the torchrun agent only: its workers must stop by themselves."""
    if not kids:
        rec["fired"] = False  # (workers not started yet: try again at the next poll)
        return
    try:
        os.kill(proc.pid, signal.SIGKILL)
    except OSError:
        rec["fired"] = False
        return
    rec["agent_workers"] = kids
    rec["detail"] += f"SIGKILL torchrun agent pid {proc.pid} (workers {kids}) at step {last}. "


FIRE = {"rank_kill": _fire_rank_kill, "job_kill": _fire_job_kill, "sigterm": _fire_signal, "sigint": _fire_signal,
        "corrupt_swap": _fire_corrupt_swap, "agent_kill": _fire_agent_kill}  # (second_job: second_go)


def second_go(rec: dict, second, job: Job, proc, workers: set, t0: float) -> None:
    """Let the waiting second job run, noting who holds the checkpoint directory right now."""
    s = rec["second"] = {"holder": lock_holder(job.ckpt), "go_s": time.monotonic() - t0, "launcher": proc.pid,
                         "first_pids": sorted({proc.pid, *workers, *rank_pids(proc, False)}),
                         "own_swap": job.swap2 in second.args}
    try:
        second.stdin.write(b"go\n")
        second.stdin.close()
    except OSError as e:
        rec["fired"], rec["gave_up"] = False, True
        rec["detail"] += f"the second job was gone before its go ({e}). "
        return
    rec["detail"] += (f"second job (swap dir {'its own' if s['own_swap'] else 'the same'}) started at step "
                      f"{rec['fired_at_step']}; the lock names: {s['holder'] or '(nothing)'}. ")


def _watch_second(rec: dict, second, proc, t0: float) -> None:
    """Note when the second job exits, and whether the first's lock holder was alive then."""
    if second.poll() is None:
        return
    s = rec["second"]
    s["exit"] = time.monotonic() - t0 - s["go_s"]
    holder = _pid_in(s["holder"])
    s["holder_alive_at_exit"] = holder is not None and alive(holder)
    s["first_alive_at_exit"] = proc.poll() is None


def end_second(rec: dict, second, proc, t0: float, limit_s: float) -> None:
    """Wait for the second job (hard limit from its go), record how it ended."""
    if not rec["fired"] or "second" not in rec:
        try:  # never let go: it exits without running
            second.stdin.close()
        except OSError:
            pass
        try:
            second.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_group(second)
            second.wait(timeout=30)
        return
    s = rec["second"]
    if "exit" not in s:
        try:
            second.wait(timeout=max(1.0, limit_s - s["go_s"]))
            _watch_second(rec, second, proc, t0)
        except subprocess.TimeoutExpired:
            s["hang"] = True
            kill_group(second)
            second.wait(timeout=30)
            s["exit"] = time.monotonic() - t0 - s["go_s"]
    s["rc"] = second.returncode
    metrics, log = second.soak_paths
    s["log"] = log
    s["logged"] = read_metrics(metrics)
    s["error"] = error_line(log) if second.returncode else ""
    s["traceback"] = "Traceback (most recent call last)" in _log_text(log)
    rec["detail"] += (f"the second job exited {s['rc']} {s['exit']:.2f} s after its go"
                      + (" (first job still running)" if s.get("first_alive_at_exit") else "")
                      + (f": {s['error']}" if s["error"] else "") + ". ")


def leftovers(job: Job, grace_s: float, settle_files: bool = True) -> dict:
    """Processes, swap bytes, checkpoint temp files and stray step directories left once the job
    has ended, polled for up to grace_s (workers unwinding after the launcher died need a
    moment; settle_files=False: once no process is left, files will not change)."""
    deadline = time.monotonic() + grace_s
    while True:
        procs = processes_naming(job.dir)
        swap_bytes, swap_files = tree_bytes(job.swap)
        b2, f2 = tree_bytes(job.swap2)
        swap_bytes, swap_files = swap_bytes + b2, swap_files + f2
        tmp_bytes, tmp_files = tree_bytes(job.ckpt, lambda n: n.endswith(".tmp"))
        dirs = stray_dirs(job.ckpt)
        dir_bytes = sum(tree_bytes(d)[0] for d in dirs)
        clean = not procs and (not settle_files or not swap_files and not tmp_files and not dirs)
        if clean or time.monotonic() > deadline:
            return {"procs": procs, "swap_bytes": swap_bytes, "swap_files": swap_files,
                    "tmp_bytes": tmp_bytes, "tmp_files": tmp_files, "dirs": dirs, "dir_bytes": dir_bytes}
        time.sleep(0.1)


def kill_pids(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


# ----------------------------------------------------------------------------- references


class Reference:
    """A variant's fault-free run: the loss of every step, and the step_N directory the save of
    each step writes (N = step - steps skipped so far: the optimizer's step count)."""

    def __init__(self, variant: Variant, steps: int, records: list[dict], wall: float):
        self.variant = variant
        self.steps = steps
        self.losses = {r["step"]: r.get("loss") for r in records}
        self.skipped = {r["step"]: int(r.get("skipped") or 0) for r in records}
        self.wall = wall
        self.nondeterministic = False

    def dir_of(self, step: int) -> int:
        return step - self.skipped.get(step, 0)

    def is_save(self, step: int) -> bool:
        return step % self.variant.interval == 0 or step == self.steps

    def saved_as(self, n: int | None) -> set[int]:
        """The steps whose save writes step_N (a resume from step_N continues after one of them);
        none committed: {0}."""
        if n is None:
            return {0}
        return {s for s in range(1, self.steps + 1) if self.is_save(s) and self.dir_of(s) == n}

    def committed_by(self, last_logged: int) -> int:
        """The newest step whose save had certainly committed when last_logged was logged
        (saves are synchronous: the step after a save is trained once it committed); 0: none."""
        return max([s for s in range(1, last_logged) if self.is_save(s)], default=0)

    def resaves(self) -> int:
        """Saves that write a step_N an earlier save had written (step_N.next)."""
        dirs = [self.dir_of(s) for s in range(1, self.steps + 1) if self.is_save(s)]
        return len(dirs) - len(set(dirs))


# ----------------------------------------------------------------------------- soak


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.variants = variants(args.skip_scale)
        self.c = collections.Counter()
        self.vc: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)  # by variant
        self.injected = collections.Counter()     # fired faults by kind
        self.requested = collections.Counter()
        self.hits = collections.Counter()         # fired faults that hit what they aim at
        self.failures: list[str] = []             # tiertrain failures
        self.harness_errors: list[str] = []
        self.events: list[str] = []
        self.references: dict[str, Reference] = {}
        self.ref_wall = 0.0
        self.errors_seen = collections.Counter()  # (fault, error line) of faulted invocations
        self.base = ""
        self.t_start = time.monotonic()

    def fail(self, chain: int, inv: int, kind: str, text: str, variant: str | None = None) -> None:
        self.c[kind] += 1
        if variant:
            self.vc[variant]["failures"] += 1
        self.failures.append(f"chain {chain} invocation {inv}" + (f" ({variant})" if variant else "")
                             + f": **{kind}**: {text}")

    def run(self) -> None:
        a = self.args
        base = tempfile.mkdtemp(prefix="tiertrain-soak-", dir=a.tmp)
        self.base = base
        cache = os.path.join(base, "cache")
        try:
            self.t_start = time.monotonic()
            for name in a.variants:
                self.reference_runs(base, cache, self.variants[name])
            end = self.t_start + a.minutes * 60
            chain = 0
            while time.monotonic() < end - self.ref_wall * 1.5:
                chain += 1
                variant = self.variants[self.rng.choice(a.variants)]
                cdir = os.path.join(base, f"chain{chain:04d}")
                os.makedirs(cdir)
                try:
                    self.chain(chain, Job(a, cdir, cache, variant), end)
                except Exception:  # noqa: BLE001 - the harness's own failure, not tiertrain's
                    self.harness_errors.append(f"chain {chain}: {traceback.format_exc().strip().splitlines()[-1]}")
                    traceback.print_exc()
                finally:
                    stray = processes_naming(cdir)
                    kill_pids(stray)
                    if not a.keep:
                        shutil.rmtree(cdir, ignore_errors=True)
                self.c["chains"] += 1
                self.vc[variant.name]["chains"] += 1
        finally:
            kill_pids(processes_naming(base))
            if not a.keep:
                shutil.rmtree(base, ignore_errors=True)

    def reference_runs(self, base: str, cache: str, variant: Variant) -> None:
        """Two fault-free runs of the variant: the reference, and whether training is deterministic."""
        refs = []
        for i in range(2):
            rdir = os.path.join(base, f"reference-{variant.name}-{i}")
            os.makedirs(rdir)
            job = Job(self.args, rdir, cache, variant)
            rec = run_invocation(job, None, self.rng, limit_s=self.args.reference_limit, start_step=0,
                                 start_dir=None)
            if rec["rc"] != 0 or rec["hang"]:
                raise SystemExit(f"soak: the fault-free reference run of variant {variant.name} failed "
                                 f"(rc {rec['rc']}): {rec['error']}\nsee {rec['log']}")
            ref = Reference(variant, self.args.steps, read_records(rec["metrics"]), rec["wall_s"])
            if sorted(ref.losses) != list(range(1, self.args.steps + 1)):
                raise SystemExit(f"soak: the reference run of {variant.name} logged steps {sorted(ref.losses)}, "
                                 f"expected 1..{self.args.steps}")
            refs.append(ref)
            left = leftovers(job, 5.0)
            if left["swap_files"] or left["tmp_files"] or left["procs"] or left["dirs"]:
                self.fail(0, i + 1, "leak after clean run", self.describe_left(left), variant.name)
                self.c["leaked_bytes"] += left["swap_bytes"] + left["tmp_bytes"] + left["dir_bytes"]
            if not self.args.keep:
                shutil.rmtree(rdir, ignore_errors=True)
        ref = refs[0]
        ref.wall = max(r.wall for r in refs)
        self.ref_wall = max(self.ref_wall, ref.wall)
        if refs[0].losses != refs[1].losses or refs[0].skipped != refs[1].skipped:
            ref.nondeterministic = True
            diff = [s for s in refs[0].losses if (refs[0].losses[s], refs[0].skipped[s]) !=
                    (refs[1].losses.get(s), refs[1].skipped.get(s))]
            self.failures.append(f"reference {variant.name}: two fault-free runs differ at steps {diff[:10]}: "
                                 f"training is not deterministic, so resume mismatches below may not be resume bugs")
        if variant.name == "skipped" and not ref.resaves():
            raise SystemExit(f"soak: the reference of variant skipped skipped {ref.skipped[self.args.steps]} steps "
                             f"and saved no step_N twice: raise --skip-scale")
        self.references[variant.name] = ref
        print(f"soak: reference {variant.name}: {self.args.steps} steps in {ref.wall:.1f} s; "
              f"{ref.skipped[self.args.steps]} skipped, {ref.resaves()} saves of a committed step; losses "
              f"{ref.losses[1]:.6f} .. {ref.losses[self.args.steps]:.6f}", flush=True)

    @staticmethod
    def describe_left(left: dict) -> str:
        parts = []
        if left["procs"]:
            parts.append(f"{len(left['procs'])} job process(es) alive: pids {left['procs']}")
        if left["swap_files"]:
            parts.append(f"{left['swap_bytes']} B in {len(left['swap_files'])} swap file(s), e.g. "
                         f"{'/'.join(left['swap_files'][0].split(os.sep)[-2:])}")
        if left["tmp_files"]:
            parts.append(f"{len(left['tmp_files'])} *.tmp file(s) ({left['tmp_bytes']} B) in the checkpoint dir, "
                         f"e.g. {'/'.join(left['tmp_files'][0].split(os.sep)[-2:])}")
        if left.get("dirs"):
            parts.append(f"{len(left['dirs'])} uncommitted or side step dir(s) ({left['dir_bytes']} B): "
                         f"{', '.join(os.path.basename(d) for d in left['dirs'][:4])}")
        return "; ".join(parts)

    def draw_fault(self, faults_so_far: int, start_step: int, end: float) -> str | None:
        """A fault only while there is time for it and the chain's cap allows."""
        a = self.args
        if faults_so_far < a.max_faults and time.monotonic() < end and start_step < a.steps - 1:
            fault = self.rng.choice(a.faults)
            self.requested[fault] += 1
            return fault
        return None

    def chain(self, chain: int, job: Job, end: float) -> None:
        a = self.args
        ref = self.references[job.variant.name]
        vc = self.vc[job.variant.name]
        limit = a.hang_factor * ref.wall + a.timeout
        faults = 0
        residue_from = None   # the fault whose residue the next invocation must clear
        counted: set[str] = set()  # leaked files already counted
        survived = collections.Counter()  # faults fired in this chain, by kill / corruption / second job
        floor = 0              # the newest step whose save is known to have committed
        last_logged = 0        # the last step any invocation of the chain logged
        lost_reported = False  # the previous invocation already reported a lost checkpoint
        for inv in range(1, a.max_faults + 2):
            committed = committed_steps(job.ckpt)
            start_dir = committed[-1] if committed else None
            # the step the run should continue after: the newest one saved as start_dir that ran
            start_step = max([s for s in ref.saved_as(start_dir) if floor <= s <= last_logged] or [floor])
            fault = self.draw_fault(faults, start_step, end)
            faults += fault is not None
            own_swap = fault == "second_job" and (a.second_swap == "own" or a.second_swap == "both"
                                                  and self.rng.random() < 0.5)
            rec = run_invocation(job, fault, self.rng, limit, start_step, start_dir, own_swap)
            self.c["invocations"] += 1
            vc["invocations"] += 1
            fired = bool(fault and rec["fired"])
            if fired:
                self.injected[fault] += 1
                vc["faults"] += 1
                survived[{"corrupt_swap": "corruptions", "second_job": "second_jobs"}.get(fault, "kills")] += 1
                if rec.get("save_hit") or rec.get("hit"):
                    self.hits[fault] += 1
                if rec.get("resave_hit"):
                    self.hits["save_kill_resave"] += 1
            label = fault if fired else ("(fault not fired: job ended first) " + fault if fault else "none")
            line = (f"chain {chain} inv {inv} ({job.variant.name}{', torchrun' if rec['torchrun'] else ''}): "
                    f"start {start_dir if start_dir is not None else '-'}"
                    f"{f' (step {start_step})' if start_dir is not None and start_dir != start_step else ''}, "
                    f"fault {label}, rc {rec['rc']}, {rec['wall_s']:.1f} s, logged {len(rec['logged'])} steps. "
                    f"{rec['detail']}" + (f"→ {rec['error']}" if rec["error"] else ""))
            self.events.append(line)
            print("soak: " + line, flush=True)
            fail = lambda kind, text: self.fail(chain, inv, kind, text, job.variant.name)  # noqa: E731

            # hang
            if rec["hang"]:
                fail("hang", f"fault {label}: {rec['detail']} log tail: {rec['error']}")
            # resume from the newest committed checkpoint, not below a step known committed
            first = rec["logged"][0][0] if rec["logged"] else None
            if start_dir is not None:
                self.c["resumes"] += 1
                vc["resumes"] += 1
                if first is not None and first - 1 not in ref.saved_as(start_dir):
                    fail("wrong resume point", f"newest committed step was step_{start_dir:08d} (saved by step(s) "
                         f"{sorted(ref.saved_as(start_dir))}), the run's first logged step is {first}")
                elif first is not None:
                    self.c["resumes_ok"] += 1
                    vc["resumes_ok"] += 1
            if first is not None and first - 1 < floor and not lost_reported:
                fail("lost checkpoint", f"the save of step {floor} had committed (a later step was logged), "
                     f"the run started after step {first - 1} (newest committed dir: {start_dir})")
            lost_reported = False
            # bit-identical continuation
            self.compare(rec["logged"], ref, start_dir is not None, fault, fired, label, start_step, fail)
            # no lost checkpoint
            after = committed_steps(job.ckpt)
            newest_after = after[-1] if after else None
            if rec["newest_seen"] is not None and (newest_after is None or newest_after < rec["newest_seen"]):
                lost_reported = True
                fail("lost checkpoint", f"fault {label}: step_{rec['newest_seen']:08d} was committed during the run, "
                     f"the newest committed afterwards is {newest_after}")
            if rec["logged"]:
                floor = max(floor, ref.committed_by(rec["logged"][-1][0]))
                last_logged = max(last_logged, rec["logged"][-1][0])
            # outcome of the fault
            if fault == "second_job" and fired:
                self.check_second(rec, ref, fail)
            if fired:
                self.errors_seen[(fault, _shape(rec["error"]) if rec["rc"] else f"exit {rec['rc']}")] += 1
                if fault == "second_job":  # (and how the second job ended)
                    sj = rec["second"]
                    self.errors_seen[("second_job: the second job", _shape(sj["error"]) if sj["rc"] else
                                      f"exit {sj['rc']}")] += 1
                if fault == "corrupt_swap":
                    name = rec.get("corrupted", "")
                    if rec["rc"] == 0:
                        self.c["corrupt_overwritten"] += 1  # losses checked above
                    elif rec["hang"]:
                        pass
                    elif name and (name in rec["error"] or os.path.basename(name) in _log_text(rec["log"])):
                        self.c["corrupt_named"] += 1
                        if name not in rec["error"] and os.path.basename(name) not in rec["error"]:
                            self.c["corrupt_named_only_in_traceback"] += 1
                    else:
                        fail("corruption not named", f"{rec['detail']}error: {rec['error']}")
                elif fault == "second_job":
                    if rec["rc"] != 0 and not rec["hang"]:
                        fail("first job failed beside a second job", f"rc {rec['rc']}: {rec['error']} "
                             f"(log {rec['log']}); {rec['detail']}")
                elif rec["rc"] == 0 and fault != "save_kill":
                    fail("fault ignored", f"{rec['detail']}the job exited 0")
                if fault == "agent_kill" and rec.get("workers_gone_s") is None:
                    fail("workers outlived their agent", f"{rec['detail']}")
            elif rec["rc"] != 0 and not rec["hang"]:
                fail("fault-free run failed" if not fault else "failed before the fault",
                     f"rc {rec['rc']}: {rec['error']} (log {rec['log']})")
            # leaks
            uncleaned = fired and fault in NO_CLEANUP or rec["hang"]
            left = leftovers(job, AGENT_GRACE_S if uncleaned else 10.0, settle_files=not uncleaned)
            if left["procs"]:
                if not (fired and fault == "agent_kill" and rec.get("workers_gone_s") is None):  # (reported)
                    fail("process left", f"after fault {label}: "
                         f"{self.describe_left(dict(left, swap_files=[], tmp_files=[], dirs=[]))}")
                kill_pids(left["procs"])
                left = leftovers(job, 2.0, settle_files=not uncleaned)
            dirty = left["swap_files"] or left["tmp_files"] or left["dirs"]
            if uncleaned:
                if dirty:
                    self.c["residue_events"] += 1
                    self.c["residue_bytes"] += left["swap_bytes"] + left["tmp_bytes"] + left["dir_bytes"]
                    residue_from = (inv, label, self.describe_left(left))
                else:
                    residue_from = None
            elif dirty:
                # each leaked file or directory is counted once (seen again after later endings it is not new)
                new = [f for f in left["swap_files"] + left["tmp_files"] + left["dirs"] if f not in counted]
                counted.update(new)
                self.c["leak_events"] += 1
                self.c["leaked_bytes"] += sum(_size(f) for f in new)
                self.c["leaked_files"] += len(new)
                what = f"after fault {label}, rc {rec['rc']}: {self.describe_left(left)}"
                if residue_from is not None:
                    what += (f" (the kill of invocation {residue_from[0]} ({residue_from[1]}), which left no process "
                             f"to clean up, had left: {residue_from[2]})")
                if new:
                    fail("leak", what)
                else:  # the same stale files as an earlier ending reported: a note, not a new failure
                    self.events.append(f"chain {chain} inv {inv}: still there: {what}")
                residue_from = None
            else:
                if residue_from is not None:
                    self.c["residue_cleared"] += 1
                residue_from = None
            if rec["rc"] == 0 and not rec["hang"] and rec["logged"] and rec["logged"][-1][0] == a.steps:
                if faults and inv > 1:
                    self.c["chains_recovered"] += 1
                self.c["kills_survived"] += survived["kills"]
                self.c["corruptions_survived"] += survived["corruptions"]
                self.c["second_jobs_survived"] += survived["second_jobs"]
                return
            if fired and not rec["hang"]:
                self.c["faults_to_resume"] += 1
        self.fail(chain, a.max_faults + 1, "chain did not finish",
                  f"no invocation finished all {a.steps} steps", job.variant.name)

    def compare(self, logged, ref: Reference, resumed: bool, fault, fired: bool, label: str, start_step: int,
                fail) -> bool:
        """Every logged (step, loss) equal to the reference's; counts a comparison for a resumed run."""
        if not logged:
            return True
        bad = [(s, l, ref.losses.get(s)) for s, l in logged if ref.losses.get(s) != l]
        if resumed:
            self.c["comparisons"] += 1
            self.c["identical"] += not bad
            self.vc[ref.variant.name]["comparisons"] += 1
            self.vc[ref.variant.name]["identical"] += not bad
        self.c["steps_compared"] += len(logged)
        if bad:
            s, l, r = bad[0]
            kind = "not bit-identical" if not (fault == "corrupt_swap" and fired) else "trained on garbage"
            fail(kind, f"start step {start_step}, fault {label}: {len(bad)} of {len(logged)} logged losses differ "
                 f"from the reference; first at step {s}: {l!r} vs {r!r}")
        return not bad

    def check_second(self, rec: dict, ref: Reference, fail) -> None:
        """A second job on a directory in use: refused at once, naming the holder, harming nothing."""
        s = rec["second"]
        holder = _pid_in(s["holder"])
        what = f"second job (swap dir {'its own' if s['own_swap'] else 'the same'})"
        if holder is None or holder not in s["first_pids"]:
            fail("lock names no process of the job", f"at the second job's go the lock file said "
                 f"{s['holder']!r}; the first job's processes: {s['first_pids']}")
        if s.get("hang"):
            fail("hang", f"{what}: no exit within the hard limit; log {s['log']}")
            return
        trained_beside = s["logged"] and s.get("holder_alive_at_exit")
        if trained_beside:
            fail("second job trained beside the first", f"{what} logged steps {[x for x, _ in s['logged']][:5]}... "
                 f"while {s['holder']} held the directory; log {s['log']}")
        if s["logged"]:  # (after the first had ended, a second job is just another run of the chain)
            self.compare(s["logged"], ref, True, None, False, "second_job (the second job)", 0, fail)
        if s["rc"] == 0:
            if s.get("holder_alive_at_exit"):
                fail("second job not refused", f"{what} exited 0 while the lock's holder ({s['holder']}) was alive")
            else:  # the first job had ended (its lock with it): the fault missed
                self.c["second_found_free"] += 1
            return
        named = _pid_in(s["error"])
        problems = []
        if named is None or named != holder:
            problems.append(f"its error line names {'pid ' + str(named) if named else 'no pid'}, the lock's holder "
                            f"is pid {holder}")
        if s["traceback"]:
            problems.append("it printed a traceback")
        if s["exit"] > SECOND_QUICK_S:
            problems.append(f"it took {s['exit']:.1f} s (> {SECOND_QUICK_S:g} s)")
        if problems:
            fail("second job refusal", f"{what} exited {s['rc']}: {'; '.join(problems)}: {s['error']} "
                 f"(log {s['log']})")
        else:
            self.hits["second_job"] += 1
            self.c["second_named_launcher" if holder == s["launcher"] else "second_named_rank0"] += 1


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def _size(path: str) -> int:
    if os.path.isdir(path):
        return tree_bytes(path)[0]
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _log_text(log: str) -> str:
    try:
        with open(log, errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def _shape(error: str) -> str:
    """An error line with paths, pids and numbers blurred, to group like errors."""
    s = re.sub(r"/\S+", "PATH", error)
    s = re.sub(r"\b0x[0-9a-f]+\b", "0xH", s)
    s = re.sub(r"\b\d+(\.\d+)?\b", "N", s)
    return s[:200]


def write_report(soak: Soak, args, command: str, started: str) -> str:
    c = soak.c
    fired = sum(soak.injected.values())
    kills = sum(soak.injected[k] for k in FAULTS if k not in ("corrupt_swap", "second_job"))
    job = Job(args, "CHAIN", "CACHE", Variant("", "", (), 1))  # (the variant's options come after --checkpoint.dir)
    quote = lambda cmd: " ".join(shlex.quote(x) for x in cmd)  # noqa: E731
    base = quote(job.command("CHAIN/metrics_NNN.jsonl"))
    lines = ["# Soak: faults, resumes and leaks (issues 18 and 32)", "",
             f"Started {started} UTC, {args.minutes:g} min requested, "
             f"{(time.monotonic() - soak.t_start) / 60:.1f} min run; load average at the end {loadavg()}.", "",
             "```", *machine_lines(dirs=[soak.base] if soak.base else []), "```", "",
             "Command:", "", "```", command, "```", "",
             "Job (every invocation; `--checkpoint.resume true`), plus the variant's options:", "", "```", base, "```",
             "", "Under torchrun (`agent_kill`; `OMP_NUM_THREADS` as tiertrain's launcher sets it per rank):", "",
             "```", quote(job.command("CHAIN/metrics_NNN.jsonl", torchrun=True)[:10]) + " train ... (no --nproc)",
             "```", "", "A second job (`second_job`): the same `train` options, its own metrics file, run by "
             "`python -c PREWARM` (tiertrain's CLI, imported beforehand, started on a go).", "",
             "| variant | options | reference (slower of 2 fault-free runs) | steps skipped | saves of a committed "
             "step (step_N.next) | hard limit per invocation |", "|---|---|---|---|---|---|"]
    for name in args.variants:
        v, ref = soak.variants[name], soak.references.get(name)
        if ref is None:
            lines.append(f"| {name} | `{' '.join(v.args)}` | not run | | | |")
            continue
        lines.append(f"| {name} | `{' '.join(v.args)}` | {ref.wall:.1f} s, "
                     f"{'they DIFFER' if ref.nondeterministic else 'bit-identical to each other'} | "
                     f"{ref.skipped[args.steps]} of {args.steps} | {ref.resaves()} | "
                     f"{args.hang_factor:g} × {ref.wall:.1f} + --timeout {args.timeout} = "
                     f"{args.hang_factor * ref.wall + args.timeout:.0f} s |")
    lines += ["", "| measure | value | target |", "|---|---|---|",
              f"| chains (fresh checkpoint dir, faults until one invocation finishes) | {c['chains']} | |"]
    for name in args.variants:
        v = soak.vc[name]
        lines.append(f"| — variant {name} | {v['chains']} chains, {v['invocations']} invocations, {v['faults']} "
                     f"faults fired, {v['resumes_ok']} of {v['resumes']} resumes at the right step, "
                     f"{v['identical']} / {v['comparisons']} bit-identical, {v['failures']} failures | |")
    lines += [f"| invocations of `tiertrain train` | {c['invocations']} | |",
              f"| faults injected (fired) | {fired} | |"]
    hit_text = {
        "save_kill": lambda: f" ({soak.hits['save_kill']} hit an uncommitted step dir, "
                             f"{soak.hits['save_kill_resave']} of them a step_N.next)",
        "agent_kill": lambda: f" ({soak.hits['agent_kill']} hit: every worker gone within {AGENT_GRACE_S:g} s)",
        "second_job": lambda: f" ({soak.hits['second_job']} hit: refused at once, no traceback, naming the lock's "
                              f"holder: rank 0's pid {c['second_named_rank0']}, the launcher's "
                              f"{c['second_named_launcher']}; {c['second_found_free']} found the directory free, "
                              f"the first having ended)",
    }
    for k in FAULTS:
        extra = hit_text[k]() if k in hit_text else ""
        lines.append(f"| — {k} | {soak.injected[k]} of {soak.requested[k]} drawn{extra} | |")
    lines += [
        f"| kills / signals survived (the chain then finished all steps) | {c['kills_survived']} of {kills} "
        f"| all |",
        f"| swap corruptions survived (the chain then finished all steps) | {c['corruptions_survived']} of "
        f"{soak.injected['corrupt_swap']} | all |",
        f"| second jobs beside a running one, the chain then finished all steps | {c['second_jobs_survived']} of "
        f"{soak.injected['second_job']} | all |",
        f"| resumes (invocations started with a committed checkpoint) | {c['resumes']} | |",
        f"| resumed after a step whose save writes the newest committed step_N | {c['resumes_ok']} of "
        f"{c['resumes']} (that logged a step) | all |",
        f"| bit-identical continuations / comparisons | {c['identical']} / {c['comparisons']} "
        f"({c['steps_compared']} logged steps compared in all) | all |",
        f"| swap corruptions: job failed naming the file | {c['corrupt_named']}"
        + (f" ({c['corrupt_named_only_in_traceback']} named only in the traceback, not the error line)"
           if c['corrupt_named_only_in_traceback'] else "") + " | |",
        f"| swap corruptions: rewritten before read (job finished, losses identical) | {c['corrupt_overwritten']} | |",
        f"| hangs | {c['hang']} | 0 |",
        f"| lost checkpoints | {c['lost checkpoint']} | 0 |",
        f"| bytes leaked (swap files, checkpoint *.tmp, uncommitted / side step dirs after an ending that could "
        f"clean up) | {c['leaked_bytes']} B in {c['leaked_files']} files or dirs (seen after {c['leak_events']} "
        f"endings) | 0 |",
        f"| processes left behind | {c['process left']} | 0 |",
        f"| residue of kills that leave no process to clean up ({', '.join(NO_CLEANUP)}) | {c['residue_bytes']} B "
        f"in {c['residue_events']}; cleared by the next run {c['residue_cleared']} | |",
        f"| tiertrain failures (listed below) | {len(soak.failures)} | 0 |",
        f"| harness errors (not tiertrain's) | {len(soak.harness_errors)} | 0 |", ""]
    lines += ["## Failures", ""] + ([f"- {f}" for f in soak.failures] or ["none"]) + [""]
    if soak.harness_errors:
        lines += ["## Harness errors", ""] + [f"- {e}" for e in soak.harness_errors] + [""]
    lines += ["## How each fault ended the job", "", "| fault | exit / error line (paths and numbers blurred) | n |",
              "|---|---|---|"]
    for (k, e), n in sorted(soak.errors_seen.items()):
        lines.append(f"| {k} | `{e.replace('|', '/')}` | {n} |")
    lines += ["", "## Invocations", "", "<details><summary>all</summary>", "", "```", *soak.events, "```",
              "</details>", ""]
    return "\n".join(lines)


def _names(allowed, what: str):
    """An argparse type: names separated by commas (or given as several arguments), each allowed."""
    def parse(text: str) -> list[str]:
        names = [n for n in text.split(",") if n]
        bad = [n for n in names if n not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(f"unknown {what} {', '.join(bad)} (choose from {', '.join(allowed)})")
        return names
    return parse


def main() -> None:
    # A soak started in the background (`cmd &` in a script) inherits SIGINT ignored, and so
    # would every job it starts: its SIGINT faults would do nothing. The jobs get the default.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=30.0, help="wall time of the soak")
    p.add_argument("--seed", type=int, default=0, help="seed of the fault RNG")
    p.add_argument("--out", default="", help="markdown report (default: print only)")
    p.add_argument("--steps", type=int, default=24, help="training steps of every job")
    p.add_argument("--timeout", type=int, default=30, help="tiertrain train --timeout")
    p.add_argument("--hang-factor", type=float, default=3.0)
    p.add_argument("--max-faults", type=int, default=3, help="faults per chain before a fault-free finish")
    p.add_argument("--faults", nargs="+", type=_names(FAULTS, "fault"), default=[list(FAULTS)],
                   help=f"fault kinds drawn from, e.g. agent_kill,second_job (default all: {','.join(FAULTS)})")
    names = tuple(variants(1.0))
    p.add_argument("--variants", nargs="+", type=_names(names, "variant"), default=[list(names)],
                   help=f"chain variants drawn from (default all: {','.join(names)})")
    p.add_argument("--skip-scale", type=float, default=float(2 ** 22),
                   help="initial fp16 loss scale of the 'skipped' variant (the steps until it falls far enough "
                        "are skipped; more than precision.max_consecutive_skips (20) ends the run)")
    p.add_argument("--second-swap", choices=("same", "own", "both"), default="both",
                   help="the second job's swap directory: the first job's, its own, or drawn (default)")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=2)
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--train-seed", type=int, default=0, help="tiertrain --seed")
    p.add_argument("--reference-limit", type=float, default=300.0)
    p.add_argument("--tmp", default=None, help="where the temporary directories go (default $TMPDIR)")
    p.add_argument("--keep", action="store_true", help="keep the chains' directories (logs) for inspection")
    args = p.parse_args()
    args.faults = list(dict.fromkeys(n for group in args.faults for n in group))
    args.variants = list(dict.fromkeys(n for group in args.variants for n in group))
    command = "python " + " ".join(shlex.quote(x) for x in [os.path.relpath(__file__)] + sys.argv[1:])
    started = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M")
    soak = Soak(args)
    try:
        soak.run()
    except KeyboardInterrupt:
        soak.harness_errors.append("interrupted (Ctrl-C): the report covers what ran")
    report = write_report(soak, args, command, started)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            f.write(report)
        print(f"soak: wrote {args.out}")
    print(report)
    bad = soak.failures or soak.harness_errors
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
