"""The file IO stack: the layer below the tiers, in the style of DeepNVMe.

* asynchronous parallel file IO with ``O_DIRECT`` and per-chunk checksums (:mod:`.aio`);
* an aligned, pinned-when-CUDA buffer pool reused for all of that traffic (:mod:`.buffers`);
* a tensor swapper on top: one locked directory per rank, one file per key, removed when the
  run ends however it ends (:mod:`.swap`, its handles :mod:`.swap_handle`, the directories and
  the launcher's cleanup registry :mod:`.swap_dir`);
* durable file writes: complete or absent, with locks and checksums (:mod:`.fileio`).

The tiers (tiertrain.offload), the ZeRO stages, checkpoints and exports use it; it imports
nothing from those layers above it, only leaf modules (tiertrain.errors, tiertrain.device,
tiertrain.waits). tests/test_structure.py holds it to that.
"""
from .aio import (AsyncIO, Checksum, Handle, SwapCorruptionError, SwapDirError, SwapError,
                  SwapSpaceError)
from .buffers import AlignedBufferPool, Buffer, PoolExhaustedError
from .swap import TensorSwapper
from .swap_dir import check_swap_dir
from .swap_handle import SwapHandle

__all__ = ["AlignedBufferPool", "AsyncIO", "Buffer", "Checksum", "Handle", "PoolExhaustedError",
           "SwapCorruptionError", "SwapDirError", "SwapError", "SwapHandle", "SwapSpaceError",
           "TensorSwapper", "check_swap_dir"]
