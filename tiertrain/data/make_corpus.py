"""Regenerate the bundled corpus ``tiertrain/data/corpus.txt.gz``.

Source: the Python reference documentation topics shipped with CPython in
``pydoc_data.topics.topics`` (the text behind ``help("assert")`` etc.), which is
covered by the PSF licence and so may be redistributed. Topics are joined in
sorted key order, separated by a blank line, and gzip-compressed with a fixed
header (no file name, mtime=0), so the output is a pure function of the
interpreter's topics: the same Python version yields byte-identical files.
The committed file was generated with Python 3.11 (~466 KB raw, ~134 KB gz);
a different Python version yields slightly different text.

Usage::

    python -m tiertrain.data.make_corpus            # writes next to this file
    python -m tiertrain.data.make_corpus --out x.gz
"""

from __future__ import annotations

import argparse
import gzip
import io
import os
from pathlib import Path

__all__ = ["build_corpus_text", "compress", "main"]

DEFAULT_OUT = Path(__file__).with_name("corpus.txt.gz")


def build_corpus_text() -> str:
    """All pydoc topics, in sorted key order, separated by blank lines."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip("\n") for key in sorted(topics)) + "\n"


def compress(text: str) -> bytes:
    """Deterministic gzip of the UTF-8 text (level 9, no name, mtime 0)."""
    buf = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", compresslevel=9, fileobj=buf, mtime=0) as gz:
        gz.write(text.encode("utf-8"))
    return buf.getvalue()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output .txt.gz path")
    args = parser.parse_args(argv)
    text = build_corpus_text()
    data = compress(text)
    tmp = args.out.with_name(args.out.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, args.out)
    print(f"wrote {args.out}: {len(text.encode('utf-8'))} bytes raw, {len(data)} bytes gzip")


if __name__ == "__main__":
    main()
