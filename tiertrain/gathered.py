"""Full parameters readable outside forward (``engine.gathered_parameters()``), at every
stage: the newest values (work the update began ahead of step() settled first), each unit
gathered from its shards (at stage 3 through the parameter fetcher, so the ranks agree on
it), and with a modifier rank that rank's edits broadcast and written back into every shard
(zero/flat.py) and master copy (the update form) on exit; and the fp32 state dict of a rank's
model (``engine.full_state_dict()``), gathered from the masters and shards.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterable

import torch
import torch.nn as nn

from .in_place_edits import refuse_in_place_edits, warn_of_in_place_edits

if TYPE_CHECKING:
    from .training_core import TrainingCore


@contextlib.contextmanager
def gathered_parameters_of(engine: "TrainingCore", params: Iterable[nn.Parameter] | None = None,
                           modifier_rank: int | None = None):
    """engine.gathered_parameters(params, modifier_rank): see the module docstring."""
    if engine.fetcher is None:  # (at stage 3 the gathers' agreement names the units as well)
        engine.comm.enter("gathered_parameters()")
    engine.quiesce()
    engine.update.flush()  # what is read or edited is the newest parameters
    wanted = None if params is None else {engine.flat.unit_index(p) for p in params}
    units = [u for u in engine.flat.all_units if wanted is None or u.unit.index in wanted]
    for u in units:
        if engine.fetcher is not None and not u.gathered:
            engine.fetcher.fetch(u.unit.index)
        engine.flat.gather(u.unit.index)
    engine.gathered_open += 1
    try:
        yield
        if modifier_rank is not None:
            edited = [None] * len(engine.flat.units)
            for u in units:
                engine.comm.broadcast(u.full, modifier_rank)
                lo, hi = u.unit.shard_range(engine.flat.shard_rank)
                engine.flat.write_shard(u.unit.index, u.full[lo:hi])
                if u.trainable and not engine.flat.shards.holds_masters(u.unit.index):  # (else written just now)
                    edited[u.unit.index] = u.full[lo:hi]
            engine.update.write_masters(edited)
    finally:
        engine.gathered_open -= 1
        for u in units:
            engine.flat.release(u.unit.index)


def rank_state_dict(engine: "TrainingCore", operation: str = "full_state_dict()",
                    closing: bool = False) -> dict[str, torch.Tensor]:
    """full_state_dict of this rank's model (a pipeline rank's: its stages). operation:
    the collective operation it serves (Collectives.enter: at stage 0 it issues no
    collective, and a rank still training would not learn that its peer is here). closing:
    for close(), which warns of parameters changed in place instead of raising."""
    engine.comm.enter(operation)
    out = {}
    engine.update.settle(collective=True)
    masters = engine.masters()
    shards = list(zip(engine.flat.units, masters))
    by_index = {u.unit.index: m for u, m in shards}
    if not closing:
        refuse_in_place_edits(engine, by_index.__getitem__, operation)
    else:  # (often in a finally block, where an error would hide the first: the masters' values, said)
        warn_of_in_place_edits(engine, by_index.__getitem__)
    shards += [(u, engine.flat.read_shard(u.unit.index).float()) for u in engine.flat.frozen_units]
    for u, shard in shards:
        full = torch.empty(u.unit.padded_numel, dtype=torch.float32, device=engine.device)
        if engine.plan.stage.replicates_states:  # (one shard: the whole unit)
            full.copy_(shard)
        else:
            engine.comm.all_gather(full, shard.to(engine.device))
        for slot in u.unit.slots:
            out[slot.name] = full[slot.offset:slot.end].view(slot.shape).clone()
    for module in engine.named_modules_of_state():
        for name, p in module.named_parameters():
            if name not in out and not p.requires_grad:  # frozen and whole on every rank
                out[name] = (p.detach().float() if p.is_floating_point() else p.detach()).clone()
    for name, b in engine.buffers.named().items():
        out[name] = (b.detach().float() if b.is_floating_point() else b.detach()).clone()
    return out
