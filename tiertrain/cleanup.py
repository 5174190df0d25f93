"""What a killed run leaves, found and removed by the next run or by ``tiertrain clean``.

A local launch keeps a directory ``$TMPDIR/tiertrain-launch-<launcher pid>-*`` where its ranks
register the swap directories and checkpoint directories they write (tiertrain/launch.py); the
launcher removes what they left once every rank is gone. A launcher killed with SIGKILL runs
nothing, its ranks die with it (``PR_SET_PDEATHSIG``), and its launch directory, their swap files
and a half-written checkpoint step stay behind. Each new launch, and ``tiertrain clean``, removes
the launch directories whose launcher is no longer alive, with what they registered, and says
what it removed. ``tiertrain clean DIR`` also settles a checkpoint directory (uncommitted steps,
temporary files; refused while a live job holds it) or a swap directory (rank directories no
live process locks).
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile

LAUNCH_PREFIX = "tiertrain-launch-"
_LAUNCH_DIR = re.compile(rf"^{LAUNCH_PREFIX}(\d+)-")


def new_launch_dir() -> str:
    """The launch directory of this launcher (its pid in the name: whether it is abandoned is
    whether that process is alive)."""
    return tempfile.mkdtemp(prefix=f"{LAUNCH_PREFIX}{os.getpid()}-")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # (another user's process)
        return True
    return True


def remove_launch_dir(launch_dir: str) -> list[str]:
    """Remove what the ranks of a launch registered (swap directories no live process locks,
    what killed saves left in their checkpoint directories), then the launch directory itself;
    returns a line for each thing removed. A swap directory still locked (a killed rank's last
    thread has not closed its files yet) keeps its registration and the launch directory, so
    the next launch or ``tiertrain clean`` removes it."""
    from .state.checkpoint import remove_left_behind as remove_crashed_checkpoint_files
    from .io.swap_dir import remove_left_behind as remove_swap_dirs

    lines = [f"swap directory {d}" for d in remove_swap_dirs(launch_dir)]
    removed = remove_crashed_checkpoint_files(launch_dir)
    if removed:
        lines.append(f"{removed} bytes of unfinished checkpoint saves")
    if not _still_registered(launch_dir):
        shutil.rmtree(launch_dir, ignore_errors=True)
    return lines


def _still_registered(launch_dir: str) -> bool:
    try:
        return any(n.startswith("swap-") for n in os.listdir(launch_dir))
    except OSError:
        return False


def remove_abandoned_launches(tmp_dir: str | None = None) -> list[str]:
    """Remove the launch directories whose launcher process is gone (killed: it could not
    remove them), with what their ranks registered; returns a line for each thing removed."""
    tmp_dir = tmp_dir or tempfile.gettempdir()
    lines = []
    try:
        names = sorted(os.listdir(tmp_dir))
    except OSError:
        return lines
    for name in names:
        m = _LAUNCH_DIR.match(name)
        path = os.path.join(tmp_dir, name)
        if not m or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))) or not os.path.isdir(path):
            continue
        lines += remove_launch_dir(path)
        if not os.path.exists(path):
            lines.append(f"launch directory {path} (its launcher, pid {m.group(1)}, is gone)")
    return lines


def clean_directory(path: str) -> list[str]:
    """Settle a checkpoint directory or a swap directory (zero.nvme_path) left by a killed run;
    returns a line for each thing removed. A checkpoint directory a live job holds is refused
    (CheckpointError naming the job)."""
    from .state.checkpoint import claim_directory, is_checkpoint_directory, release_directory, remove_crashed_saves
    from .io.swap_dir import locked_by_another

    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path!r} is not a directory")
    names = os.listdir(path)
    lines = []
    if is_checkpoint_directory(path):
        claim_directory(path)  # (a CheckpointError naming the holder when a job uses it)
        try:
            before = set(os.listdir(path))
            removed = remove_crashed_saves(path, None)
            gone = sorted(before - set(os.listdir(path)))
            lines += [f"unfinished checkpoint step {os.path.join(path, n)}" for n in gone]
            if removed and not gone:
                lines.append(f"{removed} bytes of unfinished checkpoint saves in {path}")
        finally:
            release_directory(path)
    for name in sorted(names):  # a swap directory: one rank{r}/ per rank, each flock-ed while in use
        rank_dir = os.path.join(path, name)
        if re.fullmatch(r"rank\d+", name) and os.path.isfile(os.path.join(rank_dir, ".lock")) \
                and not locked_by_another(os.path.join(rank_dir, ".lock")):
            shutil.rmtree(rank_dir, ignore_errors=True)
            lines.append(f"swap directory {rank_dir}")
    return lines


__all__ = ["LAUNCH_PREFIX", "new_launch_dir", "remove_launch_dir", "remove_abandoned_launches", "clean_directory"]
