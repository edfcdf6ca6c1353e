"""Batches of tensors held in memory, without DataLoader's per-sample and per-batch machinery.

DataLoader's default path indexes a dataset once per sample and stacks the samples, and each
batch also passes its fetcher, collate and profiler hooks: Python work per sample, on the training
thread, that a small GPU step cannot hide. When the samples already sit in tensors, one gather per
tensor builds the same batch, in the same order, with the same values.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sized

import torch
from torch.utils.data import Dataset, Sampler, Subset, TensorDataset


def in_memory_tensors(dataset: Dataset) -> tuple[torch.Tensor, ...] | None:
    """The tensors behind a TensorDataset (or a Subset of one, gathered once), else None."""
    if isinstance(dataset, TensorDataset):
        return dataset.tensors
    if isinstance(dataset, Subset) and isinstance(dataset.dataset, TensorDataset):
        index = torch.as_tensor(list(dataset.indices), dtype=torch.int64)
        return tuple(tensor[index] for tensor in dataset.dataset.tensors)
    return None


class TensorLoader:
    """What DataLoader(TensorDataset(*tensors), batch_size, sampler, drop_last) yields, a batch per gather.

    Keeps DataLoader's attributes that the trainer uses (`sampler`, `batch_size`, `len()`). The
    batches are gathered where the tensors are: on a GPU, each is a gather there. `pin_memory` (a
    subclass's batches built on the host) puts each batch in page-locked memory, so that
    `.to(cuda, non_blocking=True)` is asynchronous: from pageable memory the copy may wait for the GPU.
    """

    def __init__(
        self,
        tensors: tuple[torch.Tensor, ...],
        batch_size: int,
        sampler: Sampler[int] | None = None,
        drop_last: bool = False,
        pin_memory: bool = False,
    ) -> None:
        self.tensors = tensors
        self.batch_size = batch_size
        self.sampler = sampler
        self.drop_last = drop_last
        self.pin_memory = pin_memory

    def _num_samples(self) -> int:
        return len(self.sampler) if isinstance(self.sampler, Sized) else len(self.tensors[0])

    def __len__(self) -> int:
        whole, rest = divmod(self._num_samples(), self.batch_size)
        return whole + (1 if rest and not self.drop_last else 0)

    def __iter__(self) -> Iterator[tuple[torch.Tensor, ...]]:
        if self.sampler is None:  # in order: each batch is a slice, no index at all
            return self._serve(self._num_samples(), lambda start, stop: slice(start, stop))
        # The epoch's order, drawn from the sampler once and turned into one tensor: each batch is
        # then a slice of it, not a list of Python ints converted again every step. (A resumed
        # sampler yields fewer indices than its len(): count what it yields.)
        order = torch.as_tensor(list(self.sampler), dtype=torch.int64).to(self.tensors[0].device)
        return self._serve(len(order), lambda start, stop: order[start:stop])

    def _serve(
        self, num_samples: int, index: Callable[[int, int], slice | torch.Tensor]
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        end = num_samples - num_samples % self.batch_size if self.drop_last else num_samples
        for start in range(0, end, self.batch_size):
            rows = index(start, min(start + self.batch_size, end))
            batch = tuple(tensor[rows] for tensor in self.tensors)
            yield tuple(t.pin_memory() for t in batch) if self.pin_memory else batch
