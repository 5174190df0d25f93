"""Pipeline parallelism (Megatron-LM PTD-P §2): schedules as data, stage splitting, and an
executor that runs a schedule over the ``pp`` axis with point-to-point transfers.

    from tiertrain.pipeline import split_gpt, stages_for_rank, PipelineExecutor, one_f_one_b

    stages = split_gpt(model, num_stages=p * v)                  # model order
    mine = stages_for_rank(stages, p, topology.coord("pp"))      # stages r, r+p, …
    ex = PipelineExecutor(mine, topology, one_f_one_b, activation_shape=(b, seq, hidden))
    loss = ex.run(micro_batches)                                 # grads in the stage params

With ``parallel.pp > 1``, ``tiertrain.wrap(model, config, topology)`` does all of this and
adds ZeRO over dp (:class:`~.engine.PipelineEngine`); ``engine.train_batch(micro_batches)``.
"""
from .executor import PipelineExecutor, backward_from, release_output
from .p2p import P2PTimeout, PipeComm
from .schedule import (Action, ActionKind, Schedule, ScheduleDeadlock, Timeline, bubble_fraction,
                       gpipe, ideal_bubble, interleaved_one_f_one_b, local_chunk, lower, max_in_flight,
                       one_f_one_b, render, stage_rank, timeline, validate)
from .stage import (GPTStage, norm_parameters, pipeline_grad_norm, split_gpt, stage_boundaries, stages_for_rank,
                    sum_tied_gradients, tied_weight_grad_sync)
from .engine import PipelineEngine, pipeline_stages
from .hf_split import split_hf

__all__ = [
    "Action", "ActionKind", "GPTStage", "P2PTimeout", "PipeComm", "PipelineEngine", "PipelineExecutor", "Schedule",
    "ScheduleDeadlock", "Timeline", "backward_from", "bubble_fraction", "gpipe", "ideal_bubble",
    "interleaved_one_f_one_b", "local_chunk", "lower", "max_in_flight", "norm_parameters", "one_f_one_b",
    "pipeline_grad_norm", "pipeline_stages", "split_hf", "sum_tied_gradients",
    "release_output", "render", "split_gpt", "stage_boundaries", "stage_rank", "stages_for_rank",
    "tied_weight_grad_sync", "timeline", "validate",
]
