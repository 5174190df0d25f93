"""A DeepSpeed config (``ds_config.json``) as a tiertrain config (issue 35, item 1):
``tiertrain train --deepspeed ds.json``, ``tiertrain config --from-deepspeed ds.json``,
:func:`from_deepspeed` and ``TiertrainTrainer(..., deepspeed=...)``.

Every key of the file gets one of three fates, all listed in docs/deepspeed.md:

* **mapped** to the tiertrain field with the same meaning, sizes converted (DeepSpeed counts
  buffer sizes in elements, tiertrain in MiB);
* **no effect**, where tiertrain always does what the key asks for (``overlap_comm``,
  ``contiguous_gradients``) or the key tunes a mechanism tiertrain does not have (a reuse
  distance, a pinned-memory switch); the value is read, checked, and said in the banner;
* **refused**, with the reason, where honouring it would need a mechanism tiertrain lacks
  (1-bit Adam, quantised weights, MiCS): a ConfigError names every such key at once.

The file means what it means to DeepSpeed: a key it leaves out takes DeepSpeed's default, not
tiertrain's (no ``gradient_clipping`` is no clipping; ``weight_decay`` decays every parameter;
no ``scheduler`` is a constant rate; no ``zero_optimization`` is stage 0). ``"auto"``, as in
the configs transformers documents, keeps tiertrain's own value for the field (the CLI's
flag or default; under the Hugging Face Trainer, TrainingArguments').
"""
from __future__ import annotations

import json
import os
from typing import Any

from .config import ConfigError
from .deepspeed_fates import AUTO, Translation, checked_number, is_auto, mapped, no_effect, params_of, refuse_unless
from .deepspeed_schedule import scheduler, scheduler_peak

MiB = 2 ** 20


def read_deepspeed(source: str | os.PathLike | dict) -> dict:
    """The config as a dict: a dict as given, or a JSON file's content."""
    if isinstance(source, dict):
        return source
    path = os.fspath(source)
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--deepspeed={path!r} does not exist: expected a DeepSpeed JSON config") from None
    except OSError as e:
        raise ConfigError(f"--deepspeed={path!r} cannot be read: {e.strerror or e}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"--deepspeed={path!r} is not valid JSON: {e}") from None
    except RecursionError:
        raise ConfigError(f"--deepspeed={path!r} nests its values deeper than a JSON config's few levels") from None
    if not isinstance(data, dict):
        raise ConfigError(f"--deepspeed={path!r} holds a {type(data).__name__}, expected a JSON object of config keys")
    return data


def from_deepspeed(source: str | os.PathLike | dict, dtype: str = "fp32") -> Translation:
    """Translate a DeepSpeed config (see the module docstring); ConfigError naming every key
    that cannot be honoured, or whose value is not one DeepSpeed accepts either. dtype: the
    compute dtype where the config says "auto" (it sizes the parameter buffers it converts)."""
    t = Translation()
    ds = t.source = _former_names(read_deepspeed(source), t)
    t.peak = scheduler_peak(ds.get("scheduler"))
    precision = _precision(ds) or dtype
    itemsize = 4 if precision == "fp32" else 2
    for key, value in ds.items():
        handler = _TOP.get(key)
        if isinstance(key, str) and key.startswith("_"):
            t.no_effect(key, "a comment (DeepSpeed reads no key that starts with _)")
        elif handler is None:
            t.refuse(key, "not a DeepSpeed config key tiertrain knows (a typo, or a feature it does not have)")
        elif handler is not _SKIP:
            handler(t, key, value)
    _zero(ds.get("zero_optimization"), t, itemsize)
    for key in _left_to_derive(ds):
        t.fates.append((f"{key} (absent)", "derived when the run starts from train_batch_size and the "
                                           "data-parallel size, as DeepSpeed derives it"))
    if "gradient_clipping" not in ds:
        t.set("gradient_clipping (absent)", "optimizer.grad_clip", 0.0, "DeepSpeed's default: no clipping")
    if "scheduler" not in ds:
        t.set("scheduler (absent)", "schedule.warmup_steps", 0, "DeepSpeed's default: a constant rate")
        t.set("scheduler (absent)", "schedule.decay_steps", 0)
    if t.refused:
        raise ConfigError("the DeepSpeed config has keys tiertrain cannot honour: "
                          + "; ".join(f"{k}: {why}" for k, why in t.refused)
                          + " (docs/deepspeed.md lists every key and its fate)")
    return t


_BATCH_FIELDS = {"train_micro_batch_size_per_gpu": "micro_batch_size",
                 "gradient_accumulation_steps": "grad_accum_steps"}
"""DeepSpeed's batch keys besides train_batch_size → the BatchConfig field each is."""


def _left_to_derive(ds: dict) -> list[str]:
    """The batch keys a DeepSpeed config leaves out beside an explicit train_batch_size (an
    "auto" one is tiertrain's own value, given)."""
    if "train_batch_size" not in ds or is_auto(ds["train_batch_size"]):
        return []
    return [k for k in _BATCH_FIELDS if k not in ds]


def derive_batch(batch, dp: int, source: str | os.PathLike | dict, overridden=()) -> list[str]:
    """A DeepSpeed config's train_batch_size with the micro-batch size or the accumulation left
    out: the missing one derived from the data-parallel size, as DeepSpeed's engine derives it
    when it starts (train_batch_size alone: accumulation 1), set in ``batch`` (a BatchConfig).
    A field in ``overridden`` (set on the command line) is kept, and the sizes must then agree.
    Returns the lines to say; ConfigError where the sizes do not divide, as DeepSpeed refuses them."""
    if not batch.global_batch_size:
        return []
    missing = [(k, _BATCH_FIELDS[k]) for k in _left_to_derive(read_deepspeed(source))
               if _BATCH_FIELDS[k] not in overridden]
    if not missing:
        return []
    lines = []
    if len(missing) == 2:  # (DeepSpeed: accumulation 1, the micro-batch what is left)
        batch.grad_accum_steps = 1
        lines.append("DeepSpeed's gradient_accumulation_steps (absent beside train_batch_size alone): "
                     "batch.grad_accum_steps = 1")
    key, field = missing[0]  # (with both missing: the micro-batch)
    other_key, other = next((k, getattr(batch, f)) for k, f in _BATCH_FIELDS.items() if f != field)
    per_sample = other * dp
    if batch.global_batch_size % per_sample:
        raise ConfigError(f"DeepSpeed train_batch_size={batch.global_batch_size} is not a multiple of "
                          f"{other_key}={other} × {dp} data-parallel ranks, so {key} cannot be derived (DeepSpeed "
                          f"refuses it too): give {key}, or a train_batch_size that {other * dp} divides")
    setattr(batch, field, batch.global_batch_size // per_sample)
    lines.append(f"DeepSpeed's {key} (absent): batch.{field} = {getattr(batch, field)} = train_batch_size "
                 f"{batch.global_batch_size} / ({other_key} {other} × {dp} data-parallel ranks), as DeepSpeed "
                 f"derives it")
    return lines


# -- the sections ----------------------------------------------------------------------------------


def _former_names(ds: dict, t: Translation) -> dict:
    """ds with its top-level keys under their current names: DeepSpeed reads ``bfloat16`` (bf16's
    former name) where ``bf16`` is absent, and ignores it beside one."""
    if "bfloat16" not in ds:
        return ds
    if "bf16" in ds:
        t.no_effect("bfloat16", "DeepSpeed reads bf16's former name only where bf16 is absent")
        return {k: v for k, v in ds.items() if k != "bfloat16"}
    t.fates.append(("bfloat16", "read as bf16 (its former name), as DeepSpeed reads it"))
    return {("bf16" if k == "bfloat16" else k): v for k, v in ds.items()}


def _averaged_either_way(t: Translation, key: str, value: Any) -> None:
    """prescale_gradients and gradient_predivide_factor: where DeepSpeed divides the gradients
    by the ranks (or by a factor, then by ranks/factor), before or after the sum. The mean is
    the same; tiertrain sums in fp32, where the 16-bit overflow these guard against cannot occur."""
    if key == "prescale_gradients" and not isinstance(value, bool):
        raise ConfigError(f"DeepSpeed {key}={value!r} is invalid: expected true or false")
    if key == "gradient_predivide_factor" and not is_auto(value):
        number = checked_number(key, value)
        if number <= 0:
            raise ConfigError(f"DeepSpeed {key}={value!r} is invalid: expected a number > 0")
    t.no_effect(key, f"{value!r}: gradients are summed in fp32 and averaged over the data-parallel ranks either "
                     f"way (dividing before the sum guards a 16-bit sum against overflow; the mean is the same)")


def _data_types(t: Translation, key: str, value: Any) -> None:
    """Only grad_accum_dtype, and only what tiertrain does: fp32 (or DeepSpeed's default, null)."""
    if not isinstance(value, dict):
        raise ConfigError(f"DeepSpeed {key}={value!r} is invalid: expected an object")
    for sub, v in value.items():
        if sub == "grad_accum_dtype" and v in (None, "fp32"):
            t.no_effect(f"{key}.{sub}", f"{v!r}: gradients accumulate in fp32")
        else:
            t.refuse(f"{key}.{sub}", f"{v!r}: gradients accumulate in fp32" if sub == "grad_accum_dtype"
                     else "not a data_types key tiertrain knows")


def _precision(ds: dict) -> str | None:
    """The dtype the config asks for; None when it says "auto"."""
    enabled = {k: ds[k].get("enabled") if isinstance(ds.get(k), dict) else None for k in ("fp16", "bf16")}
    on = [k for k, v in enabled.items() if v is True]
    if len(on) > 1:
        raise ConfigError("DeepSpeed fp16.enabled and bf16.enabled are both true: expected at most one")
    if on:
        return on[0]
    return None if AUTO in enabled.values() else "fp32"


def _fp16(t: Translation, key: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ConfigError(f"DeepSpeed {key}={value!r} is invalid: expected an object")
    on = value.get("enabled") is True or is_auto(value.get("enabled"))
    if is_auto(value.get("enabled")):
        t.fates.append((f"{key}.enabled", "auto: tiertrain's precision.dtype"))
    elif on:
        t.set(f"{key}.enabled", "precision.dtype", key, "fp32 masters and optimizer state, as DeepSpeed")
    scale = value.get("loss_scale", 0)
    static = key == "fp16" and on and not is_auto(scale) and checked_number(f"{key}.loss_scale", scale) != 0
    known = _FP16_KEYS if key == "fp16" else _BF16_KEYS
    for sub, v in value.items():
        name = f"{key}.{sub}"
        if sub == "enabled":
            continue
        if sub not in known:  # (DeepSpeed's config model forbids other keys, enabled or not)
            t.refuse(name, f"not a key of DeepSpeed's {key} section; valid: enabled, {', '.join(known)}")
        elif not on:
            t.no_effect(name, f"{key} is not enabled")
        elif sub in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
            refuse_unless(False, "tiertrain keeps fp32 master weights, gradients and optimizer state")(t, name, v)
        elif sub == "check_grad_overflow":
            t.no_effect(name, f"{v!r}: a step whose gradient norm is not finite is always skipped (DeepSpeed's "
                              f"default, true)")
        elif sub == "immediate_grad_update":
            t.no_effect(name, f"{v!r}: gradients are reduced into fp32 shards as backward produces them")
        elif sub == "loss_scale":
            if static:  # (DeepSpeed's ZeRO still skips a step whose gradients overflow; the scale stays)
                t.set(name, "precision.loss_scale.initial_scale", float(v), "a static scale")
                t.set(name, "precision.loss_scale.dynamic", False, "overflowing steps skipped, the scale kept")
            else:
                t.no_effect(name, "0: dynamic loss scaling, tiertrain's")
        elif static and sub in ("initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"):
            t.no_effect(name, f"the loss scale is static ({key}.loss_scale={scale!r}), as in DeepSpeed")
        elif sub == "initial_scale_power":
            # (2 ** 128 and above is no fp32 number: every scaled loss would overflow)
            mapped("precision.loss_scale.initial_scale", integer=True, convert=lambda p: float(2 ** p),
                    note="2 ** initial_scale_power", maximum=127)(t, name, v)
        elif sub == "loss_scale_window":
            mapped("precision.loss_scale.growth_interval", integer=True, minimum=1)(t, name, v)
        elif sub == "hysteresis":
            mapped("precision.loss_scale.hysteresis", integer=True, minimum=1)(t, name, v)
        elif sub == "min_loss_scale":
            mapped("precision.loss_scale.min_scale", minimum=0)(t, name, v)
        elif sub == "consecutive_hysteresis":
            refuse_unless(False, "tiertrain's hysteresis counts overflows since the last growth")(t, name, v)
        elif sub == "auto_cast":
            refuse_unless(False, "tiertrain computes in the fp16 parameters' dtype; it does not autocast")(t, name, v)
        elif sub == "fp16_master_weights_and_grads":
            refuse_unless(False, "tiertrain keeps fp32 master weights and gradients")(t, name, v)


_FP16_KEYS = ("auto_cast", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis",
              "consecutive_hysteresis", "min_loss_scale", "fp16_master_weights_and_grads")
_BF16_KEYS = ("immediate_grad_update", "check_grad_overflow", "bf16_master_weights_and_grads", "bf16_optimizer_states")
"""The keys of DeepSpeed's fp16 and bf16 sections besides enabled (its DeepSpeedFP16Config and
DeepSpeedBF16Config, 0.19, which refuse any other)."""


def _optimizer(t: Translation, key: str, value: Any) -> None:
    if not isinstance(value, dict):
        raise ConfigError(f"DeepSpeed {key}={value!r} is invalid: expected an object with type and params")
    kind = str(value.get("type", "")).lower()
    params = params_of(key, value)
    adamw = kind == "adamw" or (kind in ("adam", "cpuadam", "fusedadam") and params.get("adam_w_mode", True))
    if kind == "muon":
        t.refuse(f"{key}.type", f"{value.get('type')!r}: pass Muon in code, with AdamW for the parameters that are "
                                f"not hidden matrices (DeepSpeed's use_muon=False groups): tiertrain.wrap(..., "
                                f"optimizer=[torch.optim.Muon(hidden_matrices, lr=...), torch.optim.AdamW(the_rest, "
                                f"lr=...)]) (docs/optimizers.md)")
        return
    if not adamw:
        t.refuse(f"{key}.type", f"{value.get('type')!r}: tiertrain's optimizer from a config is AdamW (DeepSpeed's "
                                f"Adam with adam_w_mode, AdamW); other optimizers are passed in code (optimizer=)")
        return
    t.no_effect(f"{key}.type", f"{value.get('type')!r}: AdamW (torch's fused CPU or device kernel)")
    for sub, v in params.items():
        name = f"{key}.params.{sub}"
        if sub == "lr" and t.peak is not None:
            if not is_auto(v):
                checked_number(name, v, minimum=0)
            t.no_effect(name, f"{v!r}: DeepSpeed's scheduler sets the rate from {t.peak[0]} "
                              f"({t.peak[1]!r}) before the first step")
        elif sub == "lr":
            mapped("optimizer.lr", minimum=0)(t, name, v)
        elif sub == "eps":
            mapped("optimizer.eps", minimum=0)(t, name, v)
        elif sub == "weight_decay":
            mapped("optimizer.weight_decay", minimum=0)(t, name, v)
            t.set(name, "optimizer.weight_decay_on", "all", "DeepSpeed decays every parameter")
        elif sub == "betas":
            if is_auto(v):
                t.fates.append((name, "auto: tiertrain's optimizer.betas"))
            elif isinstance(v, (list, tuple)) and len(v) == 2:
                t.set(name, "optimizer.betas", [checked_number(name, b) for b in v])
            else:
                raise ConfigError(f"DeepSpeed {name}={v!r} is invalid: expected [beta1, beta2]")
        elif sub in ("adam_w_mode", "torch_adam", "fp32_optimizer_states"):
            t.no_effect(name, f"{v!r}: the update is AdamW with fp32 state either way")
        elif sub == "bias_correction":
            refuse_unless(True, "tiertrain's AdamW always corrects the moments' bias")(t, name, v)
        elif sub == "amsgrad":
            refuse_unless(False, "tiertrain's AdamW has no AMSGrad")(t, name, v)
        else:
            t.refuse(name, "not an AdamW parameter")


_MONITOR_KEYS = {True: ("enabled", "project", "team", "group"), False: ("enabled", "output_path", "job_name")}
"""The keys of DeepSpeed's wandb (True) and tensorboard (False) sections (its monitor config
models, which refuse any other)."""


def _monitor(path: str, project: bool):
    def handle(t: Translation, key: str, value: Any) -> None:
        for name in value if isinstance(value, dict) else ():
            if name not in _MONITOR_KEYS[project]:
                t.refuse(f"{key}.{name}", f"not a key of DeepSpeed's {key} section; valid: "
                                          f"{', '.join(_MONITOR_KEYS[project])}")
        if not isinstance(value, dict) or not value.get("enabled"):
            t.no_effect(key, "not enabled")
            return
        for name in ("team", "group") if project else ():
            if value.get(name) is not None:
                variable = "WANDB_ENTITY" if name == "team" else "WANDB_RUN_GROUP"
                t.no_effect(f"{key}.{name}", f"{value[name]!r}: tiertrain's W&B writer takes no {name}; set "
                                             f"{variable}={value[name]} in the environment, which W&B reads")
        names = ("project",) if project else ("output_path", "job_name")
        for name in names:
            if not isinstance(value.get(name, ""), str):
                raise ConfigError(f"DeepSpeed {key}.{name}={value[name]!r} is invalid: expected a string")
        if project:
            t.set(key, path, value.get("project") or "tiertrain")
        else:
            t.set(key, path, os.path.join(value.get("output_path") or "runs", value.get("job_name") or "tb"))
    return handle


def _zero(value: Any, t: Translation, itemsize: int) -> None:
    if value is None:
        t.set("zero_optimization (absent)", "zero.stage", 0, "DeepSpeed's default")
        return
    if not isinstance(value, dict):
        raise ConfigError(f"DeepSpeed zero_optimization={value!r} is invalid: expected an object")
    key = "zero_optimization"
    for spelled, v in value.items():
        name = f"{key}.{spelled}"
        sub = _ZERO_SPELLINGS.get(spelled, spelled)  # (DeepSpeed takes a field's name or its alias)
        handler = _ZERO.get(sub)
        if sub in ("offload_optimizer", "offload_param"):
            _offload(t, name, v, "zero.offload_optimizer" if sub == "offload_optimizer" else "zero.offload_params")
        elif sub in _FORMER_OFFLOADS:
            _former_offload(t, name, v, value)
        elif sub in _ELEMENTS:
            path, bytes_per = _ELEMENTS[sub]
            per = itemsize if bytes_per is None else bytes_per
            mapped(path, convert=lambda n, per=per: round(n * per / MiB, 6),
                    note=f"elements × {per} bytes, in MiB")(t, name, v)
        elif handler is None:
            t.refuse(name, "not a zero_optimization key tiertrain knows")
        else:
            handler(t, name, v)


_FORMER_OFFLOADS = {"cpu_offload": "offload_optimizer", "cpu_offload_param": "offload_param"}
"""DeepSpeed's former names of an offload to the CPU → the key that replaced each."""


def _former_offload(t: Translation, key: str, value: Any, section: dict) -> None:
    """cpu_offload and cpu_offload_param, read as DeepSpeed still reads them: true is the current
    key with device "cpu" (its other settings at their defaults), false or null no offload; beside
    the current key DeepSpeed refuses the pair, and so does this."""
    current = _FORMER_OFFLOADS[key.rpartition(".")[2]]
    if value is not None and not isinstance(value, bool):
        raise ConfigError(f"DeepSpeed {key}={value!r} is invalid: expected true or false")
    if current in section:
        t.refuse(key, f"given beside {current}, which replaced it: DeepSpeed refuses the two together; keep "
                      f"{current} alone")
        return
    path = "zero.offload_optimizer" if current == "offload_optimizer" else "zero.offload_params"
    t.set(key, path, "cpu" if value else "none", f"its former name for {current}.device, as DeepSpeed reads it")


def _offload(t: Translation, key: str, value: Any, path: str) -> None:
    if value is None:  # (DeepSpeed's default: no offload)
        t.set(key, path, "none")
        return
    if not isinstance(value, dict):
        raise ConfigError(f"DeepSpeed {key}={value!r} is invalid: expected an object with device")
    device = value.get("device", "none")
    if device not in ("none", "cpu", "nvme"):
        raise ConfigError(f"DeepSpeed {key}.device={device!r} is invalid: expected 'none', 'cpu' or 'nvme'")
    t.set(f"{key}.device", path, device)
    for sub, v in value.items():
        name = f"{key}.{sub}"
        if sub == "device":
            continue
        if sub == "nvme_path":
            t.set(name, "zero.nvme_path", str(v))
        elif sub == "buffer_count" and path == "zero.offload_optimizer":
            mapped("zero.nvme_buffers", integer=True, minimum=1)(t, name, v)
        elif sub in ("pin_memory", "buffer_count", "buffer_size", "max_in_cpu"):
            t.no_effect(name, f"{v!r}: tiertrain pins the host memory a device copy reads and sizes its own "
                              f"staging (zero.nvme_chunk_mb, nvme_kept_units)")
        elif sub in ("pipeline_read", "pipeline_write", "pipeline"):
            t.no_effect(name, f"{v!r}: tiertrain's NVMe step always reads the next chunk and writes the last one "
                              f"while it updates a chunk")
        elif sub == "fast_init":
            t.no_effect(name, f"{v!r}: how DeepSpeed writes the initial NVMe state; tiertrain writes it once, "
                              f"at wrap()")
        elif sub == "ratio":
            checked_number(name, v)
            t.no_effect(name, f"{v!r}: tiertrain offloads the whole optimizer state (ratio 1.0)"
                              + (", none of it stays on the device as DeepSpeed's partial offload keeps "
                                 f"{1 - v:.0%}" if v < 1 else ""))
        else:
            t.refuse(name, "not an offload key tiertrain knows")


_ELEMENTS = {
    "reduce_bucket_size": ("zero.bucket_mb", 4),
    "stage3_prefetch_bucket_size": ("zero.prefetch_mb", None),
    "stage3_max_live_parameters": ("zero.max_live_mb", None),
}
"""Sizes DeepSpeed counts in elements → (tiertrain field in MiB, bytes per element: fp32
gradients, or compute-dtype parameters (None))."""

_ALWAYS = "tiertrain always does it"
_ZERO = {
    "stage": mapped("zero.stage", integer=True),
    "stage3_param_persistence_threshold": mapped("zero.persistence_threshold", integer=True),
    "overlap_comm": no_effect(f"{_ALWAYS}: reductions overlap backward"),
    "contiguous_gradients": no_effect(f"{_ALWAYS}: gradients live in flat buffers"),
    "reduce_scatter": no_effect(f"{_ALWAYS} at stages 2-3"),
    "allgather_partitions": no_effect(_ALWAYS),
    "allgather_bucket_size": no_effect("parameters are gathered one unit at a time"),
    "round_robin_gradients": no_effect("each rank reduces its own shard"),
    "stage3_max_reuse_distance": no_effect("a gathered unit is released after its use (zero.max_live_mb caps them)"),
    "stage3_gather_16bit_weights_on_model_save": no_effect("save_pretrained and export always gather the weights"),
    "stage3_gather_fp16_weights_on_model_save": no_effect("save_pretrained and export always gather the weights"),
    "ignore_unused_parameters": no_effect("unused parameters get zero gradients"),
    "load_from_fp32_weights": no_effect("checkpoints hold the fp32 masters"),
    "elastic_checkpoint": no_effect("checkpoints reshard to any layout"),
    "zero_hpz_partition_size": refuse_unless(1, "ZeRO++ hierarchical partitioning is not implemented"),
    "zero_quantized_weights": refuse_unless(False, "ZeRO++ quantised weights are not implemented"),
    "zero_quantized_gradients": refuse_unless(False, "ZeRO++ quantised gradients are not implemented"),
    "mics_shard_size": refuse_unless(-1, "MiCS is not implemented"),
    "memory_efficient_linear": no_effect("linear layers are the model's own"),
    "sub_group_size": no_effect("the NVMe optimizer streams chunks of zero.nvme_chunk_mb; the CPU tier steps "
                                 "each shard whole"),
    "model_persistence_threshold": refuse_unless(9223372036854775807, "a model-wide persistence budget is not "
                                                  "implemented; stage3_param_persistence_threshold is"),
    "use_multi_rank_bucket_allreduce": no_effect("each bucket is reduced once, by the rank owning its shard"),
    "mics_hierarchical_params_gather": refuse_unless(False, "MiCS is not implemented"),
    "zeropp_loco_param": refuse_unless(None, "ZeRO++ LoCo is not implemented"),
    "log_trace_cache_warnings": no_effect("stage 3 checks each pass against the first (zero.stage3_check)"),
    "stage3_use_all_reduce_for_fetch_params": no_effect("parameters are gathered with all-gathers"),
    "override_module_apply": no_effect("the model's own apply() is untouched"),
    "stage3_module_granularity_threshold": no_effect("units are the ModuleList's children, or zero.unit_params"),
    "stage3_allgather_sequential": no_effect("parameters are gathered one unit at a time"),
    "compute_grad_norm": no_effect("the gradient norm is always computed (the clip and the metrics use it)"),
    "cpu_offload_use_pin_memory": no_effect("its former pin-memory switch (DeepSpeed only warns of it): tiertrain "
                                            "pins the host memory a device copy reads"),
    "legacy_stage1": refuse_unless(False, "DeepSpeed's former stage-1 code; tiertrain's stage 1 is the paper's"),
    "parameter_alignment": no_effect("the flat buffers' layout is tiertrain's own"),
    "zero_quantized_nontrainable_weights": refuse_unless(False, "ZeRO++ quantised weights are not implemented"),
    "pipeline_loading_checkpoint": no_effect("checkpoints load into any layout, pipeline stages included"),
    "enable_sanity_checks": no_effect("stage 3 checks each pass against the first (zero.stage3_check)"),
    "save_muon_momentum_buffer_in_memory": no_effect("on the NVMe tier each tensor's optimizer state is read "
                                                      "just before its update and written right after"),
    "leaf_module": no_effect("stage-3 units are whole blocks (the ModuleList's children, or zero.unit_params): "
                              "a mixture-of-experts layer is gathered whole"),
    "zenflow": refuse_unless(None, "ZenFlow's stall-free offload is not implemented; zero.overlap_cpu_step "
                                    "overlaps the CPU step with backward"),
}

_ZERO_SPELLINGS = {
    "stage3_model_persistence_threshold": "model_persistence_threshold",
    "prefetch_bucket_size": "stage3_prefetch_bucket_size",
    "param_persistence_threshold": "stage3_param_persistence_threshold",
    "max_live_parameters": "stage3_max_live_parameters",
    "max_reuse_distance": "stage3_max_reuse_distance",
    "gather_16bit_weights_on_model_save": "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold": "stage3_module_granularity_threshold",
    "use_all_reduce_for_fetch_params": "stage3_use_all_reduce_for_fetch_params",
    "allgather_sequential": "stage3_allgather_sequential",
}
"""DeepSpeed's zero_optimization fields by their other spelling (it accepts both a field's name
and its alias): the key _ZERO or _ELEMENTS knows them by."""

_SKIP = object()
_TOP = {
    "train_batch_size": mapped("batch.global_batch_size", integer=True, minimum=1),
    "train_micro_batch_size_per_gpu": mapped("batch.micro_batch_size", integer=True, minimum=1),
    "gradient_accumulation_steps": mapped("batch.grad_accum_steps", integer=True, minimum=1),
    "gradient_clipping": mapped("optimizer.grad_clip"),
    "steps_per_print": no_effect("DeepSpeed's own console print; metrics are logged every logging.log_interval"),
    "fp16": _fp16,
    "bf16": _fp16,
    "optimizer": _optimizer,
    "scheduler": scheduler,
    "zero_optimization": _SKIP,  # (after the precision is known)
    "tensorboard": _monitor("logging.tensorboard_dir", project=False),
    "wandb": _monitor("logging.wandb_project", project=True),
    "comet": refuse_unless({"enabled": False}, "tiertrain has no Comet writer: set logging.tensorboard_dir, "
                                                "logging.wandb_project or logging.metrics_file"),
    "comms_config": no_effect("not a key DeepSpeed reads (its name for what comms_logger configures), as here"),
    "monitor_config": no_effect("not a key DeepSpeed reads (its name for what tensorboard, wandb, csv_monitor "
                                 "and comet configure), as here"),
    "wall_clock_breakdown": no_effect("every metrics record splits the step into its phases"),
    "flops_profiler": no_effect("every metrics record holds TFLOP/s and MFU"),
    "memory_breakdown": no_effect("every metrics record holds memory per tier"),
    "csv_monitor": no_effect("metrics go to logging.metrics_file (JSONL)"),
    "comms_logger": no_effect("engine.counter holds the bytes of each collective"),
    "dump_state": no_effect("tiertrain config prints the resolved config"),
    "zero_allow_untested_optimizer": no_effect("an unknown optimizer is checked, not trusted (tiertrain/optim.py)"),
    "zero_force_ds_cpu_optimizer": no_effect("the CPU tier steps with torch's fused CPU AdamW"),
    "checkpoint": no_effect("checkpoints are tiertrain's, resharded to any layout"),
    "aio": no_effect("tiertrain's NVMe IO sizes its own requests (zero.nvme_chunk_mb)"),
    "activation_checkpointing": no_effect("DeepSpeed applies it where the model calls deepspeed.checkpointing; "
                                           "set activations.checkpoint_every (and activations.offload cpu)"),
    "prescale_gradients": _averaged_either_way,
    "gradient_predivide_factor": _averaged_either_way,
    "communication_data_type": refuse_unless(None, "gradients are reduced in fp32", same=("fp32",)),
    "data_types": _data_types,
    "amp": refuse_unless({"enabled": False}, "NVIDIA Apex AMP is not supported; use bf16 or fp16"),
    "sparse_attention": refuse_unless(None, "not implemented"),
    "compression_training": refuse_unless({"enabled": False}, "not implemented"),
    "curriculum_learning": refuse_unless({"enabled": False}, "not implemented"),
    "data_efficiency": refuse_unless({"enabled": False}, "not implemented"),
    "elasticity": refuse_unless({"enabled": False}, "not implemented; resume at another size reshards instead"),
    "autotuning": refuse_unless({"enabled": False}, "not implemented; tiertrain plan chooses a layout"),
    "pipeline": refuse_unless(None, "set parallel.pp and parallel.schedule"),
    "tensor_parallel": refuse_unless(None, "set parallel.tp"),
    "sequence_parallel_size": refuse_unless(1, "DeepSpeed-Ulysses is applied in the model's code; set "
                                                "parallel.cp (and parallel.cp_algorithm: ulysses) instead"),
    "seq_parallel_communication_data_type": no_effect("DeepSpeed-Ulysses' own setting (sequence_parallel_size)"),
    "sparse_gradients": refuse_unless(False, "gradients are dense"),
    "dataloader_drop_last": no_effect("the data sampler gives every rank whole micro-batches"),
    "timers": no_effect("every metrics record splits the step into its phases"),
    "eigenvalue": refuse_unless({"enabled": False}, "not implemented"),
    "progressive_layer_drop": refuse_unless({"enabled": False}, "not implemented"),
    "quantize_training": refuse_unless({"enabled": False}, "not implemented"),
    "weight_quantization": refuse_unless(None, "not implemented"),
    "hybrid_engine": refuse_unless({"enabled": False}, "not implemented (RLHF generation engine)"),
    "nebula": refuse_unless({"enabled": False}, "not implemented; checkpoints are tiertrain's"),
    "compile": refuse_unless({"enabled": False}, "compile the model yourself (torch.compile) before wrapping it"),
    "torch_autocast": refuse_unless({"enabled": False}, "tiertrain computes in precision.dtype; it does not "
                                                          "autocast"),
    "use_data_before_expert_parallelism": refuse_unless(False, "expert parallelism is not implemented"),
    "expert_parallel": refuse_unless(None, "expert parallelism is not implemented (experts are sharded by ZeRO "
                                            "like any parameter)"),
    "gradient_allreduce_op": refuse_unless("mean", "gradients are averaged over the data-parallel ranks"),
    "managed_gradient_accumulation": refuse_unless(True, "the accumulation window is batch.grad_accum_steps"),
    "disable_allgather": no_effect("how DeepSpeed publishes updated parameters; the values are the same"),
    "disable_python_gc": no_effect("tiertrain leaves Python's garbage collector as it is"),
    "log_level": no_effect("DeepSpeed's own logger"),
    "vocabulary_size": no_effect("DeepSpeed's FLOPs estimate; tiertrain counts the model's own"),
}


def documented_keys() -> dict[str, list[str]]:
    """Every key this translation knows, by section (for docs/deepspeed.md's table)."""
    zero = set(_ZERO) | set(_ELEMENTS) | set(_ZERO_SPELLINGS) | set(_FORMER_OFFLOADS) | set(_FORMER_OFFLOADS.values())
    return {"": sorted([*_TOP, "bfloat16"]), "zero_optimization": sorted(zero)}


__all__ = ["Translation", "documented_keys", "from_deepspeed", "read_deepspeed"]
