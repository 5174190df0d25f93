"""Data: byte tokenizer, bundled corpus, memory-mapped token files, the data.path formats
(.npy, raw .bin, text, JSONL, datasets directories), dp-sharded sampling."""

from tiertrain.data.corpus import load_bundled_corpus
from tiertrain.data.dataset import TokenFileDataset, bundled_dataset, write_token_file
from tiertrain.data.formats import (TextTokenizer, TokenArrayDataset, first_out_of_range, load_tokenizer,
                                    open_token_dataset)
from tiertrain.data.sampler import ShardedSampler, micro_batches
from tiertrain.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "load_bundled_corpus",
    "write_token_file",
    "TokenFileDataset",
    "bundled_dataset",
    "TokenArrayDataset",
    "TextTokenizer",
    "first_out_of_range",
    "load_tokenizer",
    "open_token_dataset",
    "ShardedSampler",
    "micro_batches",
]
