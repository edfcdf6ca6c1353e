"""Bad values through the real train.py and torchrun: one line from rank 0, exit 2, nothing written.

tests/test_config_schema.py sweeps every key in-process; these launches show the same checks stop a
real job before Hydra's app, the process group, a logger or a file exist (W&B is left on, so a run
would appear if anything got that far).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.cli import CPU, output, python_train, rank_exit_codes, torchrun

pytestmark = pytest.mark.slow


def _nothing_written(cwd: Path) -> None:
    """No run dir, sweep dir, W&B run, checkpoint or metrics file: cwd holds nothing at all."""
    assert not list(cwd.iterdir()), sorted(str(p) for p in cwd.rglob("*"))


def _one_line_from_rank0(proc: subprocess.CompletedProcess[str], message: str) -> None:
    text = output(proc)
    lines = [line for line in text.splitlines() if "configuration error:" in line]
    assert lines == [f"configuration error: {message}"], text  # printed once, by rank 0, on one line
    codes = rank_exit_codes(text)
    assert codes[0] == 2 and set(codes) == {0, 1} and set(codes.values()) <= {2, -15}, codes
    # torchrun's ChildFailedError report is its own; nothing of train.py's, Hydra's or torch's.
    assert 'train.py", line' not in text and "hydra/_internal" not in text and "torch/nn" not in text, text
    assert proc.returncode == 1, text  # torchrun's own exit code for any failed worker (torch/distributed/run.py)


def test_torchrun_out_of_range_value(tmp_path: Path) -> None:
    proc = torchrun(["optim.lr=-7", CPU], cwd=tmp_path, timeout_s=120, fresh=True)
    _one_line_from_rank0(proc, "optim.lr=-7.0 is invalid: accepted: a number > 0")
    _nothing_written(tmp_path)


def test_torchrun_multirun_with_one_bad_value_runs_no_job(tmp_path: Path) -> None:
    # The first value is fine: without the check the first job would train before the second failed.
    proc = torchrun(
        ["-m", "sync.static_graph=false,maybe", CPU, "trainer.max_steps=2"], cwd=tmp_path, timeout_s=120, fresh=True
    )
    _one_line_from_rank0(proc, "sync.static_graph=maybe is invalid: accepted: true or false")
    _nothing_written(tmp_path)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["trainer.num_epochs=[1,2"],
            "trainer.num_epochs=[1,2 cannot be parsed (no viable alternative at input '[1,2'); "
            "accepted: an integer >= 1, or null",
        ),
        (["data.num_samples=lots"], "data.num_samples=lots is invalid: accepted: an integer >= 1"),
    ],
    ids=["unclosed-list", "word-for-a-number"],
)
def test_plain_python_exits_2_with_one_line(tmp_path: Path, args: list[str], message: str) -> None:
    proc = python_train(args, cwd=tmp_path, timeout_s=120)
    assert proc.returncode == 2, output(proc)
    assert proc.stderr.strip() == f"configuration error: {message}" and proc.stdout == "", output(proc)
    _nothing_written(tmp_path)
