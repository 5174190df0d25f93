"""The process grid and the multi-process test harness."""
from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from tiertrain import ConfigError, Topology
from tiertrain.config import ParallelConfig
from tiertrain.testing import DistributedTimeout, RankFailure, run_distributed


def _grid(rank, world, tp, pp):
    topo = Topology.build(ParallelConfig(tp=tp, pp=pp))
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=topo.group("tp"))
    return topo.sizes, topo.coords, topo.ranks("dp"), topo.ranks("tp"), float(t)


@pytest.mark.timeout(60)
def test_axes_follow_megatron_order_tp_fastest():
    results = run_distributed(_grid, 4, 2, 1, timeout=50)
    for rank, (sizes, coords, dp_ranks, tp_ranks, tp_sum) in enumerate(results):
        assert sizes == {"pp": 1, "dp": 2, "cp": 1, "tp": 2}
        assert coords == {"pp": 0, "dp": rank // 2, "cp": 0, "tp": rank % 2}
        assert tp_ranks == [rank - rank % 2, rank - rank % 2 + 1]
        assert dp_ranks == [rank % 2, rank % 2 + 2]
        assert tp_sum == sum(tp_ranks), "the tp group reduces over exactly the tp peers"


def _context_grid(rank, world):
    topo = Topology.build(ParallelConfig(cp=2))
    sums = {}
    for axis in ("cp", "dp", "dp_cp"):
        t = torch.tensor([float(rank)])
        dist.all_reduce(t, group=topo.group(axis))
        sums[axis] = float(t)
    return topo.coords, topo.ranks("cp"), topo.ranks("dp"), topo.coord("dp_cp"), topo.size("dp_cp"), sums


@pytest.mark.timeout(60)
def test_context_parallel_ranks_are_adjacent_and_replicas_span_dp_and_cp():
    """cp varies faster than dp (Megatron-Core's order); the dp_cp group, over which ZeRO
    partitions, holds every rank of both axes, in the order dp · cp + cp coordinate."""
    for rank, (coords, cp_ranks, dp_ranks, replica, replicas, sums) in enumerate(run_distributed(_context_grid, 4, timeout=50)):
        assert coords == {"pp": 0, "dp": rank // 2, "cp": rank % 2, "tp": 0}
        assert cp_ranks == [rank - rank % 2, rank - rank % 2 + 1]
        assert dp_ranks == [rank % 2, rank % 2 + 2]
        assert (replica, replicas) == (rank, 4)
        assert sums == {"cp": sum(cp_ranks), "dp": sum(dp_ranks), "dp_cp": 6.0}


def _bad_grid(rank, world):
    Topology.build(ParallelConfig(dp=3))


@pytest.mark.timeout(30)
def test_layout_not_matching_world_size_is_an_error():
    with pytest.raises(RankFailure, match=r"dp × tp × pp = 3 × 1 × 1 = 3 but the world size is 2"):
        run_distributed(_bad_grid, 2, timeout=20)


def test_single_process_topology_needs_no_process_group():
    topo = Topology.build()
    assert topo.sizes == {"pp": 1, "dp": 1, "cp": 1, "tp": 1} and topo.group("dp") is None and topo.group("dp_cp") is None
    with pytest.raises(ConfigError, match="axis 'ep' is unknown"):
        topo.size("ep")


def _raise_on_rank_1(rank, world):
    if rank == 1:
        raise ValueError("boom from rank 1")
    return rank


def _hang_in_collective(rank, world):
    if rank == 0:
        dist.all_reduce(torch.ones(1))  # rank 1 never joins
    else:
        time.sleep(60)


def _die(rank, world):
    if rank == 1:
        os._exit(3)
    time.sleep(60)


@pytest.mark.timeout(30)
def test_harness_reports_failing_rank_with_traceback():
    with pytest.raises(RankFailure, match=r"(?s)rank 1 failed: ValueError: boom from rank 1.*Traceback"):
        run_distributed(_raise_on_rank_1, 2, timeout=20)


@pytest.mark.timeout(30)
def test_harness_turns_a_hang_into_a_fast_failure():
    start = time.monotonic()
    with pytest.raises((DistributedTimeout, RankFailure)):
        run_distributed(_hang_in_collective, 2, timeout=5)
    assert time.monotonic() - start < 15


@pytest.mark.timeout(30)
def test_harness_reports_a_dead_rank():
    with pytest.raises(RankFailure, match="rank 1 failed: ended with exit code 3"):
        run_distributed(_die, 2, timeout=20)


def _two_thread_ops(rank, world):
    import sys

    for _ in range(3):
        (torch.randn(600, 600) @ torch.randn(600, 600)).sum()
        (torch.randn(3_000_000).exp() * 2).sum()
    from tiertrain.launch import HEAVY_IMPORTS

    return torch.get_num_threads(), [name for name in HEAVY_IMPORTS if name in sys.modules]


@pytest.mark.timeout(60)
def test_ranks_forked_after_the_preloaded_imports_compute_with_several_threads():
    """The ranks fork from a forkserver that preloaded tiertrain.launch.HEAVY_IMPORTS (those this
    process holds: tests/conftest.py imports them). A module that ran a multi-threaded torch op
    at import would start the OpenMP pool in the server, and a pool started before a fork hangs
    the child's first parallel region: a rank given two threads computes."""
    try:
        (threads, preloaded), = run_distributed(_two_thread_ops, 1, threads=2, timeout=30)
    except DistributedTimeout:
        pytest.fail("a rank hung in torch's thread pool: a module of tiertrain.launch.HEAVY_IMPORTS runs a parallel "
                    "torch op at import; take it out of HEAVY_IMPORTS")
    assert threads == 2 and preloaded, preloaded
