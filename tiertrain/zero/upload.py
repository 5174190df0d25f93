"""Updated shard values, host → device, through a few pinned chunks: the copy of the updated
parameters back to the accelerator after ZeRO-Offload's CPU step (§4).

On an accelerator the CPU tier's step must leave each updated shard on the device in the
compute dtype. ``device_shard.copy_(fp32_master)`` does that slowly: torch casts on the host
into a new pageable tensor, then copies it synchronously at pageable-memory speed. On an H100
host the stage-2 step phase (shards on the device) took 1.02 s where stage 3 (shards in host
memory, which the CPU pass writes itself) took 0.43 s, for the same 1.28 B-element update
(bench/results/gpu_issue36.md). Here a shard goes to the device in chunks through a ring of
pinned buffers: each chunk is written (by the CPU pass, which writes its compute-dtype copy
there, or by a cast of the master) and copied to the device on the copy stream while the next
is written, so the upload overlaps the update and only the last chunk's copy follows it.
DeepSpeed's CPU Adam copies its updated tiles the same way.
"""
from __future__ import annotations

from typing import Iterator

import torch

from ..device import Copy, DeviceStreams, Transfer

CHUNK = 1 << 25
"""Elements per chunk (64 MiB in bf16): ~10 ms of the CPU pass on a 16-core GPU host against
~2-3 ms for its copy. The pass called per chunk costs more the smaller the chunk: on the EPYC
VM, paired against one call over 100 M elements, +2-6 % in chunks of 8 Mi, 0-2 % in chunks of
32 Mi (bench/results/adamw_chunks.md)."""

SLOTS = 2
"""Pinned chunk buffers: one being written while the other's copy runs (a copy takes a
fraction of a chunk's update); a buffer is written again only once its copy has read it."""


class ShardUpload:
    """Sends host values into device shards, chunk by chunk, through SLOTS pinned buffers.

    ``for a, b, buffer in upload.chunks(shard): <write the new values of shard[a:b] into
    buffer>`` copies each chunk to the device once written; :meth:`finish` orders the device's
    compute stream after every copy issued so far, and must come before anything on the device
    reads the shards."""

    def __init__(self, streams: DeviceStreams, dtype: torch.dtype, chunk: int = CHUNK, slots: int = SLOTS):
        if chunk < 1 or slots < 1:
            raise ValueError(f"ShardUpload needs chunk >= 1 and slots >= 1; got chunk={chunk}, slots={slots}")
        self.streams, self.dtype, self.chunk = streams, dtype, chunk
        self._buffers: list[torch.Tensor] = []  # (allocated at first use: most engines never upload)
        self._last: list[Transfer | None] = [None] * slots
        self._next = 0
        self._unwaited: list[Transfer] = []

    @property
    def nbytes(self) -> int:
        """Bytes of the chunk buffers allocated (pinned host memory on an accelerator host)."""
        return sum(b.numel() * b.element_size() for b in self._buffers)

    def chunks(self, shard: torch.Tensor) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(start, end, buffer) per chunk of ``shard`` (a contiguous device tensor of the upload's
        dtype): the caller writes the new values of ``shard[start:end]`` into ``buffer``, and the
        chunk's copy is issued when it asks for the next."""
        if shard.dtype != self.dtype or not shard.is_contiguous():
            raise ValueError(f"ShardUpload sends contiguous {self.dtype} shards; got {shard.dtype} "
                             f"{tuple(shard.shape)}{'' if shard.is_contiguous() else ', not contiguous'}")
        flat = shard.view(-1)
        for start in range(0, flat.numel(), self.chunk):
            end = min(flat.numel(), start + self.chunk)
            slot = self._free_slot(end - start)
            buffer = self._buffers[slot][:end - start]
            yield start, end, buffer
            transfer = self.streams.copy(flat[start:end], buffer, Copy.UPDATE_TO_DEVICE)
            self._last[slot] = transfer
            self._unwaited.append(transfer)

    def send(self, shard: torch.Tensor, values: torch.Tensor) -> None:
        """``shard`` ← ``values`` (host memory, any dtype: cast on the host, a chunk at a time)."""
        values = values.reshape(-1)
        for start, end, buffer in self.chunks(shard):
            buffer.copy_(values[start:end])

    def finish(self) -> None:
        """Order the device's compute stream after every copy issued (the host does not wait)."""
        unwaited, self._unwaited = self._unwaited, []
        for transfer in unwaited:
            transfer.wait()

    def _free_slot(self, numel: int) -> int:
        """The next buffer, of at least numel elements, once the copy that last read it has."""
        slot, self._next = self._next, (self._next + 1) % len(self._last)
        if self._last[slot] is not None:
            self._last[slot].source_read()
            self._last[slot] = None
        if slot == len(self._buffers):
            self._buffers.append(self.streams.host_empty(numel, self.dtype))
        elif self._buffers[slot].numel() < numel:  # (sized by use: a small model's buffers stay small)
            self._buffers[slot] = self.streams.host_empty(numel, self.dtype)
        return slot


def upload_buffer_bytes(largest_shard_numel: int, element_size: int) -> int:
    """The most bytes a ShardUpload's buffers take, for shards of at most this many elements."""
    return SLOTS * min(CHUNK, largest_shard_numel) * element_size
