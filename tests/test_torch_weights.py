"""``tiertrain.load_pretrained`` reads weights written by ``torch.save`` as it reads safetensors
(tiertrain/state/torch_weights.py):

* a Hugging Face ``pytorch_model.bin``, single or sharded with ``pytorch_model.bin.index.json``
  (the Hub's older checkpoints), into an engine at stage 3 on 2 ranks, each reading about its
  own half (the file memory-mapped), the values bit for bit;
* a training script's ``torch.save(model.state_dict(), path)`` of a wrapped model: the parts of
  the names that DataParallel / DistributedDataParallel (``module.``) and torch.compile
  (``_orig_mod.``) add are taken off, and said in the report; a dict holding the state dict
  under ``state_dict`` (Lightning) or ``model`` is found; a model whose own names hold
  ``module`` keeps them; the legacy (non-zip) format reads the same;
* what cannot be read is refused naming the file and why: objects of other classes (the file
  is unpickled weights-only: none of its code runs), no state dict in the file, two tensors
  that become one name.
"""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn as nn

import tiertrain
from reference import make_config
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402


def _llama(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return zoo.build("llama-gqa")


def _values(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _save_bin(directory: str, state: dict, shards: int = 1) -> None:
    """As transformers 4 saved with safe_serialization=False: one file, or shards and an index."""
    os.makedirs(directory, exist_ok=True)
    if shards == 1:
        torch.save(state, os.path.join(directory, "pytorch_model.bin"))
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {n: state[n] for n in names[i::shards]}
        torch.save(part, os.path.join(directory, file))
        weight_map.update({n: file for n in part})
    with open(os.path.join(directory, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


def _into_engine(rank, world, directory):
    cfg = make_config(zero={"stage": 3}, batch={"micro_batch_size": 2})
    engine = tiertrain.wrap(_llama(1), cfg, tiertrain.Topology.build(cfg.parallel))
    report = tiertrain.load_pretrained(engine, directory)
    values = engine.full_state_dict()
    engine.close()
    return values, report.bytes_read, report.files


@pytest.mark.timeout(120)
@pytest.mark.parametrize("shards", [1, 3])
def test_a_pytorch_model_bin_checkpoint_loads_into_an_engine_each_rank_reading_its_part(shards, tmp_path):
    model = _llama(0)
    want = _values(model)
    _save_bin(str(tmp_path), want, shards)
    results = run_distributed(_into_engine, 2, str(tmp_path), timeout=90)
    total = sum(v.numel() * v.element_size() for v in want.values())
    for values, bytes_read, files in results:
        assert len(files) == shards
        assert all(torch.equal(values[n], want[n]) for n in values if n in want)
        assert bytes_read < 0.75 * total, (bytes_read, total)  # (about half each: its shards' rows)


def test_a_scripts_state_dict_of_a_wrapped_model_loads_without_the_wrappers_names(tmp_path):
    model = _llama(0)
    want = _values(model)
    for label, wrapped in (("DataParallel", nn.DataParallel(model)), ("torch.compile", torch.compile(model)),
                           ("both", nn.DataParallel(torch.compile(model)))):
        path = str(tmp_path / f"{label}.pt")
        torch.save(wrapped.state_dict(), path)
        target = _llama(1)
        report = tiertrain.load_pretrained(target, path)
        assert all(torch.equal(v, want[k]) for k, v in target.state_dict().items()), label
        assert report.unexpected == [] and report.missing == [], label
        assert report.unwrapped, label
    assert report.unwrapped == ["_orig_mod", "module. in front"]


def test_a_state_dict_nested_in_a_saved_dict_or_in_the_legacy_format_loads(tmp_path):
    model = _llama(0)
    want = _values(model)
    cases = {"lightning.ckpt.pt": {"state_dict": want, "epoch": 3, "optimizer_states": [{"lr": 0.1}]},
             "model.pt": {"model": want, "step": 10}}
    for name, saved in cases.items():
        torch.save(saved, tmp_path / name)
    torch.save(want, tmp_path / "legacy.pth", _use_new_zipfile_serialization=False)
    for name in [*cases, "legacy.pth"]:
        target = _llama(1)
        tiertrain.load_pretrained(target, tmp_path / name)
        assert all(torch.equal(v, want[k]) for k, v in target.state_dict().items()), name


class _Outer(nn.Module):
    """A model whose own parameter names begin with ``module.``: they are not a wrapper's."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.module = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)


def test_a_models_own_module_names_are_kept(tmp_path):
    torch.save(_Outer(0).state_dict(), tmp_path / "outer.pt")
    target = _Outer(1)
    report = tiertrain.load_pretrained(target, tmp_path / "outer.pt")
    assert report.unwrapped == []
    assert torch.equal(target.module.weight, _Outer(0).module.weight)


class _Custom:
    """An object of a class the weights-only unpickler does not know."""


def test_what_cannot_be_read_is_refused_naming_the_file_and_why(tmp_path):
    model = _llama(0)
    torch.save({"state_dict": _values(model), "extra": _Custom()}, tmp_path / "objects.pt")
    with pytest.raises(ValueError, match=r"objects\.pt' cannot be read with torch\.load\(weights_only=True\), "
                                         r"which runs no code of the file"):
        tiertrain.load_pretrained(_llama(1), tmp_path / "objects.pt")
    torch.save({"weights": [1, 2], "epoch": 3}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match=r"other\.pt' holds a dict with keys \['epoch', 'weights'\], not a state "
                                         r"dict"):
        tiertrain.load_pretrained(_llama(1), tmp_path / "other.pt")
    state = _values(model)
    state["module.lm_head.weight"] = state["lm_head.weight"]
    torch.save(state, tmp_path / "both.pt")
    with pytest.raises(ValueError, match=r"'lm_head\.weight' and 'module\.lm_head\.weight' are both "
                                         r"'lm_head\.weight' once the wrappers' parts"):
        tiertrain.load_pretrained(_llama(1), tmp_path / "both.pt")
