"""The trainer's own knobs (conf/trainer/default.yaml), as a typed record."""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Literal

from trainer.errors import ConfigError, check, is_int, is_number
from trainer.reliability.fault import Fault

Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16"]  # autocast
OnNonfinite = Literal["raise", "skip"]
DEVICES: tuple[str, ...] = typing.get_args(Device)
PRECISIONS: tuple[str, ...] = typing.get_args(Precision)
NONFINITE: tuple[str, ...] = typing.get_args(OnNonfinite)


@dataclass(frozen=True)
class TrainSettings:
    """How long to train, how often to log and evaluate, and where and in what precision."""

    max_steps: int | None = 300  # optimizer steps; with num_epochs too, whichever ends first
    num_epochs: int | None = None
    seed: int = 0
    log_every_n_steps: int = 10
    eval_every_n_steps: int = 100  # 0: evaluate only at the end
    grad_accum_steps: int = 1  # micro-batches of data.batch_size per optimizer step
    device: Device = "auto"
    precision: Precision = "fp32"
    collective_timeout_s: float = 300.0
    progress_bar: bool = True
    profile: bool = False  # torch.profiler trace of a few steps per rank, in <run dir>/profiler/
    checkpoint_every_n_steps: int = 0  # 0: only at the end
    keep_checkpoints: int = 3  # step-<n>.pt files kept (last.pt always points at the newest)
    resume: str = "auto"  # auto: from <run dir>/checkpoints/last.pt if present; never; or a path
    checkpoint_on_sigterm: bool = False  # when every rank is stopped at the same step boundary
    on_nonfinite: OnNonfinite = "raise"  # skip: skip the optimizer step on all ranks alike
    check_replicas_every_n_steps: int = 100  # 0: off; strategies that let replicas differ skip it
    compile: bool = False  # torch.compile the model (in place) before the sync strategy wraps it
    peak_tflops: float | None = None  # the device's peak, for perf/mfu; null: a known CUDA GPU's, else no MFU
    fault: Fault = field(default_factory=Fault)  # testing aid: fail one rank on purpose

    def __post_init__(self) -> None:
        # Checked once, at start-up on every rank alike, before any collective can be waiting.
        check(
            self.max_steps is None or (is_int(self.max_steps) and self.max_steps >= 0),
            "trainer.max_steps",
            self.max_steps,
            "must be an integer >= 0, or null to train trainer.num_epochs",
        )
        check(
            self.num_epochs is None or (is_int(self.num_epochs) and self.num_epochs >= 1),
            "trainer.num_epochs",
            self.num_epochs,
            "must be an integer >= 1, or null",
        )
        if self.max_steps is None and self.num_epochs is None:
            raise ConfigError("trainer.max_steps and trainer.num_epochs are both null: set at least one")
        check(is_int(self.seed), "trainer.seed", self.seed, "must be an integer")
        check(
            is_int(self.log_every_n_steps) and self.log_every_n_steps >= 1,
            "trainer.log_every_n_steps",
            self.log_every_n_steps,
            "must be an integer >= 1",
        )
        check(
            is_int(self.eval_every_n_steps) and self.eval_every_n_steps >= 0,
            "trainer.eval_every_n_steps",
            self.eval_every_n_steps,
            "must be an integer >= 0 (0: only at the end)",
        )
        check(
            is_int(self.grad_accum_steps) and self.grad_accum_steps >= 1,
            "trainer.grad_accum_steps",
            self.grad_accum_steps,
            "must be an integer >= 1",
        )
        check(self.device in DEVICES, "trainer.device", self.device, f"accepted: {', '.join(DEVICES)}")
        check(self.precision in PRECISIONS, "trainer.precision", self.precision, f"accepted: {', '.join(PRECISIONS)}")
        check(
            is_int(self.checkpoint_every_n_steps) and self.checkpoint_every_n_steps >= 0,
            "trainer.checkpoint_every_n_steps",
            self.checkpoint_every_n_steps,
            "must be an integer >= 0 (0: only at the end)",
        )
        check(
            is_int(self.keep_checkpoints) and self.keep_checkpoints >= 1,
            "trainer.keep_checkpoints",
            self.keep_checkpoints,
            "must be an integer >= 1",
        )
        check(
            isinstance(self.resume, str) and self.resume != "",
            "trainer.resume",
            self.resume,
            "accepted: auto, never, or the path of a checkpoint file",
        )
        check(
            self.on_nonfinite in NONFINITE,
            "trainer.on_nonfinite",
            self.on_nonfinite,
            f"accepted: {', '.join(NONFINITE)}",
        )
        check(
            is_int(self.check_replicas_every_n_steps) and self.check_replicas_every_n_steps >= 0,
            "trainer.check_replicas_every_n_steps",
            self.check_replicas_every_n_steps,
            "must be an integer >= 0 (0: off)",
        )
        check(isinstance(self.compile, bool), "trainer.compile", self.compile, "accepted: true, false")
        check(
            self.peak_tflops is None or (is_number(self.peak_tflops) and self.peak_tflops > 0),
            "trainer.peak_tflops",
            self.peak_tflops,
            "must be a number of TFLOP/s > 0 (this device's peak, for perf/mfu), or null",
        )
        check(
            is_number(self.collective_timeout_s) and self.collective_timeout_s > 0,
            "trainer.collective_timeout_s",
            self.collective_timeout_s,
            "must be a number of seconds > 0",
        )
