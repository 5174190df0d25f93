"""The NVMe tier's IO stack (DeepNVMe-style): an aligned, pinned-when-CUDA buffer pool reused for
all traffic, an asynchronous parallel O_DIRECT file IO layer, and a tensor swapper on top."""
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
