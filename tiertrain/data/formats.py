"""Training data in the formats users already have, opened as next-token windows and
checked before the first step.

:func:`open_token_dataset` chooses the reader from the file itself, never from a config
switch, so a file cannot be read as something it is not:

* a file starting with numpy's magic (``.npy``, whatever its name) is read through its
  header -- real dtype and shape, memory-mapped -- 1-D (a token stream) or 2-D (rows of
  fixed length, whose windows never cross a row);
* ``.txt`` (UTF-8) and ``.jsonl`` (one JSON object per line, its ``text_field`` the
  text) are tokenised once, with a local ``tokenizer.json`` (the ``tokenizers``
  library) or as UTF-8 bytes, into a ``.npy`` under ``cache_dir`` named by the hash of
  the content and of the tokenizer, so a changed file or tokenizer never reuses a stale
  cache, and every rank after the first maps the cached array;
* a directory saved by Hugging Face ``datasets`` (``save_to_disk``) is read with
  ``load_from_disk`` when that package is installed (an ``input_ids`` column, or the text
  column tokenised as above);
* anything else is a raw headerless little-endian token file (nanoGPT ``.bin``) of
  ``dtype`` (uint16 by default, what ``tiertrain train`` always read).

Every mistake found is a :class:`~tiertrain.config.ConfigError` in one line naming the
config field (``data.path``, ``data.tokenizer`` ...), the file, the bad value and what is
valid: a missing, empty or wrongly sized file, a non-integer or >2-D array, a raw file
that looks written with a wider dtype (the int32-read-as-uint16 trap), rows or a stream
shorter than one sample, a JSONL line that is not JSON or lacks the field (by line
number), a tokenizer that does not load or outgrows the model's vocabulary, and the
first token id outside ``[0, vocab_size)`` with its position. The last one used to
surface as a bare ``IndexError`` only once a batch reached the token; here the whole
array is scanned up front, vectorised over chunks of the memory map, so even a
multi-gigabyte file costs about one sequential read.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterable, Literal, get_args

import numpy as np
import torch
from torch.utils.data import Dataset

from tiertrain.config import ConfigError
from tiertrain.data.tokenizer import ByteTokenizer
from tiertrain.io.fileio import atomic_write, file_sha256

__all__ = ["RawDtype", "TokenArrayDataset", "TextTokenizer", "first_out_of_range", "load_tokenizer",
           "open_token_dataset"]

RawDtype = Literal["uint8", "uint16", "int16", "uint32", "int32", "int64"]
"""dtypes a raw (headerless, little-endian) token file may be read as."""

NPY_MAGIC = b"\x93NUMPY"
"""First bytes of every .npy file: such a file is read through its header, whatever its name."""

TEXT_SUFFIXES = (".txt", ".jsonl")
"""File name endings read as text and tokenised (everything else without a .npy header is raw tokens)."""

NOT_TOKENS = {".json": "JSON (one document per line is .jsonl)", ".csv": "CSV", ".tsv": "TSV", ".parquet": "Parquet",
              ".arrow": "Arrow", ".gz": "gzip", ".zip": "zip", ".pt": "a torch file", ".safetensors": "safetensors"}
"""Endings of files that are surely not raw tokens: refused by name rather than read as uint16 garbage."""

HF_DATASET_MARKERS = ("dataset_info.json", "state.json", "dataset_dict.json")
"""Files that ``datasets``' save_to_disk writes: a directory holding one is read with load_from_disk."""

CACHE_FORMAT = 1
"""Part of every cache key: bump it when tokenisation changes, so old caches are not reused."""

_VALID = ("expected a token file (.npy, or a raw .bin of data.dtype), text (.txt, .jsonl), a Hugging Face "
          "datasets directory (save_to_disk), or '' for the bundled corpus")


class TokenArrayDataset(Dataset):
    """Next-token windows over a 1-D token stream or the rows of a 2-D token array.

    The same contract as :class:`~tiertrain.data.TokenFileDataset` (so ShardedSampler and
    micro_batches work unchanged): sample ``i`` is ``seq_len + 1`` consecutive tokens,
    ``input_ids`` its first ``seq_len`` and ``labels`` its last ``seq_len``. In a 2-D
    array each row gives ``(row_len - 1) // seq_len`` windows and none crosses into the
    next row (rows are usually separate documents or pre-cut sequences).
    """

    def __init__(self, tokens: np.ndarray, seq_len: int, source: str = ""):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"TokenArrayDataset.seq_len={seq_len!r} is invalid: must be a positive int")
        if tokens.ndim not in (1, 2) or tokens.dtype.kind not in "iu":
            raise ValueError(f"TokenArrayDataset: tokens must be a 1-D or 2-D integer array, "
                             f"got shape {tokens.shape} of {tokens.dtype}")
        row_len = tokens.shape[-1]
        if row_len < seq_len + 1:
            raise ValueError(f"TokenArrayDataset: {row_len} tokens per row, fewer than seq_len + 1 = {seq_len + 1}")
        self.tokens: np.ndarray = tokens
        """The token ids (usually a read-only memory map)."""
        self.seq_len: int = seq_len
        """Tokens per sample (inputs and labels each have this length)."""
        self.source: str = source
        """Where the tokens came from (for repr and messages)."""
        self._per_row = (row_len - 1) // seq_len
        self._rows = tokens.shape[0] if tokens.ndim == 2 else 1

    def __len__(self) -> int:
        return self._rows * self._per_row

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"TokenArrayDataset index {index} out of range for {n} samples")
        row, k = divmod(index % n, self._per_row)
        stream = self.tokens[row] if self.tokens.ndim == 2 else self.tokens
        start = k * self.seq_len
        # (np.array copies: a tensor over the read-only memory map would warn and could not be written)
        window = torch.from_numpy(np.array(stream[start: start + self.seq_len + 1], dtype=np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}

    def __repr__(self) -> str:
        return (f"TokenArrayDataset({self.source!r}, shape={tuple(self.tokens.shape)}, dtype={self.tokens.dtype}, "
                f"seq_len={self.seq_len}, samples={len(self)})")


def first_out_of_range(tokens: np.ndarray, vocab_size: int, chunk: int = 1 << 22) -> tuple[int, int] | None:
    """(flat position, id) of the first token id outside ``[0, vocab_size)``, or None.

    Reads ``chunk`` ids at a time (min and max first, the exact position only in the
    chunk that fails), so a memory-mapped file is checked at about the speed of reading
    it and never held in memory whole.
    """
    flat = tokens.reshape(-1)  # (a view for the C-order arrays written by np.save and the raw reader)
    for start in range(0, flat.shape[0], chunk):
        part = np.asarray(flat[start: start + chunk])
        if part.size and (part.min() < 0 or part.max() >= vocab_size):
            at = int(np.flatnonzero((part < 0) | (part >= vocab_size))[0])
            return start + at, int(part[at])
    return None


class TextTokenizer:
    """Text → token ids for tokenising a corpus: a local ``tokenizer.json`` or UTF-8 bytes.

    ``digest`` identifies the exact tokenizer (its file's hash), so it keys the cache.
    """

    def __init__(self, hf: Any = None, digest: str = "bytes", name: str = "UTF-8 bytes"):
        self._hf = hf
        self.digest: str = digest
        """Hash of the tokenizer (its file's), part of the cache key."""
        self.name: str = name
        """How the text was tokenised, for messages."""
        self.vocab_size: int = hf.get_vocab_size(with_added_tokens=True) if hf is not None else ByteTokenizer.vocab_size
        """Number of ids the tokenizer can produce (special and added tokens included)."""

    def encode_batch(self, texts: list[str], add_special_tokens: bool) -> list[np.ndarray]:
        """Token ids of each text; special tokens (e.g. a BOS the tokenizer's post-processor
        adds) only where asked, i.e. once per document rather than per line of one text."""
        if self._hf is None:
            return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
        return [np.asarray(e.ids, dtype=np.int64)
                for e in self._hf.encode_batch(texts, add_special_tokens=add_special_tokens)]


GPT_VOCAB = "model.vocab_size"
"""The name of the vocabulary size in messages for tiertrain's GPT (the field that sets it)."""


def _larger_vocabulary(vocab_name: str, needed: int | None = None) -> str:
    """The fix of a vocabulary too small: the field to raise (the GPT's), or, for a model whose
    vocabulary is its own (model.hf), data tokenised with the model's tokenizer."""
    if vocab_name == GPT_VOCAB:
        return f"--model.vocab_size {needed}" if needed else "a larger --model.vocab_size"
    return f"the tokenizer {vocab_name} was trained with (model.vocab_size does not apply to it)"


def load_tokenizer(path: str | os.PathLike, vocab_size: int, data_path: str = "",
                   vocab_name: str = GPT_VOCAB) -> TextTokenizer:
    """The tokenizer.json at ``path`` (``tokenizers`` library), or a ConfigError naming
    ``data.tokenizer`` when it is missing, does not load, or has more ids than
    ``vocab_size`` (the model's embedding rows; vocab_name says where that number comes from)."""
    where = f"data.tokenizer={str(path)!r} is invalid for data.path={data_path!r}"
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{where}: no such file; expected a tokenizer.json saved by the tokenizers library, "
                          f"or data.tokenizer='' to tokenise as UTF-8 bytes")
    raw = p.read_bytes()
    try:
        from tokenizers import Tokenizer

        hf = Tokenizer.from_str(raw.decode("utf-8"))
    except ImportError:
        raise ConfigError(f"{where}: the tokenizers package is not installed (pip install tokenizers)") from None
    except Exception as e:  # (tokenizers raises a bare Exception for every parse error)
        detail = " ".join(str(e).split())[:200]
        raise ConfigError(f"{where}: it does not load as a tokenizer.json ({detail}); expected a file written by "
                          f"tokenizers' Tokenizer.save or a Hugging Face tokenizer's save_pretrained") from None
    tok = TextTokenizer(hf, digest=hashlib.sha256(raw).hexdigest(), name=f"tokenizer {p.name}")
    if tok.vocab_size > vocab_size:
        raise ConfigError(f"{where}: it has a vocabulary of {tok.vocab_size} ids, more than {vocab_name}="
                          f"{vocab_size}; expected at most {vocab_size} ids "
                          f"({_larger_vocabulary(vocab_name, tok.vocab_size)})")
    return tok


def open_token_dataset(
    path: str | os.PathLike,
    *,
    seq_len: int,
    vocab_size: int,
    dtype: RawDtype = "uint16",
    tokenizer: str = "",
    text_field: str = "text",
    cache_dir: str | os.PathLike = "runs/cache",
    check_ids: bool = True,
    vocab_name: str = GPT_VOCAB,
) -> TokenArrayDataset:
    """``path`` opened as next-token windows of ``seq_len`` (see the module docstring for
    the formats), after checking it fits a model of ``vocab_size`` ids and ``seq_len``.

    The arguments are the ``data.*`` config fields and the messages name them so.
    ``check_ids=False`` skips the vocabulary scan (for a caller that has just run it on
    the same file, as ``tiertrain train``'s ranks do after its pre-launch check).
    """
    shown = str(path)
    where = f"data.path={shown!r} is invalid"
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"{where}: no such file or directory; {_VALID}")
    if p.is_dir():
        if not any((p / m).is_file() for m in HF_DATASET_MARKERS):
            raise ConfigError(f"{where}: it is a directory without the files datasets' save_to_disk writes "
                              f"({', '.join(HF_DATASET_MARKERS)}); {_VALID}")
        tokens, raw_dtype = _hf_dataset_tokens(p, shown, vocab_size, tokenizer, text_field, Path(cache_dir),
                                               vocab_name), None
    elif not p.is_file():
        raise ConfigError(f"{where}: it is not a regular file; {_VALID}")
    else:
        size = p.stat().st_size
        if size == 0:
            raise ConfigError(f"{where}: the file is empty (0 bytes); {_VALID}")
        with open(p, "rb") as f:
            is_npy = f.read(len(NPY_MAGIC)) == NPY_MAGIC
        text = not is_npy and p.suffix.lower() in TEXT_SUFFIXES
        if tokenizer and not text:
            raise ConfigError(f"data.tokenizer={tokenizer!r} is invalid with data.path={shown!r}: the file is "
                              f"already token ids ({'.npy' if is_npy else 'raw ' + dtype}); expected "
                              f"data.tokenizer='' (a tokenizer applies to .txt, .jsonl or a datasets text column)")
        raw_dtype = None
        if is_npy:
            tokens = _open_npy(p, shown)
        elif p.suffix.lower() == ".npy":
            raise ConfigError(f"{where}: it is named .npy but has no numpy header (it does not start with "
                              f"\\x93NUMPY); expected a file written by np.save, or a raw token file named .bin")
        elif p.suffix.lower() in NOT_TOKENS:
            raise ConfigError(f"{where}: it is {NOT_TOKENS[p.suffix.lower()]} by its name, which is not read as "
                              f"data; {_VALID}")
        elif text:
            tok = load_tokenizer(tokenizer, vocab_size, shown, vocab_name) if tokenizer else TextTokenizer()
            tokens = _cached(Path(cache_dir), p.stem, file_sha256(p), tok, text_field,
                             lambda: _tokenize_file(p, shown, tok, text_field))
        else:
            tokens, raw_dtype = _open_raw(p, shown, size, dtype), dtype

    where = f"data.path={shown!r} is invalid"
    if tokens.ndim == 2 and tokens.shape[1] < seq_len + 1 and tokens.shape[0] > 0:
        raise ConfigError(f"{where}: its rows of {tokens.shape[1]} tokens are shorter than one sample: "
                          f"model.seq_len={seq_len} needs rows of at least {seq_len + 1} tokens "
                          f"(or a shorter --model.seq_len)")
    if tokens.size < seq_len + 1:
        raise ConfigError(f"{where}: it holds {tokens.size} tokens, fewer than one sample: model.seq_len="
                          f"{seq_len} needs at least {seq_len + 1} (more data, or a shorter --model.seq_len)")
    if check_ids:
        bad = first_out_of_range(tokens, vocab_size)
        if bad is not None:
            pos, value = bad
            at = (f"row {pos // tokens.shape[1]}, column {pos % tokens.shape[1]} (position {pos})"
                  if tokens.ndim == 2 else f"position {pos}")
            hint = f", or check data.dtype={raw_dtype!r} is what the file was written as" if raw_dtype else ""
            raise ConfigError(f"{where}: token id {value} at {at} is outside the vocabulary of {vocab_name}="
                              f"{vocab_size}; expected ids in 0..{vocab_size - 1} ({_larger_vocabulary(vocab_name)}, "
                              f"or data tokenised for this model{hint})")
    return TokenArrayDataset(tokens, seq_len, shown)


# --------------------------------------------------------------------------- token arrays


def _open_npy(p: Path, shown: str) -> np.ndarray:
    where = f"data.path={shown!r} is invalid"
    try:
        arr = np.load(p, mmap_mode="r", allow_pickle=False)  # (never unpickle what a data file holds)
    except (ValueError, OSError, EOFError) as e:
        raise ConfigError(f"{where}: it does not load as .npy ({' '.join(str(e).split())}); expected an integer "
                          f"array written by np.save") from None
    if arr.dtype.kind not in "iu":
        raise ConfigError(f"{where}: its dtype is {arr.dtype} (from the .npy header); expected an integer dtype "
                          f"(token ids), e.g. uint16 or int32")
    if arr.ndim not in (1, 2):
        raise ConfigError(f"{where}: its shape is {arr.shape}; expected 1-D (a token stream) or 2-D (rows of "
                          f"tokens)")
    return arr


_WIDER = {2: "uint16", 4: "int32", 8: "int64"}
"""The dtype a raw file was probably written as, by item size (see _looks_wider)."""


def _open_raw(p: Path, shown: str, size: int, dtype: str) -> np.ndarray:
    where = f"data.path={shown!r} is invalid"
    if dtype not in get_args(RawDtype):
        raise ConfigError(f"data.dtype={dtype!r} is invalid: expected one of {', '.join(get_args(RawDtype))}")
    dt = np.dtype(dtype).newbyteorder("<")
    if size % dt.itemsize:
        raise ConfigError(f"{where}: it has {size} bytes, not a multiple of {dt.itemsize} (the item size of "
                          f"data.dtype={dtype!r}); expected a raw little-endian token file of data.dtype, or "
                          f"the data.dtype it was written with")
    arr = np.memmap(p, dtype=dt, mode="r")
    wider = _looks_wider(arr)
    if wider is not None:
        m, n = wider
        which = "every second value" if m == 2 else f"{m - 1} of every {m} values"
        raise ConfigError(f"{where}: read as data.dtype={dtype!r}, {which} of its first {n} is 0, the high bytes "
                          f"of little-endian {_WIDER[m * dt.itemsize]} ids; expected data.dtype="
                          f"{_WIDER[m * dt.itemsize]!r} (or save it as .npy, whose header carries its dtype)")
    return arr


def _looks_wider(arr: np.ndarray, sample: int = 1 << 20, min_groups: int = 16) -> tuple[int, int] | None:
    """(m, n) when the first n values read as m-value groups whose all but first are zero:
    small ids written m times wider (an int32 file read as uint16 reads id, 0, id, 0 ...).
    Real token streams never have a zero at every m-th position over thousands of tokens;
    only files too short to tell (fewer than min_groups groups) are let through."""
    best = None
    for m in (2, 4, 8):
        if arr.dtype.itemsize * m > 8:
            break
        n = min(arr.shape[0], sample) // m * m
        if n // m < min_groups:
            break
        groups = np.asarray(arr[:n]).reshape(-1, m)
        if groups[:, 1:].any() or not groups[:, 0].any():
            break
        best = (m, n)
    return best


# --------------------------------------------------------------------------- text, tokenised once


def _cached(cache_dir: Path, stem: str, content: str, tok: TextTokenizer, text_field: str, make) -> np.ndarray:
    """The tokens make() returns, saved once as ``{stem}-{content}-{recipe}.npy`` in
    cache_dir (written atomically, so ranks racing here never read a partial file) and
    memory-mapped from there. The recipe hash covers the tokenizer, the text field and
    CACHE_FORMAT: changing any of them (or the content) gives a new file."""
    recipe = hashlib.sha256(f"{CACHE_FORMAT}\0{tok.digest}\0{text_field}".encode()).hexdigest()
    path = cache_dir / f"{stem}-{content[:16]}-{recipe[:16]}.npy"
    if path.is_file():
        try:
            return np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError, EOFError):
            pass  # (a damaged cache file is rebuilt below)
    ids = make()
    ids = ids.astype(np.uint16 if tok.vocab_size <= 1 << 16 else np.uint32)  # (the vocabulary bounds the ids)
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: np.save(f, ids))
    except OSError as e:
        raise ConfigError(f"data.cache_dir={str(cache_dir)!r} is invalid: cannot write the tokenised data there "
                          f"({e.strerror or e}); expected a writable directory") from None
    return np.load(path, mmap_mode="r", allow_pickle=False)


def _tokenize_file(p: Path, shown: str, tok: TextTokenizer, text_field: str) -> np.ndarray:
    """A .txt file's lines (newlines kept, no special tokens: one text), or each JSONL
    document's text followed by a newline (special tokens per document)."""
    where = f"data.path={shown!r} is invalid"
    if p.suffix.lower() == ".txt":
        raw = p.read_bytes()
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ConfigError(f"{where}: it is not UTF-8 text: byte {e.start} is 0x{raw[e.start]:02x}; expected "
                              f"a UTF-8 .txt file") from None
        if tok._hf is None:  # (bytes: the file's bytes are the ids, no need to split it)
            return np.frombuffer(raw, dtype=np.uint8)
        return _encode(text.splitlines(keepends=True), tok, add_special_tokens=False)
    return _encode(_jsonl_texts(p, where, text_field), tok, add_special_tokens=True)


def _jsonl_texts(p: Path, where: str, text_field: str) -> Iterable[str]:
    valid = f"expected one JSON object per line with a string field {text_field!r} (data.text_field)"
    with open(p, "rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue  # (blank lines, e.g. a trailing one, carry no document)
            try:
                doc = json.loads(line)
            except json.JSONDecodeError as e:  # (its own "line 1" is within this one line)
                raise ConfigError(f"{where}: line {number} is not JSON ({e.msg} at column {e.colno}); "
                                  f"{valid}") from None
            except UnicodeDecodeError as e:
                raise ConfigError(f"{where}: line {number} is not UTF-8 (byte {e.start} of the line); "
                                  f"{valid}") from None
            if not isinstance(doc, dict):
                raise ConfigError(f"{where}: line {number} is a JSON {type(doc).__name__}, not an object; {valid}")
            if text_field not in doc:
                keys = ", ".join(repr(k) for k in list(doc)[:8]) or "none"
                raise ConfigError(f"{where}: line {number} has no {text_field!r} field (its keys: {keys}); {valid}, "
                                  f"or set data.text_field")
            if not isinstance(doc[text_field], str):
                raise ConfigError(f"{where}: line {number}'s {text_field!r} is a JSON "
                                  f"{type(doc[text_field]).__name__}; {valid}")
            yield doc[text_field] + "\n"


def _encode(texts: Iterable[str], tok: TextTokenizer, add_special_tokens: bool, batch: int = 4096) -> np.ndarray:
    """All texts' ids concatenated; encoded in batches (the tokenizers library runs each
    batch on all cores) without holding more than one batch of strings."""
    parts: list[np.ndarray] = []
    pending: list[str] = []
    for text in texts:
        pending.append(text)
        if len(pending) == batch:
            parts += tok.encode_batch(pending, add_special_tokens)
            pending = []
    if pending:
        parts += tok.encode_batch(pending, add_special_tokens)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


# --------------------------------------------------------------------------- Hugging Face datasets


def _hf_dataset_tokens(p: Path, shown: str, vocab_size: int, tokenizer: str, text_field: str,
                       cache_dir: Path, vocab_name: str = GPT_VOCAB) -> np.ndarray:
    """A save_to_disk directory's ``input_ids`` (equal-length rows stay rows), or its text
    column tokenised and cached like a JSONL file (keyed by the dataset's fingerprint)."""
    where = f"data.path={shown!r} is invalid"
    try:
        import datasets
    except ImportError:
        raise ConfigError(f"{where}: it is a Hugging Face datasets directory, which needs the datasets package "
                          f"(pip install datasets); or export it as .jsonl or .npy") from None
    try:
        ds = datasets.load_from_disk(str(p))
    except Exception as e:  # (datasets raises several types for a damaged or foreign directory)
        raise ConfigError(f"{where}: datasets.load_from_disk fails ({' '.join(str(e).split())[:200]})") from None
    if not hasattr(ds, "column_names") or isinstance(ds.column_names, dict):  # a DatasetDict of splits
        if "train" not in ds:
            raise ConfigError(f"{where}: its splits are {', '.join(map(repr, ds))}; expected a 'train' split "
                              f"(or the path of one split's directory)")
        ds = ds["train"]
    columns = list(ds.column_names)
    fingerprint = str(getattr(ds, "_fingerprint", "") or _file_digest_of_dir(p))
    if "input_ids" in columns:
        if tokenizer:
            raise ConfigError(f"data.tokenizer={tokenizer!r} is invalid with data.path={shown!r}: the dataset is "
                              f"already token ids (column 'input_ids'); expected data.tokenizer=''")
        rows = [np.asarray(r, dtype=np.int64) for r in ds["input_ids"]]
        if rows and all(r.shape == rows[0].shape and r.ndim == 1 for r in rows):
            return np.stack(rows)  # pre-cut sequences: windows stay inside them
        return np.concatenate([r.reshape(-1) for r in rows]) if rows else np.zeros(0, dtype=np.int64)
    if text_field not in columns:
        raise ConfigError(f"{where}: the dataset has no {text_field!r} column (its columns: "
                          f"{', '.join(map(repr, columns))}); expected an 'input_ids' column or the text column "
                          f"named by data.text_field")
    tok = load_tokenizer(tokenizer, vocab_size, shown, vocab_name) if tokenizer else TextTokenizer()
    return _cached(cache_dir, p.name, hashlib.sha256(fingerprint.encode()).hexdigest(), tok, text_field,
                   lambda: _encode((t + "\n" for t in ds[text_field]), tok, add_special_tokens=True))


def _file_digest_of_dir(p: Path) -> str:
    """Names, sizes and modification times of a directory's files: a fingerprint for a
    dataset object that carries none."""
    h = hashlib.sha256()
    for f in sorted(x for x in p.rglob("*") if x.is_file()):
        st = f.stat()
        h.update(f"{f.relative_to(p)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return h.hexdigest()
