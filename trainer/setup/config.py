"""The boundary between Hydra/OmegaConf and plain Python.

Everything past this module gets plain dicts and typed constructor arguments; only this module,
trainer/setup/build.py, train.py and the tests handle DictConfig.
"""

from __future__ import annotations

import difflib
import os
import sys
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainer.setup import schema
from trainer.setup.dist import read_launch_env

RUN_STAMP_ENV = "DDPLAB_RUN_STAMP"


def set_run_stamp(stamp: str) -> None:
    """Publish the agreed run stamp; child processes (submitit tasks, launchers) inherit it."""
    os.environ[RUN_STAMP_ENV] = stamp


def _run_stamp() -> str:
    if RUN_STAMP_ENV not in os.environ:
        raise RuntimeError(f"{RUN_STAMP_ENV} is not set: train.py sets it before Hydra runs (or set run_name=...)")
    return os.environ[RUN_STAMP_ENV]


def _rank() -> int:
    return read_launch_env().rank


# Registered on import, and evaluated lazily in whichever process resolves them: a submitit task
# resolves the run dir and its log file name itself, from its own environment.
OmegaConf.register_new_resolver("ddplab.run_stamp", _run_stamp, replace=True)
OmegaConf.register_new_resolver("ddplab.rank", _rank, replace=True)
# Every rank logs to its own file; only rank 0 talks on the console unless something is wrong.
OmegaConf.register_new_resolver("ddplab.console_level", lambda: "INFO" if _rank() == 0 else "WARNING", replace=True)
# Only global rank 0 writes Hydra's .hydra/ files; the others would race it for the same paths.
OmegaConf.register_new_resolver("ddplab.hydra_subdir", lambda: ".hydra" if _rank() == 0 else None, replace=True)


schema.register()  # the typed schemas every conf/<group>/<option>.yaml names in its defaults

CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def compose_config(overrides: list[str], run_stamp: str = "composed") -> DictConfig:
    """The config train.py would see for these overrides, without running Hydra's app (tests, benchmarks)."""
    from hydra import compose, initialize_config_dir

    set_run_stamp(os.environ.get(RUN_STAMP_ENV, run_stamp))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain containers: for W&B, checkpoints and summaries."""
    mark_job_started()
    return OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)  # type: ignore[return-value]


def run_dir() -> Path:
    """This job's output directory: hydra.run.dir, or <sweep dir>/<job num> under -m."""
    return Path(HydraConfig.get().runtime.output_dir)


def job_num() -> int:
    """The multirun job number (0 for a single run): part of each job's store prefix and W&B group."""
    hydra_cfg = HydraConfig.get()
    return int(hydra_cfg.job.num) if hydra_cfg.mode == RunMode.MULTIRUN else 0


def job_identity() -> tuple[int, tuple[str, ...]]:
    """The multirun job number and its overrides: what every rank must agree it is running."""
    return job_num(), tuple(HydraConfig.get().overrides.task)


def job_name(run_name: str) -> str:
    """The W&B group of this job's runs: the run name, plus the job number under multirun."""
    hydra_cfg = HydraConfig.get()
    return f"{run_name}-{hydra_cfg.job.num}" if hydra_cfg.mode == RunMode.MULTIRUN else run_name


_job_started = False


def mark_job_started() -> None:
    global _job_started
    _job_started = True


def job_started() -> bool:
    """False while Hydra is still parsing the command line: an exit then is Hydra rejecting it."""
    return _job_started


def explain_overrides(overrides: list[str], config_dir: Path) -> None:
    """After Hydra has rejected the command line, name the accepted keys next to a misspelt one.

    Hydra says "Key 'max_step' is not in struct" but not which keys exist; this composes the
    config with the same group choices and prints the keys at that level and the closest match.
    It only ever adds a hint to a failure Hydra already reported, so it can never block a run.
    """
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not o.startswith("-")])
    except Exception:
        return  # a syntax error: Hydra's own message is the right one
    groups = {p.name for p in config_dir.iterdir() if p.is_dir()}
    choices = [
        o.input_line
        for o in parsed
        if o.key_or_group in groups and not o.is_sweep_override() and o.input_line is not None
    ]
    plain = [o for o in parsed if not (o.is_add() or o.is_force_add() or o.is_delete())]
    keys = [o.key_or_group for o in plain if "." in o.key_or_group and not o.key_or_group.startswith("hydra.")]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(config_dir.resolve()), version_base="1.3"):
            cfg = compose("config", overrides=choices)
    except Exception:
        return
    for key in keys:
        message = unknown_key_message(key, cfg)
        if message:
            print(message, file=sys.stderr)


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
    listed = ", ".join(accepted) if accepted else "(none)"
    return f"'{key}' is not a config key.{hint} Keys under '{parent_key}': {listed}."
