"""``TiertrainTrainer``: a ``transformers.Trainer`` whose forward, backward and optimizer step
run on tiertrain's engine (ZeRO stages 1-3, the CPU and NVMe tiers), so that a script built on
the Trainer keeps its TrainingArguments, datasets, collator, ``compute_loss``, callbacks,
``evaluate()`` and ``save_model()``::

    from transformers import TrainingArguments
    from tiertrain.config import Config
    from tiertrain.integrations.hf_trainer import TiertrainTrainer

    config = Config()
    config.zero.stage = 3
    config.zero.offload_optimizer = "cpu"          # optimizer state on the CPU tier
    args = TrainingArguments(output_dir="out", per_device_train_batch_size=8, learning_rate=1e-4,
                             max_steps=1000, logging_steps=10, eval_strategy="steps", eval_steps=200,
                             save_steps=500)
    trainer = TiertrainTrainer(model=model, args=args, train_dataset=train, eval_dataset=val,
                               data_collator=collator, tiertrain_config=config)
    trainer.train()
    trainer.evaluate()
    trainer.save_model("out/final")               # collective: every rank calls it
    trainer.close()                               # optional: hands back trainer.model whole

launched on every rank by ``torchrun --nproc-per-node N script.py`` (or, on one machine,
``tiertrain.launch.launch_local(main, N)``); docs/hf_trainer.md has the before/after of a script.

**How it plugs in** (transformers 5.x's Trainer): the engine is built where the Trainer would
prepare its model and optimizer with Accelerate (``_prepare_for_training``); the model the
inner loop sees is a thin module whose forward is the engine's forward, so ``compute_loss``
(yours or the Trainer's: ``compute_loss_func``, label smoothing, ``num_items_in_batch``) runs
unchanged inside it; ``training_step`` hands the loss to ``engine.backward`` (gradients are
reduced over the data-parallel ranks during backward); ``optimizer.step()`` is ``engine.step()``
(clipping, the update, the schedule); ``evaluate``/``predict`` run the engine's forward under
``no_grad``; ``save_model`` is the engine's collective ``save_pretrained``; the checkpoints of
``save_steps`` hold that export plus ``engine.save_checkpoint`` (optimizer, schedule, RNG), which
``train(resume_from_checkpoint=...)`` loads (as it loads a checkpoint that Trainer saved with
DeepSpeed: ``engine.load_deepspeed_checkpoint``; with FSDP, sharded or whole, or on its own, a
peft run's too: tiertrain/state/trainer_checkpoint.py). Accelerate still shards the data loaders and
gathers metrics over the existing process group; it never wraps the model (no DDP) and never
autocasts (the engine's ``precision.dtype`` is the compute dtype).

**TrainingArguments → tiertrain Config** (:func:`config_from_training_arguments`):
learning_rate → optimizer.lr; adam_beta1/2 → optimizer.betas; adam_epsilon → optimizer.eps;
weight_decay → the decayed group of the Trainer's own split (``get_decay_parameter_names``: no
decay for biases and norms; with a DeepSpeed optimizer block, every trained parameter, as there);
max_grad_norm → optimizer.grad_clip (0: none); per_device_train_batch_size →
batch.micro_batch_size; gradient_accumulation_steps → batch.grad_accum_steps; bf16/fp16 →
precision.dtype; lr_scheduler_type, warmup_steps,
lr_scheduler_kwargs, max_steps/num_train_epochs → the Trainer's own scheduler
(``transformers.get_scheduler``), stepped by the engine once per update applied; optim
adamw_torch/adamw_torch_fused → torch AdamW; optim adafactor/sgd/adagrad/rmsprop (with the
optim_args the Trainer reads) and ``optimizer_cls_and_kwargs=(cls, kwargs)`` → that optimizer,
as the Trainer builds it, over the same groups (tiertrain/optim.py; docs/optimizers.md);
``optimizers=(optimizer, scheduler)`` → that optimizer's class over its own groups and rates, and
the scheduler (a LambdaLR: transformers' get_*_schedule_with_warmup) rebuilt on the engine's;
a subclass's own create_optimizer / create_scheduler → what they build, taken the same way. seed,
logging_steps, eval_strategy/eval_steps, save_strategy/save_steps, save_total_limit,
output_dir, callbacks, report_to work as in the Trainer. What tiertrain_config may set: zero,
activations, parallel.dp and precision.loss_scale; a field TrainingArguments also sets must be
left at its default or agree with it (else ConfigError naming both).

**A DeepSpeed config** (``TiertrainTrainer(..., deepspeed="ds_config.json")``, or
``TrainingArguments(deepspeed=...)``, which transformers builds only where the deepspeed package
is installed; a single process then gets the world of one DeepSpeed would make) is translated as
``tiertrain train --deepspeed`` translates it (docs/deepspeed.md): its "auto" values are the
TrainingArguments', its explicit ones must agree with them (as transformers requires), a key
it leaves out takes DeepSpeed's default (no ``gradient_clipping``: no clipping, as the
DeepSpeed engine would do), and its scheduler block (WarmupLR, WarmupDecayLR,
WarmupCosineLR) is the schedule, "auto" resolved as transformers resolves it; without one,
lr_scheduler_type applies. The Trainer's decay split (no decay for biases and norms) is kept.

Limits
------
* Works: train() (max_steps or epochs, gradient accumulation, logging with loss, grad_norm and
  learning_rate, eval and save strategies, callbacks), evaluate(), predict(), save_model(),
  resume_from_checkpoint from a checkpoint this trainer saved, compute_loss overrides,
  compute_loss_func, label smoothing, compute_metrics (with eval logits).
* torch_compile (with torch_compile_backend/mode) compiles each block's forward
  (tiertrain.compiling.compile_blocks, docs/compile.md), not the whole model.
* activation_checkpointing / gradient_checkpointing (with their kwargs: every_n_layers,
  offload, use_reentrant) is the model's own, as the Trainer enables it: a checkpointed layer's
  recompute in backward gathers its stage-3 parameters again, as its forward did (the same
  values as without it). Not together with tiertrain_config.activations.checkpoint_every.
* metric_for_best_model keeps trainer_state's best_model_checkpoint as the Trainer does (the
  rotation spares it); load_best_model_at_end loads its weights into the engine at the end;
  save_strategy="best" saves at each new best.
* Refused with a ConfigError naming the argument and what is valid: fsdp,
  parallelism_config, an optim the engine does not build, optim_args the Trainer would
  ignore, lr_scheduler_type reduce_lr_on_plateau/greedy, auto_find_batch_size,
  use_liger_kernel, bf16_full_eval/fp16_full_eval, more than one GPU per process
  (DataParallel), model_init and hyper-parameter search, ``optimizers=(..., scheduler)`` whose
  scheduler is not a LambdaLR, tiertrain_config with parallel.tp or parallel.pp > 1 or
  a non-default schedule/checkpoint section, and training through the end of an epoch whose
  batches per rank are not a multiple of gradient_accumulation_steps (the engine steps every
  grad_accum_steps micro-batches; HF would take a short last step).
* Differs: bf16/fp16 are the engine's compute dtype (parameters and activations in bf16/fp16,
  fp32 master weights and Adam state, dynamic loss scaling for fp16 with GradScaler's growth
  interval and backoff, but never below 1), not Accelerate's autocast.
  ``trainer.model`` holds only this rank's shards at ZeRO stage 3 while the engine is open: use
  the trainer (evaluate, predict, save_model), or ``trainer.close()`` (collective) to get the
  whole trained model back. Every rank must call train, evaluate, predict, save_model and
  close (they are collective). One train() per trainer (a second one raises; resume instead).
  Checkpoints hold no rng_state/optimizer.pt files of the Trainer's format: the engine's
  checkpoint (``checkpoint-N/tiertrain``) holds that state (save_only_model=True leaves it out:
  such a checkpoint does not resume). ``total_flos`` counts the full parameter count taken
  before partitioning.
* Tested (tests/test_hf_trainer.py, 2 gloo ranks on CPU): stage 3 with accumulation, stage 3
  with the CPU optimizer tier, optimizer_cls_and_kwargs and a compute_loss override, resume,
  evaluate, predict, save_model, the refusals. Not tested through the Trainer: GPUs, bf16/fp16, the NVMe tier,
  stages 1-2, offload_params, push_to_hub.
"""
from __future__ import annotations

import functools
import os
from typing import Any

import torch
import torch.nn as nn

from ..compiling import compile_blocks
from ..config import Config, ConfigError
from ..state import trainer_checkpoint
from ..topology import Topology
from ..wrapping import wrap
from .hf_arguments import (SUPPORTED_OPTIMS, TRAINER_OPTIMS, _refuse, _value, check_training_arguments,
                           client_optimizers, config_from_training_arguments, deepspeed_schedule,
                           trainer_optimizer, trainer_param_groups)

try:
    from transformers import Trainer
except ImportError as e:  # pragma: no cover - the integration needs transformers
    raise ImportError("tiertrain.integrations.hf_trainer needs transformers (and accelerate): "
                      "pip install 'transformers[torch]'") from e

__all__ = ["TiertrainTrainer", "check_training_arguments", "config_from_training_arguments",
           "SUPPORTED_OPTIMS", "ENGINE_CHECKPOINT"]

ENGINE_CHECKPOINT = "tiertrain"
"""Subdirectory of a Trainer checkpoint (checkpoint-N/) holding the engine's resumable state."""


class _AsIs:
    """A value the engine hands to the model untouched (its batch moves tensors to the device and
    casts floating ones to the compute dtype): the Trainer's num_items_in_batch, a token count
    that a bf16 cast would round."""

    def __init__(self, value: Any):
        self.value = value


_AS_IS = ("num_items_in_batch",)


def _call_model(module: nn.Module, batch: tuple) -> Any:
    """The engine's loss_fn: the model called as the Trainer called the proxy; returns the
    model's outputs (compute_loss, outside, finds the loss in them)."""
    args, kwargs, as_is = batch
    return module(*args, **kwargs, **as_is.value)


def _hf_scheduler(optimizer: torch.optim.Optimizer, args, max_steps: int):
    """The scheduler Trainer.create_scheduler would build, over the engine's optimizer."""
    from transformers.optimization import get_scheduler

    return get_scheduler(args.lr_scheduler_type, optimizer=optimizer,
                         num_warmup_steps=args.get_warmup_steps(max_steps), num_training_steps=max_steps,
                         scheduler_specific_kwargs=args.lr_scheduler_kwargs)


def _tiertrain_scheduler(optimizer: torch.optim.Optimizer, schedule):
    """A DeepSpeed config's schedule (deepspeed_schedule) over the engine's optimizer."""
    from ..optim import lr_factor

    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, schedule))


def _use_the_engines_device(args) -> None:
    """Without an accelerator, Accelerate treats several processes as one distributed run only
    with use_cpu=True (MULTI_CPU: it then adopts the process group already initialised, or
    initialises gloo from torchrun's environment); otherwise every rank would believe it is
    alone and train on the whole data set. The engine's device decides (tiertrain.device)."""
    from ..topology import default_device

    if default_device().type == "cpu" and not args.use_cpu:
        args.use_cpu = True
        if vars(args).pop("_setup_devices", None) is not None:  # (TrainingArguments set devices up already)
            args._setup_devices  # again now, before the Trainer builds its Accelerator on that state


def _one_process_group_for_deepspeed_arguments(args) -> None:
    """TrainingArguments(deepspeed=...) makes Accelerate's state a distributed one even in a
    single process (DeepSpeed's init_distributed would make it a world of one), so the Trainer
    gathers its logged loss over a process group that nothing has initialised: a single process
    gets that world of one (gloo, an in-memory store), as under DeepSpeed. Under torchrun the
    launcher's group is used."""
    from transformers.training_args import ParallelMode

    if (args.parallel_mode != ParallelMode.DISTRIBUTED or torch.distributed.is_initialized()
            or int(os.environ.get("WORLD_SIZE", "1")) > 1):
        return
    torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)


class _EngineModel(nn.Module):
    """What the Trainer's loops see as the model: calling it runs the engine's forward (the
    stage-3 gathers, the compute dtype); train()/eval() reach the real model; zero_grad() is
    the engine's business (gradients live in its flat buffers). Other attributes are the real
    model's."""

    def __init__(self, engine):
        super().__init__()
        object.__setattr__(self, "_engine", engine)  # (not a submodule: its parameters are the engine's)

    def forward(self, *args, **kwargs):
        as_is = {k: kwargs.pop(k) for k in _AS_IS if k in kwargs}
        return self._engine((args, kwargs, _AsIs(as_is)))

    def train(self, mode: bool = True):
        self.training = mode
        self._engine.module.train(mode)
        return self

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def _get_name(self) -> str:  # (the Trainer's label smoothing shifts labels by the model's class name)
        return self._engine.module._get_name()

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(object.__getattribute__(self, "_engine").module, name)


class _EngineOptimizer:
    """Trainer.optimizer: step() is engine.step() (clip, update, the engine's scheduler step).
    Records the rate of the update it applies and fills the grad_norm the loop will log."""

    def __init__(self, engine):
        self.engine = engine
        self.last_lr = engine.learning_rate()
        self.pending_norm: torch.Tensor | None = None

    @property
    def param_groups(self) -> list[dict]:
        return [{"lr": self.engine.learning_rate()}]

    def step(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("TiertrainTrainer's optimizer.step() takes no closure")
        self.last_lr = self.engine.learning_rate()
        self.engine.step()
        if self.pending_norm is not None:
            self.pending_norm.fill_(self.engine.last_grad_norm)
            self.pending_norm = None

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass

    def state_dict(self) -> dict:
        raise NotImplementedError("the optimizer state lives in the engine's shards: save with "
                                  "trainer.save_model / checkpoints (engine.save_checkpoint)")


class _EngineScheduler:
    """Trainer.lr_scheduler: the engine steps the real scheduler once per update applied;
    get_last_lr() is the rate of the last update (what the Trainer logs)."""

    def __init__(self, optimizer: _EngineOptimizer):
        self.optimizer = optimizer

    def step(self, *args, **kwargs) -> None:
        pass

    def get_last_lr(self) -> list[float]:
        return [self.optimizer.last_lr]

    def state_dict(self) -> dict:
        return {}


class TiertrainTrainer(Trainer):
    """A ``transformers.Trainer`` training on tiertrain's engine; see the module docstring.
    tiertrain_config: the engine's Config for what TrainingArguments has no word for (zero
    stage and tiers, activation checkpointing); default: Config() (stage 0)."""

    def __init__(self, model: nn.Module | None = None, args=None, *positional,
                 tiertrain_config: Config | None = None, deepspeed=None, **kwargs):
        if positional:
            raise TypeError("TiertrainTrainer: pass the Trainer's arguments after args by keyword")
        if args is None:
            raise ConfigError("TiertrainTrainer needs args=TrainingArguments(output_dir=...)")
        if model is None or kwargs.get("model_init") is not None:
            raise ConfigError("TiertrainTrainer(model_init=...) is not supported: pass model= (the engine wraps one "
                              "model once; hyper-parameter search re-creates it)")
        self.deepspeed_config = deepspeed if deepspeed is not None else (args.deepspeed or None)
        # (stepped by the engine over its shards, the scheduler rebuilt on its optimizer: hf_arguments.py)
        self._client_optimizer, self._client_scheduler = client_optimizers(kwargs.pop("optimizers", None),
                                                                           self.deepspeed_config)
        if self._client_optimizer is not None and kwargs.get("optimizer_cls_and_kwargs") is not None:
            raise ConfigError("TiertrainTrainer: optimizers=(...) and optimizer_cls_and_kwargs both name the optimizer: "
                              "pass one")
        self.tiertrain_config = config_from_training_arguments(args, tiertrain_config, self.deepspeed_config)
        _use_the_engines_device(args)
        self.engine = None
        self._engine_max_steps: int | None = None
        self._proxy: _EngineModel | None = None
        self._resumed_from: str | None = None
        super().__init__(model=model, args=args, **kwargs)
        _one_process_group_for_deepspeed_arguments(self.args)
        if self.args.n_gpu > 1:
            _refuse("n_gpu", self.args.n_gpu, "one device per process: launch one process per GPU (torchrun)")
        # Counted before the engine partitions the parameters (floating_point_ops).
        self._num_parameters = sum(p.numel() for p in self.model.parameters())
        self._num_embedding_parameters = sum(p.numel() for m in self.model.modules() if isinstance(m, nn.Embedding)
                                             for p in m.parameters(recurse=False))

    # -- what the Trainer would do with Accelerate, done by the engine -------------------------

    def _build_accelerator_args(self, **kwargs) -> dict[str, Any]:
        out = super()._build_accelerator_args(**kwargs)
        out["mixed_precision"] = "no"  # the engine's precision.dtype is the compute dtype: no autocast
        return out

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        pass  # the engine places every parameter (its shard, on its tier) itself

    def _schedule_steps(self) -> int:
        """The optimizer steps the scheduler spans: as the Trainer computes them in train()."""
        if self.args.max_steps > 0:
            return self.args.max_steps
        if self.train_dataset is None:
            return 1  # (evaluation only)
        return self.set_initial_training_values(self.args, self.get_train_dataloader())[-1]

    def _decay_split(self) -> tuple[list[str], list[str]]:
        """The trained parameters' names in the Trainer's two param groups (create_optimizer's):
        decayed, then not, each in the model's order."""
        decay = set(self.get_decay_parameter_names(self.model))
        named = [n for n, p in self.model.named_parameters() if p.requires_grad]
        return [n for n in named if n in decay], [n for n in named if n not in decay]

    def _ensure_engine(self, max_steps: int | None = None):
        """The engine, built at the first need (collective: every rank builds it)."""
        if self.engine is None and self._proxy is not None:
            raise ConfigError("TiertrainTrainer: close() was called; build a new trainer (trainer.model now holds "
                              "the trained values whole)")
        if max_steps is None:
            max_steps = self._engine_max_steps if self.engine is not None else self._schedule_steps()
        if self.engine is not None:
            if max_steps != self._engine_max_steps:
                raise ConfigError(f"TiertrainTrainer: the engine's schedule spans {self._engine_max_steps} steps but "
                                  f"training now asks for {max_steps}: build a new trainer")
            return self.engine
        config = self.tiertrain_config
        topology = Topology.build(config.parallel)
        if topology.size("dp") != self.args.world_size:
            raise ConfigError(f"TiertrainTrainer: the engine's data-parallel size {topology.size('dp')} differs from "
                              f"the Trainer's world size {self.args.world_size} (whose data loaders shard the data)")
        model = self.model
        groups = trainer_param_groups(model, self._decay_split(), self.args.weight_decay, self.deepspeed_config)
        optimizer = None
        client, client_scheduler = self._scripts_optimizers(max_steps)
        if client is not None:  # (its own groups, as the Trainer then takes them)
            optimizer, groups = client, None
        elif self.optimizer_cls_and_kwargs is not None or _value(self.args.optim) in TRAINER_OPTIMS:
            # (as Trainer.create_optimizer builds it)
            cls, options = self.optimizer_cls_and_kwargs or self.get_optimizer_cls_and_kwargs(self.args, model)
            optimizer, groups = trainer_optimizer(cls, options, groups, model)
        schedule = deepspeed_schedule(self.deepspeed_config, self.args, max_steps)
        scheduler = (client_scheduler if client_scheduler is not None else
                     functools.partial(_hf_scheduler, args=self.args, max_steps=max_steps) if schedule is None
                     else functools.partial(_tiertrain_scheduler, schedule=schedule))
        if self.args.torch_compile:  # each block, not the whole model: the engine's hooks stay outside
            compile_blocks(model, backend=self.args.torch_compile_backend, mode=self.args.torch_compile_mode)
        self.engine = wrap(model, config, topology, loss_fn=_call_model, optimizer=optimizer, param_groups=groups,
                           lr_scheduler=scheduler)
        self._engine_max_steps = max_steps
        self._proxy = _EngineModel(self.engine)
        self.accelerator.backward = self._backward_through_engine  # (a training_step override's call)
        self.model_wrapped = self._proxy
        self.optimizer = _EngineOptimizer(self.engine)
        self.lr_scheduler = _EngineScheduler(self.optimizer)
        return self.engine

    def _scripts_optimizers(self, max_steps: int):
        """(optimizer instance, scheduler factory) the script gives, or (None, None): Trainer(
        optimizers=...), or its subclass's own create_optimizer / create_scheduler /
        create_optimizer_and_scheduler, called as the Trainer calls them (before, ignored in
        silence: the engine's AdamW trained instead). They build on the model's parameters; the
        engine steps that optimizer's class over its shards (hf_arguments.client_optimizers)."""
        if self._client_optimizer is not None:
            return self._client_optimizer, self._client_scheduler
        own = {name for name in ("create_optimizer", "create_scheduler", "create_optimizer_and_scheduler")
               if getattr(type(self), name) is not getattr(TiertrainTrainer, name)}
        if not own:
            return None, None
        self.optimizer = self.lr_scheduler = None
        if "create_optimizer_and_scheduler" in own:
            self.create_optimizer_and_scheduler(num_training_steps=max_steps)
        else:
            self.create_optimizer()
            if "create_scheduler" in own:
                self.create_scheduler(num_training_steps=max_steps, optimizer=self.optimizer)
        return client_optimizers((self.optimizer, self.lr_scheduler if own - {"create_optimizer"} else None),
                                 self.deepspeed_config)

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader=None) -> nn.Module:
        self._ensure_engine()
        return self._proxy

    def _prepare_for_training(self, max_steps, train_dataloader, resume_from_checkpoint):
        accum = self.args.gradient_accumulation_steps
        per_epoch = len(train_dataloader) if hasattr(train_dataloader, "__len__") else None
        if per_epoch is not None and per_epoch % accum and max_steps > per_epoch // accum:
            raise ConfigError(
                f"TiertrainTrainer: an epoch gives each rank {per_epoch} batches, not a multiple of "
                f"gradient_accumulation_steps={accum}; the engine steps every {accum} micro-batches, so the "
                f"Trainer's short last step of each epoch cannot be taken: make the train set a multiple of "
                f"per_device_train_batch_size × world size × {accum} samples, set dataloader_drop_last=True "
                f"with such a size, or change gradient_accumulation_steps")
        fresh = self.engine is None
        engine = self._ensure_engine(max_steps)
        if not fresh and engine.steps > 0 and resume_from_checkpoint is None:
            raise ConfigError("TiertrainTrainer: train() was already run on this trainer; resume from a saved "
                              "checkpoint with a new trainer (train(resume_from_checkpoint=...))")
        if resume_from_checkpoint is not None:
            path = os.path.join(resume_from_checkpoint, ENGINE_CHECKPOINT)
            if os.path.isdir(path):
                engine.load_checkpoint(path)
            elif os.path.isfile(os.path.join(resume_from_checkpoint, "latest")):
                engine.load_deepspeed_checkpoint(resume_from_checkpoint)  # (saved by Trainer with DeepSpeed)
            elif trainer_checkpoint.saved_by_trainer(resume_from_checkpoint):  # (on its own, or with FSDP)
                engine.enter_load("train(resume_from_checkpoint=...)")
                trainer_checkpoint.load(engine, resume_from_checkpoint, list(self._decay_split()),
                                        self.state.global_step)
            else:
                raise ConfigError(f"resume_from_checkpoint={resume_from_checkpoint!r} has no {ENGINE_CHECKPOINT}/ "
                                  f"directory (saved by TiertrainTrainer with save_only_model=False), no DeepSpeed "
                                  f"checkpoint ('latest' naming its global_step directory, saved by Trainer "
                                  f"with DeepSpeed), no pytorch_model_fsdp_0/ or pytorch_model_fsdp.bin (saved by "
                                  f"Trainer with FSDP's SHARDED_STATE_DICT or FULL_STATE_DICT) and no "
                                  f"{trainer_checkpoint.OPTIMIZER_FILE} (saved by Trainer on its own)")
            taken = engine.steps + engine.skipped_steps  # (the Trainer counts fp16 overflow skips as steps)
            if taken != self.state.global_step:
                raise ConfigError(f"resume_from_checkpoint={resume_from_checkpoint!r}: the engine's checkpoint is at "
                                  f"step {taken} but trainer_state.json at {self.state.global_step}")
            self.optimizer.last_lr = engine.learning_rate()
        for attr in ("model", "optimizer", "lr_scheduler"):
            setattr(self.callback_handler, attr, getattr(self, attr))
        self.callback_handler.train_dataloader = train_dataloader
        return self._proxy, train_dataloader

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        self._resumed_from = resume_from_checkpoint  # (loaded into the engine in _prepare_for_training)

    def _load_optimizer_and_scheduler(self, checkpoint) -> None:
        pass  # in the engine's checkpoint

    def _load_scaler(self, checkpoint) -> None:
        pass

    # -- the inner loop ------------------------------------------------------------------------

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch=None) -> torch.Tensor:
        """Forward through the engine (compute_loss unchanged), then engine.backward. The
        engine divides by grad_accum_steps × dp itself, so it is handed the loss of this
        micro-batch as one whole step's loss would be computed from it: the Trainer's loss
        already normalised over the accumulated batch (num_items_in_batch, compute_loss_func)
        is multiplied back by grad_accum_steps. Returns what Trainer.training_step returns."""
        engine = self._ensure_engine()
        model.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(model, inputs, num_items_in_batch=num_items_in_batch)
        if self.loss_is_scaled_for_ga is not None:
            scaled_for_ga = self.loss_is_scaled_for_ga
        else:
            scaled_for_ga = (self.model_accepts_loss_kwargs and num_items_in_batch is not None) \
                or self.compute_loss_func is not None
        accum = self.current_gradient_accumulation_steps
        engine.backward(loss * accum if scaled_for_ga else loss)
        reported = loss if scaled_for_ga else loss / accum
        return reported.detach().float().to(self.args.device)

    def _backward_through_engine(self, loss: torch.Tensor, **kwargs) -> None:
        """accelerator.backward as a script's own training_step calls it (before, refused: the
        gradients bypassed the engine). The Trainer's accelerator accumulates nothing itself
        (its gradient_accumulation_steps is 1), so the window's gradient is the sum of what it
        is given; the engine divides by grad_accum_steps, so it is handed the loss times that."""
        if kwargs:
            raise ConfigError(f"TiertrainTrainer: accelerator.backward(loss, {', '.join(kwargs)}=...): the engine runs "
                              f"the backward and takes the loss alone")
        self.engine.backward(loss * self.current_gradient_accumulation_steps)

    def _clip_grad_norm(self, model):
        return None  # the engine clips at optimizer.grad_clip (= max_grad_norm) inside step()

    def _get_grad_norm(self, model, grad_norm=None):
        # Filled by optimizer.step() (the norm is known there); logged after it.
        norm = torch.tensor(float("nan"), dtype=torch.float64)
        self.optimizer.pending_norm = norm
        return norm

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        main = getattr(self.model, "main_input_name", "input_ids")
        if main not in inputs:
            return 0
        return 6 * inputs[main].numel() * (self._num_parameters - self._num_embedding_parameters)

    # -- saving --------------------------------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Collective (every rank): the engine's save_pretrained (fp32 master values, a Hugging
        Face checkpoint from_pretrained loads), plus the processing class and training args."""
        from transformers.trainer import TRAINING_ARGS_NAME

        output_dir = self.args.output_dir if output_dir is None else output_dir
        engine = self._ensure_engine()
        engine.save_pretrained(output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_checkpoint(self, model: nn.Module, trial) -> None:
        """checkpoint-N/: the model (save_model), the engine's resumable state under
        tiertrain/ (unless save_only_model), trainer_state.json; older ones rotated."""
        from transformers.trainer import TRAINER_STATE_NAME
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
        from transformers.trainer_callback import ExportableState

        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        output_dir = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        self.save_model(output_dir, _internal_call=True)
        self._note_best_checkpoint(run_dir)
        if not self.args.save_only_model:
            self.engine.save_checkpoint(os.path.join(output_dir, ENGINE_CHECKPOINT),
                                        extra={"global_step": self.state.global_step})
        if self.args.should_save:
            for cb in [c for c in self.callback_handler.callbacks + [self.control] if isinstance(c, ExportableState)]:
                name, state = cb.__class__.__name__, cb.state()
                if isinstance(self.state.stateful_callbacks.get(name), list):
                    self.state.stateful_callbacks[name].append(state)
                else:
                    self.state.stateful_callbacks[name] = state
            self.state.save_to_json(os.path.join(output_dir, TRAINER_STATE_NAME))
            if self.args.push_to_hub:
                self._push_from_checkpoint(output_dir)
            from transformers.trainer_utils import rotate_checkpoints

            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        if torch.distributed.is_initialized():
            torch.distributed.barrier()  # (no rank reads or rotates a checkpoint another is still writing)

    def _note_best_checkpoint(self, run_dir: str) -> None:
        """trainer_state's best_model_checkpoint, as the Trainer keeps it (metric_for_best_model):
        the checkpoint of the best metric's step where one was saved. The one being saved now
        counts before it is whole on every rank, so the ranks agree without a barrier."""
        from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, SaveStrategy

        best = self.state.best_global_step
        if self.args.save_strategy not in (SaveStrategy.STEPS, SaveStrategy.EPOCH, SaveStrategy.BEST) or not best:
            return
        directory = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{best}")
        if best == self.state.global_step or os.path.isdir(directory):
            self.state.best_model_checkpoint = directory

    def _load_best_model(self) -> None:
        """load_best_model_at_end (collective): the best checkpoint's weights, which save_model
        wrote from the fp32 masters, into the engine's masters (tiertrain.load_pretrained)."""
        from ..state.pretrained import load_pretrained

        load_pretrained(self._ensure_engine(), self.state.best_model_checkpoint)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        pass  # in the engine's checkpoint

    def hyperparameter_search(self, *args, **kwargs):
        raise ConfigError("TiertrainTrainer.hyperparameter_search is not supported (it needs model_init)")

    # -- the end -------------------------------------------------------------------------------

    def close(self) -> None:
        """Collective: close the engine and hand trainer.model back whole, holding the trained
        fp32 values (the trainer cannot train or evaluate afterwards). Idempotent."""
        if self.engine is not None:
            self.engine.close()
            self.engine = None
            self.model_wrapped = self.model
