"""logger=none: the same methods as the W&B logger, doing nothing."""

from __future__ import annotations

from typing import Any


class NullLogger:
    """Accepts and drops everything, so the trainer never asks whether logging is on."""

    def __init__(self, **_runtime: Any) -> None:
        # Accepts the runtime kwargs the W&B logger takes (dir, name, group, run_config) and ignores them.
        self.location: str | None = None

    def log(self, row: dict[str, Any]) -> None:
        pass

    def log_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self, exit_code: int = 0) -> None:
        pass
