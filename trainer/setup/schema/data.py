"""Schemas of conf/data/*.yaml: one dataclass per option, registered under OPTIONS."""

from __future__ import annotations

from dataclasses import dataclass

from data.tokens import TOKENIZERS
from trainer.setup.schema.spec import SEED_BOUND, key


@dataclass
class DataConfig:
    """Keys every data option takes (data/base.py's DataModule)."""

    _target_: str = key(nonempty=True)
    batch_size: int = key(ge=1, note="per rank")
    num_workers: int = key(ge=0, note="0 loads in the training process")
    drop_last: bool = key()


@dataclass
class SyntheticConfig(DataConfig):
    num_samples: int = key(ge=1)
    num_val_samples: int = key(ge=1)
    input_dim: int = key(ge=1)
    num_classes: int = key(ge=2)
    seed: int = key(ge=0, lt=SEED_BOUND)


@dataclass
class FakeConfig(DataConfig):
    num_samples: int = key(ge=1)
    num_val_samples: int = key(ge=1)
    image_shape: list[int] = key(ge=1, length=3, note="[C, H, W], C 1 or 3")
    num_classes: int = key(ge=2)


@dataclass
class MnistConfig(DataConfig):
    root: str = key(nonempty=True)
    download: bool = key()


@dataclass
class Cifar10Config(MnistConfig):
    verify_md5: bool = key()


@dataclass
class TextConfig(DataConfig):
    path: str | None = key(note="a UTF-8 file or a directory of *.txt; null: Python's standard library sources")
    tokenizer: str = key(choices=TOKENIZERS)
    cache_dir: str = key(nonempty=True, note="where rank 0 writes the token file")
    block_size: int | None = key(ge=1, note="the model's context (model.block_size)")
    num_workers: int = key(ge=0, le=0, note="only 0: a batch is one gather from the memory-mapped tokens")


OPTIONS: dict[str, type] = {
    "synthetic": SyntheticConfig,
    "fake": FakeConfig,
    "mnist": MnistConfig,
    "cifar10": Cifar10Config,
    "text": TextConfig,
}
