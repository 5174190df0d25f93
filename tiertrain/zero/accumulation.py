"""Where gradients accumulate over the micro-batches of one step at ZeRO stages 2-3
(``zero.accumulate_on_device``): on the device, or in the gradient shard.

ZeRO §5.2 reduces each gradient bucket as backward produces it and keeps only the shard (P_g),
so with gradient accumulation every micro-batch's gradient is reduce-scattered, and with the
optimizer on the CPU tier (ZeRO-Offload §4) copied to the host and added there: n micro-batches
move n times the gradient over the host link. Accumulating on the device instead keeps each
trained unit's whole fp32 gradient in a device buffer (the reducer's bucket, kept across the
micro-batches, as stage 1's full gradient and the pipeline's per-step buckets are) and reduces
it once, at the accumulation boundary's backward, as each unit completes: the traffic of one
micro-batch per step, for 4 bytes per parameter of device memory (4Ψ, not 4Ψ/N_d).

:func:`decide` makes the choice once, for the run plan (tiertrain/run_plan.py) and the
estimator (tiertrain/estimate/layout.py), and says why.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from ..device import free_memory

AUTO_SHARE = 0.5
"""``auto`` accumulates on the device when the accumulators take at most this share of the
device memory free when the engine is built (the rest is left to activations, gathered
parameters and transient buffers, which are allocated later)."""


@dataclass(frozen=True)
class DeviceAccumulation:
    """The decision on ``zero.accumulate_on_device`` and its reason."""

    on: bool
    """Each trained unit's gradient accumulates in a full fp32 device buffer over the
    micro-batches and is reduced once per step (the reducer's ``accumulate``)."""
    reason: str
    """Why, in words (engine.plan.describe() says it)."""
    device_bytes: int = 0
    """The device memory the accumulators take when on: 4 bytes per (padded) element of every
    trained unit."""
    applies: bool = True
    """The setting has a choice to make (stages 2-3, accumulation, one model); False: the
    reason says why not."""

    def describe(self) -> str:
        if not self.applies:
            return f"gradient accumulation: {self.reason}"
        where = "on the device, reduced once per step" if self.on else "in the shard, reduced every micro-batch"
        return f"gradients accumulate {where} ({self.reason})"


def accumulator_bytes(padded_numels) -> int:
    """Device bytes of the accumulators: every trained unit's whole gradient in fp32."""
    return 4 * sum(int(n) for n in padded_numels)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def agreed_free_memory(comm, device: torch.device) -> int | None:
    """The least device memory free on any rank of ``comm`` (a Collectives), None where torch
    cannot tell: every rank of the group must decide alike, since they issue the same
    collectives, so they decide from the same number."""
    free = free_memory(device)
    if free is None or comm.size == 1:
        return free
    t = torch.tensor([free], dtype=torch.int64, device=device)
    comm.all_reduce(t, op=dist.ReduceOp.MIN, count=False)
    return int(t.item())


def decide(setting: str, *, stage: int, accum: int, launch_when_ready: bool, extra_bytes: int,
           accelerator: bool, free_device_bytes: Callable[[], int | None]) -> DeviceAccumulation:
    """The decision for ``zero.accumulate_on_device=setting`` ("auto", "on" or "off") at ZeRO
    ``stage`` with ``accum`` micro-batches per step. launch_when_ready: reductions launch as
    gradients arrive (False: a pipeline schedule launches them, once per step already).
    extra_bytes: :func:`accumulator_bytes` of the trained units. accelerator: the compute
    device is one (on a CPU-only host the device and the CPU tier are the same memory, and
    ``auto`` keeps the per-micro-batch reduction). free_device_bytes: returns the device memory
    free now (None: unknown), e.g. :func:`agreed_free_memory`; called only by ``auto`` on an
    accelerator at stages 2-3 with accumulation, where the choice needs it (every rank of the
    group gets there alike)."""
    if stage < 2:
        return DeviceAccumulation(False, f"stage {stage} keeps whole gradients and reduces once per step already",
                                  applies=False)
    if accum <= 1:
        return DeviceAccumulation(False, "one micro-batch per step, nothing to accumulate", applies=False)
    if not launch_when_ready:
        return DeviceAccumulation(False, "the pipeline schedule accumulates in its buckets and reduces once per step",
                                  applies=False)
    if setting == "on":
        return DeviceAccumulation(True, f"zero.accumulate_on_device=on, {_mib(extra_bytes)} of fp32 buffers",
                                  extra_bytes)
    if setting == "off":
        return DeviceAccumulation(False, "zero.accumulate_on_device=off")
    if not accelerator:
        return DeviceAccumulation(False, "auto: no accelerator, the device and the CPU tier are the same memory")
    free = free_device_bytes()
    if free is None:
        return DeviceAccumulation(False, "auto: the device's free memory is unknown")
    budget = int(AUTO_SHARE * free)
    if extra_bytes <= budget:
        return DeviceAccumulation(True, f"auto: {_mib(extra_bytes)} of fp32 buffers fit in {AUTO_SHARE:g} of the "
                                        f"{_mib(free)} free on the device", extra_bytes)
    return DeviceAccumulation(False, f"auto: {_mib(extra_bytes)} of fp32 buffers exceed {AUTO_SHARE:g} of the "
                                     f"{_mib(free)} free on the device")
