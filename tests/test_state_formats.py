"""Each update form declares the format of its checkpoint state as a type
(tiertrain/update/state_format.py), and checkpoints record the format's own tag, never the class
name of the form that saved it:

- renaming a form (a subclass under another name) changes nothing a checkpoint records;
- a tag this version does not know is refused by name, with the tags it knows;
- a form written outside the library keeps its own state (FormOwnState): it loads at the layout
  it was saved at, and resharding it is refused by the format's name;
- a checkpoint written before the formats were types (its form recorded by class name, the
  fingerprint's "optimizer_tier", the NVMe rule's repr in the rank file) still loads, at the
  layout it was saved at and resharded, exactly as the same checkpoint in today's shape does.

The old shape is the one tiertrain wrote at commit 661023e, observed on checkpoints it saved:
OLD_LAYOUT_KEYS, OLD_SHARD_KEYS and OLD_NVME_KEYS below. The test saves with today's code and
rewrites the metadata to that shape (rank files re-serialised, checksums recomputed, as the old
code wrote them), so no binary fixture is kept.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil

import pytest
import torch

import tiertrain

from test_reshard import GLOBAL, K, Layout, _step, _wrap
from reference import global_batches
from tiertrain.elementwise import AdamWRule, SGDRule
from tiertrain.errors import CheckpointError
from tiertrain.state import legacy_formats
from tiertrain.testing import run_distributed
from tiertrain.update.delayed import DelayedUpdate
from tiertrain.update.in_memory import InMemoryUpdate
from tiertrain.update.nvme.form import NVMeUpdate, OverlappedNVMeUpdate
from tiertrain.update.protocol import OptimizerUpdate
from tiertrain.update.state_format import FormOwnState, NVMeStreamState, TorchOptimizerState
from tiertrain.update.whole import WholeParameterUpdate

OLD_LAYOUT_KEYS = {"stage", "dp", "tp", "pp", "dtype", "optimizer_tier", "units"}
"""A layout fingerprint (COMMITTED.json "layouts"[r]) as tiertrain wrote it at 661023e."""
OLD_SHARD_KEYS = {"form", "shard_rank", "units", "frozen", "pieces", "tp", "split", "copies"}
"""A shard layout (COMMITTED.json "shards"[r]) as tiertrain wrote it at 661023e."""
OLD_NVME_KEYS = {"step", "rule", "skipped", "pieces", "shards"}
"""The NVMe stream's state in a rank file (["update"]["optimizer"]) as tiertrain wrote it at 661023e."""
OLD_TIER = {"torch_optimizer": "memory", "nvme_stream": "nvme"}

SAVED: dict[str, Layout] = {
    "memory": Layout(2, 2),
    "delayed": Layout(2, 2, "cpu", delayed=True),
    "nvme adamw": Layout(2, 2, "nvme"),
    "nvme sgd": Layout(2, 2, "nvme", sgd=True),
}
"""Each case's layout at save: the in-memory form, the delayed form (its checkpoint also holds
the parameters one update behind the masters), the NVMe stream under AdamW and under SGD."""
OUTSIDE = "form outside the library"
"""A case saved at Layout(2, 2) by tests/test_update_protocol.py's SGDUpdate, a form written
outside the library that declares no format (FormOwnState)."""
LOADED: dict[str, tuple[str, Layout]] = {
    "memory, same layout": ("memory", Layout(2, 2)),
    "memory, dp 2->1 stage 2->3": ("memory", Layout(1, 3)),
    "delayed, same layout": ("delayed", Layout(2, 2, "cpu", delayed=True)),
    "delayed, dp 2->1 stage 2->3": ("delayed", Layout(1, 3, "cpu", delayed=True)),
    "nvme adamw, same layout": ("nvme adamw", Layout(2, 2, "nvme")),
    "nvme adamw, dp 2->1": ("nvme adamw", Layout(1, 2, "nvme")),
    "nvme adamw -> memory, dp 2->1 stage 2->3": ("nvme adamw", Layout(1, 3)),
    "nvme sgd, same layout": ("nvme sgd", Layout(2, 2, "nvme", sgd=True)),
    "nvme sgd, dp 2->1": ("nvme sgd", Layout(1, 2, "nvme", sgd=True)),
    "nvme sgd -> memory, dp 2->1": ("nvme sgd", Layout(1, 2, sgd=True)),
}


# -- the types ------------------------------------------------------------------------------

def test_each_form_declares_its_state_format_as_a_type():
    assert InMemoryUpdate.state_format == TorchOptimizerState()
    assert WholeParameterUpdate.state_format == TorchOptimizerState()
    assert DelayedUpdate.state_format == TorchOptimizerState(published=True)
    assert OptimizerUpdate.state_format == FormOwnState()
    assert issubclass(OverlappedNVMeUpdate, NVMeUpdate)  # (declares the NVMe form's: its rule's slots)
    assert NVMeStreamState.of_rule(AdamWRule((0.9, 0.95), 1e-8)).state_names == ("exp_avg", "exp_avg_sq")
    assert NVMeStreamState.of_rule(SGDRule(0.9, 0.0, False)).state_names == ("momentum_buffer",)


def test_the_tags_are_the_file_format():
    """Changing a tag changes what checkpoints hold: these are the values files carry."""
    assert (TorchOptimizerState.TAG, NVMeStreamState.TAG, FormOwnState.TAG) == \
        ("torch_optimizer", "nvme_stream", "form_own")
    assert TorchOptimizerState(published=True).record() == {"tag": "torch_optimizer", "published": True}
    assert NVMeStreamState(("momentum_buffer",)).record() == {"tag": "nvme_stream",
                                                              "state_names": ["momentum_buffer"]}


def test_old_tags_read_as_the_formats_they_meant():
    never_read = {"form": "SGDUpdate"}  # (a form written outside the library: its state was never read)
    assert legacy_formats.fingerprint_tag({"optimizer_tier": "memory"}, never_read) == FormOwnState.TAG
    assert legacy_formats.fingerprint_tag({"optimizer_tier": "memory"}, {"form": "DelayedUpdate"}) == \
        TorchOptimizerState.TAG
    assert legacy_formats.fingerprint_tag({"optimizer_tier": "nvme"}, None) == NVMeStreamState.TAG
    assert legacy_formats.format_of({"form": "DelayedUpdate"}, dict) == TorchOptimizerState(published=True)
    assert legacy_formats.format_of({"form": "OverlappedNVMeUpdate"}, lambda: {"rule": repr(SGDRule(0.9, 0, False))}) \
        == NVMeStreamState(("momentum_buffer",))
    with pytest.raises(CheckpointError, match=r"'LionRule\(.*AdamWRule.*SGDRule"):
        legacy_formats.state_names_of_rule("LionRule(beta=0.9)")


# -- checkpoints ----------------------------------------------------------------------------

def _ckpt(root: str, name: str, which: str = "ckpt") -> str:
    return os.path.join(root, name.replace(" ", "_"), which)


def _wrap_form(layout: Layout, directory: str, outside: bool, seed: int = 0):
    """test_reshard's engine; outside: with SGDUpdate as its update form."""
    if not outside:
        return _wrap(layout, directory, seed=seed)
    from test_update_protocol import SGDUpdate

    original = tiertrain.wrap
    tiertrain.wrap = lambda *a, **k: original(*a, update_factory=SGDUpdate, **k)
    try:
        return _wrap(layout, directory, seed=seed)
    finally:
        tiertrain.wrap = original


def _save_all(rank, world, root):
    """Each case: K steps, a checkpoint; then the same engine saved again as a renamed form (a
    subclass under another name). Returns the saving form's class name and NVMe rule repr."""
    batches = global_batches(K + 1, GLOBAL)
    saved = {}
    for name, layout in {**SAVED, OUTSIDE: Layout(2, 2)}.items():
        engine, cfg = _wrap_form(layout, _ckpt(root, name, "run"), outside=name == OUTSIDE)
        for i in range(K):
            _step(engine, cfg, batches[i])
        engine.save_checkpoint(_ckpt(root, name))
        form = type(engine.update)
        saved[name] = (form.__name__, repr(engine.update.nvme.rule) if hasattr(engine.update, "nvme") else None,
                       engine.update.state_format.TAG)
        engine.update.__class__ = type("RenamedForm", (form,), {})
        engine.save_checkpoint(_ckpt(root, name, "renamed"))
        engine.update.__class__ = form
        engine.close()
    return saved


def _step_dir(directory: str) -> str:
    return os.path.join(directory, sorted(n for n in os.listdir(directory) if n.startswith("step_"))[-1])


def _as_written_before_types(directory: str, form: str, rule: str | None) -> None:
    """Rewrite the checkpoint in directory to the shape tiertrain wrote before the formats were
    types: the form's class name, the fingerprint's "optimizer_tier", the NVMe rule's repr."""
    step_dir = _step_dir(directory)
    path = os.path.join(step_dir, "COMMITTED.json")
    with open(path) as f:
        marker = json.load(f)
    before = json.dumps(marker, sort_keys=True)
    for layout in marker["layouts"]:  # (a form outside the library wrote "memory", as the in-memory forms)
        layout["optimizer_tier"] = OLD_TIER.get(layout.pop("state_format"), "memory")
    for shards in marker["shards"]:
        del shards["state_format"]
        shards["form"] = form
    for r in range(marker["world_size"]):
        file = os.path.join(step_dir, f"rank{r:05d}.pt")
        state = torch.load(file, weights_only=True)
        optimizer = state["update"]["optimizer"]
        if rule is None:
            assert "state_names" not in optimizer and "rule" not in optimizer
            continue  # (a torch optimizer's state: the same then as now)
        del optimizer["state_names"]
        optimizer["rule"] = rule
        assert set(optimizer) == OLD_NVME_KEYS
        torch.save(state, file)
        with open(file, "rb") as f:
            marker["sha256"][r] = hashlib.sha256(f.read()).hexdigest()
    assert json.dumps(marker, sort_keys=True) != before, "the rewrite changed nothing"
    assert all(set(layout) == OLD_LAYOUT_KEYS for layout in marker["layouts"])
    assert all(set(shards) == OLD_SHARD_KEYS for shards in marker["shards"])
    with open(path, "w") as f:
        json.dump(marker, f)


def _load_all(rank, world, root, names):
    """Each case loaded from today's checkpoint and from the old-shaped one, then step K: the
    loss and the parameters after it, for each."""
    batches = global_batches(K + 1, GLOBAL)
    out = {}
    for name in names:
        saved, layout = LOADED[name]
        results = []
        for which in ("ckpt", "old"):
            engine, cfg = _wrap(layout, _ckpt(root, name, "b"), seed=5)
            engine.load_checkpoint(_ckpt(root, saved, which))
            assert engine.steps == K, (name, which, engine.steps)
            loss = _step(engine, cfg, batches[K])
            results.append((loss, engine.full_state_dict()))
            engine.close()
        out[name] = results
    return out if rank == 0 else None


def _load_tagged(rank, world, directory, layout, root, outside=False):
    """Load the checkpoint in directory: "loaded" (and the step it resumes at), or the error."""
    engine, _ = _wrap_form(layout, os.path.join(root, f"tagged{world}"), outside, seed=5)
    try:
        engine.load_checkpoint(directory)
        return f"loaded at step {engine.steps}"
    except CheckpointError as e:
        return str(e)
    finally:
        engine.close()


@pytest.fixture(scope="module")
def saves(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("formats"))
    forms = run_distributed(_save_all, 2, root, timeout=90)[0]
    for name, (form, rule, _) in forms.items():
        shutil.copytree(_ckpt(root, name), _ckpt(root, name, "old"))
        _as_written_before_types(_ckpt(root, name, "old"), form, rule)
    return root, forms


@pytest.fixture(scope="module")
def loads(saves):
    root, _ = saves
    out = {}
    for world in (1, 2):
        names = [n for n, (_, b) in LOADED.items() if b.world == world]
        out.update(run_distributed(_load_all, world, root, names, timeout=120)[0])
    return out


def _marker(directory: str) -> dict:
    with open(os.path.join(_step_dir(directory), "COMMITTED.json")) as f:
        return json.load(f)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(SAVED) + [OUTSIDE])
def test_renaming_a_form_changes_nothing_a_checkpoint_records(saves, name):
    root, forms = saves
    original, renamed = _marker(_ckpt(root, name)), _marker(_ckpt(root, name, "renamed"))
    assert original["layouts"] == renamed["layouts"] and original["shards"] == renamed["shards"]
    expected = forms[name][2]
    assert expected == (FormOwnState.TAG if name == OUTSIDE else
                        TorchOptimizerState.TAG if forms[name][1] is None else NVMeStreamState.TAG)
    assert {s["state_format"]["tag"] for s in original["shards"]} == {expected}
    assert {layout["state_format"] for layout in original["layouts"]} == {expected}
    for directory in (_ckpt(root, name), _ckpt(root, name, "renamed")):
        text = open(os.path.join(_step_dir(directory), "COMMITTED.json")).read()
        assert forms[name][0] not in text and "RenamedForm" not in text, "a class name is in the checkpoint"
    if forms[name][1] is not None:  # (the rank file names the stream's slots, not its rule's class)
        state = torch.load(os.path.join(_step_dir(_ckpt(root, name, "renamed")), "rank00000.pt"), weights_only=True)
        assert "rule" not in state["update"]["optimizer"]
        assert state["update"]["optimizer"]["state_names"] == original["shards"][0]["state_format"]["state_names"]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(LOADED))
def test_checkpoints_written_before_the_formats_were_types_still_load(loads, name):
    (new_loss, new_params), (old_loss, old_params) = loads[name]
    assert old_loss == new_loss, f"{name}: loss {old_loss!r} from the old-shaped checkpoint, {new_loss!r} from today's"
    assert new_params.keys() == old_params.keys()
    differ = [n for n in new_params if not torch.equal(new_params[n], old_params[n])]
    assert not differ, f"{name}: parameters differ after the resumed step: {differ}"


def _retagged(root: str, source: str, tag: str, fingerprint: bool) -> str:
    directory = _ckpt(root, source, f"tagged-{tag}-{fingerprint}")
    shutil.copytree(_ckpt(root, source), directory)
    path = os.path.join(_step_dir(directory), "COMMITTED.json")
    marker = _marker(directory)
    for shards in marker["shards"]:
        shards["state_format"]["tag"] = tag
    if fingerprint:
        for layout in marker["layouts"]:
            layout["state_format"] = tag
    with open(path, "w") as f:
        json.dump(marker, f)
    return directory


@pytest.mark.timeout(240)
@pytest.mark.parametrize("where", ["fingerprint, same layout", "shard layout, dp 2->1"])
def test_an_unknown_format_tag_is_refused_by_name(saves, where):
    root, _ = saves
    same = where.endswith("same layout")
    directory = _retagged(root, "memory", "quantum_state", fingerprint=same)
    layout = SAVED["memory"] if same else Layout(1, 2)
    message = run_distributed(_load_tagged, layout.world, directory, layout, root, timeout=90)[0]
    assert not message.startswith("loaded"), f"{where}: a checkpoint in an unknown format loaded"
    assert re.search(r"'quantum_state'.*'torch_optimizer'.*'nvme_stream'.*'form_own'", message), message


@pytest.mark.timeout(240)
@pytest.mark.parametrize("which", ["ckpt", "old"])
def test_a_form_outside_the_library_loads_at_its_layout_and_is_not_resharded(saves, which):
    """Its state is its own (FormOwnState): loaded whole at the layout it was saved at, from
    today's checkpoint and from one written before the formats were types (where it was
    "memory", like the in-memory forms, and named by its class); resharding it is refused by
    the format's name, as it was before."""
    root, forms = saves
    assert forms[OUTSIDE][2] == FormOwnState.TAG
    directory = _ckpt(root, OUTSIDE, which)
    same = run_distributed(_load_tagged, 2, directory, Layout(2, 2), root, True, timeout=90)[0]
    assert same == f"loaded at step {K}", same
    other = run_distributed(_load_tagged, 1, directory, Layout(1, 2), root, True, timeout=90)[0]
    assert re.search(r"resharding optimizer state in the 'form_own' format is not supported", other), other
