"""The timeline's picture on a hand-built timeline whose every width is known: one colour per
meaning, a legend of exactly the colours drawn, and text that makes it read without the legend:
each phase named, each collective lettered (in its bar where it fits, outside with a leader where
not) with a key of names and sizes, and the queued part of a collective hatched and said.

(test_timeline.py checks the same on every strategy's real traces.)
"""

from __future__ import annotations

import pytest

from tests.timeline_figure import (
    assert_labels_fit,
    assert_no_bar_hides_another,
    assert_sizes_say_bytes,
    collective_letters,
    drawn_colours,
    expected_phase_texts,
    key,
    labels,
    leaders,
    legend_entries,
    phase_texts,
    rects,
    rgba,
    target,
    to_px,
)
from trainer.logger.timeline_figures import spread
from trainer.logger.timeline_plot import (
    COLLECTIVE,
    COMM_COLOUR,
    KERNELS,
    PHASE_COLOURS,
    PHASE_TEXT,
    QUEUED,
    QUEUED_COLOUR,
    SHADE_ALPHA,
    SHADED,
    Drawn,
    figure,
    lane_names,
)
from trainer.logger.timeline_trace import Interval, RankTimeline

MS = 1000.0  # the timeline's unit is µs


def one_step() -> RankTimeline:
    """data 0-0.05 ms, forward to 10, backward to 50, sync for 0.1 ms, optimizer to 55. Bucket 0
    spans backward (40 ms wide); buckets 1-3 are launched while it runs (four in flight at once: four
    sub-lanes), bucket 1 queued for its first 10 ms; buckets 4-13 are a cluster of 0.2 ms bars after
    it, and bucket 14's 4 ms hold its letter and size but not its name."""
    phases = [
        Interval(n, a * MS, b * MS, 1)
        for n, a, b in [
            ("data", 0, 0.05),
            ("forward", 0.05, 10),
            ("backward", 10, 50),
            ("sync", 50, 50.1),
            ("optimizer", 50.1, 55),
        ]
    ]
    comm = [Interval("bucket 0 all_reduce 4.0 MiB", 12 * MS, 52 * MS, 1)]
    comm += [Interval(f"bucket {i} all_reduce 1.0 MiB", (14 + i) * MS, (44 + i) * MS, 1) for i in (1, 2, 3)]
    comm[1].running_from = 25 * MS
    comm += [
        Interval(f"bucket {i} all_reduce 4.0 KiB", (56 + 0.3 * i) * MS, (56.2 + 0.3 * i) * MS, 1) for i in range(4, 14)
    ]
    comm.append(Interval("bucket 14 all_reduce 2.0 KiB", 61 * MS, 65 * MS, 1))
    return RankTimeline(0, phases=phases, comm=comm, compute=[])


def test_one_colour_per_meaning_and_the_legend_names_each() -> None:
    fig, _ = figure([one_step()], ["caption"], "title")
    ax = fig.axes[0]
    entries = legend_entries(ax)
    assert list(entries) == [*PHASE_COLOURS, QUEUED, COLLECTIVE, SHADED]
    assert len(set(entries.values())) == len(entries)
    assert set(entries.values()) == drawn_colours(ax)
    assert entries[COLLECTIVE] == rgba((*_rgb(COMM_COLOUR), 1.0))
    assert entries[QUEUED] == rgba((*_rgb(QUEUED_COLOUR), 1.0))
    assert entries[SHADED] == rgba((*_rgb(PHASE_COLOURS["backward"]), SHADE_ALPHA))
    running = [c for c in ax.collections if c.get_gid() == "running"]
    assert len(running) == 15 and {rgba(c.get_facecolor()[0]) for c in running} == {entries[COLLECTIVE]}


def test_every_phase_is_named_in_its_bar_or_above_it() -> None:
    timeline = one_step()
    fig, _ = figure([timeline], ["caption"], "title")
    ax = fig.axes[0]
    assert phase_texts(fig, 1) == [expected_phase_texts(timeline)] == [["bwd", "data", "fwd", "opt", "sync"]]
    bars = rects(ax, "phase")
    at = {t.get_text(): target(ax, t, bars) for t in labels(ax, "phase label")}
    for phase in timeline.phases:  # each label names its own bar, not a neighbour's
        assert at[PHASE_TEXT[phase.name]].x0 == pytest.approx(phase.start / MS)
    # sync's 0.1 ms and data's 0.05 ms have no room: above the lane, each with a leader to its bar
    outside = {t.get_text() for t in labels(ax, "phase label") if t.get_position()[1] > 0.25}
    assert outside == {"data", "sync"}
    assert_labels_fit(fig)


def test_every_collective_is_lettered_and_the_key_names_it_with_its_size() -> None:
    timeline = one_step()
    fig, drawn = figure([timeline], ["caption"], "title")
    (row,) = collective_letters(fig, [timeline])
    assert sorted(name for _, name in row) == sorted(c.name for c in timeline.comm)  # each one label
    names = key(fig)
    assert all(names[letter] == name for letter, name in row)
    assert list(names.values()) == list(dict.fromkeys(c.name for c in timeline.comm))  # in launch order
    assert list(names) == list("ABCDEFGHIJKLMNO")
    texts = {t.get_text() for t in labels(fig.axes[0], "collective label")}
    # buckets 0-3's 30-40 ms hold their whole names, bucket 14's 4 ms its size, and the 0.2 ms
    # cluster has no room: its letters sit below the lane, each with a leader
    assert texts == {*(f"{x}: {names[x]}" for x in "ABCD"), "O: 2.0 KiB", *"EFGHIJKLMN"}
    ax = fig.axes[0]
    down = sorted(start[0] for start, end in leaders(ax) if end[1] < start[1])  # the phases' go up
    assert down == pytest.approx([56.1 + 0.3 * i for i in range(4, 14)])  # from the middle of each bar
    assert_sizes_say_bytes(fig)
    assert_no_bar_hides_another(ax)  # four in flight at once: four sub-lanes
    assert_labels_fit(fig)


def test_a_queued_collective_is_hatched_and_said() -> None:
    timeline = one_step()
    fig, _ = figure([timeline], ["caption"], "title")
    ax = fig.axes[0]
    (queued,) = rects(ax, "queued")
    assert (queued.x0, queued.x1) == pytest.approx((15.0, 25.0))  # bucket 1's launch to its start
    (said,) = labels(ax, "queued label")
    box, part = said.get_window_extent(fig.canvas.get_renderer()), to_px(ax, queued)  # type: ignore[attr-defined]
    assert said.get_text() == "queued" and part.x0 <= box.x0 and box.x1 <= part.x1
    assert [t.get_text() for t in ax.get_yticklabels()] == lane_names(timeline)
    assert lane_names(timeline)[1] == "rank 0 comm\n(hatched = queued)"
    timeline.comm[1].running_from = None  # nothing queued: no hatching, and the lane says nothing of it
    fig, _ = figure([timeline], ["caption"], "title")
    assert not rects(fig.axes[0], "queued") and lane_names(timeline)[1] == "rank 0 comm"


def test_on_cuda_the_compute_lane_is_kernels_and_collectives_are_still_lettered() -> None:
    """A GPU timeline: kernels in the compute lane (no phase words: the phases are not drawn), the
    collectives lettered as on CPU, none hatched (the span is the NCCL kernel itself)."""
    timeline = one_step()
    timeline.on_gpu, timeline.comm[1].running_from = True, None
    timeline.compute = [Interval("gemm", (1 + 2 * k) * MS, (2 + 2 * k) * MS, 0) for k in range(20)]
    fig, _ = figure([timeline], ["caption"], "title")
    ax = fig.axes[0]
    assert list(legend_entries(ax)) == [KERNELS, COLLECTIVE, SHADED]
    assert len(rects(ax, "kernel")) == 20 and not labels(ax, "phase label") and not rects(ax, "queued")
    (row,) = collective_letters(fig, [timeline])
    assert sorted(name for _, name in row) == sorted(c.name for c in timeline.comm)
    assert lane_names(timeline) == ["rank 0 kernels", "rank 0 comm"]
    assert_labels_fit(fig)


def test_spread_keeps_labels_apart_and_near_their_bars() -> None:
    assert spread([(0.0, 2.0), (10.0, 12.0)], 0.0, 100.0) == [0.0, 10.0]  # apart already: unmoved
    assert spread([(4.0, 6.0), (4.0, 6.0), (4.0, 6.0)], 0.0, 100.0) == [2.0, 4.0, 6.0]  # centred on their wish
    assert spread([(1.0, 3.0), (0.0, 2.0)], 0.0, 100.0) == [2.0, 0.0]  # by position, whatever the order given
    assert spread([(0.0, 2.0), (0.0, 2.0)], 0.0, 100.0) == [0.0, 2.0]  # kept inside the axis
    assert spread([(98.0, 100.0), (99.0, 101.0)], 0.0, 100.0) == [96.0, 98.0]
    # a run that grows into the next label takes it along
    assert spread([(4.0, 6.0), (4.0, 6.0), (6.5, 8.5)], 0.0, 100.0) == pytest.approx(
        [8.5 / 3, 8.5 / 3 + 2, 8.5 / 3 + 4]
    )
    assert spread([(4.0, 6.0), (4.0, 6.0), (7.0, 9.0)], 0.0, 100.0) == [3.0, 5.0, 7.0]  # touching is apart


def test_letters_run_past_z() -> None:
    drawn = Drawn()
    letters = [drawn.letter(f"c{i}") for i in range(28)]
    assert letters[:3] == ["A", "B", "C"] and letters[25:] == ["Z", "AA", "AB"]
    assert drawn.letter("c1") == "B"  # the same collective, the same letter


def _rgb(hex_colour: str) -> tuple[float, float, float]:
    value = int(hex_colour.lstrip("#"), 16)
    return (value >> 16) / 255, (value >> 8 & 255) / 255, (value & 255) / 255
