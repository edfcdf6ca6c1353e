"""The sweep report's text outputs: the printed table, report.md and report.csv.

Kept apart from computing the rows (report_rows.py) so how a number is shown (digits, the
parentheses of an incomplete job, the dagger) never changes what it is.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.tools.report_rows import LEGEND, JobRow, RankStats


def _num(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _rank(r: RankStats | None) -> str:
    return "" if r is None else f"r{r.rank} ({r.step_ms:.2f} ms)"


HEADERS = (
    "job",
    "status",
    "overrides",
    "sync",
    "bucket_mb",
    "step ms",
    "samples/s",
    "sync %",
    "train loss",
    "eval acc",
    "slowest",
    "fastest",
)


def table_cells(row: JobRow) -> list[str]:
    """Display strings; an incomplete job's numbers are wrapped in parentheses."""
    dagger = "†" if row.sync == "ddp" and row.sync_share_pct is not None else ""
    numbers = [
        _num(row.step_ms, ".2f"),
        _num(row.samples_per_s, ".0f"),
        _num(row.sync_share_pct, ".1f") + dagger,
        _num(row.train_loss, ".4f"),
        _num(row.eval_accuracy, ".3f"),
        _rank(row.slowest),
        _rank(row.fastest),
    ]
    if row.status != "ok":
        numbers = [f"({n})" if n else n for n in numbers]
    return [row.job, row.status, row.overrides, row.sync, _num(row.bucket_cap_mb, "g"), *numbers]


def format_table(rows: Sequence[JobRow]) -> str:
    cells = [list(HEADERS), *(table_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(HEADERS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)).rstrip() for line in cells)


def format_markdown(rows: Sequence[JobRow], title: str, image: str) -> str:
    lines = [f"# {title}", "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in table_cells(row)) + " |" for row in rows]
    return "\n".join([*lines, "", "## Legend", "", LEGEND, "", f"![{title}]({image})", ""])


def csv_records(rows: Sequence[JobRow]) -> list[dict[str, Any]]:
    """Plain numbers (None when missing) plus every rank's median step time, for spreadsheets."""
    all_ranks = sorted({r.rank for row in rows for r in row.ranks})
    return [
        {
            "job": row.job,
            "status": row.status,
            "overrides": row.overrides,
            "sync": row.sync,
            "model": row.model,
            "bucket_cap_mb": row.bucket_cap_mb,
            "num_ranks": len(row.ranks),
            "step_ms": row.step_ms,
            "samples_per_s": row.samples_per_s,
            "sync_share_pct": row.sync_share_pct,
            "train_loss": row.train_loss,
            "eval_accuracy": row.eval_accuracy,
            "slowest_rank": row.slowest and row.slowest.rank,
            "fastest_rank": row.fastest and row.fastest.rank,
            "min_logged_rows": min((r.timed_steps for r in row.ranks), default=0),
            **{f"rank{k}_step_ms": next((r.step_ms for r in row.ranks if r.rank == k), None) for k in all_ranks},
        }
        for row in rows
    ]


def write_csv(rows: Sequence[JobRow], path: Path) -> None:
    records = csv_records(rows)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in rec.items()} for rec in records)
