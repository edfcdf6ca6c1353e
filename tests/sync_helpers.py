"""A sync strategy built from its conf/sync/<option>.yaml, a few keys changed: the defaults live in
the YAML only (a strategy's signature declares each key's type, range and meaning, no default)."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import hydra
from omegaconf import OmegaConf

from tests.compose import compose_config
from trainer.sync.base import SyncStrategy

T = TypeVar("T")


@functools.cache
def yaml_keys(option: str) -> dict[str, Any]:
    """sync=<option>'s node as a run composes it: its _target_ and every key's default."""
    keys = OmegaConf.to_container(compose_config([f"sync={option}"]).sync, resolve=True)
    assert isinstance(keys, dict)
    return {str(k): v for k, v in keys.items()}


def from_yaml(option: str, **keys: Any) -> SyncStrategy:
    """sync=<option> with these keys changed, built as a run builds it (hydra's instantiate)."""
    strategy = hydra.utils.instantiate({**yaml_keys(option), **keys}, _convert_="all")
    assert isinstance(strategy, SyncStrategy)
    return strategy


def class_from_yaml(cls: Callable[..., T], option: str, **keys: Any) -> T:
    """A class its option's target builds (zero's ZeroSync, Zero3Sync, or a test's subclass of one),
    given the YAML's values of the parameters it takes, these keys changed."""
    takes = inspect.signature(cls).parameters
    return cls(**{k: v for k, v in {**yaml_keys(option), **keys}.items() if k in takes})
