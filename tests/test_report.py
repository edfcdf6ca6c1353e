"""The sweep report on a small hand-written sweep: every number in the table, Markdown and CSV is
checked against arithmetic here, then the plot, the files written and the CLI on the same sweep.
Single ranks, truncated lines, override diffs and other small inputs are in test_report_edges.py."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any

import pytest
from PIL import Image

from tests.report_helpers import BUCKETED, DDP, MANUAL, NONE, comm_keys, eval_row, run_cli, train_row, write_job
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
# No row has memory/optimizer_state_mb (written before it existed): opt state MB is `-` in every job.
SYNC_0 = 100 * (0.006 / 0.052 + 0.006 / 0.066) / 2
SYNC_2 = 100 * (0.05 / 0.09 + 0.06 / 0.12) / 2
EXPECTED_CELLS = {
    "0": [
        "0",
        "ok",
        "sync=ddp sync.bucket_cap_mb=1",
        "ddp",
        "1",
        "16.00",
        "380",
        "10.3†",
        "-",
        "-",
        "700",
        "-",
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
        "10.00",
        "800",
        "0.0†",
        "-",
        "-",
        "700",
        "-",
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
        "52.50",
        "100",
        "52.8",
        "-",
        "-",
        "700",
        "-",
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
        "(150.00)",
        "(30)",
        "(0.0†)",
        "-",
        "-",
        "(700)",
        "-",  # a run logged before memory/optimizer_state_mb existed: no value, not parenthesized
        "(5.5000)",
        "",
        "(r1 (200.00 ms))",
        "(r0 (100.00 ms))",
    ],
}


def markdown_header(text: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith("| job"))
    return [c.strip() for c in line.strip("|").split(" | ")]


def markdown_rows(text: str) -> dict[str, list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| job")]
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]
    return {c[0]: c for c in cells}


def test_table_markdown_and_csv_numbers(sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    assert main([str(sweep), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "DDP bucket size sweep: sweep, 3 ranks" in printed
    table = {line.split()[0]: line for line in printed.splitlines()[2:6]}
    for job, cells in EXPECTED_CELLS.items():
        tokens = " ".join(c for c in cells if c).split()
        assert table[job].split() == tokens
    assert markdown_rows((out / "report.md").read_text()) == EXPECTED_CELLS

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
    step_ax, rate_ax, rank_rate_ax = fig.axes  # the third: per-rank samples/s on a right axis
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


def strategy_ranks() -> dict[str, list[list[dict[str, Any]]]]:
    """Each strategy's rows per rank, as its JSONL would hold them.

    none has no comm keys; manual times every row; ddp times one row in a few (the others carry
    bytes only), and its fp16 job ran on CUDA (memory/cuda_max_allocated_mb); bucketed buckets
    by hand. Memory peaks sit on different rows and ranks, exposed times differ between ranks.
    Optimizer state (memory/optimizer_state_mb) peaks on neither rank 0 nor a last row; the ddp auto
    job lacks it, as a run logged before it existed would.
    """

    def row(step: int, step_s: float, extra: dict[str, Any]) -> dict[str, Any]:
        return train_row(step, step_s, 0.0, 100, 1.0, extra)

    def opt(mb: float) -> dict[str, Any]:
        return {"memory/optimizer_state_mb": mb}

    mb = 4_000_000.0
    return {
        "none": [
            [row(10, 0.01, {"memory/rss_mb": 710.0} | opt(72.5))],
            [row(10, 0.01, {"memory/rss_mb": 705.5} | opt(72.75))],
        ],
        "manual": [
            [
                row(10, 0.05, comm_keys(mb, 0.02, 0.02) | opt(72.5)),
                row(20, 0.05, comm_keys(mb, 0.03, 0.03) | {"memory/rss_mb": 801.0} | opt(72.5)),
            ],
            [
                row(10, 0.05, comm_keys(mb, 0.01, 0.01) | opt(73.25)),
                row(20, 0.05, comm_keys(mb, 0.04, 0.04) | opt(72.5)),
            ],
        ],
        "ddp fp16": [
            [
                row(10, 0.03, comm_keys(mb / 2, 0.02, 0.004) | {"memory/cuda_max_allocated_mb": 1500.0} | opt(72.5)),
                row(20, 0.03, comm_keys(mb / 2) | {"memory/cuda_max_allocated_mb": 1530.0} | opt(72.5)),
                row(30, 0.03, comm_keys(mb / 2, 0.02, 0.006) | {"memory/cuda_max_allocated_mb": 1510.0} | opt(72.5)),
            ],
            [
                row(10, 0.03, comm_keys(mb / 2, 0.02, 0.001) | {"memory/cuda_max_allocated_mb": 1490.0} | opt(72.5)),
                row(20, 0.03, comm_keys(mb / 2) | {"memory/cuda_max_allocated_mb": 1620.25} | opt(74.0)),
                row(30, 0.03, comm_keys(mb / 2, 0.02, 0.002) | {"memory/cuda_max_allocated_mb": 1480.0} | opt(72.5)),
            ],
        ],
        "ddp auto": [[row(10, 0.04, comm_keys(mb))], [row(10, 0.04, comm_keys(mb) | {"memory/rss_mb": 950.0})]],
        "bucketed": [
            [
                row(10, 0.04, comm_keys(mb, 0.02, 0.015) | opt(36.25)),
                row(20, 0.04, comm_keys(mb, 0.02, 0.005) | opt(36.25)),
            ],
            [
                row(10, 0.04, comm_keys(mb, 0.02, 0.012) | opt(36.25)),
                row(20, 0.04, comm_keys(mb, 0.02, 0.011) | opt(36.375)),
            ],
        ],
    }


@pytest.fixture
def strategy_sweep(tmp_path: Path) -> Path:
    """A sweep over strategies as `experiment=strategy_sweep` runs it: one job per strategy variant."""
    root = tmp_path / "strategies"
    ranks = strategy_ranks()
    common = ["experiment=strategy_sweep", "logger=none"]
    write_job(root / "0", ranks["none"], NONE, ["sync=none", *common, "run_name=s-0"])
    write_job(root / "1", ranks["manual"], MANUAL, ["sync=manual", *common, "run_name=s-1"])
    fp16 = ["sync=ddp", "sync.comm_hook=fp16", *common, "run_name=s-2"]
    write_job(root / "2", ranks["ddp fp16"], DDP, fp16, 25, sync_knobs={"comm_hook": "fp16"})
    auto = ["sync=ddp", "sync.bucket_cap_mb=auto", *common, "run_name=s-3"]
    write_job(root / "3", ranks["ddp auto"], DDP, auto, "auto")
    rs_ag = ["sync=bucketed", "sync.collective=rs_ag", *common, "run_name=s-4"]
    write_job(root / "4", ranks["bucketed"], BUCKETED, rs_ag, 25, sync_knobs={"collective": "rs_ag"})
    return root


def expected_comm_and_memory(ranks: list[list[dict[str, Any]]]) -> dict[str, float | None]:
    """The report's definitions (report.md's legend), applied to the rows the test wrote."""

    def per_rank(key: str, reduce: Any) -> list[float]:
        return [reduce(v) for v in ([row[key] for row in rows if key in row] for rows in ranks) if v]

    bytes_ = per_rank("comm/bytes_per_step", statistics.median)
    exposed = per_rank("time/comm_exposed_s", statistics.median)
    rss = per_rank("memory/rss_mb", max)
    cuda = per_rank("memory/cuda_max_allocated_mb", max)
    opt = per_rank("memory/optimizer_state_mb", max)
    return {
        "mb_per_step": statistics.median(bytes_) / 1e6 if bytes_ else None,
        "comm_exposed_ms": 1000 * statistics.median(exposed) if exposed else None,
        "peak_rss_mb": max(rss) if rss else None,
        "peak_cuda_mb": max(cuda) if cuda else None,
        "opt_state_mb": max(opt) if opt else None,
    }


def test_strategy_sweep_bytes_exposed_time_and_peak_memory(
    strategy_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "out"
    assert main([str(strategy_sweep), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == "Strategy sweep: strategies, 2 ranks"
    header = markdown_header((out / "report.md").read_text())
    at = header.index("MB/step")
    # opt state MB comes right after the memory peaks (after peak CUDA MB when there is one).
    assert header[at : at + 6] == ["MB/step", "exposed ms", "peak RSS MB", "peak CUDA MB", "opt state MB", "train loss"]
    assert header[:5] == ["job", "status", "overrides", "sync", "bucket_mb"]
    cells = markdown_rows((out / "report.md").read_text())
    records = {r["job"]: r for r in csv.DictReader((out / "report.csv").open())}

    # Only what differs between jobs labels them: experiment, logger and run_name are the same or hidden.
    labels = {job: (c[2], c[3], c[4]) for job, c in cells.items()}
    assert labels == {
        "0": ("sync=none", "none", ""),
        "1": ("sync=manual", "manual", ""),
        "2": ("sync=ddp sync.comm_hook=fp16", "ddp", "25"),
        "3": ("sync=ddp sync.bucket_cap_mb=auto", "ddp", "auto"),
        "4": ("sync=bucketed sync.collective=rs_ag", "bucketed", "25"),
    }
    assert [records[j]["bucket_cap_mb"] for j in "01234"] == ["", "", "25.0", "auto", "25.0"]

    def shown(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)

    for job, name in enumerate(strategy_ranks()):
        want = expected_comm_and_memory(strategy_ranks()[name])
        assert cells[str(job)][at : at + 5] == [
            shown(want["mb_per_step"], ".2f"),
            shown(want["comm_exposed_ms"], ".2f"),
            shown(want["peak_rss_mb"], ".0f"),
            shown(want["peak_cuda_mb"], ".0f"),
            shown(want["opt_state_mb"], ".1f"),
        ], name
        for column, value in want.items():
            got = records[str(job)][column]
            assert (got == "") if value is None else (float(got) == pytest.approx(value)), (name, column, got)
    # The definitions, spelled out on three jobs: none sends nothing; ddp's untimed rows count for
    # bytes but not for exposed time; the peaks are over every rank and row.
    assert cells["0"][at : at + 2] == ["-", "-"] and records["0"]["mb_per_step"] == ""
    assert float(records["2"]["mb_per_step"]) == pytest.approx(2.0)
    assert float(records["2"]["comm_exposed_ms"]) == pytest.approx(1000 * statistics.median([0.005, 0.0015]))
    assert float(records["2"]["peak_cuda_mb"]) == 1620.25 and float(records["3"]["peak_rss_mb"]) == 950.0
    # Optimizer state likewise: the peak is rank 1's first row (manual), rank 1's middle row (ddp fp16),
    # unrounded in the CSV (bucketed: 36.375, shown 36.4); a job whose rows lack it shows `-`, CSV empty.
    opt_at = at + 4
    assert [cells[j][opt_at] for j in "01234"] == ["72.8", "73.2", "74.0", "-", "36.4"]
    assert [records[j]["opt_state_mb"] for j in "01234"] == ["72.75", "73.25", "74.0", "", "36.375"]

    # Without bucket sizes to put on an x axis (one numeric value, and "auto"), the plot is one bar per job.
    fig = plot(build_rows(find_jobs(strategy_sweep)), "title")
    assert fig.axes[0].get_xscale() == "linear"
    ticks = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert ticks[2] == "job 2\nsync=ddp\nsync.comm_hook=fp16" and len(ticks) == 5


def test_cpu_sweep_has_no_cuda_column(sweep: Path, tmp_path: Path) -> None:
    assert main([str(sweep), "--out", str(tmp_path)]) == 0
    header = markdown_header((tmp_path / "report.md").read_text())
    assert "peak RSS MB" in header and "peak CUDA MB" not in header
    at = header.index("peak RSS MB")
    assert header[at : at + 3] == ["peak RSS MB", "opt state MB", "train loss"]
    records = list(csv.DictReader((tmp_path / "report.csv").open()))
    assert {r["peak_cuda_mb"] for r in records} == {""} and {r["peak_rss_mb"] for r in records} == {"700.0"}
    # Rows written before memory/optimizer_state_mb existed: the column is `-` (empty in the CSV).
    assert {r["opt_state_mb"] for r in records} == {""}
    assert {cells[at + 1] for cells in markdown_rows((tmp_path / "report.md").read_text()).values()} == {"-"}
