"""One training loop for any model: :class:`Trainer`.

    trainer = Trainer(MyModel, config, train_data=train_set, eval_data=val_set, loss_fn=loss_fn)
    summary = trainer.fit()

It gives any model what ``tiertrain train`` (a thin command over it) gives its GPT:

* the model given whole, or as a zero-argument factory: then it is built after the seed is
  set, directly in partitioned form at ZeRO stage 3 (tiertrain.zero.construct), and first
  on the meta device to count it (FLOPs, the planner, predicted bytes) at no memory cost;
* ``zero.offload: auto``: the planner chooses stage, tiers and checkpointing for this model
  on this machine before it is built (tiertrain/trainer/auto.py);
* data as a map-style Dataset (sharded by dp rank, resumable at any dp) or any iterable of
  batches (tiertrain/trainer/batches.py), held-out data evaluated every ``eval.every``
  steps (loss and perplexity);
* a progress bar, metrics records every ``logging.log_interval`` steps to JSONL,
  TensorBoard and Weights & Biases (tiertrain/observe): loss, learning rate, gradient norm,
  tokens/s, achieved TFLOP/s and MFU (tiertrain/trainer/flops.py), model-state bytes per
  tier beside the estimator's prediction, peak RSS, and the step time split into data,
  forward, backward and optimizer (each less its waits) and the waits on data-parallel
  collectives and swap IO (tiertrain/waits.py): the parts add up to the step;
* checkpoints every ``checkpoint.interval`` steps (``async_save``: in the background), resumed
  from the newest at any layout with the data position, or a start from a DeepSpeed or FSDP2
  run's (``from_deepspeed``, ``from_dcp``); SIGTERM / Ctrl-C end the run cleanly; a checkpoint
  saved while the loss or the gradient norm spikes, or before gradients stayed non-finite, is
  marked diverged and a resume passes over it (tiertrain/trainer/divergence.py).

Metrics are means over the data-parallel ranks (loss weighted by micro-batches, times per step)
and maxima for memory; ``tokens_per_s`` and TFLOP/s count every rank's tokens. Records are
strict JSON (non-finite numbers null, named under "non_finite").
"""
from __future__ import annotations

import contextlib
import dataclasses
import sys
import time
import uuid
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from ..config import ConfigError
from ..launch import check_terminated
from ..precision import NonFiniteError
from .auto import predicted_tier_bytes, resolve_auto_offload
from .batches import batch_stream, count_tokens, is_dataset
from .evaluation import held_out_loss
from .config import LoopConfig
from .divergence import DivergenceWatch
from .flops import flops_per_token, peak_flops_per_rank
from ..zero.stage3 import tensors_in
from .records import (Window, finite_or_none, format_summary, gather_over_dp, local_ranks, peak_rss_bytes,
                      postfix)

__all__ = ["Trainer", "model_fingerprint", "format_summary"]

ModelOrFactory = nn.Module | Callable[[], nn.Module]


_VOLATILE_CONFIG_KEYS = ("_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
                         "use_cache", "return_dict", "output_attentions", "output_hidden_states", "init_std",
                         "initializer_range", "_attn_implementation_autoset")
"""Config keys that may change between a save and a resume without changing the model."""


def model_fingerprint(model: nn.Module) -> dict[str, Any] | None:
    """What identifies a model's architecture beyond its tensor shapes (the load compares those):
    its ``config``'s scalar fields (GPTConfig's, a Hugging Face config's) less those acting only
    at construction; None without a config."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    if dataclasses.is_dataclass(config):
        raw = dataclasses.asdict(config)
    elif callable(getattr(config, "to_dict", None)):
        raw = config.to_dict()
    else:
        return None
    return {k: v for k, v in raw.items()
            if k not in _VOLATILE_CONFIG_KEYS and isinstance(v, (bool, int, float, str, type(None)))}


def _compare_fingerprints(saved: dict, current: dict, where: str) -> None:
    diffs = [f"model.{k}: {saved[k]!r} in the checkpoint, {current[k]!r} now"
             for k in current if k in saved and saved[k] != current[k]]
    if diffs:
        raise ConfigError(f"{where} was saved with another model ({'; '.join(diffs)}): resume with the "
                          f"checkpoint's model settings, or start a new run in another checkpoint.dir")


def _infer_seq_len(data: Any) -> int | None:
    """The sequence length of the training data: the last dimension of a sample's (or a
    batch's) input_ids or first integer tensor; None when there is none."""
    try:
        sample = data[0] if is_dataset(data) else None
        if sample is None:
            iterator = iter(data)
            if iterator is data:
                return None  # reading a one-shot iterator would lose a batch
            sample = next(iterator, None)
    except Exception:  # noqa: BLE001 - the caller falls back to no attention term
        return None
    if isinstance(sample, dict) and isinstance(sample.get("input_ids"), torch.Tensor):
        return int(sample["input_ids"].shape[-1])
    first = next(tensors_in(sample), None)
    if first is not None and first.dim() >= 1 and not first.is_floating_point():
        return int(first.shape[-1])
    return None


class Trainer:
    """Trains a model under a :class:`LoopConfig` on this rank (see the module docstring).

    model: an nn.Module, or a zero-argument factory (partitioned construction at stage 3).
    train_data / eval_data: a map-style Dataset or an iterable of batches (batches.py).
    topology: the process grid (default: ``Topology.build(config.parallel)``).
    collate_fn: joins a Dataset's samples into a micro-batch (default_collate).
    seq_len: tokens per sample for the FLOPs count and the planner (default: from the data).
    fingerprint: compared with a checkpoint's on resume (default: ``model_fingerprint``).
    partitioned_construction: build a factory's model partitioned at ZeRO stage 3 (false:
    whole, for a factory that changes the model after building it, e.g. tiling it).
    Other keyword arguments go to :func:`tiertrain.wrap` (loss_fn, optimizer, param_groups,
    lr_scheduler, unit_modules, activation_shape).

    Construction builds and wraps the model (``trainer.engine``): load weights into it here
    (``tiertrain.load_pretrained(trainer.engine, path)``) before :meth:`fit`, which resumes
    from a checkpoint when there is one.
    """

    def __init__(self, model: ModelOrFactory, config: LoopConfig, train_data: Any, eval_data: Any = None, *,
                 topology=None, collate_fn: Callable[[list], Any] | None = None, seq_len: int | None = None,
                 fingerprint: dict[str, Any] | None = None, partitioned_construction: bool = True,
                 **wrap_options: Any):
        from ..topology import Topology
        from ..wrapping import wrap

        if not isinstance(config, LoopConfig):
            raise TypeError(f"config is a {type(config).__name__}: expected a tiertrain.trainer.LoopConfig (the "
                            f"engine's Config plus steps, seed and eval)")
        config.validate()
        if config.eval.every and eval_data is None:
            raise ConfigError(f"eval.every={config.eval.every} but no eval_data was given: pass held-out data "
                              f"or set eval.every=0")
        self.topology = topology if topology is not None else Topology.build(config.parallel)
        self.is_main = self.topology.rank == 0
        self.train_data, self.eval_data, self.collate_fn = train_data, eval_data, collate_fn
        self.seq_len = seq_len if seq_len is not None else _infer_seq_len(train_data)
        self.partitioned_construction = partitioned_construction

        factory = None if isinstance(model, nn.Module) else model
        if factory is not None and not callable(factory):
            raise TypeError(f"model is a {type(model).__name__}: expected an nn.Module or a zero-argument "
                            f"callable returning one")
        # The model whole but without memory: the planner, FLOPs and predicted bytes read it.
        shape_model = model if factory is None else self._meta_build(factory)
        if config.zero.offload == "auto":
            config = resolve_auto_offload(config, self._dims(shape_model), self.topology)
        self.config = config
        self.flops_per_token = flops_per_token(shape_model, self.seq_len or 0, self.topology.size("tp"))
        self.predicted_bytes = predicted_tier_bytes(shape_model, config, self.topology.world_size)
        self.fingerprint = fingerprint if fingerprint is not None else model_fingerprint(shape_model)
        self.num_parameters = sum(p.numel() for p in shape_model.parameters())
        del shape_model

        if config.checkpoint.dir:  # one job per directory, named before its swap files or model are built
            from ..state import checkpoint

            checkpoint.lock_directory(config.checkpoint.dir, self.topology)
        if factory is not None:
            model = self._build(factory)
        self.model = model
        self.engine = wrap(model, config.engine_config(), self.topology, **wrap_options)
        dp, dp_rank = self.topology.size("dp"), self.topology.coord("dp")
        self.train_batches = batch_stream(train_data, dp_rank, dp, config.batch.micro_batch_size,
                                          seed=config.seed, collate=collate_fn)
        self.dp_group = self.topology.group("dp")
        self.replica_group = self.topology.group("dp_cp")
        """The ranks whose losses average to the step's loss: dp × cp (each context-parallel rank
        returns its share of its samples' loss, tiertrain/parallel/cp_plan.py)."""
        self.step = 0
        self.run_id = uuid.uuid4().hex
        self.records: list[dict[str, Any]] = []
        ckpt = config.checkpoint
        self.divergence = DivergenceWatch(ckpt.loss_spike_factor, ckpt.grad_norm_spike_factor, ckpt.spike_window)

    # -- construction --------------------------------------------------------------------

    @staticmethod
    def _meta_build(factory: Callable[[], nn.Module]) -> nn.Module:
        with torch.device("meta"):
            built = factory()
        if not isinstance(built, nn.Module):
            raise TypeError(f"the model factory returned a {type(built).__name__}: expected an nn.Module")
        return built

    def _build(self, factory: Callable[[], nn.Module]) -> nn.Module:
        """The model from its factory after the run's seed (the same model on every rank),
        in partitioned form at ZeRO stage 3 without tensor parallelism."""
        from ..zero.construct import partitioned_init
        from ..zero.stages import ZeroStage

        torch.manual_seed(self.config.seed)
        partitioned = self.partitioned_construction and ZeroStage.of(self.config).partitions_parameters \
            and self.topology.size("tp") == 1 and self.topology.size("pp") == 1
        with partitioned_init(self.topology) if partitioned else contextlib.nullcontext():
            return factory()

    def _dims(self, model: nn.Module):
        """The planner's description of the model: tiertrain's GPT's dims, or any module's
        (tiertrain.estimate.modules)."""
        from ..estimate import ModelDims
        from ..estimate.modules import dims_of_module
        from ..models.gpt import GPTConfig

        if isinstance(getattr(model, "config", None), GPTConfig):
            return ModelDims.from_gpt_config(model.config)
        if not self.seq_len:
            raise ConfigError("zero.offload='auto' needs the sequence length to model activations and none "
                              "could be read from train_data: pass seq_len=... to the Trainer")
        return dims_of_module(model, self.seq_len)

    # -- the loop ------------------------------------------------------------------------

    def fit(self) -> dict[str, Any]:
        """Resume when a checkpoint is there, train to ``config.steps``, evaluate and save as
        configured; returns the summary (the same keys on every rank)."""
        from ..observe.trace import StepTrace, trace_path
        from ..observe.writers import open_writers

        cfg = self.config
        start = self.step = self._maybe_resume()
        writers = open_writers(cfg.logging, append=start > 0, run_config=self._run_description()) \
            if self.is_main else None
        bar = self._progress_bar(start)
        if self.is_main:
            print(f"tiertrain: {self.num_parameters:,} parameters | zero.stage={cfg.zero.stage} | "
                  f"{cfg.precision.dtype} | world_size={self.topology.world_size} (dp={self.topology.size('dp')}"
                  f"{', cp=' + str(self.topology.size('cp')) if self.topology.size('cp') > 1 else ''}) "
                  f"| global batch {self.engine.global_batch_size} samples | {cfg.steps - start} steps"
                  + self._units_line() + self._tiers_line(), flush=True)
        peak_flops, self.peak_source = peak_flops_per_rank(
            cfg.logging.peak_tflops, self.topology.device.type != "cpu", local_ranks(self.topology.world_size))
        window = Window(self.engine)
        trace = StepTrace(trace_path(cfg.logging, self.topology.rank), cfg.logging.trace_steps, first_step=start + 2)
        t_start = time.perf_counter()
        tokens_total = 0
        last_train: dict[str, Any] = {}
        last_eval: dict[str, Any] = {}
        try:
            for step in range(start + 1, cfg.steps + 1):
                check_terminated()  # (a SIGTERM whose Terminated something below swallowed)
                trace.before_step(step)
                tokens, loss = self._train_step(window)
                trace.after_step(step)
                tokens_total += tokens
                self.step = step
                self._watch_divergence(step, loss)
                final = step == cfg.steps
                if step == start + 1 or step % cfg.logging.log_interval == 0 or final:
                    last_train = self._record(window, step, t_start, peak_flops)
                    self.records.append(last_train)
                    if writers is not None:
                        writers.write(last_train)
                    if bar is not None:
                        bar.set_postfix(**postfix(last_train, last_eval), refresh=False)
                    window = Window(self.engine)
                if cfg.eval.every and (step % cfg.eval.every == 0 or final):
                    with window.excluded():  # the window measures training, not evaluation
                        last_eval = {"step": step, **self.evaluate(), "elapsed_s": time.perf_counter() - t_start}
                    self.records.append(last_eval)
                    if writers is not None:
                        writers.write(last_eval)
                    if bar is not None:
                        bar.set_postfix(**postfix(last_train, last_eval), refresh=False)
                if bar is not None:
                    bar.update(1)
                self._maybe_save(step, final)
        except NonFiniteError as e:
            self._mark_diverged(str(e).splitlines()[0][:300])
            raise
        finally:
            trace.close()
            if trace.written and self.is_main:
                print(f"tiertrain: trace of {cfg.logging.trace_steps} step(s) in {trace.path} "
                      f"(Perfetto or chrome://tracing; tiertrain plot draws it)", flush=True)
            if bar is not None:
                bar.close()
            if writers is not None:
                writers.close()
        summary = self._summary(start, time.perf_counter() - t_start, tokens_total)
        if self.is_main:
            print(format_summary(summary), flush=True)
        return summary

    def _tiers_line(self) -> str:
        """Where the model states live and where checkpoints go (issue 35, item 5: the banner
        did not say which tiers were active)."""
        zero = self.config.zero
        where = {"none": "the device", "cpu": "the CPU", "nvme": "NVMe"}
        line = (f" | optimizer state on {where[zero.offload_optimizer.config_name]}"
                f", parameters on {where[zero.offload_params.config_name]}")
        if "nvme" in (zero.offload_optimizer.config_name, zero.offload_params.config_name):
            line += f" (swap in {zero.nvme_path})"
        if self.engine.plan.accumulation.applies:  # (zero.accumulate_on_device's decision)
            line += f" | {self.engine.plan.accumulation.describe()}"
        return line + (f" | checkpoints in {self.config.checkpoint.dir}" if self.config.checkpoint.dir else "")

    def _units_line(self) -> str:
        """Stage 3: how many units, and how much of the model the largest gathers at once."""
        report = self.engine.memory_report()
        if not report.units:
            return ""
        line = f" | {report.units} stage-3 units, the largest {report.largest_unit_share:.0%} of the model"
        if report.largest_unit_share > 0.5:
            line += (" (gathered whole at once: stage 3 saves little; give unit_modules=[...] to wrap(), or a "
                     "smaller zero.unit_params)")
        return line

    def _mark_diverged(self, reason: str) -> None:
        """The checkpoint of this step count is the state of a run that diverged (it stopped on
        gradients that stayed non-finite, or was saved in a loss or gradient-norm spike): it is
        marked, so a resume does not take it by default (the previous one is the state to
        resume, with a lower optimizer.lr). Collective."""
        from ..state import checkpoint

        directory = self.config.checkpoint.dir
        if not directory:
            return
        # (every rank raised at the same step, the norm being global: each lets its background
        # save commit, so that the mark lands on a committed checkpoint)
        self.engine.wait_for_checkpoint()
        if self.is_main:
            if checkpoint.mark_diverged(directory, self.engine.steps, reason):
                print(f"tiertrain: the checkpoint of step {self.engine.steps} in {directory!r} is marked diverged: "
                      f"a resume passes over it", file=sys.stderr, flush=True)

    def _watch_divergence(self, step: int, loss: float) -> None:
        """Judge the step's loss (averaged over data-parallel ranks) and gradient norm; the
        first spike of a streak is a warning line on rank 0."""
        watch = self.divergence
        if not watch.enabled:
            return
        if self.topology.size("dp_cp") > 1 and dist.is_initialized():
            total = torch.tensor([loss], dtype=torch.float64)
            dist.all_reduce(total, group=self.replica_group)
            loss = float(total) / self.topology.size("dp_cp")
        was_spiking = watch.spike is not None
        spike = watch.observe(step, loss, self.engine.last_grad_norm)
        if spike is not None and not was_spiking and self.is_main:
            print(f"tiertrain: warning: {spike.describe()}; checkpoints saved while it lasts are marked diverged",
                  file=sys.stderr, flush=True)

    def _train_step(self, window: "Window") -> tuple[int, float]:
        """One optimizer step (grad_accum_steps micro-batches); returns this rank's tokens and
        its mean loss."""
        engine, tokens = self.engine, 0
        if self.topology.size("pp") > 1:  # the pipeline schedule runs forward and backward itself
            batches = []
            with window.timing("data"):
                for _ in range(engine.accum):
                    batches.append(next(self.train_batches))
            tokens = sum(count_tokens(b) for b in batches)
            with window.timing("schedule"):
                loss = engine.train_batch(iter(batches))
            window.add_loss(loss, tokens)
            return tokens, float(loss)
        total = 0.0
        for _ in range(engine.accum):
            with window.timing("data"):
                batch = next(self.train_batches)
            tokens += count_tokens(batch)
            with window.timing("forward"):
                loss = engine(batch)
            with window.timing("backward"):
                engine.backward(loss)
            total += float(loss.detach())
        with window.timing("optimizer"):
            engine.step()
        window.add_loss(total / engine.accum, tokens)
        return tokens, total / engine.accum

    def evaluate(self) -> dict[str, float]:
        """Loss and perplexity on up to eval.batches micro-batches per rank of eval_data
        (collective: every data-parallel rank evaluates the same number of batches, so one
        whose data ends first ends the evaluation for all)."""
        if self.eval_data is None:
            raise ConfigError("evaluate() needs eval_data: pass held-out data to the Trainer")
        return held_out_loss(self.engine, self.topology, self.eval_data, self.config, self.collate_fn)

    # -- records -------------------------------------------------------------------------

    def _record(self, window: "Window", step: int, t_start: float, peak_flops: float | None) -> dict[str, Any]:
        engine = self.engine
        report = engine.memory_report()
        cpu, nvme = report.cpu_tier, report.nvme_tier
        times = window.times()
        local = [window.loss_sum, window.steps, window.tokens, report.total, peak_rss_bytes(),
                 report.total - cpu - nvme, cpu, nvme, *times.values()]
        stats = gather_over_dp(local, self.topology, self.replica_group)
        n_time = len(times)
        mean_loss = float(stats[:, 0].sum() / stats[:, 1].sum())
        maxima = stats[:, 3:8].max(dim=0).values.tolist()
        mean_times = (stats[:, 8:8 + n_time].mean(dim=0) / max(window.steps, 1)).tolist()
        elapsed = window.elapsed()
        # Every data-parallel rank's tokens; the pipeline and tensor ranks of a dp coordinate
        # process the same ones.
        tokens_per_s = float(stats[:, 2].sum()) / self.topology.size("cp") / max(elapsed, 1e-9)
        flops_per_rank = self.flops_per_token * tokens_per_s / self.topology.world_size
        record: dict[str, Any] = {
            "step": step,
            "loss": mean_loss,
            "lr": engine.learning_rate(),
            "grad_norm": engine.last_grad_norm,
            "tokens_per_s": tokens_per_s,
            "tflops": flops_per_rank / 1e12 if self.flops_per_token else None,
            "mfu": flops_per_rank / peak_flops if (peak_flops and self.flops_per_token) else None,
            "mem_bytes_per_rank": int(maxima[0]),
            "peak_rss_bytes_per_rank": int(maxima[1]),
            "bytes_device": int(maxima[2]), "bytes_cpu": int(maxima[3]), "bytes_nvme": int(maxima[4]),
            **{f"predicted_bytes_{tier}": b for tier, b in self.predicted_bytes.items()},
            **{f"time_{k}_s": v for k, v in zip(times, mean_times)},
            "loss_scale": float(engine.scaler.scale),
            "skipped": int(engine.skipped_steps),
            "elapsed_s": time.perf_counter() - t_start,
        }
        return record

    def _progress_bar(self, start: int):
        if not (self.is_main and self.config.logging.progress):
            return None
        from tqdm import tqdm

        return tqdm(total=self.config.steps, initial=start, desc="train", unit="step", dynamic_ncols=True,
                    file=sys.stderr)

    def _run_description(self) -> dict[str, Any]:
        from ..config import to_dict

        return {"config": to_dict(self.config), "parameters": self.num_parameters,
                "world_size": self.topology.world_size, "flops_per_token": self.flops_per_token}

    def _summary(self, start: int, elapsed: float, tokens: int) -> dict[str, Any]:
        from ..device import peak_allocated

        train = [r for r in self.records if "loss" in r]
        evals = [r for r in self.records if "eval_loss" in r]
        totals = gather_over_dp([tokens], self.topology, self.dp_group)
        summary = {
            "steps": self.config.steps,
            "steps_run": self.config.steps - start,
            "optimizer_steps": int(self.engine.steps),
            "skipped_steps": int(self.engine.skipped_steps),
            "first_loss": finite_or_none(train[0]["loss"]) if train else None,
            "last_loss": finite_or_none(train[-1]["loss"]) if train else None,
            "eval_loss": finite_or_none(evals[-1]["eval_loss"]) if evals else None,
            "time_s": elapsed,
            "tokens_per_s": float(totals[:, 0].sum()) / max(elapsed, 1e-9),
            "mem_bytes_per_rank": max((r["mem_bytes_per_rank"] for r in train), default=0),
            "peak_rss_bytes_per_rank": max((r["peak_rss_bytes_per_rank"] for r in train), default=0),
            "zero_stage": self.config.zero.stage,
            "precision": self.config.precision.dtype,
            "world_size": self.topology.world_size,
            "dp": self.topology.size("dp"),
            "cp": self.topology.size("cp"),
            "parameters": self.num_parameters,
            "global_batch_size": self.engine.global_batch_size,
        }
        peak_device = peak_allocated(self.topology.device)
        if peak_device is not None:
            summary["cuda_peak_bytes"] = peak_device
        return summary

    # -- checkpoints ---------------------------------------------------------------------

    def _maybe_resume(self) -> int:
        """Continue from the newest committed checkpoint in checkpoint.dir (when resume is on
        and one exists): engine state, data position, run id; returns the step to continue
        after (fresh: _fresh_start). With resume off and checkpoint.overwrite, rank 0 first
        deletes the checkpoints there, so that none can later shadow this run."""
        from ..state import checkpoint

        ckpt = self.config.checkpoint
        if not ckpt.dir:
            return self._fresh_start()
        # Before anything in the directory is cleaned, removed or resumed: one job per directory.
        checkpoint.lock_directory(ckpt.dir, self.engine.topology)
        if self.is_main:
            # What a job killed mid-save left (temporary files, uncommitted step directories):
            # nobody saves yet, and no rank reads those.
            checkpoint.remove_crashed_saves(ckpt.dir, step=None)
        if not ckpt.resume:
            if ckpt.overwrite and self.is_main:
                # The other ranks touch the directory only inside save(), whose first
                # collective rank 0 reaches after this.
                checkpoint.remove_checkpoints(ckpt.dir)
            return self._fresh_start()
        if not checkpoint.marked_steps(ckpt.dir):
            return self._fresh_start()
        # The newest checkpoint intact on every rank, the same for all (newer ones not intact are
        # named in a warning); a CheckpointError naming what is wrong when none is intact.
        step_dir, marker = checkpoint.agree_on_checkpoint(ckpt.dir, None, self.engine.topology)
        saved = checkpoint.peek_extra(step_dir) or {}
        if isinstance(saved.get("model"), dict) and self.fingerprint is not None:
            _compare_fingerprints(saved["model"], self.fingerprint, f"checkpoint {step_dir!r}")
        saved_batch = saved.get("global_batch_size")
        if isinstance(saved_batch, int) and saved_batch != self.engine.global_batch_size:
            dp = self.topology.size("dp")
            raise ConfigError(f"checkpoint {step_dir!r} trained with a global batch of {saved_batch} samples; this run's "
                              f"is {self.engine.global_batch_size} (batch.micro_batch_size × grad_accum_steps × dp="
                              f"{dp}): resuming would change it silently. Choose batch.grad_accum_steps so that "
                              f"micro × accum × dp = {saved_batch} (tiertrain train --resume does it), or start a "
                              f"new run")
        extra = self.engine.load_checkpoint(ckpt.dir, step=marker["step"]) or {}
        if self.is_main:
            print(f"tiertrain: resumed from {step_dir} (step {marker['step']})", flush=True)
        position = extra.get("data", {"sampler": extra["sampler"]} if "sampler" in extra else None)
        if position is not None:
            try:
                self.train_batches.load_state_dict(position)
            except ValueError as e:
                raise ConfigError(f"checkpoint.dir={ckpt.dir!r}: the data order cannot continue: {e}") from None
        if "divergence" in extra:  # (checkpoints saved before the watch had none)
            try:
                self.divergence.load_state_dict(extra["divergence"], f"checkpoint {step_dir!r}")
            except ValueError as e:
                raise checkpoint.CheckpointError(str(e)) from None
        if isinstance(marker.get("run_id"), str):
            self.run_id = marker["run_id"]  # its run continues: keep_last rotates its checkpoints
        return int(extra.get("step", self.engine.steps))

    def _fresh_start(self) -> int:
        """Step 0, or the step of the checkpoint checkpoint.from_deepspeed or .from_dcp names."""
        ckpt, engine = self.config.checkpoint, self.engine
        path, whose = (ckpt.from_deepspeed, "DeepSpeed's") if ckpt.from_deepspeed else (ckpt.from_dcp, "FSDP2's")
        if path:
            (engine.load_deepspeed_checkpoint if ckpt.from_deepspeed else engine.load_dcp_checkpoint)(path)
            if self.is_main:
                print(f"tiertrain: started from {whose} {path!r} at step {engine.steps}", flush=True)
        return engine.steps if path else 0

    def _maybe_save(self, step: int, final: bool) -> None:
        """Save every checkpoint.interval steps (0: only at the end) when checkpoint.dir is
        set, with the step, the data position and the model's fingerprint as extras."""
        ckpt = self.config.checkpoint
        if not ckpt.dir or not (final or (ckpt.interval and step % ckpt.interval == 0)):
            return
        extra = {"step": step, "data": self.train_batches.state_dict(), "divergence": self.divergence.state_dict(),
                 "global_batch_size": self.engine.global_batch_size}
        if self.fingerprint is not None:
            extra["model"] = self.fingerprint
        self.engine.save_checkpoint(ckpt.dir, extra=extra, keep_last=ckpt.keep_last, run_id=self.run_id,
                                    background=ckpt.async_save and not final)
        if self.divergence.spike is not None:
            self._mark_diverged(self.divergence.spike.describe())

    # -- lifetime ------------------------------------------------------------------------

    def close(self) -> None:
        """Collective (every rank): wait for a background save, free the engine's buffers and
        hand the model back whole (Engine.close)."""
        self.engine.close()

    def __enter__(self) -> "Trainer":
        return self

    def __exit__(self, exc_type, exc, traceback) -> None:
        # After an error the other ranks may be anywhere (waiting in a collective for this
        # one): a collective close would hang both. The launcher ends the job and removes
        # the swap files (tiertrain.launch, io.swap_dir's cleanup registry).
        if exc_type is None:
            self.close()
