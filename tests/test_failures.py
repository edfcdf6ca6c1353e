"""Bad input and dying ranks, through the real CLI: clear messages, quick exits, nothing lost."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import psutil
import pytest

from tests.cli import CPU, assert_every_rank_stopped, env, output, torchrun, torchrun_cmd, train_rows
from tests.compose import REPO
from trainer.logger.wandb_files import read_run

pytestmark = pytest.mark.slow

BAD_INPUTS = {
    # id: (overrides, text the failing ranks must print: key, value, accepted values)
    "unknown-sync": (["sync=bogus"], ["sync=bogus is not an option of sync", "bucketed", "ddp", "manual", "none"]),
    "bucket-zero": (["sync.bucket_cap_mb=0"], ["sync.bucket_cap_mb=0 is invalid", "a number > 0, or auto"]),
    "collective-bogus": (
        ["sync=bucketed", "sync.collective=bogus"],
        ["sync.collective='bogus' is invalid", "all_reduce", "rs_ag"],
    ),
    "bucketed-cap-zero": (["sync=bucketed", "sync.bucket_cap_mb=0"], ["sync.bucket_cap_mb=0 is invalid", "> 0"]),
    # torch's SyncBatchNorm refuses CPU tensors: refused at start-up, before any logger exists.
    "syncbn-on-cpu": (
        ["model=cnn", "data=fake", "model.batchnorm=true", "model.sync_batchnorm=true"],
        ["model.sync_batchnorm=true cannot run on cpu", "trainer.device=cuda", "model.sync_batchnorm=false"],
    ),
    "batch-zero": (["data.batch_size=0"], ["data.batch_size=0 is invalid", "integer >= 1"]),
    "negative-steps": (["trainer.max_steps=-1"], ["trainer.max_steps=-1 is invalid", "integer >= 0"]),
    "misspelt-key": (
        ["trainer.max_step=5"],
        ["trainer.max_step", "Did you mean trainer.max_steps?", "log_every_n_steps"],
    ),
    "missing-root": (
        ["data=mnist", "data.root=/nonexistent/mnist"],
        ["data.root=/nonexistent/mnist", "data.download=true"],
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS, ids=list(BAD_INPUTS))
def test_bad_input_fails_fast_on_every_rank_with_a_clear_message(tmp_path: Path, case: str) -> None:
    overrides, expected = BAD_INPUTS[case]
    started = time.monotonic()
    proc = torchrun(
        [*overrides, CPU, "logger=none", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path, timeout_s=120, fresh=True
    )
    elapsed = time.monotonic() - started
    text = output(proc)
    assert proc.returncode != 0, text
    for fragment in expected:
        assert_every_rank_stopped(text, fragment)
    # One message, from rank 0 only, its parts in the order a reader needs them (for a misspelt key
    # the suggestion before the list), and none of Hydra's "+key" advice.
    assert text.count("configuration error:") == 1, text
    where = [text.index(fragment) for fragment in expected]
    assert where == sorted(where), text
    assert "To append to your config use +" not in text
    # No traceback from our code or Hydra's: the only one allowed is torchrun's own failure report.
    assert text.count("Traceback (most recent call last)") <= 1, text
    assert 'train.py", line' not in text and str(REPO / "trainer") not in text and "hydra/_internal" not in text
    assert elapsed < 60, f"took {elapsed:.0f}s"
    assert not list((tmp_path / "run").glob("metrics/*.jsonl")), "a logger started before the input was checked"


def test_device_cuda_without_a_gpu_per_rank_fails_fast_naming_both_numbers(tmp_path: Path) -> None:
    # No GPU visible (on any machine): each of the 2 ranks stops at start-up with exit code 2.
    started = time.monotonic()
    proc = subprocess.run(
        torchrun_cmd(["trainer.device=cuda", "logger=none", f"hydra.run.dir={tmp_path / 'run'}"]),
        cwd=tmp_path,
        env={**env(), "CUDA_VISIBLE_DEVICES": ""},
        capture_output=True,
        text=True,
        timeout=120,
    )
    text = output(proc)
    assert proc.returncode != 0, text
    message = "trainer.device=cuda needs one GPU per rank: 2 rank(s) on this node but 0 GPU(s) visible"
    assert assert_every_rank_stopped(text, message) == {2}
    assert "trainer.device=auto or cpu" in text, text
    assert time.monotonic() - started < 60


def wait_for_rows(path: Path, count: int, proc: subprocess.Popen[str], timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, "the job ended early"
        if path.exists() and len(train_rows(path)) >= count:
            return
        time.sleep(0.2)
    pytest.fail(f"{path} never reached {count} rows")


def workers(launcher: subprocess.Popen[str]) -> dict[int, psutil.Process]:
    """torchrun's worker processes by global rank."""
    found = {}
    for child in psutil.Process(launcher.pid).children(recursive=True):
        try:
            if "train.py" in " ".join(child.cmdline()) and "RANK" in child.environ():
                found[int(child.environ()["RANK"])] = child
        except psutil.NoSuchProcess:
            continue
    return found


def start_long_job(tmp_path: Path) -> tuple[subprocess.Popen[str], Path]:
    run_dir = tmp_path / "run"
    args = [
        CPU,
        "trainer.max_steps=1000000",
        "trainer.log_every_n_steps=5",
        "trainer.eval_every_n_steps=0",
        "trainer.progress_bar=false",
        f"hydra.run.dir={run_dir}",
    ]
    launcher = subprocess.Popen(
        torchrun_cmd(args), cwd=tmp_path, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    for rank in (0, 1):
        wait_for_rows(run_dir / "metrics" / f"rank{rank}.jsonl", 3, launcher)
    return launcher, run_dir


def assert_rank_flushed(run_dir: Path, rank: int, exit_codes: set[int]) -> None:
    """The rank's W&B run was finished and holds every row its JSONL holds.

    Only this rank's file is read, strictly: a SIGKILLed rank's own file may end inside a record."""
    (run_path,) = (run_dir / "wandb").glob(f"offline-run-*-rank{rank}")
    run = read_run(run_path)
    assert run.name == f"rank-{rank}"
    assert run.exit_code in exit_codes
    logged = [row["_step"] for row in run.history if "train/loss" in row]
    assert logged == [row["step"] for row in train_rows(run_dir / "metrics" / f"rank{rank}.jsonl")]
    assert len(logged) >= 3


def test_a_killed_rank_brings_the_job_down_and_the_survivor_flushes(tmp_path: Path) -> None:
    launcher, run_dir = start_long_job(tmp_path)
    killed_at = time.monotonic()
    workers(launcher)[1].kill()  # SIGKILL: rank 1 cannot clean up at all
    out, _ = launcher.communicate(timeout=60)
    assert launcher.returncode != 0, out
    assert time.monotonic() - killed_at < 30
    # Rank 0 either sees the broken collective first (exit 1) or torchrun's SIGTERM (143);
    # either way its run is finished with everything it logged.
    assert_rank_flushed(run_dir, 0, {1, 143})
