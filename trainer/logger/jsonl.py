"""Per-rank metrics as JSON lines: metrics/rank{r}.jsonl, one object per logged step.

Every rank always writes this file, whatever `logger` is: the sweep report and the tests read it,
and it survives a killed process because each row is flushed as it is written.

A resumed run (elastic restart, trainer.resume=auto) appends to the same file, so on resume the
rows of the interrupted attempt after the checkpoint's step are dropped first: the resumed run logs
those steps again, with the same values, and the file holds each step's train, eval and checkpoint row once.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from trainer.windows import kinds_of


def row_kind(row: dict[str, Any]) -> str:
    """A step has at most one row of each kind: its training row, its evaluation row, its checkpoint's
    row (the `row` key; rows written before it existed: the kind their keys imply)."""
    return "+".join(sorted(kinds_of(row)))


def rows_up_to(lines: Iterable[str], step: int) -> tuple[list[str], set[str]]:
    """The lines to keep when resuming at `step`, and the row kinds already logged at that step.

    Kept: each parsable row with row["step"] <= step, the first of its (step, kind) only. Dropped:
    rows after the step (the resumed run logs them again) and unparsable lines (a row cut short
    when a process was killed mid-write). Kept lines are returned as written, byte for byte.
    """
    kept: list[str] = []
    seen: set[tuple[int, str]] = set()
    for line in lines:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(row, dict) or not isinstance(row.get("step"), int) or row["step"] > step:
            continue
        key = (row["step"], row_kind(row))
        if key not in seen:
            seen.add(key)
            kept.append(line.rstrip("\r\n"))
    return kept, {kind for at, kind in seen if at == step}


def truncate_after(path: Path, step: int) -> set[str]:
    """Rewrite `path` to hold only rows_up_to(step); returns the row kinds it holds at `step`.

    Atomic: the kept rows go to a temporary file in the same directory, are fsynced, then replace
    the file in one rename. A crash at any point leaves either the old file or the new one, and
    both hold every row up to the checkpoint's step.
    """
    if not path.is_file():
        return set()
    text = path.read_text(encoding="utf-8", errors="replace")
    lines = text.splitlines()
    kept, kinds = rows_up_to(lines, step)
    if kept == lines and text.endswith("\n") or not text:
        return kinds  # nothing to drop (a resume from the last row's step): no rewrite
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.writelines(line + "\n" for line in kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power cut
    finally:
        os.close(directory)
    return kinds


class JsonlLogger:
    """Appends rows to one file; the summary lives in summary.json, not here."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.location: str | None = str(path)
        self._path = path
        self._file = path.open("a", encoding="utf-8")
        self._resumed_step: int | None = None
        self._kinds_at_resume: set[str] = set()  # row kinds the file already holds at the resumed step

    def resumed_at(self, step: int) -> None:
        """Drop the rows after `step` (the interrupted attempt's); skip re-logging a kind held at `step`.

        A row of a kind the file already holds at that step (its eval row, say) is not written twice.
        """
        self._file.close()  # the rewrite replaces the file: reopen the new one, not the old inode
        try:
            self._kinds_at_resume = truncate_after(self._path, step)
        finally:
            self._file = self._path.open("a", encoding="utf-8")
        self._resumed_step = step

    def log(self, row: dict[str, Any]) -> None:
        if row["step"] == self._resumed_step and row_kind(row) in self._kinds_at_resume:
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def log_summary(self, summary: dict[str, Any]) -> None:
        pass

    def close(self, exit_code: int = 0) -> None:
        if not self._file.closed:
            self._file.close()
