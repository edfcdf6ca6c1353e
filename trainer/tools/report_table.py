"""The sweep report's cells and its files: each job's cells, report.md and report.csv.

Kept apart from computing the rows (report_rows.py) so how a number is shown (digits, the
parentheses of an incomplete job, the dagger) never changes what it is. report.md and report.csv
hold every column; the printed tables (report_screen.py) keep what a reader compares in a
100-column terminal.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.tools.report_layout import cap_cell, layout_cell
from trainer.tools.report_points import LINK_HEADER, Point, point_cells, point_headers, shown
from trainer.tools.report_rows import LEGEND, JobRow, RankStats


def _rank(r: RankStats | None) -> str:
    return "" if r is None else f"r{r.rank} ({r.step_ms:.2f} ms)"


HEADERS = (
    "job",
    "status",
    "overrides",
    "sync",
    "bucket_mb",
    "buckets",
    "same as",
    "step ms",
    "samples/s (median row)",
    "sync %",
    "MB/step",
    "exposed ms",
    "peak RSS MB",
    "opt state MB",
    "mem MB/rank",
    "train loss",
    "eval acc",
    "slowest",
    "fastest",
)
CUDA_HEADER = "peak CUDA MB"  # after peak RSS MB (before opt state MB), only when some job ran on CUDA
PREDICTED_HEADER = "predicted MB/rank"  # after mem MB/rank, only with report --memory
INTER_NODE_HEADER = "inter-node MB/step"  # after MB/step, only when some job's emulated nodes held several ranks


def headers(rows: Sequence[JobRow]) -> list[str]:
    names = list(HEADERS)
    if any(row.comm_exposed_link_ms is not None for row in rows):
        names.insert(names.index("exposed ms") + 1, LINK_HEADER)
    if any(row.inter_node_mb_per_step is not None for row in rows):
        names.insert(names.index("MB/step") + 1, INTER_NODE_HEADER)
    if any(row.predicted_memory_mb is not None for row in rows):
        names.insert(names.index("mem MB/rank") + 1, PREDICTED_HEADER)
    if any(row.peak_cuda_mb is not None for row in rows):
        names.insert(names.index("peak RSS MB") + 1, CUDA_HEADER)
    return names


DAGGER_NOTE = "† ddp communicates inside backward (time/backward_s), not in the sync phase: its sync % is ~0"


NOTHING_SENT = "-"  # the job sends nothing (sync=none)
NOT_MEASURED = "n/m"  # the job sends, but no row measured it (e.g. trainer.sample_every_n_steps=0)
# Under the printed table, whose headers are short: which steps its numbers are over (report.md's legend).
WINDOWS_NOTE = (
    "windows: step ms, samples/s, sync %, MB/step, exposed ms a median row; train loss the last row;"
    " eval acc the last eval; n/m: not measured"
)


def notes_under_table(table: str) -> list[str]:
    """What the table's marks mean, said right under it (report.md's legend has the whole story); a mark
    whose column the printed table left out needs no word."""
    return [DAGGER_NOTE] if "†" in table else []


def _dagger(row: JobRow) -> str:
    return "†" if row.sync == "ddp" and row.sync_share_pct is not None else ""


def table_cells(row: JobRow, names: Sequence[str] = HEADERS) -> list[str]:
    """Display strings for the columns `names` (headers()); an incomplete job's numbers are wrapped in parentheses.

    `-` marks communication a job did not do (sync=none) or did not time, or a metric its rows do not
    carry (optimizer state in runs logged before it existed), as opposed to a blank.
    """
    dagger = _dagger(row)

    def some(header: str, value: float | None, spec: str) -> list[str]:
        """A conditional column's cell, or none where the table has no such column."""
        return [shown(value, spec) or "-"] if header in names else []

    # A quantity no row measured is not one the job did without: `-` only for a job that sends nothing.
    absent = NOTHING_SENT if row.sync == "none" else NOT_MEASURED
    numbers = [
        shown(row.step_ms, ".2f"),
        shown(row.samples_per_s, ".0f"),
        shown(row.sync_share_pct, ".1f") + dagger,
        shown(row.mb_per_step, ".2f") or absent,
        *some(INTER_NODE_HEADER, row.inter_node_mb_per_step, ".2f"),
        shown(row.comm_exposed_ms, ".2f") or absent,
        *some(LINK_HEADER, row.comm_exposed_link_ms, ".2f"),
        shown(row.peak_rss_mb, ".0f"),
        *some(CUDA_HEADER, row.peak_cuda_mb, ".0f"),
        shown(row.opt_state_mb, ".1f") or "-",
        shown(row.step_memory_mb, ".1f") or "-",
        *some(PREDICTED_HEADER, row.predicted_memory_mb, ".1f"),
        shown(row.train_loss, ".4f"),
        shown(row.eval_accuracy, ".3f"),
        _rank(row.slowest),
        _rank(row.fastest),
    ]
    if row.status != "ok":
        numbers = [f"({n})" if n not in ("", NOTHING_SENT, NOT_MEASURED) else n for n in numbers]
    layout = [layout_cell(row), row.same_buckets_as]
    cap = cap_cell(row.bucket_setting, [row.cap_in_use_mb])
    return [row.job, row.status, row.overrides, row.sync, cap, *layout, *numbers]


def job_lines(rows: Sequence[JobRow]) -> list[list[str]]:
    """The header, then one line of cells per job."""
    names = headers(rows)
    return [names, *(table_cells(row, names) for row in rows)]


def _markdown_table(names: Sequence[str], cells: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(names) + " |", "|" + "---|" * len(names)]
    return lines + ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in cells]


def format_markdown(
    rows: Sequence[JobRow],
    title: str,
    image: str,
    points: Sequence[Point] = (),
    notes: Sequence[str] = (),
) -> str:
    """Points (medians and spread over repeats) and what they allow one to say, then every job, then the legend."""
    names, *cells = job_lines(rows)
    lines = [f"# {title}", ""]
    if points:
        point_names = point_headers(points)
        point_lines = [point_cells(p, LINK_HEADER in point_names) for p in points]
        lines += ["## Points", "", *_markdown_table(point_names, point_lines), ""]
    lines += [*(f"- {note}" for note in notes), *([""] if notes else []), "## Jobs", "", *_markdown_table(names, cells)]
    lines += [line for note in notes_under_table("".join(map("".join, cells))) for line in ("", note)]
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
            "bucket_cap_mb": row.bucket_cap_mb if row.bucket_cap_mb is not None else row.bucket_setting or None,
            "bucket_cap_mb_in_use": row.cap_in_use_mb,
            "repeat": row.repeat or None,
            "num_buckets": None if row.bucket_sizes is None else len(row.bucket_sizes),
            "bucket_sizes_bytes": None if row.bucket_sizes is None else " ".join(map(str, row.bucket_sizes)),
            "same_buckets_as": row.same_buckets_as or None,
            "num_ranks": len(row.ranks),
            "step_ms": row.step_ms,
            "samples_per_s": row.samples_per_s,
            "sync_share_pct": row.sync_share_pct,
            "mb_per_step": row.mb_per_step,
            "inter_node_mb_per_step": row.inter_node_mb_per_step,
            "comm_exposed_ms": row.comm_exposed_ms,
            "comm_exposed_link_ms": row.comm_exposed_link_ms,
            "comm_ms": row.comm_ms,
            "compute_ms": row.compute_ms,
            "hidden_comm_ms": row.hidden_comm_ms,
            "peak_rss_mb": row.peak_rss_mb,
            "peak_cuda_mb": row.peak_cuda_mb,
            "opt_state_mb": row.opt_state_mb,
            "step_memory_mb": row.step_memory_mb,
            "predicted_memory_mb": row.predicted_memory_mb,
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
