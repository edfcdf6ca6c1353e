"""Reading a timeline figure back (tests/test_timeline_plot.py, test_timeline.py): its bars, its
legend and its collective labels, from the matplotlib objects, as a reader would see them."""

from __future__ import annotations

from collections.abc import Iterable

from matplotlib.axes import Axes
from matplotlib.collections import Collection
from matplotlib.figure import Figure
from matplotlib.transforms import Bbox

COMM_HEIGHT = 0.3  # a collective's bar; a compute lane's bar is 0.7 tall


def rgba(colour: Iterable[float]) -> tuple[float, ...]:
    return tuple(round(float(v), 3) for v in colour)


def is_comm(collection: Collection) -> bool:
    (path,) = collection.get_paths()
    return abs(path.get_extents().height - COMM_HEIGHT) < 1e-9


def drawn_colours(ax: Axes) -> set[tuple[float, ...]]:
    """Every fill colour of every bar and shaded span on the axes."""
    return {rgba(c) for collection in ax.collections for c in collection.get_facecolor()}


def legend_entries(ax: Axes) -> dict[str, tuple[float, ...]]:
    legend = ax.get_legend()
    assert legend is not None
    return {
        t.get_text(): rgba(h.get_facecolor()) for t, h in zip(legend.get_texts(), legend.legend_handles, strict=True)
    }


def comm_bars_px(fig: Figure) -> list[Bbox]:
    """Each collective's bar in pixels."""
    return [c.get_paths()[0].get_extents(ax.transData) for ax in fig.axes for c in ax.collections if is_comm(c)]


def bar_labels(fig: Figure) -> list[tuple[str, Bbox]]:
    """The texts placed in data coordinates (the collectives' labels; captions sit on the y axis's transform)."""
    renderer = fig.canvas.get_renderer()
    return [
        (t.get_text(), t.get_window_extent(renderer))
        for ax in fig.axes
        for t in ax.texts
        if t.get_transform() is ax.transData
    ]


def assert_labels_fit(fig: Figure) -> None:
    """Each label lies inside one collective's bar, clear of every other bar and label."""
    bars, labels = comm_bars_px(fig), bar_labels(fig)
    for text, box in labels:
        under = [b for b in bars if b.x0 < box.x1 and box.x0 < b.x1 and b.y0 < box.y1 and box.y0 < b.y1]
        assert len(under) == 1, (text, len(under))
        (bar,) = under
        assert bar.x0 <= box.x0 and box.x1 <= bar.x1, (text, box, bar)
    for i, (text, box) in enumerate(labels):
        assert not any(box.overlaps(other) for _, other in labels[i + 1 :]), text
