"""A resumed run's metrics/rank{r}.jsonl holds each step once: the rewrite on resume (drops the rows
after the checkpoint, a torn last line, never the file itself). The same under the real torchrun, a
crash -> elastic restart -> re-run of the finished job, is in test_restarts.py (it shares that file's
launches)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from tests.cli import jsonl
from tests.report_helpers import eval_row, run_cli, train_row, write_job
from trainer.logger.base import ResumableLogger, resumed_at
from trainer.logger.jsonl import JsonlLogger, row_kind, truncate_after
from trainer.logger.none import NullLogger
from trainer.tools.report import load_job


def row(step: int, loss: float = 1.0) -> dict[str, Any]:
    return {"step": step, "epoch": 0, "train/loss": loss}


def write(path: Path, rows: list[dict[str, Any]], tail: str = "") -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)
    return path


def steps_and_kinds(path: Path) -> list[tuple[int, str]]:
    return [(r["step"], row_kind(r)) for r in jsonl(path)]


def test_resume_drops_the_rows_after_the_checkpoint_and_appends_after_the_kept_ones(tmp_path: Path) -> None:
    path = write(tmp_path / "metrics" / "rank0.jsonl", [row(2), row(4), eval_row(4, 0.5), row(6, 0.25), row(8)])
    logger = JsonlLogger(path)
    logger.resumed_at(4)
    assert steps_and_kinds(path) == [(2, "train"), (4, "train"), (4, "eval")]
    logger.log(row(6, 0.25))  # the resumed run logs step 6 again (bit-identical: the same values)
    logger.close()
    assert steps_and_kinds(path) == [(2, "train"), (4, "train"), (4, "eval"), (6, "train")]
    assert jsonl(path)[-1] == row(6, 0.25)
    assert not list(path.parent.glob("*.tmp"))  # no temporary file left behind


def test_a_finished_run_resumed_again_logs_its_final_eval_once(tmp_path: Path) -> None:
    """Resumed at its final step, a row of a kind the file already holds there is not written twice."""
    path = write(tmp_path / "rank0.jsonl", [row(2), row(4), eval_row(4, 0.5)])
    before = path.read_bytes()
    logger = JsonlLogger(path)
    logger.resumed_at(4)
    logger.log(eval_row(4, 0.5))
    logger.close()
    assert path.read_bytes() == before
    # A kind the file does not hold at that step is still written (a step's train row and eval row).
    path = write(tmp_path / "rank1.jsonl", [row(2), row(4)])
    logger = JsonlLogger(path)
    logger.resumed_at(4)
    logger.log(row(4))
    logger.log(eval_row(4, 0.5))
    logger.close()
    assert steps_and_kinds(path) == [(2, "train"), (4, "train"), (4, "eval")]


def test_a_torn_last_line_and_rows_logged_twice_before_are_dropped(tmp_path: Path) -> None:
    """A killed process leaves half a row; files from before this fix hold the replayed rows twice."""
    rows = [row(2), row(4), row(6), row(4), row(6), row(8)]
    path = write(tmp_path / "rank0.jsonl", rows, tail='{"step": 10, "epoch": 0, "train/lo')
    logger = JsonlLogger(path)
    logger.resumed_at(6)
    logger.log(row(8))
    logger.close()
    assert steps_and_kinds(path) == [(2, "train"), (4, "train"), (6, "train"), (8, "train")]
    assert path.read_text().endswith("}\n")  # the new row did not glue onto the torn one


def test_the_report_reads_a_torn_job_before_and_after_the_rewrite(tmp_path: Path) -> None:
    rows = [train_row(s, 0.01, 0.001, 1000.0, 2.0 - s / 10) for s in (2, 4, 6)]
    job = write_job(tmp_path / "sweep" / "0", [rows, rows], "trainer.sync.ddp.DDPSync", [], tail='{"step": 8, "ep')
    assert [len(r) for r in load_job(job).rows.values()] == [3, 3]
    for rank in (0, 1):
        truncate_after(job / "metrics" / f"rank{rank}.jsonl", 4)
    assert [[r["step"] for r in rows] for rows in load_job(job).rows.values()] == [[2, 4], [2, 4]]
    proc = run_cli(str(tmp_path / "sweep"))
    assert proc.returncode == 0, proc.stderr


def test_the_file_is_unchanged_if_the_rewrite_fails_midway(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write(tmp_path / "rank0.jsonl", [row(2), row(4), row(6)], tail='{"step": 8')
    before = path.read_bytes()

    def fail(*_: object) -> None:
        raise OSError("disk gone")

    monkeypatch.setattr(os, "replace", fail)
    logger = JsonlLogger(path)
    with pytest.raises(OSError, match="disk gone"):
        logger.resumed_at(4)
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["rank0.jsonl"]  # the temporary file is removed
    logger.close()


def test_a_missing_or_untouched_file_is_not_rewritten(tmp_path: Path) -> None:
    assert truncate_after(tmp_path / "absent.jsonl", 4) == set()
    path = write(tmp_path / "rank0.jsonl", [row(2), row(4), eval_row(4, 0.5)])
    inode = path.stat().st_ino
    assert truncate_after(path, 4) == {"train", "eval"}
    assert path.stat().st_ino == inode


def test_the_trainer_tells_the_loggers_that_keep_rows(tmp_path: Path) -> None:
    path = write(tmp_path / "rank0.jsonl", [row(2), row(4)])
    jsonl_logger, null_logger = JsonlLogger(path), NullLogger()
    assert isinstance(jsonl_logger, ResumableLogger) and not isinstance(null_logger, ResumableLogger)
    resumed_at([jsonl_logger, null_logger], 2)  # what Trainer.__init__ calls after a resume
    jsonl_logger.close()
    assert steps_and_kinds(path) == [(2, "train")]
