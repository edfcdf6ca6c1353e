"""What every metric sink offers, so the loop logs unconditionally (logger=none is a real object)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


class MetricLogger(Protocol):
    """One rank's sink for metric rows, a final summary, and a clean close."""

    location: str | None  # where the sink writes, for the end-of-run message

    def log(self, row: dict[str, Any]) -> None:
        """Record one row; `row["step"]` is the optimizer step it belongs to."""

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Record the run's final numbers."""

    def close(self, exit_code: int = 0) -> None:
        """Flush and finish; safe to call twice. A non-zero code marks the run as failed."""


@runtime_checkable
class ResumableLogger(Protocol):
    """A sink whose rows outlive an attempt (the JSONL file): told where a resumed run starts.

    After a crash the sink holds rows past the checkpoint that the resumed run logs again; a sink
    with this method drops them, so each step is recorded once. The trainer calls it on every rank,
    right after a successful resume, on the loggers that have it.
    """

    def resumed_at(self, step: int) -> None:
        """Training continues after optimizer step `step` (the checkpoint's)."""


@runtime_checkable
class TimelineLogger(Protocol):
    """A sink that keeps pictures and files (W&B): given the timeline of trainer.profile=true's steps."""

    def log_timeline(self, image: Path, trace: Path, step: int) -> None:
        """The timeline picture and the merged trace, after the profiled steps (rank 0 only)."""


def resumed_at(loggers: Sequence[MetricLogger], step: int) -> None:
    """Tell each logger that keeps rows across attempts where the resumed run starts."""
    for logger in loggers:
        if isinstance(logger, ResumableLogger):
            logger.resumed_at(step)
