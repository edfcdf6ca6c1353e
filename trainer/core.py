"""The core types every package of trainer/ may import: the distributed context and the trainer's
settings, declared once. A leaf: it imports nothing from trainer/ but the error type.

TrainSettings is conf/trainer/default.yaml's schema: each key's type, range or choices and meaning,
in pydantic's terms (trainer/setup/validate.py validates the composed config against it, and
docs/configuration.md lists it). Its defaults are the YAML's: the one place they live.
"""

from __future__ import annotations

import socket
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import torch
import torch.distributed as dist
from pydantic import Field

CONF_DIR = Path(__file__).resolve().parents[1] / "conf"  # the Hydra config tree: conf/<group>/<option>.yaml
FaultKind = Literal["crash", "hang", "sigterm", "perturb", "nan_loss", "kill_in_save", "slow", "kill", "desync", "size"]
SEED_BOUND = 2**32  # numpy's seed range; torch's is wider


@dataclass(frozen=True)
class DistContext:
    """A process's rank, device and backend once the process group exists."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    backend: str
    attempt: int = 0  # torchrun's restart count: 0 for the first attempt
    store: dist.Store | None = None  # the process group's store (this job's key prefix)

    @property
    def is_main_process(self) -> bool:
        # Global rank 0, never local rank 0: on two nodes there are two local rank 0s.
        return self.rank == 0


def hostname() -> str:
    return socket.gethostname()


@dataclass(frozen=True)
class Fault:
    """trainer.fault, a testing aid (trainer/reliability/fault.py acts on it): one rank fails on
    purpose at the start of step `at_step` (kind=slow: of every step from it on), in torchrun's first
    attempt only. Off unless both set."""

    rank: Annotated[int | None, Field(ge=0, description="which global rank; null: off")]
    at_step: Annotated[int | None, Field(ge=1, description="at the start of which step (1-based); null: off")]
    kind: FaultKind
    delay_ms: Annotated[float, Field(ge=0, description="kind=slow: what the rank sleeps at the start of each step")]

    @property
    def configured(self) -> bool:
        return self.rank is not None and self.at_step is not None

    def due(self, rank: int, step: int, attempt: int) -> bool:
        """Whether this rank fires at this step (the first attempt only; kind=slow: every step from at_step)."""
        if self.kind == "slow":
            return attempt == 0 and rank == self.rank and self.at_step is not None and step >= self.at_step
        return attempt == 0 and rank == self.rank and step == self.at_step

    def poisons_loss(self, rank: int, step: int, attempt: int) -> bool:
        """kind=nan_loss: this rank's loss (so its gradients, so the averaged ones) becomes NaN."""
        return self.kind == "nan_loss" and self.due(rank, step, attempt)


FAULT_KINDS: tuple[str, ...] = typing.get_args(FaultKind)


@dataclass(frozen=True)
class TrainSettings:
    """How long to train, how often to log and evaluate, and where and in what precision."""

    max_steps: Annotated[int | None, Field(ge=0, description="optimizer steps; null: train num_epochs")]
    num_epochs: Annotated[int | None, Field(ge=1)]  # with max_steps too: whichever ends first
    seed: Annotated[int, Field(ge=0, lt=SEED_BOUND, description="model init and data shuffling")]
    log_every_n_steps: Annotated[int, Field(ge=1, description="a row on every rank; the last step always")]
    sample_every_n_steps: Annotated[
        int, Field(ge=0, description="phases, communication and memory measured on one step in n; 0: none")
    ]
    sample_budget: Annotated[
        float | None,
        Field(gt=0, le=1, description="sample while the samples cost under this share of the run's time; null: always"),
    ]
    sample_max_gap_steps: Annotated[int, Field(ge=1, description="sample at least this often, whatever the budget")]
    eval_every_n_steps: Annotated[int, Field(ge=0, description="0: only at the end")]
    eval_max_samples: Annotated[int | None, Field(ge=1, description="the val split's first n; null: all of it")]
    grad_accum_steps: Annotated[int, Field(ge=1, description="micro-batches per optimizer step")]
    global_batch_size: Annotated[
        int | None, Field(ge=1, description="sets data.batch_size to it / (ranks × grad_accum_steps); null: off")
    ]
    max_grad_norm: Annotated[float | None, Field(gt=0, description="clip the averaged gradient's L2 norm; null: off")]
    device: Literal["auto", "cpu", "cuda"]
    # param_dtype before precision, whose default follows it: a bad value is refused under the key typed
    param_dtype: Annotated[
        Literal["fp32", "bf16", "fp16"],
        Field(description="the parameters forward and backward read, and their gradients; 16-bit: an fp32 master copy"),
    ]
    reduce_dtype: Annotated[
        Literal["fp32", "bf16", "fp16"], Field(description="the gradients' reduction on the wire: fp32 or param_dtype")
    ]
    precision: Annotated[
        Literal["fp32", "bf16", "fp16"], Field(description="bf16 and fp16 autocast; fp16 with a gradient scaler")
    ]
    collective_timeout_s: Annotated[float, Field(gt=0, description="a collective waiting longer fails the job")]
    flight_recorder: Annotated[
        Annotated[int, Field(ge=0, strict=True)] | Literal["auto"],
        Field(description="collectives torch's Flight Recorder keeps per rank (the hang report); 0: off; auto: on CPU"),
    ]
    step_grace_s: Annotated[
        float, Field(gt=0, description="how long SIGTERM or Ctrl-C waits for the step to end before the rank stops")
    ]
    progress_bar: bool
    profile: Annotated[bool, Field(description="a torch.profiler trace of steps 3-5 per rank")]
    checkpoint: Annotated[
        bool, Field(description="false: no checkpoint at all, not at the end either; a restart starts over")
    ]
    checkpoint_every_n_steps: Annotated[int, Field(ge=0, description="0: only at the end")]
    keep_checkpoints: Annotated[int, Field(ge=1, description="step checkpoints kept")]
    checkpoint_format: Annotated[Literal["full", "sharded"], Field(description="sharded: a part per rank (DCP)")]
    checkpoint_async: Annotated[bool, Field(description="sharded only: the write runs off the step path")]
    resume: Annotated[str, Field(min_length=1, description="auto, never, or the path of a checkpoint")]
    checkpoint_on_sigterm: bool
    on_nonfinite: Annotated[Literal["raise", "skip"], Field(description="skip: skip the step on all ranks alike")]
    check_replicas_every_n_steps: Annotated[int, Field(ge=0, description="0: off")]
    compile: Annotated[bool, Field(description="torch.compile the model before the sync strategy wraps it")]
    end_sample_tokens: Annotated[
        int, Field(ge=0, description="tokens of the end-of-run text sample (data with a vocabulary); 0: none")
    ]
    peak_tflops: Annotated[
        float | None, Field(gt=0, description="the device's peak for perf/mfu; null: a table on CUDA, none on CPU")
    ]
    fault: Fault
