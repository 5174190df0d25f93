"""What the training loop reads: any data a user has, as this rank's micro-batches.

* A map-style ``torch.utils.data.Dataset`` (``__len__`` + ``__getitem__``) is sharded by
  data-parallel rank with :class:`~tiertrain.data.ShardedSampler` (one global, seeded,
  reshuffled-per-epoch sample stream, rank r taking positions r, r + dp, ...) and collated
  ``batch.micro_batch_size`` samples at a time (``torch.utils.data.default_collate`` unless
  given another). Its position is the sampler's: a resumed run continues the stream, at any
  dp size.
* Any other iterable of batches (a DataLoader, a list, an IterableDataset yielding
  batches) is taken to give the same batches on every rank, and rank r of dp takes batches
  r, r + dp, r + 2·dp, ... (like accelerate's dispatching of an IterableDataset). When it
  ends, it is iterated again (the next epoch) if ``iter()`` gives a new iterator; a one-shot
  iterator (a generator) that ends stops the run with an error saying so. Its position is
  the number of batches taken from it: a resumed run skips as many, which continues the run
  exactly when the iterable yields the same batches again (a seeded DataLoader).

Pipeline ranks of one data-parallel coordinate read the same batches (the first and last
stages both need them): sharding is by the dp coordinate, never the global rank.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from ..data.sampler import ShardedSampler
from ..zero.stage3 import tensors_in

__all__ = ["BatchStream", "DatasetBatches", "IterableBatches", "batch_stream", "eval_batches", "is_dataset",
           "count_tokens"]


def is_dataset(data: Any) -> bool:
    """A map-style dataset (sharded by sample), as opposed to an iterable of batches."""
    return (not isinstance(data, IterableDataset) and hasattr(data, "__getitem__") and hasattr(data, "__len__")
            and not isinstance(data, (list, tuple)))


class BatchStream:
    """This rank's endless stream of micro-batches, with a resumable position."""

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise NotImplementedError


class DatasetBatches(BatchStream):
    """Micro-batches of a map-style dataset, sharded by dp rank (see the module docstring)."""

    def __init__(self, dataset: Dataset, dp_rank: int, dp_size: int, micro_batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, collate: Callable[[list], Any] | None = None):
        if len(dataset) < dp_size:
            raise ValueError(f"the dataset has {len(dataset)} samples, fewer than the {dp_size} data-parallel "
                             f"ranks: every rank needs at least one")
        self.dataset = dataset
        self.sampler = ShardedSampler(len(dataset), dp_size, dp_rank, seed=seed, shuffle=shuffle)
        self.micro_batch_size = micro_batch_size
        self.collate = collate or default_collate
        self._indices = iter(self.sampler)

    def __next__(self) -> Any:
        # Exactly micro_batch_size indices per batch and none ahead: the sampler's position is
        # always what was handed out (a checkpoint taken now resumes at the next batch).
        return self.collate([self.dataset[next(self._indices)] for _ in range(self.micro_batch_size)])

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "sampler" not in state:
            raise ValueError(f"the saved data position {sorted(state)} is not a dataset's (no 'sampler'): the "
                             f"run was saved with an iterable of batches, and is resumed with a Dataset")
        self.sampler.load_state_dict(state["sampler"])
        self._indices = iter(self.sampler)


class IterableBatches(BatchStream):
    """Every dp-th batch of an iterable of batches, starting at dp_rank (module docstring)."""

    def __init__(self, data: Iterable[Any], dp_rank: int, dp_size: int, what: str = "train_data"):
        self.data = data
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.what = what
        self.taken = 0
        """Batches taken from the iterable so far, by all ranks together (the position)."""
        self._epoch_batches = 0
        self._iterator = iter(data)
        self._one_shot = self._iterator is data

    def _next_raw(self) -> Any:
        try:
            item = next(self._iterator)
        except StopIteration:
            if self._one_shot or self._epoch_batches == 0:
                reason = "it is a one-shot iterator" if self._one_shot else "it yields nothing"
                raise RuntimeError(f"{self.what} ran out after {self.taken} batches and cannot be read again "
                                   f"({reason}): give a list, a DataLoader or a Dataset, or fewer steps") from None
            self._iterator = iter(self.data)  # the next epoch
            self._epoch_batches = 0
            return self._next_raw()
        self._epoch_batches += 1
        self.taken += 1
        return item

    def __next__(self) -> Any:
        # Skip the batches of ranks before this one, take ours, skip those after it.
        while self.taken % self.dp_size != self.dp_rank:
            self._next_raw()
        batch = self._next_raw()
        while self.taken % self.dp_size:
            self._next_raw()
        return batch

    def state_dict(self) -> dict[str, Any]:
        return {"batches_taken": self.taken}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "batches_taken" not in state:
            raise ValueError(f"the saved data position {sorted(state)} is not an iterable's (no "
                             f"'batches_taken'): the run was saved with a Dataset and is resumed with an iterable")
        target = int(state["batches_taken"])
        self.taken, self._epoch_batches = 0, 0
        self._iterator = iter(self.data)
        if self._one_shot and target:
            raise ValueError(f"{self.what} is a one-shot iterator: it cannot be read again from the start to "
                             f"skip the {target} batches the checkpoint consumed; give a list, a DataLoader "
                             f"or a Dataset")
        while self.taken < target:
            self._next_raw()


def batch_stream(data: Any, dp_rank: int, dp_size: int, micro_batch_size: int, *, seed: int = 0,
                 shuffle: bool = True, collate: Callable[[list], Any] | None = None) -> BatchStream:
    """This rank's stream of training micro-batches from a Dataset or an iterable of batches."""
    if is_dataset(data):
        return DatasetBatches(data, dp_rank, dp_size, micro_batch_size, seed=seed, shuffle=shuffle, collate=collate)
    if not isinstance(data, Iterable):
        raise TypeError(f"train_data of type {type(data).__name__} is neither a map-style Dataset (__len__ and "
                        f"__getitem__) nor an iterable of batches")
    return IterableBatches(data, dp_rank, dp_size)


def eval_batches(data: Any, dp_rank: int, dp_size: int, micro_batch_size: int,
                 collate: Callable[[list], Any] | None = None) -> Iterator[Any]:
    """This rank's held-out micro-batches, from the start, in order, once (a fresh iterator
    per evaluation): a Dataset's samples r, r + dp, ... collated micro_batch_size at a time,
    the last batch partial when the held-out samples end inside one (as the Hugging Face
    Trainer evaluates them: a held-out split smaller than a micro-batch per rank is evaluated,
    not an error once training has started), or every dp-th batch of an iterable."""
    if is_dataset(data):
        collate = collate or default_collate
        mine = range(dp_rank, len(data) - len(data) % dp_size, dp_size)  # the same count on every rank
        for start in range(0, len(mine), micro_batch_size):
            yield collate([data[i] for i in mine[start:start + micro_batch_size]])
        return
    for i, batch in enumerate(data):
        if i % dp_size == dp_rank:
            yield batch


def count_tokens(batch: Any) -> int:
    """Tokens in a batch, for tokens/s and FLOPs: the size of ``input_ids`` (a dict's, or the
    first tensor's when it holds integers in at least 2 dimensions: [batch, sequence]);
    otherwise the number of samples (the first tensor's first dimension)."""
    if isinstance(batch, dict) and isinstance(batch.get("input_ids"), torch.Tensor):
        return batch["input_ids"].numel()
    first = next(tensors_in(batch), None)
    if first is None:
        return 0
    if first.dim() >= 2 and not first.is_floating_point():
        return first.numel()
    return first.shape[0] if first.dim() else 1
