"""One global stream of sample indices, dealt out round-robin to data-parallel ranks.

Data parallelism (and ZeRO, which is data parallelism with partitioned state)
is only exact if the dp ranks together see the same global batch that a single
process would. So the sampler defines that global stream once, independently
of the rank:

* epoch ``e`` is ``torch.randperm(num_samples)`` drawn from
  ``torch.Generator().manual_seed(seed + e)`` (``range(num_samples)`` when
  ``shuffle=False``);
* epochs are concatenated forever, so stream position ``p`` is a pure function
  of ``(p, num_samples, seed, shuffle)`` (see :meth:`global_indices`), the same
  whatever the number of ranks: a run resumed at another data-parallel size
  continues the very stream it left (nothing is dropped at an epoch's end to
  make it divide evenly: a global batch may straddle two epochs instead);
* position ``p`` belongs to rank ``p % dp_size``.

``consumed_samples`` counts *global* samples (all ranks together), as in
Megatron-LM; it is the only state, so a checkpoint taken at step ``s`` resumes
mid-epoch exactly. With global batch ``G = micro * accum * dp``, rank ``r``'s
``j``-th group of ``micro * accum`` indices are positions
``j*G + r + dp*t`` -- together exactly positions ``j*G .. j*G + G - 1``.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
from torch.utils.data import Dataset, Sampler

__all__ = ["ShardedSampler", "micro_batches"]


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"ShardedSampler.{name}={value!r} is invalid: must be an int >= {minimum}")


class ShardedSampler(Sampler[int]):
    """Infinite, resumable, rank-sharded view of one global sample-index stream."""

    def __init__(
        self,
        num_samples: int,
        dp_size: int,
        dp_rank: int,
        seed: int = 0,
        shuffle: bool = True,
        consumed_samples: int = 0,
    ):
        _check_int("num_samples", num_samples, 1)
        _check_int("dp_size", dp_size, 1)
        _check_int("seed", seed, 0)
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or not 0 <= dp_rank < dp_size:
            raise ValueError(
                f"ShardedSampler.dp_rank={dp_rank!r} is invalid: must be an int in [0, {dp_size})"
            )
        if num_samples < dp_size:
            raise ValueError(
                f"ShardedSampler.num_samples={num_samples} is invalid: must be >= dp_size={dp_size} "
                "so that every rank gets at least one sample per epoch"
            )
        self.num_samples = num_samples
        """Size of the dataset the indices refer to."""
        self.dp_size = dp_size
        """Number of data-parallel ranks sharing the stream."""
        self.dp_rank = dp_rank
        """This rank, in [0, dp_size)."""
        self.seed = seed
        """Epoch e is shuffled with seed + e."""
        self.shuffle = bool(shuffle)
        """Permute each epoch (True) or walk range(num_samples) in order (False)."""
        self.consumed_samples = 0
        """Global stream position where iteration starts (a multiple of dp_size)."""
        self._set_consumed(consumed_samples)
        self._cached_epoch: int | None = None
        self._cached_order: list[int] = []

    @property
    def epoch_length(self) -> int:
        """Stream positions per epoch: every sample once."""
        return self.num_samples

    def _set_consumed(self, consumed_samples: Any) -> None:
        _check_int("consumed_samples", consumed_samples, 0)
        if consumed_samples % self.dp_size != 0:
            raise ValueError(
                f"ShardedSampler.consumed_samples={consumed_samples} is invalid: must be a "
                f"multiple of dp_size={self.dp_size} (it counts global samples)"
            )
        self.consumed_samples = consumed_samples

    def _epoch_order(self, epoch: int) -> list[int]:
        if epoch != self._cached_epoch:
            if self.shuffle:
                gen = torch.Generator().manual_seed(self.seed + epoch)
                order = torch.randperm(self.num_samples, generator=gen)
            else:
                order = torch.arange(self.num_samples)
            self._cached_order = order.tolist()
            self._cached_epoch = epoch
        return self._cached_order

    def index_at(self, position: int) -> int:
        """Sample index at global stream position ``position``."""
        epoch, offset = divmod(position, self.epoch_length)
        return self._epoch_order(epoch)[offset]

    def global_indices(self, start: int, count: int) -> list[int]:
        """Sample indices at global stream positions ``start .. start + count - 1`` (all ranks)."""
        if start < 0 or count < 0:
            raise ValueError(f"global_indices: start={start} and count={count} must be >= 0")
        return [self.index_at(p) for p in range(start, start + count)]

    def __iter__(self) -> Iterator[int]:
        """This rank's indices from ``consumed_samples`` on, forever.

        ``consumed_samples`` advances by ``dp_size`` *before* each index is
        yielded, so a ``state_dict()`` taken after pulling k indices resumes at
        the (k+1)-th. Don't prefetch ahead of training if you checkpoint this.
        """
        while True:
            position = self.consumed_samples + self.dp_rank
            self.consumed_samples += self.dp_size
            yield self.index_at(position)

    def state_dict(self) -> dict[str, Any]:
        """Resumable state: consumed_samples plus what defines the stream (checked on load)."""
        return {
            "consumed_samples": self.consumed_samples,
            "num_samples": self.num_samples,
            "dp_size": self.dp_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume at ``state["consumed_samples"]``.

        Raises ValueError if the saved stream differs from this one (num_samples,
        seed, shuffle), or if the position is not a multiple of this dp_size (the
        global batch of the new layout does not divide it). A saved dp_size
        different from this one is fine: the stream does not depend on it.
        """
        for key in ("num_samples", "seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ValueError(
                    f"ShardedSampler.load_state_dict: saved {key}={state[key]!r} differs from "
                    f"this sampler's {key}={getattr(self, key)!r}; the stream would change"
                )
        self._set_consumed(state["consumed_samples"])

    def __repr__(self) -> str:
        return (
            f"ShardedSampler(num_samples={self.num_samples}, dp_size={self.dp_size}, "
            f"dp_rank={self.dp_rank}, seed={self.seed}, shuffle={self.shuffle}, "
            f"consumed_samples={self.consumed_samples})"
        )


def micro_batches(
    dataset: Dataset, sampler: ShardedSampler, micro_batch_size: int
) -> Iterator[dict[str, torch.Tensor]]:
    """Infinite iterator of collated micro-batches ``{key: [micro_batch_size, ...]}``.

    Pulls exactly ``micro_batch_size`` indices from ``sampler`` per batch and
    nothing ahead, so ``sampler.state_dict()`` always matches what was yielded.
    """
    if isinstance(micro_batch_size, bool) or not isinstance(micro_batch_size, int) or micro_batch_size < 1:
        raise ValueError(
            f"micro_batches: micro_batch_size={micro_batch_size!r} is invalid: must be an int >= 1"
        )
    indices = iter(sampler)
    while True:
        samples = [dataset[next(indices)] for _ in range(micro_batch_size)]
        yield {key: torch.stack([s[key] for s in samples]) for key in samples[0]}
