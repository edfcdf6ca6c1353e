"""The sweep report's figure (report.png): step time and throughput per point, and where each job's time went.

Kept apart from the text outputs (report_table.py) because it is the only part that needs
matplotlib, and its layout choices (log x, a 1/N right axis, error bars over repeats, the stacked
time bars) are a topic of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from trainer.tools.report_layout import bucket_count, cap_cell, tie_sentences
from trainer.tools.report_plot_time import draw_time_split
from trainer.tools.report_points import Point, gather_points
from trainer.tools.report_rows import CAP_KEY, REPEAT_KEY, JobRow, override_key

FIELDS = ("step_ms", "samples_per_s")
LINE = 0.035  # a line of text under the panels, in figure heights
YLABELS = ("median step time (ms)", "global throughput (samples/s)")


def _values(row: JobRow, field: str) -> list[float]:
    return [v for v in (getattr(r, field) for r in row.ranks) if v is not None]


def _other_overrides(row: JobRow) -> list[str]:
    """The row's overrides besides the strategy, model, bucket size and repeat: they tell its series apart."""
    keys = ("sync", "model", CAP_KEY, REPEAT_KEY)
    return [o for o in row.overrides.split() if override_key(o) not in keys]


def _layout_line(row: JobRow) -> str:
    """A tick label's second line: `4 buckets` (then `= cap 1` when an earlier cap built the same),
    `1 buffer` (manual), `5 units` (fsdp), or nothing."""
    if row.bucket_sizes is None:
        return f"\n{row.units.count()}" if row.units is not None else ""
    same = f"\n= {row.same_buckets_as}" if row.same_buckets_as else ""
    return f"\n{bucket_count(row.bucket_sizes)}{same}"


def _point_layout_line(point: Point) -> str:
    """_layout_line of a point; repeats that built different buckets (`bucket_cap_mb=auto` chooses in
    every run) each show theirs on one line: `2 buckets | 4 buckets`."""
    each = point.each(_layout_line)
    if len(each) == 1:
        return each[0]
    return "\n" + " | ".join(line.strip().replace("\n", " ") for line in each)


def _median(point: Point, field: str) -> float:
    """The points drawn all have this field (plot() keeps finished, timed jobs only)."""
    value = point.median(field)
    assert value is not None
    return value


def _errors(point: Point, field: str) -> tuple[float, float]:
    """Distances from the point's median down to its min and up to its max (0, 0 for one run)."""
    spread = point.spread if field == "step_ms" else point.samples_spread
    middle = point.median(field)
    if spread is None or middle is None:
        return 0.0, 0.0
    return middle - spread[0], spread[1] - middle


def _error_bars(ax: Axes, xs: Sequence[float], points: Sequence[Point], field: str, **style: object) -> None:
    errors = [_errors(p, field) for p in points]
    lows, highs = [e[0] for e in errors], [e[1] for e in errors]
    ax.errorbar(xs, [p.median(field) for p in points], yerr=[lows, highs], capsize=4, **style)  # type: ignore[arg-type]


def _layout(point: Point) -> tuple[int, ...] | None:
    """The buckets every job of the point built; None when they differ (auto) or are unknown."""
    layouts = {j.bucket_sizes for j in point.jobs}
    return layouts.pop() if len(layouts) == 1 else None


def as_drawn(members: Sequence[Point]) -> list[Point]:
    """Each point of a series (in cap order) as drawn: neighbouring caps that built the same buckets are
    one configuration, so they are drawn as one value, the median over all their jobs with the spread
    of all of them, at each of their caps (a flat line: no cap of theirs beats another); any other
    point as it is."""
    runs: list[list[Point]] = []
    for p in members:
        layout = _layout(p)
        if runs and layout is not None and _layout(runs[-1][0]) == layout:
            runs[-1].append(p)
        else:
            runs.append([p])
    drawn: list[Point] = []
    for run in runs:
        one = run[0] if len(run) == 1 else Point(" = ".join(p.label for p in run), [j for p in run for j in p.jobs])
        drawn += [one] * len(run)
    return drawn


def _against_cap(ax: Axes, marks: Axes, field: str, points: Sequence[Point], done: Sequence[JobRow]) -> None:
    """Points on a log cap axis, one line per series, error bars = spread over repeats (and over the caps
    that built the same buckets, drawn as one value: as_drawn)."""
    vary = [f for f in ("sync", "model") if len({getattr(r, f) for r in done}) > 1]
    series: dict[str, list[Point]] = {}
    capped = sorted((p for p in points if p.first.bucket_cap_mb is not None), key=lambda p: p.first.bucket_cap_mb or 0)
    for p in capped:
        name = " ".join([getattr(p.first, f) for f in vary] + _other_overrides(p.first)) or p.first.sync
        series.setdefault(name, []).append(p)
    colors = [f"C{i % 10}" for i in range(len(points) + 1)]
    for color, (label, members) in zip(colors, series.items(), strict=False):
        xs = [p.first.bucket_cap_mb or 0.0 for p in members]
        drawn = as_drawn(members)
        _error_bars(ax, xs, drawn, field, fmt="o-", mfc="none", color=color, label=label)
        for i, one in enumerate(drawn):  # a set of caps drawn as one value: said once, over its span
            if one is not members[i] and (i == 0 or drawn[i - 1] is not one):
                at = [x for x, p in zip(xs, drawn, strict=True) if p is one]
                middle = (at[0] * at[-1]) ** 0.5  # the middle of the span on the log axis
                ax.annotate(
                    "same buckets",
                    (middle, _median(one, field)),
                    xytext=(0, 6),
                    textcoords="offset points",
                    ha="center",
                    fontsize=7,
                    color=color,
                )
        ranks = [(x, v) for x, p in zip(xs, members, strict=True) for j in p.jobs for v in _values(j, field)]
        marks.plot(*zip(*ranks, strict=True), "x", color=color)
    others = [p for p in points if p.first.bucket_cap_mb is None]
    for color, p in zip(colors[len(series) :], others, strict=False):
        r = p.first
        cap = cap_cell(r.bucket_setting, [j.cap_in_use_mb for j in p.jobs])  # `auto (5|1)`: each run's choice
        what = f"buckets {cap}" if cap else "no buckets"
        ax.axhline(_median(p, field), ls="--", color=color, label=f"{r.sync} (job {r.job}, {what})")
        if field == "step_ms":  # rank spread; on throughput the ranks sit at 1/N of the line
            values = [v for j in p.jobs for v in _values(j, field)]
            ax.axhspan(min(values), max(values), color=color, alpha=0.12)
    ax.set_xscale("log")
    ticks = {p.first.bucket_cap_mb or 0.0: p.first for p in capped}
    ax.set_xticks(list(ticks), [f"{t:g}{_layout_line(r)}" for t, r in ticks.items()], fontsize=8)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("bucket_cap_mb (MiB, log scale) and the buckets built")


def _per_point(ax: Axes, marks: Axes, field: str, points: Sequence[Point]) -> None:
    """One bar per point (the median over its repeats) with its spread as an error bar."""
    xs = list(range(len(points)))
    ax.bar(xs, [_median(p, field) for p in points], color="C0", alpha=0.6, label="median over repeats")
    if any(len(p.jobs) > 1 for p in points):
        _error_bars(ax, xs, points, field, fmt="none", color="black", label="min-max over repeats")
    ranks = [(x, v) for x, p in zip(xs, points, strict=True) for j in p.jobs for v in _values(j, field)]
    marks.plot(*zip(*ranks, strict=True), "x", color="black")
    # Many points (a strategy sweep has eleven) would overlap their labels: one slanted line each instead.
    slant = len(points) > 4
    labels = []
    for p in points:
        words = [o for o in p.first.overrides.split() if override_key(o) != REPEAT_KEY]
        jobs = f"job{'s' * (len(p.jobs) > 1)} {','.join(j.job for j in p.jobs)}"
        if slant:
            labels.append(" ".join(words) + f" ({jobs}" + _point_layout_line(p).replace("\n", ", ") + ")")
        else:
            labels.append(f"{jobs}\n" + "\n".join(words) + _point_layout_line(p))
    ax.set_xticks(xs, labels, fontsize=8)
    if slant:
        ax.tick_params(axis="x", labelrotation=30)
        for text in ax.get_xticklabels():
            text.set(ha="right", rotation_mode="anchor")
    ax.set_xlabel("job (overrides)")


def plot(rows: Sequence[JobRow], title: str, points: Sequence[Point] | None = None) -> Figure:
    """Step time and throughput against bucket size (log x) when it varies, else per point; then the time split."""
    done = [r for r in rows if r.status == "ok" and r.step_ms is not None and r.samples_per_s is not None]
    points = [p for p in (gather_points(rows) if points is None else points) if all(j in done for j in p.jobs)]
    on_cap_axis = len({r.bucket_cap_mb for r in done if r.bucket_cap_mb is not None}) >= 2
    fig = Figure(figsize=(19, 5.5))
    FigureCanvasAgg(fig)  # Agg renders to files only, and without pyplot no figure stays alive globally
    axes = fig.subplots(1, 3)
    num_ranks = max((len(r.ranks) for r in done), default=1)
    for ax, field, ylabel in zip(axes[:2], FIELDS, YLABELS, strict=True):
        # Per-rank throughput goes on a right axis scaled 1/N: balanced ranks sit on the job's line.
        marks = ax if field == "step_ms" else ax.twinx()
        if points:
            if on_cap_axis:
                _against_cap(ax, marks, field, points, done)
            else:
                _per_point(ax, marks, field, points)
        ax.plot([], [], "x", color="gray", label="per-rank median" + ("" if marks is ax else " (right axis)"))
        ax.set(ylabel=ylabel, ylim=(0, 1.25 * ax.get_ylim()[1]))  # headroom for the legend
        if marks is not ax:
            marks.set(ylabel=f"per-rank samples/s (= left / {num_ranks})", ylim=(0, ax.get_ylim()[1] / num_ranks))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    draw_time_split(axes[2], done)
    fig.suptitle(title)
    # Under the panels, the terminal's own sentences on caps that built the same buckets.
    below = tie_sentences(rows)
    skipped = [r.job for r in rows if all(r is not d for d in done)]
    if skipped:
        below.append(f"not drawn (incomplete or no timings): job {', '.join(skipped)}")
    for i, line in enumerate(reversed(below)):
        fig.text(0.5, 0.01 + LINE * i, line, ha="center", fontsize=9)
    fig.tight_layout(rect=(0, 0.01 + LINE * max(1, len(below)), 1, 1))
    return fig
