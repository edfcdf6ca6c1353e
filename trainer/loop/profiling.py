"""trainer.profile=true: a torch.profiler trace of a few steps per rank, in the run dir.

The traces (`profiler/rank{r}.*.pt.trace.json`) open in Perfetto (ui.perfetto.dev) or TensorBoard.
The profiler costs time while it records, so it is off by default and records only a few steps,
after one step of wait and one of warm-up.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from types import TracebackType

import torch
from torch.profiler import (
    ProfilerActivity,
    profile,
    schedule,
    tensorboard_trace_handler,
)


class StepProfiler(AbstractContextManager["StepProfiler"]):
    """Wraps the training loop; step() after every optimizer step. A no-op when disabled."""

    def __init__(self, enabled: bool, device: torch.device, rank: int, out_dir: Path, active_steps: int = 3) -> None:
        self._profile: profile | None = None
        if enabled:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
            out_dir.mkdir(parents=True, exist_ok=True)
            self._profile = profile(
                activities=activities,
                schedule=schedule(wait=1, warmup=1, active=active_steps, repeat=1),
                on_trace_ready=tensorboard_trace_handler(str(out_dir), worker_name=f"rank{rank}"),
                record_shapes=True,
                with_stack=False,
            )

    def __enter__(self) -> StepProfiler:
        if self._profile is not None:
            self._profile.__enter__()
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._profile is not None:
            self._profile.__exit__(kind, exc, tb)

    def step(self) -> None:
        if self._profile is not None:
            self._profile.step()
