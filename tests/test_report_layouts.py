"""The sweep report's honesty: the buckets each job built, identical layouts marked and warned about,
repeats gathered into points with their spread (and repeats that chose different caps under
bucket_cap_mb=auto), and the overlap sentence (the per-job time split:
test_report_time_split.py). Every expected number below is worked by hand from the hand-written rows."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest

from tests.report_helpers import (
    DDP,
    MANUAL,
    markdown_header,
    markdown_rows,
    printed_columns,
    train_row,
    unwrapped,
    write_job,
)
from trainer.tools.report import find_jobs, main
from trainer.tools.report_layout import axis_warning, bucket_layout, format_layout
from trainer.tools.report_plot import plot
from trainer.tools.report_points import gather_points, spread_sentences
from trainer.tools.report_rows import build_rows

THREE = [37883944, 37761024, 405504]  # the old bucket_sweep's layout at caps 1, 5 and 25


def ddp_job(
    root: Path, num: int, cap: float, step_s: float, sizes: list[int] | None, repeat: int | None = None
) -> None:
    overrides = ([f"+repeat={repeat}"] if repeat is not None else []) + [f"sync.bucket_cap_mb={cap:g}"]
    ranks = [[train_row(10, step_s, 0.0, 100, 1.0)], [train_row(10, step_s, 0.0, 100, 1.0)]]
    write_job(root / str(num), ranks, DDP, ["sync=ddp", *overrides, "logger=none"], cap, bucket_sizes=sizes)


def test_identical_layouts_are_marked_and_warned(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "sweep"
    for num, (cap, ms) in enumerate([(1, 0.18), (5, 0.31), (25, 0.19)]):
        ddp_job(root, num, cap, ms, THREE)
    rows = build_rows(find_jobs(root))
    assert [r.bucket_sizes for r in rows] == [tuple(THREE)] * 3
    assert [r.same_buckets_as for r in rows] == ["", "cap 1", "cap 1"]
    warning = axis_warning(rows)
    assert warning is not None and "bucket_cap_mb 1, 5 and 25 all give the same buckets" in warning
    assert main([str(root)]) == 0
    printed = capsys.readouterr().out
    assert printed.count("warning: bucket_cap_mb") == 1
    cells = markdown_rows((root / "report.md").read_text())
    assert cells["1"][5:7] == ["3: 37.88 37.76 0.41 MB", "cap 1"]
    assert "all give the same buckets" in (root / "report.md").read_text()
    with (root / "report.csv").open() as f:
        records = {r["job"]: r for r in csv.DictReader(f)}
    assert records["2"]["num_buckets"] == "3" and records["2"]["bucket_sizes_bytes"] == "37883944 37761024 405504"
    assert records["2"]["same_buckets_as"] == "cap 1" and records["0"]["same_buckets_as"] == ""


def test_a_cap_that_changes_the_layout_is_not_warned_about(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    ddp_job(root, 0, 1, 0.1, THREE)
    ddp_job(root, 1, 5, 0.1, THREE)
    ddp_job(root, 2, 100, 0.1, [sum(THREE)])
    rows = build_rows(find_jobs(root))
    assert [r.same_buckets_as for r in rows] == ["", "cap 1", ""]
    assert axis_warning(rows) is None


def _drawn(ax: Any) -> list[tuple[float, float, float, float]]:
    """The step panel's series as drawn: each point's cap, value and error bar's ends."""
    (bars,) = [c for c in ax.containers if hasattr(c, "lines")]
    line, _, (whiskers,) = bars.lines
    ends = [(float(s[0][1]), float(s[1][1])) for s in whiskers.get_segments()]
    return [(float(x), float(y), *e) for x, y, e in zip(line.get_xdata(), line.get_ydata(), ends, strict=True)]


def test_caps_that_built_the_same_buckets_are_drawn_as_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Caps 1, 5 and 25 built one layout and cap 25's job happened to be the fastest: the plot crowns
    none of them. They are drawn as one value at each of their caps (the median of their three jobs,
    the spread of all three), named `same buckets`, and the sentence the terminal prints is under the
    panels; cap 100, another layout, is its own point."""
    root = tmp_path / "sweep"
    for num, (cap, ms, sizes) in enumerate([(1, 0.18, THREE), (5, 0.31, THREE), (25, 0.12, THREE), (100, 0.2, [7])]):
        ddp_job(root, num, cap, ms, sizes)
    fig = plot(build_rows(find_jobs(root)), "title")
    step_ax = fig.axes[0]
    assert _drawn(step_ax) == [
        pytest.approx((1.0, 180.0, 120.0, 310.0)),
        pytest.approx((5.0, 180.0, 120.0, 310.0)),
        pytest.approx((25.0, 180.0, 120.0, 310.0)),
        pytest.approx((100.0, 200.0, 200.0, 200.0)),
    ]
    assert [t.get_text() for t in step_ax.texts] == ["same buckets"]
    sentence = (
        "note: bucket_cap_mb 1, 5 and 25 give the same buckets (3: 37.88 37.76 0.41 MB): one configuration, "
        "so any difference between these jobs is noise"
    )
    assert [t.get_text() for t in fig.texts] == ["title", sentence]  # the suptitle, then the lines under the panels
    assert main([str(root)]) == 0
    assert unwrapped(capsys.readouterr().out).splitlines().count(sentence) == 1
    assert f"- {sentence}" in (root / "report.md").read_text().splitlines()
    # Every cap the same buckets: the terminal's warning, under the panels too, and one flat line.
    every = tmp_path / "every"
    for num, (cap, ms) in enumerate([(1, 0.18), (5, 0.31), (25, 0.12)]):
        ddp_job(every, num, cap, ms, THREE)
    rows = build_rows(find_jobs(every))
    fig = plot(rows, "title")
    assert [t.get_text() for t in fig.texts] == ["title", axis_warning(rows)]
    assert [y for _, y, _, _ in _drawn(fig.axes[0])] == pytest.approx([180.0] * 3)


def test_layouts_of_other_strategies_are_not_compared(tmp_path: Path) -> None:
    # The same sizes under manual (no cap) and under ddp: no mark, no warning; zero's flat buffer is read.
    root = tmp_path / "sweep"
    ddp_job(root, 0, 25, 0.1, THREE)
    write_job(root / "1", [[train_row(10, 0.1, 0.0, 100, 1.0)]], MANUAL, ["sync=manual"], bucket_sizes=THREE)
    rows = build_rows(find_jobs(root))
    assert [r.same_buckets_as for r in rows] == ["", ""] and axis_warning(rows) is None
    summary = {"sync": {"numel": 10, "padded_numel": 12}, "model": {"parameter_bytes": 40}}
    assert bucket_layout(summary) == (48,) and bucket_layout({"sync": {}}) is None and bucket_layout(None) is None


def markdown_cells(text: str) -> list[list[str]]:
    return [[c.strip() for c in line.strip("|").split(" | ")] for line in text.splitlines() if line.startswith("| ")]


@pytest.fixture
def repeated(tmp_path: Path) -> Path:
    """Caps 1, 4 and 25, three repeats interleaved; cap 4 is clearly faster, caps 1 and 25 overlap."""
    root = tmp_path / "sweep"
    times = {1: [0.100, 0.130, 0.110], 4: [0.060, 0.070, 0.065], 25: [0.120, 0.140, 0.125]}
    sizes = {1: [1, 2, 3], 4: [3, 3], 25: [6]}
    num = 0
    for repeat in range(3):
        for cap in (1, 4, 25):
            ddp_job(root, num, cap, times[cap][repeat], sizes[cap], repeat + 1)
            num += 1
    return root


def test_repeats_become_points_with_median_and_spread(repeated: Path, capsys: pytest.CaptureFixture[str]) -> None:
    points = gather_points(build_rows(find_jobs(repeated)))
    assert [p.label for p in points] == ["cap 1", "cap 4", "cap 25"]
    assert [[j.job for j in p.jobs] for p in points] == [["0", "3", "6"], ["1", "4", "7"], ["2", "5", "8"]]
    assert [p.step_ms for p in points] == pytest.approx([110.0, 65.0, 125.0])
    assert [p.spread for p in points] == [
        pytest.approx((100.0, 130.0)),
        pytest.approx((60.0, 70.0)),
        pytest.approx((120.0, 140.0)),
    ]
    assert spread_sentences(points) == ["cap 1 and cap 25 are not distinguishable here (their spreads overlap)."]
    assert main([str(repeated)]) == 0
    printed = capsys.readouterr().out
    assert "cap 1 and cap 25 are not distinguishable here" in printed and "warning" not in printed
    markdown = (repeated / "report.md").read_text()
    point_rows = {cells[0]: cells for cells in markdown_cells(markdown) if cells[0].startswith("cap ")}
    assert point_rows["cap 4"][:6] == ["cap 4", "1,4,7", "4", "2: 0.00 0.00 MB", "65.00", "60.00-70.00"]
    # On screen the cap is said once, under its key (bucket_mb repeats it, and is left off), the buckets
    # by their count; hidden and exposed ms, `-` in every point (no row timed its communication), are
    # left off too.
    lines = printed.splitlines()
    at = lines.index("Points (median over repeats, spread = min-max of the jobs' medians):") + 1
    screen = printed_columns(lines[at : at + 4])
    assert list(screen) == [
        "bucket_cap_mb",
        "jobs",
        "buckets",
        "step ms",
        "spread ms",
        "samples/s",
        "compute ms",
    ]
    assert screen["bucket_cap_mb"] == ["1", "4", "25"] and screen["buckets"] == ["3 buckets", "2 buckets", "1 bucket"]
    assert screen["spread ms"] == ["100.00-130.00", "60.00-70.00", "120.00-140.00"]


def test_error_bars_span_each_points_spread(repeated: Path) -> None:
    fig = plot(build_rows(find_jobs(repeated)), "title")
    step_ax = fig.axes[0]
    (bars,) = [c for c in step_ax.containers if hasattr(c, "lines") and c.lines[2]]
    segments = sorted((float(s[0][0]), float(s[0][1]), float(s[1][1])) for s in bars.lines[2][0].get_segments())
    assert segments == [
        pytest.approx((1.0, 100.0, 130.0)),
        pytest.approx((4.0, 60.0, 70.0)),
        pytest.approx((25.0, 120.0, 140.0)),
    ]
    ticks = [t.get_text() for t in step_ax.get_xticklabels()]
    assert ticks == ["1\n3 buckets", "4\n2 buckets", "25\n1 bucket"]


def test_spreads_that_do_not_overlap_and_a_sweep_without_repeats(repeated: Path, tmp_path: Path) -> None:
    points = [p for p in gather_points(build_rows(find_jobs(repeated))) if p.label != "cap 25"]
    assert spread_sentences(points) == ["No two points' spreads overlap: their order held in every repeat."]
    root = tmp_path / "once"
    ddp_job(root, 0, 1, 0.1, [1, 2])
    ddp_job(root, 1, 25, 0.2, [3])
    (sentence,) = spread_sentences(gather_points(build_rows(find_jobs(root))))
    assert sentence.startswith("Every point ran once: this sweep has no spread")
    assert main([str(root)]) == 0
    assert "## Points" not in (root / "report.md").read_text() and "no spread" in (root / "report.md").read_text()


# Layouts at and past format_layout's limit (4): up to 4 buckets every size is listed, in the order
# built; past it, the count, the min-max range and the total (of the unrounded sizes) instead.
FOUR = [4_000_000, 1_000_000, 3_250_000, 2_500_000]
FIVE = [1_000_000, 4_000_000, 500_000, 3_250_000, 2_500_000]
# 1.004999 ... 12.004999 MB, shuffled: each rounds to a whole MB, their total (78.059988) does not.
TWELVE = [(i * 1_000_000) + 4_999 for i in (7, 3, 12, 1, 9, 5, 11, 2, 8, 6, 10, 4)]
FIVE_TEXT = "5: 0.50-4.00 MB, 11.25 in all"
TWELVE_TEXT = "12: 1.00-12.00 MB, 78.06 in all"


@pytest.mark.parametrize(
    ("sizes", "limit", "expected"),
    [
        (None, 4, ""),
        ([405_504], 4, "1: 0.41 MB"),
        (FOUR, 4, "4: 4.00 1.00 3.25 2.50 MB"),  # exactly at the limit: all four, as built
        (FIVE, 4, FIVE_TEXT),  # one past it: none of the five listed
        (TWELVE, 4, TWELVE_TEXT),
        (FIVE, 5, "5: 1.00 4.00 0.50 3.25 2.50 MB"),  # the boundary is the `limit` argument
        (FOUR, 3, "4: 1.00-4.00 MB, 10.75 in all"),
    ],
    ids=["none", "one", "four-at-limit", "five-past-limit", "twelve", "five-at-limit-5", "four-past-limit-3"],
)
def test_format_layout_lists_up_to_the_limit_and_summarises_past_it(
    sizes: list[int] | None, limit: int, expected: str
) -> None:
    assert format_layout(None if sizes is None else tuple(sizes), limit) == expected


def test_format_layout_default_limit_is_four() -> None:
    assert format_layout(tuple(FOUR)) == "4: 4.00 1.00 3.25 2.50 MB"
    assert format_layout(tuple(FIVE)) == FIVE_TEXT
    assert format_layout(tuple(TWELVE)) == TWELVE_TEXT


def test_report_shows_layouts_at_and_past_the_limit(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # Three caps, three different layouts: each job's buckets cell is format_layout's text, no warning.
    root = tmp_path / "sweep"
    for num, (cap, sizes) in enumerate([(1, FOUR), (5, FIVE), (25, TWELVE)]):
        ddp_job(root, num, cap, 0.1, sizes)
    assert main([str(root)]) == 0
    printed = capsys.readouterr().out
    markdown = (root / "report.md").read_text()
    at = markdown_header(markdown).index("buckets")
    cells = markdown_rows(markdown)
    assert [cells[job][at : at + 2] for job in ("0", "1", "2")] == [
        ["4: 4.00 1.00 3.25 2.50 MB", ""],
        [FIVE_TEXT, ""],
        [TWELVE_TEXT, ""],
    ]
    assert "warning" not in printed and "warning" not in markdown
    # On screen, the count: the sizes are report.md's (and the csv's).
    assert printed_columns(printed.splitlines()[1:5])["buckets"] == ["4 buckets", "5 buckets", "12 buckets"]


def test_warning_and_table_show_a_twelve_bucket_layout_summarised(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "sweep"
    for num, cap in enumerate([1, 5, 25]):
        ddp_job(root, num, cap, 0.1, TWELVE)
    rows = build_rows(find_jobs(root))
    assert [r.same_buckets_as for r in rows] == ["", "cap 1", "cap 1"]
    warning = (
        f"warning: bucket_cap_mb 1, 5 and 25 all give the same buckets ({TWELVE_TEXT}): "
        "the swept axis changed nothing ddp does, so any difference between these jobs is noise"
    )
    assert axis_warning(rows) == warning
    assert main([str(root)]) == 0
    printed = capsys.readouterr().out
    assert unwrapped(printed).splitlines().count(warning) == 1
    screen = printed_columns(printed.splitlines()[1:5])
    assert screen["buckets"] == ["12 buckets"] * 3 and screen["same as"] == ["", "cap 1", "cap 1"]
    markdown = (root / "report.md").read_text()
    assert f"- {warning}" in markdown.splitlines()
    at = markdown_header(markdown).index("buckets")
    cells = markdown_rows(markdown)
    assert [cells[job][at : at + 2] for job in ("0", "1", "2")] == [
        [TWELVE_TEXT, ""],
        [TWELVE_TEXT, "cap 1"],
        [TWELVE_TEXT, "cap 1"],
    ]


def test_repeats_that_chose_different_caps_show_each_choice(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bucket_cap_mb=auto chooses in every run, from that run's own trials: the two repeats of ddp_auto
    here chose 25 and 5 MiB and built 1 and 3 buckets. Each job shows its own choice, and the point
    both; ddp's two repeats, at a fixed cap, built one layout, shown once."""
    root = tmp_path / "sweep"
    one, three = [12_771_368], [5_242_880, 5_242_880, 2_285_608]
    for num, (repeat, preset, chosen, sizes) in enumerate(
        [(1, "ddp_auto", 25.0, one), (1, "ddp", None, one), (2, "ddp_auto", 5.0, three), (2, "ddp", None, one)]
    ):
        ranks = [[train_row(10, 0.07 + 0.01 * num, 0.0, 100, 1.0)]] * 2
        overrides = [f"+repeat={repeat}", f"+strategy={preset}", "logger=none"]
        facts = {} if chosen is None else {"auto_chosen_mb": chosen, "bucket_cap_mb_in_use": chosen}
        cap = 25 if chosen is None else "auto"
        write_job(root / str(num), ranks, DDP, overrides, cap, bucket_sizes=sizes, sync_facts=facts)
    assert main([str(root)]) == 0
    printed = capsys.readouterr().out.splitlines()
    markdown = (root / "report.md").read_text()

    point_rows = {cells[0]: cells for cells in markdown_cells(markdown) if cells[0].startswith("+strategy=")}
    assert point_rows["+strategy=ddp_auto"][1:4] == ["0,2", "auto (25\\|5)", "1: 12.77 MB \\| 3: 5.24 5.24 2.29 MB"]
    assert point_rows["+strategy=ddp"][1:4] == ["1,3", "25", "1: 12.77 MB"]
    at = markdown_header(markdown).index("bucket_mb")
    jobs_md = markdown_rows(markdown)
    assert [jobs_md[job][at] for job in "0123"] == ["auto (25)", "25", "auto (5)", "25"]
    with (root / "report.csv").open() as f:
        assert [r["bucket_cap_mb_in_use"] for r in csv.DictReader(f)] == ["25.0", "", "5.0", ""]

    jobs = printed_columns(printed[1:6])
    assert jobs["bucket_mb"] == ["auto (25)", "25", "auto (5)", "25"]
    assert jobs["buckets"] == ["1 bucket", "1 bucket", "3 buckets", "1 bucket"]
    at = printed.index("Points (median over repeats, spread = min-max of the jobs' medians):") + 1
    points = printed_columns(printed[at : at + 3])
    assert points["strategy"] == ["ddp_auto", "ddp"]
    assert points["bucket_mb"] == ["auto (25|5)", "25"] and points["buckets"] == ["1|3 buckets", "1 bucket"]
    # The plot's bar for the point names both layouts.
    ticks = [t.get_text() for t in plot(build_rows(find_jobs(root)), "title").axes[0].get_xticklabels()]
    assert ticks[0].endswith("\n1 bucket | 3 buckets") and ticks[1].endswith("\n1 bucket")
