"""A checkpoint directory is data from anyone (issue 32, items 4 and 7): its commit marker names
files, and its files may be links, FIFOs or devices. Loading and exporting open only regular
files under plain names inside the step directory, read a marker of bounded size whose lists
hold one entry per rank, and so end with an error naming the file instead of reading
/dev/zero forever, blocking on a FIFO, or reading a file outside the directory."""
from __future__ import annotations

import json
import os
import shutil

import pytest

import tiertrain
from reference import global_batches, make_config, make_model
from tiertrain.state.checkpoint import MARKER, CheckpointError
from tiertrain.state.consolidate import export_checkpoint


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A committed single-rank checkpoint of the test GPT (step 1)."""
    root = tmp_path_factory.mktemp("saved")
    cfg = make_config(batch={"micro_batch_size": 4})
    engine = tiertrain.wrap(make_model(), cfg, tiertrain.Topology.build(cfg.parallel))
    engine.train_batch(iter(global_batches(1, 4)))
    engine.save_checkpoint(str(root / "ckpt"))
    return root / "ckpt"


def _copy(saved, tmp_path):
    copy = tmp_path / "ckpt"
    shutil.copytree(saved, copy, symlinks=True)
    return copy, copy / "step_00000001"


def _load(directory):
    cfg = make_config(batch={"micro_batch_size": 4})
    engine = tiertrain.wrap(make_model(seed=3), cfg, tiertrain.Topology.build(cfg.parallel))
    return engine.load_checkpoint(str(directory))


def _rewrite_marker(step_dir, change):
    marker = json.loads((step_dir / MARKER).read_text())
    change(marker)
    (step_dir / MARKER).write_text(json.dumps(marker))


def _rank_file_is_a_link_to_dev_zero(step_dir):
    (step_dir / "rank00000.pt").unlink()
    (step_dir / "rank00000.pt").symlink_to("/dev/zero")


def _rank_file_is_a_fifo(step_dir):
    (step_dir / "rank00000.pt").unlink()
    os.mkfifo(step_dir / "rank00000.pt")


def _marker_is_a_link_to_dev_zero(step_dir):
    (step_dir / MARKER).unlink()
    (step_dir / MARKER).symlink_to("/dev/zero")


def _marker_names_dev_zero(step_dir):
    _rewrite_marker(step_dir, lambda m: m.setdefault("files", {}).update({"/dev/zero": "0" * 64}))


def _marker_names_a_file_outside(step_dir):
    (step_dir.parent.parent / "secret.json").write_text("{}")
    _rewrite_marker(step_dir, lambda m: m.setdefault("files", {}).update({"../../secret.json": "0" * 64}))


def _marker_lists_fewer_checksums_than_ranks(step_dir):
    _rewrite_marker(step_dir, lambda m: m.update(world_size=2))


def _rank_file_links_out_of_the_directory(step_dir):
    outside = step_dir.parent.parent / "elsewhere.pt"
    shutil.move(step_dir / "rank00000.pt", outside)
    (step_dir / "rank00000.pt").symlink_to(outside)


HOSTILE = {
    "rank file -> /dev/zero": (_rank_file_is_a_link_to_dev_zero, r"rank00000\.pt' is a symbolic link"),
    "rank file is a FIFO": (_rank_file_is_a_fifo, r"rank00000\.pt' is not a regular file"),
    "COMMITTED.json -> /dev/zero": (_marker_is_a_link_to_dev_zero, r"COMMITTED\.json' is a symbolic link"),
    "marker names /dev/zero": (_marker_names_dev_zero, r"names the file '/dev/zero', which is not a plain file name"),
    "marker names ../../secret.json": (_marker_names_a_file_outside,
                                       r"names the file '\.\./\.\./secret\.json', which is not a plain file name"),
    "fewer checksums than ranks": (_marker_lists_fewer_checksums_than_ranks,
                                   r"'sha256' must list one entry per rank \(2\), it has 1"),
    "rank file links out": (_rank_file_links_out_of_the_directory, r"rank00000\.pt' is a symbolic link"),
}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(HOSTILE))
def test_a_hostile_checkpoint_is_refused_naming_the_file_by_export_and_resume(saved, tmp_path, case):
    mutate, named = HOSTILE[case]
    directory, step_dir = _copy(saved, tmp_path)
    mutate(step_dir)
    with pytest.raises(CheckpointError, match=named):
        export_checkpoint(str(directory), str(tmp_path / "out"))
    assert not list(tmp_path.glob("out/*.safetensors"))
    if case not in ("marker names /dev/zero", "marker names ../../secret.json"):  # (a load reads no extra file)
        with pytest.raises(CheckpointError, match=named if "marker" not in case and "COMMITTED" not in case
                           else r"no intact committed checkpoint|" + named):
            _load(directory)
