"""End to end: the real train.py under the real torchrun (2 gloo ranks on CPU), and read-backs."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch

from tests.cli import CPU, jsonl, output, python_train, torchrun, train_rows
from tests.compose import REPO, compose_config
from trainer.logger.wandb_files import find_runs
from trainer.setup.build import build_parts
from trainer.tools import export

pytestmark = pytest.mark.slow

DESIGN_KEYS = {
    "step",
    "epoch",
    "train/loss",
    "train/accuracy",
    "train/lr",
    "time/step_s",
    "time/data_s",
    "time/forward_s",
    "time/backward_s",
    "time/sync_s",
    "time/optimizer_s",
    "throughput/samples_per_s",
    "memory/rss_mb",
}
QUICK = ["trainer.progress_bar=false", "data.num_samples=1024", "data.num_val_samples=128"]


def screen(text: str) -> list[str]:
    """Console lines as templates: numbers, paths and the bar's fill replaced, so what is left is
    the fields and words a reader of the README's sample expects."""
    lines = []
    for line in text.splitlines():
        line = re.sub(r"\|[^|]*\|", "|<bar>|", line.strip())
        line = re.sub(r"\S*/\S*", "<path>", line)
        line = re.sub(r"\d[\d.]*", "<n>", line)
        if line:
            lines.append(line)
    return lines


def readme_screen_sample() -> str:
    readme = (REPO / "README.md").read_text()
    section = readme[readme.index("## What a run shows") :]
    return section[section.index("```\n") + 4 : section.index("\n```", section.index("```\n") + 4)]


def test_torchrun_ddp_leaves_the_documented_files_and_wandb_runs(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    proc = torchrun(
        [
            CPU,
            "sync=ddp",
            "sync.bucket_cap_mb=5",
            "trainer.max_steps=20",
            "trainer.log_every_n_steps=5",
            "trainer.sample_max_gap_steps=5",  # every row's step sampled, whatever the budget says
            "trainer.eval_every_n_steps=10",
            f"hydra.run.dir={run_dir}",
            *QUICK[1:],  # with the progress bar: the README's sample shows it
        ],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, output(proc)
    assert "done: 20 steps" in proc.stdout and "wandb sync" in proc.stdout

    # The README's screen sample is what a run prints, field by field (numbers and paths aside).
    sample = screen(readme_screen_sample())
    bars = [line for line in screen(proc.stderr) if line.startswith("train:")]
    assert bars and bars[-1] == next(line for line in sample if line.startswith("train:"))
    assert screen(proc.stdout) == [line for line in sample if not line.startswith("train:")]

    # Hydra's files from rank 0 only; one console log per rank.
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "sync.bucket_cap_mb=5" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "[rank1]" in (run_dir / "train_rank1.log").read_text()
    assert "[rank0]" in (run_dir / "train_rank0.log").read_text()
    # W&B's own debug logs stay in the run dir too, not in ~/.cache/wandb. wandb-core, a process of
    # its own, may still be writing its log as the job exits (seen under load): it gets a moment.
    cache = run_dir / "wandb" / "cache"
    for _ in range(50):
        if list(cache.rglob("core-debug-*.log")):
            break
        time.sleep(0.2)
    assert list(cache.rglob("core-debug-*.log")), sorted((run_dir / "wandb").rglob("*"))

    # Per-rank JSONL with the documented keys at every log step, eval rows at 10 and 20.
    for rank in (0, 1):
        rows = train_rows(run_dir / "metrics" / f"rank{rank}.jsonl")
        assert [row["step"] for row in rows] == [5, 10, 15, 20]
        assert all(row.keys() >= DESIGN_KEYS for row in rows)
        evals = [row for row in jsonl(run_dir / "metrics" / f"rank{rank}.jsonl") if "eval/loss" in row]
        assert [row["step"] for row in evals] == [10, 20]

    # The checkpoint loads without unpickling code, with the unwrapped model's keys.
    state = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    cfg = compose_config(["sync=ddp"])
    expected = build_parts(cfg).model.state_dict().keys()
    assert state["model"].keys() == expected and state["step"] == 20
    # The export tool writes that model as one plain file, the same tensors.
    assert export.main([str(run_dir), "--out", str(tmp_path / "model.pt")]) == 0
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    assert list(exported) == ["model"] and all(torch.equal(exported["model"][k], state["model"][k]) for k in expected)

    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 20 and summary["backend"] == "gloo"
    assert summary["sync"]["strategy"] == "ddp" and summary["sync"]["bucket_cap_mb"] == 5.0
    assert summary["sync"]["num_buckets"] >= 1 and [r["rank"] for r in summary["ranks"]] == [0, 1]
    # The final checkpoint's cost: its own row at step 20 on every rank, and in each rank's record.
    for rank, record in enumerate(summary["ranks"]):
        (saved,) = [r for r in jsonl(run_dir / "metrics" / f"rank{rank}.jsonl") if "checkpoint/blocked_s" in r]
        last_row = train_rows(run_dir / "metrics" / f"rank{rank}.jsonl")[-1]
        assert saved["step"] == 20 and saved["checkpoint/peak_rss_mb"] >= 0.9 * last_row["memory/rss_mb"]
        assert record["checkpoints_written"] == 1
        assert record["max_checkpoint/blocked_s"] == saved["checkpoint/blocked_s"] > 0

    # Both ranks' W&B runs, read back from the .wandb files themselves.
    runs = {run.name: run for run in find_runs(run_dir)}
    assert sorted(runs) == ["rank-0", "rank-1"]
    assert runs["rank-0"].group == runs["rank-1"].group == runs["rank-0"].config["run_name"]
    for rank in (0, 1):
        run = runs[f"rank-{rank}"]
        assert run.exit_code == 0 and run.project == "ddplab"
        assert run.config["run.rank"] == rank and run.config["run.world_size"] == 2  # flat, Hydra's keys
        assert run.config["sync.bucket_cap_mb"] == 5
        logged = {row["_step"]: row["train/loss"] for row in run.history if "train/loss" in row}
        mine = {row["step"]: row["train/loss"] for row in train_rows(run_dir / "metrics" / f"rank{rank}.jsonl")}
        assert logged == mine  # W&B and JSONL hold the same numbers
        assert run.summary["steps"] == 20 and "eval/accuracy" in run.summary


@pytest.mark.parametrize("sync", ["manual", "none", "ddp"])
def test_ranks_share_one_default_run_dir(tmp_path: Path, sync: str) -> None:
    proc = torchrun([f"sync={sync}", "logger=none", "trainer.max_steps=4", *QUICK], cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    (run_dir,) = (tmp_path / "outputs").iterdir()  # both ranks agreed on one stamp
    assert {p.name for p in (run_dir / "metrics").iterdir()} == {"rank0.jsonl", "rank1.jsonl"}
    assert (run_dir / "train_rank0.log").is_file() and (run_dir / "train_rank1.log").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["sync"]["strategy"] == sync and summary["world_size"] == 2
    assert ("ranks never communicate" in proc.stdout) == (sync == "none")


def test_plain_python_is_world_size_one(tmp_path: Path) -> None:
    proc = python_train(
        ["logger=none", "trainer.max_steps=5", f"hydra.run.dir={tmp_path / 'run'}", *QUICK], cwd=tmp_path
    )
    assert proc.returncode == 0, output(proc)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 1 and summary["steps"] == 5


def test_cnn_on_fake_images(tmp_path: Path) -> None:
    args = ["model=cnn", "data=fake", "logger=none", "trainer.max_steps=20", f"hydra.run.dir={tmp_path / 'run'}"]
    proc = torchrun([*args, "data.num_samples=1280", "trainer.progress_bar=false"], cwd=tmp_path)
    assert proc.returncode == 0, output(proc)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 20 and summary["world_size"] == 2


def test_synthetic_task_is_learned(tmp_path: Path) -> None:
    """The demo's promise: loss visibly falls and accuracy rises on the default task."""
    proc = torchrun(
        ["logger=none", "trainer.max_steps=120", f"hydra.run.dir={tmp_path / 'run'}", "trainer.progress_bar=false"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, output(proc)
    rows = train_rows(tmp_path / "run" / "metrics" / "rank0.jsonl")
    assert rows[-1]["train/loss"] < 0.5 * rows[0]["train/loss"]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["eval/accuracy"] > 0.5  # chance is 0.1
