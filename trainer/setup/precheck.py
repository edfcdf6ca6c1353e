"""The command line checked before Hydra's app starts: one line naming the key, exit 2, nothing written.

train.py calls check_command_line() on every rank before @hydra.main, which would create the run
dir and .hydra/ first. It composes what Hydra will compose (every value of a sweep too), so that a
bad override, a value of the wrong type (OmegaConf, against trainer/setup/schema/) or out of range
(pydantic, through trainer/setup/validate.py) stops every rank alike before the process group, a logger or a file
exists. Rank 0 prints the message; the other ranks wait for its word, then exit the same way.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import difflib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch.distributed as dist
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from trainer.errors import ConfigError, from_leaves
from trainer.setup import config as conf
from trainer.setup.build import instantiate
from trainer.setup.dist import LaunchEnv, job_store, read_launch_env
from trainer.setup.schema.declare import accepted, declared_of
from trainer.setup.validate import accepted_for, validate

EXIT_CODE = 2
RANK_WAIT_S = 30.0  # how long a rank other than 0 waits for rank 0 to report the same error
RANK0_FIRST_S = 5.0


def _compose(overrides: list[str], hydra_cfg: bool = False) -> DictConfig:
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(conf.CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides, return_hydra_config=hydra_cfg)


def _first_line(err: BaseException) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def _parse(overrides: list[str]) -> list[Override]:
    """Each override parsed alone, so a grammar error names the one that failed and what its key takes."""
    parsed = []
    for i, line in enumerate(overrides):
        try:
            parsed += OverridesParser.create().parse_overrides([line])
        except OverrideParseException as err:
            reason = _first_line(err).removeprefix("Error parsing override ")
            others = [o for j, o in enumerate(overrides) if j != i]
            hint = _accepted_quietly(others, _key(line))
            raise ConfigError(f"{line} cannot be parsed ({reason}){'; ' + hint if hint else ''}") from None
    return parsed


def _accepted_quietly(overrides: list[str], key: str) -> str | None:
    """What key accepts under these overrides' group choices, or None if that cannot be told."""
    cfg = _compose_choices(overrides)
    return accepted_for(cfg, key) if cfg is not None else None


def _variants(parsed: list[Override], multirun: bool) -> Iterator[list[str]]:
    """The override lists to check: the first job's, then each other value of each sweep once."""
    fixed = [o.input_line or "" for o in parsed if not o.is_sweep_override()]
    sweeps = [(o, [_single(o, v) for v in o.sweep_string_iterator()]) for o in parsed if o.is_sweep_override()]
    if sweeps and not multirun:
        return  # Hydra itself refuses a sweep without --multirun, saying so
    first = fixed + [values[0] for _, values in sweeps]
    yield first
    for i, (_, values) in enumerate(sweeps):
        for value in values[1:]:
            yield [*first[: len(fixed) + i], value, *first[len(fixed) + i + 1 :]]


def _single(override: Override, value: str) -> str:
    prefix = "+" if override.is_add() else "++" if override.is_force_add() else ""
    package = f"@{override.package}" if override.package else ""
    return f"{prefix}{override.key_or_group}{package}={value}"


def explain_compose_error(err: BaseException, overrides: list[str]) -> ConfigError:
    """Hydra's or OmegaConf's compose error as one ConfigError line naming the key and what it accepts."""
    if isinstance(err, ConfigError):
        return err
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, option = str(err.missing_cfg_file).rpartition("/")
        options = sorted(p.stem for p in (conf.CONF_DIR / group).glob("*.yaml"))
        if options:
            close = difflib.get_close_matches(option, options, n=1)
            near = f" (did you mean {group}={close[0]}?)" if close else ""
            return ConfigError(f"{group}={option} is not an option of {group}{near}: accepted: {', '.join(options)}")
    not_listed = re.match(r"Could not override '([\w/]+)'\. No match in the defaults list", _first_line(err))
    if not_listed and (conf.CONF_DIR / not_listed[1]).is_dir():  # e.g. strategy: in no default, so it is added
        group = not_listed[1]
        line = next((o for o in overrides if _key(o) == group), f"{group}=<option>")
        return ConfigError(
            f"{line} cannot override {group}: the primary config (conf/config.yaml) picks no {group}, so "
            f"add one instead: +{line}"
        )
    cause: BaseException | None = err
    while cause is not None and not (isinstance(cause, OmegaConfBaseException) and cause.full_key):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return ConfigError(_first_line(err))
    full_key = str(cause.full_key)
    key = full_key.split("[")[0]
    given = [o for o in overrides if _key(o) == key]
    value = given[-1].split("=", 1)[1] if given else None
    schema = getattr(cause, "object_type", None)
    unknown = isinstance(cause, (ConfigKeyError, ConfigAttributeError))
    if unknown and not given and isinstance(schema, type) and dataclasses.is_dataclass(schema):
        return ConfigError(  # a YAML (or an experiment) sets a key its schema lacks: a developer's slip
            f"{key} is set in a config file, but its schema {schema.__name__} has no field "
            f"{key.rpartition('.')[2]}: add it in trainer/setup/schema/ (docs/configuration.md, adding a key)"
        )
    if unknown:
        return ConfigError(conf.unknown_key_message(key, _compose_choices(overrides)) or _first_line(cause))
    hint = _accepted_from_schema(cause, full_key)
    if hint is None:  # e.g. an item of a list: compose again without the override to find the key's schema
        hint = _accepted_quietly([o for o in overrides if _key(o) != key], full_key) or "see its YAML's comment"
    what = f"{key}={value}" if value is not None else f"{full_key} ({_first_line(cause)}, set in a config file)"
    return ConfigError(f"{what} is invalid: {hint}")


def _accepted_from_schema(cause: OmegaConfBaseException, full_key: str) -> str | None:
    """What the key accepts, from the schema OmegaConf names in its error (no second compose)."""
    declared = declared_of(getattr(cause, "object_type", None))
    leaf = full_key.rpartition(".")[2]
    if declared is None or "[" in leaf:
        return None
    known = any(f.name == leaf for f in dataclasses.fields(declared))
    return accepted(declared, leaf) if known else None


def _compose_choices(overrides: list[str]) -> DictConfig | None:
    """The config with only these overrides' group choices (sync=fsdp), or None if even that fails."""
    try:
        return _compose([o for o in overrides if "=" in o and "." not in _key(o)])
    except Exception:
        return None


def check_overrides(argv: list[str]) -> None:
    """Raise ConfigError if anything the command line would run is bad input (train.py's arguments)."""
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return  # Hydra's own flags (--help, --cfg, --config-name, ...): Hydra handles the command line
    stamp = os.environ.get(conf.RUN_STAMP_ENV)
    conf.set_run_stamp(stamp or "precheck")  # so run_name resolves, if anything asks; the real one comes later
    try:
        overrides = [a for a in argv if not a.startswith("-")]
        multirun = len(overrides) != len(argv)
        for variant in _variants(_parse(overrides), multirun):
            _check(variant, multirun)
    finally:
        if stamp is None:
            del os.environ[conf.RUN_STAMP_ENV]


def _check(overrides: list[str], multirun: bool) -> None:
    """Compose and validate one job's overrides (and, under -m, each value its experiment sweeps)."""
    try:
        cfg = _compose(overrides, hydra_cfg=multirun)
        swept: list[str] = []
        if multirun:  # an experiment's own sweep (hydra.sweeper.params): each value too
            node = cfg.hydra.sweeper.get("params")
            params: dict[str, Any] = OmegaConf.to_container(node) if node else {}  # type: ignore[assignment]
            swept = [f"{k}={v}" for k, v in params.items() if not any(_key(o) == _key(str(k)) for o in overrides)]
            with open_dict(cfg):
                del cfg["hydra"]
        if not swept:
            _validate(cfg)
    except Exception as err:
        raise explain_compose_error(err, overrides) from None
    for variant in _variants(_parse(swept), multirun=True) if swept else ():
        _check([*overrides, *variant], multirun=False)


def _validate(cfg: DictConfig) -> None:
    validate(cfg)
    # The constructors that cost nothing run too, so their own checks also come before any file.
    for group in ("trainer", "data", "sync"):
        instantiate(cfg[group])


def rank0_signal(store: dist.Store, env: LaunchEnv) -> Callable[[bool], bool]:
    """Rank 0's word that it has reported the job's bad input, through the job's store."""
    key = f"ddplab/{env.run_id}/attempt-{env.restart_count}/config-error"

    def signal(publish: bool) -> bool:
        if publish:
            store.set(key, "reported")
            return True
        try:
            store.wait([key], dt.timedelta(seconds=RANK_WAIT_S))
        except Exception:  # timed out, or rank 0 and torchrun's store are gone: report it here
            return False
        return True

    return signal


def check_command_line(argv: list[str], rank: int, wait_for_rank0: Callable[[bool], bool] | None = None) -> None:
    """On bad input: rank 0 prints one line and exits 2; the others exit 2 once rank 0 has said so.

    wait_for_rank0(publish: bool) -> bool publishes (rank 0) or awaits (other ranks) rank 0's
    word through the job's store; without it every rank prints for itself.
    """
    try:
        with from_leaves():
            check_overrides(argv)
    except ConfigError as error:
        err = " ".join(str(error).split())  # one line, whatever the message
        if rank == 0 or wait_for_rank0 is None:
            print(f"configuration error: {err}", file=sys.stderr, flush=True)
            if wait_for_rank0 is not None:
                wait_for_rank0(True)
        elif not wait_for_rank0(False):  # rank 0 did not fail the same way: say it here
            print(f"[rank{rank}] configuration error: {err}", file=sys.stderr, flush=True)
        else:
            # Let rank 0 exit first, so torchrun's report names it (exit code 2, the rank that printed)
            # as the first failure; torchrun then stops this rank, or it exits 2 itself.
            time.sleep(RANK0_FIRST_S)
        raise SystemExit(EXIT_CODE) from None


def prints_bad_input_error() -> bool:
    """For a bad-input error found inside the app (e.g. SyncBatchNorm on CPU, a missing data root):
    whether this rank prints it. Rank 0 does and says so through the job's store; the others stay
    quiet once rank 0 has spoken (they print their own if it has not: their error may be theirs alone).
    """
    launch = read_launch_env()
    if launch.world_size == 1:
        return True
    word = rank0_signal(job_store(launch), launch)
    if launch.rank == 0:
        return word(True)
    if not word(False):
        return True
    time.sleep(RANK0_FIRST_S)  # rank 0 exits first, so torchrun's report names it
    return False
