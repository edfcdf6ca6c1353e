"""The sweep report on a strategy sweep: MB/step, exposed ms, peak RSS, peak CUDA and optimizer-state
columns, each checked against arithmetic on rows written by the test (the CUDA column appears
because one job ran on CUDA), and the bar plot's job labels; the buckets column of strategies
without buckets, the dagger's line under the printed table, and that table in 100 columns while
report.md and report.csv keep every column."""

from __future__ import annotations

import csv
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.report_helpers import (
    BUCKETED,
    DDP,
    FSDP,
    MANUAL,
    NONE,
    comm_keys,
    markdown_header,
    markdown_rows,
    printed_columns,
    train_row,
    write_job,
)
from trainer.tools.report import find_jobs, main
from trainer.tools.report_plot import plot
from trainer.tools.report_rows import build_rows
from trainer.tools.report_table import DAGGER_NOTE


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
    # opt state MB and mem MB/rank come right after the memory peaks (after peak CUDA MB when there is one).
    assert header[at : at + 7] == [
        "MB/step",
        "exposed ms",
        "peak RSS MB",
        "peak CUDA MB",
        "opt state MB",
        "mem MB/rank",
        "train loss",
    ]
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

    def shown(value: float | None, spec: str, absent: str = "-") -> str:
        return absent if value is None else format(value, spec)

    for job, name in enumerate(strategy_ranks()):
        want = expected_comm_and_memory(strategy_ranks()[name])
        # Communication no row measured: `n/m`, unless the job sends nothing (`-`, sync=none): issue 73.
        absent = "-" if name == "none" else "n/m"
        assert cells[str(job)][at : at + 5] == [
            shown(want["mb_per_step"], ".2f", absent),
            shown(want["comm_exposed_ms"], ".2f", absent),
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
    assert ticks[2] == "sync=ddp sync.comm_hook=fp16 (job 2)" and len(ticks) == 5  # five: one slanted line each


def test_buckets_column_names_what_each_strategy_has(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """manual has flat buffers (and gradients reduced alone), fsdp units, none nothing: each says so,
    with the word for what it counts, where a strategy with buckets shows its buckets."""
    root = tmp_path / "sweep"
    rows = [[train_row(10, 0.05, 0.01, 100, 1.0, comm_keys(4e6, 0.02, 0.01))]] * 2
    buffers = {"num_buffers": 2, "buffer_sizes_bytes": [390_000, 200_000], "num_reduced_in_place": 3}
    write_job(root / "0", rows, MANUAL, ["sync=manual"], sync_facts=buffers)
    alone = {"num_buffers": 0, "buffer_sizes_bytes": [], "num_reduced_in_place": 10}
    write_job(root / "1", rows, MANUAL, ["sync=manual", "sync.coalesce_mb=0"], sync_facts=alone)
    units = {"num_units": 5, "unit_bytes": [135_168, 4_198_400, 4_198_400, 4_198_400, 41_000]}
    write_job(root / "2", rows, FSDP, ["sync=fsdp"], sync_facts=units)
    write_job(root / "3", [[train_row(10, 0.02, 0.0, 100, 1.0)]] * 2, NONE, ["sync=none"])
    write_job(root / "4", rows, BUCKETED, ["sync=bucketed"], 25, bucket_sizes=[4_000_000])
    assert main([str(root)]) == 0
    printed = capsys.readouterr().out.splitlines()
    buckets = markdown_header((root / "report.md").read_text()).index("buckets")
    cells = {job: c[buckets] for job, c in markdown_rows((root / "report.md").read_text()).items()}
    assert cells == {
        "0": "2 buffers: 0.39 0.20 MB + 3 grads in place",
        "1": "no buffer: 10 grads in place",
        "2": "5 units: 0.04-4.20 MB, 12.77 in all",
        "3": "- (sends nothing)",
        "4": "1: 4.00 MB",
    }
    # On screen, what each has without its sizes (report.md's): the count, with the word for what it counts.
    assert printed_columns(printed[1:7])["buckets"] == [
        "2 buffers +3 in place",
        "0 buffers +10 in place",
        "5 units",
        "-",
        "1 bucket",
    ]
    # The per-job bars name the count the same way (five points: one slanted line each).
    ticks = [t.get_text() for t in plot(build_rows(find_jobs(root)), "title").axes[0].get_xticklabels()]
    assert ticks == [
        "sync=manual (job 0, 2 buffers)",
        "sync=manual sync.coalesce_mb=0 (job 1, 0 buffers)",
        "sync=fsdp (job 2, 5 units)",
        "sync=none (job 3)",
        "sync=bucketed (job 4, 1 bucket)",
    ]
    # No ddp job, no dagger: nothing to explain under the table.
    assert not any("†" in line for line in printed)


def test_the_dagger_is_explained_under_the_printed_table(
    strategy_sweep: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Where sync % fits on screen, the note under the table says what its dagger means.
    root = tmp_path / "two"
    rows = [[train_row(10, 0.05, 0.01, 100, 1.0, comm_keys(4e6, 0.02, 0.01))]] * 2
    write_job(root / "0", rows, DDP, ["sync=ddp"], 25)
    write_job(root / "1", rows, MANUAL, ["sync=manual"])
    assert main([str(root)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed_columns(printed[1:4])["sync %"] == ["20.0†", "20.0"]  # 0.01 s of sync in a 0.05 s step
    assert printed[4] == DAGGER_NOTE and DAGGER_NOTE.startswith("† ")
    # The strategy sweep's table is wider: sync % is left off the screen, and with it the dagger and its
    # note; report.md keeps both.
    assert main([str(strategy_sweep)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert "sync %" not in printed[1] and not any("†" in line for line in printed)
    markdown = (strategy_sweep / "report.md").read_text()
    jobs_table = markdown.split("## Jobs")[1].split("## Legend")[0].strip().splitlines()
    assert sum("†" in line for line in jobs_table[2:7]) == 2  # the two ddp jobs' sync %
    assert jobs_table[-1] == DAGGER_NOTE


def test_the_printed_table_fits_100_columns_and_the_files_keep_every_column(
    strategy_sweep: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # Run from the dir above the sweep, as after `train.py -m`: the paths printed are the ones given.
    monkeypatch.chdir(strategy_sweep.parent)
    assert main([strategy_sweep.name]) == 0
    printed = capsys.readouterr().out.splitlines()
    markdown = (strategy_sweep / "report.md").read_text()
    assert max(len(line) for line in markdown.splitlines() if line.startswith("| ")) > 100  # it had to fit
    assert [line for line in printed if len(line) > 100] == []
    screen = printed_columns(printed[1:7])
    # What a reader compares: the swept keys' values (each key once, in its own column), step time,
    # throughput and exposed communication, as report.md has them.
    assert screen["sync"] == ["none", "manual", "ddp", "ddp", "bucketed"]
    assert screen["comm_hook"] == ["", "", "fp16", "", ""] and screen["collective"] == ["", "", "", "", "rs_ag"]
    assert screen["bucket_cap_mb"] == ["", "", "", "auto", ""]
    cells = markdown_rows(markdown)
    header = markdown_header(markdown)
    for name, full in (("step ms", "step ms"), ("samples/s", "samples/s (median row)"), ("exposed ms", "exposed ms")):
        assert screen[name] == [cells[job][header.index(full)] for job in "01234"], name
    # `same as` is empty in every job: not on screen, in report.md and report.csv.
    assert "same as" not in screen and {cells[job][header.index("same as")] for job in "01234"} == {""}
    records = list(csv.DictReader((strategy_sweep / "report.csv").open()))
    assert [r["same_buckets_as"] for r in records] == [""] * 5
    # The ranks and memory peaks did not fit: they are the files', and the last line says where those are.
    assert {"slowest", "fastest", "peak RSS MB", "peak CUDA MB"}.isdisjoint(screen)
    assert {"slowest", "fastest", "peak RSS MB", "peak CUDA MB"} <= set(header)
    assert printed[-1] == "full tables (every column): report.md and report.csv in strategies; plot: report.png"
