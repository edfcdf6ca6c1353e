"""Every composed value checked against its schema's range or choices, before anything starts.

OmegaConf has already checked each value's type while composing (the schemas in
trainer/setup/schema/); pydantic checks each typed node's values against the same declarations
(ranges, choices, lengths, no key the schema lacks), and its first error becomes one ConfigError line
naming the full key, the value and what the key accepts. check_rules adds the few rules that tie
keys together. It runs in train.py before Hydra's app, on every rank alike, so a bad value stops the
job before the process group, the loggers or any file exist.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

import hydra
from omegaconf import DictConfig, OmegaConf
from pydantic import ValidationError
from pydantic_core import ErrorDetails

from trainer.errors import ConfigError, check
from trainer.setup.schema.declare import accepted, adapter, declared_of, nested_schema


def _refusal(error: ErrorDetails, declared: type, node: DictConfig, prefix: str) -> tuple[bool, str]:
    """One of pydantic's errors as (the value is copied from another key, the one-line message).

    pydantic's location is followed through the nested schemas (trainer.fault, sync.bucket_timer) to the key's field;
    what follows it (a list's index, a union's member) is the value's, which is named whole.
    """
    loc = list(error["loc"])
    while len(loc) > 1 and isinstance(loc[0], str) and loc[0] in node:
        inner = nested_schema(typing.get_type_hints(declared).get(loc[0]))
        if inner is None:
            break
        prefix, node, declared, loc = f"{prefix}{loc[0]}.", node[loc[0]], inner, loc[1:]
    name = str(loc[0]) if loc else ""
    if error["type"] == "unexpected_keyword_argument":  # added with +group.key=...
        names = ", ".join(f.name for f in dataclasses.fields(declared) if not f.name.startswith("_"))
        where = prefix.rstrip(".")
        return False, f"{prefix}{name} is not a key of {where} ({declared.__name__}): accepted keys: {names}"
    if name not in node:
        return False, f"{prefix}{'.'.join(str(part) for part in loc)}: {error['msg']}"
    value = node[name]  # resolves interpolations
    plain = OmegaConf.to_container(value, resolve=True) if OmegaConf.is_config(value) else value
    return OmegaConf.is_interpolation(node, name), f"{prefix}{name}={plain!r} is invalid: {accepted(declared, name)}"


def check_node(node: DictConfig, prefix: str) -> list[tuple[bool, str]]:
    """pydantic's errors for a typed node's values (nested typed nodes included), none for an untyped one.

    Each comes with whether its value is copied from another key (sync.time_every_n_steps:
    ${trainer.log_every_n_steps}): validate() reports those last, so a bad value is named under its
    own key first.
    """
    declared = declared_of(OmegaConf.get_type(node))
    if declared is None:
        return []
    try:
        adapter(declared).validate_python(OmegaConf.to_container(node, resolve=True))
    except ValidationError as err:
        return [_refusal(e, declared, node, prefix) for e in err.errors()]
    return []


def accepted_for(cfg: DictConfig, full_key: str) -> str | None:
    """What a key accepts, from its schema ("accepted: an integer >= 1"), or None for an untyped key."""
    parent_key, _, leaf = full_key.split("[")[0].rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, default=None) if parent_key else cfg
    if not isinstance(parent, DictConfig):
        return None
    declared = declared_of(OmegaConf.get_type(parent))
    if declared is None or leaf not in {f.name for f in dataclasses.fields(declared)}:
        return None
    return accepted(declared, leaf)


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
    if _number(cfg, "trainer.checkpoint_async"):
        check(
            _number(cfg, "trainer.checkpoint_format") == "sharded",
            "trainer.checkpoint_async",
            True,
            "needs trainer.checkpoint_format=sharded (DCP's async save writes a part per rank; "
            f"trainer.checkpoint_format={_number(cfg, 'trainer.checkpoint_format')} writes one file from rank 0)",
        )
    comm_hook = _number(cfg, "sync.comm_hook")  # sync=ddp's
    if comm_hook is not None and comm_hook != "none":
        check(
            not _number(cfg, "sync.time_buckets"),
            "sync.comm_hook",
            comm_hook,
            "sync.time_buckets=true registers DDP's one communication hook already: use comm_hook=none, or "
            "time_buckets=false (DDP's runtime statistics time the hooked communication too)",
        )
        check(
            comm_hook != "powersgd" or _number(cfg, "sync.bucket_cap_mb") != "auto",
            "sync.comm_hook",
            comm_hook,
            "with sync.bucket_cap_mb=auto: PowerSGD keeps per-bucket state (error feedback, warm start) that "
            "a rebuild of the buckets would invalidate; give bucket_cap_mb a number",
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
    # weight_decay_on is the builder's (trainer/setup/build.py's optimizer_factory), not the optimizer's.
    for name in (str(k) for k in node if not str(k).startswith("_") and k != "weight_decay_on"):
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
    refusals = [r for name, node in groups for r in check_node(node, f"{name}.")]
    if refusals:
        raise ConfigError(min(refusals, key=lambda r: r[0])[1])  # the first one of a key's own value
    for name, node in groups:
        for key, target_node in _with_targets(node, name):
            check_target(target_node, key, keywords=key == "optim")
    check_rules(cfg)
