"""Tensor parallelism composed with the engine: a dp × tp run trains like one process.

The model is converted with tiertrain.parallel.apply_tensor_parallel (Megatron §2.3) before
wrap(); ZeRO then shards each tp rank's slice over its dp peers. Losses and the gathered
parameters must equal the single-process tp=1 reference (fp32, within the float64 oracle's
bound as in test_engine: same AdamW eps=1e-3 and the reasons given there)."""
from __future__ import annotations

import pytest

from reference import Oracle, engine_train, global_batches, make_config, make_model, reference_train, tp_gathered
from tiertrain.parallel import apply_tensor_parallel
from tiertrain.testing import run_distributed


def _config(stage, dp, tp, accum=1):
    return make_config(zero={"stage": stage, "bucket_mb": 0.02}, parallel={"dp": dp, "tp": tp},
                       batch={"micro_batch_size": 2, "grad_accum_steps": accum},
                       optimizer={"eps": 1e-3, "lr": 1e-2, "grad_clip": 0.05})


def _tp_run(rank, world, stage, dp, tp, sequence_parallel):
    cfg = _config(stage, dp, tp, accum=2)
    losses, local, engine = engine_train(
        rank, world, make_model(), cfg, global_batches(4, 2 * 2 * dp),
        prepare=lambda m, topo: apply_tensor_parallel(m, topo, sequence_parallel=sequence_parallel))
    return losses, tp_gathered(engine, local)


@pytest.mark.timeout(90)
@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("dp,tp,sequence_parallel", [(1, 2, False), (2, 2, False), (1, 2, True)])
def test_dp_tp_matches_single_process_reference(stage, dp, tp, sequence_parallel):
    results = run_distributed(_tp_run, dp * tp, stage, dp, tp, sequence_parallel, timeout=80)
    oracle = Oracle.run(reference_train, make_model(), _config(stage, 1, 1, accum=2), global_batches(4, 2 * 2 * dp))
    for rank, (losses, params) in enumerate(results):
        oracle.check(losses, params, f"stage {stage} dp={dp} tp={tp} sp={sequence_parallel}, rank {rank}")
