"""The sweep report on a small hand-written sweep: every number in the table, Markdown and CSV is
checked against arithmetic here, then the plot, the files written and the CLI on the same sweep.
Single ranks, truncated lines, override diffs and other small inputs are in test_report_edges.py."""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.report_helpers import (
    DDP,
    MANUAL,
    eval_row,
    markdown_header,
    markdown_rows,
    printed_columns,
    run_cli,
    train_row,
    write_job,
)
from trainer.tools.report import find_jobs, main
from trainer.tools.report_plot import plot
from trainer.tools.report_rows import build_rows


@pytest.fixture
def sweep(tmp_path: Path) -> Path:
    """Job 0/1: ddp at 1 and 25 MiB (job 1 on 3 ranks); job 2: manual; job 3: ddp at 5 MiB, killed mid-write.

    The values make medians differ from means and sum/sum differ from a mean of ratios.
    """
    root = tmp_path / "sweep"
    write_job(
        root / "0",
        [
            [
                train_row(10, 0.010, 0.001, 100, 2.5),
                train_row(20, 0.030, 0.003, 300, 2.2),
                eval_row(20, 0.5),
                train_row(30, 0.012, 0.002, 230, 2.0),
                eval_row(30, 0.75),
            ],
            [
                train_row(10, 0.020, 0.002, 150, 2.4),
                train_row(20, 0.016, 0.002, 40, 1.5),
                eval_row(20, 0.5),
                train_row(30, 0.030, 0.002, 250, 1.0),
                eval_row(30, 0.75),
            ],
        ],
        DDP,
        ["sync=ddp", "sync.bucket_cap_mb=1", "logger=none", "run_name=x-0"],
        1,
    )
    write_job(
        root / "1",
        [
            [train_row(10, 0.008, 0.0, 400, 1.2), train_row(20, 0.008, 0.0, 400, 1.1), eval_row(20, 0.8)],
            [train_row(10, 0.010, 0.0, 300, 1.3), train_row(20, 0.010, 0.0, 300, 0.9), eval_row(20, 0.8)],
            [train_row(10, 0.030, 0.0, 100, 1.3), train_row(20, 0.030, 0.0, 100, 1.0), eval_row(20, 0.8)],
        ],
        DDP,
        ["sync=ddp", "sync.bucket_cap_mb=25", "logger=none", "run_name=x-1"],
        25,
    )
    write_job(
        root / "2",
        [
            [train_row(10, 0.040, 0.020, 50, 3.0), train_row(20, 0.050, 0.030, 70, 2.0), eval_row(20, 0.25)],
            [train_row(10, 0.060, 0.030, 40, 1.0), train_row(20, 0.060, 0.030, 40, 1.0), eval_row(20, 0.25)],
        ],
        MANUAL,
        ["sync=manual", "logger=none", "run_name=x-2"],
    )
    write_job(
        root / "3",
        [[train_row(10, 0.100, 0.0, 10, 5.0)], [train_row(10, 0.200, 0.0, 20, 6.0)]],
        DDP,
        ["sync=ddp", "sync.bucket_cap_mb=5", "logger=none", "run_name=x-3"],
        5,
        complete=False,
        tail='{"step": 20, "train/lo',
    )
    (root / "multirun.yaml").write_text("hydra: {}\n")
    return root


# Worked by hand from the rows above:
# job 0: rank medians 12 ms and 20 ms -> 16.00; samples/s 230 + 150 = 380;
#        sync share (0.006/0.052 + 0.006/0.066) / 2 = 10.32 %; loss (2.0 + 1.0) / 2; last eval 0.75
# job 1: 8, 10 and 30 ms -> 10.00; 400 + 300 + 100 = 800; sync 0 %; loss (1.1 + 0.9 + 1.0) / 3; eval 0.8
# job 2: 45 and 60 ms -> 52.50; 60 + 40 = 100; sync (0.05/0.09 + 0.06/0.12) / 2 = 52.78 %; loss 1.5
# job 3: 100 and 200 ms -> 150.00; 10 + 20 = 30; incomplete, truncated last line skipped
# No row has memory/optimizer_state_mb or memory/peak_mb (written before they existed): opt state MB
# and mem MB/rank are `-` in every job; no row has comm/* either: MB/step and exposed ms are `n/m`
# (not measured), which `-` (sends nothing) was before issue 73.
SYNC_0 = 100 * (0.006 / 0.052 + 0.006 / 0.066) / 2
SYNC_2 = 100 * (0.05 / 0.09 + 0.06 / 0.12) / 2
EXPECTED_CELLS = {
    "0": [
        "0",
        "ok",
        "sync=ddp sync.bucket_cap_mb=1",
        "ddp",
        "1",
        "",  # buckets: no summary.json layout in these hand-written jobs
        "",  # same as
        "16.00",
        "380",
        "10.3†",
        "n/m",  # MB/step: the strategy sends, no row measured it (not `-`, which says it sends nothing)
        "n/m",  # exposed ms: likewise
        "700",
        "-",
        "-",  # mem MB/rank: no row has memory/peak_mb
        "1.5000",
        "0.750",
        "r1 (20.00 ms)",
        "r0 (12.00 ms)",
    ],
    "1": [
        "1",
        "ok",
        "sync=ddp sync.bucket_cap_mb=25",
        "ddp",
        "25",
        "",  # buckets: no summary.json layout in these hand-written jobs
        "",  # same as
        "10.00",
        "800",
        "0.0†",
        "n/m",  # MB/step: the strategy sends, no row measured it (not `-`, which says it sends nothing)
        "n/m",  # exposed ms: likewise
        "700",
        "-",
        "-",  # mem MB/rank: no row has memory/peak_mb
        "1.0000",
        "0.800",
        "r2 (30.00 ms)",
        "r0 (8.00 ms)",
    ],
    "2": [
        "2",
        "ok",
        "sync=manual",
        "manual",
        "",
        "",  # buckets: no summary.json layout in these hand-written jobs
        "",  # same as
        "52.50",
        "100",
        "52.8",
        "n/m",  # MB/step: the strategy sends, no row measured it (not `-`, which says it sends nothing)
        "n/m",  # exposed ms: likewise
        "700",
        "-",
        "-",  # mem MB/rank: no row has memory/peak_mb
        "1.5000",
        "0.250",
        "r1 (60.00 ms)",
        "r0 (45.00 ms)",
    ],
    "3": [
        "3",
        "incomplete",
        "sync=ddp sync.bucket_cap_mb=5",
        "ddp",
        "5",
        "",  # buckets: no summary.json layout in these hand-written jobs
        "",  # same as
        "(150.00)",
        "(30)",
        "(0.0†)",
        "n/m",  # MB/step: the strategy sends, no row measured it (not `-`, which says it sends nothing)
        "n/m",  # exposed ms: likewise
        "(700)",
        "-",  # a run logged before memory/optimizer_state_mb existed: no value, not parenthesized
        "-",  # mem MB/rank: no row has memory/peak_mb
        "(5.5000)",
        "",
        "(r1 (200.00 ms))",
        "(r0 (100.00 ms))",
    ],
}


def test_table_markdown_and_csv_numbers(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([str(sweep), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "DDP bucket size sweep: sweep, 3 ranks"
    assert markdown_rows((out / "report.md").read_text()) == EXPECTED_CELLS
    # On screen: the job, the one that did not finish, the swept keys' values, then the numbers that have
    # a value somewhere; the ranks, RSS and the columns of `-` only are report.md's (and the csv's).
    screen = printed_columns(printed[1:6])
    names = ["job", "status", "sync", "bucket_cap_mb", "step ms", "samples/s", "sync %", "train loss", "eval acc"]
    assert list(screen) == names
    assert screen["status"] == ["", "", "", "incomplete"]
    assert screen["sync"] == ["ddp", "ddp", "manual", "ddp"] and screen["bucket_cap_mb"] == ["1", "25", "", "5"]
    header = markdown_header((out / "report.md").read_text())
    for name in names[4:]:
        at = header.index("samples/s (median row)" if name == "samples/s" else name)
        assert screen[name] == [EXPECTED_CELLS[job][at] for job in "0123"], name

    records = {r["job"]: r for r in csv.DictReader((out / "report.csv").open())}
    assert list(records) == ["0", "1", "2", "3"]
    expected = {  # job: step_ms, samples_per_s, sync_share_pct, train_loss, eval_accuracy, rank0/1/2 step ms
        "0": (16.0, 380.0, SYNC_0, 1.5, 0.75, 12.0, 20.0, None),
        "1": (10.0, 800.0, 0.0, 1.0, 0.8, 8.0, 10.0, 30.0),
        "2": (52.5, 100.0, SYNC_2, 1.5, 0.25, 45.0, 60.0, None),
        "3": (150.0, 30.0, 0.0, 5.5, None, 100.0, 200.0, None),
    }
    columns = (
        "step_ms",
        "samples_per_s",
        "sync_share_pct",
        "train_loss",
        "eval_accuracy",
        "rank0_step_ms",
        "rank1_step_ms",
        "rank2_step_ms",
    )
    for job, values in expected.items():
        for column, value in zip(columns, values, strict=True):
            got = records[job][column]
            assert (got == "") if value is None else (float(got) == pytest.approx(value)), (job, column, got)
    assert [records[j]["status"] for j in "0123"] == ["ok", "ok", "ok", "incomplete"]
    assert [records[j]["bucket_cap_mb"] for j in "0123"] == ["1.0", "25.0", "", "5.0"]
    assert [(records[j]["slowest_rank"], records[j]["fastest_rank"]) for j in "0123"] == [
        ("1", "0"),
        ("2", "0"),
        ("1", "0"),
        ("1", "0"),
    ]
    assert [records[j]["num_ranks"] for j in "0123"] == ["2", "3", "2", "2"]


def drawn_points(axes: list[Any]) -> tuple[set[float], set[float]]:
    xs: set[float] = set()
    ys: set[float] = set()
    for line in (line for ax in axes for line in ax.lines):
        xs.update(float(x) for x in line.get_xdata())
        ys.update(round(float(y), 6) for y in line.get_ydata())
    return xs, ys


def test_plot_draws_complete_jobs_only(sweep: Path) -> None:
    fig = plot(build_rows(find_jobs(sweep)), "title")
    # The third: where each job's time went; the fourth: per-rank samples/s on a right axis.
    step_ax, rate_ax, _, rank_rate_ax = fig.axes
    assert step_ax.get_xscale() == rate_ax.get_xscale() == "log"
    assert "ms" in step_ax.get_ylabel() and "samples/s" in rate_ax.get_ylabel()
    step_x, step_y = drawn_points([step_ax])
    rate_x, rate_y = drawn_points([rate_ax, rank_rate_ax])
    # Jobs 0 and 1 as a line with their ranks as markers; manual as a horizontal reference line.
    assert {1.0, 25.0} <= step_x and {16.0, 12.0, 20.0, 10.0, 8.0, 30.0, 52.5} <= step_y
    assert {380.0, 230.0, 150.0, 800.0, 400.0, 300.0, 100.0} <= rate_y
    # The incomplete job 3 (5 MiB, 150 ms, 100/200 ms ranks, 30 samples/s) appears nowhere.
    assert 5.0 not in step_x | rate_x
    assert not {150.0, 100.0, 200.0} & step_y and 30.0 not in rate_y
    legend = [t.get_text() for t in step_ax.get_legend().get_texts()]
    assert "ddp" in legend and "manual (job 2, no buckets)" in legend
    assert any("job 3" in t.get_text() for t in fig.texts)


def test_files_written_and_png_is_an_image(sweep: Path) -> None:
    assert main([str(sweep)]) == 0  # default --out: the sweep dir itself
    markdown = (sweep / "report.md").read_text()
    assert "## Legend" in markdown and "median over ranks" in markdown and "![" in markdown
    assert "(report.png)" in markdown
    with Image.open(sweep / "report.png") as image:
        image.verify()
    with Image.open(sweep / "report.png") as image:
        assert image.format == "PNG" and image.width >= 1000 and image.height >= 400


def test_cli_prints_the_table(sweep: Path) -> None:
    proc = run_cli(str(sweep))
    assert proc.returncode == 0, proc.stderr
    assert "job  status" in proc.stdout and "16.00" in proc.stdout and "incomplete" in proc.stdout
    assert (sweep / "report.md").is_file()


def test_cpu_sweep_has_no_cuda_column(sweep: Path, tmp_path: Path) -> None:
    assert main([str(sweep), "--out", str(tmp_path)]) == 0
    header = markdown_header((tmp_path / "report.md").read_text())
    assert "peak RSS MB" in header and "peak CUDA MB" not in header
    at = header.index("peak RSS MB")
    assert header[at : at + 4] == ["peak RSS MB", "opt state MB", "mem MB/rank", "train loss"]
    records = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert {r["peak_cuda_mb"] for r in records} == {""} and {r["peak_rss_mb"] for r in records} == {"700.0"}
    # Rows written before memory/optimizer_state_mb existed: the column is `-` (empty in the CSV).
    assert {r["opt_state_mb"] for r in records} == {""}
    assert {cells[at + 1] for cells in markdown_rows((tmp_path / "report.md").read_text()).values()} == {"-"}


def test_memory_puts_the_prediction_beside_the_measurement(sweep: Path, tmp_path: Path) -> None:
    """report --memory: each job's predicted total per rank, from its own overrides at its own number
    of ranks, the same number the predictor prints for them; without --memory no such column."""
    from trainer.tools.memory import predicted_total_mb

    assert main([str(sweep), "--out", str(tmp_path / "plain")]) == 0
    assert "predicted MB/rank" not in markdown_header((tmp_path / "plain" / "report.md").read_text())
    assert main([str(sweep), "--memory", "--out", str(tmp_path)]) == 0
    header = markdown_header((tmp_path / "report.md").read_text())
    assert header[header.index("mem MB/rank") + 1] == "predicted MB/rank"
    records = {r["job"]: r for r in csv.DictReader((tmp_path / "report.csv").open())}
    for job, overrides, ranks in [("0", ["sync=ddp", "sync.bucket_cap_mb=1"], 2), ("1", ["sync=ddp"], 3)]:
        expected = predicted_total_mb([*overrides, "logger=none", f"run_name=x-{job}"], ranks)
        assert float(records[job]["predicted_memory_mb"]) == pytest.approx(expected, rel=1e-6)
    # the default mlp with SGD's momentum at 64 per rank: ddp's replica, its reducer's buckets and the
    # activations (docs/memory.md's example) against manual's, which has no buckets of its own
    assert float(records["0"]["predicted_memory_mb"]) == pytest.approx(1.31, abs=0.01)
    assert float(records["2"]["predicted_memory_mb"]) == pytest.approx(1.01, abs=0.01)
