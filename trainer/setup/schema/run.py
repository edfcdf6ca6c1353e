"""Schemas of conf/schedule/, conf/trainer/ and conf/logger/ options, registered under OPTIONS."""

from __future__ import annotations

from dataclasses import dataclass, field

from trainer.logger.wandb import MODES as WANDB_MODES
from trainer.reliability.fault import KINDS as FAULT_KINDS
from trainer.setup.schema.spec import SEED_BOUND, key
from trainer.setup.settings import DEVICES, NONFINITE, PRECISIONS


@dataclass
class ScheduleConfig:
    _target_: str = key(nonempty=True)


@dataclass
class WarmupCosineConfig(ScheduleConfig):
    warmup_steps: int = key(ge=0, note="not longer than trainer.max_steps")
    min_lr_ratio: float = key(ge=0, le=1)


@dataclass
class FaultConfig:
    _target_: str = key(nonempty=True)
    rank: int | None = key(ge=0, note="null: off")
    at_step: int | None = key(ge=1, note="null: off")
    kind: str = key(choices=FAULT_KINDS)


@dataclass
class TrainerConfig:
    _target_: str = key(nonempty=True)
    max_steps: int | None = key(ge=0, note="null: train trainer.num_epochs")
    num_epochs: int | None = key(ge=1)
    seed: int = key(ge=0, lt=SEED_BOUND)
    log_every_n_steps: int = key(ge=1)
    eval_every_n_steps: int = key(ge=0, note="0: only at the end")
    grad_accum_steps: int = key(ge=1)
    device: str = key(choices=DEVICES)
    precision: str = key(choices=PRECISIONS)
    collective_timeout_s: float = key(gt=0)
    progress_bar: bool = key()
    profile: bool = key()
    checkpoint_every_n_steps: int = key(ge=0, note="0: only at the end")
    keep_checkpoints: int = key(ge=1)
    resume: str = key(nonempty=True, note="auto, never, or the path of a checkpoint file")
    checkpoint_on_sigterm: bool = key()
    on_nonfinite: str = key(choices=NONFINITE)
    check_replicas_every_n_steps: int = key(ge=0, note="0: off")
    compile: bool = key(note="torch.compile the model before the sync strategy wraps it")
    peak_tflops: float | None = key(gt=0, note="the device's peak for perf/mfu; null: a table on CUDA, none on CPU")
    fault: FaultConfig = field(default_factory=FaultConfig)


@dataclass
class LoggerConfig:
    _target_: str = key(nonempty=True)


@dataclass
class WandbConfig(LoggerConfig):
    mode: str = key(choices=WANDB_MODES, note="also from the WANDB_MODE environment variable")
    project: str = key(nonempty=True)
    entity: str | None = key(note="null: your W&B default")


SCHEDULES: dict[str, type] = {"constant": ScheduleConfig, "warmup_cosine": WarmupCosineConfig}
TRAINERS: dict[str, type] = {"default": TrainerConfig}
LOGGERS: dict[str, type] = {"wandb": WandbConfig, "none": LoggerConfig}
