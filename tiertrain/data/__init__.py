"""Data: byte tokenizer, bundled corpus, memory-mapped token files, dp-sharded sampling."""

from tiertrain.data.corpus import load_bundled_corpus
from tiertrain.data.dataset import TokenFileDataset, bundled_dataset, write_token_file
from tiertrain.data.sampler import ShardedSampler, micro_batches
from tiertrain.data.tokenizer import ByteTokenizer

__all__ = [
    "ByteTokenizer",
    "load_bundled_corpus",
    "write_token_file",
    "TokenFileDataset",
    "bundled_dataset",
    "ShardedSampler",
    "micro_batches",
]
