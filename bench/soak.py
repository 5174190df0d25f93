#!/usr/bin/env python
"""Soak test (issue 18): tiny ZeRO-3 NVMe training jobs, again and again, with random faults
and resumes, checking that nothing is lost, nothing hangs and nothing is left behind.

Every job is ``tiertrain train --nproc 2`` (run as ``python -m tiertrain.cli train``) on a tiny
GPT at ZeRO stage 3 with parameters and optimizer state on NVMe (a swap directory of its own
under a temporary directory), ``--checkpoint.interval 2 --checkpoint.keep_last 3``, metrics
for every step (``--logging.log_interval 1``) and a short ``--timeout``.

1. A **reference** run without faults (run twice: if the two differ, training itself is not
   deterministic and every later mismatch is reported as such) records the loss of each step.
2. Then, until ``--minutes`` have passed, **chains**: a fresh checkpoint and swap directory, and
   invocations of the same command (``--checkpoint.resume true``, the default) until one
   finishes all steps. Each invocation, until ``--max-faults`` faults were injected into the
   chain, gets one random fault (seeded RNG, ``--seed``), fired at a random step read from the
   invocation's metrics file:

   * ``rank_kill``    SIGKILL to one worker (a child of the launcher, from
     ``/proc/PID/task/*/children``);
   * ``job_kill``     SIGKILL to the whole process group (the job runs in a session of its own);
   * ``save_kill``    SIGKILL to the whole group the moment a ``step_*`` directory without
     ``COMMITTED.json`` appears (polled every few ms; "hit" when it was still uncommitted after
     the kill, else the save won the race);
   * ``sigterm`` / ``sigint``   to the launcher only;
   * ``corrupt_swap`` flip bytes in one ``*.swp`` file of the running job's swap directory: the
     job must fail with an error naming that file, or finish with every loss identical to the
     reference (the file was rewritten before it was read again); finishing with other
     losses is training on garbage.

3. **Checks**, after every invocation (every one has a hard wall-clock limit, ``--hang-factor``
   × the reference run's time + ``--timeout``; reaching it is a *hang*, the job is killed):

   * *resume*: an invocation that starts with a committed checkpoint in the directory logs
     newest-committed-step + 1 as its first step;
   * *no lost checkpoint*: the newest committed step after a fault is >= the newest one seen
     committed before it;
   * *bit-identical continuation*: every (step, loss) an invocation logged equals the
     reference's exactly (floats compared as parsed from JSON, i.e. bit for bit);
   * *no leaks*: no process of the job alive (any process whose command line names the chain's
     directory), no bytes in the swap directory, no ``*.tmp`` file in the checkpoint directory.
     A whole-group SIGKILL (``job_kill``, ``save_kill``) leaves no process that could clean up:
     what it leaves is recorded as *residue*, and must be gone after the next invocation (the
     next run clears stale swap files); anything left after any other ending is a *leak*.
   * a *fault-free* invocation (the last of a chain) must exit 0.

The harness's own errors (an exception in this script) are listed separately and never
counted as tiertrain failures. Writes a markdown table to ``--out``.

Usage:
    python bench/soak.py --minutes 30 --out bench/results/soak.md
    python bench/soak.py --minutes 3 --out /tmp/soak.md          # a quick check
"""
from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback

from _common import loadavg, machine_lines

FAULTS = ("rank_kill", "job_kill", "save_kill", "sigterm", "sigint", "corrupt_swap")
GROUP_KILLS = ("job_kill", "save_kill")
POLL_S = 0.01


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
        if text in cmd and proc_state(int(name)) not in (None, "Z", "X"):
            found.append(int(name))
    return found


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


def committed_steps(ckpt_dir: str) -> list[int]:
    """Steps whose directory holds a COMMITTED.json that parses as JSON."""
    steps = []
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return steps
    for n in names:
        if not (n.startswith("step_") and n[5:].isdigit()):
            continue
        try:
            with open(os.path.join(ckpt_dir, n, "COMMITTED.json")) as f:
                json.load(f)
        except (OSError, ValueError):
            continue
        steps.append(int(n[5:]))
    return sorted(steps)


def uncommitted_dirs(ckpt_dir: str) -> list[str]:
    try:
        names = os.listdir(ckpt_dir)
    except OSError:
        return []
    return [n for n in names if n.startswith("step_") and n[5:].isdigit()
            and not os.path.exists(os.path.join(ckpt_dir, n, "COMMITTED.json"))]


def read_metrics(path: str) -> list[tuple[int, float | None]]:
    """(step, loss) of every complete JSON line (a killed job may leave a partial last line)."""
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
            out.append((int(r["step"]), r.get("loss")))
        except (ValueError, KeyError, TypeError):
            continue
    return out


# ----------------------------------------------------------------------------- the job


class Job:
    """The command of a chain, and one invocation of it."""

    def __init__(self, args, chain_dir: str, cache_dir: str):
        self.args = args
        self.dir = chain_dir
        self.ckpt = os.path.join(chain_dir, "ckpt")
        self.swap = os.path.join(chain_dir, "swap")
        self.cache = cache_dir
        self.n = 0

    def command(self, metrics: str) -> list[str]:
        a = self.args
        return [sys.executable, "-m", "tiertrain.cli", "train", "--nproc", "2", "--timeout", str(a.timeout),
                "--steps", str(a.steps), "--seed", str(a.train_seed),
                "--model.n_layers", str(a.layers), "--model.hidden", str(a.hidden),
                "--model.n_heads", str(a.heads), "--model.seq_len", str(a.seq),
                "--batch.micro_batch_size", str(a.micro_batch),
                "--zero.stage", "3", "--zero.offload_params", "nvme", "--zero.offload_optimizer", "nvme",
                "--zero.nvme_path", self.swap,
                "--checkpoint.dir", self.ckpt, "--checkpoint.interval", "2", "--checkpoint.keep_last", "3",
                "--checkpoint.resume", "true",
                "--logging.metrics_file", metrics, "--logging.log_interval", "1", "--logging.progress", "false",
                "--data.cache_dir", self.cache]

    def start(self):
        self.n += 1
        metrics = os.path.join(self.dir, f"metrics_{self.n:03d}.jsonl")
        log = os.path.join(self.dir, f"log_{self.n:03d}.txt")
        cmd = self.command(metrics)
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, cwd=self.dir, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        return proc, metrics, log


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


def run_invocation(job: Job, fault: str | None, rng: random.Random, limit_s: float, start_step: int) -> dict:
    """Start the job, inject `fault` (or none), wait for the end (hard limit), return a record."""
    rec = {"fault": fault, "fired": False, "detail": "", "hang": False}
    committed_before = committed_steps(job.ckpt)
    rec["newest_before"] = committed_before[-1] if committed_before else 0
    target = rng.randint(start_step + 1, max(start_step + 1, job.args.steps - 1))
    rec["target_step"] = target if fault else None
    proc, metrics, log = job.start()
    rec["log"], rec["metrics"] = log, metrics
    t0 = time.monotonic()
    workers: set[int] = set()
    newest_seen = rec["newest_before"]
    while proc.poll() is None:
        now = time.monotonic()
        if now - t0 > limit_s:
            rec["hang"] = True
            rec["detail"] += f"no exit within {limit_s:.0f} s (hard limit): killed. "
            kill_group(proc)
            break
        kids = [k for k in children(proc.pid) if _cmdline(k) == _cmdline(proc.pid)]  # forked ranks
        workers.update(kids)
        steps = committed_steps(job.ckpt)
        if steps:
            newest_seen = max(newest_seen, steps[-1])
        if rec.get("watch") and "rewritten_after_s" not in rec:
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
        if fault and not rec["fired"]:
            logged = read_metrics(metrics)
            last = logged[-1][0] if logged else start_step
            if fault == "save_kill":
                fresh = [d for d in uncommitted_dirs(job.ckpt) if int(d[5:]) > start_step]
                if fresh:
                    kill_group(proc)
                    rec["fired"] = True
                    hit = [d for d in fresh if d in uncommitted_dirs(job.ckpt)]
                    rec["detail"] += (f"killed while {fresh[0]} uncommitted" if hit else
                                      f"{fresh[0]} committed before the kill landed") + ". "
                    rec["save_hit"] = bool(hit)
            elif last >= target:
                rec["fired"] = True
                rec["fired_at_step"] = last
                if fault == "rank_kill":
                    if kids:
                        victim = rng.choice(kids)
                        try:
                            os.kill(victim, signal.SIGKILL)
                            rec["detail"] += f"SIGKILL worker pid {victim} at step {last}. "
                        except OSError as e:
                            rec["fired"] = False
                            rec["detail"] += f"worker {victim} gone before the kill ({e}). "
                    else:
                        rec["fired"] = False
                        rec["detail"] += "no worker found. "
                elif fault == "job_kill":
                    kill_group(proc)
                    rec["detail"] += f"SIGKILL process group at step {last}. "
                elif fault in ("sigterm", "sigint"):
                    sig = signal.SIGTERM if fault == "sigterm" else signal.SIGINT
                    try:
                        os.kill(proc.pid, sig)
                        rec["detail"] += f"{sig.name} to launcher at step {last}. "
                    except OSError:
                        rec["fired"] = False
                elif fault == "corrupt_swap":
                    _, files = tree_bytes(job.swap, lambda n: n.endswith(".swp"))
                    files = [f for f in files if os.path.getsize(f) > 0] if files else []
                    if files:
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
                    else:
                        rec["fired"] = False  # try again at the next poll (files may appear)
        time.sleep(POLL_S)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        proc.wait(timeout=30)
    rec["wall_s"] = time.monotonic() - t0
    if "rewritten_after_s" in rec:
        rec["detail"] += f"the job {rec['rewrite_kind']} the corrupted file {rec['rewritten_after_s']:.2f} s later. "
    rec.pop("watch", None)
    rec["rc"] = proc.returncode
    rec["workers"] = sorted(workers)
    rec["newest_seen"] = newest_seen
    rec["logged"] = read_metrics(metrics)
    rec["error"] = error_line(log) if proc.returncode else ""
    if proc.returncode == -signal.SIGKILL and not rec["hang"]:
        rec["error"] = "(SIGKILL by the soak)"
    return rec


def leftovers(job: Job, grace_s: float) -> dict:
    """Processes, swap bytes and checkpoint temp files left once the job has ended, polled for
    up to grace_s (workers unwinding after the launcher died need a moment)."""
    deadline = time.monotonic() + grace_s
    while True:
        procs = processes_naming(job.dir)
        swap_bytes, swap_files = tree_bytes(job.swap)
        tmp_bytes, tmp_files = tree_bytes(job.ckpt, lambda n: n.endswith(".tmp"))
        clean = not procs and not swap_files and not tmp_files
        if clean or time.monotonic() > deadline:
            return {"procs": procs, "swap_bytes": swap_bytes, "swap_files": swap_files,
                    "tmp_bytes": tmp_bytes, "tmp_files": tmp_files}
        time.sleep(0.1)


def kill_pids(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass


# ----------------------------------------------------------------------------- soak


class Soak:
    def __init__(self, args):
        self.args = args
        self.rng = random.Random(args.seed)
        self.c = collections.Counter()
        self.injected = collections.Counter()     # fired faults by kind
        self.requested = collections.Counter()
        self.failures: list[str] = []             # tiertrain failures
        self.harness_errors: list[str] = []
        self.events: list[str] = []
        self.reference: dict[int, float] = {}
        self.ref_wall = 0.0
        self.nondeterministic = False
        self.errors_seen = collections.Counter()  # (fault, error line) of faulted invocations

    def fail(self, chain: int, inv: int, kind: str, text: str) -> None:
        self.c[kind] += 1
        self.failures.append(f"chain {chain} invocation {inv}: **{kind}**: {text}")

    def run(self) -> None:
        a = self.args
        base = tempfile.mkdtemp(prefix="tiertrain-soak-", dir=a.tmp)
        self.base = base
        cache = os.path.join(base, "cache")
        try:
            self.reference_runs(base, cache)
            end = self.t_start + a.minutes * 60
            chain = 0
            while time.monotonic() < end - self.ref_wall * 1.5:
                chain += 1
                cdir = os.path.join(base, f"chain{chain:04d}")
                os.makedirs(cdir)
                try:
                    self.chain(chain, Job(a, cdir, cache), end)
                except Exception:  # noqa: BLE001 - the harness's own failure, not tiertrain's
                    self.harness_errors.append(f"chain {chain}: {traceback.format_exc().strip().splitlines()[-1]}")
                    traceback.print_exc()
                finally:
                    stray = processes_naming(cdir)
                    kill_pids(stray)
                    if not a.keep:
                        shutil.rmtree(cdir, ignore_errors=True)
                self.c["chains"] += 1
        finally:
            kill_pids(processes_naming(base))
            if not a.keep:
                shutil.rmtree(base, ignore_errors=True)

    def reference_runs(self, base: str, cache: str) -> None:
        self.t_start = time.monotonic()
        losses = []
        for i in range(2):
            rdir = os.path.join(base, f"reference{i}")
            os.makedirs(rdir)
            job = Job(self.args, rdir, cache)
            rec = run_invocation(job, None, self.rng, limit_s=self.args.reference_limit, start_step=0)
            if rec["rc"] != 0 or rec["hang"]:
                raise SystemExit(f"soak: the fault-free reference run failed (rc {rec['rc']}): {rec['error']}\n"
                                 f"see {rec['log']}")
            got = {s: l for s, l in rec["logged"]}
            if sorted(got) != list(range(1, self.args.steps + 1)):
                raise SystemExit(f"soak: the reference run logged steps {sorted(got)}, expected 1..{self.args.steps}")
            losses.append(got)
            self.ref_wall = max(self.ref_wall, rec["wall_s"])
            left = leftovers(job, 5.0)
            if left["swap_files"] or left["tmp_files"] or left["procs"]:
                self.fail(0, i + 1, "leak after clean run", self.describe_left(left))
                self.c["leaked_bytes"] += left["swap_bytes"] + left["tmp_bytes"]
            if not self.args.keep:
                shutil.rmtree(rdir, ignore_errors=True)
        self.reference = losses[0]
        if losses[0] != losses[1]:
            self.nondeterministic = True
            diff = [s for s in losses[0] if losses[0][s] != losses[1][s]]
            self.failures.append(f"reference: two fault-free runs differ at steps {diff[:10]}: training is not "
                                 f"deterministic, so resume mismatches below may not be resume bugs")
        print(f"soak: reference {self.args.steps} steps in {self.ref_wall:.1f} s; "
              f"losses {self.reference[1]:.6f} .. {self.reference[self.args.steps]:.6f}", flush=True)

    @staticmethod
    def describe_left(left: dict) -> str:
        parts = []
        if left["procs"]:
            parts.append(f"{len(left['procs'])} job process(es) alive: pids {left['procs']}")
        if left["swap_files"]:
            parts.append(f"{left['swap_bytes']} B in {len(left['swap_files'])} swap file(s), e.g. "
                         f"{os.path.basename(left['swap_files'][0])}")
        if left["tmp_files"]:
            parts.append(f"{len(left['tmp_files'])} *.tmp file(s) ({left['tmp_bytes']} B) in the checkpoint dir, "
                         f"e.g. {'/'.join(left['tmp_files'][0].split(os.sep)[-2:])}")
        return "; ".join(parts)

    def chain(self, chain: int, job: Job, end: float) -> None:
        a = self.args
        limit = a.hang_factor * self.ref_wall + a.timeout
        faults = 0
        residue_from = None   # the fault whose residue the next invocation must clear
        counted: set[str] = set()  # leaked files already counted
        survived = collections.Counter()  # faults fired in this chain, by kill / corruption
        for inv in range(1, a.max_faults + 2):
            committed = committed_steps(job.ckpt)
            start_step = committed[-1] if committed else 0
            # a fault only while there is time for it and the chain's cap allows
            fault = None
            if faults < a.max_faults and time.monotonic() < end and start_step < a.steps - 1:
                fault = self.rng.choice(a.faults)
                faults += 1
                self.requested[fault] += 1
            rec = run_invocation(job, fault, self.rng, limit, start_step)
            self.c["invocations"] += 1
            fired = bool(fault and rec["fired"])
            if fired:
                self.injected[fault] += 1
                survived["corruptions" if fault == "corrupt_swap" else "kills"] += 1
            label = fault if fired else ("(fault not fired: job ended first) " + fault if fault else "none")
            line = (f"chain {chain} inv {inv}: start {start_step}, fault {label}, rc {rec['rc']}, "
                    f"{rec['wall_s']:.1f} s, logged {len(rec['logged'])} steps. {rec['detail']}"
                    + (f"→ {rec['error']}" if rec["error"] else ""))
            self.events.append(line)
            print("soak: " + line, flush=True)

            # hang
            if rec["hang"]:
                self.fail(chain, inv, "hang", f"fault {label}: {rec['detail']} log tail: {rec['error']}")
            # resume from the newest committed checkpoint
            if start_step > 0:
                self.c["resumes"] += 1
                first = rec["logged"][0][0] if rec["logged"] else None
                if first is not None and first != start_step + 1:
                    self.fail(chain, inv, "wrong resume point",
                              f"newest committed step was {start_step}, the run's first logged step is {first}")
                elif first is not None:
                    self.c["resumes_ok"] += 1
            # bit-identical continuation
            if rec["logged"]:
                bad = [(s, l, self.reference.get(s)) for s, l in rec["logged"] if self.reference.get(s) != l]
                if start_step > 0:
                    self.c["comparisons"] += 1
                    self.c["identical"] += not bad
                self.c["steps_compared"] += len(rec["logged"])
                if bad:
                    s, l, r = bad[0]
                    kind = "not bit-identical" if not (fault == "corrupt_swap" and fired) else "trained on garbage"
                    self.fail(chain, inv, kind, f"start {start_step}, fault {label}: {len(bad)} of "
                              f"{len(rec['logged'])} logged losses differ from the reference; first at step {s}: "
                              f"{l!r} vs {r!r}")
            # no lost checkpoint
            after = committed_steps(job.ckpt)
            newest_after = after[-1] if after else 0
            if newest_after < rec["newest_seen"]:
                self.fail(chain, inv, "lost checkpoint", f"fault {label}: step {rec['newest_seen']} was committed "
                          f"during the run, the newest committed afterwards is {newest_after}")
            # outcome of the fault
            if fired:
                self.errors_seen[(fault, _shape(rec["error"]) if rec["rc"] else f"exit {rec['rc']}")] += 1
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
                        self.fail(chain, inv, "corruption not named", f"{rec['detail']}error: {rec['error']}")
                elif rec["rc"] == 0 and fault != "save_kill":
                    self.fail(chain, inv, "fault ignored", f"{rec['detail']}the job exited 0")
            elif rec["rc"] != 0 and not rec["hang"]:
                self.fail(chain, inv, "fault-free run failed" if not fault else "failed before the fault",
                          f"rc {rec['rc']}: {rec['error']} (log {rec['log']})")
            # leaks
            group_killed = fired and fault in GROUP_KILLS or rec["hang"]
            left = leftovers(job, 2.0 if group_killed else 10.0)
            if left["procs"]:
                self.fail(chain, inv, "process left", f"after fault {label}: {self.describe_left(dict(left, swap_files=[], tmp_files=[]))}")
                kill_pids(left["procs"])
                left = leftovers(job, 2.0)
            dirty = left["swap_files"] or left["tmp_files"]
            if group_killed:
                if dirty:
                    self.c["residue_events"] += 1
                    self.c["residue_bytes"] += left["swap_bytes"] + left["tmp_bytes"]
                    residue_from = (inv, label, self.describe_left(left))
                else:
                    residue_from = None
            elif dirty:
                # each leaked file is counted once (a stale file seen again after later endings is not new)
                new = [f for f in left["swap_files"] + left["tmp_files"] if f not in counted]
                counted.update(new)
                self.c["leak_events"] += 1
                self.c["leaked_bytes"] += sum(_size(f) for f in new)
                self.c["leaked_files"] += len(new)
                what = f"after fault {label}, rc {rec['rc']}: {self.describe_left(left)}"
                if residue_from is not None:
                    what += (f" (the whole-group kill of invocation {residue_from[0]} ({residue_from[1]}) had left: "
                             f"{residue_from[2]})")
                if new:
                    self.fail(chain, inv, "leak", what)
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
                return
            if fired and not rec["hang"]:
                self.c["faults_to_resume"] += 1
        self.fail(chain, a.max_faults + 1, "chain did not finish",
                  f"no invocation finished all {a.steps} steps")


def _cmdline(pid: int) -> bytes | None:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return None


def _size(path: str) -> int:
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
    import re

    s = re.sub(r"/\S+", "PATH", error)
    s = re.sub(r"\b0x[0-9a-f]+\b", "0xH", s)
    s = re.sub(r"\b\d+(\.\d+)?\b", "N", s)
    return s[:200]


def write_report(soak: Soak, args, command: str, started: str) -> str:
    c = soak.c
    fired = sum(soak.injected.values())
    kills = sum(soak.injected[k] for k in FAULTS if k != "corrupt_swap")
    save_hits = sum(1 for e in soak.events if "uncommitted" in e and "save_kill" in e)
    lines = ["# Soak: faults, resumes and leaks (issue 18)", "",
             f"Started {started} UTC, {args.minutes:g} min requested, "
             f"{(time.monotonic() - soak.t_start) / 60:.1f} min run; load average at the end {loadavg()}.", "",
             "```", *machine_lines(dirs=[soak.base]), "```", "",
             "Command:", "", "```", command, "```", "",
             "Job (every invocation; `--checkpoint.resume true`):", "", "```",
             " ".join(shlex.quote(x) for x in Job(args, "CHAIN", "CACHE").command("CHAIN/metrics_NNN.jsonl")), "```", "",
             f"Reference: {args.steps} steps, {soak.ref_wall:.1f} s wall (the slower of 2 fault-free runs; "
             f"{'they DIFFER' if soak.nondeterministic else 'bit-identical to each other'}); hard limit per "
             f"invocation {args.hang_factor:g} × that + --timeout {args.timeout} = "
             f"{args.hang_factor * soak.ref_wall + args.timeout:.0f} s.", "",
             "| measure | value | target |", "|---|---|---|",
             f"| chains (fresh checkpoint dir, faults until one invocation finishes) | {c['chains']} | |",
             f"| invocations of `tiertrain train` | {c['invocations']} | |",
             f"| faults injected (fired) | {fired} | |"]
    for k in FAULTS:
        extra = f" ({save_hits} hit an uncommitted step dir)" if k == "save_kill" else ""
        lines.append(f"| — {k} | {soak.injected[k]} of {soak.requested[k]} drawn{extra} | |")
    lines += [
        f"| kills / signals survived (the chain then finished all steps) | {c['kills_survived']} of {kills} "
        f"| all |",
        f"| swap corruptions survived (the chain then finished all steps) | {c['corruptions_survived']} of "
        f"{soak.injected['corrupt_swap']} | all |",
        f"| resumes (invocations started with a committed checkpoint) | {c['resumes']} | |",
        f"| resumed at newest committed step + 1 | {c['resumes_ok']} of {c['resumes']} (that logged a step) | all |",
        f"| bit-identical continuations / comparisons | {c['identical']} / {c['comparisons']} "
        f"({c['steps_compared']} logged steps compared in all) | all |",
        f"| swap corruptions: job failed naming the file | {c['corrupt_named']}"
        + (f" ({c['corrupt_named_only_in_traceback']} named only in the traceback, not the error line)"
           if c['corrupt_named_only_in_traceback'] else "") + " | |",
        f"| swap corruptions: rewritten before read (job finished, losses identical) | {c['corrupt_overwritten']} | |",
        f"| hangs | {c['hang']} | 0 |",
        f"| lost checkpoints | {c['lost checkpoint']} | 0 |",
        f"| bytes leaked (swap files + checkpoint *.tmp after an ending that could clean up) | "
        f"{c['leaked_bytes']} B in {c['leaked_files']} files (seen after {c['leak_events']} endings) | 0 |",
        f"| processes left behind | {c['process left']} | 0 |",
        f"| residue of whole-group SIGKILLs (nobody left to clean) | {c['residue_bytes']} B in {c['residue_events']}; "
        f"cleared by the next run {c['residue_cleared']} | |",
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
    p.add_argument("--faults", nargs="+", choices=FAULTS, default=list(FAULTS), help="fault kinds drawn from")
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
