"""`data.path` formats (tiertrain.data.formats): .npy and raw .bin token arrays, text and
JSONL tokenised with a local tokenizer.json or as bytes, a Hugging Face datasets directory;
and the bad-data table: every bad input is one ConfigError before training, naming the
file, the bad value and (where there is one) its position.

The table goes through ``check_launch``, the check `tiertrain train` runs before any
process starts, so each row also says that the error comes before training."""
from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from tiertrain import cli
from tiertrain.config import ConfigError
from tiertrain.data import ShardedSampler, micro_batches
from tiertrain.train import TrainConfig, _build_dataset, check_launch, default_model

SEQ = 8
"""model.seq_len of every config here: one sample is SEQ + 1 tokens."""

SENTENCES = [
    "the cat sat on the mat",
    "the dog sat on the log",
    "a cat and a dog ran to the mat",
    "the log and the mat are on the floor",
]


def _cfg(tmp_path: Path, path: Path | str, *extra: str) -> TrainConfig:
    return cli.load_train_config(None, ["--model.n_layers", "1", "--model.hidden", "32", "--model.n_heads", "2",
                                        "--model.seq_len", str(SEQ), "--data.path", str(path),
                                        "--data.cache_dir", str(tmp_path / "cache"),
                                        "--logging.metrics_file", "", *extra])


def _windows(ds) -> list[list[int]]:
    """Every sample's input_ids + its last label: the seq_len + 1 tokens it was cut from."""
    out = []
    for i in range(len(ds)):
        s = ds[i]
        assert s["input_ids"].dtype == torch.int64 and s["input_ids"].shape == (SEQ,)
        assert torch.equal(s["input_ids"][1:], s["labels"][:-1])
        out.append(s["input_ids"].tolist() + [int(s["labels"][-1])])
    return out


def _train_tokenizer(path: Path, kind: str = "wordlevel") -> int:
    """A tokenizer.json trained here on SENTENCES; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    if kind == "wordlevel":
        tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]"])
    else:
        tok = Tokenizer(models.BPE(unk_token="[UNK]"))
        trainer = trainers.BpeTrainer(special_tokens=["[UNK]"], vocab_size=60)
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(SENTENCES * 3, trainer)
    tok.save(str(path))
    return tok.get_vocab_size(with_added_tokens=True)


# --------------------------------------------------------------------------- formats


def test_npy_1d_is_read_with_its_header_dtype(tmp_path):
    """(Once: the header's bytes were read as uint16 tokens.)"""
    tokens = (np.arange(50) * 7 % 256).astype(np.int32)
    np.save(tmp_path / "t.npy", tokens)
    ds = _build_dataset(_cfg(tmp_path, tmp_path / "t.npy"))
    assert len(ds) == (50 - 1) // SEQ
    assert _windows(ds) == [tokens[i * SEQ: i * SEQ + SEQ + 1].tolist() for i in range(len(ds))]


def test_npy_2d_rows_are_windows_that_never_cross_a_row(tmp_path):
    rows = np.arange(4 * 20, dtype=np.uint16).reshape(4, 20) % 256  # 20 tokens: 2 windows of 9 per row
    np.save(tmp_path / "rows.npy", rows)
    ds = _build_dataset(_cfg(tmp_path, tmp_path / "rows.npy"))
    assert len(ds) == 4 * ((20 - 1) // SEQ)
    expected = [rows[r, k * SEQ: k * SEQ + SEQ + 1].tolist() for r in range(4) for k in range(2)]
    assert _windows(ds) == expected


@pytest.mark.parametrize("dtype", ["uint16", "int32", "uint8", "int64"])
def test_raw_bin_is_read_with_data_dtype(tmp_path, dtype):
    tokens = (np.arange(40) * 5 % 256).astype(dtype)
    (tmp_path / "t.bin").write_bytes(tokens.astype(np.dtype(dtype).newbyteorder("<")).tobytes())
    ds = _build_dataset(_cfg(tmp_path, tmp_path / "t.bin", "--data.dtype", dtype))
    assert _windows(ds) == [tokens[i * SEQ: i * SEQ + SEQ + 1].tolist() for i in range(len(ds))]


def test_text_file_as_bytes_is_cached_by_content(tmp_path):
    text = "hello, wörld\n" * 4
    (tmp_path / "c.txt").write_text(text, encoding="utf-8")
    ds = _build_dataset(_cfg(tmp_path, tmp_path / "c.txt"))
    stream = list(text.encode("utf-8"))
    assert _windows(ds) == [stream[i * SEQ: i * SEQ + SEQ + 1] for i in range(len(ds))]
    cached = list((tmp_path / "cache").glob("c-*.npy"))
    assert len(cached) == 1
    assert np.load(cached[0]).tolist() == stream
    _build_dataset(_cfg(tmp_path, tmp_path / "c.txt"))  # the same content: the same cache file
    assert list((tmp_path / "cache").glob("c-*.npy")) == cached
    (tmp_path / "c.txt").write_text(text + "more\n", encoding="utf-8")  # new content: a new key
    _build_dataset(_cfg(tmp_path, tmp_path / "c.txt"))
    assert len(list((tmp_path / "cache").glob("c-*.npy"))) == 2


@pytest.mark.parametrize("kind", ["wordlevel", "bpe"])
def test_jsonl_with_a_tokenizer_json(tmp_path, kind):
    from tokenizers import Tokenizer

    vocab = _train_tokenizer(tmp_path / "tokenizer.json", kind)
    lines = [json.dumps({"body": s, "id": i}) for i, s in enumerate(SENTENCES)]
    (tmp_path / "c.jsonl").write_text("\n".join(lines) + "\n\n", encoding="utf-8")  # (a blank line is skipped)
    cfg = _cfg(tmp_path, tmp_path / "c.jsonl", "--data.tokenizer", str(tmp_path / "tokenizer.json"),
               "--data.text_field", "body", "--model.vocab_size", str(vocab))
    ds = _build_dataset(cfg)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    stream = [i for s in SENTENCES for i in tok.encode(s + "\n").ids]
    assert len(stream) >= SEQ + 1
    assert _windows(ds) == [stream[i * SEQ: i * SEQ + SEQ + 1] for i in range(len(ds))]
    # A different tokenizer over the same file is another cache entry, never the stale one.
    ds_bytes = _build_dataset(_cfg(tmp_path, tmp_path / "c.jsonl", "--data.text_field", "body"))
    assert _windows(ds_bytes)[0] == list((SENTENCES[0] + "\n").encode())[: SEQ + 1]
    assert len(list((tmp_path / "cache").glob("c-*.npy"))) == 2


def test_the_dataset_feeds_the_sampler_and_micro_batches(tmp_path):
    np.save(tmp_path / "t.npy", np.arange(200, dtype=np.int64) % 256)
    ds = _build_dataset(_cfg(tmp_path, tmp_path / "t.npy"))
    sampler = ShardedSampler(len(ds), 2, 1, seed=0, shuffle=True)
    batch = next(micro_batches(ds, sampler, 3))
    assert batch["input_ids"].shape == batch["labels"].shape == (3, SEQ)


def test_a_large_memory_mapped_file_is_scanned_in_chunks(tmp_path):
    """The vocabulary check is vectorised over chunks of the memory map: a bad id near the
    end of a 16M-token file is found, named with its position, in well under a second."""
    from tiertrain.data.formats import first_out_of_range

    tokens = np.lib.format.open_memmap(tmp_path / "big.npy", mode="w+", dtype=np.uint16, shape=(1 << 24,))
    tokens[:] = 7
    tokens[(1 << 24) - 3] = 300
    tokens.flush()
    del tokens
    arr = np.load(tmp_path / "big.npy", mmap_mode="r")
    assert first_out_of_range(arr, 256, chunk=1 << 20) == ((1 << 24) - 3, 300)
    assert first_out_of_range(arr, 301) is None


def test_hf_datasets_directory_without_the_package_says_to_install_it(tmp_path, monkeypatch):
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_info.json").write_text("{}")
    (tmp_path / "ds" / "state.json").write_text("{}")
    monkeypatch.setitem(sys.modules, "datasets", None)  # (import datasets raises ImportError)
    with pytest.raises(ConfigError, match=r"data\.path=.*ds.*pip install datasets"):
        check_launch(_cfg(tmp_path, tmp_path / "ds"), 1)


def test_hf_datasets_directory_is_loaded_with_load_from_disk(tmp_path, monkeypatch):
    """Through a stand-in for `datasets` (not installed here) with load_from_disk's shape."""
    (tmp_path / "ds").mkdir()
    (tmp_path / "ds" / "dataset_dict.json").write_text("{}")
    rows = [list(range(i, i + 12)) for i in range(5)]

    class FakeDataset:
        column_names = ["input_ids"]
        _fingerprint = "abc123"

        def __len__(self):
            return len(rows)

        def __getitem__(self, key):
            assert key == "input_ids"
            return rows

    fake = types.ModuleType("datasets")
    fake.load_from_disk = lambda path: {"train": FakeDataset()}
    monkeypatch.setitem(sys.modules, "datasets", fake)
    ds = _build_dataset(_cfg(tmp_path, tmp_path / "ds"))
    assert _windows(ds) == [r[: SEQ + 1] for r in rows]  # equal-length rows stay rows, one window each


def test_a_real_datasets_directory_of_token_rows_and_of_text(tmp_path):
    """The real `datasets` package (the hf extra): save_to_disk of token rows, and of a text
    column tokenised like a .jsonl file."""
    datasets = pytest.importorskip("datasets")
    rows = [list(range(i, i + SEQ + 1)) for i in range(6)]
    datasets.Dataset.from_dict({"input_ids": rows}).save_to_disk(str(tmp_path / "tokens"))
    assert _windows(_build_dataset(_cfg(tmp_path, tmp_path / "tokens"))) == rows
    datasets.Dataset.from_dict({"text": SENTENCES * 4}).save_to_disk(str(tmp_path / "text"))
    text = _build_dataset(_cfg(tmp_path, tmp_path / "text"))
    joined = "".join(SENTENCES * 4).encode()
    assert len(text) >= 1 and _windows(text)[0] == list(joined[:SEQ + 1])


# --------------------------------------------------------------------------- the bad-data table


def _write(tmp_path: Path, case: str) -> tuple[Path, list[str]]:
    """The bad input of one row of the table: its path and the extra config overrides."""
    p = tmp_path / "data"
    if case == "missing":
        return tmp_path / "nope.npy", []
    if case == "empty":
        (p := tmp_path / "empty.bin").write_bytes(b"")
    elif case == "directory":
        (p := tmp_path / "somedir").mkdir()
    elif case == "npy_float":
        np.save(p := tmp_path / "float.npy", np.zeros(40, dtype=np.float32))
    elif case == "npy_3d":
        np.save(p := tmp_path / "cube.npy", np.zeros((2, 3, 20), dtype=np.int32))
    elif case == "npy_bad_id":
        tokens = np.full(100, 5, dtype=np.int32)
        tokens[37] = 300
        tokens[60] = 999  # (only the first is named)
        np.save(p := tmp_path / "vocab.npy", tokens)
    elif case == "npy_negative_id":
        tokens = np.full(100, 5, dtype=np.int64)
        tokens[12] = -1
        np.save(p := tmp_path / "neg.npy", tokens)
    elif case == "npy_2d_bad_id":
        tokens = np.full((3, 20), 5, dtype=np.uint16)
        tokens[2, 4] = 4000
        np.save(p := tmp_path / "rows.npy", tokens)
    elif case == "npy_short_rows":
        np.save(p := tmp_path / "short_rows.npy", np.zeros((10, SEQ), dtype=np.int32))
    elif case == "npy_too_few":
        np.save(p := tmp_path / "few.npy", np.zeros(SEQ, dtype=np.int32))
    elif case == "bin_odd_size":
        (p := tmp_path / "odd.bin").write_bytes(b"\x01\x00" * 20 + b"\x01")
    elif case == "bin_int32_as_uint16":
        (p := tmp_path / "int32.bin").write_bytes((np.arange(100, dtype="<i4") % 200 + 1).tobytes())
    elif case == "bin_size_not_int32":
        (p := tmp_path / "six.bin").write_bytes(b"\x01\x00" * 51)
        return p, ["--data.dtype", "int32"]
    elif case == "bin_bad_id":
        tokens = np.full(64, 3, dtype="<u2")
        tokens[50] = 256
        (p := tmp_path / "bad.bin").write_bytes(tokens.tobytes())
    elif case == "npy_header_as_bin":
        np.save(tmp_path / "x.npy", np.arange(40, dtype=np.float64))
        (p := tmp_path / "renamed.bin").write_bytes((tmp_path / "x.npy").read_bytes())
    elif case == "json_not_jsonl":
        (p := tmp_path / "c.json").write_text(json.dumps([{"text": s} for s in SENTENCES]))
    elif case == "jsonl_not_json":
        (p := tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"text": broken\n')
    elif case == "jsonl_no_field":
        (p := tmp_path / "c.jsonl").write_text('{"text": "fine"}\n{"text": "ok"}\n{"body": "x"}\n')
    elif case == "txt_not_utf8":
        (p := tmp_path / "c.txt").write_bytes(b"hello world " * 3 + b"\xff\xfe tail")
    elif case == "txt_too_short":
        (p := tmp_path / "c.txt").write_text("hi\n")
    elif case == "tokenizer_broken":
        (tmp_path / "c.txt").write_text(" ".join(SENTENCES))
        (tok := tmp_path / "tokenizer.json").write_text('{"model": "not a tokenizer"}')
        return tmp_path / "c.txt", ["--data.tokenizer", str(tok)]
    elif case == "tokenizer_missing":
        (tmp_path / "c.txt").write_text(" ".join(SENTENCES))
        return tmp_path / "c.txt", ["--data.tokenizer", str(tmp_path / "no_tokenizer.json")]
    elif case == "tokenizer_too_big":
        (tmp_path / "c.txt").write_text(" ".join(SENTENCES))
        _train_tokenizer(tok := tmp_path / "tokenizer.json")
        return tmp_path / "c.txt", ["--data.tokenizer", str(tok), "--model.vocab_size", "8"]
    elif case == "tokenizer_with_token_file":
        np.save(p := tmp_path / "t.npy", np.zeros(40, dtype=np.int32))
        _train_tokenizer(tok := tmp_path / "tokenizer.json")
        return p, ["--data.tokenizer", str(tok), "--model.vocab_size", "64"]
    else:
        raise AssertionError(case)
    return p, []


BAD_DATA = [
    # case, what the one-line error must contain (besides data.path and the file's name)
    ("missing", ["no such file"]),
    ("empty", ["empty", "0 bytes"]),
    ("directory", ["is a directory", ".npy", ".jsonl"]),
    ("npy_float", ["float32", "integer"]),
    ("npy_3d", ["(2, 3, 20)", "1-D", "2-D"]),
    ("npy_bad_id", ["token id 300", "position 37", "model.vocab_size=256"]),
    ("npy_negative_id", ["token id -1", "position 12"]),
    ("npy_2d_bad_id", ["token id 4000", "row 2, column 4", "position 44"]),
    ("npy_short_rows", [f"rows of {SEQ} tokens", f"model.seq_len={SEQ}", f"at least {SEQ + 1}"]),
    ("npy_too_few", [f"{SEQ} tokens", f"model.seq_len={SEQ}", f"at least {SEQ + 1}"]),
    ("bin_odd_size", ["41 bytes", "multiple of 2", "data.dtype='uint16'"]),
    ("bin_int32_as_uint16", ["data.dtype='uint16'", "every second", "data.dtype='int32'"]),
    ("bin_size_not_int32", ["102 bytes", "multiple of 4", "data.dtype='int32'"]),
    ("bin_bad_id", ["token id 256", "position 50", "model.vocab_size=256"]),
    ("npy_header_as_bin", ["float64", "integer"]),
    ("json_not_jsonl", ["JSON", ".jsonl"]),
    ("jsonl_not_json", ["line 2", "not JSON", "column 10"]),
    ("jsonl_no_field", ["line 3", "'text'", "data.text_field"]),
    ("txt_not_utf8", ["UTF-8", "byte 36"]),
    ("txt_too_short", ["3 tokens", f"at least {SEQ + 1}"]),
    ("tokenizer_broken", ["data.tokenizer=", "tokenizer.json", "does not load"]),
    ("tokenizer_missing", ["data.tokenizer=", "no_tokenizer.json", "no such file"]),
    ("tokenizer_too_big", ["data.tokenizer=", "model.vocab_size=8", "vocabulary of"]),
    ("tokenizer_with_token_file", ["data.tokenizer=", "t.npy", "already token ids"]),
]


@pytest.mark.parametrize("case, needles", BAD_DATA, ids=[c for c, _ in BAD_DATA])
def test_bad_data_is_one_config_error_before_training(tmp_path, case, needles):
    path, extra = _write(tmp_path, case)
    cfg = _cfg(tmp_path, path, *extra)
    with pytest.raises(ConfigError) as info:
        check_launch(cfg, 1)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("data."), msg
    assert "data.path=" in msg and path.name in msg, msg
    for needle in needles:
        assert needle in msg, (needle, msg)


def test_fewer_samples_than_data_parallel_ranks(tmp_path):
    np.save(tmp_path / "t.npy", np.zeros(2 * SEQ + 1, dtype=np.int32))  # 2 samples
    check_launch(_cfg(tmp_path, tmp_path / "t.npy"), 2)
    with pytest.raises(ConfigError, match=r"data\.path=.*t\.npy.*2 samples.*at least 4"):
        check_launch(_cfg(tmp_path, tmp_path / "t.npy", "--batch.micro_batch_size", "1"), 4)


@pytest.mark.parametrize("args, field", [
    (["--data.dtype", "float32"], "data.dtype"),
    (["--data.text_field", ""], "data.text_field"),
    (["--data.tokenizer", "tok.json"], "data.tokenizer"),  # with the bundled corpus (data.path='')
])
def test_data_config_fields_are_validated(args, field):
    with pytest.raises(ConfigError, match=re.escape(field)):
        cli.load_train_config(None, args)


# --------------------------------------------------------------------------- the command, end to end


@pytest.mark.timeout(120)
def test_train_on_jsonl_with_a_local_tokenizer_json(tmp_path, monkeypatch, capsys):
    vocab = _train_tokenizer(tmp_path / "tokenizer.json", "bpe")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": s}) + "\n" for s in SENTENCES * 10), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    assert cli.main(["train", "--nproc", "1", "--steps", "2", "--model.n_layers", "1", "--model.hidden", "32",
                     "--model.n_heads", "2", "--model.seq_len", "16", "--model.vocab_size", str(vocab),
                     "--batch.micro_batch_size", "2", "--batch.global_batch_size", "2",
                     "--logging.progress", "false", "--logging.metrics_file", "m.jsonl",
                     "--data.path", "corpus.jsonl", "--data.tokenizer", "tokenizer.json"]) == 0
    records = [json.loads(line) for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert records[-1]["step"] == 2 and all(r["loss"] is not None for r in records)
    assert list((tmp_path / "runs" / "cache").glob("corpus-*.npy"))


def test_readme_and_help_state_the_default_models_parameter_count():
    n = default_model().num_parameters()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert f"{n:,}" in readme and "5M parameters" not in readme
    assert f"~{n / 1e6:.2f}M parameters" in cli.USAGE
