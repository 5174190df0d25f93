"""Where partitioned units' parameter shards live between uses: the parameter tier of
ZeRO-Infinity (§5), one store per tier, chosen once from the placement.

A stage-3 unit's compute-dtype shard is read by each all-gather (gather before use) and
rewritten after each optimizer step. The stores differ in where its values sit and how they
reach the all-gather:

* :class:`DeviceShards`: in device memory; the all-gather sends the shard itself;
* :class:`HostShards`: in (pinned) CPU memory; each gather first copies it to the device
  (ZeRO-Infinity's CPU→device step) on the device's copy stream, started ahead of use by
  :meth:`stage` so that the copy of unit i+2 overlaps the compute of unit i;
* :class:`NVMeShards`: in one swap file per unit (through a TensorSwapper); the shard tensor
  keeps no storage. Each gather reads the file into a host staging tensor (NVMe→CPU, started
  ahead of use by :meth:`prefetch`, straight into that page-aligned tensor: no copy out of the
  swap pool) and copies that to the device (CPU→device, when the gather needs it); a write
  ("p swap" of ZeRO-Infinity §6) goes out asynchronously until :meth:`wait_writes`. The staging tensors of the last gathers are kept with their values, so
  the units forward gathered last are not read again when backward gathers them first;
* :class:`OptimizerMasterShards`: fp32 shards on NVMe with the optimizer on NVMe too: the
  optimizer's master records are the shards, one copy on disk instead of two.

:meth:`gather_input` returns a :class:`~tiertrain.device.Transfer`: the all-gather waits for
it before reading its input (tiertrain/device.py; on the CPU the wait is the deferred-copy
harness's check).

Resident units (stages 0-2, stage-3 persistent parameters) never use a store: their shard is
a view of the unit's full buffer on the device.
"""
from __future__ import annotations

import threading
import time

import torch

from ..device import Copy, DeviceStreams, Transfer, free_storage
from ..tiers import Tier
from ..io.buffers import page_aligned_empty, tensor_range_buffer


class DeviceShards:
    """Shards in device memory."""

    tier = Tier.DEVICE
    kept_units = 0
    """Staging tensors kept with their values per shard size (NVMeShards; none here)."""

    def __init__(self, placement, dtype: torch.dtype, streams: DeviceStreams):
        self.placement = placement
        self.dtype = dtype
        self.streams = streams

    def allocate(self, numel: int) -> torch.Tensor:
        """A new shard tensor on this tier."""
        return self.placement.empty(numel, self.dtype, self.tier)

    def write(self, index: int, shard: torch.Tensor, values: torch.Tensor) -> None:
        """Store values as unit index's shard (shard: the unit's shard tensor)."""
        if values is not shard:
            shard.copy_(values)

    def read(self, index: int, shard: torch.Tensor) -> torch.Tensor:
        """A copy of unit index's stored shard values."""
        return shard.detach().clone()

    def gather_input(self, index: int, shard: torch.Tensor) -> Transfer:
        """Unit index's shard on the compute device, as the all-gather's input (wait for it)."""
        return Transfer(shard, Copy.PARAM_TO_DEVICE, self.streams)

    def prefetch(self, indices, shard_numel) -> None:
        """Start bringing these units' shards closer (a hint; shard_numel(index): the size of
        a unit's shard, to skip units whose values the store still holds)."""

    def stage(self, indices, shards) -> None:
        """Start copying these units' shards (shards: index → shard tensor) to the device
        (a hint, for units gathered soon)."""

    def drop_staged(self) -> None:
        """Forget the copies stage() started (before the shards change)."""

    def done_with_input(self, tensor: torch.Tensor) -> None:
        """The all-gather that read gather_input's tensor has completed (the store may reuse it)."""

    def holds_masters(self, index: int) -> bool:
        """Whether unit index's stored shard is the optimizer's fp32 master itself (nothing to
        publish to it after a step: see OptimizerMasterShards)."""
        return False

    def forget_values(self) -> None:
        """The stored shards may have changed outside write() (an optimizer step wrote them):
        copies of their values kept for reuse are stale."""

    def wait_writes(self) -> None:
        """Complete the writes in flight."""


class HostShards(DeviceShards):
    """Shards in CPU memory, pinned when the device is an accelerator; copied to the device per
    gather, on the copy stream, ahead of use when staged."""

    tier = Tier.CPU

    def __init__(self, placement, dtype, streams):
        super().__init__(placement, dtype, streams)
        self._staged: dict[int, Transfer] = {}  # copies to the device started by stage()

    def gather_input(self, index, shard):
        staged = self._staged.pop(index, None)
        return staged if staged is not None else self.streams.to_device(shard, Copy.PARAM_TO_DEVICE)

    def stage(self, indices, shards):
        for index in indices:
            if index not in self._staged:
                self._staged[index] = self.streams.to_device(shards[index], Copy.PARAM_TO_DEVICE)

    def drop_staged(self):
        self._staged.clear()

    def write(self, index, shard, values):
        self._staged.pop(index, None)  # (a copy of the values before this write)
        super().write(index, shard, values)


class NVMeShards(DeviceShards):
    """Shards in swap files, one per unit; the shard tensors hold no storage."""

    tier = Tier.NVME

    def __init__(self, placement, dtype, streams, swapper, kept_units: int = 4, read_ahead: int = 4):
        super().__init__(placement, dtype, streams)
        self.swapper = swapper
        self.kept_units = kept_units
        """Staging tensors of each shard size kept, with their values, once their all-gather is
        done (zero.nvme_kept_units)."""
        self.read_ahead = read_ahead
        """Most units whose reads :meth:`prefetch` has in flight (each into a staging tensor)."""
        self._reading: dict[int, tuple[torch.Tensor, tuple, object]] = {}
        """unit -> (staging tensor, version, read) of the reads prefetch started, until gathered."""
        self._writes = []  # swap-outs in flight
        # Host staging tensors of the gathers' reads, reused: a shard is tens to hundreds of MB,
        # above what the allocator keeps, so a new tensor per read would fault in every page
        # again (a copy of 160 MB into fresh pages ran at 1.6 GB/s here, into reused ones at
        # 8.7: bench/results/scale.md, "CPU per byte"). A kept tensor still holds the values of
        # the unit it was read for: at the turn from forward to backward, the last units of
        # forward are the first of backward, and their gathers take those values again instead
        # of reading the disk (ZeRO-Infinity moves each parameter twice per step; these move once).
        self._spare: dict[int, list[tuple[torch.Tensor, int | None, tuple | None]]] = {}
        """size -> (tensor, unit, version) of the spare staging tensors, the first to be reused
        first: those holding no values (unit None), then the oldest values."""
        self._lent: dict[int, tuple[int, tuple, int]] = {}  # id of a staging tensor lent to an all-gather -> (unit, version, numel)
        self._lock = threading.Lock()  # (the spares are also taken and given back by an optimizer step's worker)
        self._epoch = 0
        self._written: dict[int, int] = {}
        self.staging_reused = 0
        """Gathers whose read landed in a reused staging tensor (a counter for tests and benches)."""
        self.values_reused = 0
        """Gathers that took a kept staging tensor's values instead of reading the disk."""
        self.staging_allocated = 0
        """Staging tensors allocated (the others are reused)."""
        self.read_ahead_taken = 0
        """Gathers that found their read started by :meth:`prefetch` (into their staging tensor)."""

    @staticmethod
    def key(index: int) -> str:
        """The swap key of unit index's shard file."""
        return f"param_shard{index}"

    def _version(self, index: int) -> tuple:
        """Changes whenever unit index's stored values may have (a kept copy is valid while equal)."""
        return (self._epoch, self._written.get(index, 0))

    def forget_values(self):
        self._epoch += 1

    def write(self, index, shard, values):
        self._written[index] = self._written.get(index, 0) + 1
        self._writes.append(self.swapper.swap_out(self.key(index), values.to(self.dtype)))
        free_storage(shard)

    def allocate(self, numel):
        # (Its values go to the swap file and its memory is freed in place; gathers read the
        # file into staging tensors, which the device copies from.)
        return self.placement.empty(numel, self.dtype, self.tier, device_copies=False)

    def read(self, index, shard):
        staged = self.placement.empty(shard.numel(), self.dtype, self.tier)
        self._fill(index, staged).wait()
        return staged

    def _fill(self, index: int, staged: torch.Tensor, padded: bool = False):
        """Start reading unit index's stored shard into staged (a host tensor of the shard's
        size; ``padded``: a staging tensor of page_aligned_empty, read into with no copy);
        returns the read (``wait()``)."""
        into = tensor_range_buffer(staged, 0, staged.numel(), owns_tail=True) if padded else None
        return self.swapper.swap_in(self.key(index), staged if into is None else into)

    def _new_staging(self, numel: int) -> torch.Tensor:
        # (page-aligned: reads land in it and an NVMe step writes masters from it with no copy)
        self.staging_allocated += 1
        return page_aligned_empty(numel, self.dtype,
                                  lambda n, dtype: self.placement.empty(n, dtype, self.tier))

    def _reusable_spare(self, numel: int) -> torch.Tensor | None:
        """A spare staging tensor to read into, or None (call with the lock held): one holding
        no values, else the oldest values once kept_units are kept; while fewer are kept, None
        (a new tensor), so that the last ones read stay intact."""
        spare = self._spare.get(numel)
        if spare and (len(spare) >= self.kept_units or spare[0][1] is None):
            self.staging_reused += 1
            return spare.pop(0)[0]
        return None

    def _kept(self, index: int, numel: int) -> int | None:
        """Position in the spares of a tensor holding unit index's current values, or None
        (call with the lock held)."""
        if not self.kept_units:
            return None
        version = self._version(index)
        for k, (_, unit, kept_version) in enumerate(self._spare.get(numel, ())):
            if unit == index and kept_version == version:
                return k
        return None

    def gather_input(self, index, shard):
        version = self._version(index)
        numel = shard.numel()
        read = None
        with self._lock:
            reading = self._reading.pop(index, None)
            kept = self._kept(index, numel)
            if reading is not None and reading[1] == version:
                (staged, _, read), reading = reading, None
                self.read_ahead_taken += 1
            elif kept is not None:
                staged = self._spare[numel].pop(kept)[0]
                self.values_reused += 1
            else:
                staged = self._reusable_spare(numel)
        if reading is not None:  # (read before the values changed)
            self._discard(reading)
        if read is None and kept is None:
            staged = self._new_staging(numel) if staged is None else staged
            read = self._fill(index, staged, padded=True)
        if read is not None:
            read.wait()
        transfer = self.streams.to_device(staged, Copy.PARAM_TO_DEVICE)
        if transfer.value is staged:  # (the compute device is the host: the gather reads it)
            self._lent[id(staged)] = (index, version, numel)
        return transfer

    def done_with_input(self, tensor):
        lent = self._lent.pop(id(tensor), None)
        if lent is not None:
            self._give_back(tensor, *lent[:2])

    def _give_back(self, tensor: torch.Tensor, unit: int | None, version: tuple | None) -> None:
        """A staging tensor returns to the spares, holding unit's values of version (or none)."""
        with self._lock:
            spare = self._spare.setdefault(tensor.numel(), [])
            if unit is None:
                spare.insert(0, (tensor, None, None))
            else:
                spare.append((tensor, unit, version))
            if len(spare) > self._spares_kept(tensor.numel()):
                spare.pop(0)

    def _spares_kept(self, numel: int) -> int:
        """How many spares of a size are kept (call with the lock held): the staging tensors of
        that size are allocated once and reused, up to kept_units (at least one, reused even when
        no values are kept), the one lent to the all-gather and read_ahead being read (a tensor
        freed and allocated again would fault its pages in again, at its next read)."""
        lent = sum(n == numel for _, _, n in self._lent.values())
        reading = sum(r[0].numel() == numel for r in self._reading.values())
        return max(1, self.kept_units) + 1 + self.read_ahead - lent - reading

    def _to_read(self, indices, shard_numel) -> list[int]:
        """The units among indices whose values no kept staging tensor holds or is being read into."""
        with self._lock:
            return [i for i in indices if i not in self._reading and self._kept(i, shard_numel(i)) is None]

    def prefetch(self, indices, shard_numel):
        """Each unit's read starts now, straight into the staging tensor its gather will take
        (no copy from the swap pool; at most read_ahead at a time)."""
        with self._lock:
            stale = {i: r for i, r in self._reading.items() if r[1] != self._version(i)}
            for i in stale:
                del self._reading[i]
        for reading in stale.values():
            self._discard(reading)
        for index in self._to_read(indices, shard_numel):
            numel = shard_numel(index)
            with self._lock:  # (prefetch and gather_input run on the training thread alone)
                if len(self._reading) >= self.read_ahead:
                    return
                staged = self._reusable_spare(numel)
            staged = self._new_staging(numel) if staged is None else staged
            version = self._version(index)
            read = self._fill(index, staged, padded=True)
            with self._lock:
                self._reading[index] = (staged, version, read)

    def _discard(self, reading) -> None:
        """A read prefetch started whose values are no longer wanted: its staging tensor comes
        back, holding no values, once the read is over."""
        staged, _, read = reading
        read.add_done_callback(lambda _r: self._give_back(staged, None, None))

    def wait_writes(self):
        """Wait for the shard writes in flight; raises the first IO error (naming the file)."""
        writes, self._writes = self._writes, []
        for handle in writes:
            handle.wait()


class OptimizerMasterShards(NVMeShards):
    """fp32 shards on NVMe that are the NVMe optimizer's masters: one copy on disk, not two.

    With fp32 parameters, a unit's parameter shard and its optimizer master hold the same
    values, so keeping both in swap files (as ZeRO-Infinity's parameter and optimizer tiers
    do when they are separate) stores and moves 4 bytes per parameter twice: each step wrote
    the master with the moments (12 B) and then the parameter shard again (4 B). Here the
    optimizer's master records (tiertrain/update/nvme/records.py, "Chunk records") are the
    shard: a gather reads them (:meth:`NVMeAdamW.read_master`), a step's update of a chunk is
    the shard's write, and :meth:`write` (a checkpoint load, edited parameters) replaces them.
    Units the optimizer does not hold (frozen ones) keep their own files.

    Reads of a unit happen only while no step is updating it: a step's chunks of a unit are
    written after its gradient is final (the unit is not gathered again in that backward), and
    a transactional step's new generation becomes visible only when it commits.

    **The step takes the masters backward just gathered.** The step running during backward
    (tiertrain/update/nvme/overlapped_step.py) updates a unit once its gradient is final, and
    backward gathered that unit just before computing the gradient: the staging tensor the
    gather read holds the unit's pre-step master shard, exactly the bytes the step would read
    back from the master records. :meth:`keep_for_step`, called as the unit's gradient becomes
    complete, hands that tensor to the step instead of leaving it among the spares; the step
    then reads only the moments record of the unit's chunks (8 bytes per element, not 12).
    The staging tensors are page-aligned (:func:`~tiertrain.io.buffers.page_aligned_empty`)
    and the optimizer cuts its chunks at page boundaries where the pieces allow, so the step
    updates each chunk's master in the tensor itself and writes the master record straight from
    it: no copy in or out (a chunk that is not page-aligned in it is copied into the step's
    buffer). The tensor comes back when the unit is updated and those writes landed
    (:meth:`step_done_with`, NVMeAdamW.when_written). At most ``kept_units`` tensors are
    handed over at once (a step lagging further behind backward reads the others' masters
    from disk).

    **The next forward takes the masters the step updated last.** The units whose gradients
    complete last in backward are the first the next forward gathers (the embedding, the first
    blocks). Handed over with ``carry_over``, their tensors keep the step's updated values (the
    step updated them in place; a chunk it updated in its buffer is copied in by
    :meth:`updated`, from the step's ShardWriter) and, once the step has committed, return to
    the spares holding those values at the new version, so that the next forward's first
    gathers read nothing; a step that does not commit returns them empty."""

    def __init__(self, files: NVMeShards, optimizer, units):
        super().__init__(files.placement, files.dtype, files.streams, files.swapper, files.kept_units,
                         files.read_ahead)
        self._spare, self._lent, self._writes, self._lock = files._spare, files._lent, files._writes, files._lock
        self._reading = files._reading
        self._epoch, self._written = files._epoch + 1, files._written
        self.staging_reused, self.values_reused = files.staging_reused, files.values_reused
        self.staging_allocated, self.read_ahead_taken = files.staging_allocated, files.read_ahead_taken
        self.optimizer = optimizer
        self.units = frozenset(units)
        """Indices of the units whose shards are the optimizer's masters (shard s = unit s)."""
        self._for_step: dict[int, torch.Tensor] = {}  # unit -> its pre-step masters, handed to the step
        self._carried: dict[int, set] = {}  # unit handed over with carry_over -> the ranges updated in it
        self.masters_handed = 0
        """Units whose pre-step masters a step took from a gather's staging (a counter)."""
        self.copy_cpu_seconds = 0.0
        """CPU time of copying the step's updated masters into the staging carried over."""

    def holds_masters(self, index: int) -> bool:
        return index in self.units

    def _version(self, index):
        # (a step, a load or a transactional edit of the masters commits a new optimizer version)
        return (*super()._version(index), self.optimizer.version if index in self.units else 0)

    def _fill(self, index, staged, padded=False):
        if index in self.units:
            return self.optimizer.read_master(index, staged, padded=padded)
        return super()._fill(index, staged, padded)

    def write(self, index, shard, values):
        if index not in self.units:
            super().write(index, shard, values)
            return
        self._written[index] = self._written.get(index, 0) + 1  # (an in-place edit commits no version)
        requests = self.optimizer.write_master(index, values)
        if requests is not None:
            self._writes.append(requests)

    def keep_for_step(self, index, carry_over=False):
        if index not in self.units or not self.kept_units:
            return False
        numel = self.optimizer.shard_numel(index)
        with self._lock:
            if index in self._for_step or len(self._for_step) >= self.kept_units:
                return False
            kept = self._kept(index, numel)
            if kept is None:
                return False
            self._for_step[index] = self._spare[numel].pop(kept)[0]
            if carry_over:
                self._carried[index] = set()
            self.masters_handed += 1
        return True

    def master_in_ram(self, index):
        with self._lock:
            return self._for_step.get(index)

    def updated(self, index, start, end, values):
        with self._lock:
            covered = self._carried.get(index)
            tensor = self._for_step.get(index)
        if covered is not None:
            if values.data_ptr() != tensor[start:end].data_ptr():  # (else updated in it already)
                t0 = time.thread_time()
                tensor[start:end].copy_(values)  # (after the step read its masters from it)
                self.copy_cpu_seconds += time.thread_time() - t0
            covered.add((start, end))  # (a restore republishes the same ranges)

    def _spares_kept(self, numel):
        # A tensor handed to the step leaves a gap among the spares that the next gather fills
        # with a new tensor; when it comes back it is kept, not freed (see NVMeShards), within
        # kept_units handed at once.
        handed = sum(t.numel() == numel for t in self._for_step.values())
        return super()._spares_kept(numel) + self.kept_units - handed

    def step_done_with(self, index):
        with self._lock:
            tensor = self._for_step.get(index)
            if tensor is None or index in self._carried:  # (carried: kept until the step commits)
                return
        # (the step may be writing masters straight from the tensor: it comes back once they landed)
        self.optimizer.when_written(index, lambda: self._hand_back(index, tensor))

    def _hand_back(self, index: int, tensor: torch.Tensor) -> None:
        with self._lock:  # (unless step_done took it back already, and a later step was handed another)
            if self._for_step.get(index) is not tensor:
                return
            del self._for_step[index]
        self._give_back(tensor, None, None)  # (the step has since changed the unit's values)

    def step_done(self, committed):
        with self._lock:
            handed, self._for_step = self._for_step, {}
            carried, self._carried = self._carried, {}
        for index, tensor in handed.items():
            whole = sum(end - start for start, end in carried.get(index, ())) == tensor.numel()
            if committed and whole:  # (chunks tile the shard: every value is the committed one)
                self._give_back(tensor, index, self._version(index))
            else:
                self._give_back(tensor, None, None)


def store_for(param_tier: Tier) -> type[DeviceShards]:
    """The store that keeps parameter shards on ``param_tier``: device memory, pinned host
    memory (ZeRO-Offload's P_p on the CPU), or swap files (ZeRO-Infinity's NVMe tier)."""
    tier = Tier(param_tier)
    if tier == Tier.NVME:
        return NVMeShards
    return HostShards if tier == Tier.CPU else DeviceShards


def shard_store(placement, dtype: torch.dtype, streams: DeviceStreams, swapper=None,
                kept_units: int = 4, read_ahead: int = 4, kind: type[DeviceShards] | None = None) -> DeviceShards:
    """The store of placement.param_tier, or of ``kind`` (the run plan's: tiertrain/run_plan.py)
    (kept_units, read_ahead: NVMeShards')."""
    kind = kind or store_for(placement.param_tier)
    if issubclass(kind, NVMeShards):
        if swapper is None:
            raise ValueError("parameters on the nvme tier need a TensorSwapper")
        return kind(placement, dtype, streams, swapper, kept_units, read_ahead)
    return kind(placement, dtype, streams)
