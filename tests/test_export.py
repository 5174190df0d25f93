"""engine.save_pretrained: a live run exported as a Hugging Face checkpoint by every rank in
parallel, one unit gathered at a time (ZeRO-Infinity §6: no rank holds the whole model). The
checkpoint loads with ``type(model).from_pretrained`` with no missing or unexpected tensor,
holds the engine's fp32 masters bit for bit (or them cast to bf16), computes the trained model's
logits exactly, names tensors as the model's own save_pretrained does (tied copies dropped),
and loads back into another engine with tiertrain.load_pretrained.

One launch of 2 gloo ranks trains and exports every case (each rank imports transformers once);
the tests check its results in this process."""
from __future__ import annotations

import json
import os

import pytest
import torch

import tiertrain
from reference import make_config, rank_slices
from tiertrain.testing import run_distributed

transformers = pytest.importorskip("transformers")
import zoo  # noqa: E402
from safetensors import safe_open  # noqa: E402

WORLD, MICRO, STEPS = 2, 2, 2
SMALL_SHARDS = 16 * 1024
"""Bytes per file in the sharded exports: several files per rank for these small models."""


BUILDERS = {"llama": zoo.llama_gqa, "gpt2": zoo.gpt2_tied, "t5": zoo.t5, "lora": zoo.lora, "bart": zoo.bart,
            "mixtral": zoo.mixtral, "qwen2_moe": zoo.qwen2_moe}
CAUSAL = {"llama": True, "gpt2": True, "t5": False, "lora": True, "bart": False, "mixtral": True, "qwen2_moe": True}

# label -> (model, zero section, precision section, exports: (directory, save_pretrained kwargs),
#           round trip: (export directory, zero section of the engine it is loaded into) or None)
CASES = {
    "llama, stage 3": ("llama", {"stage": 3}, {},
                       [("fp32", {"max_shard_bytes": SMALL_SHARDS}), ("bf16", {"dtype": torch.bfloat16})],
                       ("fp32", {"stage": 2, "offload_optimizer": "cpu"})),
    "gpt2 tied, stage 3": ("gpt2", {"stage": 3}, {}, [("fp32", {})], ("fp32", {"stage": 3})),
    "t5 shared, stage 3, small params persistent": ("t5", {"stage": 3, "persistence_threshold": 64}, {},
                                                    [("fp32", {"max_shard_bytes": SMALL_SHARDS})], None),
    "bart buffer, stage 3": ("bart", {"stage": 3}, {}, [("fp32", {})], None),
    "lora frozen backbone, stage 3": ("lora", {"stage": 3}, {},
                                      [("fp32", {"max_shard_bytes": SMALL_SHARDS}), ("bf16", {"dtype": "bf16"})],
                                      ("fp32", {"stage": 3})),
    "lora frozen backbone, stage 1": ("lora", {"stage": 1}, {}, [("fp32", {"max_shard_bytes": SMALL_SHARDS})], None),
    "gpt2 tied, stage 0": ("gpt2", {"stage": 0}, {}, [("fp32", {})], None),
    "llama bf16, stage 1": ("llama", {"stage": 1}, {"dtype": "bf16"},
                            [("fp32", {"max_shard_bytes": SMALL_SHARDS}), ("bf16", {"dtype": torch.bfloat16})], None),
    # Checkpoints converted by transformers (issue 34, item 7): experts one tensor each on disk,
    # stacked in memory.
    "mixtral experts, stage 3": ("mixtral", {"stage": 3}, {}, [("fp32", {"max_shard_bytes": SMALL_SHARDS})],
                                 ("fp32", {"stage": 2, "offload_optimizer": "cpu"})),
    "qwen2 moe, stage 1": ("qwen2_moe", {"stage": 1}, {}, [("fp32", {}), ("bf16", {"dtype": "bf16"})],
                           ("fp32", {"stage": 3})),
    "gpt2, stage 3, params+optimizer on nvme": (
        "gpt2", {"stage": 3, "offload_params": "nvme", "offload_optimizer": "nvme", "nvme_chunk_mb": 0.01}, {},
        [("fp32", {"max_shard_bytes": SMALL_SHARDS}), ("bf16", {"dtype": torch.bfloat16})], ("fp32", {"stage": 1})),
}


def _build(name: str, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = BUILDERS[name]()
    if CAUSAL[name]:
        model.loss_function = zoo.causal_lm_loss
    return model


def _batches(name: str, steps: int = STEPS):
    return [{"input_ids": b["input_ids"], "labels": b["input_ids"] if CAUSAL[name] else b["labels"]}
            for b in zoo.global_batches(steps, MICRO * WORLD, seq_len=zoo.SEQ)]


def _config(zero: dict, precision: dict | None = None, nvme_path: str = ""):
    if "nvme" in zero.values():
        zero = {**zero, "nvme_path": nvme_path}
    return make_config(zero=zero, precision=precision or {}, batch={"micro_batch_size": MICRO},
                       optimizer={"eps": 1e-3})


def _report(r) -> dict:
    return dict(files=r.files, written=r.written, weight_map=r.weight_map, tensors=r.tensors,
                bytes_written=r.bytes_written, largest_write=r.largest_write, gathers=r.gathers,
                largest_gather=r.largest_gather, total_size=r.total_size, dtype=r.dtype)


@torch.no_grad()
def _logits(model: torch.nn.Module, name: str) -> torch.Tensor:
    model.eval()
    batch = _batches(name, steps=1)[0]
    return model(**batch).logits.detach().clone()


def _case(rank: int, world: int, root: str, label: str) -> dict:
    name, zero, precision, exports, round_trip = CASES[label]
    base = os.path.join(root, label.replace(" ", "_").replace(",", ""))
    cfg = _config(zero, precision, os.path.join(base, "swap"))
    engine = tiertrain.wrap(_build(name), cfg, tiertrain.Topology.build(cfg.parallel))
    for batch in _batches(name):
        engine.train_batch(rank_slices(batch, rank, world, MICRO, 1))
    full = engine.full_state_dict()
    # What a rank may hold at once: one unit in fp32, or one tensor the module holds whole anyway
    # (a buffer, a frozen parameter outside the layout: stage 1's frozen backbone).
    held = [t for t in list(engine.module.parameters()) + list(engine.module.buffers()) if t not in engine.flat.unit_of]
    out: dict = {"full": full, "exports": {}, "unit_bytes": max(u.padded_numel * 4 for u in engine.layout.all_units),
                 "held_bytes": max([t.numel() * 4 for t in held], default=0), "frozen_units": len(engine.layout.frozen)}
    for directory, kwargs in exports:
        report = engine.save_pretrained(os.path.join(base, directory), **kwargs)
        out["exports"][directory] = _report(report)
    if round_trip is not None:
        directory, zero_b = round_trip
        cfg_b = _config(zero_b, precision, os.path.join(base, "swap_b"))
        engine_b = tiertrain.wrap(_build(name, seed=1), cfg_b, tiertrain.Topology.build(cfg_b.parallel))
        before = engine_b.full_state_dict()
        tiertrain.load_pretrained(engine_b, os.path.join(base, directory))
        after = engine_b.full_state_dict()
        out["round trip"] = dict(changed=any(not torch.equal(before[n], after[n]) for n in before),
                                 differ=sorted(n for n in full if n not in after or not torch.equal(full[n], after[n])),
                                 names=sorted(after) == sorted(full))
        engine_b.close()
    model = engine.module
    engine.close()  # the model now holds the trained fp32 values
    out["closed"] = {n: t.detach().float().clone() if t.is_floating_point() else t.detach().clone()
                     for n, t in model.state_dict().items()}
    if rank == 0:
        out["logits"] = _logits(model, name)
    return out


def _misuse(rank: int, world: int, root: str) -> dict:
    """A bad dtype fails on every rank before any collective; a re-export into a directory
    replaces the earlier export's files; a model of one tensor is one model.safetensors."""
    cfg = _config({"stage": 3})
    engine = tiertrain.wrap(_build("llama"), cfg, tiertrain.Topology.build(cfg.parallel))
    out = {}
    for bad in (torch.int8, "fp8", 3):
        try:
            engine.save_pretrained(os.path.join(root, "bad"), dtype=bad)
            out[str(bad)] = None
        except ValueError as e:
            out[str(bad)] = str(e)
    try:
        engine.save_pretrained(os.path.join(root, "bad"), max_shard_bytes=0)
        out["max_shard_bytes"] = None
    except ValueError as e:
        out["max_shard_bytes"] = str(e)
    again = os.path.join(root, "again")
    engine.save_pretrained(again, max_shard_bytes=SMALL_SHARDS)
    out["first"] = sorted(os.listdir(again))
    out["second report"] = _report(engine.save_pretrained(again))  # larger files: fewer of them
    out["second"] = sorted(os.listdir(again))
    out["full"] = engine.full_state_dict()
    engine.close()

    single = torch.nn.Linear(8, 4, bias=False)
    cfg = _config({"stage": 2})
    engine = tiertrain.wrap(single, cfg, tiertrain.Topology.build(cfg.parallel), loss_fn=lambda m, b: m(b).sum())
    engine.save_pretrained(os.path.join(root, "single"))
    out["single"] = sorted(os.listdir(os.path.join(root, "single")))
    out["single full"] = engine.full_state_dict()
    engine.close()
    return out


def _all(rank: int, world: int, root: str) -> dict:
    results = {}
    for label in CASES:
        try:
            results[label] = _case(rank, world, root, label)
        except Exception as e:
            raise RuntimeError(f"export case {label!r} raised {type(e).__name__}: {e}") from e
    results["misuse"] = _misuse(rank, world, root)
    return results


@pytest.fixture(scope="module")
def exported(tmp_path_factory, one_torch_thread):
    """(root directory, [rank 0's results, rank 1's]): every case trained and exported."""
    root = str(tmp_path_factory.mktemp("export"))
    return root, run_distributed(_all, WORLD, root, timeout=400)


def _directory(root: str, label: str, export: str) -> str:
    return os.path.join(root, label.replace(" ", "_").replace(",", ""), export)


def _file_tensors(directory: str) -> dict[str, torch.Tensor]:
    out = {}
    for name in os.listdir(directory):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(directory, name), framework="pt") as f:
                for key in f.keys():
                    assert key not in out, f"{key} in two files"
                    out[key] = f.get_tensor(key)
    return out


HF_CASES = [label for label, case in CASES.items() if case[0] != "lora"]
LORA_CASES = [label for label, case in CASES.items() if case[0] == "lora"]


# -- the tests ------------------------------------------------------------------------------------

@pytest.mark.timeout(420)
@pytest.mark.parametrize("label", HF_CASES)
def test_from_pretrained_loads_the_masters_bit_for_bit_and_computes_the_same_logits(exported, label):
    root, per_rank = exported
    got = per_rank[0][label]
    name, _, precision, exports, _ = CASES[label]
    full = got["full"]
    assert all(torch.equal(got["closed"][n], full[n]) for n in full), "close() left other values than full_state_dict"
    cls = type(_build(name))
    for export, kwargs in exports:
        directory = _directory(root, label, export)
        loaded, info = cls.from_pretrained(directory, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], \
            f"{label} ({export}): {info}"
        state = loaded.state_dict()
        assert set(full) <= set(state), f"{label}: not loaded: {sorted(set(full) - set(state))}"
        bf16 = kwargs.get("dtype") is not None
        for n, want in full.items():
            want = want.to(torch.bfloat16) if bf16 else want
            assert torch.equal(state[n].to(want.dtype), want), f"{label} ({export}): {n} differs"
            if not bf16:
                assert state[n].dtype == torch.float32
        if not bf16 and not precision:  # (fp32 compute: the engine's own forward is fp32 too)
            assert torch.equal(_logits(loaded, name), got["logits"]), f"{label}: logits differ"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("label", list(CASES))
def test_files_hold_the_tensors_hugging_face_names_cast_once(exported, label, tmp_path):
    root, per_rank = exported
    got = per_rank[0][label]
    name, _, _, exports, _ = CASES[label]
    full = got["full"]
    model = _build(name)
    model.save_pretrained(str(tmp_path / "hf"))  # what transformers writes for the same model
    hf_names = set(_file_tensors(str(tmp_path / "hf")))
    # The values as transformers' own save would write them: through its checkpoint conversion
    # (experts unstacked), from the trained model's tensors and the module's buffers.
    from transformers.core_model_loading import revert_weight_conversion
    expected = revert_weight_conversion(model, {**model.state_dict(), **full})
    for export, kwargs in exports:
        directory = _directory(root, label, export)
        tensors = _file_tensors(directory)
        extra, missing = sorted(set(tensors) - hf_names), sorted(hf_names - set(tensors))
        assert not extra and not missing, f"{label} ({export}): names differ from save_pretrained's: {extra}, {missing}"
        dtype = torch.bfloat16 if kwargs.get("dtype") is not None else torch.float32
        for n, t in tensors.items():
            want = expected[n]
            assert t.dtype == dtype and torch.equal(t, want.to(dtype)), f"{label} ({export}): {n}"
        config = json.load(open(os.path.join(directory, "config.json")))
        assert config["architectures"] == [type(model).__name__] and config["dtype"] == str(dtype)[6:]
        assert not [f for f in os.listdir(directory) if f.endswith(".tmp")], "temporary files left"
        umask = os.umask(0)
        os.umask(umask)
        modes = {f: os.stat(os.path.join(directory, f)).st_mode & 0o777 for f in os.listdir(directory)}
        assert set(modes.values()) == {0o666 & ~umask}, f"{label} ({export}): not the mode open() gives: {modes}"


@pytest.mark.timeout(420)
@pytest.mark.parametrize("label", list(CASES))
def test_ranks_write_in_parallel_and_hold_at_most_one_unit(exported, label):
    root, per_rank = exported
    name, zero, precision, exports, _ = CASES[label]
    for export, kwargs in exports:
        reports = [r[label]["exports"][export] for r in per_rank]
        first = reports[0]
        directory = _directory(root, label, export)
        files = first["files"]
        assert all(r["files"] == files and r["weight_map"] == first["weight_map"] for r in reports)
        n = len(files)
        assert n >= WORLD and files == [f"model-{k:05d}-of-{n:05d}.safetensors" for k in range(1, n + 1)]
        if kwargs.get("max_shard_bytes"):
            assert n > 2 * WORLD, f"{label} ({export}): only {n} files"
        index = json.load(open(os.path.join(directory, "model.safetensors.index.json")))
        assert index["weight_map"] == first["weight_map"]
        assert index["metadata"]["total_size"] == first["total_size"]
        assert sorted(os.listdir(directory)) == sorted(files + ["model.safetensors.index.json", "config.json"] + (
            ["generation_config.json"] if os.path.exists(os.path.join(directory, "generation_config.json")) else []))
        # Parallel: both ranks wrote files, none twice, every file once, bytes balanced.
        written = [r["written"] for r in reports]
        assert all(written) and sorted(written[0] + written[1]) == sorted(files)
        assert not set(written[0]) & set(written[1])
        assert sum(r["bytes_written"] for r in reports) == first["total_size"]
        assert sum(r["tensors"] for r in reports) == len(first["weight_map"])
        shares = [r["bytes_written"] for r in reports]
        assert all(share > 0.25 * first["total_size"] for share in shares), shares
        # Bounded: no gather or write larger than one unit, so never the whole model.
        unit_bytes, held_bytes = per_rank[0][label]["unit_bytes"], per_rank[0][label]["held_bytes"]
        for r in reports:
            assert 0 < r["largest_write"] <= max(unit_bytes, held_bytes), (label, export, r)
            assert r["largest_gather"] <= unit_bytes, (label, export, r)
        if zero["stage"] == 3:
            fp32_total = first["total_size"] * (2 if kwargs.get("dtype") else 1)
            assert all(r["gathers"] > 0 and r["largest_gather"] < fp32_total for r in reports)
        if zero["stage"] == 1:  # resident: the masters gathered only when the compute copy is not the value wanted
            wants_masters = (kwargs.get("dtype") or torch.float32) != (torch.bfloat16 if precision else torch.float32)
            assert all((r["gathers"] > 0) == wants_masters for r in reports), (export, reports)


@pytest.mark.timeout(420)
@pytest.mark.parametrize("label", LORA_CASES)
def test_lora_model_tensors_equal_full_state_dict_by_name(exported, label):
    """Not a pure Hugging Face class (adapters replace q_proj and v_proj): its files hold every
    tensor of full_state_dict, the frozen backbone included (frozen units at stage 3, plain
    frozen parameters the module holds whole at stage 1)."""
    root, per_rank = exported
    got = per_rank[0][label]
    full = got["full"]
    assert (got["frozen_units"] > 0) == (CASES[label][1]["stage"] == 3)
    assert any(".base." in n for n in full) and any(".a.weight" in n for n in full)
    for export, kwargs in CASES[label][3]:
        dtype = torch.bfloat16 if kwargs.get("dtype") is not None else torch.float32
        tensors = _file_tensors(_directory(root, label, export))
        assert set(tensors) == set(full)
        differ = [n for n in full if not torch.equal(tensors[n], full[n].to(dtype))]
        assert not differ, f"{export}: {differ}"


@pytest.mark.timeout(420)
def test_export_loads_back_into_another_engine_with_load_pretrained(exported):
    root, per_rank = exported
    cases = [label for label, case in CASES.items() if case[4] is not None]
    assert len(cases) >= 3
    for label in cases:
        for rank, results in enumerate(per_rank):
            trip = results[label]["round trip"]
            assert trip["names"] and trip["changed"], f"{label}, rank {rank}: {trip}"
            assert not trip["differ"], f"{label}, rank {rank}: differ after load_pretrained: {trip['differ']}"


@pytest.mark.timeout(420)
def test_bad_arguments_re_export_and_single_file(exported):
    root, per_rank = exported
    for rank, results in enumerate(per_rank):
        got = results["misuse"]
        for bad in ("torch.int8", "fp8", "3"):
            assert got[bad] is not None and "dtype" in got[bad] and "torch.bfloat16" in got[bad], (rank, bad, got[bad])
        assert got["max_shard_bytes"] is not None and "max_shard_bytes" in got["max_shard_bytes"]
    got = per_rank[0]["misuse"]
    assert len([f for f in got["first"] if f.startswith("model-")]) > len(
        [f for f in got["second"] if f.startswith("model-")]), (got["first"], got["second"])
    second = got["second report"]["files"]
    assert got["second"] == sorted(second + ["config.json", "generation_config.json", "model.safetensors.index.json"])
    tensors = _file_tensors(os.path.join(root, "again"))
    assert set(tensors) == set(got["full"]) and all(torch.equal(tensors[n], got["full"][n]) for n in tensors)
    assert got["single"] == ["model.safetensors"]  # one tensor: one file, no index, no config
    tensors = _file_tensors(os.path.join(root, "single"))
    assert list(tensors) == ["weight"] and torch.equal(tensors["weight"], got["single full"]["weight"])
