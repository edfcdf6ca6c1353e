"""timeline.png: per rank a lane of compute phases and a lane of collectives, on one time axis,
written so that it reads without its legend.

- Each phase bar says which phase it is (data, fwd, bwd, sync, opt) inside it, or just above it with
  a leader where the bar is too narrow: sync and the optimizer are not told apart by colour alone.
- A collective's bar runs from its launch to its completion; the part before the backend took it
  up (timeline_trace.py: queued) is pale and hatched, the part it ran solid, and the lane's name
  says "hatched = queued". Hatching rather than a gap or a separate lane: the bar still starts at
  the launch, which is what overlap with backward is about, while two stacked bars read as running
  at once only where both are solid, so a bucket waiting behind others is not mistaken for one
  sent in parallel; with one sub-lane per collective in flight, a queue of buckets is a staircase
  of hatched waits. Where the queued part is wide enough it also says "queued".
- Every collective carries a letter, the same for the same collective (bucket or unit, kind, size)
  in every step, rank and job; a key under the plot gives each letter's collective with its size in
  bytes (KiB and MiB are binary, as bucket_cap_mb is). The letter sits in the bar, with the name or
  the size where those fit too, or below the lane with a leader where the bar is too narrow: every
  bar can be told, however dense the cluster.
One colour per meaning, and the legend lists every colour drawn (and nothing else). Where each
label goes, once the figure is laid out, is trainer/logger/timeline_labels.py's.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from trainer.logger.timeline_labels import Bar, Drawn, Wanted, keep_fitting_labels
from trainer.logger.timeline_trace import RankTimeline

PHASE_COLOURS = {
    "data": "#bbbbbb",
    "forward": "#8fb3d9",
    "backward": "#3a6ea5",
    "sync": "#f2c14e",
    "optimizer": "#6aa84f",
}
PHASE_TEXT = {"data": "data", "forward": "fwd", "backward": "bwd", "sync": "sync", "optimizer": "opt"}
KERNEL_COLOUR = "#7b5ea7"  # on CUDA the compute lane holds kernels, not phases
COMM_COLOUR = "#d1495b"
QUEUED_COLOUR = "#f6d5da"  # the collectives' red, pale
QUEUED_EDGE = "#e3909a"  # its hatching: light enough for a label drawn across it to stay legible
QUEUED_HATCH = "////"
SHADE_ALPHA = 0.12  # backward's span, shaded across both lanes in backward's colour
KERNELS = "compute kernel (CUDA)"
COLLECTIVE = "collective, running to completion"
QUEUED = "collective, queued (launched, not yet taken up)"
SHADED = "backward's span (shaded)"
ROW_PITCH = 2.2  # data units from one rank's compute lane to the next's; its comm lane sits 1 below
HALF = 0.25  # half a compute bar's height
SUB_LANE = 0.3  # a collective's bar, at most: concurrent collectives stack in sub-lanes
COMM_HEIGHT = 0.9  # all of a comm lane's sub-lanes, about centred on its tick
COMM_BOTTOM = -1.4  # the lowest sub-lane's bottom, from the compute lane's centre
CALLOUT_GAP = 0.08  # between a bar's edge and an outside label's near edge: the leader's room
SIZE = re.compile(r"\d+(?:\.\d+)? [KMG]iB")


def lane_names(timeline: RankTimeline) -> list[str]:
    """The y tick labels of a rank's two lanes."""
    queued = "\n(hatched = queued)" if any(c.running_from is not None for c in timeline.comm) else ""
    return [f"rank {timeline.rank} {'kernels' if timeline.on_gpu else 'compute'}", f"rank {timeline.rank} comm{queued}"]


def draw_rank(ax: Axes, y: float, timeline: RankTimeline, origin: float, caption: str, drawn: Drawn) -> None:
    """Two lanes at y (compute, above) and y - 1 (communication); backward shaded across both."""

    def ms(t: float) -> float:
        return (t - origin) * 1e-3

    first = ms(timeline.phases[0].start)
    ax.update_datalim([(first, y + 0.6), (first, y - 1.75)])  # room above and below for labels put outside
    for phase in timeline.phases:
        if phase.name == "backward":
            span, colour = [ms(phase.start), ms(phase.end)], PHASE_COLOURS["backward"]
            ax.fill_between(span, y + COMM_BOTTOM - 0.05, y + HALF + 0.05, color=colour, alpha=SHADE_ALPHA, gid="shade")
            drawn.add(SHADED)
    for item in timeline.compute if timeline.on_gpu else timeline.phases:
        colour = KERNEL_COLOUR if timeline.on_gpu else PHASE_COLOURS[item.name]
        gid = "kernel" if timeline.on_gpu else "phase"
        ax.broken_barh([(ms(item.start), ms(item.end) - ms(item.start))], (y - HALF, 2 * HALF), color=colour, gid=gid)
        drawn.add(KERNELS if timeline.on_gpu else item.name)
        if not timeline.on_gpu:  # a kernel is too short for a word, and no label goes near the kernels
            bar = Bar(ax, ms(item.start), ms(item.end), y - HALF, y + HALF)
            text, colour = PHASE_TEXT[item.name], "white" if item.name == "backward" else "black"
            drawn.wanted.append(Wanted(bar, [(text, bar, None)], text, y + HALF + CALLOUT_GAP, "phase label", colour))
    ends: list[float] = []  # per sub-lane, where its last bar ends: concurrent collectives stack up
    subs = []
    for c in sorted(timeline.comm, key=lambda c: c.start):
        sub = next((k for k, end in enumerate(ends) if end <= c.start), len(ends))
        ends[sub : sub + 1] = [c.end]
        subs.append((c, sub))
    # As many sub-lanes as collectives in flight at once, thinner when many: no bar hides another
    # (a pile of overlapping bars looks concurrent), and a label inside its own bar is over no other.
    height = min(SUB_LANE, COMM_HEIGHT / max(1, len(ends)))
    for c, sub in subs:
        bottom = y + COMM_BOTTOM + height * sub
        bar = Bar(ax, ms(c.start), ms(c.end), bottom, bottom + height)
        running = bar.start if c.running_from is None else ms(c.running_from)
        draw_collective(bar, c.name, running, y + COMM_BOTTOM - CALLOUT_GAP, drawn)
    ax.text(1.01, y - 0.5, caption, transform=ax.get_yaxis_transform(), fontsize=7, va="center")


def draw_collective(bar: Bar, name: str, running: float, callout_y: float, drawn: Drawn) -> None:
    """A collective's bar, hatched until it runs, and the labels it wants: its letter, with its name
    or its size where they fit, on the solid part before the whole bar (clear of the hatching)."""
    ax, height, parts = bar.ax, (bar.bottom, bar.top - bar.bottom), [(bar, COMM_COLOUR)]
    if running > bar.start:
        queued = replace(bar, end=running)
        ax.broken_barh(
            [(bar.start, running - bar.start)],
            height,
            facecolor=QUEUED_COLOUR,
            edgecolor=QUEUED_EDGE,
            hatch=QUEUED_HATCH,
            linewidth=0.4,
            gid="queued",
        )
        drawn.add(QUEUED)
        drawn.wanted.append(Wanted(queued, [("queued", queued, QUEUED_COLOUR)], None, callout_y, "queued label"))
        behind = COMM_COLOUR if (bar.start + bar.end) / 2 >= running else QUEUED_COLOUR  # at the bar's middle
        parts = [(replace(bar, start=running), COMM_COLOUR), (bar, behind)]
    ax.broken_barh(
        [(running, bar.end - running)], height, facecolor=COMM_COLOUR, edgecolor="black", linewidth=0.4, gid="running"
    )
    drawn.add(COLLECTIVE)
    letter = drawn.letter(name)
    texts = [f"{letter}: {name}", *(f"{letter}: {size}" for size in SIZE.findall(name)[-1:]), letter]
    inside = [(text, part, colour) for text in texts for part, colour in parts]
    drawn.wanted.append(Wanted(bar, inside, letter, callout_y, "collective label"))


def legend_handles(meanings: Sequence[str]) -> list[Patch]:
    """One patch per meaning, in the figure's own colours (phases first, in their step order)."""
    colours = {**PHASE_COLOURS, KERNELS: KERNEL_COLOUR, COLLECTIVE: COMM_COLOUR}
    order = [*PHASE_COLOURS, KERNELS, QUEUED, COLLECTIVE, SHADED]
    handles = []
    for meaning in sorted(meanings, key=order.index):
        if meaning == SHADED:
            handles.append(Patch(color=PHASE_COLOURS["backward"], alpha=SHADE_ALPHA, label=meaning))
        elif meaning == QUEUED:
            handles.append(Patch(facecolor=QUEUED_COLOUR, edgecolor=QUEUED_EDGE, hatch=QUEUED_HATCH, label=meaning))
        else:
            handles.append(Patch(color=colours[meaning], label=meaning))
    return handles


def new_figure(width: float, height: float) -> Figure:
    fig = Figure(figsize=(width, height))
    FigureCanvasAgg(fig)  # Agg renders to files only, and without pyplot no figure stays alive globally
    return fig


def figure(timelines: Sequence[RankTimeline], captions: Sequence[str], title: str) -> tuple[Figure, Drawn]:
    height = 1.6 + 1.5 * len(timelines)
    fig = new_figure(14, height)
    ax = fig.subplots()
    origin = min(p.start for t in timelines for p in [*t.phases, *t.comm])
    ticks, labels, drawn = [], [], Drawn()
    for row, (timeline, caption) in enumerate(zip(timelines, captions, strict=True)):
        y = -ROW_PITCH * row
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
