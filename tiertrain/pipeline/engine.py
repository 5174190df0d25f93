"""The engine under pipeline parallelism: Megatron PTD-P (§2 pipeline, §3 tensor, data
parallelism) with ZeRO stages 0-3 over each stage's data-parallel replicas.

``tiertrain.wrap`` returns a :class:`PipelineEngine` when ``parallel.pp > 1``. It trains the
pipeline stages this rank holds (``v = parallel.virtual_stages`` chunks, global stages
``r, r+p, …``) with the schedule ``parallel.schedule`` over ``grad_accum_steps``
micro-batches per step, on the training core the one-model engine is built on
(tiertrain/training_core.py):

* **Gradients** of every micro-batch are added, in fp32, into the flat buffers of the
  chunk's ZeRO units (reducer hooks, ``launch_when_ready=False``). When a chunk's last
  backward of the step is over, the executor calls back and that chunk's units are
  reduced over dp at once (all-reduce at stage 0, reduce-scatter at stages 1-3), while the
  pipeline goes on with the other chunks' work. Stage 2 reduce-scatters each bucket once
  per step and frees it, so between steps only the gradient shard persists. DeepSpeed
  refuses pipeline + ZeRO-2 because its ZeRO-2 reduces at every micro-batch backward
  (``m`` times the traffic); accumulating a step's micro-batches first avoids that.
* **Tied embeddings**: the first stage's embedding and the last stage's head copy (see
  :mod:`.stage`) exchange their accumulated fp32 gradients in the flat buffers
  (:func:`~.stage.sum_tied_gradients`) before their units are reduced; both copies then
  get the same update and stay equal. The copy is left out of the gradient norm.
* **Gradient norm and overflow**: squares summed over dp shards, tp slices and pp stages,
  so clipping and fp16 overflow skips agree on every rank.
* **Buffers** (BatchNorm's running statistics; :mod:`tiertrain.buffers`) of each stage are
  broadcast from the stage's data-parallel rank 0 once per step, before the first
  micro-batch's forward (``zero.broadcast_buffers``), so the dp ranks of a stage start every
  step from the same values; each rank's are checkpointed, and full_state_dict holds every
  stage's.
* **Checkpoints** are saved per rank; loading checks each rank's own layout.
* **Evaluation** (:meth:`PipelineEngine.evaluate_each`) runs the forward-only schedule
  (:func:`.schedule.forward_only`) with the stages in eval mode and no autograd graph; the
  last stage's loss of each micro-batch is broadcast to every pipeline rank.
* **Context parallelism** (parallel.cp > 1, issue 38): a model converted by
  ``apply_context_parallel`` is cut as usual; each stage runs its blocks' ring or Ulysses
  attention over its cp group on this rank's share of every sequence (:mod:`.stage`,
  :mod:`.hf_context`), and what travels between stages is that share, to the rank of the same
  (dp, cp, tp) coordinates (the pp group). The last stage's loss is this rank's share of the
  exact token mean over the cp group; gradients are averaged and ZeRO-partitioned over the
  dp × cp ranks (``dp_cp``), which hold the same parameters.
* **ZeRO stage 3** (:mod:`.zero3`): each chunk is laid out as a stage-3 model of its own,
  one partitioned unit per block plus one for the chunk's embeddings/norm/head, so every
  data-parallel rank of a stage holds 1/dp of the stage's parameters between uses, on the
  parameter tier (device, CPU or NVMe). Inside the schedule a block is gathered for each
  micro-batch's forward and again for its backward, and released after each (per block, not
  per chunk); gradients follow stage 2's path above (accumulated over the step's
  micro-batches, reduce-scattered once per chunk). Frozen parameters stay whole.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn as nn

from ..collective_order import CollectiveMismatchError
from ..config import Config, ConfigError
from ..engine_contract import StateIO
from ..optim import ClientOptimizer, for_pipeline_rank
from ..models.gpt import GPT
from ..topology import Topology
from ..training_core import TrainingCore
from ..update.factory import UpdateFactory, build_update
from ..zero.layout import bucket_layout, concatenate
from ..zero.plan import GradientPlan
from ..zero.stages import ZeroStage
from .executor import PipelineExecutor
from .schedule import gpipe, interleaved_one_f_one_b, one_f_one_b
from .zero3 import PipelineFetcher, Stage3Executor, stage3_plan
from .stage import TIED_FIRST, TIED_LAST, split_gpt, stages_for_rank, sum_tied_gradients

_USE_TRAIN_BATCH = ("with parallel.pp > 1 use engine.train_batch(micro_batches): a pipeline schedule "
                    "interleaves the forward and backward of several micro-batches")

SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_one_f_one_b}
"""parallel.schedule → the function building that schedule for (p, m, v)."""


def pipeline_stages(model: nn.Module | Sequence[nn.Module], topology: Topology, virtual_stages: int = 1,
                    balance: str = "layers", split: list[list[str]] | None = None) -> list[nn.Module]:
    """This rank's stage modules: a tiertrain GPT (or its tensor-parallel form) or a Hugging Face
    model (:mod:`.hf_split`: the rotary decoders of PIPELINE_DECODERS, GPT-2, T5, BERT/RoBERTa MLM; also after
    a tensor-parallel plan) is split into ``pp × virtual_stages`` stages and this rank keeps
    stages ``r, r+p, …``; a list is taken as this rank's stages
    already (each called as ``stage(x, batch)``, see :mod:`.stage`). ``balance``: "layers" or
    "params"; ``split`` (models other than tiertrain's GPT): one list of module names per
    stage, all ``pp × virtual_stages`` of them, in model order (see :mod:`.hf_split`)."""
    p = topology.size("pp")
    if isinstance(model, (list, tuple, nn.ModuleList)):
        stages = list(model)
        if len(stages) != virtual_stages:
            raise ConfigError(f"parallel.virtual_stages={virtual_stages} but {len(stages)} stage modules were "
                              f"given for this rank; give one module per virtual stage")
        return stages
    if isinstance(model, GPT):
        if split is not None:
            raise ValueError("pipeline_stages: split= is for other models; a tiertrain GPT is cut by balance=")
        return stages_for_rank(split_gpt(model, p * virtual_stages, balance), p, topology.coord("pp"))
    if isinstance(model, nn.Module):
        from .hf_split import split_hf  # (a ValueError naming what was found when not recognised)
        return stages_for_rank(split_hf(model, p * virtual_stages, balance, split), p, topology.coord("pp"))
    raise TypeError(f"parallel.pp={p}: wrap() needs this rank's pipeline stages, a list of modules called as "
                    f"stage(x, batch) (see tiertrain.pipeline.stage), a tiertrain GPT or a Hugging Face model "
                    f"to split; got {type(model).__name__}")


def tied_names(stage: nn.Module) -> tuple[str, str]:
    """(the first stage's tied weight, its copy on the last stage), by parameter name within the
    stages: a GPT's ``embed.weight``/``head.weight``, a Hugging Face model's own names."""
    return getattr(stage, "tied_names", None) or (TIED_FIRST, TIED_LAST)


def gpt_activation_shape(stage: nn.Module) -> Callable[[dict], tuple[int, ...]]:
    """The activation a GPT stage sends for a micro-batch: [batch, seq, hidden], with the
    sequence split over tp under sequence parallelism, over cp under context parallelism
    (this rank's share of the tokens, sent to the next stage's rank of the same cp coordinate)."""
    hidden = stage.config.hidden
    tp = torch.distributed.get_world_size(stage.tp_group) if stage.sequence_parallel else 1
    cp = getattr(stage, "cp_size", 1)

    def shape(batch: dict) -> tuple[int, ...]:
        b, t = batch["input_ids"].shape
        return (b, t // (tp * cp), hidden)
    return shape


def pipeline_plan(stages: Sequence[nn.Module], config: Config, dp: int) -> tuple[GradientPlan, list[list[int]]]:
    """What differs from the one-model engine: the stages' own parameter names (the model's:
    ``blocks.5.mlp.fc1.weight``); buckets per chunk (one never spans two chunks), so a chunk's
    units can be reduced as soon as its backward is over; reductions launched by the schedule
    (``launch_when_ready=False``); the last stage's copy of a tied embedding left out of the
    gradient norm (the first stage's embedding already counts it). Also returns, per chunk,
    the indices of its flat units (in layout order, chunk after chunk)."""
    named, seen = [], {}
    for k, stage in enumerate(stages):
        for name, p in stage.named_parameters():
            if name in seen:
                raise ValueError(f"parameter name {name!r} appears in local stages {seen[name]} and {k}; "
                                 f"stages of one rank must hold distinct parameters")
            seen[name] = k
            if p.requires_grad:
                named.append((name, p))
    if not named:
        raise ValueError("the model has no trainable parameters")
    bucket_numel = max(1, int(config.zero.bucket_mb * 2**20) // 4)
    shards = ZeroStage.of(config).shards_over(dp)
    layouts = [bucket_layout([(n, p) for n, p in s.named_parameters() if p.requires_grad], shards, bucket_numel)
               for s in stages]
    units_of_chunk, start = [], 0
    for layout in layouts:
        units_of_chunk.append(list(range(start, start + len(layout.units))))
        start += len(layout.units)
    copies = {tied_names(s)[1] for s in stages if getattr(s, "tied", False) and s.is_last and not s.is_first}
    plan = GradientPlan(named, concatenate(layouts, [f"chunk{k}" for k in range(len(stages))]),
                        launch_when_ready=False,
                        counts_in_norm=lambda name: name not in copies)
    return plan, units_of_chunk


class PipelineEngine(TrainingCore):
    """Trains this rank's pipeline stages; see the module docstring. client: the user's
    optimizer, groups and schedule resolved against the whole model (wrap() does it), of
    which this rank trains its stages' share (optim.for_pipeline_rank). Use :meth:`train_batch`
    (a schedule interleaves the forward and backward of several micro-batches, so there is
    no separate forward/backward call). Built on the training core (tiertrain/training_core.py)
    as tiertrain.Engine is, with the schedule's executor in place of the one-model contract:
    the core builds no one-model parameter fetcher here, and the reducer reports to none."""

    def __init__(self, stages: Sequence[nn.Module], config: Config, topology: Topology,
                 activation_shape: tuple[int, ...] | Callable[[dict], tuple[int, ...]] | None = None,
                 timeout: float | None = None, update_factory: UpdateFactory = build_update,
                 state_io: StateIO | None = None, client: ClientOptimizer | None = None):
        self.stages = list(stages)
        self._tied_stages = [s for s in self.stages if getattr(s, "tied", False)]
        chunk_modules = None
        # Stage 3: per-block units inside each chunk, gathered by zero3.PipelineFetcher.
        if ZeroStage.of(config).partitions_parameters:
            copies = set(self.tied_copies())
            plan, self._units_of_chunk, chunk_modules = stage3_plan(
                self.stages, config, topology.size("dp_cp"), counts_in_norm=lambda name: name not in copies)
        else:
            plan, self._units_of_chunk = pipeline_plan(self.stages, config, topology.size("dp_cp"))
        if client is not None:
            held = {name for stage in self.stages for name, _ in stage.named_parameters()}
            client = for_pipeline_rank(client, held, self.tied_copies())
        super().__init__(nn.ModuleList(self.stages), config, topology, lambda dp: plan, update_factory,
                         one_model_fetcher=False, state_io=state_io, client=client)
        self._schedule_failed: str | None = None
        """Why this engine refuses to train: its schedule raised midway (_refuse_after_failure)."""
        self.pipeline_fetcher: PipelineFetcher | None = None
        """Stage 3: gathers and releases each chunk's units inside the schedule (.zero3)."""
        if chunk_modules is not None:
            self.pipeline_fetcher = PipelineFetcher(self.flat, self.stages, chunk_modules)
            self._on_close.append(self.pipeline_fetcher.remove)
        if activation_shape is None and all(hasattr(s, "arch") for s in self.stages):
            activation_shape = gpt_activation_shape(self.stages[0])
        elif activation_shape is None and hasattr(self.stages[0], "activation_shape"):  # (hf_split's stages)
            activation_shape = self.stages[0].activation_shape
        executor = PipelineExecutor if self.pipeline_fetcher is None else Stage3Executor
        self.executor = executor(
            self.stages, topology, SCHEDULES[config.parallel.schedule], activation_shape, dtype=self.dtype,
            tied=False, timeout=timeout, grads_ready=self._chunk_gradients_final)
        if self.pipeline_fetcher is not None:
            self.executor.fetcher = self.pipeline_fetcher

    def named_modules_of_state(self) -> list[nn.Module]:
        return list(self.stages)

    def _refuse_after_failure(self, failure: BaseException) -> None:
        """The schedule raised midway. The other pipeline stages wait for this one's activations
        or gradients, which will not come, and would take the next batch's for them: a pipeline
        cannot skip a batch as one model can (tiertrain.Engine). From now on this engine refuses
        to train and its collectives are refused (the others' transfers then fail, naming this
        rank, once its process ends), and the exception says so."""
        self._schedule_failed = (
            f"pipeline rank {self.topology.coord('pp')} (global rank {self.topology.rank}) raised "
            f"{type(failure).__name__} in its schedule at step {self.steps + 1}; its other pipeline stages wait for "
            f"the activations or gradients it did not send, so this pipeline cannot go on (a pipeline cannot skip a "
            f"batch on some stages): resume the run from its last checkpoint")
        self.comm.fail(self._schedule_failed)
        failure.add_note(f"tiertrain: {self._schedule_failed}; this engine refuses to train from now on")

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The whole model, as at every other layout (issue 34, item 10): every pipeline
        rank's parameters and buffers gathered to every rank of the pipeline (collective over
        all ranks; the tied head's copy on the last stage included). Under tensor parallelism
        each tensor is this tensor-parallel rank's slice, as without a pipeline."""
        mine = {k: v.cpu() for k, v in self._rank_state_dict().items()}
        if self.topology.size("pp") == 1:
            return mine
        stages: list[Any] = [None] * self.topology.size("pp")
        torch.distributed.all_gather_object(stages, mine, group=self.topology.group("pp"))
        whole: dict[str, torch.Tensor] = {}
        for stage in stages:
            whole.update({k: v for k, v in stage.items() if k not in whole})
        return {k: v.to(self.device) for k, v in whole.items()}

    def source_model(self) -> tuple[nn.Module, dict[str, str]] | None:
        """The Hugging Face model wrap() cut these stages from (on the meta device where another
        rank holds a stage), whose names a checkpoint's are, and the last stage's copy of the
        weight the cut untied (copy → weight), known on every rank; None for stages given as a
        list or cut from tiertrain's GPT."""
        models = [getattr(s, "whole_model", None) for s in self.stages]
        if not models or any(m is None or m is not models[0] for m in models):
            return None
        tie = self.stages[0].cut_tie
        return models[0], ({tie[1]: tie[0]} if tie else {})

    def tied_copies(self) -> dict[str, str]:
        """The last stage's copy of a tied embedding, kept equal to the first stage's."""
        return {tied_names(s)[1]: tied_names(s)[0] for s in self._tied_stages if s.is_last and not s.is_first}

    # -- training ------------------------------------------------------------------------

    # The one-model contract is not this engine's: these say what to call instead (a user
    # porting a pp=1 loop calls them), and nothing behind them runs.

    def __call__(self, batch: Any) -> torch.Tensor:
        """Refused: a pipeline runs micro-batches through :meth:`train_batch`."""
        raise TypeError(_USE_TRAIN_BATCH)

    forward = __call__

    def backward(self, loss: torch.Tensor) -> None:
        """Refused: a pipeline runs micro-batches through :meth:`train_batch`."""
        raise TypeError(_USE_TRAIN_BATCH)

    def evaluate(self, batch: Any) -> torch.Tensor:
        """The loss of one micro-batch (as :meth:`tiertrain.Engine.evaluate`), on every
        pipeline rank: :meth:`evaluate_each` of ``[batch]``. Evaluating several micro-batches
        at once pipelines them; one at a time, each crosses the stages alone."""
        return torch.tensor(self.evaluate_each([batch])[0], dtype=torch.float64)

    def evaluate_each(self, batches: Sequence[Any]) -> list[float]:
        """The loss of each micro-batch of ``batches``, in order, on every pipeline rank: the
        stages in eval mode (dropout off), the forward-only schedule
        (:func:`~.schedule.forward_only`, Megatron's ``forward_only``, DeepSpeed's
        ``eval_batch``) with no autograd graph, parameters and gradients untouched. Call it
        between steps; every rank of a pipeline must be given the same micro-batches, and at
        stage 3 every data-parallel rank of a stage as many (each block is gathered for its
        forward). A schedule that raises leaves the engine refusing to train, as in
        :meth:`train_batch`."""
        if self._schedule_failed is not None:
            raise CollectiveMismatchError(self._schedule_failed)
        if isinstance(batches, (dict, torch.Tensor)) or not isinstance(batches, Sequence) or not batches:
            empty = isinstance(batches, Sequence) and not isinstance(batches, (dict, torch.Tensor))
            raise ValueError(f"evaluate_each(batches): expected a non-empty list of micro-batches (every one is "
                             f"evaluated in one schedule), got {type(batches).__name__}{' (empty)' if empty else ''}"
                             f" (one micro-batch: evaluate(batch); from an iterator: list(itertools.islice(it, n)))")
        self._refuse_unset("evaluate_each")
        self._check_model_unchanged()
        micro = [self._to_device(batch) for batch in batches]
        was_training = self.module.training
        self.module.eval()
        try:
            return self.executor.evaluate(micro)
        except BaseException as failure:
            self._refuse_after_failure(failure)
            raise
        finally:
            if self.pipeline_fetcher is not None:
                self.pipeline_fetcher.release_all()
            self.module.train(was_training)

    def _step_micro_batches(self, batches: Iterator[Any] | Sequence[Any]) -> list[Any]:
        """One step's grad_accum_steps micro-batches from train_batch's argument (see there)."""
        n = self.accum
        if isinstance(batches, Sequence) and not isinstance(batches, (str, bytes)):
            if len(batches) != n:
                raise ValueError(f"train_batch: a list holds one step's micro-batches, grad_accum_steps={n} of them; "
                                 f"got {len(batches)} (or pass an iterator: train_batch takes the next {n})")
            return list(batches)
        if not isinstance(batches, Iterator):
            one = " (one micro-batch: [batch], with grad_accum_steps=1)" if isinstance(batches, dict) else ""
            raise TypeError(f"train_batch(batches): expected an iterator of micro-batches (DeepSpeed's data_iter) or a "
                            f"list of grad_accum_steps={n} of them, got {type(batches).__name__}{one}")
        taken = []
        for batch in batches:
            taken.append(batch)
            if len(taken) == n:
                return taken
        if not taken:
            raise StopIteration  # (the end of the data, as DeepSpeed's train_batch ends it)
        raise ValueError(f"train_batch: the iterator ran out after {len(taken)} of the step's grad_accum_steps={n} "
                         f"micro-batches, which would be dropped untrained: give a multiple of {n} micro-batches")

    def _chunk_gradients_final(self, stage: nn.Module) -> None:
        if stage not in self._tied_stages:  # tied chunks wait for the exchange
            self.reducer.launch(self._units_of_chunk[self.stages.index(stage)])

    def _exchange_tied_gradients(self) -> None:
        first = last = None
        for s in self._tied_stages:
            params = dict(s.named_parameters())
            name_first, name_last = tied_names(s)
            if s.is_first:
                first = self.reducer.accumulated_gradient(params[name_first])
            if s.is_last:
                last = self.reducer.accumulated_gradient(params[name_last])
        sum_tied_gradients(first, last, self.topology, self.executor.comm.timeout)
        for s in self._tied_stages:
            self.reducer.launch(self._units_of_chunk[self.stages.index(s)])

    def train_batch(self, batches: Iterator[Any] | Sequence[Any]) -> float:
        """Run grad_accum_steps micro-batches through the schedule and one optimizer step:
        the next ones of an iterator (DeepSpeed's ``train_batch(data_iter)``), or a list of
        exactly that many; returns the mean loss of the micro-batches (on every pipeline rank).
        An iterator already exhausted raises StopIteration, as DeepSpeed's does (the end of the
        data); one that runs out partway raises ValueError (the micro-batches taken would be
        dropped). Every rank of a pipeline must be given the same micro-batches. A schedule that raised
        (caught, a loop may go on) leaves this engine refusing to train: see _refuse_after_failure."""
        if self._schedule_failed is not None:
            raise CollectiveMismatchError(self._schedule_failed)
        self._refuse_unset("train_batch")
        self._check_model_unchanged()
        micro = [self._to_device(batch) for batch in self._step_micro_batches(batches)]
        if self.buffers and self.module.training and self.config.zero.broadcast_buffers and self.comm.size > 1:
            # DDP's broadcast_buffers, over this stage's data-parallel group: once per step, before
            # the first micro-batch's forward (the schedule interleaves the forwards of several).
            self.buffers.broadcast(self.comm)
        self.reducer.begin(reduce_now=False)
        try:
            loss = self.executor.run(micro, loss_scale=self.scaler.scale / self.dp)  # 1/dp: see Engine.backward
        except BaseException as failure:
            self._refuse_after_failure(failure)
            raise
        if self.pipeline_fetcher is not None:
            self.pipeline_fetcher.release_all()  # (each backward released its units already)
        if self._tied_stages:
            self._exchange_tied_gradients()
        self.train_state.micro_steps += self.accum
        self.step()
        return loss
