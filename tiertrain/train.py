"""The ``tiertrain train`` job: a GPT on the bundled corpus (or a token file), trained with
the engine under any ZeRO stage, on every rank of an initialised process group (or in
one process).

:class:`TrainConfig` is the engine's :class:`~tiertrain.config.Config` plus four job
sections (``model``, ``data``, ``steps``, ``seed``), so one command line overrides both::

    tiertrain train --zero.stage 3 --precision.dtype bf16 --model.n_layers 4 --steps 50

:func:`run_training` runs on every rank: it builds the topology, the seeded model, the
dataset and a :class:`~tiertrain.data.ShardedSampler` over the data-parallel axis, wraps
the model and runs ``steps`` optimizer steps with ``engine.train_batch``. Rank 0 shows a
progress bar, appends one JSON record per logged step to ``logging.metrics_file`` and
prints a summary; every rank returns the summary dict.

Logged steps are step 1, every ``logging.log_interval``-th step and the last step. A
record's ``loss`` is the mean over the data-parallel ranks of the mean loss of the steps
since the previous record; ``tokens_per_s`` counts every rank's tokens; memory figures
are the maximum over ranks. Non-finite numbers are written as ``null`` and their keys
listed under ``"non_finite"`` (strict JSON: ``metrics_line``).
A fresh run starts the metrics file afresh; a run resumed from a checkpoint appends.

The model is built with ``tile_factor`` (memory-centric tiling of each block's qkv, fc1,
fc2) and ``activations.*`` (activation checkpointing, tiertrain.offload.activations)
applied. With ``zero.offload: auto`` the planner (tiertrain.estimate.plan) chooses the ZeRO
stage, offload tiers, checkpointing and tiling at start-up for the RAM (and GPU memory)
available then: rank 0 plans and prints the plan, every rank trains with it; when nothing
fits, every rank raises the same ConfigError naming the short tier and by how much.

With ``checkpoint.dir`` set, the job saves (``engine.save_checkpoint``) every
``checkpoint.interval`` steps and at the end, keeping ``checkpoint.keep_last`` of its own
run's checkpoints (a run is identified by the run id in each commit marker: a fresh run
makes one, a resumed run continues the one it resumed; other runs' checkpoints are never
deleted), with the job's step, the sampler's position and the model config as extras; with
``checkpoint.resume`` a run finding a committed checkpoint there continues from it
(``engine.load_checkpoint``, at any data-parallel size or ZeRO stage), after checking that
the model config is the one saved (a ConfigError naming each field that differs). A run
with ``checkpoint.resume: false`` into a directory already holding checkpoints is refused
before it starts, unless ``checkpoint.overwrite: true``: then rank 0 deletes them before
the first step, so that none can later shadow the new run.

Every path the run writes is checked before any process starts (``check_paths``), and
every user mistake is a ConfigError naming the field, the value and what is valid.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import torch
import torch.distributed as dist

from .config import Config, ConfigError, _check_positive, _fail, check_finite
from .data.formats import TEXT_SUFFIXES, RawDtype
from .launch import check_terminated
from .models.gpt import GPT, GPTConfig

__all__ = ["DataConfig", "TrainConfig", "run_training", "check_launch", "default_model", "plan_for_run",
           "apply_plan"]


def default_model() -> GPTConfig:
    """The default job's model: 4 blocks × 192 wide, 6 heads, seq_len 128 (~1.85M parameters).

    Sized so that the default ``tiertrain train`` (2 gloo processes on a 2-core CPU, 250
    steps) takes one to two minutes while the byte-level loss falls from ln 256 ≈ 5.5 to
    below 2.5. The "small" preset (6 × 256, ~4.8M parameters) learns about as much per
    step but takes 2-3× longer per step there: ``--model.n_layers 6 --model.hidden 256
    --model.n_heads 8``.
    """
    return GPTConfig(n_layers=4, hidden=192, n_heads=6, seq_len=128)


@dataclass
class DataConfig:
    path: str = ""
    """Data to train on, its format read from the file: .npy token array (1-D or 2-D), raw token file (.bin, data.dtype), .txt or .jsonl text (tokenised), a datasets save_to_disk directory; empty uses the bundled corpus."""
    dtype: RawDtype = "uint16"
    """Token dtype of a raw headerless little-endian data.path (nanoGPT .bin); a .npy file's own header gives its dtype."""
    tokenizer: str = ""
    """tokenizer.json (Hugging Face tokenizers) for a .txt/.jsonl data.path; empty tokenises text as UTF-8 bytes."""
    text_field: str = "text"
    """Field of each JSONL line (column of a datasets directory) that holds the text."""
    cache_dir: str = "runs/cache"
    """Directory where the bundled corpus and text data.path files are tokenised (once, keyed by content and tokenizer)."""
    seed: int = 0
    """Seed of the sample order: epoch e is shuffled with seed + e."""
    shuffle: bool = True
    """Shuffle the samples every epoch; false reads them in file order."""

    def validate(self, path: str = "data") -> None:
        _check_positive(f"{path}.seed", self.seed, allow_zero=True)
        if self.dtype not in get_args(RawDtype):  # (the loader checks this; a config built in code is checked here)
            _fail(f"{path}.dtype", self.dtype, "one of " + ", ".join(map(repr, get_args(RawDtype))))
        if not self.text_field:
            _fail(f"{path}.text_field", self.text_field, "the name of the JSONL field holding the text, e.g. 'text'")
        if self.tokenizer and not self.path:
            raise ConfigError(f"{path}.tokenizer={self.tokenizer!r} is invalid with {path}.path='': the bundled "
                              f"corpus is byte-tokenised; expected a .txt or .jsonl {path}.path, or tokenizer=''")
        if not self.cache_dir and (not self.path or self.path.lower().endswith(TEXT_SUFFIXES)):
            raise ConfigError(f"{path}.cache_dir='' is invalid: the bundled corpus (data.path='') and text "
                              f"files need a cache directory to hold their tokens")


@dataclass
class TrainConfig(Config):
    """A training job: the engine's Config sections plus the model, the data and the run length."""

    model: GPTConfig = field(default_factory=default_model)
    """The GPT to train (fields of tiertrain.models.gpt.GPTConfig)."""
    data: DataConfig = field(default_factory=DataConfig)
    """Training data and its sample order."""
    steps: int = 250
    """Optimizer steps to run (each of batch.grad_accum_steps micro-batches per rank)."""
    seed: int = 0
    """Seed of the model initialisation (the same on every rank)."""
    tile_factor: int = 1
    """Memory-centric tiling: each block's qkv, fc1 and fc2 run as this many tiles, each its own stage-3 unit (1 = off)."""

    def validate(self) -> "TrainConfig":
        check_finite(self)
        for f in dataclasses.fields(Config):
            getattr(self, f.name).validate(f.name)
        hidden, heads = self.model.hidden, self.model.n_heads
        if all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (hidden, heads)) \
                and hidden % heads:
            # Named here rather than by GPTConfig, which blames hidden for what is usually a
            # head count chosen without the width in mind (hidden is the default 192).
            divisors = [d for d in range(1, hidden + 1) if hidden % d == 0][:12]
            raise ConfigError(f"model.n_heads={heads} is invalid with model.hidden={hidden}: expected a divisor "
                              f"of hidden, e.g. {', '.join(map(str, divisors))} (or a hidden divisible by {heads})")
        try:
            self.model.validate()
        except ValueError as e:  # GPTConfig names fields "GPTConfig.x"; the command line says model.x
            raise ConfigError(str(e).replace("GPTConfig.", "model.", 1)) from None
        self.data.validate("data")
        _check_positive("steps", self.steps)
        _check_positive("seed", self.seed, allow_zero=True)
        _check_positive("tile_factor", self.tile_factor)
        if self.tile_factor > self.model.hidden:
            raise ConfigError(f"tile_factor={self.tile_factor} is invalid: expected 1..model.hidden "
                              f"({self.model.hidden}; a tile needs at least one output feature)")
        if self.activations.checkpoint_every > self.model.n_layers:
            raise ConfigError(f"activations.checkpoint_every={self.activations.checkpoint_every} is invalid: "
                              f"the model has {self.model.n_layers} blocks; expected 0 (off) or "
                              f"1..{self.model.n_layers}")
        return self

    def engine_config(self) -> Config:
        """The plain engine Config (the sections wrap() reads)."""
        return Config(**{f.name: getattr(self, f.name) for f in dataclasses.fields(Config)})


def check_launch(cfg: TrainConfig, world_size: int) -> None:
    """ConfigError now, before any process starts, for what would fail on every rank later."""
    pp, dp, tp = cfg.parallel.resolve(world_size)
    if tp > 1 and cfg.tile_factor > 1:
        raise ConfigError(f"tile_factor={cfg.tile_factor} with parallel.tp={tp}: tiling a tensor-parallel "
                          f"model is not supported; valid: tile_factor=1")
    cfg.batch.resolve(dp)
    if tp > 1:  # each tensor-parallel rank holds whole heads and equal slices (tiertrain/parallel)
        for name, value in (("model.n_heads", cfg.model.n_heads), ("model.vocab_size", cfg.model.vocab_size),
                            ("model.ffn_mult × model.hidden", cfg.model.ffn_hidden)):
            if value % tp:
                raise ConfigError(f"{name}={value} is invalid with parallel.tp={tp}: expected a multiple of {tp} "
                                  f"(each tensor-parallel rank holds an equal share)")
    if cfg.data.path:
        _check_data(cfg, dp)
    check_paths(cfg)


def _check_data(cfg: TrainConfig, dp: int) -> None:
    """What every rank would refuse later, now: data.path opened and scanned (format, dtype,
    token ids against model.vocab_size, length against model.seq_len; text is tokenised
    into data.cache_dir here, once), and at least one sample per data-parallel rank."""
    samples = len(_build_dataset(cfg))
    if samples < max(dp, 1):
        raise ConfigError(f"data.path={cfg.data.path!r} is invalid: its {samples} samples of model.seq_len="
                          f"{cfg.model.seq_len} + 1 tokens are too few: expected at least {max(dp, 1)} (one per "
                          f"data-parallel rank): more data or a shorter seq_len")


def _writable_dir(field_name: str, value: str, directory: str) -> None:
    """ConfigError unless directory is, or can be created as, a directory this process may
    write in (the nearest existing ancestor is a writable directory)."""
    path = os.path.abspath(directory)
    if os.path.exists(path):
        if not os.path.isdir(path):
            raise ConfigError(f"{field_name}={value!r} is invalid: {path!r} is a file, expected a directory")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ConfigError(f"{field_name}={value!r} is invalid: the directory {path!r} is not writable")
        return
    parent = os.path.dirname(path)
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise ConfigError(f"{field_name}={value!r} is invalid: {parent!r} is a file, so no directory can be "
                          f"created below it; expected a directory path")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{field_name}={value!r} is invalid: {path!r} cannot be created, {parent!r} is not "
                          f"writable")


def check_paths(cfg: TrainConfig) -> None:
    """Every path the run writes (checkpoint.dir, logging.metrics_file, zero.nvme_path,
    data.cache_dir) is usable, and the checkpoint directory holds no other run's checkpoints
    unless told what to do with them: a ConfigError naming the field before the first step
    (a checkpoint.dir that is a file used to fail at the first save, after the training)."""
    from .checkpoint import marked_steps

    ckpt = cfg.checkpoint
    if ckpt.dir:
        _writable_dir("checkpoint.dir", ckpt.dir, ckpt.dir)
        existing = marked_steps(ckpt.dir)
        if existing and not ckpt.resume and not ckpt.overwrite:
            shown = ", ".join(map(str, existing[:5])) + (", ..." if len(existing) > 5 else "")
            raise ConfigError(f"checkpoint.dir={ckpt.dir!r} already holds committed checkpoints (steps {shown}) "
                              f"and checkpoint.resume=false: set checkpoint.resume=true to continue that run, "
                              f"checkpoint.overwrite=true to delete them, or another checkpoint.dir")
    metrics = cfg.logging.metrics_file
    if metrics:
        if os.path.isdir(metrics):
            raise ConfigError(f"logging.metrics_file={metrics!r} is invalid: it is a directory, expected a file "
                              f"path (e.g. {os.path.join(metrics, 'metrics.jsonl')!r})")
        if os.path.exists(metrics) and not os.access(metrics, os.W_OK):
            raise ConfigError(f"logging.metrics_file={metrics!r} is invalid: the file is not writable")
        _writable_dir("logging.metrics_file", metrics, os.path.dirname(os.path.abspath(metrics)))
    if cfg.zero.nvme_path and ("nvme" in (cfg.zero.offload_optimizer, cfg.zero.offload_params)
                               or cfg.zero.offload == "auto"):
        _writable_dir("zero.nvme_path", cfg.zero.nvme_path, cfg.zero.nvme_path)
    if not cfg.data.path:
        _writable_dir("data.cache_dir", cfg.data.cache_dir, cfg.data.cache_dir)


# ---------------------------------------------------------------------------------------


def _peak_rss_bytes() -> int:
    """Peak resident set size of this process (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak) if sys.platform == "darwin" else int(peak) * 1024


def _json_safe(record: dict[str, Any]) -> dict[str, Any]:
    """record with each non-finite float as None, and those keys listed under "non_finite"
    (absent when there are none): strict JSON has no NaN or Infinity."""
    flagged = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    if not flagged:
        return dict(record)
    return {**{k: None if k in flagged else v for k, v in record.items()}, "non_finite": flagged}


def metrics_line(record: dict[str, Any]) -> str:
    """One metrics-file line: record as strict JSON (see _json_safe; allow_nan=False makes
    any non-finite number left over an error here rather than an unreadable file)."""
    return json.dumps(_json_safe(record), allow_nan=False)


def _human(n: float) -> str:
    from .estimate.report import human_bytes

    return human_bytes(n)


_NOT_COMPARED = ("init_std",)
"""GPTConfig fields a resume may change: they act only when the model is first built."""


def model_fingerprint(model: GPTConfig) -> dict[str, Any]:
    """The model config as saved in each checkpoint's extras (JSON-like) and compared on resume."""
    return dataclasses.asdict(model)


def _compare_models(saved: dict, now: GPTConfig, where: str) -> None:
    """ConfigError naming each model field the checkpoint was saved with that differs now.
    The layout check at load compares tensor shapes only, so n_heads 2 → 4 at the same width
    would otherwise continue silently with another model."""
    current = model_fingerprint(now)
    diffs = [f"model.{k}: {saved[k]!r} in the checkpoint, {current[k]!r} now"
             for k in current if k in saved and k not in _NOT_COMPARED and saved[k] != current[k]]
    if diffs:
        raise ConfigError(f"{where} was saved with another model ({'; '.join(diffs)}): resume with the "
                          f"checkpoint's model settings, or start a new run in another checkpoint.dir")


def _maybe_resume(engine, cfg: TrainConfig, sampler) -> tuple[int, str]:
    """Resume from the newest committed checkpoint in checkpoint.dir (when resume is on and
    one exists): the engine restores its state, the sampler its position. Returns the step
    to continue after (0 for a fresh start) and the run id the checkpoints are saved under:
    the resumed checkpoint's (its run continues, and keep_last rotates its checkpoints) or a
    new one. With resume off and checkpoint.overwrite, rank 0 first deletes the checkpoints
    already there (check_paths refused the run otherwise), so none can shadow this run."""
    import uuid

    from . import checkpoint

    new_run = uuid.uuid4().hex  # rank 0's is the one written into the commit markers
    ckpt = cfg.checkpoint
    if not (ckpt.dir and hasattr(engine, "load_checkpoint")):
        return 0, new_run
    if not dist.is_initialized() or dist.get_rank() == 0:
        # What a job killed mid-save left (temporary files, uncommitted step directories):
        # nobody saves yet, and no rank reads those.
        checkpoint.remove_crashed_saves(ckpt.dir, step=None)
    if not ckpt.resume:
        if ckpt.overwrite and (not dist.is_initialized() or dist.get_rank() == 0):
            # The other ranks touch the directory only inside save(), whose first collective
            # rank 0 reaches after this.
            checkpoint.remove_checkpoints(ckpt.dir)
        return 0, new_run
    if not checkpoint.marked_steps(ckpt.dir):
        return 0, new_run
    # The newest intact checkpoint (newer ones with a corrupt marker are named in a warning);
    # a CheckpointError naming the markers when none is intact, rather than a silent fresh start.
    step_dir, marker = checkpoint.find_committed(ckpt.dir)
    saved = checkpoint.peek_extra(step_dir) or {}
    if isinstance(saved.get("model"), dict):
        _compare_models(saved["model"], cfg.model, f"checkpoint {step_dir!r}")
    extra = engine.load_checkpoint(ckpt.dir) or {}
    if "sampler" in extra:
        try:
            sampler.load_state_dict(extra["sampler"])
        except ValueError as e:
            raise ConfigError(f"checkpoint.dir={ckpt.dir!r}: the data order cannot continue: {e}") from None
    run_id = marker.get("run_id")
    return int(extra.get("step", engine.steps)), run_id if isinstance(run_id, str) else new_run


def _maybe_save(engine, cfg: TrainConfig, step: int, sampler, final: bool, run_id: str | None = None) -> None:
    """Save every checkpoint.interval steps (0: only at the end) when checkpoint.dir is set;
    the job's step, the sampler's position and the model config travel as the checkpoint's
    extras; keep_last rotates the checkpoints of run run_id only."""
    if not (cfg.checkpoint.dir and hasattr(engine, "save_checkpoint")):
        return
    interval = cfg.checkpoint.interval
    if final or (interval and step % interval == 0):
        engine.save_checkpoint(cfg.checkpoint.dir, extra={"step": step, "sampler": sampler.state_dict(),
                                                          "model": model_fingerprint(cfg.model)},
                               keep_last=cfg.checkpoint.keep_last, run_id=run_id,
                               background=cfg.checkpoint.async_save and not final)


def _build_dataset(cfg: TrainConfig, check_ids: bool = True):
    """data.path in its format (tiertrain.data.formats; a ConfigError for bad data), or the
    bundled corpus. check_ids=False skips the token-id scan that check_launch just ran."""
    from .data import bundled_dataset, open_token_dataset

    d = cfg.data
    if d.path:
        return open_token_dataset(d.path, seq_len=cfg.model.seq_len, vocab_size=cfg.model.vocab_size, dtype=d.dtype,
                                  tokenizer=d.tokenizer, text_field=d.text_field, cache_dir=d.cache_dir,
                                  check_ids=check_ids)
    return bundled_dataset(cfg.model.seq_len, cfg.data.cache_dir)


def build_model(cfg: TrainConfig, topology=None) -> GPT:
    """The job's GPT, tiled (tile_factor) and with activation checkpointing applied
    (activations.checkpoint_every / offload), ready for wrap(). At ZeRO stage 3 (untiled)
    it is built directly in partitioned form, so no rank ever holds the whole model."""
    import contextlib

    from .zero.construct import partitioned_init

    device = topology.device if topology is not None else None
    tp = topology.size("tp") if topology is not None else 1
    partitioned = topology is not None and cfg.zero.stage == 3 and cfg.tile_factor == 1 and tp == 1
    with partitioned_init(topology) if partitioned else contextlib.nullcontext():
        model = GPT(cfg.model)
    if tp > 1:  # Megatron tensor parallelism; pipeline stages are cut by wrap() (parallel.pp)
        from .parallel import apply_tensor_parallel

        apply_tensor_parallel(model, topology)
    if cfg.tile_factor > 1:
        from .estimate.peak import tile_plan
        from .tiling import apply_tiling

        apply_tiling(model, tile_plan(cfg.tile_factor))
    if cfg.activations.checkpoint_every > 0:
        from .offload.activations import apply_activation_checkpointing

        apply_activation_checkpointing(model, cfg.activations, device=device)
    return model


# --------------------------------------------------------------------------- zero.offload: auto


def apply_plan(cfg: TrainConfig, plan) -> TrainConfig:
    """cfg with the plan's stage, tiers, checkpointing and tiling (zero.offload becomes
    "manual": the choice is made); ConfigError when this version cannot run it."""
    from .config import from_dict, merge, to_dict

    chosen = plan.config_dict()
    chosen.pop("model", None)  # the job's own model (the plan was made for it)
    chosen["zero"]["offload"] = "manual"
    if "nvme_path" in chosen["zero"] and not chosen["zero"]["nvme_path"]:
        chosen["zero"]["nvme_path"] = cfg.zero.nvme_path
    return from_dict(TrainConfig, merge(to_dict(cfg), chosen)).validate()


def _local_ranks(world_size: int) -> int:
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", world_size)))
    except ValueError:
        return world_size


def plan_for_run(cfg: TrainConfig, world_size: int, device: torch.device | None = None,
                 probe_path: str | None = None):
    """The planner's choice for this job (tiertrain.estimate.plan) on this machine now:
    host RAM available (MemAvailable, capped by a cgroup limit), free device memory with
    CUDA, the free space of zero.nvme_path as the NVMe tier (none when it is empty), and
    the bandwidths, compute peak and process overhead of a probe file when one exists
    (``probe_path``, default $TIERTRAIN_PROBE or runs/hardware_probe.json). Only layouts
    this version's config accepts are chosen."""
    import shutil

    from .estimate import ModelDims
    from .estimate.plan import Hardware, plan
    from .estimate.probe import HardwareProbe, _cgroup_memory_limit, read_meminfo

    local = _local_ranks(world_size)
    nodes = max(1, world_size // local)
    path = probe_path or os.environ.get("TIERTRAIN_PROBE") or "runs/hardware_probe.json"
    mem = read_meminfo()
    available = mem.get("MemAvailable", mem.get("MemFree", 0))
    limit = _cgroup_memory_limit()
    available = min(available, limit) if limit else available
    if os.path.isfile(path):
        hw = Hardware.from_probe(HardwareProbe.load(path), ranks_per_node=local, nodes=nodes)
        hw.source = f"probe file {path}, RAM available now"
    else:
        hw = Hardware(ranks_per_node=local, nodes=nodes, host_memory=available, source="this machine now")
    hw.host_memory = available
    if device is not None:
        from .device import free_memory
        hw.device_memory = free_memory(device)  # (None on the CPU)
    hw.swap_dir = cfg.zero.nvme_path or None
    hw.nvme_bytes = shutil.disk_usage(cfg.zero.nvme_path).free if cfg.zero.nvme_path and \
        os.path.isdir(cfg.zero.nvme_path) else None

    def allowed(layout) -> str | None:
        from .estimate.plan import Plan

        stub = Plan(True, dims, layout, None, hw, {}, {}, None, "")
        try:
            apply_plan(cfg, stub)
        except (ConfigError, ValueError) as e:
            return str(e)
        return None

    dims = ModelDims.from_gpt_config(cfg.model)
    return plan(dims, hw, micro_batch=cfg.batch.micro_batch_size, precision=cfg.precision.dtype,
                bucket_mb=cfg.zero.bucket_mb, allowed=allowed)


def _resolve_auto(cfg: TrainConfig, topology) -> TrainConfig:
    """zero.offload=auto: rank 0 plans, every rank applies the same plan (or raises the same
    ConfigError naming what is short); rank 0 prints the plan."""
    from .estimate.plan import render_plan, short_message

    message: list[Any] = [None]
    if topology.rank == 0:
        try:
            chosen = plan_for_run(cfg, topology.world_size, topology.device)
            if chosen.fits:
                message[0] = ("ok", apply_plan(cfg, chosen), render_plan(chosen))
            else:
                message[0] = ("error", "zero.offload='auto': " + short_message(chosen), render_plan(chosen))
        except (ConfigError, ValueError) as e:
            message[0] = ("error", f"zero.offload='auto': {e}", "")
    if dist.is_initialized() and topology.world_size > 1:
        dist.broadcast_object_list(message, src=0)
    kind, value, table = message[0]
    if topology.rank == 0 and table:
        print("tiertrain: zero.offload=auto, the planner's choice:\n" + table.rstrip(), flush=True)
    if kind == "error":
        raise ConfigError(value)
    return value


def _gather_stats(values: list[float], topology, group) -> torch.Tensor:
    """[dp, len(values)] tensor of every data-parallel rank's values (one collective)."""
    local = torch.tensor(values, dtype=torch.float64, device=topology.device)
    if group is None or not dist.is_initialized() or topology.size("dp") == 1:
        return local.unsqueeze(0)
    parts = [torch.empty_like(local) for _ in range(topology.size("dp"))]
    dist.all_gather(parts, local, group=group)
    return torch.stack(parts)


def run_training(cfg: TrainConfig) -> dict[str, Any]:
    """Train cfg on this rank (inside an initialised process group, or alone); see the
    module docstring. Returns the summary dict (the same keys on every rank)."""
    from .data import ShardedSampler, micro_batches
    from .wrapping import wrap
    from .topology import Topology

    cfg.validate()
    topology = Topology.build(cfg.parallel)
    check_launch(cfg, topology.world_size)
    is_main = topology.rank == 0
    dp_group = topology.group("dp")
    if cfg.zero.offload == "auto":
        cfg = _resolve_auto(cfg, topology)

    torch.manual_seed(cfg.seed)
    model = build_model(cfg, topology)
    n_params = cfg.model.num_parameters()
    dataset = _build_dataset(cfg, check_ids=False)  # (check_launch above scanned the same file)
    sampler = ShardedSampler(len(dataset), topology.size("dp"), topology.coord("dp"),
                             seed=cfg.data.seed, shuffle=cfg.data.shuffle)
    engine = wrap(model, cfg.engine_config(), topology)
    start_step, run_id = _maybe_resume(engine, cfg, sampler)
    batches = micro_batches(dataset, sampler, cfg.batch.micro_batch_size)
    tokens_per_step = engine.global_batch_size * cfg.model.seq_len

    metrics = None
    if is_main and cfg.logging.metrics_file:
        path = Path(cfg.logging.metrics_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        metrics = open(path, "a" if start_step > 0 else "w")  # a fresh run starts a fresh file

    bar = None
    if is_main and cfg.logging.progress:
        from tqdm import tqdm

        bar = tqdm(total=cfg.steps, initial=start_step, desc="train", unit="step",
                   dynamic_ncols=True, file=sys.stderr)
    if is_main:
        print(f"tiertrain: {n_params:,} parameters | zero.stage={cfg.zero.stage} | "
              f"{cfg.precision.dtype} | world_size={topology.world_size} (dp={topology.size('dp')}) | "
              f"global batch {engine.global_batch_size} × {cfg.model.seq_len} tokens | "
              f"{cfg.steps - start_step} steps", flush=True)

    records: list[dict[str, Any]] = []
    peak_mem = peak_rss = 0
    window_loss, window_n = 0.0, 0
    t_start = t_last = time.perf_counter()
    last_logged_step = start_step
    try:
        for step in range(start_step + 1, cfg.steps + 1):
            check_terminated()  # (a SIGTERM whose Terminated something below swallowed)
            loss = engine.train_batch(batches)
            window_loss += loss
            window_n += 1
            final = step == cfg.steps
            if step == start_step + 1 or step % cfg.logging.log_interval == 0 or final:
                now = time.perf_counter()
                stats = _gather_stats([window_loss, window_n, engine.memory_report().total,
                                       _peak_rss_bytes()], topology, dp_group)
                mean_loss = float(stats[:, 0].sum() / stats[:, 1].sum())
                mem, rss = int(stats[:, 2].max()), int(stats[:, 3].max())
                peak_mem, peak_rss = max(peak_mem, mem), max(peak_rss, rss)
                record = {
                    "step": step,
                    "loss": mean_loss,
                    "lr": engine.learning_rate(),
                    "grad_norm": engine.last_grad_norm,
                    "tokens_per_s": tokens_per_step * (step - last_logged_step) / max(now - t_last, 1e-9),
                    "mem_bytes_per_rank": mem,
                    "peak_rss_bytes_per_rank": rss,
                    "loss_scale": float(engine.scaler.scale),
                    "skipped": int(engine.skipped_steps),
                    "elapsed_s": now - t_start,
                }
                records.append(_json_safe(record))  # (the summary's losses: None when not finite)
                if metrics is not None:
                    metrics.write(metrics_line(record) + "\n")
                    metrics.flush()
                if bar is not None:
                    bar.set_postfix(loss=f"{mean_loss:.3f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                                    mem_rank=_human(mem), refresh=False)
                window_loss, window_n = 0.0, 0
                t_last, last_logged_step = now, step
            if bar is not None:
                bar.update(1)
            _maybe_save(engine, cfg, step, sampler, final, run_id)
    finally:
        if bar is not None:
            bar.close()
        if metrics is not None:
            metrics.close()

    elapsed = time.perf_counter() - t_start
    steps_run = cfg.steps - start_step
    summary = {
        "steps": cfg.steps,
        "steps_run": steps_run,
        "optimizer_steps": int(engine.steps),
        "skipped_steps": int(engine.skipped_steps),
        "first_loss": records[0]["loss"] if records else None,
        "last_loss": records[-1]["loss"] if records else None,
        "time_s": elapsed,
        "tokens_per_s": tokens_per_step * steps_run / max(elapsed, 1e-9),
        "mem_bytes_per_rank": peak_mem,
        "peak_rss_bytes_per_rank": peak_rss,
        "zero_stage": cfg.zero.stage,
        "precision": cfg.precision.dtype,
        "world_size": topology.world_size,
        "dp": topology.size("dp"),
        "parameters": n_params,
        "global_batch_size": engine.global_batch_size,
    }
    from .device import peak_allocated
    peak_device = peak_allocated(topology.device)
    if peak_device is not None:
        summary["cuda_peak_bytes"] = peak_device
    if is_main:
        print(format_summary(summary), flush=True)
    return summary


def format_summary(s: dict[str, Any]) -> str:
    """The human-readable end-of-run summary."""
    def loss(x):
        return "n/a" if x is None else f"{x:.3f}"

    lines = [
        "training done",
        f"  steps        {s['steps_run']} run, {s['steps']} total ({s['skipped_steps']} skipped)",
        f"  loss         {loss(s['first_loss'])} -> {loss(s['last_loss'])} (first -> last logged)",
        f"  time         {s['time_s']:.1f} s",
        f"  throughput   {s['tokens_per_s']:,.0f} tokens/s (all ranks)",
        f"  memory/rank  {_human(s['mem_bytes_per_rank'])} model states, "
        f"{_human(s['peak_rss_bytes_per_rank'])} peak RSS"
        + (f", {_human(s['cuda_peak_bytes'])} peak CUDA" if "cuda_peak_bytes" in s else ""),
        f"  zero.stage   {s['zero_stage']} ({s['precision']})",
        f"  world size   {s['world_size']} (dp={s['dp']})",
    ]
    return "\n".join(lines)
