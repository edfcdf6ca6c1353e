"""Schemas of conf/optim/*.yaml: every keyword the lab hands to torch's optimizer, typed and
ranged here so that torch's own ValueError never reaches a user (torch's own bounds, except lr,
which must be > 0: a zero learning rate trains nothing)."""

from __future__ import annotations

from dataclasses import dataclass

from trainer.setup.schema.spec import key


@dataclass
class OptimConfig:
    _target_: str = key(nonempty=True)
    _partial_: bool = key(True, choices=(True,), note="the trainer binds the model's parameters")
    lr: float = key(gt=0)
    weight_decay: float = key(ge=0)


@dataclass
class SGDConfig(OptimConfig):
    momentum: float = key(ge=0, lt=1)
    dampening: float = key(ge=0, le=1)
    nesterov: bool = key(note="needs momentum > 0 and dampening 0")


@dataclass
class AdamWConfig(OptimConfig):
    betas: list[float] = key(ge=0, lt=1, length=2)
    eps: float = key(gt=0)
    amsgrad: bool = key()


OPTIONS: dict[str, type] = {"sgd": SGDConfig, "adamw": AdamWConfig}
