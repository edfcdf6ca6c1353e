"""A profiled sweep's report agrees with its pictures: the rows that held profiled steps are left out of
the table's timings and said to be, `report --timelines` gives the drawn steps' own median beside the
table's, and samples/s that does not follow from step ms (global batch / step ms) is said to. First
on hand-written rows (every expected number worked by hand), then on a real profiled run."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import pytest

from tests.dist_helpers import run_on_ranks
from tests.report_helpers import DDP, markdown_header, markdown_rows, printed_columns, train_row, unwrapped
from tests.report_helpers import write_job as write_job_dir
from tests.train_helpers import build, case_results, train_each
from trainer.logger.jsonl import JsonlLogger
from trainer.tools import report
from trainer.tools.report_rows import PROFILED_KEY

PROFILED = {PROFILED_KEY: 3}


def profiled_rank(scale: float = 1.0) -> list[dict[str, Any]]:
    """The issue's shape: the row whose window held the profiled steps (and the profiler's start and the
    trace's writing) reads 985 ms and 65 samples/s; the unprofiled rows 70-72 ms and ~900 samples/s."""
    return [
        train_row(10, 0.985 * scale, 0.0, 65.0, 2.0, PROFILED),
        train_row(20, 0.070 * scale, 0.0, 900.0, 1.9),
        train_row(30, 0.072 * scale, 0.0, 880.0, 1.8),
        train_row(40, 0.071 * scale, 0.0, 890.0, 1.7),
    ]


def write_job(path: Path, ranks: list[list[dict[str, Any]]], overrides: list[str], global_batch: int = 128) -> Path:
    write_job_dir(path, ranks, DDP, overrides, 25, bucket_sizes=[1000])
    summary = json.loads((path / "summary.json").read_text())
    (path / "summary.json").write_text(json.dumps(summary | {"global_batch_size": global_batch}))
    return path


def test_profiled_rows_are_left_out_of_the_timings_and_said(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    root = tmp_path / "sweep"
    write_job(root / "0", [profiled_rank(), profiled_rank()], ["sync=ddp", "+repeat=1"])
    # Job 1 logged one row only, and the profiler was in it: nothing else to keep, said so.
    only = [[train_row(6, 0.489, 0.0, 130.0, 2.0, PROFILED)]] * 2
    write_job(root / "1", only, ["sync=ddp", "+repeat=2"])
    assert report.main([str(root)]) == 0
    printed = capsys.readouterr().out
    screen = printed_columns(printed.splitlines()[1:4])
    # Job 0: per rank the median of 70, 72, 71 ms (not of 985 too: 71.5); samples/s the sum over ranks
    # of the median of 900, 880, 890 (not 877.5 each): 1780. 128 / 71 ms = 1803: within a fifth.
    assert screen["step ms"] == ["71.00", "489.00"]
    assert screen["samples/s"] == ["1780", "260"]
    said = unwrapped(printed)
    assert "jobs 0 and 1 ran under the profiler" not in said  # job 1 had no other row to keep
    assert "note: job 0 ran under the profiler (trainer.profile=true): step ms and samples/s leave out" in said
    assert "note: job 1: every row held profiled steps, so step ms and samples/s include the profiler's cost" in said
    # Job 1: 128 samples / 489 ms = 262 samples/s against 260: it follows, so no rate note.
    assert "does not follow from step ms" not in said
    markdown = (root / "report.md").read_text()
    assert "- note: job 0 ran under the profiler" in markdown
    cells = markdown_rows(markdown)
    assert cells["0"][markdown_header(markdown).index("step ms")] == "71.00"


def test_samples_per_s_that_does_not_follow_from_step_ms_is_said(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    root = tmp_path / "sweep"
    ranks = [[train_row(step, 0.050, 0.0, 640.0, 1.0) for step in (10, 20, 30)]] * 2
    write_job(root / "0", ranks, ["sync=ddp", "+repeat=1"])  # 1280 against 128 / 50 ms = 2560
    slower = [[train_row(step, 0.050, 0.0, 1200.0, 1.0) for step in (10, 20, 30)]] * 2
    write_job(root / "1", slower, ["sync=ddp", "+repeat=2"])  # 2400 against 2560: within a fifth
    assert report.main([str(root)]) == 0
    said = unwrapped(capsys.readouterr().out)
    line = (
        "note: samples/s does not follow from step ms for job 0 (1280; 128 samples / 50.00 ms: 2560): samples/s "
        "is wall-clock over every step since the previous row, the time between steps included; step ms is one "
        "sampled step per row"
    )
    assert line in said.splitlines()
    assert f"- {line}" in (root / "report.md").read_text().splitlines()


# A real profiled run: 2 gloo ranks, a row per step (each row's sampled step is its own step, so rows 3-5
# time the very steps the profiler records and the timeline draws).
COMMON = [
    "logger=none",
    "trainer.profile=true",
    "data.num_samples=256",
    "data.num_val_samples=16",
    "trainer.max_steps=9",
    "trainer.log_every_n_steps=1",
    "trainer.eval_every_n_steps=0",
    "trainer.progress_bar=false",
    "model.hidden_sizes=[64,48,32]",
    "sync=bucketed",
    "sync.bucket_cap_mb=0.02",
]
CASES = {"profiled": COMMON}


def _train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    rows = JsonlLogger(Path(run_dir) / "metrics" / f"rank{rank}.jsonl")
    trainer = build(rank, world_size, overrides, run_dir, loggers=[rows])
    trainer.fit()
    rows.close()
    return {}


def _median_over_ranks(run: Path, key: str, profiled: bool) -> float:
    """The report's definition by hand: per rank the median over its (un)profiled rows, then over ranks."""
    per_rank = []
    for path in sorted((run / "metrics").glob("rank*.jsonl")):
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        values = [r[key] for r in rows if "train/loss" in r and (PROFILED_KEY in r) == profiled]
        per_rank.append(statistics.median(values))
    return statistics.median(per_rank)


def test_a_profiled_runs_table_and_timeline_each_say_their_steps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ranks = run_on_ranks(train_each, 2, tmp_path / "ranks", _train, CASES, str(tmp_path / "runs"), timeout_s=300)
    case_results(ranks, "profiled")
    run = tmp_path / "runs" / "profiled"
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "0").symlink_to(run)
    assert report.main([str(sweep), "--timelines", "--out", str(tmp_path / "out")]) == 0
    printed = unwrapped(capsys.readouterr().out)
    table_ms = _median_over_ranks(run, "time/step_s", profiled=False) * 1e3
    drawn_ms = _median_over_ranks(run, "time/step_s", profiled=True) * 1e3
    match = re.search(
        r"profiled steps 3-5, median step ([\d.]+) ms \(the table's, without them: ([\d.]+) ms\)", printed
    )
    assert match, printed
    # The table's step ms: the unprofiled rows' (steps 1, 2, 6-9), the same number on the timeline's line.
    markdown = (tmp_path / "out" / "report.md").read_text()
    assert match.group(2) == markdown_rows(markdown)["0"][markdown_header(markdown).index("step ms")]
    assert match.group(2) == f"{table_ms:.2f}"
    # The drawn steps' median from the trace's phases: the profiled rows' own time/step_s (the same host
    # marks, a clock read apart).
    assert float(match.group(1)) == pytest.approx(drawn_ms, rel=0.05, abs=0.3)
    assert "note: job 0 ran under the profiler (trainer.profile=true)" in printed
