"""Sweeps and multi-process launches end to end: multirun inside torchrun (route 1), the torchrun
launcher plugin (route 2), two torchrun "nodes" on loopback, and submitit's local executor."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.cli import CPU, TORCHRUN, TRAIN, env, output, run_torchrun, torchrun, train_rows
from tests.compose import REPO
from tests.report_helpers import printed_columns
from trainer.logger.wandb_files import find_runs
from trainer.setup.sweep_lines import ONE_PROCESS_LINE

pytestmark = pytest.mark.slow

QUICK = [
    "trainer.max_steps=6",
    "trainer.log_every_n_steps=3",
    "trainer.progress_bar=false",
    "data.num_samples=1024",
    "data.num_val_samples=128",
]
FAIL_FIRST_JOB_ON_RANK_1 = ["trainer.fault.at_step=3,null", "trainer.fault.rank=1"]


def python_train(args: list[str], cwd: Path, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, TRAIN, *args], cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout_s
    )


def sweep_dir(cwd: Path) -> Path:
    (stamp,) = (cwd / "multirun").iterdir()
    return stamp


def assert_job_complete(job: Path, world_size: int = 2, wandb: bool = False) -> dict:
    """A finished job's files, as DESIGN.md lists them; returns its summary."""
    assert (job / ".hydra" / "config.yaml").is_file()
    for rank in range(world_size):
        assert (job / f"train_rank{rank}.log").is_file()
        assert len(train_rows(job / "metrics" / f"rank{rank}.jsonl")) == 2
    assert (job / "checkpoints" / "last.pt").is_file()
    summary = json.loads((job / "summary.json").read_text())
    assert summary["world_size"] == world_size and summary["steps"] == 6
    if wandb:
        runs = find_runs(job)
        assert sorted(run.name for run in runs) == [f"rank-{r}" for r in range(world_size)]
        assert len({run.group for run in runs}) == 1 and all(run.exit_code == 0 for run in runs)
    return summary


def groups(job: Path) -> set[str]:
    return {run.group for run in find_runs(job)}


def test_route1_multirun_inside_torchrun(tmp_path: Path) -> None:
    proc = torchrun(["-m", CPU, "sync=ddp", "sync.bucket_cap_mb=1,5", *QUICK], cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    sweep = sweep_dir(tmp_path)
    first = assert_job_complete(sweep / "0", wandb=True)
    second = assert_job_complete(sweep / "1", wandb=True)
    assert first["sync"]["bucket_cap_mb"] == 1.0 and second["sync"]["bucket_cap_mb"] == 5.0
    assert groups(sweep / "0") == {f"{sweep.name}-0"} and groups(sweep / "1") == {f"{sweep.name}-1"}
    assert proc.stdout.count("Launching 2 jobs") == 1  # Hydra's own messages from rank 0 only
    # A job is two lines: Hydra's naming it and its overrides, then its result; its whole report is in its log.
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 6 and ONE_PROCESS_LINE not in proc.stdout, proc.stdout
    for num, at in ((0, 1), (1, 3)):
        log = sweep / str(num) / "train_rank0.log"
        assert f"#{num} : {CPU} sync=ddp sync.bucket_cap_mb={(1, 5)[num]} trainer." in lines[at], proc.stdout
        assert lines[at + 1].startswith(f"#{num} done: 6 steps, train/loss "), proc.stdout
        assert lines[at + 1].endswith(f"; full report: {tmp_path / log}"), proc.stdout
        assert "done: 6 steps" in log.read_text() and "sync: strategy=ddp" in log.read_text()
    # The sweep ends on one line: its jobs, its dir and the report command, from rank 0 only.
    assert lines[-1] == (
        f"sweep: 2 jobs in multirun/{sweep.name}; report: python -m trainer.tools.report multirun/{sweep.name}"
    ), proc.stdout
    report = subprocess.run(
        [sys.executable, "-m", "trainer.tools.report", str(sweep)], cwd=REPO, capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    assert "sync.bucket_cap_mb=1" in (sweep / "report.md").read_text()
    assert report.stdout.splitlines()[1].split()[:2] == ["job", "bucket_cap_mb"], report.stdout
    assert (sweep / "report.png").stat().st_size > 10_000


def test_strategy_sweep_runs_each_strategy_variant_as_a_job(tmp_path: Path) -> None:
    # Two of experiment=strategy_variants' presets, each a sync choice with a knob; the report reads them.
    args = ["-m", CPU, "logger=none", "experiment=strategy_variants", "+strategy=bucketed_rs_ag,ddp_fp16", "+repeat=1"]
    proc = torchrun([*args, "model.hidden_sizes=[64]", *QUICK], cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    sweep = sweep_dir(tmp_path)
    first = json.loads((sweep / "0" / "summary.json").read_text())["sync"]
    second = json.loads((sweep / "1" / "summary.json").read_text())["sync"]
    assert (first["strategy"], first["collective"]) == ("bucketed", "rs_ag")
    assert (second["strategy"], second["comm_hook"]) == ("ddp", "fp16")
    rows = train_rows(sweep / "0" / "metrics" / "rank0.jsonl")
    assert rows[-1]["comm/reduce_scatter_per_step"] == rows[-1]["comm/all_gather_per_step"] >= 1
    report = subprocess.run(
        [sys.executable, "-m", "trainer.tools.report", str(sweep)], cwd=REPO, capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    assert "Strategy sweep" in report.stdout and "ddp_fp16" in report.stdout
    assert "+strategy=ddp_fp16" in (sweep / "report.md").read_text()


def test_bucket_sweep_builds_different_buckets_and_reports_repeats(tmp_path: Path) -> None:
    # experiment=bucket_sweep as shipped (its 52-tensor model, two repeats interleaved), two of its caps.
    args = ["-m", CPU, "logger=none", "experiment=bucket_sweep", "sync.bucket_cap_mb=0.25,25", *QUICK]
    proc = torchrun(args, cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    sweep = sweep_dir(tmp_path)
    summaries = [json.loads((sweep / str(j) / "summary.json").read_text()) for j in range(4)]
    assert len(summaries[0]["model"]["parameter_tensors"]) == 52
    assert [s["sync"]["bucket_cap_mb"] for s in summaries] == [0.25, 25.0, 0.25, 25.0]  # interleaved
    assert [s["sync"]["num_buckets"] for s in summaries] == [22, 1, 22, 1]
    report = subprocess.run(
        [sys.executable, "-m", "trainer.tools.report", str(sweep)], cwd=REPO, capture_output=True, text=True
    )
    assert report.returncode == 0, report.stderr
    lines = report.stdout.splitlines()
    at = lines.index("Points (median over repeats, spread = min-max of the jobs' medians):") + 1
    points = printed_columns(lines[at : at + 3])
    assert points["bucket_cap_mb"] == ["0.25", "25"] and points["jobs"] == ["0,2", "1,3"]
    assert points["buckets"] == ["22 buckets", "1 bucket"]
    assert all("-" in spread for spread in points["spread ms"])  # a spread min-max for each cap
    assert "warning" not in report.stdout and ("distinguishable" in report.stdout or "No two" in report.stdout)


def test_route1_a_job_failing_on_one_rank_stops_the_sweep(tmp_path: Path) -> None:
    started = time.monotonic()
    proc = torchrun(["-m", CPU, *FAIL_FIRST_JOB_ON_RANK_1, "logger=none", *QUICK], cwd=tmp_path)
    assert proc.returncode != 0, output(proc)
    assert time.monotonic() - started < 60
    assert "injected fault" in output(proc)
    sweep = sweep_dir(tmp_path)
    assert not (sweep / "1").exists(), "a later job started after a failure"
    assert not (sweep / "0" / "summary.json").exists(), "the failed job looks finished"


def test_route2_torchrun_launcher_runs_each_job_as_its_own_group(tmp_path: Path) -> None:
    proc = python_train(
        [
            "-m",
            "hydra/launcher=torchrun",
            "hydra.launcher.nproc_per_node=2",
            CPU,
            "sync=ddp",
            "sync.bucket_cap_mb=1,5",
            *QUICK,
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, output(proc)
    sweep = sweep_dir(tmp_path)
    assert_job_complete(sweep / "0", wandb=True)
    assert_job_complete(sweep / "1", wandb=True)
    assert groups(sweep / "0") == {f"{sweep.name}-0"} and groups(sweep / "1") == {f"{sweep.name}-1"}
    assert proc.stdout.strip().splitlines()[-1].startswith(f"sweep: 2 jobs in multirun/{sweep.name}; report: ")
    assert ONE_PROCESS_LINE not in proc.stdout and proc.stdout.count(" done: 6 steps, ") == 2, proc.stdout


def test_a_sweep_without_a_launcher_says_once_that_each_job_runs_on_one_process(tmp_path: Path) -> None:
    proc = python_train(["-m", CPU, "logger=none", "sync.bucket_cap_mb=1,5", *QUICK], cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == ONE_PROCESS_LINE and proc.stdout.count(ONE_PROCESS_LINE) == 1, proc.stdout
    assert "python -m trainer.tools.launch --nproc_per_node=N train.py -m" in ONE_PROCESS_LINE
    assert "hydra/launcher=torchrun hydra.launcher.nproc_per_node=N" in ONE_PROCESS_LINE
    sweep = sweep_dir(tmp_path)
    for job in ("0", "1"):  # what the line says: world size 1
        assert json.loads((sweep / job / "summary.json").read_text())["world_size"] == 1


def test_route2_isolates_a_failing_job_and_exits_nonzero(tmp_path: Path) -> None:
    """Forked workers (the test above spawns them): each connects to its own job's store, not the
    launching process's in-process one it inherits (over that the group's rendezvous waited forever)."""
    fork = "hydra.launcher.start_method=fork"
    proc = python_train(
        ["-m", "hydra/launcher=torchrun", fork, CPU, *FAIL_FIRST_JOB_ON_RANK_1, "logger=none", *QUICK], cwd=tmp_path
    )
    text = output(proc)
    assert proc.returncode != 0, text
    # The first failure torchrun records is rank 1's fault, or (on a loaded machine) rank 0 losing its
    # peer a moment earlier; either way the job is named and rank 1's own error is on the console.
    assert "job 0 (" in text and re.search(r"failed: rank [01] exited with code 1", text), text
    assert "InjectedFault" in text, text
    sweep = sweep_dir(tmp_path)
    assert not (sweep / "0" / "summary.json").exists()
    assert_job_complete(sweep / "1")  # the next job still ran


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_two_nodes_on_loopback_form_one_job(tmp_path: Path) -> None:
    """Two torchrun invocations, 2 processes each, meeting through c10d rendezvous: world size 4.
    Each is torchrun's own main forked (tests/cli.run_torchrun), the two at once; the fresh `torchrun`
    command's multi-node rendezvous is test_checkpoint_kills.py's elastic job."""
    cmd = [
        TORCHRUN,
        "--nnodes=2",
        "--nproc_per_node=2",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint=127.0.0.1:{free_port()}",
        "--rdzv-id=two-nodes",
        TRAIN,
        CPU,
        *QUICK,
    ]
    with ThreadPoolExecutor(2) as pool:
        nodes = list(pool.map(lambda _: run_torchrun(cmd, cwd=tmp_path, timeout_s=300), range(2)))
    outs = [output(node) for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outs
    (run_dir,) = (tmp_path / "outputs").iterdir()  # all four ranks agreed on one directory
    assert_job_complete(run_dir, world_size=4)
    runs = {run.name: run for run in find_runs(run_dir)}
    assert sorted(runs) == ["rank-0", "rank-1", "rank-2", "rank-3"]
    # Global ranks 0..3, local ranks 0,1 on each node; one group for the whole job.
    local = sorted((run.config["run.rank"], run.config["run.local_rank"]) for run in runs.values())
    assert local[0][0] == 0 and sorted(r for r, _ in local) == [0, 1, 2, 3]
    assert sorted(lr for _, lr in local) == [0, 0, 1, 1] and len({run.group for run in runs.values()}) == 1
    # Only global rank 0 announces results, though each node has a local rank 0.
    assert sum("done: 6 steps" in out for out in outs) == 1


def test_submitit_local_runs_each_job_as_two_tasks(tmp_path: Path) -> None:
    proc = python_train(
        [
            "-m",
            "hydra/launcher=local",
            "hydra.launcher.tasks_per_node=2",
            CPU,
            "sync=ddp",
            "sync.bucket_cap_mb=1,5",
            "logger=none",
            *QUICK,
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, output(proc)
    sweep = sweep_dir(tmp_path)
    for job in ("0", "1"):
        summary = assert_job_complete(sweep / job)
        assert [r["rank"] for r in summary["ranks"]] == [0, 1]
