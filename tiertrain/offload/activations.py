"""Activation checkpointing: full-block recomputation every k blocks, with the checkpoints
(the saved block inputs) optionally held in the CPU tier (ZeRO-R's activation checkpointing
and its CPU offload, docs/concepts.md#zero-r-residual-memory; ZeRO-Infinity's memory model and offload engine,
docs/concepts.md#zero-infinity).

``apply_activation_checkpointing(model, config)`` runs the forward of every k-th block
(blocks 0, k, 2k, …; ``k = config.checkpoint_every``) under
``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``: the forward keeps only the
block's inputs, and backward recomputes the block (forward once more) just before its
backward needs the activations. Compute per step grows from 3× to 4× the forward (the
"recomputation 1×" of ZeRO-Infinity §4), and the activations held between forward and
backward fall from every block's intermediates to ≈ ``bsz·seq·hd·bytes`` per checkpointed
block (docs/concepts.md#transformer-memory: checkpoints ≈ 2·bsz·seq·hd·nl/ci bytes in fp16, ci = k), plus the
working memory of the one block being recomputed (AWM).

With ``config.offload == "cpu"`` the checkpoints live in host memory between forward and
backward. Each block input is copied into a (pinned, on an accelerator) host buffer on the
device's copy stream (the forward continues meanwhile), and copied back, the recomputation
waiting for it, when backward starts recomputing that block (tiertrain/device.py: the same
calls on every device; on the CPU the deferred-copy harness checks their waits). Each checkpoint crosses the link twice
(saved once, fetched once) per ci blocks of compute, an arithmetic intensity of 24·hd·ci
(ZeRO-Infinity §4, docs/concepts.md#bandwidth-and-efficiency), so 1–2 GB/s keep the GPU busy: that is why its placement
policy sends checkpoints to the CPU before parameters. (The copy back is not prefetched
ahead of the recomputation: a possible refinement; the bandwidth needed is small.) On a
CPU-only machine, where the "device" is host memory already, the same code path copies
each checkpoint into a separate, accounted host pool, so the path runs and its bytes are
counted. The pool keeps freed buffers for reuse by
size (ZeRO-R's constant, preallocated checkpoint buffers, against fragmentation): after the
first step no new host memory is allocated.

How a block's inputs reach the CPU tier: non-reentrant checkpoint saves the block's
positional tensor inputs through autograd's saved-tensor mechanism *before* it installs its
own hooks for the block's interior, so a ``torch.autograd.graph.saved_tensors_hooks`` pair
around the checkpoint call sees exactly the checkpoints (and nothing else), and its unpack
runs when backward asks for them, i.e. just before recomputation. Keyword tensor
arguments are passed positionally for the same reason.

Interaction with ZeRO stage 3 (tiertrain/zero/stage3.py): the checkpointed forward replaces
the block's ``forward`` only, so ``module.__call__`` and the fetcher's hooks on the block
still run around the original forward: the pre-hook gathers, the post-hook releases and
hangs a gradient hook on the block's output, which gathers the block again as soon as
backward reaches it — before any of its saved activations is unpacked, hence before the
recomputation, which therefore finds its parameters gathered. Stage-3 units *inside* a
checkpointed block (tiles of a ``TiledLinear``, finer ``unit_modules``) have their hooks fire
again during the recomputation; it runs inside ``stage3.recomputation()``, under which the
fetcher gathers without recording the unit in its traced order or prefetching from it, and
afterwards releases only units whose backward has not begun yet (they are gathered again by
their own backward, as ZeRO §5.3 does for every unit); the unit whose backward asked for the
recomputation keeps its parameters. So at most one nested unit more than without
checkpointing is gathered at a time, each step's prefetch order stays the traced one, and
ranks stay in step (they all recompute the same blocks in the same order).

Selective recomputation (``config.recompute == "selective"``,
docs/concepts.md#selective-activation-checkpointing): the checkpointed forward also keeps
the outputs of the block's matrix multiplications and fused attention
(:data:`SELECTIVE_SAVED_OPS`, torchtitan's op-level policy), through torch's public
``create_selective_checkpoint_contexts``; the recomputation takes those from the cache and
recomputes only the cheap ops between them (norms, activations, rotary, elementwise), so
backward does no more FLOPs than without checkpointing. The kept outputs stay on the device
whatever ``offload`` says (they are what makes backward fast); ``memory()`` counts them in
``saved_op_bytes``. Hugging Face models run a training forward without their KV cache while
checkpointed (:class:`_NoCacheInTraining`).

Dropout: checkpoint stashes the RNG state (CPU, and the inputs' devices') at forward and
restores it for the recomputation, so every mask is drawn again identically.
"""
from __future__ import annotations

import contextlib
import functools
import threading
import weakref
from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from ..blocks import model_blocks, own_checkpoint_interval
from ..compiling import compile_checkpointed_block, unwrap_compiled
from ..config import ACTIVATION_TIERS, ActivationConfig, ConfigError, parse_tier
from ..device import Copy, DeviceStreams, host_empty, pins_host, pins_host_by_default
from ..tiers import Tier
from .recompute import recomputation

__all__ = ["ActivationCheckpointing", "CheckpointMemory", "HostCheckpointPool", "SELECTIVE_SAVED_OPS",
           "apply_activation_checkpointing", "checkpoint_memory", "checkpointing_of"]

_ATTR = "_tiertrain_activation_checkpointing"
_OFFLOAD = ACTIVATION_TIERS


def _aten_ops(*names: str) -> frozenset:
    """The default overloads of the named aten ops this torch build has (the fused attention
    kernels differ between builds and devices)."""
    return frozenset(getattr(torch.ops.aten, n).default for n in names if hasattr(torch.ops.aten, n))


SELECTIVE_SAVED_OPS = _aten_ops(
    "mm", "addmm", "_scaled_mm", "_grouped_mm",  # the linears (F.linear reaches aten as mm/addmm)
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_flash_attention_forward", "_efficient_attention_forward")
"""Ops whose outputs a selectively checkpointed block keeps: matrix multiplications and
fused attention. Batched matmuls (``bmm``) are not among them: in eager attention they make
the s×s scores, the memory checkpointing exists to drop."""


# --------------------------------------------------------------------------- accounting


@dataclass
class CheckpointMemory:
    """Bytes held in activation checkpoints on this rank (both tiers), now and at peak
    since the checkpointing was applied or since the last ``reset_peak()``."""

    bytes: int = 0
    """Checkpoint bytes held now (device + CPU tier)."""
    peak_bytes: int = 0
    """Most checkpoint bytes held at once."""
    host_bytes: int = 0
    """Of ``bytes``, those in the CPU tier (offload='cpu')."""
    host_peak_bytes: int = 0
    """Most checkpoint bytes held at once in the CPU tier."""
    host_reserved_bytes: int = 0
    """Host pool capacity: buffers in use plus freed ones kept for reuse."""
    recomputations: int = 0
    """Blocks recomputed in backward so far."""
    saved_op_bytes: int = 0
    """Of ``bytes``, the op outputs kept by selective recomputation (on the device)."""


class _Counters:
    """Checkpoint byte counters; updated from the forward thread (pack) and from wherever
    autograd frees a block's saved inputs (on CUDA, an autograd device thread)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.device = self.host = self.peak = self.host_peak = self.recomputations = self.saved_ops = 0

    def add_saved_ops(self, nbytes: int) -> None:
        with self.lock:
            self.saved_ops += nbytes
        self.add(nbytes, 0)

    def add(self, device: int, host: int) -> None:
        with self.lock:
            self.device += device
            self.host += host
            self.peak = max(self.peak, self.device + self.host)
            self.host_peak = max(self.host_peak, self.host)

    def __reduce__(self):  # deepcopy/pickle of a model: fresh counters
        return (_Counters, ())


class HostCheckpointPool:
    """Host buffers for offloaded checkpoints (pinned when they will feed an accelerator),
    kept after use and handed out again by exact byte size, so a training loop whose block
    inputs repeat their shapes allocates host memory in its first step only. A returned buffer
    carries its last copy (a Transfer), and is reused only once the host has waited for it."""

    def __init__(self, pin: bool):
        self.pin = pin
        self._free: dict[int, list[tuple[torch.Tensor, object]]] = {}
        self._lock = threading.Lock()
        self.reserved_bytes = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            buf, last_use = free.pop() if free else (None, None)
            if buf is None:
                self.reserved_bytes += nbytes
        if last_use is not None:
            last_use.synchronize()
        if buf is None:
            buf = host_empty(nbytes, torch.uint8, pinned=self.pin)
        return buf

    def give(self, buf: torch.Tensor, last_use=None) -> None:
        with self._lock:
            self._free.setdefault(buf.numel(), []).append((buf, last_use))

    def clear(self) -> None:
        """Drop the buffers kept for reuse (those in use stay with their checkpoints)."""
        with self._lock:
            for bufs in self._free.values():
                self.reserved_bytes -= sum(b.numel() for b, _ in bufs)
            self._free.clear()

    def __reduce__(self):  # deepcopy/pickle of a model: a fresh, empty pool
        return (HostCheckpointPool, (self.pin,))


class _OnDevice:
    """A checkpoint kept where it is (offload='none'); counts its storage once however many
    blocks received the same tensor."""

    __slots__ = ("tensor", "key", "owner")

    def __init__(self, owner: "ActivationCheckpointing", tensor: torch.Tensor):
        self.tensor, self.owner = tensor, owner
        storage = tensor.untyped_storage()
        self.key = storage.data_ptr()
        with owner._counters.lock:
            entry = owner._storages.setdefault(self.key, [storage.nbytes(), 0])
            entry[1] += 1
            first = entry[1] == 1
        if first:
            owner._counters.add(entry[0], 0)

    def __del__(self):
        owner = self.owner
        with owner._counters.lock:
            entry = owner._storages[self.key]
            entry[1] -= 1
            last = entry[1] == 0
            if last:
                del owner._storages[self.key]
        if last:
            owner._counters.add(-entry[0], 0)


class _OnHost:
    """A checkpoint copied into the CPU tier (offload='cpu')."""

    __slots__ = ("buf", "host", "device", "saved", "back", "owner", "nbytes")

    def __init__(self, owner: "ActivationCheckpointing", x: torch.Tensor):
        self.owner, self.device = owner, x.device
        self.nbytes = x.numel() * x.element_size()
        self.buf = owner.pool.take(self.nbytes)
        self.host = self.buf.view(x.dtype).view(x.shape)
        self.back = None
        # Device → (pinned) host on the copy stream, ordered after the work that produced x,
        # while the forward goes on (tiertrain/device.py).
        self.saved = owner.streams(x.device).copy(self.host, x, Copy.ACTIVATION_TO_HOST)
        owner._counters.add(0, self.nbytes)

    def unpack(self) -> torch.Tensor:
        """Back to the device it came from, just before the block is recomputed."""
        streams = self.owner.streams(self.device)
        out = torch.empty(self.host.shape, dtype=self.host.dtype, device=self.device)
        self.saved.wait(streams.copy_stream)  # the copy back reads what the copy out wrote
        self.back = streams.copy(out, self.host, Copy.ACTIVATION_TO_DEVICE)
        return self.back.wait()  # the recomputation reads it

    def __del__(self):
        owner = self.owner
        owner.pool.give(self.buf, self.back if self.back is not None else self.saved)
        owner._counters.add(0, -self.nbytes)


def _release_saved_ops(counters: _Counters, kept: list[int]) -> None:
    counters.add_saved_ops(-kept[0])


class _NoCacheInTraining:
    """Forward hooks on a Hugging Face model: no KV cache in a training forward. Its blocks
    would write to the cache, and a block recomputed in backward would find it changed by its
    own forward (and write to it again); the cache serves generation only, and Hugging Face's
    own gradient checkpointing turns it off too. Each config with ``use_cache`` set (an
    encoder-decoder's decoder stack holds its own copy) reads False for the length of the
    call, and a ``use_cache=True`` argument becomes False. The hooks read the model they are
    called on (a deep copy of the model calls them with the copy). They run outside compiled
    code (a compiled model calls them eagerly)."""

    def __init__(self):
        self.turned_off: list = []

    @classmethod
    def install(cls, model: nn.Module) -> list:
        """The hooks' handles; none for a model without a ``use_cache`` config."""
        if not any(hasattr(getattr(m, "config", None), "use_cache") for m in model.modules()):
            return []
        hooks = cls()
        return [model.register_forward_pre_hook(torch.compiler.disable(hooks.before), with_kwargs=True),
                model.register_forward_hook(torch.compiler.disable(hooks.after), always_call=True)]

    def before(self, module, args, kwargs):
        if not (module.training and torch.is_grad_enabled()):
            return None
        configs = {id(c): c for m in module.modules() if (c := getattr(m, "config", None)) is not None}
        for config in configs.values():
            if getattr(config, "use_cache", None) is True:
                config.use_cache = False
                self.turned_off.append(config)
        if kwargs.get("use_cache"):
            return args, {**kwargs, "use_cache": False}
        return None

    def after(self, module, args, output):
        for config in self.turned_off:
            config.use_cache = True
        self.turned_off = []


# --------------------------------------------------------------------------- the wrapper


class _CheckpointedForward:
    """Installed as ``block.forward``: runs the block's own forward under non-reentrant
    checkpoint, with the handle's saved-tensor hooks around it (see the module docstring).
    A class, not a closure, so that ``copy.deepcopy(model)`` rebinds it to the copy."""

    def __init__(self, owner: "ActivationCheckpointing", module: nn.Module, previous, name: str):
        self.owner, self.module, self.previous, self.name = owner, module, previous, name

    def _run(self, *args, **kwargs):
        if self.previous is not None:
            return self.previous(*args, **kwargs)
        return type(self.module).forward(self.module, *args, **kwargs)

    def __call__(self, *args, **kwargs):
        if not torch.is_grad_enabled():  # nothing is saved for backward: nothing to checkpoint
            return self._run(*args, **kwargs)
        keys = tuple(kwargs)
        n = len(args)

        def run(*flat):
            return self._run(*flat[:n], **dict(zip(keys, flat[n:], strict=True)))

        owner = self.owner
        with torch.autograd.graph.saved_tensors_hooks(owner._pack, owner._unpack):
            return checkpoint(run, *args, *kwargs.values(), use_reentrant=False,
                              context_fn=functools.partial(owner._contexts, self.name))


class ActivationCheckpointing:
    """What :func:`apply_activation_checkpointing` did to a model: ``blocks`` (every
    candidate block, in order), ``checkpointed`` (those recomputed: every k-th), the pool
    of the CPU tier, ``memory()`` and ``remove()``."""

    def __init__(self, model: nn.Module, config: ActivationConfig, blocks: list[str], pin: bool):
        self.config = config
        self.offload = config.offload
        self.blocks = blocks
        k = config.checkpoint_every
        self.checkpointed = blocks[::k] if k > 0 else []
        self.pool = HostCheckpointPool(pin) if self.offload == Tier.CPU else None
        self._streams: dict[torch.device, DeviceStreams] = {}
        self._counters = _Counters()
        self._storages: dict[int, list[int]] = {}
        self._installed: list[tuple[nn.Module, object]] = []
        self._model = model
        for name in self.checkpointed:
            module = model.get_submodule(name)
            previous = module.__dict__.get("forward")
            module.forward = _CheckpointedForward(self, module, previous, name)
            self._installed.append((module, previous))
        self._cache_hooks = _NoCacheInTraining.install(model)

    def streams(self, device: torch.device) -> DeviceStreams:
        """The streams and copies of the device a checkpoint comes from."""
        if device not in self._streams:
            self._streams[device] = DeviceStreams(device)
        return self._streams[device]

    # -- saved-tensor hooks (see the module docstring) ------------------------------

    def _pack(self, x: torch.Tensor):
        if isinstance(x, nn.Parameter):  # model state, not an activation: leave it alone
            return x
        return _OnHost(self, x) if self.offload == Tier.CPU else _OnDevice(self, x)

    @staticmethod
    def _unpack(packed) -> torch.Tensor:
        if isinstance(packed, _OnHost):
            return packed.unpack()
        if isinstance(packed, _OnDevice):
            return packed.tensor
        return packed

    def _contexts(self, block: str):
        if self.config.recompute == "block":
            return contextlib.nullcontext(), self._recomputing()
        return self._selective_contexts(block)

    def _selective_contexts(self, block: str):
        """torch's selective-checkpoint modes for one checkpointed call, with the bytes of
        the outputs they keep counted until the call's recompute mode (which holds them) is
        freed with the block's part of the autograd graph."""
        kept = [0]
        counters = self._counters

        def policy(ctx, op, *args, **kwargs):
            if op not in SELECTIVE_SAVED_OPS:
                return CheckpointPolicy.PREFER_RECOMPUTE
            outputs = ctx.op_output if isinstance(ctx.op_output, (tuple, list)) else (ctx.op_output,)
            nbytes = sum(t.untyped_storage().nbytes() for t in outputs if isinstance(t, torch.Tensor))
            kept[0] += nbytes
            counters.add_saved_ops(nbytes)
            return CheckpointPolicy.MUST_SAVE

        caching, cached = create_selective_checkpoint_contexts(policy)
        weakref.finalize(cached, _release_saved_ops, counters, kept)
        return caching, self._recomputing_selectively(block, cached)

    @contextlib.contextmanager
    def _recomputing_selectively(self, block: str, cached):
        with cached, self._recomputing():
            try:
                yield
            except RuntimeError as e:
                if "not found in storage" not in str(e):  # (torch's words name an op, not the block)
                    raise
                raise RuntimeError(
                    f"selective recomputation of block {block!r} failed: its recomputation did not run the ops "
                    f"its forward ran, so the kept outputs cannot be matched to them. The block's forward must "
                    f"depend on its inputs only, not on state its forward changes (a KV cache written to: pass "
                    f"use_cache=False; a counter or flag read in forward); or use activations.recompute=block. "
                    f"torch said: {e}") from e

    @contextlib.contextmanager
    def _recomputing(self):
        with self._counters.lock:
            self._counters.recomputations += 1
        with recomputation():
            yield

    # -- inspection ------------------------------------------------------------------

    def memory(self) -> CheckpointMemory:
        c = self._counters
        with c.lock:
            return CheckpointMemory(bytes=c.device + c.host, peak_bytes=c.peak, host_bytes=c.host,
                                    host_peak_bytes=c.host_peak,
                                    host_reserved_bytes=self.pool.reserved_bytes if self.pool else 0,
                                    recomputations=c.recomputations, saved_op_bytes=c.saved_ops)

    def reset_peak(self) -> None:
        c = self._counters
        with c.lock:
            c.peak, c.host_peak = c.device + c.host, c.host

    def remove(self) -> None:
        """Restore the blocks' forwards (checkpoints already taken are still honoured)."""
        for module, previous in self._installed:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._installed = []
        for hook in self._cache_hooks:
            hook.remove()
        self._cache_hooks = []
        self._model.__dict__.pop(_ATTR, None)

    def __repr__(self) -> str:
        return (f"ActivationCheckpointing(checkpoint_every={self.config.checkpoint_every}, "
                f"recompute='{self.config.recompute}', offload='{self.offload.config_name}', "
                f"checkpointed={self.checkpointed})")


def apply_activation_checkpointing(model: nn.Module, config: ActivationConfig,
                                   blocks: Iterable[str | nn.Module] | None = None,
                                   device: torch.device | str | None = None) -> ActivationCheckpointing:
    """Checkpoint every ``config.checkpoint_every``-th block of ``model`` in place (blocks 0,
    k, 2k, … of :func:`tiertrain.blocks.model_blocks`), holding the checkpoints in the tier
    ``config.offload`` names; call before ``tiertrain.wrap``. ``device``: where the model
    computes (decides whether CPU-tier buffers are pinned; default: pinned when CUDA is
    available). ``checkpoint_every=0`` checkpoints nothing. Returns the handle, also found
    later with :func:`checkpointing_of` / :func:`checkpoint_memory`."""
    if not isinstance(config, ActivationConfig):
        raise TypeError(f"config must be an ActivationConfig (Config.activations), got {type(config).__name__}")
    model = unwrap_compiled(model)  # (a compiled wrapper's module checkpointed, its forward compiled)
    k = config.checkpoint_every
    if isinstance(k, bool) or not isinstance(k, int):
        raise ConfigError(f"activations.checkpoint_every={k!r} is invalid: expected an int >= 0 "
                          f"(0 = off, k = every k-th block)")
    config.offload = parse_tier("activations.offload", config.offload, _OFFLOAD)
    config.validate()
    if _ATTR in model.__dict__:
        raise RuntimeError(f"activation checkpointing is already applied to this {type(model).__name__} "
                           f"({model.__dict__[_ATTR]!r}); call .remove() on that handle first")
    names = model_blocks(model, blocks)
    again = [n for n in names if isinstance(model.get_submodule(n).__dict__.get("forward"), _CheckpointedForward)]
    if again:
        raise RuntimeError(f"blocks {again} are already checkpointed (by an earlier apply_activation_checkpointing "
                           f"on a module that contains them); call .remove() on that handle first")
    if k > 0 and own_checkpoint_interval(model):
        raise ConfigError(f"activations.checkpoint_every={k}: this {type(model).__name__} checkpoints its layers "
                          f"already (transformers' gradient_checkpointing_enable / activation_checkpointing_enable): "
                          f"two checkpoints around each layer (with use_reentrant=True each recomputed twice); keep "
                          f"one: model.gradient_checkpointing_disable(), or activations.checkpoint_every=0")
    if k > len(names):
        shown = names if len(names) <= 4 else names[:2] + ["…"] + names[-1:]
        raise ConfigError(f"activations.checkpoint_every={k} is invalid: the model has {len(names)} "
                          f"block(s) ({', '.join(shown)}); expected 0 (off) or 1..{len(names)}")
    for name in names[::k] if k > 0 else []:
        compile_checkpointed_block(model, name)
    pin = pins_host_by_default() if device is None else pins_host(torch.device(device))
    handle = ActivationCheckpointing(model, config, names, pin)
    model.__dict__[_ATTR] = handle
    return handle


def checkpointing_of(model: nn.Module) -> ActivationCheckpointing | None:
    """The handle of the checkpointing applied to model, or None."""
    return model.__dict__.get(_ATTR)


def checkpoint_memory(model: nn.Module) -> CheckpointMemory:
    """Checkpoint bytes of the checkpointing applied to model or to any module inside it (a
    pipeline stage holding blocks of a checkpointed model, say), summed; all zero when there
    is none. The accessor for Engine.memory_report(), and what the estimator's
    infinity_activation_checkpoint_bytes predicts."""
    owners = {}
    handle = checkpointing_of(model)
    if handle is not None:
        owners[id(handle)] = handle
    for module in model.modules():
        forward = module.__dict__.get("forward")
        if isinstance(forward, _CheckpointedForward):
            owners.setdefault(id(forward.owner), forward.owner)
    total = CheckpointMemory()
    for owner in owners.values():
        for name, value in vars(owner.memory()).items():
            setattr(total, name, getattr(total, name) + value)
    return total
