"""data=text: a text corpus as windows of block_size + 1 tokens, for next-token prediction.

The first 90 % of the tokens train, the last 10 % validate. Sample i of a split is the window
starting at token i * block_size: inputs are its first block_size tokens, targets the same shifted
by one, so within an epoch every token of the split is a target exactly once. The window indices
go through the lab's ResumableSampler like any dataset's samples: shuffled per epoch, rank r takes
perm[r::world_size], and a resumed run skips the indices already trained on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, DistributedSampler, Subset

from data.base import DataModule, Loader
from data.tensor_loader import TensorLoader
from data.tokens import TOKENIZERS, corpus_files, decode, encode, map_tokens, scan, write_tokens

VAL_FRACTION = 0.1


class Windows(Dataset):
    """Windows of block_size + 1 tokens over a slice [start, stop) of the token file."""

    def __init__(self, tokens: np.ndarray, block_size: int) -> None:
        self.tokens, self.block_size = tokens, block_size
        self._offsets = np.arange(block_size + 1)

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.block_size

    def batch(self, indices: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        """One gather from the memory map for a whole batch of windows."""
        rows = torch.from_numpy(self.tokens[indices[:, None] * self.block_size + self._offsets].astype(np.int64))
        return rows[:, :-1], rows[:, 1:]

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        inputs, targets = self.batch(np.array([index]))
        return inputs[0], targets[0]


class WindowLoader(TensorLoader):
    """TensorLoader's batching and order over windows: a batch is one gather from the token file."""

    def __init__(self, windows: Windows, indices: np.ndarray, **kwargs: Any) -> None:
        super().__init__((torch.as_tensor(indices),), **kwargs)
        self.windows = windows

    def _serve(
        self, num_samples: int, index: Callable[[int, int], slice | torch.Tensor]
    ) -> Iterator[tuple[torch.Tensor, ...]]:
        for (rows,) in super()._serve(num_samples, index):
            batch = self.windows.batch(rows.numpy())
            yield tuple(t.pin_memory() for t in batch) if self.pin_memory else batch


class TextData(DataModule):
    """A UTF-8 file or a directory of *.txt files (data.path), or Python's stdlib sources by default."""

    tokens = True  # samples are token windows: only a model that reads tokens fits (model=gpt)

    def __init__(
        self,
        batch_size: int,
        block_size: int | None,
        path: str | None = None,
        tokenizer: str = "char",
        cache_dir: str = "datasets/tokens",
        num_workers: int = 0,
        drop_last: bool = True,
    ) -> None:
        super().__init__(batch_size, num_workers, drop_last)
        if block_size is None:
            raise ValueError(
                "data=text reads windows of model.block_size tokens, but this model has no block_size: "
                "use a model that reads tokens (model=gpt)"
            )
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"model.block_size={block_size!r} is invalid: must be an integer >= 1")
        if num_workers != 0:  # a batch is one gather from the memory map: no per-sample work to farm out
            raise ValueError(
                f"data.num_workers={num_workers} is invalid for data=text: accepted 0 (batches are gathered in process)"
            )
        if tokenizer not in TOKENIZERS:
            raise ValueError(f"data.tokenizer={tokenizer!r} is invalid: accepted {', '.join(TOKENIZERS)}")
        self.path, self.cache_dir, self.block_size = path, cache_dir, block_size
        self.corpus = scan(corpus_files(path), tokenizer)
        where = f"data.path={path}" if path is not None else "the default corpus"
        if self.corpus.num_tokens == 0:
            raise ValueError(f"{where} is empty: the corpus has no tokens to train on")
        self.num_train = int(self.corpus.num_tokens * (1 - VAL_FRACTION))
        num_val = self.corpus.num_tokens - self.num_train
        if num_val < block_size + 1:
            raise ValueError(
                f"model.block_size={block_size} is too long for {where}: its validation split (the last 10 %) "
                f"has {num_val} tokens, fewer than one window of block_size + 1; use model.block_size <= "
                f"{max(num_val - 1, 0)} or a larger corpus"
            )
        self.input_shape = (block_size,)
        self.input_dtype = torch.int64
        self.num_classes = self.corpus.vocab_size

    def vocabulary(self) -> dict[str, object]:
        return self.corpus.vocab()

    def encode(self, text: str) -> list[int]:
        return encode(text, self.corpus.vocab())

    def decode(self, ids: list[int]) -> str:
        return decode(ids, self.corpus.vocab())

    def prepare(self) -> None:
        write_tokens(self.cache_dir, self.corpus)  # rank 0 only, before any rank maps the file

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        tokens = map_tokens(self.cache_dir, self.corpus)
        return Windows(tokens[: self.num_train], self.block_size), Windows(tokens[self.num_train :], self.block_size)

    def _loader(
        self, dataset: Dataset, sampler: DistributedSampler | None, drop_last: bool, pin_memory: bool
    ) -> Loader:
        if isinstance(dataset, Subset):  # a rank's val shard: its windows, in order
            windows, indices = dataset.dataset, np.asarray(dataset.indices, dtype=np.int64)
        else:
            windows, indices = dataset, np.arange(len(dataset), dtype=np.int64)  # type: ignore[arg-type]
        assert isinstance(windows, Windows)
        return WindowLoader(
            windows, indices, batch_size=self.batch_size, sampler=sampler, drop_last=drop_last, pin_memory=pin_memory
        )
