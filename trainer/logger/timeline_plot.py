"""timeline.png: per rank a lane of compute phases and a lane of collectives, on one time axis.

One colour per meaning, and the legend lists every colour the figure drew (and nothing else):
collectives are all one red, told apart by their black edges, not by a second colour that could
be read as another phase. A collective's label is kept only where, at the size it is saved, it
fits inside its bar: a cluster of tiny bars goes unlabelled rather than under a pile of text.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from trainer.logger.timeline_trace import Interval, RankTimeline

PHASE_COLOURS = {
    "data": "#bbbbbb",
    "forward": "#8fb3d9",
    "backward": "#3a6ea5",
    "sync": "#f2c14e",
    "optimizer": "#6aa84f",
}
KERNEL_COLOUR = "#7b5ea7"  # on CUDA the compute lane holds kernels, not phases
COMM_COLOUR = "#d1495b"
SHADE_ALPHA = 0.12  # backward's span, shaded across both lanes in backward's colour
KERNELS = "compute kernel (CUDA)"
COLLECTIVE = "collective, launch to completion"
SHADED = "backward's span (shaded)"
LABEL_PAD_PX = 2.0  # a label keeps this much of its bar free on either side


@dataclass(frozen=True)
class Bar:
    """A collective's bar: its axes, its sub-lane's bottom (data units) and its extent in ms."""

    ax: Axes
    bottom: float
    start: float
    end: float


@dataclass
class Drawn:
    """What draw_rank put on one axes: the meanings, for the legend, and the collectives' labels."""

    meanings: list[str] = field(default_factory=list)  # in the order first drawn
    bars: list[Bar] = field(default_factory=list)  # every collective's bar
    labels: list[tuple[Text, Bar]] = field(default_factory=list)  # a label and the bar it names

    def add(self, meaning: str) -> None:
        if meaning not in self.meanings:
            self.meanings.append(meaning)


def short(name: str) -> str:
    """`bucket 3 all_reduce 4.0 MiB` -> `b3 4.0M` (KiB: `K`): what fits on a bar."""
    words = name.split()
    if words[0] == "bucket" and len(words) >= 4:
        return f"b{words[1]} {words[-2]}{words[-1][0]}"
    return words[0] if words else name


def lane_names(timeline: RankTimeline) -> list[str]:
    """The y tick labels of a rank's two lanes."""
    return [f"rank {timeline.rank} {'kernels' if timeline.on_gpu else 'compute'}", f"rank {timeline.rank} comm"]


def draw_rank(ax: Axes, y: float, timeline: RankTimeline, origin: float, caption: str, drawn: Drawn) -> None:
    """Two lanes at y (compute, above) and y - 1 (communication); backward shaded across both."""
    ms = 1e-3
    for phase in timeline.phases:
        if phase.name == "backward":
            start, end = (phase.start - origin) * ms, (phase.end - origin) * ms
            ax.fill_between([start, end], y - 1.45, y + 0.45, color=PHASE_COLOURS["backward"], alpha=SHADE_ALPHA)
            drawn.add(SHADED)
    lane: Sequence[Interval] = timeline.compute if timeline.on_gpu else timeline.phases
    for item in lane:
        meaning = KERNELS if timeline.on_gpu else item.name
        colour = KERNEL_COLOUR if timeline.on_gpu else PHASE_COLOURS[item.name]
        ax.broken_barh([((item.start - origin) * ms, (item.end - item.start) * ms)], (y - 0.35, 0.7), color=colour)
        drawn.add(meaning)
    ends: list[float] = []  # per sub-lane, where its last bar ends: concurrent collectives stack up
    for c in sorted(timeline.comm, key=lambda c: c.start):
        sub = next((k for k, end in enumerate(ends) if end <= c.start), len(ends))
        if sub == len(ends):
            ends.append(c.end)
        ends[sub] = c.end
        bottom = y - 1.4 + 0.3 * min(sub, 2)
        start, width = (c.start - origin) * ms, (c.end - c.start) * ms
        ax.broken_barh([(start, width)], (bottom, 0.3), color=COMM_COLOUR, edgecolor="black", linewidth=0.4)
        drawn.add(COLLECTIVE)
        bar = Bar(ax, bottom, start, start + width)
        drawn.bars.append(bar)
        label = ax.text(start + width / 2, bottom + 0.15, short(c.name), ha="center", va="center", fontsize=6)
        drawn.labels.append((label, bar))
    ax.text(1.01, y - 0.5, caption, transform=ax.get_yaxis_transform(), fontsize=7, va="center")


def legend_handles(meanings: Sequence[str]) -> list[Patch]:
    """One patch per meaning, in the figure's own colours (phases first, in their step order)."""
    colours = {**PHASE_COLOURS, KERNELS: KERNEL_COLOUR, COLLECTIVE: COMM_COLOUR}
    order = [*PHASE_COLOURS, KERNELS, COLLECTIVE, SHADED]
    handles = []
    for meaning in sorted(meanings, key=order.index):
        if meaning == SHADED:
            handles.append(Patch(color=PHASE_COLOURS["backward"], alpha=SHADE_ALPHA, label=meaning))
        else:
            handles.append(Patch(color=colours[meaning], label=meaning))
    return handles


def keep_fitting_labels(fig: Figure, drawn: Drawn) -> None:
    """Remove each label that does not fit inside its bar at the figure's final layout: wider than
    the bar, over another bar (more than three concurrent collectives share the top sub-lane), or
    closer than the padding to a label already kept."""
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    kept: list[tuple[Text, Bar]] = []
    boxes: list[Bbox] = []
    for text, bar in drawn.labels:
        box = text.get_window_extent(renderer).padded(LABEL_PAD_PX)
        to_ms = bar.ax.transData.inverted()
        left, right = to_ms.transform([(box.x0, 0.0), (box.x1, 0.0)])[:, 0]
        inside = bar.start <= left and right <= bar.end
        covered = any(
            b is not bar and b.ax is bar.ax and b.bottom == bar.bottom and b.start < right and left < b.end
            for b in drawn.bars
        )
        if inside and not covered and not any(box.overlaps(other) for other in boxes):
            kept.append((text, bar))
            boxes.append(box)
        else:
            text.remove()
    drawn.labels = kept


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)  # Agg renders to files only, and without pyplot no figure stays alive globally
    return fig


def figure(timelines: Sequence[RankTimeline], captions: Sequence[str], title: str) -> tuple[Figure, Drawn]:
    height = 1.4 + 1.2 * len(timelines)
    fig = new_figure(14, height)
    ax = fig.subplots()
    origin = min(p.start for t in timelines for p in [*t.phases, *t.comm])
    ticks, labels, drawn = [], [], Drawn()
    for row, (timeline, caption) in enumerate(zip(timelines, captions, strict=True)):
        y = -2.2 * row
        draw_rank(ax, y, timeline, origin, caption, drawn)
        ticks += [y, y - 1]
        labels += lane_names(timeline)
    ax.set_yticks(ticks, labels, fontsize=8)
    ax.set_xlabel("ms (rank 0's clock)")
    ax.set_title(title, fontsize=9, loc="right", pad=18)
    handles = legend_handles(drawn.meanings)
    ax.legend(handles=handles, fontsize=7, ncol=len(handles), loc="lower left", bbox_to_anchor=(0, 1.0), frameon=False)
    fig.subplots_adjust(left=0.09, right=0.87, top=1 - 0.75 / height, bottom=0.55 / height)
    keep_fitting_labels(fig, drawn)
    return fig, drawn


def plot(timelines: Sequence[RankTimeline], captions: Sequence[str], title: str, out: Path) -> None:
    figure(timelines, captions, title)[0].savefig(out, dpi=110)
