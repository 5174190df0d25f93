"""The compute device's streams, events, asynchronous copies and host buffers: one code path
for every device.

Everything goes through ``torch.get_device_module(device)``: ``torch.cuda`` on a GPU,
``torch.cpu`` on the CPU, whose ``Stream``, ``Event``, ``stream()`` and ``current_stream()``
exist and do nothing (torch 2.13). So the CPU suite executes the stream and event calls a GPU
executes, and no ``torch.cuda.`` call is needed outside this module (the hardware probe and the
launcher, which ask CUDA-specific questions, excepted).

A tier transfer (ZeRO-Infinity §6: a parameter shard CPU → device ahead of its all-gather, a
reduced gradient device → CPU for the CPU optimizer, an activation checkpoint out and back) is a
:class:`Transfer`: the copy runs on the device's *copy stream*, after the work the compute stream
had queued when it was issued (the producer of its source), and its consumer must wait for it:
:meth:`Transfer.wait` orders a stream after it (the all-gather or the recomputation that reads
the copy), :meth:`Transfer.synchronize` the host (the CPU optimizer reading a landed gradient).
On a GPU a missing wait is a race: a kernel or the host reads memory the copy has not written
yet. On the CPU every copy is synchronous, so no test could see one; hence:

**Deferred copies** (a test harness, ``TIERTRAIN_DEFER_COPIES=1`` in the environment of the
process): every transfer writes NaN (integers: their maximum) into its destination, keeps its
source's values, and fills them in only when it is waited on. A consumer that reads before
waiting reads NaN, and the test comparing with an ordinary run fails. A transfer whose source
is already where it is wanted (the CPU tier on a CPU device) is then copied anyway, so the
harness covers the lines a GPU would run. ``TIERTRAIN_DEFER_COPIES=skip-wait:KIND`` also makes
the waits of one kind of transfer do nothing: what removing those waits from the code would do
(tests/test_deferred_copies.py shows that each kind's removal is caught).

**Pinned host memory** (page-locked, what an accelerator copies to and from asynchronously) is
allocated here only, by :func:`host_empty`, and its storage is not resizable: it may be freed by
dropping every reference, never shrunk or grown in place (``resize_``). Memory that is freed in
place (:func:`free_storage`) is pageable. On the CPU nothing is pinned, so no test would see a
resize of pinned memory; hence the **emulated GPU host** (``TIERTRAIN_EMULATE_GPU_HOST=1``): host
buffers that would be pinned on a GPU machine are pinned here too, in the sense that matters, a
storage that refuses to resize, and :func:`is_pinned` reports them; defaults chosen for an
accelerator (stage-3 prefetch) apply (docs/gpu.md lists what else a GPU host does differently and
what is emulated).
"""
from __future__ import annotations

import enum
import os
import weakref
from typing import Callable

import numpy as np
import torch

from .spans import span

DEFER_COPIES_ENV = "TIERTRAIN_DEFER_COPIES"
"""The environment variable that turns on the deferred-copy harness (see the module docstring)."""


class Copy(enum.Enum):
    """The kinds of tier transfer (for the harness's per-kind switch and for errors)."""

    PARAM_TO_DEVICE = "param-to-device"
    """A partitioned unit's shard, CPU or NVMe staging → the device, for its all-gather."""
    GRAD_TO_HOST = "grad-to-host"
    """A reduced gradient shard, device → the CPU tier's gradient (the CPU optimizer reads it)."""
    ACTIVATION_TO_HOST = "activation-to-host"
    """An activation checkpoint, device → host buffer (activations.offload: cpu)."""
    ACTIVATION_TO_DEVICE = "activation-to-device"
    """An activation checkpoint, host buffer → device, before its block is recomputed."""
    UPDATE_TO_DEVICE = "update-to-device"
    """A chunk of an updated shard in the compute dtype, pinned host buffer → the device's shard,
    after the CPU tier's optimizer step (tiertrain/zero/upload.py)."""


def device_module(device: torch.device):
    """torch.cuda, torch.cpu, ...: the module with the device's Stream, Event and stream()."""
    return torch.get_device_module(torch.device(device).type)


def is_accelerator(device: torch.device) -> bool:
    """Whether device is an accelerator (its memory is not host memory)."""
    return torch.device(device).type != "cpu"


def accelerator_available() -> bool:
    """Whether this process sees an accelerator (host buffers are then pinned for its copies)."""
    return torch.accelerator.is_available()


def default_device(local_rank: int = 0) -> torch.device:
    """The accelerator of this local rank when there is one, else the CPU."""
    if not torch.accelerator.is_available():
        return torch.device("cpu")
    kind = torch.accelerator.current_accelerator()
    return torch.device(kind.type, local_rank % torch.accelerator.device_count())


def free_memory(device: torch.device) -> int | None:
    """Bytes free on an accelerator (None for the CPU, or where torch cannot tell)."""
    if not is_accelerator(device):
        return None
    info = getattr(device_module(device), "mem_get_info", None)
    return None if info is None else int(info(device)[0])


def peak_allocated(device: torch.device) -> int | None:
    """The most bytes the caching allocator held for tensors on an accelerator (None for the CPU)."""
    if not is_accelerator(device):
        return None
    peak = getattr(device_module(device), "max_memory_allocated", None)
    return None if peak is None else int(peak(device))


def _defer_spec() -> tuple[bool, frozenset[Copy]]:
    """(defer copies, kinds whose waits do nothing) from DEFER_COPIES_ENV."""
    value = os.environ.get(DEFER_COPIES_ENV, "").strip()
    if not value or value == "0":
        return False, frozenset()
    skipped = set()
    for word in value.split(","):
        word = word.strip()
        if word in ("1", "defer"):
            continue
        if word.startswith("skip-wait:"):
            name = word.removeprefix("skip-wait:")
            try:
                skipped.add(Copy(name))
            except ValueError:
                raise ValueError(f"{DEFER_COPIES_ENV}={value!r}: {name!r} is not a kind of copy; valid: "
                                 f"{[k.value for k in Copy]}") from None
            continue
        raise ValueError(f"{DEFER_COPIES_ENV}={value!r} is invalid: expected 1 or skip-wait:KIND, comma-separated")
    return True, frozenset(skipped)


GPU_HOST_ENV = "TIERTRAIN_EMULATE_GPU_HOST"
"""The environment variable that turns on the emulated accelerator host (module docstring)."""

_emulated_pinned: dict[int, int] = {}  # data_ptr -> bytes of each live emulated pinned allocation


def env_flag(name: str, meaning: str) -> bool:
    """An on/off switch from the environment: unset, empty or 0 is off, 1 is on; anything else
    is a ValueError naming the variable, its value and ``meaning`` (what 1 does)."""
    value = os.environ.get(name, "").strip()
    if value in ("", "0"):
        return False
    if value != "1":
        raise ValueError(f"{name}={value!r} is invalid: expected 1 ({meaning}) or 0")
    return True


def emulating_gpu_host() -> bool:
    """Whether this CPU process emulates a GPU host (GPU_HOST_ENV): pinned host memory, and the
    defaults an accelerator gets (:func:`acts_as_accelerator`)."""
    return env_flag(GPU_HOST_ENV, "emulate a GPU host")


def acts_as_accelerator(device: torch.device) -> bool:
    """Whether code paths chosen for an accelerator apply to ``device``: it is one, or the CPU
    under the emulated GPU host (so that the CPU suite runs those paths)."""
    return is_accelerator(device) or emulating_gpu_host()


def pins_host(device: torch.device) -> bool:
    """Whether host buffers that ``device`` copies from and to are pinned: for an accelerator,
    and for the CPU under the emulated GPU host."""
    return acts_as_accelerator(device)


def pins_host_by_default() -> bool:
    """Whether host buffers are pinned where no compute device is named: an accelerator is
    present, or emulated."""
    return accelerator_available() or emulating_gpu_host()


def host_empty(shape, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An uninitialised host tensor; ``pinned``: page-locked, for an accelerator's asynchronous
    copies (its storage is then not resizable: free it by dropping it, never with resize_).
    Without an accelerator, pinned memory is the emulated kind (GPU_HOST_ENV), or refused."""
    if not pinned:
        return torch.empty(shape, dtype=dtype)
    if accelerator_available():
        # (The copying path, Tensor.pin_memory(), makes the same fixed storage; this one
        # allocates once, from the caching host allocator.)
        return torch.empty(shape, dtype=dtype, pin_memory=True)
    if not emulating_gpu_host():
        raise RuntimeError("pinned host memory was asked for, but this process has no accelerator "
                           f"(and {GPU_HOST_ENV} is not set): pin only when pins_host(device)")
    return _emulated_pinned_empty(shape, dtype)


def _emulated_pinned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    # A tensor over a numpy array has a storage that is not resizable, as pinned memory's is.
    numel = 1
    for n in ([shape] if isinstance(shape, int) else shape):
        numel *= int(n)
    size = torch.empty(0, dtype=dtype).element_size()
    array = np.empty(max(numel * size, 1), dtype=np.uint8)
    address = array.ctypes.data
    _emulated_pinned[address] = numel * size
    weakref.finalize(array, _emulated_pinned.pop, address, None)
    return torch.from_numpy(array)[:numel * size].view(dtype).view(shape)


def is_pinned(t: torch.Tensor) -> bool:
    """Whether t's memory is pinned host memory (real, or emulated under GPU_HOST_ENV)."""
    if t.device.type != "cpu":
        return False
    if t.untyped_storage().data_ptr() in _emulated_pinned:
        return True
    return accelerator_available() and t.is_pinned()


def emulated_pinned_bytes() -> int:
    """Bytes of emulated pinned host memory alive now (tests: what a release gave back)."""
    return sum(_emulated_pinned.values())


def free_storage(t: torch.Tensor) -> None:
    """Give t's memory back in place, keeping the tensor (its shape, and every reference to
    it) for :func:`renew_storage`. Only pageable memory can be: pinned memory's storage cannot
    be resized (allocate memory that is freed in place with ``host_empty(..., pinned=False)``)."""
    storage = t.untyped_storage()
    if not storage.resizable():
        raise RuntimeError(f"cannot free a {tuple(t.shape)} {t.dtype} tensor in place: its storage is "
                           f"not resizable ({'pinned host memory' if is_pinned(t) else 'fixed memory'}); "
                           "memory freed in place must be allocated pageable (host_empty(pinned=False))")
    storage.resize_(0)


def renew_storage(t: torch.Tensor) -> None:
    """Give t (freed by :func:`free_storage`) memory again; its values are undefined."""
    t.untyped_storage().resize_(t.numel() * t.element_size())


def _poison(t: torch.Tensor) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex:
        t.fill_(float("nan"))
    elif t.dtype == torch.bool:
        t.fill_(True)
    else:
        t.fill_(torch.iinfo(t.dtype).max)


class Transfer:
    """An asynchronous copy into ``value``: wait for it before reading ``value``."""

    __slots__ = ("value", "kind", "_event", "_fill", "_streams")

    def __init__(self, value: torch.Tensor, kind: Copy, streams: "DeviceStreams", event=None,
                 fill: Callable[[], None] | None = None):
        self.value = value
        self.kind = kind
        self._streams = streams
        self._event = event
        self._fill = fill

    def _land(self) -> None:
        if self._fill is not None and self.kind not in self._streams.skipped_waits:
            fill, self._fill = self._fill, None
            fill()

    def wait(self, stream=None) -> torch.Tensor:
        """Order ``stream`` (default: the device's current stream) after the copy; returns the
        destination. Work queued on that stream from now on sees the copied values."""
        if self._event is not None:
            (stream or self._streams.current_stream()).wait_event(self._event)
        self._land()
        return self.value

    def source_read(self) -> None:
        """Block the host until the copy has read its source, which may then be overwritten
        (under the harness at once: the copy took its source's values when it was issued).
        Not a wait for the destination: that is :meth:`wait` or :meth:`synchronize`."""
        if self._event is not None:
            self._event.synchronize()

    def synchronize(self) -> torch.Tensor:
        """Block the host until the copy has landed; returns the destination (which host code
        may then read)."""
        with span("wait/copy"):
            if self._event is not None:
                self._event.synchronize()
            self._land()
        return self.value


class DeviceStreams:
    """The compute device's current stream, a copy stream for tier transfers, and the host
    buffers those copy from (pinned when the device is an accelerator: an asynchronous copy
    from pageable memory would be synchronous)."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.module = device_module(self.device)
        self.accelerated = is_accelerator(self.device)
        self.defer, self.skipped_waits = _defer_spec()
        self._copy_stream = None

    def __reduce__(self):  # (a deep copy of a model holding one: fresh streams)
        return (DeviceStreams, (self.device,))

    # -- streams and events --

    def current_stream(self):
        return self.module.current_stream(self.device) if self.accelerated else self.module.current_stream()

    def new_stream(self):
        return self.module.Stream(device=self.device) if self.accelerated else self.module.Stream()

    @property
    def copy_stream(self):
        """The stream tier transfers run on (made at first use)."""
        if self._copy_stream is None:
            self._copy_stream = self.new_stream()
        return self._copy_stream

    def using(self, stream):
        """Context manager: work issued inside runs on ``stream``."""
        return self.module.stream(stream)

    def new_event(self):
        return self.module.Event()

    # -- host buffers --

    @property
    def pin(self) -> bool:
        """Host buffers the device copies from are pinned (for an accelerator, or emulated)."""
        return pins_host(self.device)

    def host_empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        return host_empty(shape, dtype, pinned=self.pin)

    # -- transfers --

    def copy(self, dst: torch.Tensor, src: torch.Tensor, kind: Copy, stream=None) -> Transfer:
        """dst ← src on ``stream`` (default: the copy stream), after the work the current
        stream has queued so far; returns the Transfer to wait on before reading dst. The
        caller keeps src unchanged (and alive) until then."""
        if self.defer:
            kept = src.detach().clone()
            _poison(dst)
            return Transfer(dst, kind, self, fill=lambda: dst.copy_(kept))
        if not self.accelerated:
            dst.copy_(src)
            return Transfer(dst, kind, self)
        stream = stream or self.copy_stream
        stream.wait_stream(self.current_stream())
        with self.using(stream):
            dst.copy_(src, non_blocking=True)
            event = self.new_event()
            event.record(stream)
        for t in (dst, src):  # (their memory is not reused before the copy has run)
            if t.device.type == self.device.type:
                t.record_stream(stream)
        return Transfer(dst, kind, self, event)

    def to_device(self, src: torch.Tensor, kind: Copy) -> Transfer:
        """src on the device: a new tensor copied to (src itself when it is there already,
        except under the harness)."""
        if src.device == self.device and not self.defer:
            return Transfer(src, kind, self)
        return self.copy(torch.empty(src.shape, dtype=src.dtype, device=self.device), src, kind)

    def to_host(self, src: torch.Tensor, kind: Copy) -> Transfer:
        """src in host memory: a new (pinned) tensor copied to (src itself when it is there
        already, except under the harness)."""
        if src.device.type == "cpu" and not self.defer:
            return Transfer(src, kind, self)
        return self.copy(self.host_empty(src.shape, src.dtype), src, kind)


__all__ = ["Copy", "DeviceStreams", "Transfer", "DEFER_COPIES_ENV", "GPU_HOST_ENV", "device_module",
           "env_flag", "emulating_gpu_host", "acts_as_accelerator", "pins_host", "pins_host_by_default", "host_empty", "is_pinned", "emulated_pinned_bytes",
           "free_storage", "renew_storage",
           "is_accelerator", "accelerator_available", "default_device", "free_memory", "peak_allocated"]
