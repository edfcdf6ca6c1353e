"""Hand-written job dirs for the sweep report's tests (test_report*.py), and readers of what it printed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from tests.compose import REPO

DDP = "trainer.sync.ddp.DDPSync"
MANUAL = "trainer.sync.manual.ManualSync"
NONE = "trainer.sync.none.NoSync"
BUCKETED = "trainer.sync.bucketed.BucketedSync"
FSDP = "trainer.sync.fsdp.FSDPSync"


def train_row(
    step: int,
    step_s: float,
    sync_s: float,
    samples_per_s: float,
    loss: float,
    extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A training row with the keys every row has; `extra` adds or replaces some (comm_keys, memory)."""
    return {
        "step": step,
        "epoch": 0,
        "train/loss": loss,
        "train/accuracy": 0.5,
        "train/lr": 0.1,
        "time/step_s": step_s,
        "time/data_s": 0.0,
        "time/forward_s": 0.0,
        "time/backward_s": 0.0,
        "time/sync_s": sync_s,
        "time/optimizer_s": 0.0,
        "throughput/samples_per_s": samples_per_s,
        "memory/rss_mb": 700.0,
        "some/future_key": 123.0,  # unknown keys must be ignored
        **(extra or {}),
    }


def comm_keys(bytes_per_step: float, comm_s: float | None = None, exposed_s: float | None = None) -> dict[str, Any]:
    """A communicating strategy's keys: bytes always; times only on a row whose step was timed (ddp samples)."""
    keys: dict[str, Any] = {"comm/bytes_per_step": bytes_per_step, "comm/collectives_per_step": 2.0}
    if comm_s is not None and exposed_s is not None:
        keys |= {
            "time/comm_s": comm_s,
            "time/comm_exposed_s": exposed_s,
            "comm/overlap_fraction": 1.0 - exposed_s / comm_s,
            "comm/busbw_GBps": bytes_per_step / comm_s / 1e9,
        }
    return keys


def eval_row(step: int, accuracy: float) -> dict[str, Any]:
    return {"step": step, "epoch": 0, "eval/loss": 1.0, "eval/accuracy": accuracy}


def write_job(
    path: Path,
    ranks: list[list[dict[str, Any]]],
    target: str | None,
    overrides: list[str] | None,
    bucket_cap_mb: float | str | None = None,
    complete: bool = True,
    tail: str = "",
    sync_knobs: dict[str, Any] | None = None,
    bucket_sizes: list[int] | None = None,
    sync_facts: dict[str, Any] | None = None,
) -> Path:
    """One job dir; `bucket_sizes` go to summary.json as the strategy's `sync.bucket_sizes_bytes`,
    `sync_facts` as the rest of what its describe() says (manual's buffers, fsdp's units)."""
    (path / "metrics").mkdir(parents=True)
    for rank, rows in enumerate(ranks):
        lines = "".join(json.dumps(row) + "\n" for row in rows)
        (path / "metrics" / f"rank{rank}.jsonl").write_text(lines + tail)
    if target is not None:
        sync: dict[str, Any] = {"_target_": target}
        if bucket_cap_mb is not None:
            sync["bucket_cap_mb"] = bucket_cap_mb
        sync |= sync_knobs or {}
        (path / ".hydra").mkdir()
        config = {"run_name": "${ddplab.run_stamp:}", "model": {"_target_": "models.mlp.MLP"}, "sync": sync}
        (path / ".hydra" / "config.yaml").write_text(yaml.safe_dump(config))
        (path / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if complete:
        summary: dict[str, Any] = {"steps": 30, "sync": {"strategy": target}}
        if bucket_sizes is not None:
            summary["sync"]["bucket_sizes_bytes"] = bucket_sizes
        summary["sync"] |= sync_facts or {}
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "trainer.tools.report", *args]
    return subprocess.run(command, check=False, cwd=REPO, capture_output=True, encoding="utf-8", timeout=120)


def markdown_header(text: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith("| job"))
    return [c.strip() for c in line.strip("|").split(" | ")]


def markdown_rows(text: str) -> dict[str, list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("| ") and not line.startswith("| job")]
    cells = [[c.strip() for c in line.strip("|").split(" | ")] for line in lines]
    return {c[0]: c for c in cells}


def printed_columns(lines: Sequence[str]) -> dict[str, list[str]]:
    """A printed table's cells by column: lines[0] is its header, whose names hold single spaces only
    (columns are two apart), and every cell starts where its column's name does."""
    starts = [(m.start(), m.group()) for m in re.finditer(r"\S+(?: \S+)*", lines[0])]
    ends: list[int | None] = [start for start, _ in starts[1:]] + [None]
    return {
        name: [line[start:end].strip() for line in lines[1:]] for (start, name), end in zip(starts, ends, strict=True)
    }


def unwrapped(printed: str) -> str:
    """What the report printed with every sentence it wrapped back on one line (it indents continuations)."""
    return printed.replace("\n  ", " ")
