"""Memory-mapped token files and the fixed-length windows trained on.

A token file is a headerless little-endian uint16 array (the nanoGPT ``.bin``
format): 2 bytes per token, nothing else. Every rank maps it read-only with
``np.memmap``, so the OS page cache holds one copy however many processes read
it. Sample ``i`` is the window of ``seq_len + 1`` tokens starting at
``i * seq_len``; its first ``seq_len`` tokens are the inputs and its last
``seq_len`` the next-token labels, so consecutive samples share one token.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from tiertrain.io.fileio import atomic_write

from tiertrain.data.corpus import load_bundled_corpus
from tiertrain.data.tokenizer import ByteTokenizer

__all__ = ["TOKEN_DTYPE", "write_token_file", "TokenFileDataset", "bundled_dataset"]

TOKEN_DTYPE = np.dtype("<u2")
"""On-disk dtype of token files: little-endian uint16 (vocabularies up to 65536)."""


def write_token_file(tokens: np.ndarray, path: str | os.PathLike) -> Path:
    """Atomically write a 1-D array of token ids (all in [0, 65536)) to ``path``.

    The data goes to a temporary file in the same directory which then replaces
    ``path`` (``os.replace``), so concurrent readers (other ranks) never see a
    partial file.
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"write_token_file: tokens must be 1-D, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"write_token_file: tokens must be integers, got dtype {arr.dtype}")
    if arr.size and (int(arr.min()) < 0 or int(arr.max()) > np.iinfo(TOKEN_DTYPE).max):
        raise ValueError(
            f"write_token_file: token ids must be in [0, 65535] to fit uint16, "
            f"got range [{int(arr.min())}, {int(arr.max())}]"
        )
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: f.write(arr.astype(TOKEN_DTYPE, copy=False).tobytes()))
    return path


class TokenFileDataset(Dataset):
    """Map-style dataset of next-token windows over a memory-mapped token file."""

    def __init__(self, path: str | os.PathLike, seq_len: int):
        if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
            raise ValueError(f"TokenFileDataset.seq_len={seq_len!r} is invalid: must be a positive int")
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"TokenFileDataset: token file {str(path)!r} does not exist")
        nbytes = path.stat().st_size
        if nbytes % TOKEN_DTYPE.itemsize != 0:
            raise ValueError(
                f"TokenFileDataset: {str(path)!r} has {nbytes} bytes, not a multiple of "
                f"{TOKEN_DTYPE.itemsize}; it is not a uint16 token file"
            )
        n_tokens = nbytes // TOKEN_DTYPE.itemsize
        if n_tokens < seq_len + 1:
            raise ValueError(
                f"TokenFileDataset.seq_len={seq_len} is too large for {str(path)!r}: it holds "
                f"{n_tokens} tokens, so seq_len must be <= {n_tokens - 1}"
            )
        self.path: Path = path
        """Token file being read."""
        self.seq_len: int = seq_len
        """Tokens per sample (inputs and labels each have this length)."""
        self.n_tokens: int = n_tokens
        """Number of tokens in the file."""
        self._tokens = np.memmap(path, dtype=TOKEN_DTYPE, mode="r")

    @classmethod
    def from_text(
        cls,
        text: str,
        path: str | os.PathLike,
        seq_len: int,
        tokenizer: ByteTokenizer | None = None,
    ) -> "TokenFileDataset":
        """Tokenize ``text`` (ByteTokenizer by default), write it to ``path``, open it."""
        tokenizer = tokenizer or ByteTokenizer()
        write_token_file(tokenizer.encode(text), path)
        return cls(path, seq_len)

    def __len__(self) -> int:
        return (self.n_tokens - 1) // self.seq_len

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"TokenFileDataset index {index} out of range for {n} samples")
        index %= n
        start = index * self.seq_len
        window = torch.from_numpy(self._tokens[start : start + self.seq_len + 1].astype(np.int64))
        return {"input_ids": window[:-1], "labels": window[1:]}

    def __repr__(self) -> str:
        return f"TokenFileDataset({str(self.path)!r}, seq_len={self.seq_len}, samples={len(self)})"


def bundled_dataset(seq_len: int, cache_dir: str | os.PathLike) -> TokenFileDataset:
    """The bundled corpus, byte-tokenized into a token file cached under ``cache_dir``.

    The cache file name carries a hash of the corpus text, so a changed corpus
    never reuses a stale file; writes are atomic, so ranks may race here safely.
    """
    raw = load_bundled_corpus().encode("utf-8")
    path = Path(cache_dir) / f"bundled-corpus-{hashlib.sha256(raw).hexdigest()[:16]}.u16"
    if not path.is_file() or path.stat().st_size != len(raw) * TOKEN_DTYPE.itemsize:
        write_token_file(np.frombuffer(raw, dtype=np.uint8), path)  # bytes are the byte tokens
    return TokenFileDataset(path, seq_len)
