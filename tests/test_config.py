"""Configuration: every bad value gets an error naming the field, the value and what is valid."""
from __future__ import annotations

import pytest

from tiertrain.config import (BatchConfig, Config, ConfigError, ParallelConfig, field_docs, from_dict, load,
                              parse_overrides)

BAD = [
    ({"zero": {"stage": 4}}, r"zero\.stage=4.*one of 0, 1, 2, 3"),
    ({"zero": {"stage": "3"}}, r"zero\.stage='3'.*an integer"),
    ({"precision": {"dtype": "fp8"}}, r"precision\.dtype='fp8'.*'fp32', 'bf16', 'fp16'"),
    ({"optimizer": {"lr": -1.0}}, r"optimizer\.lr=-1\.0.*> 0"),
    ({"optimizer": {"betas": [0.9]}}, r"optimizer\.betas=\[0\.9\].*a list of a number, a number"),
    ({"optimizer": {"betas": [0.9, 1.5]}}, r"optimizer\.betas\[1\]=1\.5.*\[0, 1\)"),
    ({"optimizer": {"impl": "cuda"}}, r"optimizer\.impl='cuda'"),
    ({"batch": {"micro_batch_size": 0}}, r"batch\.micro_batch_size=0.*> 0"),
    ({"batch": {"grad_accum_steps": 1.5}}, r"batch\.grad_accum_steps=1\.5.*an integer"),
    ({"parallel": {"tp": 0}}, r"parallel\.tp=0"),
    ({"logging": {"progress": "yes"}}, r"logging\.progress='yes'.*true or false"),
    ({"precision": {"loss_scale": {"backoff_factor": 2.0}}}, r"precision\.loss_scale\.backoff_factor=2\.0.*\(0, 1\)"),
    ({"zero": {"offload_optimizer": "nvme", "stage": 3}}, r"zero\.nvme_path='' is invalid with an nvme tier"),
    ({"zero": {"nvme_buffers": 2}}, r"zero\.nvme_buffers=2 is invalid: expected at least 3"),
    ({"zero": {"nvme_grads_in_ram_mb": 512}}, r"zero\.nvme_grads_in_ram_mb=512\.0 needs zero\.nvme_in_place=true"),
    ({"zero": {"nvme_grads_in_ram_mb": -1}}, r"zero\.nvme_grads_in_ram_mb=-1"),
    ({"zero": {"offload_optimizer": "cpu", "stage": 1}}, r"zero\.offload_optimizer='cpu' needs zero\.stage 2 or 3"),
    ({"zero": {"offload_params": "cpu", "stage": 2}}, r"zero\.offload_params='cpu' needs zero\.stage=3"),
    ({"zero": {"offload_optimizer": "disk"}}, r"zero\.offload_optimizer='disk'.*'none', 'cpu', 'nvme'"),
    ({"zero": {"stagee": 1}}, r"unknown key 'zero\.stagee'.*stage"),
    ({"zeroo": {}}, r"unknown key 'zeroo'.*zero"),
    ({"zero": 3}, r"zero=3.*a table of ZeroConfig fields"),
]


@pytest.mark.parametrize("data,message", BAD)
def test_bad_value_is_named(data, message):
    with pytest.raises(ConfigError, match=message):
        from_dict(Config, data).validate()


def test_dp_tp_pp_must_multiply_to_world_size():
    with pytest.raises(ConfigError, match=r"dp × tp × pp = 2 × 2 × 1 = 4 but the world size is 2"):
        ParallelConfig(dp=2, tp=2).resolve(2)
    with pytest.raises(ConfigError, match=r"world size 6 is not divisible by tp × pp = 4 × 1"):
        ParallelConfig(tp=4).resolve(6)
    assert ParallelConfig(tp=2).resolve(8) == (1, 4, 2)


def test_global_batch_must_equal_micro_times_accum_times_dp():
    with pytest.raises(ConfigError, match=r"global_batch_size=10 is inconsistent.*= 16; set it to 16"):
        BatchConfig(micro_batch_size=4, grad_accum_steps=2, global_batch_size=10).resolve(dp=2)
    assert BatchConfig(micro_batch_size=4, grad_accum_steps=2).resolve(dp=2) == 16


def test_yaml_toml_and_overrides(tmp_path):
    (tmp_path / "a.yaml").write_text("zero:\n  stage: 2\noptimizer:\n  betas: [0.8, 0.9]\n")
    (tmp_path / "a.toml").write_text("[zero]\nstage = 1\n[precision]\ndtype = 'bf16'\n")
    cfg = load(Config, str(tmp_path / "a.yaml"), ["--zero.stage", "3", "--precision.dtype=bf16"])
    assert cfg.zero.stage == 3 and cfg.precision.dtype == "bf16" and cfg.optimizer.betas == (0.8, 0.9)
    assert load(Config, None, ["--optimizer.lr", "1e-3"]).optimizer.lr == 1e-3  # YAML 1.1 reads this as a string
    with pytest.raises(ConfigError, match=r"optimizer\.lr='fast' is invalid: expected a number"):
        load(Config, None, ["--optimizer.lr", "fast"])
    cfg = load(Config, str(tmp_path / "a.toml"))
    assert cfg.zero.stage == 1 and cfg.precision.dtype == "bf16"
    with pytest.raises(ConfigError, match=r"config file .*b\.json.*unknown extension"):
        (tmp_path / "b.json").write_text("{}")
        load(Config, str(tmp_path / "b.json"))
    with pytest.raises(ConfigError, match=r"override '--zero\.stage' has no value"):
        parse_overrides(["--zero.stage"])
    with pytest.raises(ConfigError, match=r"override 'zero\.stage=1' is invalid"):
        parse_overrides(["zero.stage=1"])


def test_every_field_has_a_docstring():
    import dataclasses

    def walk(cls):
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
                walk(f.type)
    for f in dataclasses.fields(Config):
        walk(type(getattr(Config(), f.name)))
