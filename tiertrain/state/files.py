"""The on-disk format of a checkpoint directory, and reading it without trusting it.

A directory holds one ``step_NNNNNNNN`` directory per saved step (and, while a step already
committed is saved again, ``step_N.next`` / ``step_N.old`` beside it); a step is committed once
its ``COMMITTED.json`` marker exists (written last: each rank's layout fingerprint and file
sha256, the shard descriptions, the extra files' digests, the run id and save number). This
module names those files, reads and checks markers (a corrupt one is a CheckpointError naming
the file), lists and orders the committed steps, finds the one to load, opens a checkpoint's
files only when they are plain regular files, verifies their checksums and reads rank files
with the weights-only unpickler; the diverged marks live here too. Writing and committing is
tiertrain/state/checkpoint.py; rotation, cleanup and locks are tiertrain/state/directory.py.
"""
from __future__ import annotations

import errno
import json
import math
import os
import pickle
import re
import stat

import torch

from ..errors import CheckpointError
from ..io.fileio import atomic_write, stream_sha256

MARKER = "COMMITTED.json"
_STEP_DIR = re.compile(r"^step_(\d{8})$")
NEXT, OLD = ".next", ".old"
"""A save of a step already committed is written beside it, in step_N.next, and takes its place
once committed (atomically where the system can exchange two directories; else step_N is renamed
to step_N.old first): the committed checkpoint is never uncommitted, and is removed only after."""
_SIDE_DIR = re.compile(r"^step_(\d{8})(\.next|\.old)$")


class interpreting:
    """``with interpreting(step_dir):`` errors met while interpreting a checkpoint's contents (its
    marker's layout and shard descriptions, its tensors' shapes) become a CheckpointError naming
    it. A checkpoint is data: one changed after it was written (a marker edited, a file replaced
    with its checksum recomputed) must end in an error that names it, not in a traceback from
    deep inside the reader (found by tests/fuzz_checkpoints.py). The original error is chained
    (--debug shows it). (A class, not contextlib.contextmanager, which lets a StopIteration
    through unchanged.)"""

    CAUGHT = (KeyError, IndexError, TypeError, ValueError, StopIteration, AttributeError, OverflowError,
              RuntimeError)

    def __init__(self, step_dir: str):
        self.step_dir = step_dir

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, error, tb) -> bool:
        if error is None or isinstance(error, CheckpointError) or not isinstance(error, self.CAUGHT):
            return False
        text = str(error).strip().splitlines()
        raise CheckpointError(f"the checkpoint in {self.step_dir!r} does not hold together ({kind.__name__}: "
                              f"{text[0][:300] if text else ''}): its commit marker or files were changed after "
                              f"tiertrain wrote them") from error


def rank_file_name(rank: int) -> str:
    """The name of rank's file in a step directory."""
    return f"rank{rank:05d}.pt"


_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")
MAX_MARKER_BYTES = 64 << 20
"""A commit marker larger than this is not one (it is read whole into memory)."""


def open_checkpoint_file(step_dir: str, name: str) -> int:
    """An open descriptor (read-only) of file ``name`` of a step directory, once it is what a
    checkpoint's file is: a plain name (no path separator, no ``..``), not a symbolic link, a
    regular file (not a FIFO, a device or a directory) in a step directory that is no link
    either. A checkpoint directory may come from anyone, and its commit marker names files: a
    link to /dev/zero or a FIFO used to make export and resume read or wait forever, and a path
    in the marker could point anywhere. The caller closes the descriptor."""
    if not isinstance(name, str) or not _PLAIN_NAME.match(name):
        raise CheckpointError(f"{step_dir!r}: the commit marker names the file {name!r}, which is not a plain file "
                              f"name in the step directory (letters, digits, '_', '.', '-'; no path)")
    if os.path.islink(step_dir):
        raise CheckpointError(f"{step_dir!r} is a symbolic link: a checkpoint's step directories are never links")
    path = os.path.join(step_dir, name)
    try:  # (O_NONBLOCK: opening a FIFO returns at once, and fstat then refuses it)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise CheckpointError(f"{path!r} is missing from a committed checkpoint") from None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise CheckpointError(f"{path!r} is a symbolic link: a checkpoint's files are never links "
                                  f"(one pointing out of the directory, or at a device, is refused)") from None
        raise CheckpointError(f"{path!r} cannot be read: {e.strerror or e}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise CheckpointError(f"{path!r} is not a regular file (a FIFO, a device or a directory): refused")
    os.set_blocking(fd, True)
    return fd


_verified: dict[tuple[str, str], tuple[int, int, int]] = {}  # (path, sha256) -> (inode, size, mtime_ns) last verified


def verified_file(step_dir: str, name: str, sha256: str) -> str:
    """The path of a committed checkpoint's file, once it exists and its content has the
    sha256 committed for it (a CheckpointError naming the file otherwise). A file verified
    before and unchanged since (inode, size, modification time) is not read again."""
    path = os.path.join(step_dir, name)
    fd = open_checkpoint_file(step_dir, name)
    try:
        st = os.fstat(fd)
        seen = (st.st_ino, st.st_size, st.st_mtime_ns)
        if _verified.get((path, sha256)) == seen:
            return path
        with os.fdopen(os.dup(fd), "rb") as f:
            actual = stream_sha256(f)
        if actual != sha256:
            raise CheckpointError(f"{path!r} is corrupt: its sha256 differs from the one committed")
    finally:
        os.close(fd)
    _verified[(path, sha256)] = seen
    return path


def _unpickler_reason(message: str) -> str:
    """The point of torch's weights-only refusal (the global it would not import, or its
    reason), without its advice to retry with the full unpickler (the one thing not to do
    with a file from elsewhere)."""
    found = re.search(r"GLOBAL ([\w.]+)", message)
    if found:
        return f"a pickled reference to {found.group(1)}"
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    for line in lines:
        if "WeightsUnpickler error:" in line:
            return line.split("WeightsUnpickler error:", 1)[1].strip()
    boilerplate = ("Weights only load failed", "Check the documentation", "(1)", "(2)")
    return next((line for line in lines if not line.startswith(boilerplate)), "an object it does not rebuild")


def load_rank_file(path: str, device: torch.device, mmap: bool = False) -> dict:
    """torch.load with the weights-only unpickler: nothing in the file can run code. mmap:
    tensors stay in the file's pages until read (resharding reads parts of several files)."""
    try:
        state = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{path!r} is refused: loading it would unpickle {_unpickler_reason(str(e))}, "
                              f"which torch.load(weights_only=True) does not run; a tiertrain checkpoint "
                              f"holds only tensors and plain values, so this file was not written by "
                              f"tiertrain or was changed since") from None
    except Exception as e:  # (a malformed archive whose checksum was committed as well)
        raise CheckpointError(f"{path!r} could not be read: {type(e).__name__}: {e}") from e
    if not isinstance(state, dict) or "extra" not in state:
        raise CheckpointError(f"{path!r} does not hold a tiertrain rank state (a dict of parts and "
                              f"'extra'); it holds {type(state).__name__}")
    return state


def peek_extra(step_dir: str, rank: int = 0) -> dict | None:
    """The extras saved in rank's file of a step directory, read without the checksum check or
    the tensors (mmap; for a comparison before loading, which checks everything), or None when
    the file cannot be read that way (the load then names what is wrong)."""
    try:
        state = torch.load(os.path.join(step_dir, rank_file_name(rank)), map_location="cpu",
                           weights_only=True, mmap=True)
    except Exception:
        return None
    extra = state.get("extra") if isinstance(state, dict) else None
    return extra if isinstance(extra, dict) else None


# -- commit markers, their order, the step to load -----------------------------------------

_MARKER_KEYS = ("step", "world_size", "layouts", "sha256")


def _step_path(directory: str, step: int) -> str:
    """Where step's committed checkpoint is: step_N, or, while a save of a step already
    committed is between its two renames (_replace_committed without an atomic exchange), the
    new step_N.next, else the old step_N.old."""
    base = os.path.join(directory, f"step_{step:08d}")
    for path in (base, base + NEXT, base + OLD):
        if os.path.exists(os.path.join(path, MARKER)):
            return path
    return base


def marked_steps(directory: str) -> list[int]:
    """Steps whose directory holds a commit marker, intact or not, oldest first."""
    if not os.path.isdir(directory):
        return []
    steps = set()
    for name in os.listdir(directory):
        m = _STEP_DIR.match(name) or _SIDE_DIR.match(name)
        if m and os.path.exists(os.path.join(directory, name, MARKER)):
            steps.add(int(m.group(1)))
    return sorted(steps)


def read_marker(directory: str, step: int) -> dict:
    """The commit marker of step, or a CheckpointError naming the file when it cannot be read,
    is not JSON or is not a marker (a byte flip, a truncation, a hand edit)."""
    step_dir = _step_path(directory, step)
    path = os.path.join(step_dir, MARKER)
    fd = open_checkpoint_file(step_dir, MARKER)
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read(MAX_MARKER_BYTES + 1)
        if len(data) > MAX_MARKER_BYTES:
            raise CheckpointError(f"{path!r} is corrupt: larger than {MAX_MARKER_BYTES} bytes, which no commit "
                                  f"marker is")
        marker = json.loads(data.decode("utf-8"))
    except OSError as e:
        raise CheckpointError(f"{path!r} cannot be read: {e.strerror or e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path!r} is corrupt: it is not valid JSON ({e}); the commit marker "
                              f"of step {step} cannot be trusted") from None
    missing = [key for key in _MARKER_KEYS if not isinstance(marker, dict) or key not in marker]
    if missing:
        raise CheckpointError(f"{path!r} is corrupt: it is not a tiertrain commit marker (a JSON object with "
                              f"{', '.join(_MARKER_KEYS)}; missing {', '.join(missing)})")
    problem = _marker_shape_problem(marker)
    if problem:
        raise CheckpointError(f"{path!r} is corrupt: {problem}")
    return marker


def _marker_shape_problem(marker: dict) -> str | None:
    """What in a marker does not hold together (one checksum and one layout per rank, ...)."""
    world = marker["world_size"]
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        return f"world_size {world!r} is not a positive number of ranks"
    for key in ("sha256", "layouts") + (("shards",) if "shards" in marker else ()):
        value = marker[key]
        if not isinstance(value, list) or len(value) != world:
            return f"{key!r} must list one entry per rank ({world}), it has {len(value) if isinstance(value, list) else value!r}"
    bad = [d for d in marker["sha256"] if not (isinstance(d, str) and re.fullmatch(r"[0-9a-f]{64}", d))]
    if bad:
        return f"'sha256' holds {bad[0]!r}, which is not a sha256 digest"
    files = marker.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        return "'files' must map file names to sha256 digests"
    save_id = marker.get("save_id", 0)
    if isinstance(save_id, bool) or not isinstance(save_id, int) or not 0 <= save_id < 1 << 62:
        return f"'save_id' {save_id!r} is not a save number (an int >= 0)"
    return None


def _marker_problem(directory: str, step: int) -> str | None:
    try:
        read_marker(directory, step)
    except CheckpointError as e:
        return str(e)
    return None


def run_of(directory: str, step: int) -> str | None:
    """The run id in step's commit marker (None: written without one, or unreadable)."""
    try:
        run_id = read_marker(directory, step).get("run_id")
    except CheckpointError:
        return None
    return run_id if isinstance(run_id, str) else None


def committed_steps(directory: str) -> list[int]:
    """Steps with a complete (committed) checkpoint in directory whose commit marker is intact
    (a JSON object with the marker's keys), oldest first. A step whose marker is corrupt is
    left out (find_committed names it); marked_steps lists those too."""
    return [step for step in marked_steps(directory) if _marker_problem(directory, step) is None]


def saves_newest_first(directory: str, steps: list[int] | None = None) -> list[int]:
    """The marked steps (or ``steps``) in the order they were saved, newest first: by each
    marker's ``save_id`` (one more than the directory's largest at every commit), then by step.
    The step count alone does not say which save is newest: a run resumed from an older
    checkpoint (the newer ones marked diverged, or one loaded by its step) saves lower steps
    after higher ones of the line it left. A marker without a save_id (written before them)
    counts as 0; one that cannot be read comes first, so a caller reaches it, and names it."""
    return sorted(marked_steps(directory) if steps is None else steps,
                  key=lambda step: (_save_id(directory, step), step), reverse=True)


def _save_id(directory: str, step: int) -> float:
    """step's save number (0 for a marker written before them; inf for one that cannot be read)."""
    try:
        return float(read_marker(directory, step).get("save_id", 0))
    except CheckpointError:
        return math.inf


def _next_save_id(directory: str) -> int:
    ids = [i for i in (_save_id(directory, step) for step in marked_steps(directory)) if i != math.inf]
    return int(max(ids, default=0)) + 1


def find_committed(directory: str, step: int | None = None) -> tuple[str, dict]:
    """(step directory, its commit marker) of the newest (or the given) committed checkpoint.
    A corrupt marker (not JSON, not a marker) of the given step is a CheckpointError naming the
    file; without a step, newer checkpoints with corrupt markers are passed over, with a
    warning naming each file, for the newest intact one (a CheckpointError naming them when
    none is intact)."""
    marked = marked_steps(directory)
    if step is not None:
        if step not in marked:
            raise CheckpointError(f"no committed checkpoint for step {step} in {directory!r}; "
                                  f"committed: {committed_steps(directory)}")
        return _step_path(directory, step), read_marker(directory, step)
    corrupt = []
    for candidate in saves_newest_first(directory, marked):
        problem = _marker_problem(directory, candidate)
        if problem is None:
            if corrupt:
                import warnings

                warnings.warn(f"{'; '.join(corrupt)}: falling back to step {candidate}, the newest intact "
                              f"committed checkpoint in {directory!r}", stacklevel=2)
            return _step_path(directory, candidate), read_marker(directory, candidate)
        corrupt.append(problem)
    if corrupt:
        raise CheckpointError(f"no intact committed checkpoint in {directory!r}: {'; '.join(corrupt)}")
    raise CheckpointError(f"no committed checkpoint in {directory!r}")


DIVERGED = "DIVERGED.json"
"""Written into a committed step directory whose state a run found diverged (mark_diverged)."""


def mark_diverged(directory: str, step: int, reason: str) -> bool:
    """Mark step's committed checkpoint as the state of a run that diverged (its next steps'
    gradients were never finite again), so that a resume passes over it by default
    (agree_on_checkpoint); returns whether a committed checkpoint of that step was there."""
    step_dir = _step_path(directory, step)
    if not os.path.exists(os.path.join(step_dir, MARKER)):
        return False
    atomic_write(os.path.join(step_dir, DIVERGED), lambda f: f.write(json.dumps({"reason": reason}).encode()))
    return True


def diverged_reason(directory: str, step: int) -> str | None:
    """Why step's checkpoint is marked diverged, or None when it is not."""
    path = os.path.join(_step_path(directory, step), DIVERGED)
    if not os.path.lexists(path):
        return None
    try:
        fd = open_checkpoint_file(os.path.dirname(path), DIVERGED)
        with os.fdopen(fd, "rb") as f:
            reason = json.loads(f.read(1 << 16).decode("utf-8")).get("reason")
    except (CheckpointError, OSError, ValueError, AttributeError):
        reason = None
    return str(reason)[:500] if reason else "no reason recorded"
