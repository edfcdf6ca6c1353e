"""Schemas of conf/model/*.yaml: one dataclass per option, registered under OPTIONS."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.setup.schema.spec import key


@dataclass
class ModelConfig:
    """Keys every model takes (input shape and class count come from the data at run time)."""

    _target_: str = key(nonempty=True)


@dataclass
class BatchNormConfig(ModelConfig):
    """A model with BatchNorm layers; sync_batchnorm is the builder's key (trainer/setup/build.py)."""

    sync_batchnorm: bool = key(note="CUDA only: BatchNorm statistics over all ranks")


@dataclass
class MLPConfig(ModelConfig):
    hidden_sizes: list[int] = key(ge=1, note="hidden layer widths; [] gives a linear classifier")


@dataclass
class CNNConfig(BatchNormConfig):
    channels: list[int] = key(ge=1, nonempty=True, note="one conv stage per entry")
    hidden_size: int = key(ge=1)
    batchnorm: bool = key()


@dataclass
class ResNet18Config(BatchNormConfig):
    small_input_stem: bool = key()


@dataclass
class GPTConfig(ModelConfig):
    """vocab_size comes from the data (data=text) at run time."""

    n_layer: int = key(ge=1)
    n_head: int = key(ge=1, note="must divide model.n_embd")
    n_embd: int = key(ge=1)
    block_size: int = key(ge=1, note="context in tokens; must fit in the validation split")
    dropout: float = key(ge=0, lt=1, note="> 0 breaks the equivalence of N ranks and one process")
    bias: bool = key()


OPTIONS: dict[str, type] = {"mlp": MLPConfig, "cnn": CNNConfig, "resnet18": ResNet18Config, "gpt": GPTConfig}
