"""Instantiate the job's parts from the composed config, in the order they depend on each other."""

from __future__ import annotations

import logging
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
from omegaconf import DictConfig, open_dict
from torch import nn
from torch.optim import Optimizer

from data.base import DataModule
from trainer.core import DistContext, TrainSettings, hostname
from trainer.errors import ConfigError, from_leaves
from trainer.logger.base import MetricLogger
from trainer.logger.jsonl import JsonlLogger
from trainer.loop.lm import compiler_missing
from trainer.loop.profiling import ProfiledObserver
from trainer.loop.trainer import Trainer
from trainer.observer import Observer
from trainer.sample_budget import SampleBudget
from trainer.setup.instantiate import checked_strategy, instantiate, optimizer_factory, split_sync_batchnorm
from trainer.setup.validate import check_group, check_pairing, per_rank_batch
from trainer.sync.base import SyncStrategy
from trainer.sync.comm import Comm
from trainer.sync.master import DTYPES
from trainer.sync.network import EmulatedLink

log = logging.getLogger(__name__)


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
    """Every rank: its JSONL file, then its own W&B run (or the null logger), the same run on a
    restart or resume (its id comes from the run dir and the rank).

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
            rank=ctx.rank,  # with the run dir, names this rank's W&B run for every attempt of the job
        )
    )


@dataclass
class Parts:
    """The job's swappable objects, built from config before any process group or file exists."""

    settings: TrainSettings  # the trainer's keys, validated
    data: DataModule
    model: nn.Module
    sync: SyncStrategy
    optimizer_factory: Callable[..., Optimizer]
    schedule_factory: Callable[..., Callable[[int], float]]
    sync_batchnorm: bool = False  # model.sync_batchnorm: applied by build_trainer, once the device is known
    compile: bool = False  # trainer.compile: needs a compiler where the device is CPU
    link: EmulatedLink | None = None  # network=<preset>: handed to the strategy by build_trainer


def build_parts(cfg: DictConfig, world_size: int = 1) -> Parts:
    """Run every constructor once, on the composed config train.py validated before Hydra's app
    started (trainer/setup/precheck.py); the trainer's keys become TrainSettings here. A value the
    schema cannot see (a data file, a model's shape) fails in its constructor, named, on every rank
    alike, before any collective."""
    settings: TrainSettings = check_group(cfg.trainer, "trainer")
    check_pairing(cfg)  # the model and the data read the same kind of sample: before either is built
    if settings.global_batch_size is not None:
        with open_dict(cfg):
            cfg.data.batch_size = per_rank_batch(settings.global_batch_size, world_size, settings.grad_accum_steps)
        log.info(
            "trainer.global_batch_size=%d: data.batch_size=%d on %d rank(s) x %d micro-batch(es)",
            settings.global_batch_size,
            cfg.data.batch_size,
            world_size,
            settings.grad_accum_steps,
        )
    data = instantiate(cfg.data)
    seed_everything(settings.seed)
    model_node, sync_batchnorm = split_sync_batchnorm(cfg.model)
    model = instantiate(model_node, input_shape=data.input_shape, num_classes=data.num_classes)
    if sync_batchnorm and not has_batchnorm(model):
        raise ConfigError(
            f"model.sync_batchnorm=true but {cfg.model._target_} has no BatchNorm layer to synchronise; "
            "set model.batchnorm=true (cnn) or use model=resnet18, or set model.sync_batchnorm=false"
        )
    # The one the rank's command-line check built, if it did (tools and tests build without it)
    sync = checked_strategy(cfg.sync, world_size)
    return Parts(
        settings=settings,
        data=data,
        model=model,
        sync_batchnorm=sync_batchnorm,
        compile=settings.compile,
        sync=sync,
        optimizer_factory=optimizer_factory(cfg.optim),
        schedule_factory=hydra.utils.instantiate(cfg.schedule, _partial_=True, _convert_="all"),
        link=instantiate(cfg.network).link(world_size),
    )


def has_batchnorm(model: nn.Module) -> bool:
    """Whether convert_sync_batchnorm would find anything: it replaces every _BatchNorm."""
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def check_device(parts: Parts, device: torch.device) -> None:
    """What the parts need of the device, checked as soon as it is known (train.py), before the
    process group, the loggers and the W&B runs exist."""
    if parts.sync_batchnorm:
        _refuse_sync_batchnorm_on_cpu(device)
    if parts.link is not None and device.type != "cpu":
        raise ConfigError(
            f"network={parts.link.describe()!r} cannot run on {device}: the emulated link times collectives "
            "with host clocks, which NCCL's asynchronous kernels outrun; accepted: network=none, or trainer.device=cpu"
        )
    missing = compiler_missing(device) if parts.compile else None
    if missing:
        raise ConfigError(
            f"trainer.compile=true cannot run on {device}: {missing}; install one, or set trainer.compile=false"
        )
    refuses = parts.sync.refuses(parts.settings)
    if refuses:
        raise ConfigError(refuses)


def _refuse_sync_batchnorm_on_cpu(device: torch.device) -> None:
    """torch's SyncBatchNorm raises in its first training forward on CPU whenever a process group is
    initialised, even one of world size 1 (and train.py always starts one): refuse that with the key
    and the fixes, rather than with torch's message mid-step."""
    if device.type == "cpu":
        raise ConfigError(
            f"model.sync_batchnorm=true cannot run on {device}: torch's SyncBatchNorm only supports CUDA "
            "tensors once a process group exists (at any world size); use trainer.device=cuda, or "
            "model.sync_batchnorm=false (each rank then normalises with its own batch's statistics)"
        )


def convert_sync_batchnorm(model: nn.Module, device: torch.device) -> nn.Module:
    """BatchNorm layers that normalise with the statistics of the whole global batch, on every rank.

    Parameters and buffers keep their names, so checkpoints load either way.
    """
    _refuse_sync_batchnorm_on_cpu(device)
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def prepare_data(data: DataModule, ctx: DistContext) -> None:
    """Download once (rank 0), then every rank opens the files: missing ones fail here, named."""
    with from_leaves():
        if ctx.is_main_process:
            data.prepare()
    dist.barrier()  # nobody reads the dataset before rank 0 has finished fetching it
    with from_leaves():
        data.setup()


def build_trainer(
    parts: Parts, ctx: DistContext, loggers: list[MetricLogger], run_dir: Path, config: dict[str, Any]
) -> Trainer:
    """The Trainer over the parts, resumed from a checkpoint where trainer.resume finds one."""
    model = convert_sync_batchnorm(parts.model, ctx.device) if parts.sync_batchnorm else parts.model
    network = None if parts.link is None else parts.link.describe()  # the sync line names it
    # Before the trainer's wrap(): ddp registers its hook, zero picks its collectives, with the link known.
    # The one instrument; a profiled run's also keeps each profiled step's phases for the trace.
    settings = parts.settings
    budget = SampleBudget(settings.sample_budget, settings.sample_max_gap_steps)
    observer = (ProfiledObserver if settings.profile else Observer)(
        ctx.device, settings.sample_every_n_steps, emulated=parts.link is not None, budget=budget
    )
    # trainer.reduce_dtype: a gradient reduction in another dtype than its buffer's runs on a copy
    reduce_dtype = DTYPES[parts.settings.reduce_dtype] if parts.settings.param_dtype != "fp32" else None
    parts.sync.comm = Comm(parts.link, observer, reduce_dtype)
    trainer = Trainer(
        settings=parts.settings,
        ctx=ctx,
        model=model,
        data=parts.data,
        sync=parts.sync,
        optimizer_factory=parts.optimizer_factory,
        schedule_factory=parts.schedule_factory,
        loggers=loggers,
        run_dir=run_dir,
        config=config,
        network=network,
    )
    trainer.resume_from_checkpoint()
    return trainer
