"""tiertrain's errors are one family (tiertrain.errors.TiertrainError), and the ``tiertrain``
command reports each by what its class says, never by its name.

1. Every exception class tiertrain defines is a TiertrainError, found by importing every
   module and walking the subclasses of BaseException: a class added later without the base
   fails here unless it joins the justified list of exceptions below. Each keeps the builtin
   base it always had, so ``except ValueError`` in a caller's code still catches it.
2. The classes say what the command always did: exit status 2 for an invalid configuration,
   1 for a refused checkpoint, a diverged run and an unusable swap directory; one line naming
   the rank for a collective's diagnosis; a traceback for anything else.
3. The command applies that to classes it has never seen, in this process and in a worker
   rank (whose exception crosses a process boundary as launch.WorkerFailure).
"""
from __future__ import annotations

import importlib
import pkgutil

import pytest
import torch.distributed as dist

import tiertrain
from tiertrain import TiertrainError, cli, launch
from tiertrain.state.checkpoint import CheckpointError
from tiertrain.comm import CollectiveMismatchError, CollectiveTimeout, PeerLost
from tiertrain.config import ConfigError
from tiertrain.io.aio import SwapCorruptionError, SwapDirError, SwapError, SwapSpaceError
from tiertrain.precision import NonFiniteError

OUTSIDE_THE_FAMILY = {
    launch.Terminated: "SIGTERM as a KeyboardInterrupt: a TiertrainError is an Exception, and an "
                       "`except Exception` on the way out would swallow the stop request",
}
"""The only exception classes of tiertrain that are not TiertrainErrors, each with the reason."""


def _tiertrain_exception_classes() -> list[type[BaseException]]:
    """Every exception class a tiertrain module defines, warning categories aside (a warning
    is issued, never raised to end a command)."""
    for module in pkgutil.walk_packages(tiertrain.__path__, "tiertrain."):
        if module.name.rpartition(".")[2] != "__main__":  # (running a command is not defining one)
            importlib.import_module(module.name)
    found, stack = [], [BaseException]
    while stack:
        for subclass in stack.pop().__subclasses__():
            stack.append(subclass)
            if subclass.__module__.split(".")[0] == "tiertrain" and not issubclass(subclass, Warning) \
                    and subclass not in found:
                found.append(subclass)
    return found


def test_every_exception_tiertrain_defines_is_a_tiertrain_error():
    classes = _tiertrain_exception_classes()
    assert len(classes) >= 20 and ConfigError in classes and launch.WorkerFailure in classes  # (the walk works)
    outside = [f"{c.__module__}.{c.__qualname__}" for c in classes
               if not issubclass(c, TiertrainError) and c not in OUTSIDE_THE_FAMILY]
    assert not outside, f"derive these from tiertrain.errors.TiertrainError (or justify them in OUTSIDE_THE_FAMILY): {outside}"


def test_each_error_keeps_its_builtin_base():
    assert issubclass(ConfigError, ValueError) and issubclass(CheckpointError, RuntimeError)
    assert all(issubclass(c, OSError) for c in (SwapError, SwapDirError, SwapSpaceError, SwapCorruptionError))
    with pytest.raises(ValueError):
        raise ConfigError("zero.stage=5 is invalid: expected 0, 1, 2 or 3")
    error = SwapSpaceError("no room", "/swap/rank0", requested_bytes=4096, errno=28)
    assert isinstance(error, OSError) and error.errno == 28 and str(error) == "no room"


@pytest.mark.parametrize("error, exit_code", [(ConfigError, 2), (CheckpointError, 1), (NonFiniteError, 1),
                                              (SwapDirError, 1), (SwapSpaceError, None), (SwapError, None),
                                              (TiertrainError, None)])
def test_a_user_error_has_an_exit_status_and_a_failure_of_the_program_none(error, exit_code):
    assert error.exit_code == exit_code


@pytest.mark.parametrize("error", [CollectiveTimeout, CollectiveMismatchError, PeerLost])
def test_a_collective_s_failure_is_its_own_diagnosis(error):
    assert error.message_is_diagnosis and error.exit_code is None


def test_a_ranks_diagnosis_is_reported_as_one_line_naming_the_rank(monkeypatch, capsys):
    class ArrivedLate(TiertrainError, RuntimeError):
        message_is_diagnosis = True

    def command(argv):
        raise ArrivedLate("rank 1 never issued all_reduce #9\n(more detail)")

    monkeypatch.setitem(cli.COMMANDS, "train", command)
    monkeypatch.setenv("RANK", "3")
    assert cli.main(["train"]) == 1
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: rank 3 failed: ArrivedLate: rank 1 never issued all_reduce #9"]


class UnreadableShardsDirectory(ConfigError):
    """A configuration error the command has never heard of."""


class QuotaRefused(TiertrainError, RuntimeError):
    """A refusal the user acts on, with a status of its own."""

    exit_code = 4


@pytest.mark.parametrize("error, exit_code", [(UnreadableShardsDirectory, 2), (QuotaRefused, 4)])
def test_a_user_error_the_command_has_never_seen_is_one_line_with_its_exit_status(monkeypatch, capsys, error,
                                                                                  exit_code):
    def command(argv):
        raise error("zero.nvme_path='/x' is invalid: expected a directory you can read\n(a second line)")

    monkeypatch.setitem(cli.COMMANDS, "train", command)
    assert cli.main(["train"]) == exit_code
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: zero.nvme_path='/x' is invalid: expected a directory you can read"]


def test_a_failure_of_the_program_keeps_its_traceback(monkeypatch):
    class BrokenInvariant(TiertrainError, RuntimeError):
        pass

    def command(argv):
        raise BrokenInvariant("the shard count changed mid-step")

    monkeypatch.setitem(cli.COMMANDS, "train", command)
    with pytest.raises(BrokenInvariant):  # (the interpreter prints it with its traceback)
        cli.main(["train"])


def _rank1_refuses_its_checkpoint():
    if dist.get_rank() == 1:
        raise UnreadableShardsDirectory("checkpoint.dir='/ckpt' is invalid: expected a directory you can read")
    dist.barrier()  # rank 0 would wait here forever without the launcher stopping it


def test_a_worker_rank_s_user_error_crosses_the_process_boundary_as_one_line(monkeypatch, capsys):
    """The rank computes the exit status from its live exception; the launcher's report of it
    carries the status, and the command prints the rank's one line (no traceback, no notes)."""
    monkeypatch.setitem(cli.COMMANDS, "train", lambda argv: launch.launch_local(_rank1_refuses_its_checkpoint, 2,
                                                                                timeout=30))
    assert cli.main(["train"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: checkpoint.dir='/ckpt' is invalid: expected a directory you can read"]


def test_a_worker_rank_s_failure_of_the_program_carries_no_exit_status():
    with pytest.raises(launch.WorkerFailure) as failure:
        launch.launch_local(_rank1_fails, 2, timeout=30)
    assert failure.value.rank == 1 and failure.value.exit_code is None and "Traceback" in failure.value.details


def _rank1_fails():
    if dist.get_rank() == 1:
        raise KeyError("w")
    dist.barrier()
