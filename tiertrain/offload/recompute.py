"""Marks backward's recomputation of checkpointed blocks, for the stage-3 fetcher
(tiertrain/zero/stage3.py) and activation checkpointing (tiertrain/offload/activations.py):
a leaf module, so the two need not import each other. It lives beside the activations (the
tier package, below zero/), which set it; the fetchers above read it."""
from __future__ import annotations

import contextlib
import threading

_recompute = threading.local()


@contextlib.contextmanager
def recomputation():
    """Marks backward's recomputation of a checkpointed block (tiertrain.offload.activations).
    The forward hooks of stage-3 units inside the block fire again: under this context they
    gather without recording the unit in the traced order or prefetching from it, and release
    afterwards only units whose backward has not begun (the unit whose backward asked for the
    recomputation keeps its parameters; the others are gathered again by their own backward)."""
    _recompute.depth = getattr(_recompute, "depth", 0) + 1
    try:
        yield
    finally:
        _recompute.depth -= 1


def recomputing() -> bool:
    """Whether this thread is inside a recomputation."""
    return getattr(_recompute, "depth", 0) > 0

