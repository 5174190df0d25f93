"""The NVMe tier's IO stack (DeepNVMe-style): an aligned, pinned-when-CUDA buffer pool reused for
all traffic, an asynchronous parallel O_DIRECT file IO layer, and a tensor swapper on top."""
from .aio import (AsyncIO, Checksum, Handle, SwapCorruptionError, SwapDirError, SwapError,
                  SwapSpaceError)
from .buffers import AlignedBufferPool, Buffer, PoolExhaustedError
from .swap import SwapHandle, TensorSwapper, check_swap_dir

__all__ = ["AlignedBufferPool", "AsyncIO", "Buffer", "Checksum", "Handle", "PoolExhaustedError",
           "SwapCorruptionError", "SwapDirError", "SwapError", "SwapHandle", "SwapSpaceError",
           "TensorSwapper", "check_swap_dir"]
