"""The trainer's own knobs (conf/trainer/default.yaml), as a typed record.

Its values are checked once, by the schema (trainer/setup/schema/run.py's TrainerConfig, through
trainer/setup/validate.py), before it is built: it trusts them. Tests build it directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from trainer.reliability.fault import Fault

Device = Literal["auto", "cpu", "cuda"]
Precision = Literal["fp32", "bf16", "fp16"]  # autocast; fp16 with a gradient scaler
CheckpointFormat = Literal["full", "sharded"]  # one file from rank 0; or a part per rank (torch.distributed.checkpoint)
OnNonfinite = Literal["raise", "skip"]


@dataclass(frozen=True)
class TrainSettings:
    """How long to train, how often to log and evaluate, and where and in what precision."""

    max_steps: int | None = 300  # optimizer steps; with num_epochs too, whichever ends first
    num_epochs: int | None = None
    seed: int = 0
    log_every_n_steps: int = 10
    time_comm_every_n_steps: int = 10  # the communication object stamps 1 step in n (0: none)
    eval_every_n_steps: int = 100  # 0: evaluate only at the end
    eval_max_samples: int | None = None  # the val split's first n samples (all if fewer); None: the whole split
    grad_accum_steps: int = 1  # micro-batches of data.batch_size per optimizer step
    global_batch_size: int | None = None  # samples per step on all ranks: sets data.batch_size at any world size
    max_grad_norm: float | None = None  # clip the averaged gradient's global L2 norm to this; None: off
    device: Device = "auto"
    precision: Precision = "fp32"
    collective_timeout_s: float = 300.0
    progress_bar: bool = True
    profile: bool = False  # torch.profiler trace of a few steps per rank, in <run dir>/profiler/
    checkpoint_every_n_steps: int = 0  # 0: only at the end
    keep_checkpoints: int = 3  # step-<n>.pt files (or step-<n>/ dirs) kept; last.pt (last) points at the newest
    checkpoint_format: CheckpointFormat = "full"
    checkpoint_async: bool = False  # sharded only: the save is written off the step path (DCP's async save)
    resume: str = "auto"  # auto: from <run dir>/checkpoints/last.pt if present; never; or a path
    checkpoint_on_sigterm: bool = False  # when every rank is stopped at the same step boundary
    on_nonfinite: OnNonfinite = "raise"  # skip: skip the optimizer step on all ranks alike
    check_replicas_every_n_steps: int = 100  # 0: off; strategies that let replicas differ skip it
    compile: bool = False  # torch.compile the model (in place) before the sync strategy wraps it
    peak_tflops: float | None = None  # the device's peak, for perf/mfu; null: a known CUDA GPU's, else no MFU
    fault: Fault = field(default_factory=Fault)  # testing aid: fail one rank on purpose
