"""The training core both engines are built on: ``tiertrain.Engine`` (one model:
tiertrain/engine.py) and ``tiertrain.pipeline.PipelineEngine`` (this rank's pipeline stages:
tiertrain/pipeline/engine.py) each add their way of running micro-batches to it, and neither
builds anything the other needs removed.

The core owns what an optimizer step and a checkpoint need, whatever ran the micro-batches:
the flat layout and buffers (zero/layout.py, zero/flat.py), gradient reduction
(zero/reducer.py), the overlapped parameter gather (zero/param_gather.py), the optimizer step
in one of its forms (update/: in memory, from NVMe, overlapped with backward, ZeRO-Offload's
delayed update; chosen once by update/factory.py), the learning-rate schedule (optim.py), loss
scaling (precision.py), the CPU/NVMe tiers (offload/), the counters and RNG (train_state.py),
step() with its clipping and fp16 skips, and checkpoints over stateful parts (the checkpoint
and export methods call the StateIO it is given: tiertrain/state/engine_io.py, which imports
the engines, never the reverse). The parts are built by tiertrain/engine_build.py, which adds
stage 3's one-model parameter fetcher (zero/stage3.py) only when the engine asks for it
(``one_model_fetcher``): a pipeline schedule interleaves the forwards and backwards of several
micro-batches, and its own fetcher (pipeline/zero3.py) gathers inside the schedule.
memory_report() is tiertrain/memory_report.py's, gathered_parameters() and full_state_dict()
tiertrain/gathered.py's; the StateIO is typed in tiertrain/engine_contract.py. What to build
and how to train is resolved once into the run plan (``engine.plan``: tiertrain/run_plan.py).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.nn as nn

from .comm import Collectives, CommCounter
from .config import Config, ConfigError
from .engine_build import build_parts
from .engine_contract import StateIO, Stateful
from .errors import parameters_named
from .gathered import gathered_parameters_of, rank_state_dict
from .held_gradients import HeldGradients
from .host_memory import retain_freed_host_memory
from .in_place_edits import refuse_in_place_edits
from .memory_report import MemoryReport, memory_report_of
from .model_changes import ModelAtWrap
from .module_load import ModuleLoad
from .optim import (ClientOptimizer, OptimizerArg, SchedulerFactory, client_optimizer, clip_coefficient,
                    scheduled_lr, squared_norm)
from .precision import compute_dtype
from .run_plan import RunPlan, resolve_run_plan
from .spans import span
from .topology import Topology
from .train_state import RNGState, TrainState
from .unit_values import MasterShards
from .update.factory import UpdateFactory
from .update.instance_view import guard as guard_optimizer_instances, refuse_other_optimizers
from .zero.accumulation import agreed_free_memory
from .zero.agreement import Event
from .zero.construct import check_no_partitioned_init
from .zero.flat import FrozenShards
from .zero.plan import GradientPlan
from .zero.reducer import check_dense_gradients
from .zero.released import let_go, mark_gathered
from .zero.stage3 import ParameterFetcher


class TrainingCore:
    """What both engines share; see the module docstring. An engine builds on it by calling
    this constructor with its module and gradient plan, then adds how micro-batches run (the
    one-model contract, or a pipeline schedule). plan: the gradient plan, a function of the
    number of ranks gradients are averaged over (dp × cp), made once the config is validated.
    one_model_fetcher: at stage 3, build the fetcher whose hooks gather each unit around its
    module in one forward and one backward (the one-model engine's). optimizer, param_groups,
    lr_scheduler: the user's own (tiertrain/optim.py client_optimizer); or client: them resolved
    already (a pipeline rank's share: optim.for_pipeline_rank)."""

    fetcher: ParameterFetcher | None
    """Stage 3's one-model parameter fetcher (engine_build.py adds it for tiertrain.Engine); None
    at stages 0-2 and in a pipeline engine."""

    def __init__(self, module: nn.Module, config: Config, topology: Topology,
                 plan: Callable[[int], GradientPlan], update_factory: UpdateFactory, *,
                 one_model_fetcher: bool, optimizer: OptimizerArg | None = None,
                 param_groups: list[dict] | None = None, lr_scheduler: SchedulerFactory | None = None,
                 state_io: StateIO | None = None, client: ClientOptimizer | None = None):
        config.validate()
        check_no_partitioned_init("tiertrain.wrap()")
        check_dense_gradients(module)
        if client is None:
            client = client_optimizer(module, config, optimizer, param_groups, lr_scheduler)
        if config.zero.retain_host_memory:
            retain_freed_host_memory()
        self.module = module
        self._at_wrap = ModelAtWrap.of(module)
        """The parameters as wrap() found them (what _check_model_unchanged compares with)."""
        self.config = config
        self.topology = topology
        self.dtype = compute_dtype(config.precision.dtype)
        self.device = topology.device
        self.stage = config.zero.stage  # (the user's int, for fingerprints; what it means: self.plan.stage)
        self.counter = CommCounter()
        # The ranks holding the same parameters: dp × cp (context-parallel ranks see other tokens
        # of the same samples, so for gradients and states they are data-parallel too).
        self.comm = Collectives(topology.group("dp_cp"), self.counter)
        # Tensor parallelism (tiertrain.parallel.apply_tensor_parallel before wrap): each tp
        # rank trains its own slice; ZeRO shards that slice over dp × cp.
        self.tp_comm = Collectives(topology.group("tp"))
        self.pp_comm = Collectives(topology.group("pp"))
        self.dp = self.comm.size
        """Ranks over which gradients are averaged and ZeRO partitions: dp × cp."""
        self.accum = config.batch.grad_accum_steps
        self.global_batch_size = config.batch.resolve(topology.size("dp"))  # (samples: cp ranks share theirs)

        self._on_close: list[Callable[[], None]] = []
        """What close() undoes, last registered first (hooks, tiers, what wrap() applied)."""
        self._closed = False
        self.state_io = state_io
        """Checkpoints and export (StateIO; tiertrain.wrap() gives tiertrain/state/engine_io.py)."""
        self._pending_save: Any = None
        self._checkpoint_group = None
        """A gloo group of every rank for background saves' checksum exchange (made at the first)."""
        self._own_run_id: str | None = None
        """The run id of this engine's saves when the caller gives none (made at the first)."""
        self.files_with_model: dict[str, bytes] = {}
        """Files written beside the model by every checkpoint (for the offline export) and by
        save_pretrained: a --model.hf run's tokenizer (models.hf.tokenizer_files), name → content."""
        gradient_plan = plan(self.dp)
        self._plan = resolve_run_plan(config, client, gradient_plan, dp_rank=self.comm.rank,
                                      tp_rank=topology.coord("tp"), tp_size=self.tp_comm.size,
                                      device=topology.device,
                                      free_device_bytes=lambda: agreed_free_memory(self.comm, topology.device))
        # layout, buffers, placement, swapper, flat, fetcher (if asked for), reducer, scaler, update
        build_parts(self, module, gradient_plan, update_factory, client, one_model_fetcher=one_model_fetcher)
        self.train_state = TrainState()
        self._slot_position: dict[tuple[int, int], int] | None = None  # (unit, slot) → flag index
        self._stepped_at = -1
        self._boundary_unstepped = False  # a backward ended an accumulation window; step() not called since
        self._warned_unstepped = False
        self.last_grad_norm = float("nan")
        fixed = not self.plan.stage.partitions_parameters  # (stage 3 gathers each unit anew)
        self._at_wrap.bound = [(n, p, p.dtype, p.device, p.data_ptr() if fixed else None)
                               for n, p in self.flat.params.items()]
        self.undo_on_close(self._at_wrap.watch())
        self.gathered_open = 0
        """gathered_parameters() contexts open (a model.load_state_dict() inside one loads the gathered copies)."""
        self.undo_on_close(ModuleLoad(self).attach(module))
        self.held_gradients = HeldGradients(self.flat.params)  # (.grad between backward and step)
        self.undo_on_close(lambda: self.held_gradients.remove(check=False))
        instances = client.instances if client is not None else ()
        self.undo_on_close(refuse_other_optimizers(self.flat.params, instances))
        if instances:  # (last: a failed build leaves them as they were)
            self.undo_on_close(guard_optimizer_instances(instances))

    @property
    def plan(self) -> RunPlan:
        """The ZeRO stage, stores, gradient facts and update form, resolved once (run_plan.py)."""
        return self._plan

    def train(self, mode: bool = True) -> "TrainingCore":
        """The model's training mode (dropout on), as nn.Module.train: what a loop written for a
        DeepSpeed engine or a DDP/FSDP-wrapped module calls on the wrapper."""
        self.module.train(mode)
        return self

    def eval(self) -> "TrainingCore":
        """The model's evaluation mode (dropout off), as nn.Module.eval."""
        return self.train(False)

    # -- counters ----------------------------------------------------------------------

    @property
    def steps(self) -> int:
        """Optimizer updates applied so far."""
        return self.train_state.steps

    @property
    def micro_steps(self) -> int:
        """Micro-batches run through backward so far."""
        return self.train_state.micro_steps

    @property
    def skipped_steps(self) -> int:
        """fp16 steps skipped on overflow."""
        return self.train_state.skipped_steps

    def learning_rate(self, step: int | None = None) -> float:
        """The rate of update number `step` (default: the next one), of the first param group:
        config.schedule's, or with a client optimizer or lr_scheduler the optimizer's own (then
        only the next update's rate is known)."""
        own = self.update.own_learning_rate()
        if own is None:
            return scheduled_lr(self.config.optimizer, self.config.schedule, self.steps if step is None else step)
        if step is not None and step != self.steps:
            raise ValueError(f"learning_rate(step={step}): with a client optimizer or lr_scheduler only the next "
                             f"update's rate (step {self.steps}) is known")
        return own

    @property
    def last_overlapped_step(self) -> dict | None:
        """Progress of the last NVMe step overlapped with backward when step() began: shards
        whose gradients were final, and chunks already updated (OverlappedStep.progress)."""
        return self.update.last_overlapped_step

    # -- settling and the optimizer step ---------------------------------------------

    def wait_for_parameters(self) -> None:
        """Complete the parameter all-gathers a step left running (zero.overlap_param_gather):
        call it before reading parameters outside the engine between step() and the next
        forward. The engine's own entry points, and the model's state_dict(), call it."""
        self.flat.wait_gathers()

    def quiesce(self) -> None:
        """Before reading or replacing the training state from outside (tiertrain.state.pretrained):
        cancel work the optimizer step began ahead of step() (an overlapped NVMe step), and
        complete the parameter all-gathers."""
        self._state_written()
        self.update.cancel()
        self.flat.wait_gathers()

    def _before_outside_forward(self) -> None:
        """The model is called outside the engine: it reads the newest parameters, as
        gathered_parameters() does."""
        self.quiesce()
        self.update.flush()

    def _check_model_unchanged(self) -> None:
        """Before a forward: what the model's owner may have changed behind the engine's back and
        would silently stop training (tiertrain/model_changes.py), refused by name."""
        self._at_wrap.check(self.module)

    def _state_written(self) -> None:
        """Before the training state changes: a background save has serialised it."""
        if self._pending_save is not None:
            self._pending_save.wait_serialized()

    unset_tensors = None
    """Tensors a meta-device build left without a value (a pipeline engine's, set by wrap():
    tiertrain/pipeline/materialize.py UnsetTensors, which load_pretrained fills); None: none.
    Training, evaluation and saves refuse while any rank holds one."""

    def _refuse_unset(self, operation: str) -> None:
        if self.unset_tensors is not None:
            self.unset_tensors.check(operation)

    @property
    def closed(self) -> bool:
        """Whether close() has handed the model back."""
        return self._closed

    @property
    def at_boundary(self) -> bool:
        return self.micro_steps % self.accum == 0 and self.micro_steps > 0

    def step(self) -> bool:
        """Update at an accumulation boundary; returns True when parameters changed
        (False between boundaries and for fp16 steps skipped on overflow).

        Megatron's optimizer protocol: the gradients are made ready here (reductions waited,
        fp16 unscaled, tensor-parallel partial sums, global norm, clip coefficient); the
        update form (tiertrain/update/) then steps with them."""
        self.held_gradients.remove()
        self._boundary_unstepped = False
        if not self.at_boundary or self.micro_steps == self._stepped_at:
            return False
        # Takes what the user set on their optimizer instance since the last update, and
        # refuses (before anything changes) what the engine's lr_scheduler owns.
        self.update.own_learning_rate()
        with span("step"):
            return self._step()

    def _step(self) -> bool:
        self._stepped_at = self.micro_steps
        self._state_written()  # (a background save reads the masters and moments this step changes)
        self.flat.wait_gathers()
        self.update.before_step()
        if self.fetcher is not None:
            self.fetcher.agree(Event.STEP)
        with span("step/reduce_wait"):
            self.reducer.wait()
        unused = self._unused_on_every_rank()
        if unused:
            self._check_unused_still_in_model(unused)
        self.flat.zero_stale_grads()
        self._sum_partial_grads_over_tp()
        grads = [u.grad for u in self.flat.units]
        if self.scaler.enabled:
            for g in grads:
                g.mul_(1.0 / self.scaler.scale)
        with span("step/grad_norm"):
            norm = self._global_grad_norm(grads)
            self.last_grad_norm = float(norm)
        if not torch.isfinite(norm):
            self.update.cancel()
            # A run whose gradients stay non-finite would skip forever (the loss scale stuck at
            # its minimum): stop it, naming the first bad gradient while it is still there. The
            # norm is global, so every rank skips, counts and raises at the same step.
            limit = self.config.precision.max_consecutive_skips
            stop = self.scaler.state.consecutive_skips + 1 >= limit
            if stop:
                from .precision import NonFiniteError, first_nonfinite
                culprit = first_nonfinite(self.flat, grads)
            self.flat.zero_grads(lazy=self.launch_when_ready)
            scale = self.scaler.scale
            self.scaler.update(overflow=True)
            self.train_state.skipped_steps += 1
            if stop:
                where = f"first non-finite gradient: {culprit}" if culprit else \
                    f"rank {self.topology.rank}'s gradient shard is finite, another rank's is not"
                raise NonFiniteError(
                    f"step {self.steps + self.skipped_steps}: {limit} consecutive steps skipped with a non-finite "
                    f"gradient norm ({self.last_grad_norm}) at loss scale {scale:g}; {where} "
                    f"(precision.max_consecutive_skips={limit}): the run has diverged; resume from an earlier "
                    f"checkpoint with a lower optimizer.lr, or check the data")
            return False
        clip = None
        if self.config.optimizer.grad_clip > 0:
            clip = clip_coefficient(norm, self.config.optimizer.grad_clip).to(self.placement.optimizer)
        if unused:
            self.update.leave_unchanged(unused)
        with span("step/update"):
            self.update.step(grads, clip, self.learning_rate(), self.steps)
        if self.fetcher is not None and self.update.publishes_in_step:
            self.fetcher.prefetch_next_forward()
        self.scaler.update(overflow=False)
        self.train_state.steps += 1
        return True

    def _unused_on_every_rank(self) -> frozenset[str]:
        """The parameters no data-parallel rank computed a gradient for since the last step
        (one small all-reduce of a flag per parameter). torch leaves a parameter whose .grad is
        None unchanged; the update must too, where the flat buffers hold zeros for it."""
        if self._slot_position is None:
            slots = [(u.unit.index, k) for u in self.flat.units for k in range(len(u.unit.slots))]
            self._slot_position = {slot: i for i, slot in enumerate(slots)}
        position = self._slot_position
        slots = list(position)
        flags = torch.zeros(len(slots), dtype=torch.int32, device=self.device)
        used = [position[slot] for slot in self.reducer.take_used()]
        if used:
            flags[torch.tensor(used, device=self.device)] = 1
        self.comm.all_reduce(flags, count=False)
        if bool(flags.all()):
            return frozenset()
        return frozenset(self.flat.units[index].unit.slots[k].name
                         for (index, k), flag in zip(slots, flags.tolist()) if not flag)

    def _check_unused_still_in_model(self, unused: frozenset[str]) -> None:
        """Parameters no rank computed a gradient for are usually idle (an expert no token
        reached); but a module replaced after wrap() leaves the engine's parameters out of the
        forward while the new module's train nothing (their gradients pile up in .grad):
        refused before the update, naming them."""
        present = {id(p) for p in self.module.parameters()}
        gone = sorted(n for n in unused if id(self.flat.params[n]) not in present)
        if gone:
            shown, one = parameters_named(gone)
            raise ConfigError(
                f"{shown} of the wrapped model {'is' if one else 'are'} no longer in "
                f"the model: {'its' if one else 'their'} module was replaced after wrap() (model.x = nn.Linear(...)), "
                f"so the new module's parameters are not the engine's and would never train. Change the model "
                f"before wrap(); after it, close() the engine (it hands the model back with the trained values) and "
                f"wrap the changed model")

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
        kept = self.update.grad_squares() if self._norm_grads is None else None
        if self._norm_grads is not None:
            grads = self._norm_grads or [torch.zeros(1, device=self.placement.optimizer)]
        # (An in-place NVMe step releases the gradient shards it consumed: their squares were
        # taken when each reduction landed, the same sums in the same order.)
        squares = torch.stack(kept if kept is not None else [squared_norm(g) for g in grads]).sum().to(self.device)
        sharded = () if self.plan.stage.replicates_states else (self.comm,)  # (stage 0: whole on each rank)
        for comm in sharded + (self.tp_comm, self.pp_comm):
            if comm.size > 1:
                comm.all_reduce(squares, count=False)
        return squares.sqrt()

    def wait_seconds(self) -> dict[str, float]:
        """Cumulative seconds the training thread blocked on the data-parallel collectives
        ("comm") and on swap-file reads and writes ("io"); tiertrain/waits.py."""
        io = self.swapper.waits.seconds if self.swapper is not None else 0.0
        return {"comm": self.counter.waits.seconds, "io": io}

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
        return memory_report_of(self)

    def gathered_parameters(self, params: Iterable[nn.Parameter] | None = None, modifier_rank: int | None = None):
        """Full parameters readable outside forward (every rank must enter). With
        modifier_rank set, that data-parallel rank's edits are broadcast and written back
        into every shard and master copy on exit (a context manager: tiertrain/gathered.py)."""
        return gathered_parameters_of(self, params, modifier_rank)

    # -- checkpoints -----------------------------------------------------------------

    def checkpoint_parts(self) -> dict[str, Stateful]:
        """The stateful parts a checkpoint is made of, in restore order: masters and optimizer
        (the update form), loss scaler, counters, RNG."""
        parts = {"update": self.update, "scaler": self.scaler, "train_state": self.train_state, "rng": RNGState(self.device)}
        if self.flat.frozen_units:
            parts["frozen"] = FrozenShards(self.flat)
        if self.buffers:
            parts["buffers"] = self.buffers
        return parts

    def named_modules_of_state(self) -> list[nn.Module]:
        """The modules whose parameter and buffer names are the model's (the pipeline engine's
        stages; here the model)."""
        return [self.module]

    def checkpoint_fingerprint(self) -> dict:
        """What a checkpoint of this rank must match to load here."""
        return self._state_io().fingerprint(self)

    def state_dict(self) -> dict:
        """This rank's training state: fp32 master shards, optimizer, scaler, counters, RNG."""
        self.quiesce()
        return self._state_io().rank_state(self.checkpoint_parts())

    def load_state_dict(self, state: dict) -> None:
        self.quiesce()
        self._state_io().restore_rank_state(self.checkpoint_parts(), state)

    def save_checkpoint(self, directory: str, extra: dict | None = None, keep_last: int = 0,
                        run_id: str | None = None, background: bool = False) -> str:
        """Collective: atomically save every rank's shard under directory/step_N (see
        tiertrain/state/checkpoint.py; the writing is tiertrain/state/engine_io.py's).
        keep_last: then delete all but the newest keep_last checkpoints of this run, the run
        being run_id (the training loop passes the id of the run it continues); by default this
        engine's own saves. Checkpoints of other runs are never deleted. A CheckpointError on
        every rank, before anything is written, when the fp32 masters hold inf or NaN.
        background: return at once, and serialise, write and commit the state on a thread while
        training goes on (checkpoint.async_save); the next optimizer step waits until the
        state is serialised (it changes it), the next save, a load and close() until it is
        committed, as does :meth:`wait_for_checkpoint`."""
        # (its gathers run on the world group and its barriers on a gloo group of its own: a rank
        # alone here, or a peer still training, must fail here, naming them)
        self._refuse_unset("save_checkpoint")
        self.comm.meet("save_checkpoint()")
        self.wait_for_checkpoint()
        self.quiesce()
        self.update.settle(collective=True)  # an update in flight is saved, not lost
        refuse_in_place_edits(self, MasterShards(self).shard, "save_checkpoint()")
        state_io = self._state_io()
        if run_id is None:
            import uuid

            # rank 0's id is the one written into the commit marker and compared by rotation
            run_id = self._own_run_id = self._own_run_id or uuid.uuid4().hex
        if self._checkpoint_group is None and self.topology.world_group() is not None:
            # (made at the first save of either kind, so that a background save does not pay for it)
            self._checkpoint_group = torch.distributed.new_group(backend="gloo")
        saved = state_io.save_checkpoint(self, directory, extra, keep_last, run_id, background,
                                         self._checkpoint_group)
        if not isinstance(saved, str):  # (a background save, committed by its thread)
            self._pending_save = saved
            return saved.step_dir
        return saved

    def wait_for_checkpoint(self) -> str | None:
        """Wait until a background save (save_checkpoint(background=True)) is committed;
        returns its directory (None when none was pending), or raises the CheckpointError
        that stopped it."""
        pending, self._pending_save = self._pending_save, None
        return None if pending is None else pending.wait()

    def tied_copies(self) -> dict[str, str]:
        """{parameter: the parameter it is kept equal to} among this rank's parameters (none in
        one model; a pipeline's last stage may hold a copy of the tied embedding)."""
        return {}

    def shard_description(self) -> dict:
        """This rank's shard layout as a checkpoint records it (tiertrain/state/shard_layout.py describe)."""
        return self._state_io().shard_description(self)

    def load_checkpoint(self, directory: str, step: int | None = None, reshard: bool = True) -> dict:
        """Collective: restore the newest intact committed checkpoint (all ranks the same one,
        checkpoint.agree_on_checkpoint), or the given step; returns the extras saved with it.
        A checkpoint saved at another layout (data-, tensor- or pipeline-parallel size, ZeRO
        stage, optimizer tier, unit sizes) is resharded to this run's (tiertrain/state/reshard.py);
        reshard=False refuses it instead."""
        self.enter_load("load_checkpoint()")
        return self._state_io().load_checkpoint(self, directory, step, reshard)

    def load_deepspeed_checkpoint(self, directory: str, tag: str | None = None) -> dict:
        """Collective: load a DeepSpeed ZeRO checkpoint (any stage, ranks; tag: ``directory/latest``'s
        by default), moments and step; returns its client state (state/deepspeed_checkpoint.py)."""
        self.enter_load("load_deepspeed_checkpoint()")
        return self._state_io().load_deepspeed_checkpoint(self, directory, tag)

    def load_dcp_checkpoint(self, path: str) -> dict:
        """Collective: load an FSDP2 run's DCP checkpoint, moments and step (state/dcp_checkpoint.py)."""
        self.enter_load("load_dcp_checkpoint()")
        return self._state_io().load_dcp_checkpoint(self, path)

    def enter_load(self, operation: str) -> None:
        """Collective: before operation replaces the state, meet the ranks and finish saves in flight."""
        self.comm.meet(operation)
        self.wait_for_checkpoint()
        self.quiesce()
        self._boundary_unstepped = False  # (the gradients of a window not stepped are not kept)

    def masters(self) -> list[torch.Tensor]:
        """This rank's fp32 master shard of every unit (read from NVMe when they live there)."""
        self.quiesce()
        return self.update.masters()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter's value in fp32, by name (collective), gathered from the shards:
        trained ones from their fp32 masters, frozen ones from their compute-dtype values; and
        the persistent buffers (floating ones in fp32). Under tp: this rank's slices."""
        return self._rank_state_dict()

    def _rank_state_dict(self, operation: str = "full_state_dict()", closing: bool = False) -> dict[str, torch.Tensor]:
        """full_state_dict of this rank's model (a pipeline rank's: its stages): gathered.py."""
        return rank_state_dict(self, operation, closing)

    def save_pretrained(self, directory: str, dtype: torch.dtype | str | None = None,
                        max_shard_bytes: int | None = None, peft=None) -> Any:
        """Collective: write the model as a Hugging Face safetensors checkpoint (config included),
        the ranks writing its files in parallel, one unit gathered at a time (ZeRO-Infinity §6).
        Values: the fp32 masters (frozen: their compute-dtype values), in dtype (None: fp32).
        max_shard_bytes: tensor bytes per file at most (default 5 GB). A peft.PeftModel needs
        peft=tiertrain.PeftExport.ADAPTER or .MERGED. Returns a tiertrain.ExportReport
        (tiertrain/state/export.py)."""
        state_io = self._state_io()
        self._refuse_unset("save_pretrained")
        self.comm.meet("save_pretrained()")
        self.quiesce()
        self.update.settle(collective=True)
        refuse_in_place_edits(self, MasterShards(self).shard, "save_pretrained()")
        return state_io.save_pretrained(self, directory, dtype=dtype, max_shard_bytes=max_shard_bytes, peft=peft)

    def _state_io(self) -> StateIO:
        """The StateIO this engine was built with (tiertrain.wrap() gives every engine one)."""
        if self.state_io is None:
            raise ConfigError("this engine was built without state I/O (Engine(..., state_io=None)), so it cannot "
                              "save, load or export state: build it with tiertrain.wrap(), which passes "
                              "tiertrain.state.engine_io")
        return self.state_io

    def undo_on_close(self, undo: Callable[[], None]) -> None:
        """Have close() call undo (after what was registered later): wrap() hands over what
        it applied to the model, e.g. activation checkpointing."""
        self._on_close.insert(0, undo)

    def close(self) -> None:
        """Collective: undo what wrap() did and leave the model a plain module holding the trained
        fp32 values. Finishes the update in flight (raising its error), cancels an overlapped
        NVMe step not yet committed, completes the gathers in flight, removes every hook, stops
        the update's thread, deletes swap files. Idempotent."""
        if self._closed:
            return
        self._closed = True
        errors, values = [], None
        try:
            self.wait_for_checkpoint()
        except BaseException as e:
            errors.append(e)
        try:
            self.quiesce()
            values = self._rank_state_dict("close()", closing=True)
        except BaseException as e:  # still undo everything, then raise the first error
            errors.append(e)
        for undo in reversed(self._on_close):
            try:
                undo()
            except BaseException as e:
                errors.append(e)
        if errors:
            raise errors[0]
        mark_gathered(self.flat.params.values())  # (plain parameters again: zero/released.py)
        let_go(self.flat.params.values())
        with torch.no_grad():
            for name, p in self.flat.params.items():
                p.data = values[name].to(self.frozen_dtypes.get(name, torch.float32))  # (module_dtypes.py)
