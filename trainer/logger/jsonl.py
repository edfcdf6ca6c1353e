"""Per-rank metrics as JSON lines: metrics/rank{r}.jsonl, one object per logged step.

Every rank always writes this file, whatever `logger` is: the sweep report and the tests read it,
and it survives a killed process because each row is flushed as it is written.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class JsonlLogger:
    """Appends rows to one file; the summary lives in summary.json, not here."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.location: str | None = str(path)
        self._file = path.open("a", encoding="utf-8")

    def log(self, row: dict[str, Any]) -> None:
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self, exit_code: int = 0) -> None:
        if not self._file.closed:
            self._file.close()
