"""The completion handle of a :class:`~tiertrain.io.swap.TensorSwapper` request: one or more
file requests of :class:`~tiertrain.io.aio.AsyncIO` plus the copies that follow them, waited on
as one (``wait``, ``exception``, ``add_done_callback``).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, List, Optional

from .aio import Handle
from ..waits import WaitClock, run_timeout

__all__ = ["SwapHandle"]


class SwapHandle:
    """Completion of a swap_out / swap_in (one or more file requests plus the copies that
    follow them). ``wait(timeout)`` returns the destination tensor for swap_in, None for
    swap_out, and re-raises the first error."""

    def __init__(self, op: str, key: Any, path: str, result=None, clock: Optional[WaitClock] = None):
        self.op = op
        self._clock = clock
        self.key = key
        self.path = path
        self._result = result
        self._lock = threading.Lock()
        self._count = 1                  # sealed with _seal() once every part is attached
        self._finished = False
        self._error: Optional[BaseException] = None
        self._event = threading.Event()
        self._callbacks: List[Callable[["SwapHandle"], None]] = []

    def _attach(self, h: Handle, finish: Callable[[Handle], None]) -> None:
        with self._lock:
            self._count += 1

        def done(h: Handle) -> None:
            err = h._error
            if err is not None:
                h.claim_error()              # reported through this SwapHandle
            try:
                finish(h)
            except BaseException as e:  # noqa: BLE001
                err = err or e
            self._part_done(err)

        h.add_done_callback(done)

    def _seal(self, error: Optional[BaseException] = None) -> None:
        self._part_done(error)

    def _part_done(self, err: Optional[BaseException]) -> None:
        with self._lock:
            if err is not None and self._error is None:
                self._error = err
            self._count -= 1
            if self._count:
                return
            self._finished = True
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:               # before waiters wake: e.g. a prefetch chained on this
            try:                           # write has started once wait()/flush() return
                fn(self)
            except BaseException:  # noqa: BLE001
                pass
        self._event.set()

    def add_done_callback(self, fn: Callable[["SwapHandle"], None]) -> None:
        """Run ``fn(handle)`` on completion, in the completing thread before ``wait`` returns
        (``fn`` must not wait on this handle), or now if it is already complete."""
        with self._lock:
            if not self._finished:
                self._callbacks.append(fn)
                return
        fn(self)

    def done(self) -> bool:
        return self._event.is_set()

    def exception(self, timeout: Optional[float] = None) -> Optional[BaseException]:
        self._wait_event(timeout)
        return self._error

    def _wait_event(self, timeout: Optional[float]) -> None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self.op} of key {self.key!r} ({self.path}) not finished after "
                               f"{timeout} s")

    def wait(self, timeout: Optional[float] = None):
        """None: the run's timeout (tiertrain.waits.run_timeout())."""
        with self._clock.timing() if self._clock is not None else contextlib.nullcontext():
            self._wait_event(run_timeout() if timeout is None else timeout)
        if self._error is not None:
            raise self._error
        return self._result

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error else "done")
        return f"SwapHandle({self.op} {self.key!r} -> {self.path}, {state})"
