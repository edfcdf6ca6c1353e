"""The sweep report's printed tables: the jobs and the points fitted to a 100-column terminal.

A column blank on every line, or repeating an earlier one, is left out; then the columns a reader
compares least are dropped, in a fixed order, until the table fits; then the widest text is cut
short. report.md and report.csv (report_table.py) keep every column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from trainer.tools.report_layout import short_layout
from trainer.tools.report_points import LINK_HEADER, Point, point_cells, point_headers
from trainer.tools.report_rows import REPEAT_KEY, JobRow, override_key, value_of
from trainer.tools.report_table import CUDA_HEADER, INTER_NODE_HEADER, NOT_MEASURED, PREDICTED_HEADER, job_lines


def aligned(cells: Sequence[Sequence[str]]) -> str:
    widths = [max(len(line[i]) for line in cells) for i in range(len(cells[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)).rstrip() for line in cells)


SCREEN_WIDTH = 100  # a terminal's: what does not fit is in report.md and report.csv
BLANK = ("", "-", NOT_MEASURED)  # a column of nothing but these tells the reader nothing on screen
# The line under the printed table names these columns' windows (report_table.WINDOWS_NOTE).
SCREEN_NAMES = {"samples/s (median row)": "samples/s"}
# The printed tables drop these columns, first first, until they fit: what a reader compares (the
# swept values, step time and its spread, throughput, exposed communication and, on an emulated link,
# the link's ideal beside it) stays. The bytes across nodes go before the bytes in all: shown if they fit.
JOB_DROP_ORDER: tuple[str, ...] = (
    "fastest",
    "slowest",
    CUDA_HEADER,
    "peak RSS MB",
    "opt state MB",
    "eval acc",
    PREDICTED_HEADER,
    "mem MB/rank",
)
JOB_DROP_ORDER += ("sync", "sync %", "train loss", "bucket_mb", INTER_NODE_HEADER, "MB/step", "same as", "buckets")
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
    return aligned([[c.name for c in shown], *([c.cells[i] for c in shown] for i in range(len(shown[0].cells)))])


def _by_name(names: Sequence[str], lines: Sequence[Sequence[str]]) -> dict[str, list[str]]:
    return {name: [line[i] for line in lines] for i, name in enumerate(names)}


def screen_table(rows: Sequence[JobRow]) -> str:
    """The jobs as printed: the job, what is swept (a column per key), then the numbers in report.md's order."""
    names, *lines = job_lines(rows)
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
    names = point_headers(points)
    full = _by_name(names, [point_cells(p, LINK_HEADER in names) for p in points])
    full["buckets"] = [_point_layout(p) for p in points]
    words = [[o for o in p.first.overrides.split() if override_key(o) != REPEAT_KEY] for p in points]
    columns = swept_columns(words) if any(words) else [Column("point", full["point"], clip=True)]
    texts = ("jobs", "bucket_mb", "buckets")
    columns += [Column(SCREEN_NAMES.get(n, n), full[n], n in texts) for n in names if n != "point"]
    return fit(columns, POINT_DROP_ORDER)
