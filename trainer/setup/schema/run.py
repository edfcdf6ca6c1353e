"""Schemas of conf/schedule/, conf/trainer/ and conf/logger/ options, registered under OPTIONS."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated

from omegaconf import MISSING
from pydantic import Field

from trainer.logger.wandb import Mode as WandbMode
from trainer.reliability.fault import Kind as FaultKind
from trainer.setup.schema.declare import SEED_BOUND, NonEmpty, Schema
from trainer.setup.settings import CheckpointFormat, Device, OnNonfinite, Precision


@dataclass
class ScheduleConfig(Schema):
    _target_: NonEmpty = MISSING


@dataclass
class WarmupCosineConfig(ScheduleConfig):
    warmup_steps: Annotated[int, Field(ge=0, description="not longer than trainer.max_steps")] = MISSING
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = MISSING


@dataclass
class FaultConfig(Schema):
    _target_: NonEmpty = MISSING
    rank: Annotated[int | None, Field(ge=0, description="null: off")] = MISSING
    at_step: Annotated[int | None, Field(ge=1, description="null: off")] = MISSING
    kind: FaultKind = MISSING


@dataclass
class TrainerConfig(Schema):
    _target_: NonEmpty = MISSING
    max_steps: Annotated[int | None, Field(ge=0, description="null: train trainer.num_epochs")] = MISSING
    num_epochs: Annotated[int | None, Field(ge=1)] = MISSING
    seed: Annotated[int, Field(ge=0, lt=SEED_BOUND)] = MISSING
    log_every_n_steps: Annotated[int, Field(ge=1)] = MISSING
    time_comm_every_n_steps: Annotated[
        int, Field(ge=0, description="every collective is timed on one step in this many; 0: none")
    ] = MISSING
    eval_every_n_steps: Annotated[int, Field(ge=0, description="0: only at the end")] = MISSING
    eval_max_samples: Annotated[
        int | None, Field(ge=1, description="the validation split's first n samples; null: the whole split")
    ] = MISSING
    grad_accum_steps: Annotated[int, Field(ge=1)] = MISSING
    global_batch_size: Annotated[
        int | None, Field(ge=1, description="sets data.batch_size to it / (ranks × grad_accum_steps); null: off")
    ] = MISSING
    max_grad_norm: Annotated[
        float | None, Field(gt=0, description="the averaged gradient's global L2 norm is clipped to it; null: off")
    ] = MISSING
    device: Device = MISSING
    precision: Precision = MISSING
    collective_timeout_s: Annotated[float, Field(gt=0)] = MISSING
    progress_bar: bool = MISSING
    profile: bool = MISSING
    checkpoint_every_n_steps: Annotated[int, Field(ge=0, description="0: only at the end")] = MISSING
    keep_checkpoints: Annotated[int, Field(ge=1)] = MISSING
    checkpoint_format: CheckpointFormat = MISSING
    checkpoint_async: bool = MISSING
    resume: Annotated[str, Field(min_length=1, description="auto, never, or the path of a checkpoint file")] = MISSING
    checkpoint_on_sigterm: bool = MISSING
    on_nonfinite: OnNonfinite = MISSING
    check_replicas_every_n_steps: Annotated[int, Field(ge=0, description="0: off")] = MISSING
    compile: Annotated[bool, Field(description="torch.compile the model before the sync strategy wraps it")] = MISSING
    peak_tflops: Annotated[
        float | None,
        Field(gt=0, description="the device's peak for perf/mfu; null: a table on CUDA, none on CPU"),
    ] = MISSING
    fault: FaultConfig = field(default_factory=FaultConfig)


@dataclass
class LoggerConfig(Schema):
    _target_: NonEmpty = MISSING


@dataclass
class WandbConfig(LoggerConfig):
    mode: Annotated[WandbMode, Field(description="also from the WANDB_MODE environment variable")] = MISSING
    project: NonEmpty = MISSING
    entity: Annotated[str | None, Field(description="null: your W&B default")] = MISSING


SCHEDULES: dict[str, type] = {"constant": ScheduleConfig, "warmup_cosine": WarmupCosineConfig}
TRAINERS: dict[str, type] = {"default": TrainerConfig}
LOGGERS: dict[str, type] = {"wandb": WandbConfig, "none": LoggerConfig}
