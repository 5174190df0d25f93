"""The CPU and NVMe tiers: what tiertrain keeps off the compute device, and how it moves it.

* the NVMe IO stack (DeepNVMe-style): an aligned, pinned-when-CUDA buffer pool reused for all
  traffic (:mod:`.buffers`), an asynchronous parallel O_DIRECT file IO layer (:mod:`.aio`) and
  a tensor swapper on top (:mod:`.swap`);
* the optimizer step from NVMe: :class:`NVMeAdamW` (:mod:`.nvme_optimizer`, with the per-chunk
  update in :mod:`.chunk_update` and the step overlapped with backward in
  :mod:`.overlapped_step`) and its update form for the engine (:mod:`.nvme_update`);
* ZeRO-Offload's one-step delayed parameter update on the CPU (:mod:`.delayed`);
* activation checkpointing, with the checkpoints optionally held in CPU memory
  (:mod:`.activations`).
"""
from .activations import (ActivationCheckpointing, CheckpointMemory, apply_activation_checkpointing,
                          checkpoint_memory)
from .aio import (AsyncIO, Checksum, Handle, SwapCorruptionError, SwapDirError, SwapError,
                  SwapSpaceError)
from .buffers import AlignedBufferPool, Buffer, PoolExhaustedError
from .swap import SwapHandle, TensorSwapper, check_swap_dir
from .nvme_optimizer import NVMeAdamW, StepStats, pieces_from_param_groups

__all__ = ["ActivationCheckpointing", "AlignedBufferPool", "CheckpointMemory", "apply_activation_checkpointing",
           "checkpoint_memory", "AsyncIO", "Buffer", "Checksum", "Handle", "NVMeAdamW", "PoolExhaustedError",
           "SwapCorruptionError", "SwapDirError", "SwapError", "SwapHandle", "SwapSpaceError",
           "StepStats", "TensorSwapper", "check_swap_dir", "pieces_from_param_groups"]
