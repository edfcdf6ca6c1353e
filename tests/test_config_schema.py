"""Every key of every option is typed and checked: a wrong value is one line naming the key.

Composed in-process through trainer/setup/precheck.py, the very code train.py runs before Hydra's
app (test_bad_values_end_to_end.py runs a few through train.py and torchrun). The cases are derived
from the schemas, so a key added later is swept without touching this file.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import typing
from typing import Any

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf

from tests.compose import CONF_DIR, compose_config
from trainer.errors import ConfigError
from trainer.setup.precheck import check_overrides, explain_compose_error
from trainer.setup.schema import SCHEMAS
from trainer.setup.validate import Key, key_of, nested, schema_of, validate

MODULES = {group: "trainer/core.py" if group == "trainer" else "trainer/setup/schema.py" for group in SCHEMAS}
MODULES["sync"] = "the signature of its _target_ (trainer/sync/<option>.py)"  # a strategy declares its own keys

# Groups whose options are not typed nodes of their own: they set keys of the typed groups.
UNTYPED_GROUPS = {
    "experiment": "@package _global_: sets keys of the typed groups (model.hidden_sizes, trainer.max_steps, ...)",
    "strategy": "@package _global_: picks a sync option and sets its keys",
    "hydra": "Hydra's own config (launchers, logging), typed by Hydra",
    "local": "the user's own machine settings, git-ignored",
}
# Strings that accept any value of the right kind (a list there is still refused), and why.
ANY_STRING = {
    "data.root": "a directory: checked when the data is set up (missing files are named there)",
    "data.path": "a corpus file or directory: checked when the data is set up (a missing path is named there)",
    "data.cache_dir": "a directory rank 0 creates for the token file",
    "trainer.resume": "auto, never, or a checkpoint's path: checked when the trainer resumes",
    "logger.project": "a W&B project name",
    "logger.entity": "a W&B user or team name",
}
# Numbers that accept any value of their type, and why (none today: a new one must say why here).
ANY_NUMBER: dict[str, str] = {}


def yaml_options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


OPTIONS = [(group, option) for group in sorted(SCHEMAS) for option in yaml_options(group)]
# Options that only run together (a token model reads token data, and back): composed as a pair.
PARTNERS = {"data=text": ["model=gpt"], "model=gpt": ["data=text"]}


def chosen(group: str, option: str) -> list[str]:
    return [f"{group}={option}", *PARTNERS.get(f"{group}={option}", [])]


IDS = [f"{g}={o}" for g, o in OPTIONS]


def test_every_group_directory_is_typed() -> None:
    on_disk = {p.name for p in CONF_DIR.iterdir() if p.is_dir()}
    untyped = on_disk - set(SCHEMAS) - set(UNTYPED_GROUPS)
    assert not untyped, (
        f"conf/{sorted(untyped)[0]}/ has no schemas: add a dataclass per option to trainer/setup/schema.py "
        "and list them in its SCHEMAS (docs/configuration.md, adding a key)"
    )


def test_every_schema_has_its_yaml() -> None:
    stale = [f"{g}/{o}" for g, options in SCHEMAS.items() for o in options if o not in yaml_options(g)]
    assert not stale, f"schemas without a conf/<group>/<option>.yaml: {stale}"


def _compare(raw: DictConfig, schema: type, where: str, module: str) -> None:
    """The YAML's keys and the schema's fields are the same set: a field has no default, the YAML gives it."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    hints = typing.get_type_hints(schema)
    for name in (str(k) for k in raw if k != "defaults"):
        assert name in fields, (
            f"{where} sets `{name}`, which {schema.__name__} in {module} lacks: add the typed field "
            f"`{name}: Annotated[<type>, Field(<range>)]` (or a Literal of its choices) there "
            "(docs/configuration.md, adding a key)"
        )
        if dataclasses.is_dataclass(hints[name]):
            _compare(raw[name], hints[name], f"{where} under {name}", module)
    for name, field in fields.items():
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        assert not required or name in raw, (
            f"{schema.__name__} in {module} declares `{name}` without a default, but {where} does not set it: "
            "add its line (the value is the default) to the YAML"
        )


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=IDS)
def test_every_yaml_option_has_a_schema_with_the_same_keys(group: str, option: str) -> None:
    where, module = f"conf/{group}/{option}.yaml", MODULES[group]
    schema = SCHEMAS[group].get(option)
    assert schema is not None, (
        f"{where} has no schema: add a dataclass for it to {module} and list it in SCHEMAS as "
        f"'{option}' (docs/configuration.md, adding a key)"
    )
    raw = OmegaConf.load(CONF_DIR / group / f"{option}.yaml")
    assert isinstance(raw, DictConfig)
    if "defaults" in raw:  # an option that extends another (sync=hsdp: fsdp's keys): its keys once composed
        raw = compose_config(chosen(group, option))[group]
    _compare(raw, schema, where, module)
    assert schema_of(group, compose_config(chosen(group, option))[group]) is schema


def leaves(schema: type, prefix: str) -> list[tuple[str, Any, Key]]:
    """(full key, annotation, Key) of every leaf field, nested dataclasses (trainer.fault) included."""
    found = []
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        inner = nested(schema, field.name)  # trainer.fault
        if inner is not None:
            found += leaves(inner, f"{prefix}{field.name}.")
        else:
            found.append((f"{prefix}{field.name}", hints[field.name], key_of(schema, field.name)))
    return found


def _base(annotation: Any) -> Any:
    """int for `int | None`, list for `list[int]`, str for `Literal["a", "b"]`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if typing.get_origin(annotation) is list:
        return list
    if typing.get_origin(annotation) is typing.Literal:
        return type(args[0])
    return _base(args[0]) if args else annotation


def wrong_kinds(key: str, annotation: Any, spec: Key) -> list[str]:
    """Override values of the wrong kind for this key: a word for a number, maybe for a boolean, ..."""
    base = _base(annotation)
    if spec.number is not None:
        return ["lots", "[1,2]"]
    return {
        bool: ["maybe", "[1,2]"],
        int: ["lots", "1.5", "[1,2]"],
        float: ["lots", "[1,2]"],
        str: ["[1,2]"],
        list: ["lots", "[lots]"],
    }[base]


def out_of_range(key: str, annotation: Any, spec: Key) -> list[str]:
    """Override values of the right kind that the key must refuse: past each bound, outside the choices."""
    base = _base(annotation)
    values = [
        spec.ge - 1 if spec.ge is not None else None,
        spec.gt,
        spec.lt,
        spec.le + 1 if spec.le is not None else None,
    ]
    numbers = [str(int(v) if base is int else v) for v in values if v is not None]
    bad = [f"[{n}]" for n in numbers] if base is list else numbers
    if spec.choices:
        bad.append("false" if base is bool else "bogus")
    if base is list and spec.length is not None:
        bad.append("[" + ",".join(["0.5"] * (spec.length + 1)) + "]")
    if spec.nonempty:
        bad.append("[]" if base is list else "''")
    if key.endswith("._target_"):
        bad.append("no.such.Thing")
    if not bad:
        kind = "number" if base in (int, float) else "string" if base is str else None
        listed = {"number": ANY_NUMBER, "string": ANY_STRING}.get(kind or "")
        assert listed is None or key in listed, (
            f"{key} accepts any {kind}: give it a range or choices (Field(ge=...), Literal[...]), "
            f"or list it in tests/test_config_schema.py's ANY_{(kind or '').upper()} with the reason"
        )
    return bad


def _cases() -> list[tuple[list[str], str]]:
    cases = []
    for group, option in OPTIONS:
        if option not in SCHEMAS[group]:
            continue  # test_every_yaml_option_has_a_schema_with_the_same_keys says where to add it
        for key, annotation, spec in leaves(SCHEMAS[group][option], f"{group}."):
            for value in wrong_kinds(key, annotation, spec) + out_of_range(key, annotation, spec):
                cases.append(([*chosen(group, option), f"{key}={value}"], key))
    return cases


CASES = _cases()


def _refused(overrides: list[str]) -> str:
    with pytest.raises(ConfigError) as caught:
        check_overrides(overrides)
    message = str(caught.value)
    assert "\n" not in message.strip(), message
    return message


@functools.cache
def _composed(options: tuple[str, ...]) -> DictConfig:
    return compose_config(list(options))


def _refused_value(overrides: list[str]) -> str:
    """check_overrides' verdict on one bad value, without composing the option again for each value.

    The option is composed once (cached); the bad value is parsed by Hydra's own override parser and
    set on a copy, then validated as check_overrides validates a composed config.
    """
    *options, line = overrides
    cfg = copy.deepcopy(_composed(tuple(options)))
    (override,) = OverridesParser.create().parse_overrides([line])
    OmegaConf.update(cfg, override.key_or_group, override.value(), merge=False)
    with pytest.raises(ConfigError) as caught:
        try:
            validate(cfg)
        except Exception as err:
            raise explain_compose_error(err, overrides) from None
    message = str(caught.value)
    assert "\n" not in message.strip(), message
    return message


@pytest.mark.parametrize(("overrides", "key"), CASES, ids=[" ".join(o) for o, _ in CASES])
def test_every_leaf_refuses_a_wrong_value_naming_the_key(overrides: list[str], key: str) -> None:
    message = _refused_value(overrides)
    assert key in message and "accepted" in message, message


# The shortcut above against the whole path (compose with the bad value, then validate): one case
# of each kind of refusal, a word for a number, a bound, a choice.
SAME_PATH = [
    (["optim=sgd", "optim.lr=lots"], "optim.lr"),
    (["optim=sgd", "optim.lr=0"], "optim.lr"),
    (["sync=manual", "sync.collective=bogus"], "sync.collective"),
]


@pytest.mark.parametrize(("overrides", "key"), SAME_PATH, ids=[" ".join(o) for o, _ in SAME_PATH])
def test_the_shortcut_refuses_as_the_command_line_does(overrides: list[str], key: str) -> None:
    assert (overrides, key) in CASES
    assert _refused_value(overrides) == _refused(overrides)


@pytest.mark.parametrize(("group", "option"), OPTIONS, ids=IDS)
def test_every_option_as_it_stands_is_accepted(group: str, option: str) -> None:
    check_overrides(chosen(group, option))  # the refusals above are the values', not the option's


GLOBAL = [f"+strategy={o}" for o in yaml_options("strategy")] + [f"experiment={o}" for o in yaml_options("experiment")]


@pytest.mark.parametrize("choice", GLOBAL)
def test_every_strategy_and_experiment_sets_only_typed_values_in_range(choice: str) -> None:
    check_overrides(["-m", choice])  # -m: an experiment's own sweep values are checked one by one too


def test_the_sweep_covers_every_leaf_and_bound() -> None:
    keys = {key for _, key in CASES}
    assert {"optim.lr", "sync.static_graph", "trainer.fault.kind", "data.seed", "schedule.min_lr_ratio"} <= keys
    assert (["optim=sgd", "optim.lr=0"], "optim.lr") in CASES  # gt=0: zero itself is refused
    assert (["trainer=default", "trainer.seed=4294967296"], "trainer.seed") in CASES
    assert set(ANY_STRING) <= keys and set(ANY_NUMBER) <= keys


MORE = {
    # id: (command line as train.py gets it, text the message must hold)
    "unclosed-list": (["trainer.num_epochs=[1,2"], ["trainer.num_epochs=[1,2 cannot be parsed", "integer >= 1"]),
    "stray-equals": (["trainer.seed==3"], ["trainer.seed", "integer"]),
    "unknown-option": (["sync=bogus"], ["sync=bogus is not an option of sync", "bucketed, ddp, fsdp"]),
    "misspelt-option": (["sync=ddpp"], ["sync=ddpp is not an option of sync (did you mean sync=ddp?)", "fsdp"]),
    "group-without-a-default": (  # strategy is in no default: Hydra's "No match in the defaults list"
        ["strategy=ddp_fp16"],
        ["strategy=ddp_fp16 cannot override strategy", "add one instead: +strategy=ddp_fp16"],
    ),
    # The suggestion must compose: + where the defaults list has no such group, none where it has one.
    "misspelt-added-option": (
        ["+strategy=ddp_fp61"],
        ["+strategy=ddp_fp61 is not an option of strategy (did you mean +strategy=ddp_fp16?)", "ddp_powersgd"],
    ),
    "misspelt-option-of-a-group-without-a-default": (
        ["strategy=ddp_fp61"],
        ["strategy=ddp_fp61 cannot override strategy", "(did you mean +strategy=ddp_fp16?)", "ddp_powersgd"],
    ),
    "misspelt-option-added-to-a-default-group": (
        ["+sync=ddpp"],
        ["sync=ddpp is not an option of sync (did you mean sync=ddp?)"],
    ),
    "misspelt-key": (["trainer.max_step=5"], ["'trainer.max_step' is not a config key", "Did you mean"]),
    "added-key": (["+model.depth=3"], ["model.depth is not a key of model", "hidden_sizes"]),
    "run-name": (["run_name=[1,2]"], ["run_name=", "accepted"]),
    "warmup-longer-than-run": (
        ["schedule=warmup_cosine", "trainer.max_steps=10", "schedule.warmup_steps=20"],
        ["schedule.warmup_steps=20", "trainer.max_steps=10"],
    ),
    "nesterov-without-momentum": (["optim.nesterov=true", "optim.momentum=0"], ["optim.nesterov", "momentum > 0"]),
    "another-optimizers-keys": (["optim._target_=torch.optim.Adam"], ["optim.momentum", "torch.optim.Adam takes no"]),
    "sweep-value": (["-m", "sync.bucket_cap_mb=1,5,lots"], ["sync.bucket_cap_mb='lots' is invalid"]),
    "experiment-then-bad-value": (["-m", "experiment=bucket_sweep", "trainer.max_steps=-3"], ["trainer.max_steps=-3"]),
    "strategy-sweep-then-bad-value": (
        ["-m", "sync=ddp,bucketed", "sync.comm_hook=fp16"],
        ["'sync.comm_hook' is not a config key", "bucket_cap_mb"],  # bucketed has no comm_hook
    ),
    "launcher-start-method": (
        ["-m", "hydra/launcher=torchrun", "hydra.launcher.start_method=forc"],
        ["hydra.launcher.start_method", "'forc'", "spawn, fork, forkserver"],
    ),
    "launcher-misspelt-key": (
        ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_nod=2"],
        ["'hydra.launcher.nproc_per_nod' is not a config key", "Did you mean hydra.launcher.nproc_per_node?"],
    ),
    "launcher-not-a-number": (
        ["-m", "hydra/launcher=torchrun", "hydra.launcher.nproc_per_node=two"],
        ["hydra.launcher.nproc_per_node", "'two'", "Integer"],
    ),
    "both-lengths-null": (["trainer.max_steps=null", "trainer.num_epochs=null"], ["both null"]),
    "async-save-of-a-full-checkpoint": (
        ["trainer.checkpoint_async=true"],
        ["trainer.checkpoint_async=True is invalid", "needs trainer.checkpoint_format=sharded", "format=full"],
    ),
    "ddp-hook-and-bucket-timing": (
        ["sync.comm_hook=fp16", "sync.time_buckets=true"],  # the constructor's own rule, run before any file
        ["sync.comm_hook='fp16' is invalid", "time_buckets"],
    ),
}


@pytest.mark.parametrize("case", MORE, ids=list(MORE))
def test_command_line_errors_name_the_override(case: str) -> None:
    argv, expected = MORE[case]
    message = _refused(argv)
    for fragment in expected:
        assert fragment in message, message


def test_a_plain_node_replacing_a_group_is_still_checked_against_its_target() -> None:
    # ~optim drops the typed node: the keywords handed to torch are still checked against torch's signature.
    plain = ["~optim", "+optim._target_=torch.optim.LBFGS", "+optim._partial_=true"]
    check_overrides([*plain, "+optim.lr=0.5"])
    assert "LBFGS takes no keyword momentum" in _refused([*plain, "+optim.momentum=0.5"])


def test_the_sync_schemas_choices_are_the_strategies_own() -> None:
    # A choice is declared once, where the strategy names it in its constructor's annotation; the
    # schema uses that very declaration.
    from trainer.sync.bucketed import BucketedSync
    from trainer.sync.ddp import DDPSync
    from trainer.sync.ddp_hooks import CommHook
    from trainer.sync.flat import Collective
    from trainer.sync.fsdp import FSDPSync
    from trainer.sync.fsdp_units import Wrap
    from trainer.sync.manual import ManualSync

    def choices(cls: type, name: str) -> tuple[object, ...]:
        return typing.get_args(typing.get_type_hints(cls.__init__)[name])

    assert choices(ManualSync, "collective") == choices(BucketedSync, "collective") == typing.get_args(Collective)
    assert choices(DDPSync, "comm_hook") == typing.get_args(CommHook)
    assert choices(FSDPSync, "wrap") == typing.get_args(Wrap)
