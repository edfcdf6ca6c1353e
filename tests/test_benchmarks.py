"""The benchmarks still run end to end (their numbers are for the README, not for tests)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cli import TORCHRUN, env, run_torchrun
from tests.compose import REPO
from tests.text_helpers import write_corpus

pytestmark = pytest.mark.slow
# The quick run names its strategies rather than taking the benchmark's default list, which grows
# with every strategy added: this test checks that the benchmark runs, and each strategy has its own tests.
STRATEGIES = ("none", "manual:coalesce_mb=0", "manual", "ddp", "ddp:time_buckets=true")


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
        "--strategies",
        ",".join(STRATEGIES),
        "--json",
        str(out),
        "--baseline",
        "ddp",
    ]
    proc = run_torchrun(cmd, cwd=tmp_path, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "framework / hand-written [IQR]" in proc.stdout and "/ ddp [IQR]" in proc.stdout
    rows = json.loads(out.read_text())
    assert [row["sync"] for row in rows] == list(STRATEGIES)
    assert all(row["framework_ms"] > 0 and row["loop_ms"] > 0 and row["ratio"] > 0 for row in rows)
    # --baseline ddp: every other strategy also against the framework's ddp, timed in the same rounds
    for row in rows:
        low, high = row["ratio_iqr"]
        assert low <= row["ratio"] <= high
        if row["sync"] == "ddp":
            assert row["vs_baseline"] is None
        else:
            low, high = row["vs_baseline_iqr"]
            assert row["vs_baseline"] > 0 and low <= row["vs_baseline"] <= high


def test_overhead_benchmark_on_a_language_model(tmp_path: Path) -> None:
    """The gpt row: [batch, time, vocab] logits through every piece, the gradient memory included;
    --set reaches the framework's config (a row every step: the quick run's 8 steps would log none)."""
    out = tmp_path / "gpt.json"
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(REPO / "benchmarks" / "overhead.py"), "--quick"]
    cmd += ["--device", "cpu", "--models", "gpt", "--strategies", "ddp", "--json", str(out)]
    cmd += ["--set", "trainer.log_every_n_steps=1"]
    proc = run_torchrun(cmd, cwd=tmp_path, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the framework with trainer.log_every_n_steps=1" in proc.stdout
    (row,) = json.loads(out.read_text())
    assert row["model"] == "gpt" and row["ratio"] > 0 and row["grad_mb"] > 0
    assert row["mb_per_step"] > 0  # read back from the framework's rows, which only --set made it write


def test_overhead_benchmark_collective_cost_quick_run(tmp_path: Path) -> None:
    """--collective-cost: every route and step pair has its row, and every time is positive (the
    extras are differences of noisy times: only their presence is checked); network=none is said to
    run the communication object without a link."""
    out = tmp_path / "cost.json"
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=1", str(REPO / "benchmarks" / "overhead.py")]
    cmd += ["--collective-cost", "--quick", "--json", str(out)]
    proc = run_torchrun(cmd, cwd=tmp_path, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "network=none: the communication object without a link" in proc.stdout
    assert "timer slack: waiting thread" in proc.stdout and "| ~0 link / none [IQR] |" in proc.stdout
    report = json.loads(out.read_text())
    assert "branch_ns" not in report and len(report["timer_slack_us"]) == 2
    routes = {row["route"]: row for row in report["collectives"]}
    assert {
        "torch: launch + wait()",
        "Comm (network=none): wait()",
        "Comm on a ~0 link: wait()",
        "Comm on a ~0 link: get_future().wait()",
    } <= set(routes)
    assert any(name.startswith("DDP hook's future") for name in routes) and len(routes) == 9
    for row in routes.values():
        low, high = row["us_iqr"]
        assert row["us"] > 0 and low <= row["us"] <= high  # 2 rounds' quartiles may reach below 0
        floor = row["against"] == "(the floor)"
        assert (row["extra_us"] is None) == floor
        assert floor or row["against"] in routes or row["against"].startswith("its deadline")
    steps = [(row["model"], row["sync"]) for row in report["steps"]]
    assert steps == [("mlp-tiny", "manual"), ("mlp-tiny", "ddp"), ("mlp-deep", "manual:coalesce_mb=0")]
    assert all(row["none_ms"] > 0 and row["free_ms"] > 0 and row["ratio"] > 0 for row in report["steps"])


def test_step_costs_counts_every_piece_of_the_step_path(tmp_path: Path) -> None:
    script = REPO / "benchmarks" / "step_costs.py"
    cmd = [sys.executable, str(script), "--device", "cpu", "--number", "200"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    cells = dict(line.strip("| ").replace("*", "").split(" | ") for line in proc.stdout.splitlines()[3:])
    assert list(cells)[0].startswith("window.add") and list(cells)[-1] == "total", proc.stdout
    pieces = [float(us) for name, us in cells.items() if name != "total"]
    assert len(pieces) == 6 and all(us > 0 for us in pieces)  # each piece does real work, and was timed
    # Each cell is rounded to 0.1 µs, so the pieces' sum may miss the total by up to 0.05 per piece.
    assert abs(sum(pieces) - float(cells["total"])) <= 0.05 * len(pieces) + 1e-9


def test_row_cost_benchmark_times_each_variant_against_the_loop(tmp_path: Path) -> None:
    cmd = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(REPO / "benchmarks" / "row_cost.py"), "--quick"]
    proc = run_torchrun(cmd, cwd=tmp_path, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    first, second = proc.stdout.split("one row taken apart")
    table = [line.strip("| ").split(" | ") for line in first.splitlines() if line.startswith("| ")][1:]
    variants = ["framework", "no non-finite agreement", "no rows", "hand-written"]
    assert [row[0] for row in table] == [*variants, "hand-written + 1 collective / 10 steps"], proc.stdout
    for _, us, ratio, cpu_us in table:
        assert float(us) > 0 and float(cpu_us) > 0 and float(ratio.split()[0]) > 0
    assert dict((row[0], row[2]) for row in table)["hand-written"] == "1.000 [1.00–1.00]"
    # The row's parts, each timed where it runs: inside the logged step, the JSONL line inside the
    # row (every sample of a part lies inside its container's sample, so their medians keep the order).
    apart = {
        label.strip(): float(us)
        for label, us in (line.strip("| ").split(" | ") for line in second.splitlines() if line.startswith("| "))
        if us != "µs"
    }
    logged, row = apart["the logged step, its row included"], apart["the row (TrainRows.log)"]
    inside = ["gradient norm", "window's totals", "non-finite agreement", "TrainRows.log"]
    assert all(any(word in label for label in apart) for word in inside), proc.stdout
    assert 0 < apart["a step between rows"] < logged  # the logged step carries a row: ~2 steps' time here
    assert all(logged >= us for label, us in apart.items() if any(word in label for word in inside)), proc.stdout
    assert all(row >= us for label, us in apart.items() if label.startswith("of which")), proc.stdout
    assert sum(label.startswith("of which") for label in apart) == 3, proc.stdout


def test_activation_memory_benchmark_quick_run(tmp_path: Path) -> None:
    """Both variants measured side by side: checkpointing keeps fewer bytes for backward, and the
    time ratio sits inside its own spread."""
    out = tmp_path / "activations.json"
    cmd = [sys.executable, str(REPO / "benchmarks" / "activation_memory.py"), "--quick", "--json", str(out)]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| saved MiB | saved MiB ckpt |" in proc.stdout and "ckpt / plain [IQR]" in proc.stdout
    (row,) = json.loads(out.read_text())
    assert 0 < row["saved_mib_checkpointed"] < row["saved_mib"] and row["saved_ratio"] < 0.5
    low, high = row["time_ratio_iqr"]
    assert row["ms"] > 0 and row["ms_checkpointed"] > 0 and low <= row["time_ratio"] <= high
    assert row["peak_mib"] is None  # CPU: no CUDA allocator to read


def test_clip_cost_and_nanogpt_recipe_benchmarks_run(tmp_path: Path) -> None:
    """The recipe's two benchmarks still run end to end: their tables are for docs/, not for tests."""
    clip = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(REPO / "benchmarks" / "clip_cost.py")]
    clip += ["--models", "mlp-tiny", "--strategies", "ddp,zero", "--rounds", "2", "--steps", "3"]
    proc = run_torchrun(clip, cwd=tmp_path, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "| mlp-tiny | ddp |" in proc.stdout and "| mlp-tiny | zero |" in proc.stdout
    recipe = [TORCHRUN, "--standalone", "--nproc_per_node=2", str(REPO / "benchmarks" / "nanogpt_recipe.py")]
    corpus = write_corpus(tmp_path / "corpus.txt", 20_000)  # not the stdlib default: its tokens take seconds
    recipe += ["--steps", "4", "--chunk", "2", "--val-windows", "8", "--path", str(corpus)]
    proc = run_torchrun(recipe, cwd=tmp_path, timeout_s=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [row for row in proc.stdout.splitlines() if row.startswith("| val loss at step 4 |")]
    ours, theirs = (float(cell) for cell in line.split("|")[2:4])
    assert 0 < ours < 10 and 0 < theirs < 10  # both trained the same model shape on the same tokens
