"""data=text: a text corpus as windows of block_size + 1 tokens, for next-token prediction.

The first 90 % of the tokens train, the last 10 % validate (bpe: the tokens of the first 90 % of the
text, the only text its tokenizer is trained on, and of the last 10 %). Sample i of a split is the window
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

from data import bpe_cache
from data.base import DataModule, Loader
from data.bpe import MIN_VOCAB
from data.tensor_loader import TensorLoader
from data.tokens import MAX_VOCAB, TOKENIZERS, corpus_files, decode, encode, map_tokens, scan, write_tokens

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


def check_vocab_size(tokenizer: str, vocab_size: int | None) -> None:
    """bpe's vocabulary is as large as data.vocab_size says (ids must fit the uint16 token file);
    char's and byte's come from the corpus, so a size there would be silently ignored: refused."""
    if tokenizer != "bpe":
        if vocab_size is not None:
            raise ValueError(
                f"data.vocab_size={vocab_size!r} is invalid for data.tokenizer={tokenizer}: accepted: null "
                "(its vocabulary comes from the corpus); a size is for data.tokenizer=bpe"
            )
        return
    accepted = (
        f"accepted: an integer >= {MIN_VOCAB} (the byte values a byte-level BPE starts from) and <= {MAX_VOCAB} "
        f"(the ids the uint16 token file holds)"
    )
    if vocab_size is None:
        raise ValueError(f"data.vocab_size=null is invalid for data.tokenizer=bpe: {accepted}")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or not MIN_VOCAB <= vocab_size <= MAX_VOCAB:
        raise ValueError(f"data.vocab_size={vocab_size!r} is invalid: {accepted}")


class TextData(DataModule):
    """A UTF-8 file or a directory of *.txt files (data.path), or Python's stdlib sources by default."""

    tokens = True  # samples are token windows: only a model that reads tokens fits (model=gpt)
    num_train: int  # training tokens: counted when the token file is read (build_datasets), bpe's only then

    def __init__(
        self,
        batch_size: int,
        block_size: int | None,
        path: str | None = None,
        tokenizer: str = "char",
        cache_dir: str = "datasets/tokens",
        vocab_size: int | None = None,
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
        check_vocab_size(tokenizer, vocab_size)
        self.path, self.cache_dir, self.block_size = path, cache_dir, block_size
        self.corpus = scan(corpus_files(path), tokenizer, vocab_size)
        self._where = f"data.path={path}" if path is not None else "the default corpus"
        if self.corpus.num_tokens == 0:
            raise ValueError(f"{self._where} is empty: the corpus has no tokens to train on")
        # The first 90 % train: of the tokens (char, byte), or of the characters (bpe, whose tokens
        # are only counted once rank 0 has trained it: build_datasets checks its split then).
        self._split = int(self.corpus.num_tokens * (1 - VAL_FRACTION))
        if tokenizer != "bpe":
            self._check_val_split(self.corpus.num_tokens - self._split)
        self._tokenizer_json = ""  # bpe's, read with its tokens
        self.input_shape = (block_size,)
        self.input_dtype = torch.int64
        self.num_classes = self.corpus.vocab_size

    def _check_val_split(self, num_val: int) -> None:
        if num_val < self.block_size + 1:
            raise ValueError(
                f"model.block_size={self.block_size} is too long for {self._where}: its validation split (the "
                f"last 10 %) has {num_val} tokens, fewer than one window of block_size + 1; use model.block_size "
                f"<= {max(num_val - 1, 0)} or a larger corpus"
            )

    def vocabulary(self) -> dict[str, object]:
        vocab = self.corpus.vocab()
        if self.corpus.tokenizer == "bpe":
            self._built()  # the tokenizer is read with the tokens, once rank 0 has written both
            vocab["bpe"] = self._tokenizer_json
        return vocab

    def encode(self, text: str) -> list[int]:
        return encode(text, self.vocabulary())

    def decode(self, ids: list[int]) -> str:
        return decode(ids, self.vocabulary())

    def prepare(self) -> None:
        # rank 0 only, before any rank maps the file; bpe's tokenizer is trained here, once per cache
        if self.corpus.tokenizer == "bpe":
            bpe_cache.write(self.cache_dir, self.corpus, self._split)
        else:
            write_tokens(self.cache_dir, self.corpus)

    def build_datasets(self) -> tuple[Dataset, Dataset]:
        if self.corpus.tokenizer == "bpe":
            read = bpe_cache.read(self.cache_dir, self.corpus)
            tokens, self.num_train, self._tokenizer_json = read.tokens, read.num_train, read.tokenizer_json
            self._check_val_split(len(tokens) - self.num_train)
        else:
            tokens, self.num_train = map_tokens(self.cache_dir, self.corpus), self._split
        return Windows(tokens[: self.num_train], self.block_size), Windows(tokens[self.num_train :], self.block_size)

    def _loader(
        self, dataset: Dataset, sampler: DistributedSampler | None, drop_last: bool, device: torch.device | None
    ) -> Loader:
        """A batch of windows is gathered from the token file on the host; on a GPU, pinned."""
        if isinstance(dataset, Subset):  # a rank's val shard: its windows, in order
            windows, indices = dataset.dataset, np.asarray(dataset.indices, dtype=np.int64)
        else:
            windows, indices = dataset, np.arange(len(dataset), dtype=np.int64)  # type: ignore[arg-type]
        assert isinstance(windows, Windows)
        return WindowLoader(
            windows,
            indices,
            batch_size=self.batch_size,
            sampler=sampler,
            drop_last=drop_last,
            pin_memory=device is not None and device.type == "cuda",
        )
