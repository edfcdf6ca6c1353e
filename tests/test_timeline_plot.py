"""The timeline's picture on a hand-built timeline whose every width is known: one colour per
meaning, a legend of exactly the colours drawn, and labels only on bars they fit in.

(test_timeline.py checks the same on every strategy's real traces.)
"""

from __future__ import annotations

from tests.timeline_figure import assert_labels_fit, bar_labels, drawn_colours, is_comm, legend_entries, rgba
from trainer.logger.timeline_plot import (
    COLLECTIVE,
    COMM_COLOUR,
    PHASE_COLOURS,
    SHADE_ALPHA,
    SHADED,
    figure,
)
from trainer.logger.timeline_trace import Interval, RankTimeline

MS = 1000.0  # the timeline's unit is µs


def one_step() -> RankTimeline:
    """forward 0-10 ms, backward 10-50, optimizer 50-55; bucket 0 spans backward (40 ms wide),
    buckets 1-3 run concurrently with it (the fourth collective at once shares the top sub-lane
    with the third, so their bars overlap), and buckets 4-13 are a cluster of 0.2 ms bars after it."""
    phases = [
        Interval(n, a * MS, b * MS, 1) for n, a, b in [("forward", 0, 10), ("backward", 10, 50), ("optimizer", 50, 55)]
    ]
    comm = [Interval("bucket 0 all_reduce 4.0 MiB", 12 * MS, 52 * MS, 1)]
    comm += [Interval(f"bucket {i} all_reduce 1.0 MiB", (14 + i) * MS, (44 + i) * MS, 1) for i in (1, 2, 3)]
    comm += [
        Interval(f"bucket {i} all_reduce 4.0 KiB", (56 + 0.3 * i) * MS, (56.2 + 0.3 * i) * MS, 1) for i in range(4, 14)
    ]
    return RankTimeline(0, phases=phases, comm=comm, compute=[])


def test_one_colour_per_meaning_and_the_legend_names_each() -> None:
    fig, _ = figure([one_step()], ["caption"], "title")
    ax = fig.axes[0]
    entries = legend_entries(ax)
    assert list(entries) == ["forward", "backward", "optimizer", COLLECTIVE, SHADED]  # none of data, sync: not drawn
    assert len(set(entries.values())) == len(entries)
    assert set(entries.values()) == drawn_colours(ax)
    assert entries[COLLECTIVE] == rgba((*_rgb(COMM_COLOUR), 1.0))
    assert entries[SHADED] == rgba((*_rgb(PHASE_COLOURS["backward"]), SHADE_ALPHA))
    comm = [c for c in ax.collections if is_comm(c)]
    assert len(comm) == 14 and {rgba(c.get_facecolor()[0]) for c in comm} == {entries[COLLECTIVE]}


def test_labels_only_where_they_fit() -> None:
    fig, drawn = figure([one_step()], ["caption"], "title")
    # bucket 0 and bucket 1 (30 ms, its own sub-lane) are labelled; 2 and 3 overlap in the top
    # sub-lane, and the 0.2 ms cluster has no room: no label on any of them.
    assert [text for text, _ in bar_labels(fig)] == ["b0 4.0M", "b1 1.0M"]
    assert [t.get_text() for t, _ in drawn.labels] == ["b0 4.0M", "b1 1.0M"]
    assert_labels_fit(fig)


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    value = int(hex_colour.lstrip("#"), 16)
    return (value >> 16) / 255, (value >> 8 & 255) / 255, (value & 255) / 255
