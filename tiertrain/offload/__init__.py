"""The CPU and NVMe tiers: what tiertrain keeps off the compute device, and how it moves it.

* where partitioned parameter shards live between uses: device, CPU or swap files
  (:mod:`.shard_store`), on the file IO stack below (:mod:`tiertrain.io`: asynchronous
  O_DIRECT IO, the aligned buffer pool, the tensor swapper);
* activation checkpointing, with the checkpoints optionally held in CPU memory
  (:mod:`.activations`).

The optimizer-step forms that use these tiers (from NVMe, ZeRO-Offload's delayed update) are
in :mod:`tiertrain.update`.
"""
from .activations import (ActivationCheckpointing, CheckpointMemory, apply_activation_checkpointing,
                          checkpoint_memory)

__all__ = ["ActivationCheckpointing", "CheckpointMemory", "apply_activation_checkpointing", "checkpoint_memory"]
