"""The overhead benchmark still runs end to end (its numbers are for the README, not for tests)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.cli import TORCHRUN, env
from tests.compose import REPO

pytestmark = pytest.mark.slow


def test_overhead_benchmark_quick_run(tmp_path: Path) -> None:
    out = tmp_path / "overhead.json"
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        str(REPO / "benchmarks" / "overhead.py"),
        "--quick",
        "--device",
        "cpu",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "framework / hand-written" in proc.stdout
    rows = json.loads(out.read_text())
    assert [row["sync"] for row in rows] == ["none", "manual:coalesce_mb=0", "manual", "ddp", "ddp:time_buckets=true"]
    assert all(row["framework_ms"] > 0 and row["loop_ms"] > 0 and row["ratio"] > 0 for row in rows)
