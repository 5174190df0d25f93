"""Byte-level tokenizer: token ids are the UTF-8 bytes of the text (vocabulary 256).

No merges, no special tokens, nothing to train or download: any text encodes,
and ids fit the uint16 token files of :mod:`tiertrain.data.dataset`.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

__all__ = ["ByteTokenizer"]


class ByteTokenizer:
    """Maps text to its UTF-8 bytes and back."""

    vocab_size: int = 256
    """Number of distinct token ids (one per byte value)."""

    def encode(self, text: str) -> np.ndarray:
        """UTF-8 bytes of ``text`` as a 1-D uint16 array."""
        if not isinstance(text, str):
            raise TypeError(f"ByteTokenizer.encode expects str, got {type(text).__name__}")
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Sequence[int] | np.ndarray) -> str:
        """Text of a sequence of byte ids; invalid UTF-8 becomes U+FFFD."""
        arr = np.asarray(ids.tolist() if hasattr(ids, "tolist") else ids, dtype=np.int64).reshape(-1)
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            bad = int(arr[(arr < 0) | (arr >= self.vocab_size)][0])
            raise ValueError(f"ByteTokenizer.decode: id {bad} is out of range [0, {self.vocab_size})")
        return arr.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
