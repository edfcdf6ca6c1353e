"""Every config key, declared once: its type, range or choices, and meaning, in pydantic's terms.

One plain dataclass per option of each group (conf/<group>/<option>.yaml); the trainer's keys are
trainer/core.py's TrainSettings. A sync strategy's keys are declared by the strategy itself, in its
signature (trainer/sync/<option>.py, `Annotated[type, Field(...)]`), and its schema is made from
that signature, found through the YAML's _target_: a new strategy is its module and its YAML,
nothing here. A field (a parameter) has no default: the defaults are the YAML's, the one place they
live, so every YAML sets each of its schema's keys (a test checks both ways), and a key the schema
lacks is refused (extra="forbid"). trainer/setup/validate.py checks a composed config against
these; docs/configuration.md is checked against them (tests/test_docs.py).
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, make_dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import hydra
from omegaconf import DictConfig, OmegaConf
from pydantic import ConfigDict, Field

from data.bpe import MIN_VOCAB
from data.tokens import MAX_VOCAB, Tokenizer
from trainer.core import CONF_DIR, SEED_BOUND, TrainSettings
from trainer.logger.wandb import Mode as WandbMode
from trainer.sync.base import WeightDecayOn

NonEmpty = Annotated[str, Field(min_length=1)]
Count = Annotated[int, Field(ge=1)]
Sizes = Annotated[list[Count], Field(min_length=1)]


class Schema:
    __pydantic_config__ = ConfigDict(extra="forbid")  # +group.key=... for a key the schema lacks


@dataclass
class Target(Schema):
    """What every option builds (hydra.utils.instantiate)."""

    _target_: NonEmpty


# model (input shape and class count come from the data at run time)


@dataclass
class BatchNormModel(Target):
    sync_batchnorm: Annotated[bool, Field(description="CUDA only: BatchNorm statistics over all ranks")]


@dataclass
class MLP(Target):
    hidden_sizes: Annotated[list[Count], Field(description="hidden layer widths; [] gives a linear classifier")]


@dataclass
class CNN(BatchNormModel):
    channels: Annotated[Sizes, Field(description="one conv stage per entry")]
    hidden_size: Count
    batchnorm: bool


@dataclass
class ResNet18(BatchNormModel):
    small_input_stem: bool


@dataclass
class GPT(Target):
    n_layer: Count
    n_head: Annotated[int, Field(ge=1, description="must divide model.n_embd")]
    n_embd: Count
    block_size: Annotated[int, Field(ge=1, description="context in tokens; must fit in the validation split")]
    dropout: Annotated[float, Field(ge=0, lt=1, description="> 0 breaks the equivalence of N ranks and one process")]
    bias: bool
    activation_checkpointing: Annotated[bool, Field(description="recompute each block in backward: less memory")]


# data


@dataclass
class Data(Target):
    batch_size: Annotated[int, Field(ge=1, description="per rank")]
    num_workers: Annotated[int, Field(ge=0, description="0 loads in the training process")]
    drop_last: bool


@dataclass
class Synthetic(Data):
    num_samples: Count
    num_val_samples: Count
    input_dim: Count
    num_classes: Annotated[int, Field(ge=2)]
    seed: Annotated[int, Field(ge=0, lt=SEED_BOUND)]


@dataclass
class Fake(Data):
    num_samples: Count
    num_val_samples: Count
    image_shape: Annotated[list[Count], Field(min_length=3, max_length=3, description="[C, H, W], C 1 or 3")]
    num_classes: Annotated[int, Field(ge=2)]


@dataclass
class Mnist(Data):
    root: NonEmpty
    download: bool


@dataclass
class Cifar10(Mnist):
    verify_md5: bool


@dataclass
class Text(Data):
    path: Annotated[str | None, Field(description="a UTF-8 file or a directory of *.txt; null: Python's sources")]
    tokenizer: Tokenizer
    vocab_size: Annotated[
        int | None, Field(ge=MIN_VOCAB, le=MAX_VOCAB, description="bpe's tokens (bytes and merges); null: char, byte")
    ]
    cache_dir: Annotated[str, Field(min_length=1, description="where rank 0 writes the token file")]
    block_size: Annotated[int | None, Field(ge=1, description="the model's context (model.block_size)")]
    num_workers: Annotated[int, Field(ge=0, le=0, description="only 0: a batch is one gather from the tokens")]


# sync: a strategy declares its keys in its own signature (trainer/sync/<option>.py), the YAML their defaults


def signature_schema(target: Callable[..., Any]) -> type:
    """The schema of a target that declares its keys in its signature (`Annotated[type, Field(...)]`
    and a default the YAML repeats): a dataclass of its parameters without their defaults (the YAML
    gives every key), named after the target less its "Sync" (DDPSync: DDP, zero_sync: Zero), which
    messages print; Target itself for a target that takes no key."""
    hints = typing.get_type_hints(target.__init__ if inspect.isclass(target) else target, include_extras=True)
    fields = [(name, hints[name]) for name in inspect.signature(target).parameters]
    if not fields:
        return Target
    name = target.__name__ if inspect.isclass(target) else target.__name__.title().replace("_", "")
    schema = make_dataclass(name.removesuffix("Sync"), fields, bases=(Target,))
    schema.__module__ = target.__module__
    return schema


class SignatureSchemas(Mapping[str, type]):
    """Each <option>.yaml's schema, read from the signature of the _target_ it builds, when first
    asked for: a strategy's module is imported then, not before. Checking `sync=ddp` imports no other
    strategy (fsdp's brings torch's DTensor and distributed checkpoint, most of a second of start-up
    in every process that checks a config: the launcher and each rank)."""

    def __init__(self, group_dir: Path) -> None:
        self._paths = {path.stem: path for path in sorted(group_dir.glob("*.yaml"))}
        self._targets: dict[str, str] = {}  # option -> the _target_ its YAML names
        self._built: dict[str, type] = {}  # by target: options that build the same class share its schema

    def __getitem__(self, option: str) -> type:
        if option not in self._targets:
            yaml = OmegaConf.load(self._paths[option])  # KeyError for an option with no YAML
            assert isinstance(yaml, DictConfig), self._paths[option]
            self._targets[option] = str(yaml._target_)
        target = self._targets[option]
        if target not in self._built:
            self._built[target] = signature_schema(hydra.utils.get_object(target))
        return self._built[target]

    def __iter__(self) -> Iterator[str]:
        return iter(self._paths)

    def __len__(self) -> int:
        return len(self._paths)


def signature_schemas(group_dir: Path) -> SignatureSchemas:
    """Each <option>.yaml's schema, read from the signature of the _target_ it builds (on first use)."""
    return SignatureSchemas(group_dir)


# optim: every keyword handed to torch's optimizer, in torch's own bounds (lr > 0: zero trains nothing)


@dataclass
class Optim(Target):
    _partial_: Annotated[Literal[True], Field(description="the trainer binds the model's parameters")]
    lr: Annotated[float, Field(gt=0)]
    weight_decay: Annotated[float, Field(ge=0)]
    weight_decay_on: Annotated[WeightDecayOn, Field(description="matrices: only parameters with >= 2 dims decay")]
    fused: Annotated[bool, Field(description="torch's fused kernel (CPU and CUDA)")]


@dataclass
class SGD(Optim):
    momentum: Annotated[float, Field(ge=0, lt=1)]
    dampening: Annotated[float, Field(ge=0, le=1)]
    nesterov: Annotated[bool, Field(description="needs momentum > 0 and dampening 0")]


@dataclass
class AdamW(Optim):
    betas: Annotated[list[Annotated[float, Field(ge=0, lt=1)]], Field(min_length=2, max_length=2)]
    eps: Annotated[float, Field(gt=0)]
    amsgrad: bool


# schedule, logger (network: trainer/sync/network.py's Network is its own schema)


@dataclass
class WarmupCosine(Target):
    warmup_steps: Annotated[int, Field(ge=0, description="not longer than trainer.max_steps")]
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)]


@dataclass
class Wandb(Target):
    mode: Annotated[WandbMode, Field(description="also from the WANDB_MODE environment variable")]
    project: NonEmpty
    entity: Annotated[str | None, Field(description="null: your W&B default")]


SCHEMAS: dict[str, Mapping[str, type]] = {
    "model": {"mlp": MLP, "cnn": CNN, "resnet18": ResNet18, "gpt": GPT},
    "data": {"synthetic": Synthetic, "fake": Fake, "mnist": Mnist, "cifar10": Cifar10, "text": Text},
    "sync": signature_schemas(CONF_DIR / "sync"),
    "optim": {"sgd": SGD, "adamw": AdamW},
    "schedule": {"constant": Target, "warmup_cosine": WarmupCosine},
    "trainer": {"default": TrainSettings},
    "logger": {"wandb": Wandb, "none": Target},
    "network": signature_schemas(CONF_DIR / "network"),  # trainer/sync/network.py's Network, one class
}
