"""tiertrain.comm.Collectives on gloo: reduce-scatter (also in place, into this rank's chunk
of its own input) and all-gather give exactly what their definitions say."""
from __future__ import annotations

import pytest
import torch

from reference import assert_within_rounding
from tiertrain.comm import Collectives
from tiertrain.testing import run_distributed

N = 1000  # elements per rank's chunk


def _rank_input(rank, world):
    return torch.randn(world * N, generator=torch.Generator().manual_seed(10 + rank))


def _collectives(rank, world):
    import torch.distributed as dist

    comm = Collectives(dist.group.WORLD)
    x = _rank_input(rank, world)
    out = torch.empty(N)
    comm.reduce_scatter(out, x.clone())
    in_place = x.clone()
    comm.reduce_scatter(in_place[rank * N:(rank + 1) * N], in_place, async_op=True).wait()
    gathered = torch.empty(world * N)
    comm.all_gather(gathered, x[:N].clone())
    return out, in_place[rank * N:(rank + 1) * N], gathered


@pytest.mark.timeout(60)
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_scatter_and_all_gather_match_their_definition(world):
    inputs = [_rank_input(r, world) for r in range(world)]
    total = inputs[0].clone()
    for x in inputs[1:]:
        total += x  # for 2 ranks, x0 + x1 is the only sum order; for 3, gloo's order may differ
    exact = torch.stack(inputs).double().sum(0)
    abs_terms = torch.stack(inputs).double().abs().sum(0)
    for rank, (out, in_place, gathered) in enumerate(run_distributed(_collectives, world, timeout=50)):
        mine = slice(rank * N, (rank + 1) * N)
        if world == 2:
            assert torch.equal(out, total[mine])
        else:  # any order of a 3-term sum: within the rounding bound of the exact sum
            assert_within_rounding(out, exact[mine], abs_terms[mine], world, f"rank {rank} reduce-scatter")
        assert torch.equal(out, in_place)
        assert torch.equal(gathered, torch.cat([x[:N] for x in inputs]))


def test_the_store_query_of_a_diagnosis_runs_where_no_thread_can_start(monkeypatch):
    """A peer lost under memory pressure (an RLIMIT_AS cap, tests/test_context_parallel_cap.py)
    left no address space for the query's thread: the diagnosis became "can't start new
    thread". The query then runs on the caller's thread; otherwise on its own, bounded."""
    import threading
    import time

    from tiertrain import comm

    assert comm._within(5, lambda: "mismatch") == "mismatch"
    assert comm._within(0.05, lambda: time.sleep(1) or "late") is None

    def no_thread(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(threading.Thread, "start", no_thread)
    assert comm._within(5, lambda: "mismatch") == "mismatch"
