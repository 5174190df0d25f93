"""A DeepSpeed config in one line (issue 35, item 1): ``tiertrain train --deepspeed ds.json``
and ``tiertrain config --from-deepspeed ds.json`` translate every key to its tiertrain
counterpart, say which have no effect and why, and refuse by name, all at once, the keys that
cannot be honoured. tests/deepspeed_configs/ holds the ZeRO-2 and ZeRO-3 offload configs of
the transformers documentation ("auto" values), an explicit one in DeepSpeed's own terms, and
``like_*.json``: configs written after those axolotl, LLaMA-Factory and DeepSpeed-Chat ship."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from tiertrain.cli import load_train_config
from tiertrain.config import ConfigError
from tiertrain.deepspeed_config import from_deepspeed
from tiertrain.optim import lr_factor

HERE = os.path.dirname(os.path.abspath(__file__))
CONFIGS = os.path.join(HERE, "deepspeed_configs")


def _path(name: str) -> str:
    return os.path.join(CONFIGS, name)


def test_the_transformers_zero2_config_keeps_tiertrain_values_where_it_says_auto():
    cfg = load_train_config(None, ["--optimizer.lr", "0.002"], deepspeed=_path("transformers_zero2.json"))
    assert (cfg.zero.stage, cfg.zero.offload_optimizer.config_name) == (2, "cpu")
    assert cfg.optimizer.lr == 0.002 and cfg.optimizer.grad_clip == 1.0  # ("auto": tiertrain's own)
    assert cfg.zero.bucket_mb == pytest.approx(5e8 * 4 / 2**20, rel=1e-6)  # (elements → MiB of fp32)
    assert cfg.optimizer.weight_decay_on == "all"  # (DeepSpeed decays every parameter)
    assert cfg.schedule.warmup_shape == "log" and cfg.schedule.decay_steps == 0  # (WarmupLR: log, then flat)


def test_the_transformers_zero3_offload_config_puts_parameters_and_optimizer_on_the_cpu():
    cfg = load_train_config(None, ["--precision.dtype", "bf16"], deepspeed=_path("transformers_zero3_offload.json"))
    assert cfg.zero.stage == 3
    assert (cfg.zero.offload_params.config_name, cfg.zero.offload_optimizer.config_name) == ("cpu", "cpu")
    assert cfg.zero.max_live_mb == pytest.approx(1e9 * 2 / 2**20, rel=1e-6)  # (bf16 parameters: 2 bytes)
    assert cfg.precision.dtype == "bf16"


def test_explicit_values_and_the_keys_deepspeed_defaults_mean(tmp_path):
    cfg = load_train_config(None, ["--zero.nvme_path", str(tmp_path)], deepspeed=_path("deepspeed_zero3_explicit.json"))
    assert (cfg.batch.micro_batch_size, cfg.batch.grad_accum_steps, cfg.precision.dtype) == (4, 2, "bf16")
    assert (cfg.optimizer.lr, cfg.optimizer.betas, cfg.optimizer.weight_decay) == (0.001, (0.9, 0.95), 0.01)
    assert cfg.zero.offload_optimizer.config_name == "nvme" and cfg.zero.nvme_buffers == 4
    assert cfg.zero.nvme_path == str(tmp_path), "a --section.key override comes after the DeepSpeed file"
    assert cfg.zero.persistence_threshold == 100000
    assert cfg.zero.prefetch_mb == pytest.approx(1e7 * 2 / 2**20, rel=1e-6)
    # Left out of a DeepSpeed file means DeepSpeed's default, not tiertrain's.
    bare = load_train_config(None, [], deepspeed={"train_micro_batch_size_per_gpu": 2})
    assert bare.optimizer.grad_clip == 0.0 and bare.zero.stage == 0
    assert (bare.schedule.warmup_steps, bare.schedule.decay_steps) == (0, 0)


def _deepspeeds_update_rates(scheduler: dict, optimizer_lr: float, updates: int) -> list[float]:
    """The rate of each of DeepSpeed's updates: its engine steps the scheduler after each update,
    so update n runs at the scheduler's iteration n - 1, the first at the rate its constructor
    set. Its own scheduler class over an optimizer at the file's rate, as its engine builds them,
    where the package is installed (CI's last step), else its formulas (deepspeed/runtime/
    lr_schedules.py, 0.19) transcribed: min + (max - min) · gamma for WarmupLR / WarmupDecayLR,
    a ratio of the optimizer's rate for WarmupCosineLR."""
    kind, params = scheduler["type"], scheduler["params"]
    if os.environ.get("TIERTRAIN_TEST_DEEPSPEED"):
        import torch
        from deepspeed.runtime import lr_schedules

        optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=optimizer_lr)
        theirs = getattr(lr_schedules, kind)(optimizer, **params)
        rates = []
        for _ in range(updates):
            rates.append(optimizer.param_groups[0]["lr"])
            theirs.step()
        return rates
    warmup, total = max(2, params.get("warmup_num_steps", 1000)), params.get("total_num_steps", 0)
    log = params.get("warmup_type", "log") == "log"
    if kind == "WarmupCosineLR":
        low, high = params.get("warmup_min_ratio", 0.0) * optimizer_lr, optimizer_lr
    else:
        low = params.get("warmup_min_lr", 0.0)
        high = params.get("warmup_max_lr", 0.001 if kind == "WarmupDecayLR" else optimizer_lr)
    rates = []
    for iteration in range(-1, updates - 1):
        if iteration < 0:
            rates.append(0.0 if kind == "WarmupCosineLR" else low)
        elif iteration < warmup:
            gamma = math.log(iteration + 1) / math.log(warmup) if log else iteration / warmup
            rates.append(low + (high - low) * gamma)
        elif kind == "WarmupLR":
            rates.append(high)
        elif kind == "WarmupDecayLR":
            rates.append(low + (high - low) * max(0.0, (total - iteration) / max(1, total - warmup)))
        else:
            floor = params.get("cos_min_ratio", 0.0001)
            progress = min(1.0, (iteration - warmup + 1) / max(1, total - warmup))
            rates.append(optimizer_lr * max(0.0, floor + (1 - floor) * (1 + math.cos(math.pi * progress)) / 2))
    return rates


def _differ(ours: list[float], theirs: list[float]) -> list[int]:
    return [n for n, (a, b) in enumerate(zip(ours, theirs, strict=True))
            if not math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-15)]


def test_warmup_decay_gives_deepspeeds_rate_at_every_update():
    """The explicit config's WarmupDecayLR (linear, 1e-4 to 1e-3 over 10 updates, back down by
    100): its decay ends at warmup_min_lr, as DeepSpeed's does (it ended at 0: the last tenth of
    the run at up to 10x below DeepSpeed's rate), and every update runs at DeepSpeed's rate (the
    warmup ran two updates ahead, the decay one)."""
    cfg = load_train_config(None, ["--steps", "100"], deepspeed=_path("deepspeed_zero3_explicit.json"))
    with open(_path("deepspeed_zero3_explicit.json")) as f:
        ds = json.load(f)
    ours = [cfg.optimizer.lr * lr_factor(n, cfg.schedule) for n in range(100)]
    assert not _differ(ours, _deepspeeds_update_rates(ds["scheduler"], ds["optimizer"]["params"]["lr"], 100))
    assert math.isclose(ours[-1], 1e-4 + 9e-4 * 2 / 90, rel_tol=1e-12), ours[-1]


# (DeepSpeed key order, the optimizer's lr, the scheduler block): where the rate comes from.
RATE_CASES = {
    "warmup_max_lr before the optimizer's lr": (
        ["scheduler", "optimizer"], 0.5, {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 5,
                                                                         "warmup_type": "linear"}}),
    "warmup_max_lr after the optimizer's lr": (
        ["optimizer", "scheduler"], 0.5, {"type": "WarmupLR", "params": {"warmup_max_lr": 0.01, "warmup_num_steps": 5,
                                                                         "warmup_type": "linear"}}),
    "WarmupLR to the optimizer's lr, log": (
        ["optimizer", "scheduler"], 0.5, {"type": "WarmupLR", "params": {"warmup_min_lr": 0.05,
                                                                         "warmup_num_steps": 5}}),
    "WarmupLR to the run's lr": (
        ["scheduler"], None, {"type": "WarmupLR", "params": {"warmup_min_lr": 1e-4, "warmup_num_steps": 5,
                                                             "warmup_type": "linear"}}),
    "WarmupDecayLR at its default peak, to warmup_min_lr": (
        ["scheduler", "optimizer"], 0.5, {"type": "WarmupDecayLR", "params": {
            "warmup_min_lr": 1e-4, "warmup_num_steps": 5, "total_num_steps": 20, "warmup_type": "linear"}}),
    "WarmupCosineLR, log": (
        ["optimizer", "scheduler"], 0.01, {"type": "WarmupCosineLR", "params": {
            "total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.2}}),
    "WarmupCosineLR ending before the run, one warmup step": (
        ["optimizer", "scheduler"], 0.01, {"type": "WarmupCosineLR", "params": {
            "total_num_steps": 12, "warmup_num_steps": 1, "warmup_type": "linear"}}),
}
RUN_LR = 0.002
"""The command line's --optimizer.lr where the file has no optimizer block."""


def _rate_case(name: str) -> tuple[dict, float]:
    """(the DeepSpeed config, the rate its optimizer is built with: the file's or the run's)."""
    order, lr, scheduler = RATE_CASES[name]
    blocks = {"scheduler": scheduler, "optimizer": {"type": "AdamW", "params": {"lr": lr}}}
    return {k: blocks[k] for k in order}, (lr if "optimizer" in order else RUN_LR)


@pytest.mark.parametrize("name", list(RATE_CASES))
def test_the_rate_is_deepspeeds_at_every_update_whatever_the_order_of_the_keys(name):
    """DeepSpeed's WarmupLR and WarmupDecayLR set every group's rate from warmup_max_lr before
    the first step, the optimizer's lr then unused; WarmupLR without one warms up to the
    optimizer's lr, WarmupDecayLR to its default 0.001, and WarmupDecayLR decays back to
    warmup_min_lr. The peak used to be whichever of the two lr keys came last in the file, 0.001
    for a WarmupLR without warmup_max_lr, and the start ratio taken to that 0.001. Each update
    runs at DeepSpeed's rate: its scheduler steps after the update (the first update at the
    start rate, 0 for WarmupCosineLR) and its log warmup is log(i + 1) / log(warmup); the
    translation ran the warmup two updates ahead on another log curve (up to ~10% off), the
    decay one update ahead."""
    ds, optimizer_lr = _rate_case(name)
    run_lr = [] if "optimizer" in ds else ["--optimizer.lr", str(RUN_LR)]  # (an override wins over the file)
    cfg = load_train_config(None, [*run_lr, "--steps", "20"], deepspeed=ds)
    ours = [cfg.optimizer.lr * lr_factor(n, cfg.schedule) for n in range(20)]
    theirs = _deepspeeds_update_rates(ds["scheduler"], optimizer_lr, 20)
    assert not _differ(ours, theirs), (ours, theirs)
    fates = dict(from_deepspeed(ds).fates)
    if "warmup_max_lr" in json.dumps(ds) or "Decay" in name:
        assert fates["optimizer.params.lr"].startswith("no effect: 0.5: DeepSpeed's scheduler sets the rate"), fates


def test_under_the_trainer_the_schedulers_peak_must_be_learning_rate():
    """transformers refuses a warmup_max_lr or an optimizer lr other than learning_rate, and a
    warmup_num_steps or total_num_steps other than the arguments' (both were taken from the file
    here); a WarmupDecayLR without warmup_max_lr runs at DeepSpeed's 0.001 whatever
    learning_rate says. A warmup_min_lr is then a ratio of learning_rate."""
    transformers = pytest.importorskip("transformers")
    from tiertrain.integrations.hf_arguments import config_from_training_arguments, deepspeed_schedule

    args = transformers.TrainingArguments(output_dir="unused", learning_rate=2e-3, report_to="none", warmup_steps=1)
    for name, message in [("warmup_max_lr before the optimizer's lr", r"scheduler.params.warmup_max_lr=0.01 disagrees "
                                                                      r"with TrainingArguments\(learning_rate\)=0.002"),
                          ("WarmupDecayLR at its default peak, to warmup_min_lr",
                           r"warmup_max_lr \(absent: WarmupDecayLR's default\)=0.001 disagrees with .*ignore "
                           r"learning_rate")]:
        ds, _ = _rate_case(name)
        ds["optimizer"]["params"]["lr"] = "auto"
        with pytest.raises(ConfigError, match=message):
            config_from_training_arguments(args, deepspeed=ds)
    ds = {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto", "warmup_min_lr": 1e-3}},
          "optimizer": {"type": "AdamW", "params": {"lr": 0.5}}}
    with pytest.raises(ConfigError, match=r"optimizer.params.lr=0.5 disagrees with TrainingArguments\(learning_rate"):
        config_from_training_arguments(args, deepspeed=ds)
    ds["optimizer"]["params"]["lr"] = 2e-3
    assert config_from_training_arguments(args, deepspeed=ds).optimizer.lr == 2e-3
    # ... and its warmup and total steps must be the arguments' (transformers' trainer_config_finalize)
    for params, message in [({"warmup_num_steps": 3}, r"warmup_num_steps=3 disagrees with TrainingArguments: "
                                                      r"warmup_steps gives 1"),
                            ({"total_num_steps": 12}, r"total_num_steps=12 disagrees with TrainingArguments: the run's "
                                                      r"steps \(max_steps, or the epochs'\) gives 10")]:
        with pytest.raises(ConfigError, match=message):
            deepspeed_schedule({"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10, **params}}},
                               args, 10)
    assert deepspeed_schedule(ds, args, 10).warmup_start_ratio == pytest.approx(0.5, rel=1e-12)


@pytest.mark.parametrize("name", ["like_axolotl_z3.json", "like_llamafactory_z3_offload.json", "like_dschat_step1.json",
                                  "like_dschat_fp16_static.json"])
def test_configs_as_fine_tuning_projects_ship_them_translate(name):
    """Sections switched off (DeepSpeed-Chat's hybrid_engine with enabled false) and the values
    tiertrain always has (Adam's bias_correction true) have no effect; they used to be refused."""
    cfg = load_train_config(None, [], deepspeed=_path(name))
    fates = dict(from_deepspeed(_path(name)).fates)
    assert cfg.zero.stage == json.load(open(_path(name)))["zero_optimization"]["stage"]
    if "hybrid_engine" in fates:
        assert fates["hybrid_engine"].startswith("no effect: not enabled"), fates["hybrid_engine"]
    with pytest.raises(ConfigError, match=r"hybrid_engine: enabled true: not implemented"):
        from_deepspeed({"hybrid_engine": {"enabled": True, "max_out_tokens": 512}})
    with pytest.raises(ConfigError, match=r"optimizer.params.bias_correction: False: tiertrain's AdamW always"):
        from_deepspeed({"optimizer": {"type": "Adam", "params": {"bias_correction": False}}})


def test_where_deepspeed_divides_the_gradients_has_no_effect_the_mean_is_the_same():
    """prescale_gradients and gradient_predivide_factor (in DeepSpeedExamples' BERT, GPT-2 and
    CIFAR configs) move DeepSpeed's division by the ranks before its sum, against overflow in a
    16-bit sum: tiertrain sums in fp32 and averages, the same mean. They used to be refused."""
    fates = dict(from_deepspeed({"prescale_gradients": True, "gradient_predivide_factor": 8}).fates)
    for key in ("prescale_gradients", "gradient_predivide_factor"):
        assert fates[key].startswith("no effect: ") and "the mean is the same" in fates[key], fates[key]
    for bad, message in [({"prescale_gradients": "yes"}, r"prescale_gradients='yes' is invalid: expected true or"),
                         ({"gradient_predivide_factor": 0}, r"gradient_predivide_factor=0 is invalid: expected a "
                                                           r"number > 0"),
                         ({"gradient_predivide_factor": [2]}, r"gradient_predivide_factor=\[2\] is invalid")]:
        with pytest.raises(ConfigError, match=message):
            from_deepspeed(bad)


def test_a_section_of_switches_is_refused_only_where_a_switch_is_on():
    """DeepSpeed's data_efficiency, compression_training and curriculum_learning do nothing until
    one of their ``enabled`` flags (each false by default, at any depth) is true; templates ship
    them switched off. The refusal names the switches that are on."""
    off = {"data_efficiency": {"enabled": False, "data_routing": {"enabled": False, "random_ltd": {"enabled": False}}},
           "compression_training": {"weight_quantization": {"shared_parameters": {"enabled": False},
                                                            "different_groups": {"wq1": {"params": {"start_bits": 8}}}},
                                    "layer_reduction": {"enabled": False, "keep_number_layer": 5}},
           "curriculum_learning": {"enabled": False, "curriculum_type": "seqlen"}}
    fates = dict(from_deepspeed(off).fates)
    for key in off:
        assert fates[key] == "no effect: not enabled (its other keys configure what is off)", (key, fates[key])
    on = {"data_efficiency": {"enabled": True, "data_routing": {"random_ltd": {"enabled": True}}},
          "compression_training": {"channel_pruning": {"shared_parameters": {"enabled": True}}},
          "curriculum_learning": {"enabled": True}}
    with pytest.raises(ConfigError) as caught:
        from_deepspeed(on)
    for said in ("data_efficiency: enabled, data_routing.random_ltd.enabled true: not implemented",
                 "compression_training: channel_pruning.shared_parameters.enabled true: not implemented",
                 "curriculum_learning: enabled true: not implemented"):
        assert said in str(caught.value), (said, str(caught.value))


def test_keys_deepspeed_reads_under_a_former_name_or_not_at_all_translate_as_it_reads_them():
    """Refused as typos before: ``bfloat16`` (bf16's former name, which DeepSpeed still reads where
    bf16 is absent), ``comet`` (a DeepSpeed monitor), ``_comment`` and the ``comms_config`` and
    ``monitor_config`` of LLaMA-Factory's FP8 example (keys DeepSpeed does not read)."""
    translated = from_deepspeed({"bfloat16": {"enabled": True}, "_comment": "see the docs", "comet": {"enabled": False},
                                 "comms_config": {"verbose": False}, "monitor_config": {"enabled": True}})
    assert translated.values["precision"]["dtype"] == "bf16"
    fates = dict(translated.fates)
    assert fates["bfloat16"] == "read as bf16 (its former name), as DeepSpeed reads it"
    assert all(fates[k].startswith("no effect") for k in ("_comment", "comet", "comms_config", "monitor_config"))
    beside = from_deepspeed({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
    assert "precision" not in beside.values and dict(beside.fates)["bfloat16"].startswith("no effect")
    with pytest.raises(ConfigError, match=r"comet: enabled true: tiertrain has no Comet writer"):
        from_deepspeed({"comet": {"enabled": True, "project": "p"}})


def test_unhonourable_keys_are_refused_all_at_once_by_name():
    with pytest.raises(ConfigError) as caught:
        from_deepspeed({"optimizer": {"type": "OneBitAdam", "params": {"lr": 1e-3}},
                        "zero_optimization": {"stage": 3, "zero_quantized_weights": True},
                        "fp16": {"enabled": True, "fp16_master_weights_and_grads": True},
                        "train_batch_sise": 8})
    message = str(caught.value)
    for key in ("optimizer.type", "zero_optimization.zero_quantized_weights", "fp16.fp16_master_weights_and_grads",
                "train_batch_sise"):
        assert key in message, (key, message)
    assert "docs/deepspeed.md" in message
    with pytest.raises(ConfigError, match="fp16.enabled and bf16.enabled are both true"):
        from_deepspeed({"fp16": {"enabled": True}, "bf16": {"enabled": True}})
    with pytest.raises(ConfigError, match="train_micro_batch_size_per_gpu=-1 is invalid"):
        from_deepspeed({"train_micro_batch_size_per_gpu": -1})


def test_a_static_fp16_loss_scale_is_kept_for_the_run_as_deepspeed_keeps_it():
    translated = from_deepspeed({"fp16": {"enabled": True, "loss_scale": 128, "initial_scale_power": 12,
                                          "hysteresis": 4}})
    assert translated.values["precision"]["loss_scale"] == {"initial_scale": 128.0, "dynamic": False}
    fates = dict(translated.fates)
    assert "no effect: the loss scale is static (fp16.loss_scale=128)" in fates["fp16.hysteresis"]
    assert from_deepspeed({"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12}}).values[
        "precision"]["loss_scale"] == {"initial_scale": 2.0**12}


def test_malformed_values_and_files_are_named_not_raised_raw(tmp_path):
    """What tests/fuzz_configs.py found raised a raw error (or allocated without bound)."""
    for section in ("optimizer", "scheduler"):
        with pytest.raises(ConfigError, match=rf"DeepSpeed {section}.params=\[1\] is invalid: expected an object"):
            from_deepspeed({section: {"type": "AdamW" if section == "optimizer" else "WarmupLR", "params": [1]}})
    with pytest.raises(ConfigError, match=r"DeepSpeed tensorboard.job_name=7 is invalid: expected a string"):
        from_deepspeed({"tensorboard": {"enabled": True, "output_path": "runs", "job_name": 7}})
    with pytest.raises(ConfigError, match=r"fp16.initial_scale_power=1180591620717411303424 is invalid: expected an "
                                          r"integer >= 0 and <= 127"):
        from_deepspeed({"fp16": {"enabled": True, "initial_scale_power": 2 ** 70}})
    files = {"nested.json": b"[" * 100_000, "binary.json": b'{"fp16": "\xff"}', "folder.json": None}
    for name, content in files.items():
        path = tmp_path / name
        if content is None:
            path.mkdir()
        else:
            path.write_bytes(content)
        with pytest.raises(ConfigError, match=rf"--deepspeed='{path}' (nests its values|is not valid JSON|cannot be "
                                              rf"read)"):
            load_train_config(None, [], deepspeed=str(path))
    (tmp_path / "nested.yaml").write_text("a: " + "[" * 100_000)
    with pytest.raises(ConfigError, match=r"nested.yaml' (nests its values deeper|is not valid YAML)"):
        load_train_config(str(tmp_path / "nested.yaml"), [])


def test_a_key_asking_for_what_tiertrain_always_does_has_no_effect_and_another_value_is_refused():
    """communication_data_type "fp32" (written out in many configs) is what tiertrain does: it
    was refused as if it asked for something else."""
    fates = dict(from_deepspeed({"communication_data_type": "fp32"}).fates)
    assert fates["communication_data_type"].startswith("no effect: 'fp32': tiertrain always does it")
    with pytest.raises(ConfigError, match="communication_data_type: 'bf16': gradients are reduced in fp32"):
        from_deepspeed({"communication_data_type": "bf16"})


DEEPSPEED_ZERO_KEYS = [  # DeepSpeed 0.19.8's DeepSpeedZeroConfig: each field's name, and its alias where it has one
    "stage", "contiguous_gradients", "reduce_scatter", "reduce_bucket_size", "use_multi_rank_bucket_allreduce",
    "allgather_partitions", "allgather_bucket_size", "overlap_comm", "compute_grad_norm", "load_from_fp32_weights",
    "elastic_checkpoint", "offload_param", "offload_optimizer", "zenflow", "sub_group_size", "cpu_offload_param",
    "cpu_offload_use_pin_memory", "cpu_offload", "prefetch_bucket_size", "stage3_prefetch_bucket_size",
    "param_persistence_threshold", "stage3_param_persistence_threshold", "model_persistence_threshold",
    "stage3_model_persistence_threshold", "max_live_parameters", "stage3_max_live_parameters", "max_reuse_distance",
    "stage3_max_reuse_distance", "gather_16bit_weights_on_model_save", "stage3_gather_16bit_weights_on_model_save",
    "module_granularity_threshold", "stage3_module_granularity_threshold", "use_all_reduce_for_fetch_params",
    "stage3_use_all_reduce_for_fetch_params", "allgather_sequential", "stage3_allgather_sequential",
    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1", "round_robin_gradients",
    "parameter_alignment", "zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_nontrainable_weights",
    "zero_quantized_gradients", "memory_efficient_linear", "pipeline_loading_checkpoint", "override_module_apply",
    "log_trace_cache_warnings", "enable_sanity_checks", "save_muon_momentum_buffer_in_memory", "leaf_module"]


def test_every_zero_optimization_key_of_deepspeed_under_either_spelling_is_known():
    """DeepSpeed takes a field's name or its alias (stage3_model_persistence_threshold or
    model_persistence_threshold): a real key was refused as "a typo" under the spelling
    tiertrain did not list."""
    from tiertrain.deepspeed_config import documented_keys

    unknown = sorted(set(DEEPSPEED_ZERO_KEYS) - set(documented_keys()["zero_optimization"]))
    assert not unknown, unknown
    spelled = [from_deepspeed({"zero_optimization": {"stage": 3, k: 10 ** 6}}, "bf16").values["zero"]
               for k in ("stage3_max_live_parameters", "max_live_parameters")]
    assert spelled[0] == spelled[1] and spelled[0]["max_live_mb"] > 0, spelled
    for k in ("stage3_model_persistence_threshold", "model_persistence_threshold"):
        with pytest.raises(ConfigError, match=f"zero_optimization.{k}: 1000: a model-wide persistence budget"):
            from_deepspeed({"zero_optimization": {"stage": 3, k: 1000}})
    if os.environ.get("TIERTRAIN_TEST_DEEPSPEED"):  # (CI installs deepspeed for its last tests)
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        theirs = {k for n, f in DeepSpeedZeroConfig.model_fields.items() for k in (n, f.alias) if k}
        assert theirs == set(DEEPSPEED_ZERO_KEYS), sorted(theirs ^ set(DEEPSPEED_ZERO_KEYS))


def test_the_former_offload_names_are_read_as_deepspeed_reads_them():
    """zero_optimization.cpu_offload and cpu_offload_param, which DeepSpeed 0.19 still maps to
    offload_optimizer / offload_param {device: cpu} (with a warning), were refused as "the old
    spelling" although DeepSpeed trains with them; beside the key that replaced them DeepSpeed
    refuses the pair ("Cannot provide deprecated parameter ... together"), and so does this."""
    zero = from_deepspeed({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_param": True,
                                                 "cpu_offload_use_pin_memory": True}}).values["zero"]
    assert zero["offload_optimizer"] == "cpu" and zero["offload_params"] == "cpu", zero
    for off in (False, None):
        zero = from_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": off}}).values["zero"]
        assert zero["offload_optimizer"] == "none", zero
    assert from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": None}}).values["zero"] == \
        {"stage": 2, "offload_optimizer": "none"}
    with pytest.raises(ConfigError, match=r"zero_optimization\.cpu_offload: given beside offload_optimizer, which "
                                          r"replaced it"):
        from_deepspeed({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "cpu"}}})
    with pytest.raises(ConfigError, match=r"cpu_offload_param='yes' is invalid: expected true or false"):
        from_deepspeed({"zero_optimization": {"stage": 3, "cpu_offload_param": "yes"}})
    if os.environ.get("TIERTRAIN_TEST_DEEPSPEED"):  # (the pair refused by DeepSpeed itself)
        from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

        assert DeepSpeedZeroConfig(stage=3, cpu_offload=True).offload_optimizer.device == "cpu"
        with pytest.raises(AssertionError, match="together"):
            DeepSpeedZeroConfig(stage=2, cpu_offload=True, offload_optimizer={"device": "cpu"})


DEEPSPEED_TOP_KEYS_2025 = ["expert_parallel", "gradient_allreduce_op", "managed_gradient_accumulation",
                           "disable_allgather", "disable_python_gc", "log_level", "vocabulary_size",
                           "seq_parallel_communication_data_type", "torch_autocast", "compile", "comet", "bfloat16"]
"""Top-level keys DeepSpeed 0.19.8 reads that configs written for it may hold."""


def test_recent_top_level_deepspeed_keys_have_a_fate_and_sum_of_gradients_is_refused():
    from tiertrain.deepspeed_config import documented_keys

    assert not sorted(set(DEEPSPEED_TOP_KEYS_2025) - set(documented_keys()[""]))
    fates = dict(from_deepspeed({"gradient_allreduce_op": "mean", "disable_python_gc": True}).fates)
    assert fates["gradient_allreduce_op"].startswith("no effect")
    with pytest.raises(ConfigError, match="gradient_allreduce_op: 'sum': gradients are averaged"):
        from_deepspeed({"gradient_allreduce_op": "sum"})


def test_offload_keys_state_what_tiertrain_does_instead():
    fates = dict(from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {
        "device": "cpu", "ratio": 0.3, "pipeline_read": True}}}).fates)
    assert "offloads the whole optimizer state (ratio 1.0)" in fates["zero_optimization.offload_optimizer.ratio"]
    assert "keeps 70%" in fates["zero_optimization.offload_optimizer.ratio"]
    assert "reads the next chunk" in fates["zero_optimization.offload_optimizer.pipeline_read"]
    with pytest.raises(ConfigError, match="ratio=-1 is invalid"):
        from_deepspeed({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": -1}}})


def test_every_key_of_the_documented_configs_has_a_stated_fate():
    for name in sorted(os.listdir(CONFIGS)):
        with open(_path(name)) as f:
            ds = json.load(f)
        fates = dict(from_deepspeed(ds, dtype="bf16").fates)
        keys = [k for k, v in ds.items() if not isinstance(v, dict) or k in ("wandb", "tensorboard")]
        keys += [f"{k}.{sub}" for k, v in ds.items() if isinstance(v, dict) and k not in ("optimizer", "scheduler")
                 for sub in v if not isinstance(v[sub], dict)]
        # (a section without effect as a whole, such as comms_logger, states the fate of its keys)
        whole = {f for f, fate in fates.items() if "." not in f and fate.startswith("no effect")}
        missing = [k for k in keys if not any(f == k or f.startswith(k + ".") for f in fates)
                   and k.split(".")[0] not in whole]
        assert not missing, f"{name}: no fate for {missing}"


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiertrain.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=150)


@pytest.mark.slow
@pytest.mark.timeout(200)
@pytest.mark.parametrize("name", ["transformers_zero2.json", "transformers_zero3_offload.json"])
def test_a_run_from_the_deepspeed_config_equals_the_run_from_its_printed_tiertrain_config(tmp_path, name):
    """The acceptance of the issue: the transformers documentation's ZeRO-2 and ZeRO-3 offload
    configs train unchanged from the CLI, and `tiertrain config --from-deepspeed` prints the
    tiertrain config of the same run: the two runs' losses are the same, step for step."""
    common = ["--steps", "4", "--logging.log_interval", "1", "--logging.progress", "false",
              "--model.n_layers", "2", "--model.hidden", "64", "--model.n_heads", "4", "--model.seq_len", "32",
              "--schedule.warmup_steps", "2", "--data.cache_dir", str(tmp_path / "cache")]
    printed = _cli("config", "--from-deepspeed", _path(name), *common, cwd=tmp_path)
    assert printed.returncode == 0, printed.stderr[-2000:]
    (tmp_path / "printed.yaml").write_text(printed.stdout)
    runs = {}
    for label, how in (("deepspeed", ["--deepspeed", _path(name)]),
                       ("printed", ["--config", str(tmp_path / "printed.yaml")])):
        metrics = tmp_path / f"{label}.jsonl"
        done = _cli("train", *how, *common, "--nproc", "2", "--logging.metrics_file", str(metrics), cwd=tmp_path)
        assert done.returncode == 0, done.stderr[-3000:]
        runs[label] = [json.loads(line)["loss"] for line in metrics.read_text().splitlines() if '"loss"' in line]
        if label == "deepspeed":
            assert "zero_optimization.overlap_comm: no effect" in done.stderr, done.stderr[-2000:]
    assert len(runs["deepspeed"]) == 4 and runs["deepspeed"] == runs["printed"], runs


def test_the_documentation_table_names_every_key_the_translation_knows():
    from tiertrain.deepspeed_config import documented_keys

    text = open(os.path.join(os.path.dirname(HERE), "docs", "deepspeed.md")).read()
    absent = [k for keys in documented_keys().values() for k in keys if f"`{k}`" not in text]
    assert not absent, f"docs/deepspeed.md does not list {absent}"


def test_a_muon_config_is_refused_with_the_code_that_runs_it():
    with pytest.raises(ConfigError, match=r"optimizer.type.*'Muon': pass Muon in code.*optimizer=\[torch.optim.Muon"):
        from_deepspeed({"optimizer": {"type": "Muon", "params": {"lr": 0.02}}})


def test_a_scheduler_parameter_deepspeeds_class_does_not_take_is_refused_by_name():
    """DeepSpeed passes the params to its scheduler class as keyword arguments, so a misspelt
    one is a TypeError there; it was accepted here in silence (a warmup_nums_steps left the
    warmup at DeepSpeed's default 1000 steps). A schedule begun part way (last_batch_iteration)
    is a resumed run's, and a warmup of no steps DeepSpeed refuses too."""
    for params, message in [({"warmup_nums_steps": 10}, r"scheduler.params.warmup_nums_steps: not a parameter of "
                                                        r"DeepSpeed's WarmupLR; valid: warmup_min_lr, warmup_max_lr, "
                                                        r"warmup_num_steps"),
                            ({"last_batch_iteration": 5}, r"last_batch_iteration: 5: a schedule that starts part way"),
                            ({"warmup_num_steps": 0}, r"warmup_num_steps=0 is invalid: expected an integer >= 1")]:
        with pytest.raises(ConfigError, match=message):
            from_deepspeed({"scheduler": {"type": "WarmupLR", "params": params}})
    with pytest.raises(ConfigError, match=r"warmup_max_lr: not a parameter of DeepSpeed's WarmupCosineLR"):
        from_deepspeed({"scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 9, "warmup_max_lr": 1}}})
    assert from_deepspeed({"scheduler": {"type": "WarmupLR", "params": {"last_batch_iteration": -1}}}).values


def test_the_precision_sections_take_deepspeeds_keys_and_bf16_masters_are_refused():
    """DeepSpeed's bf16 section has switches of its own (bf16 master weights and optimizer
    state, its overflow check), which were all "no effect: bf16 needs no loss scaling", and
    neither section refused a key DeepSpeed's config model forbids (a misspelt fp16.loss_scal)."""
    from tiertrain.deepspeed_config import _BF16_KEYS, _FP16_KEYS

    for sub in ("bf16_master_weights_and_grads", "bf16_optimizer_states"):
        with pytest.raises(ConfigError, match=f"bf16.{sub}: True: tiertrain keeps fp32 master weights"):
            from_deepspeed({"bf16": {"enabled": True, sub: True}})
    fates = dict(from_deepspeed({"bf16": {"enabled": True, "check_grad_overflow": True}}).fates)
    assert fates["bf16.check_grad_overflow"].startswith("no effect: True: a step whose gradient norm is not finite")
    for ds, bad in [({"fp16": {"enabled": False, "loss_scal": 0}}, "fp16.loss_scal"),
                    ({"bf16": {"enabled": True, "loss_scale": 0}}, "bf16.loss_scale")]:
        with pytest.raises(ConfigError, match=rf"{bad}: not a key of DeepSpeed's {bad[:4]} section; valid: enabled"):
            from_deepspeed(ds)
    if os.environ.get("TIERTRAIN_TEST_DEEPSPEED"):  # (against the installed DeepSpeed's own config models)
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config, DeepSpeedFP16Config

        assert set(DeepSpeedFP16Config.model_fields) == {"enabled", *_FP16_KEYS}
        assert set(DeepSpeedBF16Config.model_fields) == {"enabled", *_BF16_KEYS}


@pytest.mark.parametrize("given,overrides,expected", [
    ({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}, [], (2, 4)),
    ({"train_batch_size": 16, "gradient_accumulation_steps": 2}, [], (4, 2)),
    ({"train_batch_size": 32}, [], (16, 1)),
    ({"train_batch_size": 32}, ["--batch.micro_batch_size", "4"], (4, 4)),
    ({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 3}, [], (2, 3)),
    ({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"}, [], (8, 2)),
], ids=["accumulation", "micro-batch", "train_batch_size alone", "micro-batch on the command line", "no total",
        "an auto micro-batch is tiertrain's"])
def test_a_batch_size_deepspeed_derives_from_the_world_size_is_derived_when_the_run_starts(given, overrides,
                                                                                          expected):
    """DeepSpeed takes two of train_batch_size, the micro-batch size and the accumulation and
    derives the third from the data-parallel size; the translation refused such a file at
    launch (its train_batch_size against tiertrain's default micro-batch of 8 and accumulation
    of 1), although DeepSpeed trains with it."""
    from tiertrain.cli.common import derived_batch
    from tiertrain.train import check_launch

    cfg = load_train_config(None, overrides, deepspeed=given)
    lines = derived_batch(cfg, 2, given, overrides)
    check_launch(cfg, 2)
    assert (cfg.batch.micro_batch_size, cfg.batch.grad_accum_steps) == expected, lines
    assert all("as DeepSpeed derives it" in line for line in lines if "absent)" in line and "alone" not in line)
    with pytest.raises(ConfigError, match=r"train_batch_size=16 is not a multiple of train_micro_batch_size_per_gpu="
                                          r"3 × 2 data-parallel ranks, so gradient_accumulation_steps cannot be "
                                          r"derived"):
        bad = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 3}
        derived_batch(load_train_config(None, [], deepspeed=bad), 2, bad, [])


def test_the_monitor_sections_take_deepspeeds_keys_and_say_where_a_wandb_team_goes():
    """wandb's team and group were dropped without a word (the run logged to the default
    entity); they are said, with the environment variables W&B reads. A key DeepSpeed's
    monitor models forbid is refused."""
    from tiertrain.deepspeed_config import _MONITOR_KEYS

    fates = dict(from_deepspeed({"wandb": {"enabled": True, "project": "p", "team": "acme", "group": "g1"}}).fates)
    assert "WANDB_ENTITY=acme" in fates["wandb.team"] and "WANDB_RUN_GROUP=g1" in fates["wandb.group"], fates
    with pytest.raises(ConfigError, match=r"wandb.projct: not a key of DeepSpeed's wandb section"):
        from_deepspeed({"wandb": {"enabled": False, "projct": "p"}})
    if os.environ.get("TIERTRAIN_TEST_DEEPSPEED"):
        from deepspeed.monitor.config import TensorBoardConfig, WandbConfig

        assert set(WandbConfig.model_fields) == set(_MONITOR_KEYS[True])
        assert set(TensorBoardConfig.model_fields) == set(_MONITOR_KEYS[False])
