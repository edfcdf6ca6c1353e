"""The command line checked before Hydra's app starts: one line naming the key, exit 2, nothing written.

train.py calls check_command_line() on every rank before @hydra.main, which would create the run
dir and .hydra/ first. It composes what Hydra will compose (every value of a sweep too) and
validates it (trainer/setup/validate.py), so that bad input stops every rank alike before the process
group, a logger or a file exists. Rank 0 prints the message; the other ranks wait for its word,
then exit the same way.
"""

from __future__ import annotations

import difflib
import os
import re
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import hydra
import torch
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.core.override_parser.types import Override
from hydra.errors import MissingConfigException, OverrideParseException
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException

from hydra_plugins.ddplab_torchrun_launcher.config import StartMethod, TorchrunLauncherConf, fork_refusal
from trainer.errors import ConfigError, from_leaves
from trainer.setup import config as conf
from trainer.setup.dist import RANK0_FIRST_S
from trainer.setup.validate import ImportFailed, accepted_for, per_rank_batch, validate

EXIT_CODE = 2


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
            cfg = _compose_choices([o for j, o in enumerate(overrides) if j != i])
            hint = accepted_for(cfg, _key(line)) if cfg is not None else None
            raise ConfigError(f"{line} cannot be parsed ({reason}){'; ' + hint if hint else ''}") from None
    return parsed


def _variants(parsed: list[Override], multirun: bool) -> Iterator[list[str]]:
    """The override lists to check: the first job's, then each other value of each sweep once."""
    fixed = [o.input_line or "" for o in parsed if not o.is_sweep_override()]
    sweeps = [[_single(o, v) for v in o.sweep_string_iterator()] for o in parsed if o.is_sweep_override()]
    if sweeps and not multirun:
        return  # Hydra itself refuses a sweep without --multirun, saying so
    first = fixed + [values[0] for values in sweeps]
    yield first
    for i, values in enumerate(sweeps):
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
            plus = "" if _in_defaults(group) else "+"  # a group the defaults list lacks is added: +strategy=...
            close = difflib.get_close_matches(option, options, n=1)
            near = f" (did you mean {plus}{group}={close[0]}?)" if close else ""
            return ConfigError(
                f"{plus}{group}={option} is not an option of {group}{near}: accepted: {', '.join(options)}"
            )
    not_listed = re.match(r"Could not override '([\w/]+)'\. No match in the defaults list", _first_line(err))
    if not_listed and (conf.CONF_DIR / not_listed[1]).is_dir():  # e.g. strategy: in no default, so it is added
        group = not_listed[1]
        line = next((o for o in overrides if _key(o) == group), f"{group}=<option>")
        options = sorted(p.stem for p in (conf.CONF_DIR / group).glob("*.yaml"))
        option = line.partition("=")[2]
        close = difflib.get_close_matches(option, options, n=1)
        if option in options:
            fix = f": +{group}={option}"
        else:  # and the option is misspelt too: the suggestion must be one that composes
            near = f"did you mean +{group}={close[0]}?" if close else f"+{group}=<option>"
            fix = f" ({near}): accepted: {', '.join(options)}"
        return ConfigError(
            f"{line} cannot override {group}: the primary config (conf/config.yaml) picks no {group}, so "
            f"add one instead{fix}"
        )
    cause: BaseException | None = err
    while cause is not None and not (isinstance(cause, OmegaConfBaseException) and cause.full_key):
        cause = cause.__cause__ or cause.__context__
    if isinstance(cause, (ConfigKeyError, ConfigAttributeError)):  # a key the composed config lacks
        key = str(cause.full_key).split("[")[0]
        choices = _compose_choices(overrides, hydra_cfg=key.startswith("hydra."))
        return ConfigError(unknown_key_message(key, choices) or _first_line(cause))
    line = _first_line(cause or err)
    if isinstance(cause, OmegaConfBaseException) and cause.full_key and str(cause.full_key) not in line:
        line = f"{cause.full_key}: {line}"  # a typed node's refusal (hydra.launcher.*) names no key
    return ConfigError(line)


def _in_defaults(group: str) -> bool:
    """Whether the primary config's defaults list has `group` (null counts): then `group=x` picks an
    option of it, else `+group=x` adds it."""
    return group in _compose([], hydra_cfg=True).hydra.runtime.choices


# Keys that moved: where the reader finds what the old key did.
MOVED = {
    "sync.mixed_precision": "trainer.param_dtype=bf16 (16-bit parameters with an fp32 master copy, FSDP2's "
    "MixedPrecisionPolicy under fsdp and hsdp) and trainer.reduce_dtype",
}


def unknown_key_message(key: str, cfg: DictConfig | None) -> str | None:
    """ "'trainer.max_step' is not a config key. Did you mean trainer.max_steps? Keys under 'trainer': ...", or None.

    The suggestion comes first: it is what the reader needs, the list is for when it is wrong.
    """
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key, default=None) if cfg is not None and parent_key else cfg
    if not isinstance(parent, DictConfig) or leaf in parent:
        return None
    accepted = sorted(str(k) for k in parent if not str(k).startswith("_"))
    close = difflib.get_close_matches(leaf, accepted, n=1)
    hint = f" Did you mean {parent_key}.{close[0]}?" if close else ""
    if key in MOVED:
        hint = f" It moved: {MOVED[key]}."
    listed = ", ".join(accepted) if accepted else "(none)"
    return f"'{key}' is not a config key.{hint} Keys under '{parent_key}': {listed}."


def _compose_choices(overrides: list[str], hydra_cfg: bool = False) -> DictConfig | None:
    """The config with only these overrides' group choices (sync=fsdp), or None if even that fails."""
    try:
        return _compose([o for o in overrides if "=" in o and "." not in _key(o)], hydra_cfg)
    except Exception:
        return None


def check_overrides(argv: list[str], world_size: int | None = None) -> None:
    """Raise ConfigError if anything the command line would run is bad input (train.py's arguments).

    world_size, where the caller knows it (the launcher, a rank), adds the checks that depend on it:
    trainer.global_batch_size must divide into the ranks' micro-batches, and the sync strategy's
    layout of the ranks must fit them (SyncStrategy.check_world_size).
    """
    if any(a.startswith("-") and a not in ("-m", "--multirun") for a in argv):
        return  # Hydra's own flags (--help, --cfg, --config-name, ...): Hydra handles the command line
    stamp = os.environ.get(conf.RUN_STAMP_ENV)
    conf.set_run_stamp(stamp or "precheck")  # so run_name resolves, if anything asks; the real one comes later
    try:
        overrides = [a for a in argv if not a.startswith("-")]
        multirun = len(overrides) != len(argv)
        for variant in _variants(_parse(overrides), multirun):
            _check(variant, multirun, world_size)
    finally:
        if stamp is None:
            del os.environ[conf.RUN_STAMP_ENV]


def _check(overrides: list[str], multirun: bool, world_size: int | None = None) -> None:
    """Compose and validate one job's overrides (and, under -m, each value its experiment sweeps)."""
    try:
        cfg = _compose(overrides, hydra_cfg=multirun)
        swept: list[str] = []
        if multirun:  # an experiment's own sweep (hydra.sweeper.params): each value too
            _check_launcher(cfg.hydra.launcher)
            node = cfg.hydra.sweeper.get("params")
            params: dict[str, Any] = OmegaConf.to_container(node) if node else {}  # type: ignore[assignment]
            swept = [f"{k}={v}" for k, v in params.items() if not any(_key(o) == _key(str(k)) for o in overrides)]
            with open_dict(cfg):
                del cfg["hydra"]
        if not swept:
            validate(cfg)
            global_batch = cfg.trainer.get("global_batch_size")
            if world_size is not None and global_batch is not None:
                per_rank_batch(global_batch, world_size, cfg.trainer.grad_accum_steps)
            if world_size is not None:  # a layout of the ranks (sync.replicate x sync.shard) this many cannot form
                sync = hydra.utils.instantiate(cfg.sync, _convert_="all")
                sync.check_world_size(world_size)
                if not multirun:  # the job's build takes it (trainer/setup/instantiate.py): built once per rank
                    from trainer.setup.instantiate import keep_checked_strategy

                    keep_checked_strategy(cfg.sync, world_size, sync)
    except Exception as err:
        raise explain_compose_error(err, overrides) from None
    for variant in _variants(_parse(swept), multirun=True) if swept else ():
        _check([*overrides, *variant], multirun=False, world_size=world_size)


def _check_launcher(launcher: DictConfig) -> None:
    """hydra/launcher=torchrun's fork where CUDA is available, refused here as one line (the launcher
    refuses it too, for any app, but only once Hydra has started)."""
    if launcher.get("_target_") == TorchrunLauncherConf._target_ and launcher.start_method == StartMethod.fork:
        refusal = fork_refusal(launcher.start_method, torch.cuda.is_available())
        if refusal:
            raise ConfigError(refusal)


def check_command_line(
    argv: list[str], rank: int, wait_for_rank0: Callable[[bool], bool] | None = None, world_size: int | None = None
) -> None:
    """On bad input: rank 0 prints one line and exits 2; the others exit 2 once rank 0 has said so.

    wait_for_rank0(publish: bool) -> bool publishes (rank 0) or awaits (other ranks) rank 0's
    word through the job's store; without it every rank prints for itself.
    """
    try:
        with from_leaves():
            check_overrides(argv, world_size)
    except ConfigError as error:
        err = " ".join(str(error).split())  # one line, whatever the message
        kind = (
            "set-up error" if isinstance(error, ImportFailed) else "configuration error"
        )  # the install's, not a key's
        if rank == 0 or wait_for_rank0 is None:
            print(f"{kind}: {err}", file=sys.stderr, flush=True)
            if wait_for_rank0 is not None:
                wait_for_rank0(True)
        elif not wait_for_rank0(False):  # rank 0 did not fail the same way: say it here
            print(f"[rank{rank}] {kind}: {err}", file=sys.stderr, flush=True)
        else:
            # Let rank 0 exit first, so torchrun's report names it (exit code 2, the rank that printed)
            # as the first failure; torchrun then stops this rank, or it exits 2 itself.
            time.sleep(RANK0_FIRST_S)
        raise SystemExit(EXIT_CODE) from None
