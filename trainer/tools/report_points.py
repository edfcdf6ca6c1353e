"""Repeated jobs of a sweep gathered into points: the median of their step times and its spread.

One run of 40 steps on a shared machine moves by 10-20 % from run to run, more than many of the
differences a sweep looks for. A sweep that repeats every point (`+repeat=1,2,3`, interleaved by
Hydra's cartesian order: every cap once, then every cap again) shows that variation; this module
turns it into numbers, the points table's cells and the plain sentences the report prints.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from trainer.tools.report_layout import cap_cell, cap_label, layout_cell
from trainer.tools.report_rows import CAP_KEY, REPEAT_KEY, JobRow, override_key


@dataclass
class Point:
    label: str  # "cap 5", or the overrides that name it ("+strategy=ddp")
    jobs: list[JobRow] = field(default_factory=list)

    def median(self, name: str) -> float | None:
        """The median over the point's jobs of one JobRow number (None where no job has it)."""
        values = [v for v in (getattr(j, name) for j in self.jobs) if v is not None]
        return statistics.median(values) if values else None

    @property
    def step_ms(self) -> float | None:
        """The median over repeats of the per-job step medians."""
        return self.median("step_ms")

    @property
    def spread(self) -> tuple[float, float] | None:
        """Min and max of the per-job step medians; None for a single run (no spread to show)."""
        values = [j.step_ms for j in self.jobs if j.step_ms is not None]
        return (min(values), max(values)) if len(values) > 1 else None

    @property
    def samples_per_s(self) -> float | None:
        return self.median("samples_per_s")

    @property
    def samples_spread(self) -> tuple[float, float] | None:
        values = [j.samples_per_s for j in self.jobs if j.samples_per_s is not None]
        return (min(values), max(values)) if len(values) > 1 else None

    @property
    def first(self) -> JobRow:
        return self.jobs[0]

    def each(self, cell: Callable[[JobRow], str]) -> list[str]:
        """One job's cell per distinct value, in job order: repeats of one configuration need not agree
        (`bucket_cap_mb=auto` chooses its cap, and so its buckets, in every run anew)."""
        return list(dict.fromkeys(cell(j) for j in self.jobs))


def shown(value: float | None, spec: str) -> str:
    """A number as every table of the report shows it; "" when it is missing."""
    return "" if value is None else format(value, spec)


def point_label(row: JobRow) -> str:
    """The job's differing overrides without its repeat, the cap written as `cap 5`."""
    words = [o for o in row.overrides.split() if override_key(o) != REPEAT_KEY]
    named = [cap_label(o.split("=", 1)[1]) if override_key(o) == CAP_KEY else o for o in words]
    return " ".join(named) or f"job {row.job}"


def gather_points(rows: Sequence[JobRow]) -> list[Point]:
    """Finished jobs with a step time, grouped by everything but `repeat`, in order of first appearance."""
    points: dict[str, Point] = {}
    for row in rows:
        if row.status == "ok" and row.step_ms is not None:
            label = point_label(row)
            points.setdefault(label, Point(label)).jobs.append(row)
    return list(points.values())


POINT_HEADERS = (
    "point",
    "jobs",
    "bucket_mb",
    "buckets",
    "step ms",
    "spread ms",
    "samples/s (median row)",
    "compute ms",
    "hidden ms",
    "exposed ms",
)
LINK_HEADER = "link ms"  # after exposed ms, only when some job ran on an emulated link


def point_headers(points: Sequence[Point]) -> list[str]:
    names = list(POINT_HEADERS)
    if any(point.median("comm_exposed_link_ms") is not None for point in points):
        names.insert(names.index("exposed ms") + 1, LINK_HEADER)
    return names


def point_cells(point: Point, link: bool = False) -> list[str]:
    """A point's medians over its repeats; `-` for the spread of a point that ran once. The cap and the
    buckets are each repeat's where they differ (`auto (5|1)`), once where the repeats agree."""
    spread = point.spread
    first = point.first

    def med(name: str) -> str:
        return shown(point.median(name), ".2f") or "-"

    same = point.each(lambda j: j.same_buckets_as)
    said = f" (same as {same[0]})" if len(same) == 1 and same[0] else ""
    return [
        point.label,
        ",".join(j.job for j in point.jobs),
        cap_cell(first.bucket_setting, [j.cap_in_use_mb for j in point.jobs]),
        " | ".join(point.each(layout_cell)) + said,
        shown(point.step_ms, ".2f"),
        "-" if spread is None else f"{spread[0]:.2f}-{spread[1]:.2f}",
        shown(point.samples_per_s, ".0f"),
        med("compute_ms"),
        med("hidden_comm_ms"),
        med("comm_exposed_ms"),
        *([med("comm_exposed_link_ms")] if link else []),
    ]


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return a[0] <= b[1] and b[0] <= a[1]


def _names(labels: Sequence[str]) -> str:
    return labels[0] if len(labels) == 1 else ", ".join(labels[:-1]) + f" and {labels[-1]}"


def spread_sentences(points: Sequence[Point]) -> list[str]:
    """What the repeats allow one to say: no spread at all, or which points cannot be told apart."""
    if not points:
        return []
    if all(p.spread is None for p in points):
        return [
            "Every point ran once: this sweep has no spread, so it cannot tell a difference from run-to-run "
            "noise (repeat it interleaved: `+repeat=1,2,3`)."
        ]
    lines = []
    single = [p.label for p in points if p.spread is None]
    if single:
        lines.append(f"{_names(single)} ran once: no spread, not compared.")
    spread = [p for p in points if p.spread is not None]
    for i, point in enumerate(spread):
        assert point.spread is not None
        same = [q.label for q in spread[i + 1 :] if q.spread is not None and _overlap(point.spread, q.spread)]
        if len(same) == 1:
            lines.append(f"{point.label} and {same[0]} are not distinguishable here (their spreads overlap).")
        elif same:
            lines.append(f"{point.label} is not distinguishable here from {_names(same)} (their spreads overlap).")
    if not any("not distinguishable" in line for line in lines):
        lines.append("No two points' spreads overlap: their order held in every repeat.")
    return lines
