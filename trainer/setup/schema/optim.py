"""Schemas of conf/optim/*.yaml: every keyword the lab hands to torch's optimizer, typed and
ranged here so that torch's own ValueError never reaches a user (torch's own bounds, except lr,
which must be > 0: a zero learning rate trains nothing)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal

from omegaconf import MISSING
from pydantic import Field

from trainer.setup.schema.declare import NonEmpty, Schema
from trainer.sync.base import WeightDecayOn


@dataclass
class OptimConfig(Schema):
    _target_: NonEmpty = MISSING
    _partial_: Annotated[Literal[True], Field(description="the trainer binds the model's parameters")] = True
    lr: Annotated[float, Field(gt=0)] = MISSING
    weight_decay: Annotated[float, Field(ge=0)] = MISSING
    weight_decay_on: Annotated[
        WeightDecayOn, Field(description="matrices: only parameters with >= 2 dimensions decay (nanoGPT's rule)")
    ] = MISSING


@dataclass
class SGDConfig(OptimConfig):
    momentum: Annotated[float, Field(ge=0, lt=1)] = MISSING
    dampening: Annotated[float, Field(ge=0, le=1)] = MISSING
    nesterov: Annotated[bool, Field(description="needs momentum > 0 and dampening 0")] = MISSING


@dataclass
class AdamWConfig(OptimConfig):
    betas: Annotated[list[Annotated[float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)] = MISSING
    eps: Annotated[float, Field(gt=0)] = MISSING
    amsgrad: bool = MISSING


OPTIONS: dict[str, type] = {"sgd": SGDConfig, "adamw": AdamWConfig}
