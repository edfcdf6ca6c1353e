"""The boundary between Hydra/OmegaConf and plain Python.

Everything past this module gets plain dicts and typed constructor arguments; only this module,
trainer/setup/build.py, train.py and the tests handle DictConfig.
"""

from __future__ import annotations

import copy
import functools
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from trainer.core import CONF_DIR
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


def _job_console_level() -> str:
    """A job's console: rank 0's INFO, except in a sweep, whose own lines say each job's result."""
    sweep = HydraConfig.initialized() and HydraConfig.get().mode == RunMode.MULTIRUN
    return "INFO" if _rank() == 0 and not sweep else "WARNING"


# Registered on import, and evaluated lazily in whichever process resolves them: a submitit task
# resolves the run dir and its log file name itself, from its own environment.
OmegaConf.register_new_resolver("ddplab.run_stamp", _run_stamp, replace=True)
OmegaConf.register_new_resolver("ddplab.rank", _rank, replace=True)
# The ranks per node the launcher reports (torchrun's LOCAL_WORLD_SIZE, submitit's tasks per node; 1
# alone): network=none's gpus_per_node, and so the two-level strategies' default shard.
OmegaConf.register_new_resolver("ddplab.local_world_size", lambda: read_launch_env().local_world_size, replace=True)
# Every rank logs to its own file; only rank 0 talks on the console unless something is wrong.
OmegaConf.register_new_resolver("ddplab.console_level", lambda: "INFO" if _rank() == 0 else "WARNING", replace=True)
OmegaConf.register_new_resolver("ddplab.job_console_level", _job_console_level, replace=True)
# Only global rank 0 writes Hydra's .hydra/ files; the others would race it for the same paths.
OmegaConf.register_new_resolver("ddplab.hydra_subdir", lambda: ".hydra" if _rank() == 0 else None, replace=True)


def compose_config(overrides: list[str], run_stamp: str = "composed") -> DictConfig:
    """The config train.py would see for these overrides, without running Hydra's app (tests, benchmarks)."""
    from hydra import compose, initialize_config_dir

    set_run_stamp(os.environ.get(RUN_STAMP_ENV, run_stamp))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)


def sync_options(context: Sequence[str] = ()) -> dict[str, DictConfig]:
    """conf/sync/'s options by name, in file order, each the sync node train.py would see under
    sync=<name>: composed by Hydra (an option's defaults list, sync=hsdp's fsdp, merged in) with the
    `context` overrides that are not the sync group's (network=1gbe network.gpus_per_node=2), so its
    interpolations (`${network.gpus_per_node}`) resolve as the run's would."""
    others = tuple(o for o in context if o.lstrip("+~").split("=", 1)[0].split(".", 1)[0] != "sync")
    return {name: copy.deepcopy(node) for name, node in _composed_sync_options(others).items()}


@functools.lru_cache(maxsize=8)
def _composed_sync_options(others: tuple[str, ...]) -> dict[str, DictConfig]:
    """sync_options' compositions, once per context in a process (a tool asks several times, and each
    composition costs Hydra ~0.1 s); callers get copies."""
    names = sorted(path.stem for path in (CONF_DIR / "sync").glob("*.yaml"))
    return {name: compose_config([*others, f"sync={name}"]).sync for name in names}


def plain_config(cfg: DictConfig) -> dict[str, Any]:
    """The resolved config as plain containers: for W&B, checkpoints and summaries."""
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
