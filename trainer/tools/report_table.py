"""The sweep report's text outputs: the printed tables, report.md and report.csv.

Kept apart from computing the rows (report_rows.py) so how a number is shown (digits, the
parentheses of an incomplete job, the dagger) never changes what it is. report.md and report.csv
hold every column; the printed tables keep what a reader compares in a 100-column terminal.
"""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from trainer.tools.report_layout import cap_cell, layout_cell, short_layout
from trainer.tools.report_points import POINT_HEADERS, Point, point_cells, shown
from trainer.tools.report_rows import LEGEND, REPEAT_KEY, JobRow, RankStats, override_key, value_of


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
    "train loss",
    "eval acc",
    "slowest",
    "fastest",
)
CUDA_HEADER = "peak CUDA MB"  # after peak RSS MB (before opt state MB), only when some job ran on CUDA


def headers(rows: Sequence[JobRow]) -> list[str]:
    if not any(row.peak_cuda_mb is not None for row in rows):
        return list(HEADERS)
    at = HEADERS.index("peak RSS MB") + 1
    return [*HEADERS[:at], CUDA_HEADER, *HEADERS[at:]]


DAGGER_NOTE = "† ddp communicates inside backward (time/backward_s), not in the sync phase: its sync % is ~0"


def notes_under_table(table: str) -> list[str]:
    """What the table's marks mean, said right under it (report.md's legend has the whole story); a mark
    whose column the printed table left out needs no word."""
    return [DAGGER_NOTE] if "†" in table else []


def _dagger(row: JobRow) -> str:
    return "†" if row.sync == "ddp" and row.sync_share_pct is not None else ""


def table_cells(row: JobRow, cuda: bool = False) -> list[str]:
    """Display strings; an incomplete job's numbers are wrapped in parentheses.

    `-` marks communication a job did not do (sync=none) or did not time, or a metric its rows do not
    carry (optimizer state in runs logged before it existed), as opposed to a blank.
    """
    dagger = _dagger(row)
    memory = [shown(row.peak_rss_mb, ".0f")] + ([shown(row.peak_cuda_mb, ".0f") or "-"] if cuda else [])
    numbers = [
        shown(row.step_ms, ".2f"),
        shown(row.samples_per_s, ".0f"),
        shown(row.sync_share_pct, ".1f") + dagger,
        shown(row.mb_per_step, ".2f") or "-",
        shown(row.comm_exposed_ms, ".2f") or "-",
        *memory,
        shown(row.opt_state_mb, ".1f") or "-",
        shown(row.train_loss, ".4f"),
        shown(row.eval_accuracy, ".3f"),
        _rank(row.slowest),
        _rank(row.fastest),
    ]
    if row.status != "ok":
        numbers = [f"({n})" if n not in ("", "-") else n for n in numbers]
    layout = [layout_cell(row), row.same_buckets_as]
    cap = cap_cell(row.bucket_setting, [row.cap_in_use_mb])
    return [row.job, row.status, row.overrides, row.sync, cap, *layout, *numbers]


def _lines(rows: Sequence[JobRow]) -> list[list[str]]:
    """The header, then one line of cells per job."""
    names = headers(rows)
    return [names, *(table_cells(row, CUDA_HEADER in names) for row in rows)]


def _aligned(cells: Sequence[Sequence[str]]) -> str:
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)).rstrip() for line in cells)


SCREEN_WIDTH = 100  # a terminal's: what does not fit is in report.md and report.csv
BLANK = ("", "-")  # a column of nothing but these tells the reader nothing on screen
SCREEN_NAMES = {"samples/s (median row)": "samples/s"}  # report.md's legend says which row
# The printed tables drop these columns, first first, until they fit: what a reader compares (the
# swept values, step time and its spread, throughput, exposed communication) stays.
JOB_DROP_ORDER: tuple[str, ...] = ("fastest", "slowest", CUDA_HEADER, "peak RSS MB", "opt state MB", "eval acc")
JOB_DROP_ORDER += ("sync", "sync %", "train loss", "bucket_mb", "MB/step", "same as", "buckets")
POINT_DROP_ORDER = ("hidden ms", "compute ms", "bucket_mb", "buckets", "jobs")


@dataclass
class Column:
    name: str
    cells: list[str]
    clip: bool = False  # text that may be cut short (`…`) when dropping columns was not enough
    swept: bool = False  # an override key's values: what tells the lines apart, never dropped

    @property
    def width(self) -> int:
        return max(len(self.name), *(len(c) for c in self.cells))


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def swept_columns(per_line: Sequence[Sequence[str]]) -> list[Column]:
    """One column per override key, headed by its last part (`sync.comm_hook` -> `comm_hook`, unless two
    keys share it), holding each line's value: the key said once, not on every line."""
    keys = list(dict.fromkeys(override_key(o) for line in per_line for o in line))
    short = [k.rpartition(".")[2] for k in keys]
    names = [s if short.count(s) == 1 else k for s, k in zip(short, keys, strict=True)]
    cells = [[value_of(line, k) for line in per_line] for k in keys]
    return [Column(n, c, clip=True, swept=True) for n, c in zip(names, cells, strict=True)]


def _width(columns: Sequence[Column]) -> int:
    return sum(c.width for c in columns) + 2 * (len(columns) - 1)


def fit(columns: Sequence[Column], drop_order: Sequence[str], width: int = SCREEN_WIDTH) -> str:
    """The columns aligned in `width` characters: without those blank in every row or whose text repeats an
    earlier one's (`sync` under `sync=...`), then without drop_order's, first first, until they fit; then
    the widest text is cut short."""
    shown: list[Column] = []
    for column in columns:
        repeats = column.clip and any(column.cells == s.cells for s in shown if s.clip)
        if not repeats and not all(c in BLANK for c in column.cells):
            shown.append(column)
    for name in drop_order:
        if _width(shown) <= width:
            break
        shown = [c for c in shown if c.swept or c.name != name]
    while _width(shown) > width and any(c.clip and c.width > 4 for c in shown):
        widest = max((c for c in shown if c.clip), key=lambda c: c.width)  # a character at a time: shared out
        cut = widest.width - 1
        widest.name, widest.cells = _clip(widest.name, cut), [_clip(c, cut) for c in widest.cells]
    return _aligned([[c.name for c in shown], *([c.cells[i] for c in shown] for i in range(len(shown[0].cells)))])


def _by_name(names: Sequence[str], lines: Sequence[Sequence[str]]) -> dict[str, list[str]]:
    return {name: [line[i] for line in lines] for i, name in enumerate(names)}


def screen_table(rows: Sequence[JobRow]) -> str:
    """The jobs as printed: the job, what is swept (a column per key), then the numbers in report.md's order."""
    names, *lines = _lines(rows)
    full = _by_name(names, lines) | {"buckets": [short_layout(r) for r in rows]}
    status = Column("status", ["" if s == "ok" else s for s in full["status"]])  # said only when a job is not ok
    columns = [Column("job", full["job"]), status, *swept_columns([r.overrides.split() for r in rows])]
    skip = ("job", "status", "overrides")  # overrides: the swept columns say them
    texts = ("sync", "bucket_mb", "buckets")
    columns += [Column(SCREEN_NAMES.get(n, n), full[n], n in texts) for n in names if n not in skip]
    return fit(columns, JOB_DROP_ORDER)


def _point_layout(point: Point) -> str:
    """`1 bucket`, once for repeats that built the same; `2|4 buckets` for repeats that did not."""
    counts = point.each(lambda j: str(len(j.bucket_sizes)) if j.bucket_sizes else "")
    if len(counts) > 1 and all(counts):
        return f"{'|'.join(counts)} buckets"
    return "|".join(point.each(short_layout))


def screen_points(points: Sequence[Point]) -> str:
    """The points as printed: what names each point (a column per key), then its medians and spread."""
    full = _by_name(POINT_HEADERS, [point_cells(p) for p in points])
    full["buckets"] = [_point_layout(p) for p in points]
    words = [[o for o in p.first.overrides.split() if override_key(o) != REPEAT_KEY] for p in points]
    columns = swept_columns(words) if any(words) else [Column("point", full["point"], clip=True)]
    texts = ("jobs", "bucket_mb", "buckets")
    columns += [Column(SCREEN_NAMES.get(n, n), full[n], n in texts) for n in POINT_HEADERS if n != "point"]
    return fit(columns, POINT_DROP_ORDER)


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
    names, *cells = _lines(rows)
    lines = [f"# {title}", ""]
    if points:
        lines += ["## Points", "", *_markdown_table(POINT_HEADERS, [point_cells(p) for p in points]), ""]
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
            "comm_exposed_ms": row.comm_exposed_ms,
            "comm_ms": row.comm_ms,
            "compute_ms": row.compute_ms,
            "hidden_comm_ms": row.hidden_comm_ms,
            "peak_rss_mb": row.peak_rss_mb,
            "peak_cuda_mb": row.peak_cuda_mb,
            "opt_state_mb": row.opt_state_mb,
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
