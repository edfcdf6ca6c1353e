"""What every metric sink offers, so the loop logs unconditionally (logger=none is a real object)."""

from __future__ import annotations

from typing import Any, Protocol


class MetricLogger(Protocol):
    """One rank's sink for metric rows, a final summary, and a clean close."""

    location: str | None  # where the sink writes, for the end-of-run message

    def log(self, row: dict[str, Any]) -> None:
        """Record one row; `row["step"]` is the optimizer step it belongs to."""

    def log_summary(self, summary: dict[str, Any]) -> None:
        """Record the run's final numbers."""

    def close(self, exit_code: int = 0) -> None:
        """Flush and finish; safe to call twice. A non-zero code marks the run as failed."""
