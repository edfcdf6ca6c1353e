"""Instantiate the job's parts from the composed config, in the order they depend on each other."""

from __future__ import annotations

import platform
import random
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import hydra
import numpy as np
import torch
import torch.distributed as dist
from hydra.errors import InstantiationException
from omegaconf import DictConfig
from torch import nn
from torch.optim import Optimizer

from data.base import DataModule
from trainer.errors import ConfigError, from_leaves
from trainer.logger.base import MetricLogger
from trainer.logger.jsonl import JsonlLogger
from trainer.loop.trainer import Trainer
from trainer.setup.dist import DistContext, hostname
from trainer.setup.settings import TrainSettings
from trainer.sync.base import SyncStrategy


def instantiate(node: DictConfig, **runtime: Any) -> Any:
    """hydra.utils.instantiate, with runtime objects bound after Hydra is done with the config.

    Runtime kwargs (shapes, a run's config dict) are passed to the constructor untouched rather
    than merged into the config, where Hydra would try to instantiate any `_target_` inside them.
    Hydra wraps constructor errors in InstantiationException; a constructor's ValueError (the
    leaves' way to reject a value, and ConfigError's base) is let through as a ConfigError, so a bad
    value reads as the constructor's own message, not a framework traceback.
    """
    try:
        with from_leaves():
            if not runtime:
                return hydra.utils.instantiate(node, _convert_="all")
            return hydra.utils.instantiate(node, _partial_=True, _convert_="all")(**runtime)
    except InstantiationException as err:
        if isinstance(err.__cause__, ValueError):
            raise (
                err.__cause__ if isinstance(err.__cause__, ConfigError) else ConfigError(str(err.__cause__))
            ) from None
        raise


def seed_everything(seed: int) -> None:
    """The same seed on every rank: equal initial weights even before any broadcast."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def _version(package: str) -> str:
    """An installed package's version without importing it (importing wandb costs seconds)."""
    try:
        return version(package)
    except PackageNotFoundError:
        return "not installed"


def run_info(ctx: DistContext) -> dict[str, Any]:
    """Facts about this rank that belong next to its config in W&B."""
    return {
        "rank": ctx.rank,
        "local_rank": ctx.local_rank,
        "world_size": ctx.world_size,
        "backend": ctx.backend,
        "device": str(ctx.device),
        "host": hostname(),
        "versions": {"python": platform.python_version(), "torch": torch.__version__, "wandb": _version("wandb")},
    }


def add_loggers(
    loggers: list[MetricLogger], cfg: DictConfig, config: dict[str, Any], ctx: DistContext, run_dir: Path, group: str
) -> None:
    """Every rank: its JSONL file, then its own W&B run (or the null logger).

    Appends as it goes, so whatever was opened gets closed even if a later one fails to start.
    """
    loggers.append(JsonlLogger(run_dir / "metrics" / f"rank{ctx.rank}.jsonl"))
    loggers.append(
        instantiate(
            cfg.logger,
            dir=str(run_dir),
            name=f"rank-{ctx.rank}",
            group=group,
            run_config={**config, "run": run_info(ctx)},
        )
    )


@dataclass
class Parts:
    """The job's swappable objects, built from config before any process group or file exists."""

    data: DataModule
    model: nn.Module
    sync: SyncStrategy
    optimizer_factory: Callable[..., Optimizer]
    schedule_factory: Callable[..., Callable[[int], float]]


def build_parts(cfg: DictConfig, settings: TrainSettings) -> Parts:
    """Run every constructor: a bad value fails here, on every rank alike, before any collective."""
    data = instantiate(cfg.data)
    seed_everything(settings.seed)
    model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
    return Parts(
        data=data,
        model=model,
        sync=instantiate(cfg.sync),
        optimizer_factory=instantiate(cfg.optim),
        schedule_factory=hydra.utils.instantiate(cfg.schedule, _partial_=True, _convert_="all"),
    )


def prepare_data(data: DataModule, ctx: DistContext) -> None:
    """Download once (rank 0), then every rank opens the files: missing ones fail here, named."""
    with from_leaves():
        if ctx.is_main_process:
            data.prepare()
    dist.barrier()  # nobody reads the dataset before rank 0 has finished fetching it
    with from_leaves():
        data.setup()


def build_trainer(
    parts: Parts,
    settings: TrainSettings,
    ctx: DistContext,
    loggers: list[MetricLogger],
    run_dir: Path,
    config: dict[str, Any],
) -> Trainer:
    return Trainer(
        settings=settings,
        ctx=ctx,
        model=parts.model,
        data=parts.data,
        sync=parts.sync,
        optimizer_factory=parts.optimizer_factory,
        schedule_factory=parts.schedule_factory,
        loggers=loggers,
        run_dir=run_dir,
        config=config,
    )
