"""Schemas of conf/data/*.yaml: one dataclass per option, registered under OPTIONS."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from omegaconf import MISSING
from pydantic import Field

from data.bpe import MIN_VOCAB
from data.tokens import MAX_VOCAB, Tokenizer
from trainer.setup.schema.declare import SEED_BOUND, NonEmpty, Schema


@dataclass
class DataConfig(Schema):
    """Keys every data option takes (data/base.py's DataModule)."""

    _target_: NonEmpty = MISSING
    batch_size: Annotated[int, Field(ge=1, description="per rank")] = MISSING
    num_workers: Annotated[int, Field(ge=0, description="0 loads in the training process")] = MISSING
    drop_last: bool = MISSING


@dataclass
class SyntheticConfig(DataConfig):
    num_samples: Annotated[int, Field(ge=1)] = MISSING
    num_val_samples: Annotated[int, Field(ge=1)] = MISSING
    input_dim: Annotated[int, Field(ge=1)] = MISSING
    num_classes: Annotated[int, Field(ge=2)] = MISSING
    seed: Annotated[int, Field(ge=0, lt=SEED_BOUND)] = MISSING


@dataclass
class FakeConfig(DataConfig):
    num_samples: Annotated[int, Field(ge=1)] = MISSING
    num_val_samples: Annotated[int, Field(ge=1)] = MISSING
    image_shape: Annotated[
        list[Annotated[int, Field(ge=1)]], Field(min_length=3, max_length=3, description="[C, H, W], C 1 or 3")
    ] = MISSING
    num_classes: Annotated[int, Field(ge=2)] = MISSING


@dataclass
class MnistConfig(DataConfig):
    root: NonEmpty = MISSING
    download: bool = MISSING


@dataclass
class Cifar10Config(MnistConfig):
    verify_md5: bool = MISSING


@dataclass
class TextConfig(DataConfig):
    path: Annotated[
        str | None, Field(description="a UTF-8 file or a directory of *.txt; null: Python's standard library sources")
    ] = MISSING
    tokenizer: Tokenizer = MISSING
    vocab_size: Annotated[
        int | None,
        Field(
            ge=MIN_VOCAB,
            le=MAX_VOCAB,
            description="bpe's tokens: its 256 byte values and merges, ids that fit the uint16 token file; "
            "null for char and byte",
        ),
    ] = MISSING
    cache_dir: Annotated[str, Field(min_length=1, description="where rank 0 writes the token file")] = MISSING
    block_size: Annotated[int | None, Field(ge=1, description="the model's context (model.block_size)")] = MISSING
    num_workers: Annotated[
        int, Field(ge=0, le=0, description="only 0: a batch is one gather from the memory-mapped tokens")
    ] = MISSING


OPTIONS: dict[str, type] = {
    "synthetic": SyntheticConfig,
    "fake": FakeConfig,
    "mnist": MnistConfig,
    "cifar10": Cifar10Config,
    "text": TextConfig,
}
