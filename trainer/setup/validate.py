"""Every composed value checked against its schema's range or choices, before anything starts.

OmegaConf has already checked each value's type while composing (the schemas in
trainer/setup/schema/); this adds what a type cannot say, plus the few rules that tie keys together.
It runs in train.py before Hydra's app, on every rank alike, so a bad value stops the job before the
process group, the loggers or any file exist.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf

from trainer.errors import ConfigError, check
from trainer.setup.schema.spec import Spec, accepted, check_value, spec_of


def _fields(node: DictConfig) -> tuple[type | None, dict[str, tuple[Any, Spec]]]:
    """A typed node's schema and, per field, its annotation and Spec (empty for an untyped node)."""
    schema = OmegaConf.get_type(node)
    if schema is None or not dataclasses.is_dataclass(schema):
        return None, {}
    hints = typing.get_type_hints(schema)
    return schema, {f.name: (hints[f.name], spec_of(f)) for f in dataclasses.fields(schema)}


def check_node(node: DictConfig, prefix: str, interpolated: bool = False) -> None:
    """Each field of a typed node (and of the typed nodes inside it) within its range or choices.

    Values copied from another key (sync.time_every_n_steps: ${trainer.log_every_n_steps}) are
    checked in a second pass (interpolated=True), so a bad value is reported under its own key first.
    """
    schema, fields = _fields(node)
    for extra in (str(k) for k in node if k not in fields):  # added with +group.key=...
        if schema is None:
            break
        names = ", ".join(f for f in fields if not f.startswith("_"))
        raise ConfigError(
            f"{prefix}{extra} is not a key of {prefix.rstrip('.')} ({schema.__name__}): accepted keys: {names}"
        )
    for name, (annotation, spec) in fields.items():
        if OmegaConf.is_interpolation(node, name) != interpolated:
            continue
        value = node[name]  # resolves interpolations
        if isinstance(value, DictConfig):
            check_node(value, f"{prefix}{name}.", interpolated)
            continue
        plain = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
        check_value(f"{prefix}{name}", plain, annotation, spec)


def accepted_for(cfg: DictConfig, full_key: str) -> str | None:
    """What a key accepts, from its schema ("accepted: an integer >= 1"), or None for an untyped key."""
    parent_key, _, leaf = full_key.split("[")[0].rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, default=None) if parent_key else cfg
    if not isinstance(parent, DictConfig):
        return None
    _, fields = _fields(parent)
    if leaf not in fields:
        return None
    return accepted(*fields[leaf])


def _number(cfg: DictConfig, key: str) -> Any:
    return OmegaConf.select(cfg, key, default=None)


def check_rules(cfg: DictConfig) -> None:
    """Rules that tie keys together (each one reads keys of two groups, or two keys of one)."""
    max_steps, warmup = _number(cfg, "trainer.max_steps"), _number(cfg, "schedule.warmup_steps")
    if max_steps is None and _number(cfg, "trainer.num_epochs") is None:
        raise ConfigError("trainer.max_steps and trainer.num_epochs are both null: set at least one")
    if warmup is not None and max_steps is not None:
        check(
            warmup <= max_steps,
            "schedule.warmup_steps",
            warmup,
            f"must not exceed trainer.max_steps={max_steps} (the warm-up is part of the run)",
        )
    if _number(cfg, "optim.nesterov"):  # torch's SGD raises for this when the trainer builds it
        momentum, dampening = _number(cfg, "optim.momentum"), _number(cfg, "optim.dampening")
        check(
            momentum > 0 and dampening == 0,
            "optim.nesterov",
            True,
            f"needs optim.momentum > 0 and optim.dampening=0 (have {momentum} and {dampening})",
        )


def check_target(node: DictConfig, group: str, keywords: bool) -> None:  # group: the node's key
    """The group's _target_ is importable; with keywords, every key is one of its parameters.

    keywords is for optim: a `_target_` swapped for another optimizer (optim._target_=torch.optim.Adam
    with sgd's momentum) would otherwise reach the user as torch's TypeError, after the process group.
    """
    target = node.get("_target_")
    try:
        built = hydra.utils.get_object(str(target))
    except Exception:
        raise ConfigError(
            f"{group}._target_={target} is invalid: accepted: the dotted path of a class or function "
            f"that can be imported (as in conf/{group.split('.')[0]}/*.yaml)"
        ) from None
    if not keywords:
        return
    params = inspect.signature(built).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return
    for name in (str(k) for k in node if not str(k).startswith("_")):
        check(
            name in params,
            f"{group}.{name}",
            node[name],
            f"{target} takes no keyword {name}; accepted: {', '.join(p for p in params if p != 'params')}",
        )


def _with_targets(node: DictConfig, key: str) -> list[tuple[str, DictConfig]]:
    """The node and the nodes inside it that name a `_target_` (trainer.fault), with their keys."""
    found = [(key, node)] if "_target_" in node else []
    for name in node:
        child = node[name]
        if isinstance(child, DictConfig):
            found += _with_targets(child, f"{key}.{name!s}")
    return found


def validate(cfg: DictConfig) -> None:
    """Raise a ConfigError for the first value out of range, or rule broken, anywhere in cfg."""
    run_name = cfg.get("run_name")
    check(isinstance(run_name, str) and run_name != "", "run_name", run_name, "accepted: a non-empty name")
    groups = [(str(n), cfg[n]) for n in cfg if n != "hydra" and isinstance(cfg[n], DictConfig)]
    for interpolated in (False, True):
        for name, node in groups:
            check_node(node, f"{name}.", interpolated)
    for name, node in groups:
        for key, target_node in _with_targets(node, name):
            check_target(target_node, key, keywords=key == "optim")
    check_rules(cfg)
