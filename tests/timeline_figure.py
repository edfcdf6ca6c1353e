"""Reading a timeline figure back (tests/test_timeline_plot.py, test_timeline.py): its bars, legend,
labels, leaders and key, from the matplotlib objects, as a reader would see them."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.patches import Patch
from matplotlib.text import Text
from matplotlib.transforms import Bbox

from trainer.logger.timeline_plot import PHASE_TEXT, ROW_PITCH
from trainer.logger.timeline_trace import RankTimeline

LABELS = ("collective label", "phase label", "queued label")
UNIT = re.compile(r"\d+\.\d (KiB|MiB|GiB)|\d+ B\b")  # a size as the figure writes it: bytes, binary units
BARE = re.compile(r"\d(\.\d+)?[KMGB]\b")  # a size without its unit's space and name: `0.7M`


def rgba(colour: Any) -> tuple[float, ...]:
    """A colour as comparable numbers (matplotlib hands them back as arrays or tuples)."""
    return tuple(round(float(v), 3) for v in colour)


def rects(ax: Axes, *gids: str) -> list[Bbox]:
    """The bars drawn with these gids, in data units (one rectangle per collection)."""
    return [c.get_paths()[0].get_extents() for c in ax.collections if c.get_gid() in gids]


def collective_bars(ax: Axes) -> list[Bbox]:
    """Each collective's whole bar, launch to completion: its solid part, joined to the hatched part
    that ends where it starts."""
    queued = rects(ax, "queued")
    bars = []
    for run in rects(ax, "running"):
        before = [q for q in queued if q.y0 == run.y0 and abs(q.x1 - run.x0) < 1e-9]
        bars.append(Bbox.from_extents(before[0].x0 if before else run.x0, run.y0, run.x1, run.y1))
    return bars


def assert_no_bar_hides_another(ax: Axes) -> None:
    """No two collectives' bars overlap: stacked ones would look concurrent, and one could hide another."""
    bars = sorted(collective_bars(ax), key=lambda b: b.x0)
    for i, bar in enumerate(bars):
        for other in bars[i + 1 :]:
            if other.x0 >= bar.x1:
                break
            assert not (other.y0 < bar.y1 - 1e-9 and bar.y0 < other.y1 - 1e-9), (bar, other)  # touching is apart


def drawn_colours(ax: Axes) -> set[tuple[float, ...]]:
    """Every fill colour of every bar and shaded span on the axes."""
    return {rgba(c) for collection in ax.collections for c in collection.get_facecolor()}


def legend_entries(ax: Axes) -> dict[str, tuple[float, ...]]:
    legend = ax.get_legend()
    assert legend is not None
    handles = [h for h in legend.legend_handles if isinstance(h, Patch)]
    assert len(handles) == len(legend.legend_handles)
    return {t.get_text(): rgba(h.get_facecolor()) for t, h in zip(legend.get_texts(), handles, strict=True)}


def labels(ax: Axes, *gids: str) -> list[Text]:
    return [t for t in ax.texts if t.get_gid() in (gids or LABELS)]


def key(fig: Figure) -> dict[str, str]:
    """The key under the plot: each letter's collective."""
    entries = [t.get_text().split("  ", 1) for t in fig.texts if t.get_gid() == "key entry"]
    return {letter: name for letter, name in entries}


def row_of(y: float) -> int:
    """The rank row (0 at the top) a label or bar at data height y belongs to: from its compute lane's
    centre up to the next row's callouts above, down to its own callouts below the comm lane."""
    return round(-(y + 0.6) / ROW_PITCH)


def to_px(ax: Axes, box: Bbox) -> Bbox:
    return Bbox(ax.transData.transform(box.get_points()))


def target(ax: Axes, text: Text, bars: Sequence[Bbox]) -> Bbox:
    """The bar a label names: the one it sits in, or the one its leader starts from (at the bar's
    middle, on its edge facing the label)."""
    x, y = text.get_position()
    inside = [b for b in bars if b.x0 <= x <= b.x1 and b.y0 <= y <= b.y1]
    if inside:
        assert len(inside) == 1, (text.get_text(), inside)
        return inside[0]
    (leader,) = [ends for ends in leaders(ax) if tuple(ends[-1]) == (x, y)]
    (bx, by) = leader[0]
    (bar,) = [b for b in bars if abs((b.x0 + b.x1) / 2 - bx) < 1e-9 and min(abs(by - b.y0), abs(by - b.y1)) < 1e-9]
    return bar


def leaders(ax: Axes) -> list[np.ndarray]:
    """Each leader's two ends (its bar's, its label's), in data units."""
    return [np.asarray(line.get_xydata(), dtype=float) for line in ax.lines if line.get_gid() == "leader"]


def assert_labels_fit(fig: Figure) -> None:
    """Each label lies inside one bar, its own (a "queued" inside its hatched part), clear of every
    other; or clear of every bar, with a leader from its bar. No two labels overlap."""
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    for ax in fig.axes:
        bars = [*collective_bars(ax), *rects(ax, "phase", "kernel")]
        px = [to_px(ax, b) for b in bars]
        boxes = [(t, t.get_window_extent(renderer)) for t in labels(ax)]
        for text, box in boxes:
            under = [p for p in px if p.x0 < box.x1 and box.x0 < p.x1 and p.y0 < box.y1 and box.y0 < p.y1]
            mine = to_px(ax, target(ax, text, bars))
            assert [p.bounds for p in under] in ([], [mine.bounds]), (text.get_text(), under, mine)
            if under:
                if text.get_gid() == "queued label":
                    mine = [to_px(ax, q) for q in rects(ax, "queued") if q.contains(*text.get_position())][0]
                assert mine.x0 <= box.x0 and box.x1 <= mine.x1, (text.get_text(), box, mine)
                assert mine.y0 <= box.y0 and box.y1 <= mine.y1, (text.get_text(), box, mine)
        for i, (text, box) in enumerate(boxes):
            assert not any(box.overlaps(other) for _, other in boxes[i + 1 :]), text.get_text()


def assert_sizes_say_bytes(fig: Figure) -> None:
    """Every size written names its unit: each key entry's collective, and each label (a letter, the
    letter and its collective's name, or the letter and that name's size)."""
    names = key(fig)
    assert names and all(UNIT.search(name) for name in names.values()), names
    for ax in fig.axes:
        for text in labels(ax, "collective label"):
            letter, _, rest = text.get_text().partition(": ")
            assert rest in ("", names[letter]) or (UNIT.fullmatch(rest) and rest in names[letter]), text.get_text()
    for text in [*fig.texts, *(t for ax in fig.axes for t in labels(ax))]:
        assert not BARE.search(text.get_text()), text.get_text()


def origin_of(timelines: Sequence[RankTimeline]) -> float:
    """The figure's time 0: the earliest phase or collective (µs)."""
    return min(p.start for t in timelines for p in [*t.phases, *t.comm])


def collective_letters(fig: Figure, timelines: Sequence[RankTimeline]) -> list[list[tuple[str, str]]]:
    """Per rank row, each collective label's letter and the name of the collective whose bar it
    names, matched by the bar's extent against the timeline's own intervals."""
    (ax,) = fig.axes
    origin, bars = origin_of(timelines), collective_bars(ax)
    rows: list[list[tuple[str, str]]] = [[] for _ in timelines]
    for text in labels(ax, "collective label"):
        bar = target(ax, text, bars)
        row = row_of(bar.y0)
        (named,) = [
            c.name
            for c in timelines[row].comm
            if abs((c.start - origin) * 1e-3 - bar.x0) < 1e-6 and abs((c.end - origin) * 1e-3 - bar.x1) < 1e-6
        ]
        rows[row].append((text.get_text().split(":")[0], named))
    return rows


def phase_texts(fig: Figure, count: int) -> list[list[str]]:
    """Per rank row, the phase labels' texts, sorted."""
    (ax,) = fig.axes
    rows: list[list[str]] = [[] for _ in range(count)]
    for text in labels(ax, "phase label"):
        rows[row_of(text.get_position()[1])].append(text.get_text())
    return [sorted(r) for r in rows]


def expected_phase_texts(timeline: RankTimeline) -> list[str]:
    return sorted(PHASE_TEXT[p.name] for p in timeline.phases)
