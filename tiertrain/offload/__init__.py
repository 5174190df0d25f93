"""The CPU and NVMe tiers: what tiertrain keeps off the compute device, and how it moves it.

* where partitioned parameter shards live between uses: device, CPU or swap files
  (:mod:`.shard_store`), on the file IO stack below (:mod:`tiertrain.io`: asynchronous
  O_DIRECT IO, the aligned buffer pool, the tensor swapper);
* the optimizer step from NVMe: :class:`NVMeAdamW` (:mod:`.nvme_optimizer`, with the per-chunk
  update in :mod:`.chunk_update` and the step overlapped with backward in
  :mod:`.overlapped_step`) and its update form for the engine (:mod:`.nvme_update`);
* ZeRO-Offload's one-step delayed parameter update on the CPU (:mod:`.delayed`);
* activation checkpointing, with the checkpoints optionally held in CPU memory
  (:mod:`.activations`).
"""
from .activations import (ActivationCheckpointing, CheckpointMemory, apply_activation_checkpointing,
                          checkpoint_memory)
from .nvme_optimizer import NVMeAdamW, StepStats, pieces_from_param_groups

__all__ = ["ActivationCheckpointing", "CheckpointMemory", "NVMeAdamW", "StepStats", "apply_activation_checkpointing",
           "checkpoint_memory", "pieces_from_param_groups"]
