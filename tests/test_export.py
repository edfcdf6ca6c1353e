"""python -m trainer.tools.export: a checkpoint's model as one plain {"model": state_dict} file.

Checkpoints written here with the lab's own writer (save_checkpoint), in the real format; the real
run's export is checked end to end in test_cli.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from models.mlp import MLP
from trainer.reliability.checkpoint import save_checkpoint
from trainer.tools import export


def checkpointed_run(run_dir: Path, seed: int, steps: tuple[int, ...] = (2, 4)) -> dict[int, dict[str, torch.Tensor]]:
    """A run dir whose checkpoints/ holds one model per step (a different one each), as training leaves it."""
    models = {}
    for step in steps:
        torch.manual_seed(seed + step)
        model = MLP(hidden_sizes=[16], input_shape=[8], num_classes=3).state_dict()
        save_checkpoint(run_dir / "checkpoints", {"model": model, "optimizer": {}, "step": step}, keep=5)
        models[step] = model
    return models


def equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_the_last_or_a_named_step_exports_as_a_plain_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    models = checkpointed_run(tmp_path / "run", seed=0)
    assert export.main([str(tmp_path / "run"), "--out", str(tmp_path / "last.pt")]) == 0
    assert export.main([str(tmp_path / "run"), "--step", "2", "--out", str(tmp_path / "two.pt")]) == 0
    last = torch.load(tmp_path / "last.pt", weights_only=True)
    assert list(last) == ["model"] and equal(last["model"], models[4])  # nothing but the model
    assert equal(torch.load(tmp_path / "two.pt", weights_only=True)["model"], models[2])
    assert not equal(models[2], models[4])
    assert (
        capsys.readouterr().out.splitlines()[0].startswith(f"exported {tmp_path / 'run' / 'checkpoints' / 'last.pt'}")
    )


def test_a_sweep_dir_exports_each_job(tmp_path: Path) -> None:
    jobs = {job: checkpointed_run(tmp_path / "sweep" / str(job), seed=10 * job) for job in (0, 1)}
    assert export.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "out")]) == 0
    for job, models in jobs.items():
        assert equal(torch.load(tmp_path / "out" / f"{job}.pt", weights_only=True)["model"], models[4])
    # A file name for a sweep would be overwritten by each job: refused, saying why.
    assert export.main([str(tmp_path / "sweep"), "--out", str(tmp_path / "one.pt")]) == 2


def test_a_missing_step_names_the_kept_ones_and_writes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    checkpointed_run(tmp_path / "run", seed=0)
    assert export.main([str(tmp_path / "run"), "--step", "3", "--out", str(tmp_path / "x.pt")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.endswith("step-3.pt does not exist (checkpoints kept there: step-2.pt, step-4.pt)"), err
    assert not list(tmp_path.glob("x.pt*"))
    assert export.main([str(tmp_path), "--out", str(tmp_path / "x.pt")]) == 1  # no checkpoints/ anywhere
    assert "no checkpoints/ under" in capsys.readouterr().err
