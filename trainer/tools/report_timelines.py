"""report --timelines: the jobs' timelines one above the other, on one time scale.

Each job is drawn from its own first profiled step (jobs are separate runs: only durations
compare), every job with the same ms per inch, so that, in a bucket sweep, many small buckets
sent during backward stand against one large bucket sent after it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from pathlib import Path

from matplotlib.figure import Figure

from trainer.logger import timeline
from trainer.logger.timeline_labels import Drawn, keep_fitting_labels
from trainer.logger.timeline_plot import draw_rank, lane_names, legend_handles, new_figure
from trainer.logger.timeline_trace import RankTimeline, TimelineError


def profiled_step_ms(timelines: Sequence[RankTimeline]) -> float | None:
    """The drawn steps' median length, defined as the report's step ms is (per rank the median over its
    steps of first phase start to last phase end, then the median over ranks): what the picture shows,
    beside the table's, which leaves these profiled steps out."""
    per_rank = []
    for t in timelines:
        steps: dict[int, tuple[float, float]] = {}
        for p in t.phases:
            start, end = steps.get(p.step, (p.start, p.end))
            steps[p.step] = (min(start, p.start), max(end, p.end))
        if steps:
            per_rank.append(statistics.median((end - start) / 1e3 for start, end in steps.values()))
    return statistics.median(per_rank) if per_rank else None


def _steps(steps: Sequence[int]) -> str:
    """`3-5` for consecutive steps, else `3, 5`."""
    if len(steps) > 1 and list(steps) == list(range(steps[0], steps[-1] + 1)):
        return f"{steps[0]}-{steps[-1]}"
    return ", ".join(map(str, steps))


def figure(jobs: Sequence[tuple[str, Path]], table_ms: Sequence[float | None] = ()) -> tuple[Figure, Drawn, list[str]]:
    """The figure of every job's traces, what it drew, and one line per job (its figures: the drawn
    steps' median beside `table_ms`, the report's step ms of that job, where given)."""
    loaded = []
    for label, path in jobs:
        try:
            timelines, steps = timeline.load(path, None, None)
        except TimelineError as err:
            raise TimelineError(f"job {path.name}: {err}") from None
        summary = timeline.figures(timelines, steps)
        loaded.append((label, timelines, summary, steps))
    lanes = sum(len(t) for _, t, _, _ in loaded)
    fig = new_figure(14, 1.0 + 1.3 * lanes)
    axes = fig.subplots(len(loaded), 1, sharex=True, squeeze=False)
    lines, drawn = [], Drawn()
    tables = [*table_ms, *[None] * (len(loaded) - len(table_ms))]
    for ax, (label, timelines, summary, steps), table in zip(axes[:, 0], loaded, tables, strict=True):
        origin = min(p.start for t in timelines for p in [*t.phases, *t.comm])
        ticks, names = [], []
        for row, t in enumerate(timelines):
            y = -2.2 * row
            draw_rank(ax, y, t, origin, timeline.caption(summary["ranks"][str(t.rank)], []), drawn)
            ticks += [y, y - 1]
            names += lane_names(t)
        ax.set_yticks(ticks, names, fontsize=7)
        # The first job's title sits above the legend row, which spans the axes' width.
        ax.set_title(label, fontsize=8, loc="left", pad=16 if ax is axes[0, 0] else 6)
        overlaps = ", ".join(f"rank {r} {timeline.percent(v['overlap'])}" for r, v in summary["ranks"].items())
        drawn_ms = profiled_step_ms(timelines)
        length = "" if drawn_ms is None else f", median step {drawn_ms:.2f} ms"
        beside = "" if table is None or drawn_ms is None else f" (the table's, without them: {table:.2f} ms)"
        lines.append(f"{label}: profiled steps {_steps(steps)}{length}{beside}; HTA overlap {overlaps}")
    handles = legend_handles(drawn.meanings)
    legend = {"fontsize": 7, "ncol": len(handles), "loc": "lower right", "bbox_to_anchor": (1, 1.0), "frameon": False}
    axes[0, 0].legend(handles=handles, **legend)
    axes[-1, 0].set_xlabel("ms from each job's first profiled step")
    fig.tight_layout()
    keep_fitting_labels(fig, drawn)
    return fig, drawn, lines


def plot_timelines(jobs: Sequence[tuple[str, Path]], out: Path, table_ms: Sequence[float | None] = ()) -> list[str]:
    """timelines.png in `out` from every job's traces; returns one line per job (its figures)."""
    fig, _, lines = figure(jobs, table_ms)
    fig.savefig(out / "timelines.png", dpi=110)
    return lines
