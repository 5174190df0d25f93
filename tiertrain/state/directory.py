"""Managing a checkpoint directory: rotation, what crashed saves left, locks, cleanup.

What happens to a checkpoint directory around the saves themselves: ``rotate`` deletes all but
a run's newest checkpoints (by run id, never another run's), ``remove_crashed_saves`` removes
what a killed save left (temporary files, uncommitted step directories, a half-replaced
committed step), ``lock_directory`` gives one job at a time the directory (an flock held by
rank 0 for as long as its process lives), ``register_for_cleanup`` / ``remove_left_behind`` let
the launcher clean up after ranks that died mid-save, and ``remove_checkpoints`` empties the
directory (checkpoint.overwrite). The format it acts on is tiertrain/state/files.py.
"""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
from typing import Any

import torch.distributed as dist

from ..io.fileio import LockHeld, atomic_write, lock_file
from .files import _SIDE_DIR, _STEP_DIR, MARKER, CheckpointError, _step_path, committed_steps, run_of, \
    saves_newest_first


def _gather_objects(obj: Any, group) -> list[Any]:
    if group is None or not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def rotate(directory: str, run_id: str | None, keep_last: int) -> list[int]:
    """Delete all but the newest keep_last committed checkpoints of run run_id (in the order
    they were saved: saves_newest_first); returns the steps deleted. Rotation goes by run, not
    by step number: another run's checkpoints, those without a run id (written before run ids,
    or by a caller that gave none) and those whose marker is corrupt are never deleted, so a new run in a directory holding an older run's
    higher steps keeps its own checkpoints (once, the older ones won and every new checkpoint
    was deleted the moment it was committed)."""
    if run_id is None or keep_last <= 0:
        return []
    own = [step for step in saves_newest_first(directory, committed_steps(directory))
           if run_of(directory, step) == run_id]
    doomed = own[keep_last:]
    for old in doomed:
        shutil.rmtree(_step_path(directory, old), ignore_errors=True)
    return doomed


def remove_crashed_saves(directory: str, step: int | None) -> int:
    """What a save killed part-way left (a process killed in atomic_write cannot remove its
    temporary file): every ``*.tmp`` file in the step directories up to ``step``, and the
    uncommitted step directories below it (no COMMITTED.json: never loadable); step None: in
    every step directory (nothing is being saved there). A directory with a corrupt marker is
    left for a person to look at. Returns the bytes removed."""
    if step is None:
        step = 1 << 62
    if not os.path.isdir(directory):
        return 0
    removed = _settle_side_dirs(directory, step)
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name)
        if not m or int(m.group(1)) > step:
            continue
        path = os.path.join(directory, name)
        if not os.path.isdir(path):
            continue
        if int(m.group(1)) < step and not os.path.exists(os.path.join(path, MARKER)):
            removed += sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path)
                           if os.path.isfile(os.path.join(path, f)))
            shutil.rmtree(path, ignore_errors=True)
            continue
        for f in os.listdir(path):
            if f.endswith(".tmp") and os.path.isfile(os.path.join(path, f)):
                removed += os.path.getsize(os.path.join(path, f))
                os.remove(os.path.join(path, f))
    return removed


def _settle_side_dirs(directory: str, step: int) -> int:
    """Finish or undo what an interrupted save of a committed step left beside it (steps up to
    ``step``): with step_N committed, step_N.next and step_N.old are leftovers; with step_N gone
    between the two renames of _replace_committed, the committed step_N.next (else .old) takes
    its place. Returns the bytes removed."""
    removed = 0
    for name in sorted(os.listdir(directory)):
        m = _SIDE_DIR.match(name)
        if not m or int(m.group(1)) > step:
            continue
        side, base = os.path.join(directory, name), os.path.join(directory, f"step_{m.group(1)}")
        if not os.path.isdir(side):
            continue
        if not os.path.exists(os.path.join(base, MARKER)) and os.path.exists(os.path.join(side, MARKER)) \
                and _step_path(directory, int(m.group(1))) == side:
            shutil.rmtree(base, ignore_errors=True)  # (an uncommitted step_N cannot be: only absent)
            os.rename(side, base)
            continue
        removed += sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(side) for f in files)
        shutil.rmtree(side, ignore_errors=True)
    return removed


LOCK = ".tiertrain.lock"
"""The lock file of a checkpoint directory in use (lock_directory)."""

_held_locks: dict[str, int] = {}  # real path of a directory this process locked -> the lock file's descriptor


def lock_directory(directory: str, topology, writing: bool = True) -> None:
    """Collective: claim directory for this job's checkpoints, so that a second job given the same
    directory stops with an error naming the job that holds it, instead of resuming the first
    one's run and deleting its half-written steps. Rank 0 holds an exclusive lock (flock) on
    directory/.tiertrain.lock until its process ends or release_directory; the file names the
    holder's host, pid and start time. The kernel drops the lock of a process that dies, so a
    killed job leaves nothing that blocks the next. ``writing=False`` (a load): a directory
    that does not exist is not created, and one this process cannot write to is read unlocked
    (a job that cannot write there cannot harm another's checkpoints)."""
    problem = None
    if topology.rank == 0 and (writing or os.path.isdir(directory)):
        try:
            claim_directory(directory)
        except OSError as e:
            if writing or e.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                problem = f"checkpoint directory {directory!r}: {e}"
        except CheckpointError as e:
            problem = str(e)
    problems = [p for p in _gather_objects(problem, topology.world_group()) if p]
    if problems:
        raise CheckpointError(problems[0])


def claim_directory(directory: str) -> None:
    """This process's exclusive lock on a checkpoint directory (lock_directory's, for one process)."""
    path = os.path.realpath(directory)
    if path in _held_locks:
        return
    os.makedirs(path, exist_ok=True)
    try:
        _held_locks[path] = lock_file(os.path.join(path, LOCK))
    except LockHeld as e:
        raise CheckpointError(f"checkpoint directory {directory!r} is in use by another job ({e.holder}); give each "
                              f"job its own checkpoint directory, or stop that job first") from None


def release_directory(directory: str) -> None:
    """Give up this process's lock on directory (lock_directory), if it holds one."""
    fd = _held_locks.pop(os.path.realpath(directory), None)
    if fd is not None:
        os.close(fd)


def is_checkpoint_directory(directory: str) -> bool:
    """Whether directory holds checkpoint steps (committed or not) or a checkpoint lock."""
    try:
        names = os.listdir(directory)
    except OSError:
        return False
    return LOCK in names or any(_STEP_DIR.match(n) or _SIDE_DIR.match(n) for n in names)


CLEANUP_PREFIX = "checkpoints-"
"""Registration files of checkpoint directories in the launcher's cleanup directory
($TIERTRAIN_CLEANUP_DIR, tiertrain/io/swap.py CLEANUP_ENV)."""


def register_for_cleanup(directory: str) -> None:
    """Tell the local launcher (when there is one) that this process writes checkpoints into
    directory, so that what a rank killed mid-save leaves there is removed once every rank is
    gone (remove_left_behind): the rank itself cannot."""
    from ..io.swap_dir import CLEANUP_ENV

    where = os.environ.get(CLEANUP_ENV)
    if not where or not os.path.isdir(where):
        return
    path = os.path.abspath(directory)
    name = CLEANUP_PREFIX + hashlib.sha256(path.encode()).hexdigest()[:16]
    if not os.path.exists(os.path.join(where, name)):
        try:
            atomic_write(os.path.join(where, name), lambda f: f.write(path.encode()))
        except OSError:
            pass


def remove_left_behind(cleanup_dir: str) -> int:
    """For every checkpoint directory registered in cleanup_dir: remove what killed saves
    left (remove_crashed_saves: *.tmp files, uncommitted step directories). Only once no rank
    writes there any more (the launcher calls it after every rank is gone). Returns bytes removed."""
    removed = 0
    try:
        names = [n for n in os.listdir(cleanup_dir) if n.startswith(CLEANUP_PREFIX)]
    except OSError:
        return 0
    for name in names:
        try:
            with open(os.path.join(cleanup_dir, name)) as f:
                directory = f.read().strip()
            removed += remove_crashed_saves(directory, step=None)
        except OSError:
            pass
    return removed


def remove_checkpoints(directory: str) -> list[int]:
    """Delete every step directory in directory (committed or not): checkpoint.overwrite."""
    if not os.path.isdir(directory):
        return []
    removed = []
    for name in sorted(os.listdir(directory)):
        m = _STEP_DIR.match(name) or _SIDE_DIR.match(name)
        if m and os.path.isdir(os.path.join(directory, name)):
            shutil.rmtree(os.path.join(directory, name))
            if int(m.group(1)) not in removed:
                removed.append(int(m.group(1)))
    return removed
