"""Schemas of conf/model/*.yaml: one dataclass per option, registered under OPTIONS."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from omegaconf import MISSING
from pydantic import Field

from trainer.setup.schema.declare import NonEmpty, Schema


@dataclass
class ModelConfig(Schema):
    """Keys every model takes (input shape and class count come from the data at run time)."""

    _target_: NonEmpty = MISSING


@dataclass
class BatchNormConfig(ModelConfig):
    """A model with BatchNorm layers; sync_batchnorm is the builder's key (trainer/setup/build.py)."""

    sync_batchnorm: Annotated[bool, Field(description="CUDA only: BatchNorm statistics over all ranks")] = MISSING


@dataclass
class MLPConfig(ModelConfig):
    hidden_sizes: Annotated[
        list[Annotated[int, Field(ge=1)]], Field(description="hidden layer widths; [] gives a linear classifier")
    ] = MISSING


@dataclass
class CNNConfig(BatchNormConfig):
    channels: Annotated[
        list[Annotated[int, Field(ge=1)]], Field(min_length=1, description="one conv stage per entry")
    ] = MISSING
    hidden_size: Annotated[int, Field(ge=1)] = MISSING
    batchnorm: bool = MISSING


@dataclass
class ResNet18Config(BatchNormConfig):
    small_input_stem: bool = MISSING


@dataclass
class GPTConfig(ModelConfig):
    """vocab_size comes from the data (data=text) at run time."""

    n_layer: Annotated[int, Field(ge=1)] = MISSING
    n_head: Annotated[int, Field(ge=1, description="must divide model.n_embd")] = MISSING
    n_embd: Annotated[int, Field(ge=1)] = MISSING
    block_size: Annotated[int, Field(ge=1, description="context in tokens; must fit in the validation split")] = MISSING
    dropout: Annotated[
        float, Field(ge=0, lt=1, description="> 0 breaks the equivalence of N ranks and one process")
    ] = MISSING
    bias: bool = MISSING
    activation_checkpointing: Annotated[
        bool, Field(description="recompute each block in backward: less activation memory, one more forward")
    ] = MISSING


OPTIONS: dict[str, type] = {"mlp": MLPConfig, "cnn": CNNConfig, "resnet18": ResNet18Config, "gpt": GPTConfig}
