"""A sync key is declared once: its type, range, meaning and default in the strategy's signature,
repeated (and checked) in conf/sync/<option>.yaml; the config layer reads the schema from the
signature, so a new strategy is its module and its YAML (docs/architecture.md, one declaration per
key)."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
import typing

import hydra
import pytest
from omegaconf import DictConfig, OmegaConf
from pydantic import ValidationError

import trainer.sync
from tests.compose import CONF_DIR
from trainer.errors import ConfigError
from trainer.setup.config import sync_options
from trainer.setup.precheck import check_overrides
from trainer.setup.schema import SCHEMAS, signature_schemas
from trainer.setup.validate import adapter, refusal
from trainer.sync.base import SyncStrategy

OPTIONS = sorted(p.stem for p in (CONF_DIR / "sync").glob("*.yaml"))


def target_of(option: str) -> typing.Callable[..., object]:
    yaml = OmegaConf.load(CONF_DIR / "sync" / f"{option}.yaml")
    assert isinstance(yaml, DictConfig)
    built: typing.Callable[..., object] = hydra.utils.get_object(str(yaml._target_))
    return built


def test_every_sync_yaml_has_the_schema_of_its_targets_signature() -> None:
    assert sorted(SCHEMAS["sync"]) == OPTIONS
    for option in OPTIONS:
        target = target_of(option)
        declared = typing.get_type_hints(target.__init__ if isinstance(target, type) else target, include_extras=True)
        schema = SCHEMAS["sync"][option]
        fields = [f.name for f in dataclasses.fields(schema)]
        assert fields == ["_target_", *inspect.signature(target).parameters], option
        hints = typing.get_type_hints(schema, include_extras=True)
        assert [repr(hints[n]) for n in fields[1:]] == [repr(declared[n]) for n in fields[1:]], option


def _strategy_classes() -> list[type[SyncStrategy]]:
    """Every SyncStrategy in trainer/sync/: the targets and the classes a target builds (zero's stages)."""
    for module in pkgutil.iter_modules(trainer.sync.__path__):
        importlib.import_module(f"trainer.sync.{module.name}")
    found, todo = [], list(SyncStrategy.__subclasses__())
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo += cls.__subclasses__()
    return [cls for cls in found if cls.__module__.startswith("trainer.sync.")]


def test_a_sync_keys_default_is_its_builders_and_the_yaml_repeats_it() -> None:
    """Issue 74 moved a key's default into its builder's signature (the strategy file states what it
    runs with); the YAML repeats it so that Hydra can override it. Nothing may hold a default that
    nothing keeps equal: the YAML's value equals the builder's, and a class a builder constructs
    (zero's stages) takes its keys without defaults of its own. The one default a signature cannot
    hold, the node's ranks (${network.gpus_per_node}), is an interpolation in the YAML and a required
    parameter."""
    targets = {option: target_of(option) for option in OPTIONS}
    assert {"DDPSync", "zero_sync"} <= {t.__name__ for t in targets.values()}
    for option, node in sync_options().items():
        params = inspect.signature(targets[option]).parameters
        for key in (k for k in node if k != "_target_"):
            default = params[key].default
            if OmegaConf.is_interpolation(node, key):
                assert default is inspect.Parameter.empty, (option, key, default)
                continue
            value = OmegaConf.to_object(node[key]) if OmegaConf.is_config(node[key]) else node[key]
            assert default is not inspect.Parameter.empty and value == default, (option, key, value, default)
    inner = [c for c in _strategy_classes() if c not in targets.values()]
    assert {"ZeroSync", "Zero3Sync"} <= {c.__name__ for c in inner}
    second = [
        f"{c.__module__}.{c.__name__}({name}={param.default!r})"
        for c in inner
        for name, param in inspect.signature(c).parameters.items()
        if param.default is not inspect.Parameter.empty
    ]
    assert not second, f"give these defaults in the builder's signature only: {second}"


def test_the_schemas_keep_the_names_messages_print() -> None:
    names = {o: SCHEMAS["sync"][o].__name__ for o in ("ddp", "bucketed", "manual", "zero", "fsdp", "none")}
    assert names == {
        "ddp": "DDP",
        "bucketed": "Bucketed",
        "manual": "Manual",
        "zero": "Zero",
        "fsdp": "FSDP",
        "none": "Target",
    }
    with pytest.raises(ConfigError) as refused:
        check_overrides(["sync=manual", "+sync.depth=3"])
    assert str(refused.value) == (
        "sync.depth is not a key of sync (Manual): accepted keys: coalesce_mb, collective, find_unused_parameters"
    )


def test_the_bucket_cap_keys_are_declared_once_for_ddp_and_bucketed() -> None:
    ddp, bucketed = (typing.get_type_hints(SCHEMAS["sync"][o], include_extras=True) for o in ("ddp", "bucketed"))
    for key in ("bucket_cap_mb", "auto_candidates_mb", "auto_steps_per_trial", "auto_warmup_steps"):
        assert ddp[key] is bucketed[key], key  # trainer/sync/autotune.py's one alias


STRATEGY = """
from typing import Annotated

from pydantic import Field

from trainer.sync.base import SyncStrategy


class EchoSync(SyncStrategy):
    name = "echo"

    def __init__(self, num_echoes: Annotated[int, Field(ge=1, description="times each gradient is sent")]) -> None:
        super().__init__()
        self.num_echoes = num_echoes

    def wrap(self, model):
        return model
"""


def test_a_new_strategy_is_its_module_and_its_yaml(tmp_path: typing.Any, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "echo_sync.py").write_text(STRATEGY)
    (tmp_path / "sync").mkdir()
    (tmp_path / "sync" / "echo.yaml").write_text("_target_: echo_sync.EchoSync\nnum_echoes: 2\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    schema = signature_schemas(tmp_path / "sync")["echo"]
    node = OmegaConf.create({"_target_": "echo_sync.EchoSync", "num_echoes": 2})
    assert adapter(schema).validate_python(OmegaConf.to_container(node)).num_echoes == 2
    for key, value, message in [
        ("num_echoes", 0, "sync.num_echoes=0 is invalid: accepted: an integer >= 1 (times each gradient is sent)"),
        ("loudness", 1, "sync.loudness is not a key of sync (Echo): accepted keys: num_echoes"),
    ]:
        bad = OmegaConf.merge(node, {key: value})
        with pytest.raises(ValidationError) as refused:
            adapter(schema).validate_python(OmegaConf.to_container(bad))
        assert isinstance(bad, DictConfig)
        assert refusal(refused.value.errors()[0], schema, bad, "sync.") == message
