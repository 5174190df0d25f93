"""The training engine: ``engine = tiertrain.wrap(model, config, topology)``, then
``loss = engine(batch)``, ``engine.backward(loss)``, ``engine.step()``.

The engine is the one-model training contract (forward, backward, evaluate, train_batch)
over the training core (tiertrain/training_core.py), which owns the flat buffers, the
gradient reducer, the optimizer-step form, the loss scaler, step() and the checkpoint and
export methods. What is the engine's own: the loss function (tiertrain/engine_contract.py),
the stage-3 parameter fetcher around one forward and one backward per micro-batch
(zero/stage3.py; built by tiertrain/engine_build.py when this engine asks for it), and the
order of the work around a micro-batch (the update form cancelled or told of the backward,
the reducer begun with the unused parameters, 1/dp folded into the loss). Stage 0 is plain
data parallelism, against which the ZeRO stages are checked. The pipeline engine
(tiertrain/pipeline/engine.py) is built on the same core, not on this class.
"""
from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch
import torch.nn as nn

from .collective_order import CollectiveMismatchError, CollectiveTimeout, PeerLost
from .config import Config, ConfigError
from .engine_contract import LossFn, StateIO, default_loss
from .in_place_edits import refuse_in_place_edits
from .label_conventions import BATCHES_CHECKED, check_batch_labels
from .optim import OptimizerArg, SchedulerFactory
from .precision import note_kept_buffers
from .spans import span
from .topology import Topology
from .training_core import TrainingCore
from .unit_values import MasterShards
from .update.factory import UpdateFactory, build_update
from .zero.param_gather import WaitForParameters
from .zero.plan import GradientPlan, default_plan
from .zero.reducer import unused_parameters

__all__ = ["Engine", "default_loss"]


class Engine(TrainingCore):
    """Trains one model on one rank of the topology; see the module docstring. plan: the
    gradient plan (see GradientPlan); by default :func:`default_plan`. update_factory:
    builds the optimizer-step form (tiertrain/update/); by default the configured one.
    optimizer, param_groups, lr_scheduler: the user's own (tiertrain/optim.py
    client_optimizer); by default AdamW and the schedule of config."""

    def __init__(self, model: nn.Module, config: Config, topology: Topology,
                 loss_fn: LossFn | None = None, unit_modules: list[str] | None = None,
                 plan: GradientPlan | None = None, update_factory: UpdateFactory = build_update,
                 optimizer: OptimizerArg | None = None, param_groups: list[dict] | None = None,
                 lr_scheduler: SchedulerFactory | None = None, state_io: StateIO | None = None):
        if topology.size("pp") > 1 and plan is None:
            raise ConfigError(f"parallel.pp={topology.size('pp')}: build the engine with tiertrain.wrap(), which "
                              f"returns a PipelineEngine for pp > 1 (Engine itself is valid only for pp=1)")
        self.loss_fn = loss_fn or default_loss
        self._label_checks_left = BATCHES_CHECKED if self.loss_fn is default_loss else 0
        """Batches whose labels are still to be checked against the model's convention (on the
        host, before they move: label_conventions.py); a loss of the user's own reads them its way."""
        self._edits_checked = False
        """The first forward compared the compute copies with the masters (in_place_edits.py)."""
        self._forward_unbacked = False
        """The last forward ran with gradients and no backward has come since: at the next
        forward that pass counts as dropped (Collectives.drop_pass), as a failed one does, so
        that ranks which all skip a pass (one failed, the others chose to skip it) go on."""
        super().__init__(model, config, topology, lambda dp: plan or default_plan(model, config, dp, unit_modules),
                         update_factory, one_model_fetcher=True, optimizer=optimizer, param_groups=param_groups,
                         lr_scheduler=lr_scheduler, state_io=state_io)

    # -- the training contract ---------------------------------------------------------

    def __call__(self, batch: Any) -> torch.Tensor:
        """Forward one micro-batch; returns the (unscaled) loss."""
        with span("forward"):
            self.update.cancel()  # (a forward before step() sees the parameters before it)
            if self._forward_unbacked:  # (a loop that skipped the pass on this rank because a peer's failed)
                self.comm.drop_pass(f"its forward of micro-batch {self.micro_steps + 1} had no backward")
            if self.fetcher is not None:
                self.fetcher.begin_forward()
            try:
                loss = self._forward(batch)
                self._forward_unbacked = torch.is_grad_enabled()
                return loss
            except BaseException as failure:
                if self._recoverable(failure):  # (caught, it leaves nothing gathered: the next forward starts afresh)
                    if self.fetcher is not None:
                        self.fetcher.abandon()
                    self.comm.drop_pass(f"its forward of micro-batch {self.micro_steps + 1} raised "
                                        f"{type(failure).__name__}")
                raise
            finally:
                if self.fetcher is not None:
                    self.fetcher.end_forward()  # (the model called directly from now on: ParameterFetcher)

    def _forward(self, batch: Any) -> torch.Tensor:
        self._check_model_unchanged()
        if self.micro_steps == 0 and not self._edits_checked:
            # (an init or a copy applied after wrap(): in_place_edits.py; later, the saves check)
            self._edits_checked = True
            if not self.flat.masters_elsewhere:  # (NVMe masters: read at the saves only)
                refuse_in_place_edits(self, MasterShards(self).shard, "the first step")
        if self._label_checks_left:
            self._label_checks_left -= 1
            check_batch_labels(self.module, batch)
        batch = self._to_device(batch)
        if self.buffers and self.module.training and self.config.zero.broadcast_buffers and self.comm.size > 1:
            self.buffers.broadcast(self.comm)  # (DDP's broadcast_buffers)
        try:
            return self._loss(batch)
        except RuntimeError as e:
            note_kept_buffers(e, self.derived_buffers_kept, self.dtype)
            raise

    def _loss(self, batch: Any) -> torch.Tensor:
        check = self.fetcher.use_check() if self.fetcher is not None else None
        if check is None and not self.flat.gathers_in_flight:
            return self.loss_fn(self.module, batch)
        with contextlib.ExitStack() as context:
            if check is not None:  # stage 3's first forward: no parameter read outside its unit
                context.enter_context(check)
                # Run it eagerly: a compiled block would trace the check and compile again
                # without it on the next step (docs/compile.md).
                context.enter_context(torch.compiler.set_stance("force_eager"))
            if self.flat.gathers_in_flight:
                # The step's parameter all-gathers are still running: each operation waits for
                # the units it touches (zero.overlap_param_gather; tiertrain/zero/param_gather.py).
                self._waits_per_operation = True
                context.callback(setattr, self, "_waits_per_operation", False)
                context.enter_context(WaitForParameters(self.flat))
            loss = self.loss_fn(self.module, batch)
        self.flat.wait_gathers()  # units no operation touched
        return loss

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """Backward one micro-batch; gradients are reduced during backward (see reducer). The
        step applies the mean over the ranks and the window's micro-batches of each loss's
        gradient (for a token mean over unevenly labelled micro-batches: docs/api.md)."""
        with span("backward"):
            self._backward(loss)

    def _backward(self, loss: torch.Tensor) -> None:
        if self._boundary_unstepped and not self._warned_unstepped:
            # A warning, not an error: several losses' backwards before one step add up on purpose.
            self._warned_unstepped = True
            warnings.warn(
                f"engine.backward() after a backward that ended an accumulation window (batch.grad_accum_steps="
                f"{self.accum}: micro-batch {self.micro_steps} ended it) without engine.step() since: the "
                f"gradients add up until engine.step() (as several losses' backwards before one step do); if the "
                f"loop meant to update, call engine.step() after each engine.backward(). Warned once",
                RuntimeWarning, stacklevel=3)
        self._forward_unbacked = False
        self.held_gradients.remove()  # (autograd would add into them)
        self.flat.wait_gathers()
        boundary = (self.micro_steps + 1) % self.accum == 0
        self.update.before_backward(boundary, self.learning_rate())
        # Stage 3 interleaves gathers with reductions, so a unit must complete at the same point
        # of backward on every rank, also where this rank's data leaves a parameter unused (an
        # expert no token was routed to): such parameters are found in the graph now.
        absent = unused_parameters(loss, self.flat.slot_of) if self.plan.stage.partitions_parameters else ()
        self.reducer.begin(reduce_now=boundary, absent=absent)
        if self.fetcher is not None:
            self.fetcher.backward_reduces = self.reducer.reduce_now
        try:
            # 1/dp folded in here makes the reduced sum the data-parallel mean: no pass over the
            # reduced gradients divides them (exact for power-of-two dp, as the scale is).
            (loss.float() * (self.scaler.scale / (self.accum * self.dp))).backward()
        except BaseException as failure:
            self.update.cancel()
            self._abandon_window(failure)
            raise
        self.reducer.end_backward()
        if self.fetcher is not None:
            self.fetcher.end_backward()
        self.train_state.micro_steps += 1
        self._boundary_unstepped = boundary
        self.held_gradients.install()  # (p.grad read before step() raises naming it: held_gradients.py)

    def _recoverable(self, failure: BaseException) -> bool:
        """Whether the ranks may still be in step after this failure of a pass: not when it was
        the collectives' own (a mismatch, a timeout, a lost peer) or left this rank out of step:
        then there is nothing to recover, and waiting for its collectives in flight could hang."""
        return self.comm.broken is None and not isinstance(failure, (CollectiveMismatchError, CollectiveTimeout,
                                                                     PeerLost))

    def _abandon_window(self, failure: BaseException) -> None:
        """A backward raised midway (caught, a loop may go on: an out-of-memory batch skipped).
        Part of its gradients may have been reduced into the window's: none may reach a step,
        and they cannot be told apart from the earlier micro-batches', so the accumulation
        window is dropped whole and starts again (the exception says so where it held more)."""
        if not self._recoverable(failure):
            return
        self.reducer.abandon()  # (its collectives in flight, issued before the pass was dropped)
        self.flat.zero_grads(lazy=self.launch_when_ready)
        if self.fetcher is not None:
            self.fetcher.abandon()
        self.comm.drop_pass(f"its backward of micro-batch {self.micro_steps + 1} raised {type(failure).__name__}")
        done = self.micro_steps % self.accum
        self.train_state.micro_steps -= done
        if done:
            failure.add_note(f"tiertrain: the accumulation window's gradients were dropped with this backward's (its "
                             f"{done} earlier micro-batch(es) too: a failed backward's partial gradients cannot be "
                             f"told apart from theirs); the window starts again at its first micro-batch")

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

    def evaluate(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch with the model in eval mode (dropout off) and no
        autograd graph, parameters unchanged. Call it between optimizer steps. At stage 3
        each unit is gathered and released as in a training forward, so every data-parallel
        rank must evaluate the same number of batches (the gathers are collectives)."""
        if self.micro_steps % self.accum:
            raise RuntimeError(f"evaluate() inside an accumulation window ({self.micro_steps % self.accum} of "
                               f"{self.accum} micro-batches run): call it after step()")
        was_training = self.module.training
        self.module.eval()
        try:
            with torch.no_grad():
                return self(batch).detach()
        finally:
            self.module.train(was_training)

