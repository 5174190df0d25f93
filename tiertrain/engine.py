"""The training engine: ``engine = tiertrain.wrap(model, config, topology)``, then
``loss = engine(batch)``, ``engine.backward(loss)``, ``engine.step()``.

The engine composes small parts and contains none of them: the flat layout and buffers
(zero/layout.py, zero/flat.py), gradient reduction (zero/reducer.py), stage-3 parameter
fetching (zero/stage3.py), AdamW and its schedule (optim.py) and loss scaling
(precision.py). Stage 0 is plain data parallelism, against which the ZeRO stages are
checked.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch
import torch.nn as nn

from . import checkpoint
from .comm import Collectives, CommCounter
from .config import Config, ConfigError
from .host_memory import retain_freed_host_memory
from .offload.activations import apply_activation_checkpointing, checkpoint_memory, checkpointing_of
from .optim import build_adamw, build_schedule, clip_coefficient, decays
from .precision import DynamicLossScaler, compute_dtype
from .topology import Topology
from .zero.construct import forget_partition, full_shape, gather_partitioned, is_partitioned
from .zero.flat import SWAP_BLOCK_BYTES, FlatParameters, Placement, swap_pool_bytes
from .zero.layout import FlatLayout, bucket_layout, module_layout
from .zero.param_gather import WaitForParameters
from .zero.reducer import GradientReducer
from .zero.stage3 import REDUCE, STEP, ParameterFetcher

LossFn = Callable[[nn.Module, Any], torch.Tensor]


@dataclass
class MemoryReport:
    """Bytes of model state held by this rank, by kind."""

    params: int
    gathered_params: int
    grads: int
    optimizer: int
    cpu_tier: int = 0
    """How many of the bytes above live in the CPU tier (offloaded)."""
    nvme_tier: int = 0
    """How many of the bytes above live in the NVMe tier (swap files)."""
    activation_checkpoints: int = 0
    """Peak bytes of activation checkpoints (saved block inputs) between a forward and its backward; not model state."""
    activation_checkpoints_cpu: int = 0
    """Of activation_checkpoints, the bytes held in the CPU tier (activations.offload=cpu)."""

    @property
    def total(self) -> int:
        return self.params + self.gathered_params + self.grads + self.optimizer


def default_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """Call the model on the batch (dict → keywords, tuple → positional) and find the loss."""
    if isinstance(batch, dict):
        out = model(**batch)
    elif isinstance(batch, (tuple, list)):
        out = model(*batch)
    else:
        out = model(batch)
    if isinstance(out, torch.Tensor):
        loss = out
    elif isinstance(out, dict) and "loss" in out:
        loss = out["loss"]
    elif getattr(out, "loss", None) is not None:
        loss = out.loss
    else:
        raise TypeError(f"the model returned {type(out).__name__} with no loss; pass loss_fn=... to wrap()")
    if loss.dim() != 0:
        raise TypeError(f"the loss must be a scalar, got shape {tuple(loss.shape)}; pass loss_fn=... to wrap()")
    return loss


def default_unit_modules(model: nn.Module) -> list[str]:
    """Stage-3 units: each child of every nn.ModuleList (transformer blocks), plus the root."""
    prefixes = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList):
            prefixes += [f"{name}.{child}" if name else child for child, _ in module.named_children()]
    return prefixes


class Engine:
    """Trains one model on one rank of the topology; see the module docstring."""

    def __init__(self, model: nn.Module, config: Config, topology: Topology,
                 loss_fn: LossFn | None = None, unit_modules: list[str] | None = None):
        config.validate()
        if config.zero.retain_host_memory:
            retain_freed_host_memory()
        if topology.size("pp") > 1 and self.launch_when_ready:
            raise ConfigError(f"parallel.pp={topology.size('pp')}: build the engine with tiertrain.wrap(), which "
                              f"returns a PipelineEngine for pp > 1 (Engine itself is valid only for pp=1)")
        self.module = model
        self.config = config
        self.topology = topology
        self.loss_fn = loss_fn or default_loss
        self.dtype = compute_dtype(config.precision.dtype)
        self.device = topology.device
        self.stage = stage = config.zero.stage
        self.counter = CommCounter()
        self.comm = Collectives(topology.group("dp"), self.counter)
        # Tensor parallelism (tiertrain.parallel.apply_tensor_parallel before wrap): each tp
        # rank trains its own slice; ZeRO shards that slice over dp.
        self.tp_comm = Collectives(topology.group("tp"))
        self.pp_comm = Collectives(topology.group("pp"))
        self.dp = self.comm.size
        self.accum = config.batch.grad_accum_steps
        self.global_batch_size = config.batch.resolve(self.dp)

        named = self._trainable_parameters(model)
        if not named:
            raise ValueError("the model has no trainable parameters")
        self._cast_buffers_and_frozen(model)
        self.layout = self._build_layout(model, named, unit_modules)
        self.placement = Placement(self.device, optimizer_tier=config.zero.offload_optimizer,
                                   param_tier=config.zero.offload_params)
        self.swapper = self._build_swapper() if "nvme" in (config.zero.offload_optimizer,
                                                           config.zero.offload_params) else None
        self.flat = FlatParameters(
            self.layout, dict(named), self.comm, self.dtype, keep_full_grads=stage <= 1,
            rebuild_param=lambda p: gather_partitioned(p, self.comm) if is_partitioned(p) else p.detach(),
            placement=self.placement, swapper=self.swapper)
        self._waits_per_operation = False
        if config.zero.overlap_param_gather:
            # Parameter gathers left running by a step are completed before model.state_dict()
            # hands out the parameters' storage, and before a forward called on the model
            # directly, not through the engine (which waits per operation).
            model.register_state_dict_pre_hook(lambda module, prefix, keep_vars: self.flat.wait_gathers())
            model.register_forward_pre_hook(lambda module, args: None if self._waits_per_operation
                                            else self.flat.wait_gathers())
        for _, p in named:
            forget_partition(p)  # the flat buffers own the shard now

        self.fetcher = None
        if stage == 3:
            modules = {u.index: (model if u.label == "<root>" else model.get_submodule(u.label))
                       for u in self.layout.units if not u.resident}
            self.fetcher = ParameterFetcher(
                self.flat, self.comm, modules, prefetch_bytes=int(self._prefetch_mb() * 2**20),
                max_live_bytes=int(config.zero.max_live_mb * 2**20), check=config.zero.stage3_check)
            # Backward completes blocks last-first, then the root (embeddings are used first
            # in forward, so their gradients come last), then the persistent small parameters.
            partitioned = [u.index for u in self.layout.units if not u.resident]
            resident = [u.index for u in self.layout.units if u.resident]
            launch_order = partitioned[1:][::-1] + partitioned[:1] + resident
        else:
            launch_order = list(range(len(self.layout.units)))
        self.reducer = GradientReducer(
            self.flat, self.comm, stage, launch_order,
            on_unit_done=self.fetcher.on_unit_grads_done if self.fetcher else None,
            before_collective=(lambda i: self.fetcher.agree(REDUCE, i)) if self.fetcher else None,
            launch_when_ready=self.launch_when_ready)

        self.nvme_optimizer = None
        self._overlapped_step = None
        """The NVMe optimizer step running during this boundary's backward (see backward())."""
        self.last_overlapped_step: dict | None = None
        """Progress of the last overlapped NVMe step when step() began: shards whose gradients
        were final, and chunks already updated, during backward (OverlappedStep.progress)."""
        if config.zero.offload_optimizer == "nvme":
            self.nvme_optimizer = self.optimizer = self._build_nvme_optimizer()
            # The schedule drives an optimizer; this one only carries the learning rate.
            self._lr_source = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=config.optimizer.lr)
            self.schedule = build_schedule(self._lr_source, config.schedule)
        else:
            self.optimizer = build_adamw(self._optimizer_groups(), config.optimizer)
            self.schedule = build_schedule(self.optimizer, config.schedule)
        self.scaler = DynamicLossScaler(config.precision.loss_scale, enabled=config.precision.dtype == "fp16")
        self.micro_steps = 0
        self.steps = 0
        self.skipped_steps = 0
        self._stepped_at = -1
        self.last_grad_norm = float("nan")
        self.delayed = None
        """zero.delayed_update: the one-step delayed CPU update (tiertrain/offload/delayed.py)."""
        if config.zero.delayed_update:
            from .offload.delayed import DelayedUpdate

            self.delayed = DelayedUpdate(self)

    launch_when_ready = True
    """Gradient reductions start as each unit's gradients arrive (False under pipeline
    parallelism, where the engine launches each chunk's units after its last backward)."""

    # -- construction ----------------------------------------------------------------

    def _trainable_parameters(self, model: nn.Module) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in model.named_parameters() if p.requires_grad]

    def _counts_in_norm(self, name: str) -> bool:
        """Whether this parameter's gradient counts in the global norm (a pipeline's copy
        of a tied weight does not: the embedding already counts it)."""
        return True

    def _cast_buffers_and_frozen(self, model: nn.Module) -> None:
        for module in model.modules():
            for name, buf in list(module.named_buffers(recurse=False)):
                dtype = self.dtype if buf.is_floating_point() else buf.dtype
                setattr(module, name, buf.to(device=self.device, dtype=dtype))
            for name, p in module.named_parameters(recurse=False):
                if not p.requires_grad:
                    p.data = p.data.to(device=self.device, dtype=self.dtype)

    def _build_swapper(self):
        """This rank's swap directory under zero.nvme_path, with a buffer pool large enough
        for the prefetch depth of ZeRO-Infinity (reads of 3 units ahead, in the half of the
        pool prefetches may hold) and as much again for writes."""
        from .offload import AlignedBufferPool, AsyncIO, TensorSwapper

        block = SWAP_BLOCK_BYTES
        largest = max(u.shard_numel for u in self.layout.units) * torch.finfo(self.dtype).bits // 8
        pin = self.device.type == "cuda"
        return TensorSwapper(self.config.zero.nvme_path, AsyncIO(num_threads=4, block_bytes=block),
                             AlignedBufferPool(swap_pool_bytes(largest), block, pin=pin), rank=self.topology.rank,
                             create=True)

    def _build_nvme_optimizer(self):
        """ZeRO-Infinity's optimizer step from NVMe (tiertrain.offload.NVMeAdamW): the fp32
        masters and Adam moments move to swap files, streamed through a few chunk buffers at
        each step; the RAM copies of the masters are dropped before the gradient shards are
        first touched."""
        from .offload import NVMeAdamW, pieces_from_param_groups

        zc = self.config.zero
        masters = [u.master for u in self.flat.units]
        groups = self._optimizer_groups()
        pieces = pieces_from_param_groups(masters, groups)
        del groups  # views of the masters: they must not outlive drop_masters()
        optimizer = NVMeAdamW(masters, pieces, self.config.optimizer, self.swapper, rank=self.topology.rank,
                              chunk_bytes=int(zc.nvme_chunk_mb * 2**20), num_buffers=zc.nvme_buffers)
        del masters
        self.flat.drop_masters()
        return optimizer

    def _prefetch_mb(self) -> float:
        """zero.prefetch_mb, or its default for this device. On CPU, gloo's collectives run on
        the same cores as the compute they would overlap: asynchronous prefetch measured 10%
        slower than none at stage 3 (bench/results/zero_interleaved.md); on CUDA the copy and
        communication engines run beside the compute, and prefetch hides them."""
        if self.config.zero.prefetch_mb is not None:
            return self.config.zero.prefetch_mb
        return 64.0 if self.device.type == "cuda" else 0.0

    def _build_layout(self, model: nn.Module, named, unit_modules) -> FlatLayout:
        zc = self.config.zero
        if self.stage == 3:
            prefixes = default_unit_modules(model) if unit_modules is None else list(unit_modules)
            for prefix in prefixes:
                model.get_submodule(prefix)  # raises AttributeError naming a bad prefix
            return module_layout(named, prefixes, self.dp, zc.persistence_threshold, shape_of=full_shape)
        if any(is_partitioned(p) for _, p in named):
            raise ConfigError(f"zero.stage={self.stage}: a model built under partitioned_init needs zero.stage=3")
        bucket_numel = max(1, int(zc.bucket_mb * 2**20) // 4)
        return bucket_layout(named, 1 if self.stage == 0 else self.dp, bucket_numel)

    def _optimizer_groups(self) -> list[dict]:
        """One AdamW tensor per piece of parameter inside this rank's master shard: views, so
        the update is in place on the flat master, and weight decay follows the parameter."""
        decay, no_decay = [], []
        self._partial_grads = []  # sequence-parallel partial gradients, summed over tp
        counted, all_counted = [], True
        tp_rank0 = self.topology.coord("tp") == 0
        for u in self.flat.units:
            for slot, a, b in u.unit.shard_pieces(self.flat.shard_rank):
                view = u.master[a:b]
                view.grad = u.grad[a:b]
                (decay if decays(slot.name, slot.shape) else no_decay).append(view)
                param = self.flat.params[slot.name]
                # Replicated parameters count once across tp (on tp rank 0), as in Megatron.
                if self._counts_in_norm(slot.name) and (tp_rank0 or getattr(param, "tp_sharded", False)):
                    counted.append(view.grad)
                else:
                    all_counted = False
                if getattr(param, "tp_partial_grad", False):
                    self._partial_grads.append(view.grad)
        self._norm_grads = None if all_counted else counted
        """Gradient pieces counted in the global norm; None: all of every unit's shard."""
        groups = [{"params": decay, "weight_decay": self.config.optimizer.weight_decay},
                  {"params": no_decay, "weight_decay": 0.0}]
        return [g for g in groups if g["params"]] or [{"params": [self.flat.units[0].master[:0]]}]

    # -- the training contract ---------------------------------------------------------

    def __call__(self, batch: Any) -> torch.Tensor:
        """Forward one micro-batch; returns the (unscaled) loss."""
        self._cancel_overlapped_step()  # (a forward before step() sees the parameters before it)
        if self.fetcher is not None:
            self.fetcher.begin_forward()
        batch = self._to_device(batch)
        if not self.flat.gathers_in_flight:
            return self.loss_fn(self.module, batch)
        # The step's parameter all-gathers are still running: each operation waits for the
        # units it touches (zero.overlap_param_gather; tiertrain/zero/param_gather.py).
        self._waits_per_operation = True
        try:
            with WaitForParameters(self.flat):
                loss = self.loss_fn(self.module, batch)
        finally:
            self._waits_per_operation = False
        self.flat.wait_gathers()  # units no operation touched
        return loss

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """Backward one micro-batch; gradients are reduced during backward (see reducer)."""
        self.flat.wait_gathers()
        boundary = (self.micro_steps + 1) % self.accum == 0
        if boundary and self.nvme_optimizer is not None and self._overlapped_step is None:
            if self._can_overlap_nvme_step():
                self._begin_overlapped_step()
            else:
                # The optimizer state's first chunks do not depend on this backward: reading
                # them now hides that read behind it instead of stalling the step (ZeRO-Infinity §6).
                self.nvme_optimizer.prefetch()
        self.reducer.begin(reduce_now=boundary)
        try:
            # 1/dp folded in here makes the reduced sum the data-parallel mean: no pass over the
            # reduced gradients divides them (exact for power-of-two dp, as the scale is).
            (loss.float() * (self.scaler.scale / (self.accum * self.dp))).backward()
        except BaseException:
            self._cancel_overlapped_step()
            raise
        self.reducer.end_backward()
        if self.fetcher is not None:
            self.fetcher.end_backward()
        self.micro_steps += 1

    def _can_overlap_nvme_step(self) -> bool:
        """Whether the NVMe optimizer may update each unit during backward, as soon as its
        gradient is reduced (tiertrain/offload/overlapped_step.py): only when nothing global —
        a clipping coefficient, an fp16 unscale, a tensor-parallel sum of partial gradients —
        changes the gradients between their reduction and the update."""
        return (self.config.zero.overlap_nvme_step and self.launch_when_ready
                and self.config.optimizer.grad_clip == 0 and not self.scaler.enabled
                and not (self.tp_comm.size > 1 and self._partial_grads))

    def _begin_overlapped_step(self) -> None:
        writer = self.flat.shard_writer()
        step = self.nvme_optimizer.begin_step([u.grad for u in self.flat.units], self.schedule.get_last_lr()[0],
                                              out=writer, shard_order=self.reducer.launch_order)
        self._overlapped_step = (step, writer)
        self.reducer.on_reduced = step.shard_ready

    def _end_overlapped_step(self, commit: bool) -> None:
        step, writer = self._overlapped_step
        self._overlapped_step = None
        self.reducer.on_reduced = None
        with writer:  # writes the last unit's shard to NVMe, after a cancel's restore too
            if commit:
                step.finish()
            else:
                step.cancel()

    def wait_for_parameters(self) -> None:
        """Complete the parameter all-gathers a step left running (zero.overlap_param_gather):
        call it before reading parameters outside the engine between step() and the next
        forward. The engine's own entry points, and the model's state_dict(), call it."""
        self.flat.wait_gathers()

    def _quiesce(self) -> None:
        """Before reading or replacing the training state: cancel an overlapped NVMe step not
        yet committed, and complete the parameter all-gathers in flight."""
        self._cancel_overlapped_step()
        self.flat.wait_gathers()

    def _cancel_overlapped_step(self) -> None:
        """Undo an overlapped step not yet committed: the parameters it published return to
        their pre-step values (the step is then run synchronously, if step() follows)."""
        if self._overlapped_step is not None:
            self._end_overlapped_step(commit=False)

    @property
    def at_boundary(self) -> bool:
        return self.micro_steps % self.accum == 0 and self.micro_steps > 0

    def step(self) -> bool:
        """Update at an accumulation boundary; returns True when parameters changed
        (False between boundaries and for fp16 steps skipped on overflow)."""
        if not self.at_boundary or self.micro_steps == self._stepped_at:
            return False
        self._stepped_at = self.micro_steps
        self.flat.wait_gathers()
        if self.nvme_optimizer is not None and self._overlapped_step is None:
            self.nvme_optimizer.prefetch()  # (no-op when backward started it; a state load drops it)
        if self.fetcher is not None:
            self.fetcher.agree(STEP)
        if self._overlapped_step is not None:
            self.last_overlapped_step = self._overlapped_step[0].progress()
        self.reducer.wait()
        self.flat.zero_stale_grads()
        self._sum_partial_grads_over_tp()
        grads = [u.grad for u in self.flat.units]
        if self.scaler.enabled:
            for g in grads:
                g.mul_(1.0 / self.scaler.scale)
        norm = self._global_grad_norm(grads)
        self.last_grad_norm = float(norm)
        if not torch.isfinite(norm):
            self._cancel_overlapped_step()
            self.flat.zero_grads(lazy=self.launch_when_ready)
            self.scaler.update(overflow=True)
            self.skipped_steps += 1
            return False
        coefficient = None
        if self.config.optimizer.grad_clip > 0:
            coefficient = clip_coefficient(norm, self.config.optimizer.grad_clip).to(self.placement.optimizer)
            if self.delayed is None:  # (the delayed update clips while copying to its snapshot)
                for g in grads:
                    g.mul_(coefficient)
        if self.delayed is not None:  # publishes the previous update, starts this one in the background
            self.delayed.step(grads, coefficient)
            self.scaler.update(overflow=False)
            self.steps += 1
            return True
        if self._overlapped_step is not None:  # most units were updated during backward
            self._end_overlapped_step(commit=True)
            self._lr_source.step()
        elif self.nvme_optimizer is not None:
            with self.flat.shard_writer() as updated_shards:
                self.nvme_optimizer.step(grads, self.schedule.get_last_lr()[0], out=updated_shards)
            self._lr_source.step()  # no gradients: only keeps the schedule's step-order check satisfied
        else:
            self.optimizer.step()
        self.schedule.step()
        self.flat.publish_masters(in_background=self.config.zero.overlap_param_gather)
        # The reducer overwrites each gradient at its next reduction: no pass zeroes them now.
        self.flat.zero_grads(lazy=self.launch_when_ready)
        if self.fetcher is not None:
            self.fetcher.prefetch_next_forward()
        self.scaler.update(overflow=False)
        self.steps += 1
        return True

    def _sum_partial_grads_over_tp(self) -> None:
        """Sequence parallelism leaves replicated parameters (LayerNorms, row biases) with
        partial gradients on each tp rank (Megatron-SP §4.2.2): sum them over tp. The
        pieces sit at the same offsets on every tp rank, so one all-reduce covers them."""
        if self.tp_comm.size == 1 or not self._partial_grads:
            return
        packed = torch.cat(self._partial_grads).to(self.device)
        self.tp_comm.all_reduce(packed, count=False)
        for g, part in zip(self._partial_grads, packed.split([g.numel() for g in self._partial_grads])):
            g.copy_(part)

    def _global_grad_norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The L2 norm of the whole model's gradient: this rank's squares, summed over the
        ZeRO shards (dp), the tensor-parallel slices (tp) and the pipeline stages (pp)."""
        if self._norm_grads is not None:
            grads = self._norm_grads or [torch.zeros(1, device=self.placement.optimizer)]
        squares = torch.stack([g.pow(2).sum() for g in grads]).sum().to(self.device)
        for comm in ((self.comm,) if self.stage > 0 else ()) + (self.tp_comm, self.pp_comm):
            if comm.size > 1:
                comm.all_reduce(squares, count=False)
        return squares.sqrt()

    def train_batch(self, batches: Iterator[Any]) -> float:
        """Run grad_accum_steps micro-batches from the iterator and one optimizer step;
        returns the mean loss of this rank's micro-batches."""
        total = 0.0
        for _ in range(self.accum):
            loss = self(next(batches))
            self.backward(loss)
            total += float(loss.detach())
        self.step()
        return total / self.accum

    def _to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            batch = batch.to(self.device, non_blocking=True)
            return batch.to(self.dtype) if batch.is_floating_point() else batch
        if isinstance(batch, dict):
            return {k: self._to_device(v) for k, v in batch.items()}
        if isinstance(batch, (list, tuple)):
            return type(batch)(self._to_device(v) for v in batch)
        return batch

    # -- inspection ----------------------------------------------------------------

    def memory_report(self) -> MemoryReport:
        """Bytes of parameters, gradients and optimizer state (fp32 master + Adam moments) on this rank."""
        flat = self.flat.memory()
        if self.delayed is not None:  # the gradient snapshot the background update reads
            self.delayed.wait(agree=False)  # (the first update creates the Adam moments)
            flat["grads"] += self.delayed.snapshot_bytes
            flat["cpu_tier"] += self.delayed.snapshot_bytes
        if self.nvme_optimizer is not None:  # masters and moments, all in swap files
            moments = self.nvme_optimizer.state_bytes
            flat["nvme_tier"] += moments
            host_moments = 0
        else:
            moments = sum(t.numel() * t.element_size() for state in self.optimizer.state.values()
                          for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0)
            host_moments = moments if self.placement.offload_optimizer else 0
        ckpt = checkpoint_memory(self.module)
        return MemoryReport(flat["params"], flat["gathered_params"], flat["grads"], flat["master"] + moments,
                            cpu_tier=flat["cpu_tier"] + host_moments, nvme_tier=flat["nvme_tier"],
                            activation_checkpoints=ckpt.peak_bytes, activation_checkpoints_cpu=ckpt.host_peak_bytes)

    @contextlib.contextmanager
    def gathered_parameters(self, params: Iterable[nn.Parameter] | None = None, modifier_rank: int | None = None):
        """Full parameters readable outside forward (every rank must enter). With
        modifier_rank set, that data-parallel rank's edits are broadcast and written back
        into every shard and master copy on exit."""
        self._quiesce()
        if self.delayed is not None:
            self.delayed.flush()  # what is read or edited is the newest parameters
        wanted = None if params is None else {self.flat.slot_of[p][0] for p in params}
        units = [u for u in self.flat.units if wanted is None or u.unit.index in wanted]
        for u in units:
            if self.fetcher is not None and not u.gathered:
                self.fetcher.fetch(u.unit.index)
            self.flat.gather(u.unit.index)
        try:
            yield
            if modifier_rank is not None:
                edited = [None] * len(self.flat.units)
                for u in units:
                    self.comm.broadcast(u.full, modifier_rank)
                    lo, hi = u.unit.shard_range(self.flat.shard_rank)
                    self.flat.write_shard(u.unit.index, u.full[lo:hi])
                    edited[u.unit.index] = u.full[lo:hi]
                if self.nvme_optimizer is not None:
                    self.nvme_optimizer.write_masters(edited)
        finally:
            for u in units:
                self.flat.release(u.unit.index)

    def state_dict(self) -> dict:
        """This rank's training state: fp32 master shards, optimizer, schedule, scaler, counters, RNG."""
        self._quiesce()
        return checkpoint.rank_state(self)

    def load_state_dict(self, state: dict) -> None:
        self._quiesce()
        checkpoint.restore_rank_state(self, state)

    def save_checkpoint(self, directory: str, extra: dict | None = None, keep_last: int = 0) -> str:
        """Collective: atomically save every rank's shard under directory/step_N (see checkpoint.py)."""
        self._quiesce()
        if self.delayed is not None:
            self.delayed.wait(agree=True)  # the update in flight is saved, not lost
        return checkpoint.save(self, directory, extra, keep_last)

    def load_checkpoint(self, directory: str, step: int | None = None) -> dict:
        """Collective: restore the newest committed checkpoint; returns the extras saved with it."""
        self._quiesce()
        return checkpoint.load(self, directory, step)

    def masters(self) -> list[torch.Tensor]:
        """This rank's fp32 master shard of every unit (read from NVMe when they live there)."""
        self._quiesce()
        if self.delayed is not None:
            self.delayed.wait(agree=False)
        if self.nvme_optimizer is not None:
            return self.nvme_optimizer.read_masters()
        return [u.master for u in self.flat.units]

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's fp32 master value, gathered from the shards (collective)."""
        out = {}
        if self.delayed is not None:
            self.delayed.wait(agree=True)
        masters = self.masters()
        for u, master in zip(self.flat.units, masters):
            full = torch.empty(u.unit.padded_numel, dtype=torch.float32, device=self.device)
            if self.stage == 0:
                full.copy_(master)
            else:
                self.comm.all_gather(full, master.to(self.device))
            for slot in u.unit.slots:
                out[slot.name] = full[slot.offset:slot.end].view(slot.shape).clone()
        return out

    def close(self) -> None:
        """Finish the delayed update in flight, if any (raising its error), and stop its thread;
        cancel an overlapped NVMe step not yet committed; complete the parameter gathers in flight."""
        self._quiesce()
        if self.delayed is not None:
            self.delayed.close()


def wrap(model: nn.Module | Sequence[nn.Module], config: Config, topology: Topology, loss_fn: LossFn | None = None,
         unit_modules: list[str] | None = None,
         activation_shape: tuple[int, ...] | Callable[[Any], tuple[int, ...]] | None = None) -> Engine:
    """Wrap any nn.Module for training under config on topology (no model changes needed).

    loss_fn(model, batch) → scalar loss; by default the model is called on the batch and
    its output (a tensor, a dict with 'loss', or an object with .loss) gives the loss.
    unit_modules: stage-3 gather units by module name (default: children of ModuleLists).

    With parallel.pp > 1 this returns a :class:`~tiertrain.pipeline.engine.PipelineEngine`:
    model is a tiertrain GPT (split into stages here) or this rank's list of stage modules,
    each called as stage(x, batch); activation_shape is the shape of the tensor passed
    between stages for a micro-batch (known for GPT stages), or a function of the batch.
    With activations.checkpoint_every = k > 0, every k-th block (children of ModuleLists)
    recomputes its activations in backward (tiertrain.offload.activations); apply it
    yourself before wrap() to choose other blocks.
    """
    if (config.activations.checkpoint_every > 0 and isinstance(model, nn.Module)
            and checkpointing_of(model) is None):
        # Before any pipeline split: the stages reuse the model's (now checkpointed) blocks.
        apply_activation_checkpointing(model, config.activations, device=topology.device)
    if topology.size("pp") > 1:
        from .pipeline.engine import PipelineEngine, pipeline_stages

        if loss_fn is not None or unit_modules is not None:
            raise ConfigError(f"parallel.pp={topology.size('pp')}: loss_fn and unit_modules do not apply to a "
                              f"pipeline (the last stage returns the loss; zero.stage 3 is not pipelined)")
        stages = pipeline_stages(model, topology, config.parallel.virtual_stages)
        return PipelineEngine(stages, config, topology, activation_shape=activation_shape)
    if activation_shape is not None:
        raise ConfigError("activation_shape is for pipeline parallelism; parallel.pp is 1")
    return Engine(model, config, topology, loss_fn=loss_fn, unit_modules=unit_modules)
