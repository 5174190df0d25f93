"""Per-rank flat buffers of every unit, and the binding of the model's parameters to them.

For each unit this rank keeps:

* ``full``   the unit's whole flat buffer in the compute dtype. Model parameters are views
             into it. Resident units (stages 0-2, stage-3 persistent parameters) keep it
             allocated; partitioned units (stage 3) hold its storage only between gather and
             release (ZeRO §5.3: "gather params → forward → release").
* ``shard``  this rank's slice of the parameters in the compute dtype (a view of ``full``
             when resident).
* ``master`` the fp32 master copy of the shard, updated by the optimizer (the shard itself
             when the compute dtype is fp32, so no second copy exists).
* ``grad``   the fp32 gradient of the shard. Stages 0-1 also keep ``grad_full``, the whole
             unit's gradient, of which ``grad`` is a view; stages 2-3 keep only the shard.

A :class:`Placement` says on which tier each lives (ZeRO-Offload §4; ZeRO-Infinity §5):
with the optimizer offloaded, ``master`` and ``grad`` live in CPU memory and the update
runs there ("g offload", "p update", "p swap"); with parameters offloaded (stage 3),
``shard`` lives in CPU memory and is copied to the device before each all-gather. On a
machine without an accelerator both tiers are host memory, and the same copies run.

Partitioned units' shards live in the store of the parameter tier, a :class:`ShardStore`
(tiertrain/zero/shard_store_protocol.py) that the engine builder picks from the tier package
(tiertrain/offload/shard_store.py) and passes in: on the device, in CPU memory, or in one swap file per
unit, where the ``shard`` tensor has no storage and each gather reads the file
(:meth:`FlatParameters.prefetch_shards` starts those reads ahead of use, so the read of unit
i+3 overlaps the compute of unit i); after each optimizer step the updated shard is written
back ("p swap" of ZeRO-Infinity §6).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

import torch
import torch.nn as nn

from ..comm import Collectives, Work
from ..device import DeviceStreams, acts_as_accelerator, free_storage, host_empty, pins_host, renew_storage
from ..spans import span
from ..tiers import Tier
from .layout import FlatLayout, Unit
from .released import hold, mark_gathered, mark_released
from .shard_store_protocol import ShardStore
from .upload import ShardUpload


NVME_READ_AHEAD = 3
"""Stage-3 units ahead whose shards are read from NVMe while the current one computes
(ZeRO-Infinity §6: NVMe→CPU for i+3, CPU→device for i+2, all-gather for i+1)."""

COPY_AHEAD = 2
"""Stage-3 units ahead whose CPU-tier shards are copied to the device (on the copy stream)
while the current one computes: i+1 and i+2 (the all-gather of i+1 then finds its input there)."""

SWAP_BLOCK_BYTES = 1 << 20
"""IO block of the parameter swapper (and of its buffer pool)."""


def swap_pool_bytes(largest_shard_bytes: int) -> int:
    """The parameter swapper's buffer pool: room for the reads of NVME_READ_AHEAD units ahead
    (in the half of the pool prefetches may hold) and as much again for writes, at least
    64 MiB, in whole IO blocks."""
    block = SWAP_BLOCK_BYTES
    return max(64 << 20, -(-(2 * NVME_READ_AHEAD * largest_shard_bytes) // block) * block)


@dataclass(frozen=True)
class Placement:
    """The tier of each kind of state (tiertrain/tiers.py)."""

    compute: torch.device = torch.device("cpu")
    optimizer_tier: Tier = Tier.DEVICE
    param_tier: Tier = Tier.DEVICE

    def __post_init__(self) -> None:  # (frozen: through object.__setattr__)
        object.__setattr__(self, "optimizer_tier", Tier(self.optimizer_tier))
        object.__setattr__(self, "param_tier", Tier(self.param_tier))

    @property
    def offload_optimizer(self) -> bool:
        """Master weights, optimizer state and gradient shards live off the device."""
        return self.optimizer_tier.offloaded

    @property
    def offload_params(self) -> bool:
        """Partitioned parameter shards live off the device (stage 3)."""
        return self.param_tier.offloaded

    @property
    def host(self) -> torch.device:
        return torch.device("cpu")

    @property
    def optimizer(self) -> torch.device:
        return self.host if self.offload_optimizer else self.compute

    @property
    def param_shards(self) -> torch.device:
        return self.host if self.offload_params else self.compute

    def empty(self, numel: int, dtype: torch.dtype, tier: Tier, device_copies: bool = True) -> torch.Tensor:
        """A new tensor on ``tier``: device memory, or host memory for the CPU and NVMe tiers.
        Host memory that the compute device copies to or from is pinned (tiertrain/device.py);
        ``device_copies=False``: no device copy reads or writes it (it is transient, or freed in
        place with free_storage, which pinned memory does not allow), so it stays pageable."""
        if Tier(tier) is Tier.DEVICE:  # (raises for anything that is not a tier, e.g. a device)
            return torch.empty(numel, dtype=dtype, device=self.compute)
        return host_empty(numel, dtype, pinned=device_copies and pins_host(self.compute))


@dataclass
class UnitBuffers:
    unit: Unit
    full: torch.Tensor
    shard: torch.Tensor
    master: torch.Tensor
    grad: torch.Tensor
    grad_full: torch.Tensor | None
    gathered: bool = True
    pending: Work | None = None
    stale_grad: bool = False
    """The gradient is logically zero but its memory still holds the previous step's values
    (:meth:`FlatParameters.zero_grads` with ``lazy=True``): the next reduction overwrites it
    instead of adding into it, which saves a pass over it to zero it and another to add."""
    trainable: bool = True
    """False for a frozen unit: no gradient, no master (both zero-sized)."""
    grad_released: bool = False
    """The gradient shard's memory was given back after the optimizer consumed it
    (:meth:`release_grad`); the step marks it stale, and the next reduction writes it again."""

    def release_grad(self) -> None:
        """Give the gradient shard's memory back: the NVMe optimizer, updating in place during
        backward, has consumed it (tiertrain/update/nvme/form.py). So a rank holds only the
        gradients reduced and not yet consumed, not every unit's."""
        if self.grad_full is None and self.grad.numel():
            free_storage(self.grad)
            self.grad_released = True

    def ensure_grad(self) -> None:
        """Give a released gradient shard memory again (contents undefined; it is stale, so the
        next reduction overwrites it and a zeroing pass zeroes it)."""
        if self.grad_released:
            renew_storage(self.grad)
            self.grad_released = False


class FlatParameters:
    """Owns the units' buffers on this rank and binds the model's parameters to them.

    ``params`` maps each layout slot name to the live nn.Parameter. A parameter built under
    :func:`tiertrain.zero.partitioned_init` arrives holding only its own shard; it is
    gathered once, here, so the unit's flat shard can be cut from it.
    """

    def __init__(self, layout: FlatLayout, params: dict[str, nn.Parameter], comm: Collectives,
                 dtype: torch.dtype, keep_full_grads: bool, shards: ShardStore, rebuild_param=None,
                 placement: Placement = Placement()):
        self.streams: DeviceStreams = shards.streams
        """The compute device's streams and tier transfers (tiertrain/device.py)."""
        self.shards: ShardStore = shards
        """Where partitioned units' shards live (the parameter tier's store, of placement.param_tier)."""
        self.upload = ShardUpload(self.streams, dtype)
        """Sends updated values from the CPU tier into shards on an accelerator (zero/upload.py)."""
        self._shards_stand_for_device = acts_as_accelerator(placement.compute) or self.streams.defer
        """Whether shards on the device tier are (or stand for) memory the host does not write:
        an accelerator's, or the CPU's under the emulated GPU host or the deferred-copy harness."""
        self.layout = layout
        self.placement = placement
        self._publishing: set[int] = set()  # resident units whose post-step all-gather is in flight
        self.masters_elsewhere = False
        """An update form holds the fp32 masters itself (hold_masters_elsewhere) and writes
        the updated shards itself: publish_masters casts none."""
        self.device = placement.compute
        self.params = params
        hold(params)
        self.comm = comm
        self.dtype = dtype
        self.units: list[UnitBuffers] = []
        self.peak_gathered_bytes = 0
        self.slot_of: dict[nn.Parameter, tuple[int, int]] = {}
        # With one shard (stage 0) every rank owns the whole unit.
        self.shard_rank = comm.rank if layout.num_shards > 1 else 0
        self._all: list[UnitBuffers] = []
        self.frozen_units: list[UnitBuffers] = []
        """Stage 3's frozen units: shards gathered and released like the others, no gradient
        or master (the layout's ``frozen``)."""
        self.unit_of: dict[nn.Parameter, tuple[int, int]] = {}
        """Every parameter in the layout (trained and frozen) → (unit index, slot index)."""
        for unit in layout.units:
            self.units.append(self._build_unit(unit, params, rebuild_param, keep_full_grads, trainable=True))
        for unit in layout.frozen:
            self.frozen_units.append(self._build_unit(unit, params, rebuild_param, keep_full_grads, trainable=False))
        self.wait_writes()

    def _build_unit(self, unit: Unit, params, rebuild_param, keep_full_grads: bool, trainable: bool) -> UnitBuffers:
        """Pack unit's parameters into its full buffer, cut this rank's shard (into the
        parameter tier's store when partitioned), allocate master and gradient (trained units
        only) and point the parameters at their slots. A master of its own is filled from the
        parameters' values, not from the compute copy: an fp32 model wrapped at bf16 keeps its
        fp32 weights exactly (the compute copy is rounded)."""
        placement, dtype, device, rank = self.placement, self.dtype, self.device, self.shard_rank
        lo, hi = unit.shard_range(rank)
        # The master is the shard itself when both are fp32 on the same tier (on NVMe, the
        # optimizer then takes the shard's file over: update/nvme/masters.py).
        shard_tier = Tier.DEVICE if unit.resident else placement.param_tier
        # With the NVMe optimizer no device copy touches the master or gradient in RAM: the
        # masters leave for its files at its build, and its step may free the gradient in
        # place; reduced gradients reach the host through a pinned transfer buffer.
        host_only = placement.optimizer_tier == Tier.NVME
        master = None
        if trainable and not (dtype == torch.float32 and placement.optimizer_tier == shard_tier):
            master = placement.empty(unit.shard_numel, torch.float32, placement.optimizer_tier,
                                     device_copies=not host_only)
            master.zero_()  # (the padding)
        full = torch.zeros(unit.padded_numel, dtype=dtype, device=device)
        for k, slot in enumerate(unit.slots):
            p = params[slot.name]
            value = rebuild_param(p) if rebuild_param is not None else p.detach()
            full[slot.offset:slot.end].copy_(value.reshape(-1))
            if master is not None:  # from the value itself: the compute copy may be rounded (bf16)
                a, b = max(slot.offset, lo), min(slot.end, hi)
                if a < b:
                    master[a - lo:b - lo].copy_(value.reshape(-1)[a - slot.offset:b - slot.offset])
            self.unit_of[p] = (unit.index, k)
            if trainable:
                self.slot_of[p] = (unit.index, k)
        if unit.resident:
            shard = full[lo:hi]
        else:
            shard = self.shards.allocate(unit.shard_numel)
            shard.copy_(full[lo:hi])
        if not trainable:
            master = grad = torch.empty(0, dtype=torch.float32, device=device)
            grad_full = None
        else:
            if master is None:
                master = shard
            if keep_full_grads:
                grad_full = torch.zeros(unit.padded_numel, dtype=torch.float32, device=device)
                grad = grad_full[lo:hi]
            else:
                grad_full = None
                grad = placement.empty(unit.shard_numel, torch.float32, placement.optimizer_tier,
                                       device_copies=not host_only)
                if placement.optimizer_tier != Tier.NVME:
                    # (With the NVMe optimizer, hold_masters_elsewhere() zeroes it once the masters have
                    # left for NVMe: pages never written take no memory, so a rank never holds
                    # both fp32 copies, twice its shard of the model, at once. Until then it is
                    # stale, logically zero: whatever form steps, nothing adds into it unwritten.)
                    grad.zero_()
        unwritten = trainable and grad_full is None and placement.optimizer_tier == Tier.NVME
        buffers = UnitBuffers(unit, full, shard, master, grad, grad_full, trainable=trainable, stale_grad=unwritten)
        for slot in unit.slots:
            params[slot.name].data = full[slot.offset:slot.end].view(slot.shape)
        self._all.append(buffers)  # units are built in index order
        if not unit.resident:
            self.release(unit.index)
            self.shards.write(unit.index, shard, shard)  # (to its file, on NVMe)
        return buffers

    @property
    def all_units(self) -> list[UnitBuffers]:
        """Every unit, trained then frozen, so that position i holds the unit of index i
        (``units`` holds the trained ones, which have gradients and masters)."""
        return self._all

    def unit_index(self, p: nn.Parameter) -> int:
        """The index of the unit holding parameter p (trained or frozen)."""
        return self.unit_of[p][0]

    # -- stage 3: gather before use, release after -------------------------------------

    def gather(self, index: int, async_op: bool = False) -> None:
        """Rebuild unit `index`'s full buffer from every rank's shard (no-op if present)."""
        u = self._all[index]
        if u.gathered:
            if u.pending is not None and not async_op:
                u.pending.wait()
                u.pending = None
                self._publishing.discard(index)
            return
        renew_storage(u.full)
        mark_gathered(self._params_of(u))
        u.gathered = True
        self.peak_gathered_bytes = max(self.peak_gathered_bytes, self.gathered_bytes())
        # (NVMe → CPU staging, prefetched; CPU → device on the copy stream, staged ahead:
        # ZeRO-Infinity's fetch). The all-gather reads the copy: it waits for it.
        shard = self.shards.gather_input(index, u.shard).wait()
        u.pending = self.comm.all_gather(u.full, shard, async_op=True)
        u.pending.then(lambda: self.shards.done_with_input(shard))  # (the staged shard lives until then)
        if not async_op:
            u.pending.wait()
            u.pending = None

    def release(self, index: int) -> None:
        """Free unit `index`'s full buffer; its parameters keep their shapes but no storage
        (reading their values raises until the next gather: zero/released.py)."""
        u = self._all[index]
        if u.unit.resident or not u.gathered:
            return
        if u.pending is not None:
            u.pending.wait()
            u.pending = None
        free_storage(u.full)
        mark_released(self._params_of(u))  # (a read of their values now raises, naming them)
        u.gathered = False

    def _params_of(self, u: UnitBuffers) -> list[nn.Parameter]:
        return [self.params[slot.name] for slot in u.unit.slots]

    # -- the parameter tier ---------------------------------------------------------------

    def on_nvme(self, index: int) -> bool:
        """Whether unit index's shard lives in a swap file (its shard tensor has no storage)."""
        return self.shards.tier == Tier.NVME and not self._all[index].unit.resident

    def wait_writes(self) -> None:
        """Wait for the shard writes in flight; raises the first IO error (naming the file)."""
        self.shards.wait_writes()

    def prefetch_shards(self, indices) -> None:
        """Start reading these units' shards from their tier (a hint: skipped when not useful)."""
        self.shards.prefetch([i for i in indices if not self._all[i].unit.resident and not self._all[i].gathered],
                             shard_numel=lambda i: self._all[i].unit.shard_numel)

    def stage_shards(self, indices) -> None:
        """Start copying these units' shards from the CPU tier to the device (a hint: the
        copy of a unit gathered two units from now overlaps the current unit's compute)."""
        wanted = [i for i in indices if not self._all[i].unit.resident and not self._all[i].gathered]
        self.shards.stage(wanted, {i: self._all[i].shard for i in wanted})

    def read_shard(self, index: int) -> torch.Tensor:
        """A copy of this rank's compute-dtype shard of unit index (read from its file on NVMe)."""
        u = self._all[index]
        if u.unit.resident:
            return u.shard.detach().clone()
        return self.shards.read(index, u.shard)

    def write_shard(self, index: int, values: torch.Tensor) -> None:
        """Set this rank's shard of unit index (and its master copy, when held here) to values."""
        self.shards.drop_staged()
        u = self._all[index]
        if u.unit.resident:
            u.shard.copy_(values)
        else:
            self.shards.write(index, u.shard, values)
            self.shards.wait_writes()
        if u.trainable and u.master is not u.shard and not self.masters_elsewhere:
            u.master.copy_(values)

    def use_store(self, store: ShardStore) -> None:
        """Keep partitioned shards in ``store`` from now on: one that wraps the current store
        (an update form whose own records are some shards, e.g. the NVMe optimizer's masters,
        tiertrain/update/nvme/masters.py); the writes in flight complete first."""
        self.wait_writes()
        self.shards = store

    def hold_masters_elsewhere(self, release_grads: bool = False) -> None:
        """Free the fp32 masters: the update form keeps its own (the NVMe optimizer, in its
        chunk records, ZeRO-Infinity §6) and writes updated values into the shards itself, so
        publish_masters casts none. The gradient shards are zeroed, or with ``release_grads``
        (a form that releases each shard once consumed) left without memory until their first
        reduction writes them (stale), so that the build never holds every unit's gradient
        (4Ψ/N_d bytes) at once."""
        for u in self.units:
            if u.master is not u.shard:
                u.master = u.master.new_empty(0)
            if u.grad_full is None:
                if release_grads:
                    u.release_grad()
                    u.stale_grad = True
                else:
                    u.grad.zero_()
        self.masters_elsewhere = True

    def gathered_bytes(self) -> int:
        return sum(u.full.numel() * u.full.element_size() for u in self._all
                   if u.gathered and not u.unit.resident)

    # -- after the optimizer step -----------------------------------------------------

    def host_compute_shard(self, index: int) -> torch.Tensor | None:
        """The compute-dtype shard publish_masters copies trained unit ``index``'s master into,
        when that copy is a plain one into host memory, which the CPU-tier optimizer may then
        write in its own pass (tiertrain/update/host_adamw.py); None when the master is the
        shard, or the shard lives on an accelerator (see :meth:`uploaded_shard`) or in swap files."""
        u = self._all[index]
        if (u.master is u.shard or u.shard.device.type != "cpu" or self.masters_elsewhere
                or self.uploaded_shard(index) is not None):
            return None
        if not u.unit.resident and self.shards.tier is Tier.NVME:
            return None
        return u.shard

    def uploaded_shard(self, index: int) -> torch.Tensor | None:
        """Trained unit ``index``'s compute-dtype shard when it is device memory that its master,
        on the CPU tier, reaches through :attr:`upload` (the CPU pass sends its compute-dtype
        copy there: tiertrain/update/host_adamw.py); else None. On the CPU that is under the
        emulated GPU host or the deferred-copy harness (tiertrain/device.py), whose shards
        stand for device memory."""
        u = self._all[index]
        on_device = u.unit.resident or self.shards.tier is Tier.DEVICE
        if (u.master is u.shard or not on_device or self.masters_elsewhere or not self.placement.offload_optimizer
                or not self._shards_stand_for_device):
            return None
        return u.shard

    def publish_masters(self, in_background: bool = False,
                        sources: Mapping[int, torch.Tensor | None] = MappingProxyType({})) -> None:
        """Copy updated fp32 masters into the compute-dtype shards, then rebuild resident
        units' full buffers with an all-gather (ZeRO §5.1: stages 1-2 all-gather the
        updated parameters). Partitioned units are gathered on their next use.
        ``in_background``: return with the all-gathers in flight (each unit's ``pending``);
        :meth:`gather` or :meth:`wait_gathers` completes them (tiertrain/zero/param_gather.py).
        ``sources``: per unit index, the compute-dtype values to store instead of casting its
        master (an update form cast them off the critical path), or None: its shard holds them
        already (the optimizer wrote its host_compute_shard)."""
        with span("publish"):
            self._publish(in_background, sources)

    def _publish(self, in_background: bool, sources: Mapping[int, torch.Tensor | None]) -> None:
        self.wait_gathers()  # a gather still sending a shard must finish before it changes
        self.shards.drop_staged()  # (copies of the shards before this update)
        # A partitioned unit still gathered holds the parameters before this update: release
        # it, so its next use gathers the new shards (a unit left gathered by an irregular
        # backward would otherwise feed stale values to the next forward, silently).
        for u in self._all:
            if not u.unit.resident:
                self.release(u.unit.index)
        if not self.masters_elsewhere:  # (otherwise the update form wrote the shards)
            for u in self.units:
                source = sources.get(u.unit.index, u.master)
                if u.master is u.shard or source is None:
                    continue
                if self.uploaded_shard(u.unit.index) is not None:
                    self.upload.send(u.shard, source)
                elif u.unit.resident:
                    u.shard.copy_(source)
                else:
                    self.shards.write(u.unit.index, u.shard, source)
        self.upload.finish()  # (what the CPU pass or the loop above sent: before the all-gathers read it)
        # All launched before any is waited on: gloo queues them back to back instead of
        # paying one round trip per unit.
        for u in self.units:
            if u.unit.resident and u.unit.num_shards > 1:
                u.pending = self.comm.all_gather(u.full, u.shard, async_op=True)
                self._publishing.add(u.unit.index)
        if not in_background:
            self.wait_gathers()
        self.wait_writes()

    @property
    def gathers_in_flight(self) -> bool:
        """Whether all-gathers launched by ``publish_masters(in_background=True)`` are pending."""
        return bool(self._publishing)

    def wait_gathers(self) -> None:
        """Complete the all-gathers ``publish_masters`` left in flight, in launch order."""
        for index in sorted(self._publishing):
            self.gather(index)

    def zero_grads(self, lazy: bool = False) -> None:
        """Zero every gradient; ``lazy``: only mark them stale (see UnitBuffers.stale_grad), for
        a reducer that writes each unit whole before anything reads it."""
        for u in self.units:
            u.stale_grad = True
        if not lazy:
            self.zero_stale_grads()

    def zero_stale_grads(self) -> None:
        """Zero the gradients still marked stale (units no reduction has written since)."""
        for u in self.units:
            if u.stale_grad:
                u.ensure_grad()
                (u.grad_full if u.grad_full is not None else u.grad).zero_()
                u.stale_grad = False

    # -- accounting --------------------------------------------------------------------

    def memory(self) -> dict[str, int]:
        """Bytes this rank holds now, by kind of state, how many of them sit in the CPU tier
        and how many in the NVMe tier (optimizer moments are counted by the engine)."""
        params = grads = master = host = nvme = 0
        p = self.placement
        for u in self._all:
            if u.unit.resident:
                params += u.full.numel() * u.full.element_size()
            else:
                nbytes = u.unit.shard_numel * u.full.element_size()
                params += nbytes
                host += nbytes if p.param_tier == Tier.CPU else 0
                nvme += nbytes if p.param_tier == Tier.NVME else 0
            if u.master is not u.shard:
                master += u.master.numel() * 4
                host += u.master.numel() * 4 if p.offload_optimizer else 0
            grad = u.grad_full if u.grad_full is not None else u.grad
            grads += grad.numel() * 4
            host += grad.numel() * 4 if p.offload_optimizer else 0
        return {"params": params, "gathered_params": self.gathered_bytes(), "grads": grads,
                "master": master, "cpu_tier": host, "nvme_tier": nvme}


class FrozenShards:
    """This rank's shards of stage 3's frozen units as a checkpoint part: the frozen weights
    (a pretrained backbone) are model state too, and a checkpoint restores them with the rest."""

    def __init__(self, flat: FlatParameters):
        self.flat = flat

    def state_dict(self) -> dict:
        return {"shards": [self.flat.read_shard(u.unit.index) for u in self.flat.frozen_units]}

    def load_state_dict(self, state: dict) -> None:
        shards = state["shards"]
        if len(shards) != len(self.flat.frozen_units):
            raise ValueError(f"the checkpoint holds {len(shards)} frozen shards; this model has "
                             f"{len(self.flat.frozen_units)} frozen units")
        for u, values in zip(self.flat.frozen_units, shards):
            self.flat.release(u.unit.index)
            self.flat.write_shard(u.unit.index, values.to(self.flat.dtype))
