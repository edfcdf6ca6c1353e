"""The sweep report on small inputs: one rank's statistics, a truncated JSONL line, which overrides
differ, a plot without bucket sizes, a single job dir and one without .hydra, the CLI refusing dirs
without jobs or metrics, the order of jobs, and a table too wide for the terminal made to fit. The
hand-worked sweep is in test_report.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.report_helpers import (
    DDP,
    MANUAL,
    NONE,
    eval_row,
    markdown_rows,
    printed_columns,
    run_cli,
    train_row,
    write_job,
)
from trainer.tools.report import find_jobs, main, read_jsonl
from trainer.tools.report_plot import plot
from trainer.tools.report_rows import build_rows, differing_overrides, rank_stats
from trainer.tools.report_screen import Column, fit


def test_rank_stats_of_one_rank() -> None:
    rows = [train_row(10, 0.010, 0.001, 100, 2.5), eval_row(10, 0.5), train_row(20, 0.030, 0.003, 300, 2.0)]
    stats = rank_stats(1, rows)
    assert (stats.rank, stats.timed_steps) == (1, 2)
    assert stats.step_ms == pytest.approx(20.0)  # median of 10 and 30 ms
    assert stats.samples_per_s == pytest.approx(200.0)
    assert stats.sync_share == pytest.approx(0.004 / 0.040)
    assert stats.train_loss == 2.0  # the last training row, not an eval row
    assert stats.opt_state_mb is None  # rows logged before memory/optimizer_state_mb existed
    opt = [train_row(10, 0.01, 0.0, 100, 1.0, {"memory/optimizer_state_mb": m}) for m in (8.0, 9.5, 9.0)]
    assert rank_stats(0, opt).opt_state_mb == 9.5  # the maximum over the rank's rows, not the last
    assert stats.step_memory_mb is None  # rows logged before memory/peak_mb existed
    peaks = [train_row(10, 0.01, 0.0, 100, 1.0, {"memory/peak_mb": m}) for m in (30.0, 42.0, 41.0)]
    assert rank_stats(0, [*peaks, eval_row(10, 0.5)]).step_memory_mb == 42.0  # the sampled steps' largest total
    empty = rank_stats(0, [eval_row(10, 0.5)])
    assert (empty.step_ms, empty.samples_per_s, empty.sync_share, empty.train_loss) == (None, None, None, None)


def test_truncated_jsonl_line_is_skipped(tmp_path: Path) -> None:
    path = tmp_path / "rank0.jsonl"
    path.write_text(json.dumps(eval_row(1, 0.5)) + "\n" + '{"step": 2, "train/lo')
    assert read_jsonl(path) == [eval_row(1, 0.5)]


def test_differing_overrides() -> None:
    jobs = [
        ["sync=ddp", "sync.bucket_cap_mb=1", "logger=none", "run_name=a-0", "hydra.verbose=true"],
        ["sync=ddp", "sync.bucket_cap_mb=25", "logger=none", "run_name=a-1", "hydra.verbose=false"],
        ["sync=manual", "logger=none", "run_name=a-2"],
    ]
    assert differing_overrides(jobs) == [
        ["sync=ddp", "sync.bucket_cap_mb=1"],
        ["sync=ddp", "sync.bucket_cap_mb=25"],
        ["sync=manual"],  # it lacks sync.bucket_cap_mb: that key differs too, but it has nothing to show
    ]
    assert differing_overrides([["model=cnn", "seed=1"], ["model=cnn", "seed=2"]]) == [["seed=1"], ["seed=2"]]
    assert differing_overrides([["+extra=1"], ["+extra=2"]]) == [["+extra=1"], ["+extra=2"]]
    assert differing_overrides([["a=1"], ["a=1"]]) == [[], []]
    # One job: everything it was given, except naming and Hydra's own settings.
    assert differing_overrides([jobs[0]]) == [["sync=ddp", "sync.bucket_cap_mb=1", "logger=none"]]


def test_plot_per_job_without_bucket_sizes(tmp_path: Path) -> None:
    root = tmp_path / "sweep"
    write_job(root / "0", [[train_row(10, 0.040, 0.02, 50, 1.0)]], MANUAL, ["sync=manual"])
    write_job(root / "1", [[train_row(10, 0.010, 0.0, 90, 1.0)]], NONE, ["sync=none"])
    fig = plot(build_rows(find_jobs(root)), "title")
    assert fig.axes[0].get_xscale() == "linear"
    labels = [t.get_text() for t in fig.axes[0].get_xticklabels()]
    assert labels == ["job 0\nsync=manual", "job 1\nsync=none"]
    assert [p.get_height() for p in fig.axes[0].patches] == pytest.approx([40.0, 10.0])


def test_single_job_dir_and_missing_hydra(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ranks = [[train_row(10, 0.010, 0.0, 100, 1.0)], [train_row(10, 0.020, 0.0, 50, 3.0)]]
    overrides = ["sync=ddp", "sync.bucket_cap_mb=5", "logger=none", "run_name=s", "hydra.run.dir=/x"]
    job = write_job(tmp_path / "single", ranks, DDP, overrides, 5)
    assert main([str(job)]) == 0
    # One job: all its overrides label it, each under its key, but run_name and hydra.* (naming only).
    screen = printed_columns(capsys.readouterr().out.splitlines()[1:3])
    assert screen == {
        "job": ["single"],
        "sync": ["ddp"],
        "bucket_cap_mb": ["5"],
        "logger": ["none"],
        "step ms": ["15.00"],
        "samples/s": ["150"],
        "sync %": ["0.0†"],
        "peak RSS MB": ["700"],
        "train loss": ["2.0000"],
    }
    assert markdown_rows((job / "report.md").read_text())["single"] == [
        "single",
        "ok",
        "sync=ddp sync.bucket_cap_mb=5 logger=none",
        "ddp",
        "5",
        "",
        "",
        "15.00",
        "150",
        "0.0†",
        "n/m",  # MB/step: ddp sends, but no row measured it (`-` would say it sends nothing: issue 73)
        "n/m",  # exposed ms: likewise
        "700",
        "-",  # opt state MB: no row has memory/optimizer_state_mb
        "-",  # mem MB/rank: no row has memory/peak_mb
        "2.0000",
        "",
        "r1 (20.00 ms)",
        "r0 (10.00 ms)",
    ]
    assert (job / "report.csv").is_file() and (job / "report.png").is_file()

    opt = {"memory/optimizer_state_mb": 12.5}
    bare = write_job(tmp_path / "bare", [[train_row(10, 0.010, 0.0, 100, 1.0, opt)]], None, None, complete=False)
    assert main([str(bare)]) == 0
    # No .hydra: no overrides, no strategy. Every number of an incomplete job is in parentheses; the
    # fastest rank (the slowest, of one rank) does not fit in the terminal.
    assert printed_columns(capsys.readouterr().out.splitlines()[1:3]) == {
        "job": ["bare"],
        "status": ["incomplete"],
        "step ms": ["(10.00)"],
        "samples/s": ["(100)"],
        "sync %": ["(0.0)"],
        "peak RSS MB": ["(700)"],
        "opt state MB": ["(12.5)"],
        "train loss": ["(1.0000)"],
        "slowest": ["(r0 (10.00 ms))"],
    }
    assert markdown_rows((bare / "report.md").read_text())["bare"][-1] == "(r0 (10.00 ms))"


def test_cli_rejects_dirs_without_jobs_or_metrics(tmp_path: Path) -> None:
    empty = tmp_path / "empty"
    empty.mkdir()
    proc = run_cli(str(empty))
    assert proc.returncode == 2 and str(empty) in proc.stderr and "no job dirs" in proc.stderr
    assert "Traceback" not in proc.stderr
    (tmp_path / "nometrics" / "0").mkdir(parents=True)
    proc = run_cli(str(tmp_path / "nometrics"))
    assert proc.returncode == 2 and "no metrics" in proc.stderr and "Traceback" not in proc.stderr
    assert not (empty / "report.md").exists()


def test_jobs_sorted_by_number_and_other_dirs_ignored(tmp_path: Path) -> None:
    for name in ("10", "2"):
        write_job(tmp_path / name, [[train_row(10, 0.010, 0.0, 100, 1.0)]], NONE, [f"seed={name}"])
    (tmp_path / ".submitit").mkdir()
    (tmp_path / "notes").mkdir()
    assert [job.name for job in find_jobs(tmp_path)] == ["2", "10"]


def test_a_table_too_wide_loses_columns_in_drop_order_then_cuts_its_longest_text() -> None:
    sizes = "[" + ",".join(["1024"] * 12) + "]"  # a swept list: 62 characters of one override's value
    columns = [
        Column("job", ["0", "1"]),
        Column("hidden_sizes", [sizes, "[64]"], clip=True, swept=True),
        Column("step ms", ["10.00", "12.50"]),
        Column("slowest", ["r1 (10.00 ms)", "r0 (12.50 ms)"]),
        Column("same as", ["", ""]),  # blank in every row: never shown
    ]
    lines = fit(columns, ["slowest", "hidden_sizes"], width=50).splitlines()
    assert max(len(line) for line in lines) == 50
    # slowest goes first; a swept column is never dropped, its longest value is cut short instead.
    screen = printed_columns(lines)
    assert list(screen) == ["job", "hidden_sizes", "step ms"] and screen["step ms"] == ["10.00", "12.50"]
    # 50 less `job` (3), `step ms` (7) and two gaps of 2: 36 characters, the last of them `…`.
    assert screen["hidden_sizes"] == [sizes[:35] + "…", "[64]"]
