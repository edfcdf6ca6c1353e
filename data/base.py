"""DataModule: a train/val dataset pair plus the per-rank loaders every data option shares.

Why one base class: the sharding rules are what make a data-parallel run comparable to a
single-process one, so they live here once and subclasses only say where the samples come from.
"""

import itertools
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sized

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset

from data.tensor_loader import TensorLoader, in_memory_tensors

Loader = DataLoader | TensorLoader


def fetch(dataset_class: type, root: str, name: str, offline_hint: str) -> None:
    """Download a torchvision dataset into root (data.download=true); a failure says how else to get it."""
    try:
        dataset_class(root, train=True, download=True)
    except (RuntimeError, OSError) as error:
        raise ValueError(
            f"data.download=true could not fetch {name} into data.root={root}: {error}; "
            f"without a network, {offline_hint} and set data.download=false"
        ) from error


def _size(dataset: Dataset) -> int:
    """len() of a map-style dataset (torch's Dataset type does not promise one; ours all have it)."""
    assert isinstance(dataset, Sized), f"{type(dataset).__name__} has no length"
    return len(dataset)


def rank_share(num_samples: int, rank: int, world_size: int) -> int:
    """Samples of perm[rank::world_size]: the shares of the ranks differ by at most one."""
    return len(range(rank, num_samples, world_size))


class ResumableSampler(DistributedSampler):
    """DistributedSampler that can start its next pass part-way, for resuming mid-epoch.

    skip_next(n) drops the first n indices of the next iteration only (indices, not loaded
    samples: nothing is read to fast-forward), so a resumed run sees exactly the batches the
    interrupted one had not yet seen.

    With drop_last=False it does not pad: torch's DistributedSampler would repeat samples to give
    every rank as many, so some would be trained twice an epoch. Here rank r takes perm[r::N] of
    all n samples and the ranks' shares differ by at most one (the trainer evens out the batches).
    """

    def __init__(self, dataset: Dataset, num_replicas: int, rank: int, seed: int, drop_last: bool) -> None:
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=drop_last)
        self._skip = 0
        if not drop_last:  # the parent's __iter__ then pads by total_size - n = 0 samples
            self.total_size = _size(dataset)
            self.num_samples = rank_share(self.total_size, rank, num_replicas)

    def skip_next(self, num_indices: int) -> None:
        self._skip = num_indices

    def __iter__(self) -> Iterator[int]:
        skip, self._skip = self._skip, 0
        return itertools.islice(super().__iter__(), skip, None)


class DataModule(ABC):
    """Datasets (built lazily, once) and the loaders that shard them across ranks."""

    input_shape: tuple[int, ...]  # per-sample shape, e.g. (32,) or (1, 28, 28); set by subclasses
    num_classes: int
    input_dtype: torch.dtype = torch.float32  # token ids (data=text) are int64
    tokens = False  # samples are token windows (data=text): only a model with takes_tokens fits

    def __init__(self, batch_size: int, num_workers: int = 0, drop_last: bool = True) -> None:
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size <= 0:
            raise ValueError(
                f"data.batch_size={batch_size} is invalid: must be an integer > 0 (the per-rank batch size)"
            )
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(
                f"data.num_workers={num_workers} is invalid: must be an integer >= 0 (0 loads in the training process)"
            )
        if not isinstance(drop_last, bool):
            raise ValueError(
                f"data.drop_last={drop_last!r} is invalid: accepted true (drop each epoch's partial "
                "batches) or false (train every sample once per epoch; ranks' batches may differ)"
            )
        self.batch_size = batch_size  # per rank: the global batch is world_size × batch_size
        self.num_workers = num_workers
        self.drop_last = drop_last
        self._datasets: tuple[Dataset, Dataset] | None = None

    def vocabulary(self) -> dict[str, object] | None:
        """What turns token ids back into text (data=text): written to the run dir and checkpoints."""
        return None

    def prepare(self) -> None:
        """Fetch files; called on global rank 0 only, before any rank builds the datasets."""

    def setup(self) -> None:
        """Open the datasets now (every rank), so missing files fail at start-up, not mid-run."""
        self._built()

    @abstractmethod
    def build_datasets(self) -> tuple[Dataset, Dataset]:
        """Return (train, val); raise ValueError when files they need are missing."""

    def train_loader(self, rank: int, world_size: int, seed: int, device: torch.device | None = None) -> Loader:
        """Shuffled loader over this rank's share of the train set.

        Invariant: every rank draws from one permutation (seeded by seed + epoch; the trainer
        must call loader.sampler.set_epoch(epoch) on every rank) and rank r takes perm[r::world_size],
        so the ranks' k-th batches together are exactly the k-th batch of size world_size ×
        batch_size that a single process would draw. drop_last=true drops the partial batches;
        false keeps them (the last global batch is smaller, and some ranks may have one batch
        fewer than others: see train_batches). `device`: where the batches are used (see _loader).
        """
        train, _ = self._built()
        if not self.drop_last and _size(train) < world_size:
            raise ValueError(
                f"the train set has {_size(train)} samples, fewer than the world size {world_size}: "
                "some rank would never hold a sample; use fewer ranks"
            )
        if self.drop_last and _size(train) < world_size * self.batch_size:
            raise ValueError(
                f"data.batch_size={self.batch_size} is too large for world size {world_size}: "
                f"the train set has {_size(train)} samples, fewer than world_size × batch_size = "
                f"{world_size * self.batch_size}, so every rank would get zero batches per epoch; "
                f"use data.batch_size <= {_size(train) // world_size} or fewer ranks"
            )
        sampler = ResumableSampler(train, world_size, rank, seed, self.drop_last)
        return self._loader(train, sampler=sampler, drop_last=self.drop_last, device=device)

    def train_batches(self, world_size: int) -> list[int]:
        """Batches per epoch of each rank's train loader (without building it): equal with drop_last."""
        n, b = _size(self._built()[0]), self.batch_size
        if self.drop_last:
            return [n // world_size // b] * world_size
        return [-(-rank_share(n, r, world_size) // b) for r in range(world_size)]

    def val_size(self, max_samples: int | None = None) -> int:
        """Samples evaluated: the val set's first max_samples (trainer.eval_max_samples), all of it
        when it has fewer or max_samples is None."""
        n = _size(self._built()[1])
        return n if max_samples is None else min(n, max_samples)

    def val_batches(self, world_size: int, max_samples: int | None = None) -> list[int]:
        """Batches of each rank's val shard: they may differ by one, and a strategy whose forward
        communicates (FSDP) needs every rank to run as many forwards as the one with the most."""
        n, b = self.val_size(max_samples), self.batch_size
        return [-(-rank_share(n, r, world_size) // b) for r in range(world_size)]

    def val_loader(
        self, rank: int, world_size: int, device: torch.device | None = None, max_samples: int | None = None
    ) -> Loader:
        """In-order loader over this rank's strided shard of the val set's first val_size(max_samples).

        Invariant: the shards range(rank, n, world_size) are disjoint and cover those n samples
        with no padding or duplicates, so all-reduced sums and counts give exact metrics. The
        subset is cut before sharding, so the ranks' union is the same n samples at any world size.
        """
        _, val = self._built()
        shard = Subset(val, range(rank, self.val_size(max_samples), world_size))  # rank_share(n, rank, world_size)
        return self._loader(shard, sampler=None, drop_last=False, device=device)

    def _built(self) -> tuple[Dataset, Dataset]:
        if self._datasets is None:
            self._datasets = self.build_datasets()
        return self._datasets

    def _loader(
        self,
        dataset: Dataset,
        sampler: DistributedSampler | None,
        drop_last: bool,
        device: torch.device | None,
    ) -> Loader:
        """On a GPU, samples already in tensors (synthetic, fake) move to it once and each batch is a
        gather there: no per-batch copy or pin. Any other dataset's batches are pinned (page-locked),
        so that their copy to the GPU does not wait for it to drain."""
        pin_memory = device is not None and device.type == "cuda"
        tensors = in_memory_tensors(dataset) if self.num_workers == 0 else None
        if tensors is not None:  # a gather per batch, in this process
            return TensorLoader(
                tuple(t.to(device) for t in tensors) if pin_memory else tensors, self.batch_size, sampler, drop_last
            )
        return DataLoader(
            dataset,
            batch_size=self.batch_size,
            shuffle=False,
            sampler=sampler,
            drop_last=drop_last,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
            pin_memory=pin_memory,
        )
