"""timeline.png: per rank a lane of compute phases and a lane of collectives, on one time axis."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402  (after choosing the file-only backend)
from matplotlib.axes import Axes  # noqa: E402

from trainer.logger.timeline_trace import Interval, RankTimeline  # noqa: E402

PHASE_COLOURS = {
    "data": "#bbbbbb",
    "forward": "#8fb3d9",
    "backward": "#3a6ea5",
    "sync": "#f2c14e",
    "optimizer": "#6aa84f",
}
COMM_COLOURS = ("#d1495b", "#edae49")


def short(name: str) -> str:
    """`bucket 3 all_reduce 4.0 MiB` -> `b3 4.0M` (KiB: `K`): what fits on a bar."""
    words = name.split()
    if words[0] == "bucket" and len(words) >= 4:
        return f"b{words[1]} {words[-2]}{words[-1][0]}"
    return words[0] if words else name


def draw_rank(ax: Axes, y: float, timeline: RankTimeline, origin: float, caption: str) -> None:
    """Two lanes at y (compute, above) and y - 1 (communication); backward shaded across both."""
    ms = 1e-3
    for phase in timeline.phases:
        if phase.name == "backward":
            ax.fill_between(
                [(phase.start - origin) * ms, (phase.end - origin) * ms],
                y - 1.45,
                y + 0.45,
                color="#3a6ea5",
                alpha=0.12,
            )
    lane: Sequence[Interval] = timeline.compute if timeline.on_gpu else timeline.phases
    for item in lane:
        colour = PHASE_COLOURS.get(item.name, "#3a6ea5")
        ax.broken_barh([((item.start - origin) * ms, (item.end - item.start) * ms)], (y - 0.35, 0.7), color=colour)
    span = max((c.end for c in timeline.comm), default=origin) - min((c.start for c in timeline.comm), default=origin)
    ends: list[float] = []  # per sub-lane, where its last bar ends: concurrent collectives stack up
    labelled: dict[int, float] = {}  # per sub-lane, where its last label ends (labels never overlap)
    for i, c in enumerate(sorted(timeline.comm, key=lambda c: c.start)):
        sub = next((k for k, end in enumerate(ends) if end <= c.start), len(ends))
        if sub == len(ends):
            ends.append(c.end)
        ends[sub] = c.end
        level = min(sub, 2)
        bottom = y - 1.4 + 0.3 * level
        width = (c.end - c.start) * ms
        colour = COMM_COLOURS[i % 2]
        ax.broken_barh(
            [((c.start - origin) * ms, width)], (bottom, 0.3), color=colour, edgecolor="black", linewidth=0.3
        )
        room = 0.06 * span * ms
        if span and width > room and c.start * ms > labelled.get(level, float("-inf")):
            ax.text(
                (c.start - origin) * ms + width / 2, bottom + 0.15, short(c.name), ha="center", va="center", fontsize=6
            )
            labelled[level] = c.end * ms
    ax.text(1.01, y - 0.5, caption, transform=ax.get_yaxis_transform(), fontsize=7, va="center")


def plot(timelines: Sequence[RankTimeline], captions: Sequence[str], title: str, out: Path) -> None:
    height = 1.4 + 1.2 * len(timelines)
    fig, ax = plt.subplots(figsize=(14, height))
    origin = min(p.start for t in timelines for p in [*t.phases, *t.comm])
    ticks, labels = [], []
    for row, (timeline, caption) in enumerate(zip(timelines, captions, strict=True)):
        y = -2.2 * row
        draw_rank(ax, y, timeline, origin, caption)
        ticks += [y, y - 1]
        labels += [f"rank {timeline.rank} {'kernels' if timeline.on_gpu else 'compute'}", f"rank {timeline.rank} comm"]
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("ms (rank 0's clock)")
    ax.set_title(title, fontsize=9, loc="right")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in (*PHASE_COLOURS.values(), COMM_COLOURS[0])]
    names = [*PHASE_COLOURS, "collective, launch to completion (shaded: backward)"]
    ax.legend(handles, names, fontsize=7, ncol=6, loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    fig.subplots_adjust(left=0.09, right=0.87, top=1 - 0.6 / height, bottom=0.55 / height)
    fig.savefig(out, dpi=110)
    plt.close(fig)
