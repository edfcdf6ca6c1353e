"""Labels on the timeline's bars: each inside its bar where it fits, clear of the others, else
outside with a leader, spread along its lane so that none overlap; and the key of the collectives'
letters under the plot. Placed once the figure has its final layout (text sizes are known only then).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from string import ascii_uppercase

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.transforms import Bbox

from trainer.logger.timeline_figures import spread

LABEL_PAD_PX = 2.0  # a label keeps this much of its bar free on either end
PRIORITY = ["collective label", "phase label", "queued label"]  # who gets a contested spot


@dataclass(frozen=True)
class Bar:
    """A bar (or a part of one) a label may sit in: its axes, its extent in ms and in data units."""

    ax: Axes
    start: float
    end: float
    bottom: float
    top: float


@dataclass(frozen=True)
class Wanted:
    """A label to place: where to try it inside, most informative first (text, the part of the bar,
    the colour behind the text: a leader passing under it stays clear of it), then the text to put
    outside with a leader (None: inside or nowhere), its near edge at callout_y (above the bar if higher)."""

    bar: Bar
    inside: Sequence[tuple[str, Bar, str | None]]
    outside: str | None
    callout_y: float
    gid: str
    colour: str = "black"


@dataclass
class Drawn:
    """What draw_rank put on the axes: the meanings (for the legend), the labels to place, and the
    collectives' letters (for the key)."""

    meanings: list[str] = field(default_factory=list)  # in the order first drawn
    wanted: list[Wanted] = field(default_factory=list)
    letters: dict[str, str] = field(default_factory=dict)  # a collective's name -> its letter

    def add(self, meaning: str) -> None:
        if meaning not in self.meanings:
            self.meanings.append(meaning)

    def letter(self, name: str) -> str:
        """A, B, ..., Z, AA, AB, ... (to ZZ): in the order collectives are first drawn."""
        if name not in self.letters:
            n = len(self.letters)
            self.letters[name] = (ascii_uppercase[n // 26 - 1] if n >= 26 else "") + ascii_uppercase[n % 26]
        return self.letters[name]


def keep_fitting_labels(fig: Figure, drawn: Drawn) -> None:
    """Place every label at the figure's final layout: inside its bar where it fits (clear of the
    labels already there), else outside with a leader, spread along its lane so that none overlap;
    then the key of the collectives' letters under the plot."""
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    for ax in fig.axes:  # labels and leaders must not move what they point at
        ax.set_xlim(ax.get_xlim())
        ax.set_ylim(ax.get_ylim())
    boxes: list[Bbox] = []
    rows: dict[tuple[Axes, float], list[tuple[Wanted, str, float]]] = {}  # each row's outside labels, widths
    for want in sorted(drawn.wanted, key=lambda w: PRIORITY.index(w.gid)):
        ax = want.bar.ax
        for content, bar, behind in want.inside:
            middle = ((bar.start + bar.end) / 2, (bar.bottom + bar.top) / 2)
            text = ax.text(*middle, content, ha="center", va="center", fontsize=6, color=want.colour, gid=want.gid)
            if behind is not None:
                text.set_bbox({"facecolor": behind, "edgecolor": "none", "pad": 0.3})
            box = text.get_window_extent(renderer).padded(LABEL_PAD_PX, 0)
            if fits(box, bar) and not any(box.overlaps(other) for other in boxes):
                boxes.append(box)
                break
            text.remove()
        else:
            if want.outside is not None:
                width = width_ms(ax, want.outside, renderer)
                rows.setdefault((ax, want.callout_y), []).append((want, want.outside, width))
    for (ax, y), row in rows.items():
        wanted = [((w.bar.start + w.bar.end - width) / 2, (w.bar.start + w.bar.end + width) / 2) for w, _, width in row]
        lo, hi = ax.get_xlim()
        for (want, content, width), start in zip(row, spread(wanted, lo, hi), strict=True):
            callout(ax, want.bar, content, start + width / 2, y, want.gid)
    add_key(fig, drawn)


def fits(box: Bbox, bar: Bar) -> bool:
    """Whether a label's box (pixels) lies inside its bar: bars never overlap, so then it is clear of
    every other bar, and of the labels placed outside, which sit beyond the lanes."""
    (left, bottom), (right, top) = bar.ax.transData.inverted().transform([(box.x0, box.y0), (box.x1, box.y1)])
    return bar.start <= left and right <= bar.end and bar.bottom <= bottom and top <= bar.top


def width_ms(ax: Axes, content: str, renderer: object) -> float:
    """A label's width on the time axis, padding included."""
    text = ax.text(0, 0, content, fontsize=5.5)
    width_px = text.get_window_extent(renderer).width + 2 * LABEL_PAD_PX  # type: ignore[arg-type]
    text.remove()
    to_data = ax.transData.inverted()
    return float(to_data.transform((width_px, 0))[0] - to_data.transform((0, 0))[0])


def callout(ax: Axes, bar: Bar, content: str, x: float, y: float, gid: str) -> None:
    """An outside label at x, its near edge at y, and its leader from the middle of the bar's facing edge."""
    above = y > bar.top
    ax.text(x, y, content, ha="center", va="bottom" if above else "top", fontsize=5.5, gid=gid)
    # over the bars (from an upper sub-lane it crosses the lower ones, visibly), under their labels
    edge = bar.top if above else bar.bottom
    leader = Line2D([(bar.start + bar.end) / 2, x], [edge, y], color="#333333", linewidth=0.5, zorder=2, gid="leader")
    ax.add_line(leader)


def add_key(fig: Figure, drawn: Drawn) -> None:
    """The collectives' letters in columns under the plot; the figure grows by the key's height, the
    axes keep their size in inches (the labels placed on them stay where they were measured)."""
    if not drawn.letters:
        return
    entries = [f"{letter}  {name}" for name, letter in drawn.letters.items()]
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    probe = [fig.text(0, 0, e, fontsize=6.5) for e in entries]
    column = max(t.get_window_extent(renderer).width for t in probe) / fig.dpi + 0.3  # inches
    for t in probe:
        t.remove()
    width, height = fig.get_size_inches()
    columns = max(1, min(len(entries), int((width - 0.8) // column)))
    lines = math.ceil(len(entries) / columns)
    line = 6.5 * 1.45 / 72  # inches
    strip = (lines + 1) * line + 0.15
    total = height + strip
    fig.set_size_inches(width, total)
    for ax in fig.axes:
        pos = ax.get_position()
        ax.set_position((pos.x0, (pos.y0 * height + strip) / total, pos.width, pos.height * height / total))
    title = "collectives by their letter on the bars (sizes in bytes: KiB = 1024 B, MiB = 1024 KiB)"
    fig.text(0.4 / width, (strip - 0.05) / total, title, fontsize=6.5, va="top", weight="bold", gid="key title")
    for i, entry in enumerate(entries):  # down the columns: A, B, C read in order
        col, row = divmod(i, lines)
        x, top = (0.4 + col * column) / width, strip - 0.05 - (row + 1) * line
        fig.text(x, top / total, entry, fontsize=6.5, va="top", gid="key entry")
