"""A parameter changed in place after ``wrap()`` fails by name instead of being lost.

After ``wrap()`` a parameter is the engine's compute copy; its value lives in the fp32 master,
which the step updates and every checkpoint, export and ``full_state_dict()`` reads. A change
made to the compute copy (``p.copy_(w)``, ``p.data[...] = ...``, ``nn.init.normal_(p)``, an
init function applied after ``wrap()``) was therefore overwritten at the next step at bf16 or
fp16, or with the masters on another tier, and left out of every save, without a word. Where
the masters are kept apart from the compute copy the compute copy is exactly the master
rounded to the compute dtype, so a change shows as a difference from it: the engine compares
them, on every data-parallel rank, at the first forward and before every save, export and
``full_state_dict()``, and raises :class:`InPlaceEditError` naming the parameters and the ways
that do reach the masters (``model.load_state_dict``, ``engine.gathered_parameters(
modifier_rank=...)``, a change before ``wrap()``); ``close()``, which hands back the masters'
values, warns instead. Only parameters the engine keeps whole on
every rank (stages 0-2, stage 3's resident units) can be changed so: a released stage-3
parameter already refuses it (tiertrain/zero/released.py).
"""
from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Callable

import torch

from .errors import TiertrainError, parameters_named

if TYPE_CHECKING:
    from .training_core import TrainingCore

__all__ = ["InPlaceEditError", "edited_parameters", "refuse_in_place_edits", "warn_of_in_place_edits"]


class InPlaceEditError(TiertrainError, RuntimeError):
    """A wrapped model's parameter was changed in place after ``wrap()``, where the engine's
    fp32 masters would not see the change."""

    exit_code = 1


MasterOf = Callable[[int], torch.Tensor]
"""This rank's fp32 master shard of the trained unit of this index (unit_values.MasterShards)."""


def edited_parameters(engine: "TrainingCore", master_of: MasterOf) -> list[str]:
    """The parameters whose compute copy in this rank's shard of a resident unit is no longer
    its fp32 master rounded to the compute dtype. Where the master is the compute copy itself
    (fp32, on the device) nothing can differ."""
    flat = engine.flat
    rank = flat.shard_rank
    names: list[str] = []
    if engine.update.unpublished:  # (the next forward publishes them: nothing to compare with)
        return names
    for u in flat.units:
        if not u.unit.resident:
            continue
        master = master_of(u.unit.index)
        lo, hi = u.unit.shard_range(rank)
        compute = u.full[lo:hi]
        rounded = master.to(device=compute.device, dtype=compute.dtype)
        if _same(compute, rounded):
            continue
        names += [slot.name for slot, a, b in u.unit.shard_pieces(rank) if not _same(compute[a:b], rounded[a:b])]
    return names


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal, NaN where NaN (a non-finite master is the saves' own error: CheckpointError)."""
    return torch.equal(a, b) or bool(((a == b) | (a.isnan() & b.isnan())).all())


def _bits_sums(tensors: list[torch.Tensor]) -> list[int]:
    """Each tensor's elements summed as integers of their width (equal copies, equal sums), read
    back at once (one device synchronisation)."""
    if not tensors:
        return []
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[tensors[0].element_size()]
    return torch.stack([t.view(ints).sum(dtype=torch.int64) for t in tensors]).tolist()


def refuse_in_place_edits(engine: "TrainingCore", master_of: MasterOf, operation: str) -> None:
    """Collective over the data-parallel group: raise InPlaceEditError on every rank when a
    rank finds an edited parameter in its own shard (an edit every rank made alike shows
    there, in the shard's owner) or the ranks' copies of a parameter kept whole differ (an
    edit some ranks made: the owner of the shard may be one that did not), naming them."""
    names = edited_parameters(engine, master_of)
    whole = [(slot.name, u.full[slot.offset:slot.end]) for u in engine.flat.units if u.unit.resident
             for slot in u.unit.slots]
    flags = [engine.comm.rank + 1 if names else 0] + _bits_sums([t for _, t in whole])
    largest, smallest = engine.comm.extremes(flags)
    differ = [name for (name, _), a, b in zip(whole, largest[1:], smallest[1:]) if a != b]
    if not largest[0] and not differ:
        return
    if names:
        shown, one = parameters_named(names)
        what = f"{shown} {'was' if one else 'were'} changed in place after wrap()"
    elif differ:
        shown, one = parameters_named(differ)
        what = (f"{shown} {'differs' if one else 'differ'} between the data-parallel ranks: changed in place after "
                f"wrap() on some ranks only")
    else:
        what = f"data-parallel rank {largest[0] - 1} changed parameters in place after wrap()"
    raise InPlaceEditError(
        f"{what} (p.copy_(...), p.data[...] = ..., nn.init.*_ or an init function applied to the wrapped model), "
        f"before {operation}: a wrapped model's values live in the engine's fp32 masters, which {operation} reads "
        f"and the next step writes back over the parameters, so the change would be lost. Make it before wrap(), or "
        f"through model.load_state_dict({{name: value}}, strict=False) or inside "
        f"`with engine.gathered_parameters(modifier_rank=0):` (on every rank), which write it into the masters")


def warn_of_in_place_edits(engine: "TrainingCore", master_of: MasterOf) -> None:
    """close(): the model it hands back holds the masters' values, so an edit in this rank's
    shard made since the last check is lost; said with a warning (no collective: close may
    run after a failure), naming the parameters."""
    names = edited_parameters(engine, master_of)
    if names:
        shown, one = parameters_named(names)
        warnings.warn(f"{shown} {'was' if one else 'were'} changed in place after wrap() and before close(): the "
                      f"model close() hands back holds the engine's fp32 masters, without the change. Make it "
                      f"after close(), or through model.load_state_dict({{name: value}}, strict=False) before it",
                      RuntimeWarning, stacklevel=4)
