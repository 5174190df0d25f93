"""The bundled English corpus (Python reference documentation, PSF licence).

Small enough to ship in the wheel (~134 KB gzip, ~466 KB of text), large enough
that the tiny GPT's loss visibly falls below the byte-uniform ln(256) in a few
hundred steps. Regenerate with ``python -m tiertrain.data.make_corpus``.
"""

from __future__ import annotations

import gzip
from importlib import resources

__all__ = ["CORPUS_RESOURCE", "load_bundled_corpus"]

CORPUS_RESOURCE = "corpus.txt.gz"
"""File name of the corpus inside the ``tiertrain.data`` package."""


def load_bundled_corpus() -> str:
    """Decompressed text of the bundled corpus."""
    res = resources.files("tiertrain.data").joinpath(CORPUS_RESOURCE)
    if not res.is_file():
        raise FileNotFoundError(
            f"bundled corpus {res} is missing; regenerate it with "
            "`python -m tiertrain.data.make_corpus`"
        )
    return gzip.decompress(res.read_bytes()).decode("utf-8")
