"""The base of tiertrain's errors, and how the ``tiertrain`` command reports each one.

Every exception class tiertrain defines derives from :class:`TiertrainError` as well as from
the builtin it always had (``ValueError``, ``RuntimeError``, ``OSError``), so ``except
ValueError`` in a caller's code still catches a ``ConfigError``. The command reads the class
attributes below, never a class name: a new subclass is reported as its base says.

:class:`CheckpointError` lives here too, not with the checkpoint files
(tiertrain/state/files.py re-exports it): the optimizer-step forms below the state package
raise it when a checkpoint's optimizer state does not fit. So does
:class:`ReleasedParameterError` (raised by tiertrain/zero/released.py), which the API pages
can then show: they cannot read the ``tiertrain.zero`` namespace package.
"""
from __future__ import annotations

__all__ = ["CheckpointError", "ReleasedParameterError", "TiertrainError", "listing", "parameters_named", "said"]


class TiertrainError(Exception):
    """The base of every error tiertrain raises on purpose.

    Its class attributes say how the ``tiertrain`` command reports it when it ends a command
    (``tiertrain --debug`` adds the traceback in every case)."""

    exit_code: int | None = None
    """The exit status of a one-line report ``error: <first line of the message>``: a user's
    mistake, or a refusal the user acts on (2 for an invalid configuration, 1 otherwise).
    None: a failure of the program, reported with its traceback."""

    message_is_diagnosis: bool = False
    """The message is a rank's diagnosis of a distributed failure (which rank hung, died or
    issued another collective): reported as the one line ``error: rank R failed: <class>:
    <message>``, exit status 1, the traceback adding nothing to it."""


class CheckpointError(TiertrainError, RuntimeError):
    """A checkpoint is missing, corrupt or was saved with another layout."""

    exit_code = 1


class ReleasedParameterError(TiertrainError, RuntimeError):
    """A stage-3 parameter's values were read while its unit is released (outside forward and
    outside ``engine.gathered_parameters()``): tiertrain/zero/released.py."""

    exit_code = 1


def listing(names, limit: int = 4) -> str:
    """Names for a message: "'a', 'b' and 3 more" (the first ``limit``, quoted)."""
    names = list(names)
    return ", ".join(repr(n) for n in names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")


def parameters_named(names: list[str]) -> tuple[str, bool]:
    """("parameter 'a'" or "parameters 'a', 'b' and 3 more", whether there is one) for messages."""
    return f"parameter{'' if len(names) == 1 else 's'} {listing(names)}", len(names) == 1


def said(error: BaseException, limit: int = 200) -> str:
    """An error in a few words for another error's message: its type and the first line of what
    it says (cut at limit characters), which may be nothing."""
    lines = str(error).splitlines()
    return f"{type(error).__name__}: {lines[0][:limit]}" if lines else type(error).__name__
