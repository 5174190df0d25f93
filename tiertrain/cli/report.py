"""How an exception that ends a command is reported: as one ``error: ...`` line with the exit
status its class gives (tiertrain.errors.TiertrainError), or, for a failure of the program,
with its traceback. ``tiertrain --debug`` adds the traceback in every case."""
from __future__ import annotations

import os
import sys
import traceback

from ..errors import TiertrainError
from .common import print_error


def report_failure(exc: Exception, debug: bool, value_error_is_bad_argument: bool) -> int | None:
    """Report ``exc`` (being handled) and return the exit status; None when it is a failure of
    the program, for the caller to re-raise with its traceback. ``value_error_is_bad_argument``:
    the command reports its bad arguments as ValueError (the estimator, the probe, the planner);
    training reports configuration errors as ConfigError, and any other ValueError raised while
    training is a failure of the run."""
    _record_for_torchrun(exc)
    launch = sys.modules.get("tiertrain.launch")  # (imported by whatever started workers)
    if launch is not None and isinstance(exc, launch.WorkerFailure):
        return report_worker_failure(exc, debug)
    text = str(exc).strip()
    first_line = text.splitlines()[0] if text else ""
    if isinstance(exc, TiertrainError) and exc.message_is_diagnosis:  # (this rank's own, under torchrun)
        message, code = f"rank {os.environ.get('RANK', '0')} failed: {type(exc).__name__}: {first_line}", 1
    elif isinstance(exc, TiertrainError) and exc.exit_code is not None:
        message, code = first_line or type(exc).__name__, exc.exit_code
    elif isinstance(exc, ValueError) and value_error_is_bad_argument:
        message, code = str(exc), 2
    else:
        return None
    if debug:
        traceback.print_exc()
    return print_error(message, code=code)


def report_worker_failure(failure, debug: bool) -> int:
    """A worker rank's failure (launch.WorkerFailure): a user error as its one line, anything
    else (or everything with --debug) with the rank's traceback and the other ranks' notes."""
    code = failure.exit_code
    if code is None or debug:
        if failure.details:
            print(failure.details.rstrip(), file=sys.stderr)
        for other in failure.others:
            print(f"note: also failed: {other}", file=sys.stderr)
    if code is not None:
        return print_error(failure.message, code=code)
    kind = f"{failure.exc_type}: " if failure.exc_type else ""
    return print_error(f"rank {failure.rank} failed: {kind}{failure.message}", code=1)


def _record_for_torchrun(exc: BaseException) -> None:
    """Under torchrun, write the failure to the error file torchrun gives each rank
    (TORCHELASTIC_ERROR_FILE, torch.distributed.elastic's own error handler), so that its
    summary shows this message instead of an exit code and "error_file: <N/A>"."""
    if not os.environ.get("TORCHELASTIC_ERROR_FILE"):
        return
    try:
        from torch.distributed.elastic.multiprocessing.errors import get_error_handler

        get_error_handler().record_exception(exc)
    except Exception:  # noqa: BLE001 - the report is best effort; the failure itself is printed below
        pass
