"""This data-parallel rank's micro-batches, for pretraining and distillation alike.

Samples are indexed 0..N-1. One global order per epoch (a seeded permutation, or
the identity without shuffling) is shared by every rank; data-parallel rank r
takes micro-batch r of each group of DP micro-batches, so the consumed-sample
count alone fixes the data position and resume is exact. A source that has its
own reader (`iter_samples(indices)`: the hidden-state store's prefetching one)
is read through it, in this order; any other source by indexing.
"""

from __future__ import annotations

from typing import Callable, Iterator, Protocol

import torch


class SampleSource(Protocol):
    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> dict: ...


def epoch_order(num_samples: int, epoch: int, seed: int, shuffle: bool) -> torch.Tensor:
    """The global sample order of one epoch (identical on every rank)."""
    if not shuffle:
        return torch.arange(num_samples)
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)
    return torch.randperm(num_samples, generator=generator)


def rank_indices(
    num_samples: int,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    seed: int = 0,
    shuffle: bool = False,
) -> Iterator[int]:
    """This rank's sample indices from global position consumed_samples on, over epochs, without end."""
    position = consumed_samples
    orders: dict[int, torch.Tensor] = {}
    while True:
        for offset in range(micro_batch_size):
            global_position = position + dp_rank * micro_batch_size + offset
            epoch = global_position // num_samples
            if epoch not in orders:
                orders = {epoch: epoch_order(num_samples, epoch, seed, shuffle)}
            yield int(orders[epoch][global_position % num_samples])
        position += micro_batch_size * dp_size


def micro_batches(
    source: SampleSource,
    consumed_samples: int,
    micro_batch_size: int,
    dp_rank: int,
    dp_size: int,
    collate: Callable[[list[dict]], dict[str, torch.Tensor]],
    *,
    seed: int = 0,
    shuffle: bool = False,
    device: torch.device | str = "cpu",
) -> Iterator[dict[str, torch.Tensor]]:
    """Collated micro-batches of this rank, on device, from consumed_samples on."""
    indices = rank_indices(len(source), consumed_samples, micro_batch_size, dp_rank, dp_size, seed, shuffle)
    reader = getattr(source, "iter_samples", None)
    samples = reader(indices) if reader is not None else (source[i] for i in indices)
    while True:
        batch = collate([next(samples) for _ in range(micro_batch_size)])
        yield {k: v.to(device, non_blocking=True) for k, v in batch.items()}
