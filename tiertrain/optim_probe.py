"""Whether an optimizer can step parameters piece by piece, decided by what it does, not by
its name (issue 37, item 2).

Every data-parallel rank steps its slice of the flat shards (ZeRO §5.1: each rank updates
only the optimizer state it owns), so a parameter reaches the optimizer cut into pieces of
flattened elements. An elementwise optimizer (SGD, Adam, AdamW, RMSprop, Adagrad, ...) gives
the same values either way; one that looks at a whole tensor (Muon orthogonalises each
matrix, Adafactor factors its second moment, LAMB scales by a per-tensor trust ratio) does
not, and trained that way it would end far from single-process training with no error. A
user's own class under any name is checked the same way.

The probe: a copy of the optimizer, with each group's hyper-parameters, steps a small matrix
and a vector a few times with the same gradients twice, whole and cut into flat pieces at
uneven points (a piece across the two tensors' boundary included, as a shard would be), and
the two results are compared; then again at a size above the thresholds of optimizers whose
arithmetic depends on a tensor's size (bitsandbytes' 8-bit states, quantised in blocks of
256 from a tensor's first element, for tensors of ``min_8bit_size`` = 4096 elements or more).
Elementwise arithmetic agrees to rounding (fused kernels round a vectorised body and a scalar
tail differently). An optimizer that steps whole tensors but
not pieces takes the whole-parameter path (tiertrain/update/whole.py: each parameter updated
whole by one owning rank); one that cannot even step whole tensors without more than a
gradient (a closure, sparse gradients) is refused, naming why, before the engine builds
anything.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

SHAPES = ((6, 5), (5,))
"""The probe's parameters: a matrix and a vector (a weight and its bias); the matrix alone for
an optimizer that takes matrices only (Muon)."""
CUTS = (7, 19)
"""Where the flattened probe is cut: uneven pieces (one across the two tensors' boundary)."""
LARGE_SHAPES = ((192, 160), (160,))
"""The second round's parameters: 30 720 elements, above the size thresholds of optimizers that
treat small tensors apart (bitsandbytes' ``min_8bit_size``, 4096 by default)."""
LARGE_CUTS = (1000, 30001)
"""Its cuts: not at multiples of a quantisation block (256), one piece below the 8-bit
threshold and one across the tensors' boundary."""
STEPS = 3
TOLERANCE = 1e-4
"""Largest difference allowed, relative to the largest change the steps made (plus a few
roundings of the values themselves): the same elementwise arithmetic in another order differs
by ~1e-7 of the values; a whole-tensor optimizer differs at the order of its steps."""


def _gradients(step: int, shapes=SHAPES) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return [torch.randn(shape, generator=g) for shape in shapes]


def _run(build: Callable, options: dict, params: list[torch.Tensor], grads_of: Callable[[int], list[torch.Tensor]]):
    optimizer = build([{"params": params, **options}])
    for step in range(STEPS):
        for p, g in zip(params, grads_of(step)):
            p.grad = g
        optimizer.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


def _pieces(tensors: list[torch.Tensor], cuts=CUTS) -> list[torch.Tensor]:
    flat = torch.cat([t.reshape(-1) for t in tensors])
    bounds = (0, *cuts, flat.numel())
    return [flat[a:b].clone() for a, b in zip(bounds, bounds[1:])]


def _compared(reference: torch.Tensor, other: torch.Tensor, start: list[torch.Tensor]) -> tuple[float, float, bool]:
    """(largest difference of other from reference, largest change the steps made from start,
    whether the difference is beyond TOLERANCE of that change plus a few roundings)."""
    moved = float((reference - torch.cat([t.reshape(-1) for t in start])).abs().max())
    difference = float((reference - other).abs().max())
    return difference, moved, difference > TOLERANCE * moved + 1e-6 * float(reference.abs().max())


@dataclass(frozen=True)
class Probe:
    """What the probe found for one param group of an optimizer."""

    steps_whole: bool
    """Stepping whole parameters, given only their gradients, works."""
    problem: str | None
    """Why it cannot step flat pieces as it steps whole tensors; None: it is elementwise."""

    @property
    def elementwise(self) -> bool:
        return self.problem is None


def probe(build: Callable, options: dict, name: str) -> Probe:
    """Whether the optimizer ``build`` (a factory of param groups) with a group's ``options``
    steps whole tensors, and steps flat pieces the same way, at a small size and at a large one
    (see the module docstring)."""
    small = _probe_at(build, options, name, SHAPES, CUTS)
    if not small.elementwise:
        return small
    return _probe_at(build, options, name, LARGE_SHAPES, LARGE_CUTS)


def _probe_at(build: Callable, options: dict, name: str, shapes_tried: tuple, cuts: tuple) -> Probe:
    failed = None
    for shapes in (shapes_tried, shapes_tried[:1]):
        start = [torch.randn(shape, generator=torch.Generator().manual_seed(7)) for shape in shapes]
        try:
            whole = _run(build, options, [t.clone().requires_grad_(True) for t in start],
                         lambda step: _gradients(step, shapes))
            break
        except Exception as e:  # (a closure or sparse gradients needed; or matrices only: try one)
            failed = failed or e
    else:
        return Probe(False, f"stepping it on a {shapes_tried[0]} matrix and a {shapes_tried[1]} vector raised "
                            f"{type(failed).__name__}: {' '.join(str(failed).split())[:200]}")
    try:
        cut = _run(build, options, [p.requires_grad_(True) for p in _pieces(start, cuts)],
                   lambda step: _pieces(_gradients(step, shapes), cuts))
    except Exception as e:
        return Probe(True, f"stepping it on flat pieces of parameters (as each rank steps its slice of the flat "
                           f"shards) raised {type(e).__name__}: {' '.join(str(e).split())[:200]}")
    difference, moved, beyond = _compared(whole, cut, start)
    if not torch.isfinite(whole).all() or beyond:
        return Probe(True, f"stepped on {' and '.join(str(s) for s in shapes)} tensors whole and cut into flat "
                           f"pieces (as each rank steps its slice of the flat shards), {name} gives other values: "
                           f"largest difference {difference:.2e}, for changes up to {moved:.2e}; it does not "
                           f"update each element on its own")
    return Probe(True, None)


ONE_AT_A_TIME_SHAPES = ((6, 5), (4, 5))
"""Two matrices (optimizers of matrices only take them too)."""


def one_at_a_time_problem(build: Callable, options: dict, name: str) -> str | None:
    """Why stepping tensors one at a time (step() with only that tensor's gradient present)
    gives other values than one step() over all of them, or None when it gives the same: the
    NVMe tier streams each tensor's state in and out around its own step()
    (tiertrain/update/whole.py StreamedStates), which an optimizer counting its steps or
    reading all its tensors at once in step() would not survive."""
    start = [torch.randn(shape, generator=torch.Generator().manual_seed(11)) for shape in ONE_AT_A_TIME_SHAPES]
    together = [t.clone() for t in start]
    alone = [t.clone() for t in start]
    a = build([{"params": together, **options}])
    b = build([{"params": alone, **options}])
    for step in range(STEPS):
        grads = _gradients(step, ONE_AT_A_TIME_SHAPES)
        for p, g in zip(together, grads):
            p.grad = g
        a.step()
        for p, g in zip(alone, grads):
            p.grad = g
            b.step()
            p.grad = None
    whole = torch.cat([t.reshape(-1) for t in together])
    each = torch.cat([t.reshape(-1) for t in alone])
    difference, moved, beyond = _compared(whole, each, start)
    if beyond:
        return (f"{name} stepped on two matrices one at a time gives other values than one step over both "
                f"(largest difference {difference:.2e}, for changes up to {moved:.2e})")
    return None


__all__ = ["Probe", "probe", "one_at_a_time_problem"]
