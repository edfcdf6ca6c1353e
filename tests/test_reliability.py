"""Reliability on real ranks, in process: checkpoints and resume, refusals, corrupt and unsafe files,
pruning, non-finite losses, replica checks, the output-dir check and the RNG round trip. The slow ones
under the real torchrun (elastic restart, hangs, SIGTERM) are in test_restarts.py, which shares BASE
and same() from here."""

from __future__ import annotations

import os
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.cli import train_rows
from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks
from tests.train_helpers import case_results
from trainer.core import DistContext
from trainer.errors import ConfigError
from trainer.logger.jsonl import JsonlLogger
from trainer.reliability.checkpoint import (
    CheckpointError,
    find_resume_state,
    load_checkpoint,
    save_checkpoint,
    step_files,
)
from trainer.setup.build import build_parts, build_trainer, prepare_data
from trainer.setup.preflight import check_output_dir

# 512 samples, 2 ranks x 32 = 8 steps per epoch: checkpoints at 4 and 12 are mid-epoch.
BASE = [
    "logger=none",
    "trainer.progress_bar=false",
    "model.hidden_sizes=[32,32]",
    "data.num_samples=512",
    "data.num_val_samples=64",
    "data.batch_size=32",
    "trainer.log_every_n_steps=2",
    "schedule=warmup_cosine",
    "schedule.warmup_steps=5",
]


def fit(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict:
    """train.py's build path on the helper's process group; returns the final weights or the error."""
    cfg = compose_config([*BASE, *overrides])
    from trainer.setup.config import plain_config

    config = plain_config(cfg)
    parts = build_parts(cfg, world_size)
    ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
    prepare_data(parts.data, ctx)
    logger = JsonlLogger(Path(run_dir) / "metrics" / f"rank{rank}.jsonl")
    try:
        trainer = build_trainer(parts, ctx, [logger], Path(run_dir), config)
        trainer.fit()
    except (RuntimeError, ConfigError) as err:
        return {"error": f"{type(err).__name__}: {err}"}
    finally:
        logger.close()
    model = trainer.sync.checkpointing.full_model_state(trainer.model)  # gathered where sharded (every rank calls it)
    return {"model": {k: v.clone() for k, v in model.items()}, "step": trainer.step}


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# bucketed: gradients as views into its own flat buffers, which a resumed run builds afresh.
SYNCS = ["sync=ddp", "sync=bucketed"]
CHECKPOINTED = ["trainer.max_steps=12", "trainer.checkpoint_every_n_steps=4", "trainer.keep_checkpoints=5"]
NONFINITE = {
    mode: ["trainer.max_steps=6", f"trainer.on_nonfinite={mode}", "trainer.fault.kind=nan_loss"]
    + ["trainer.fault.rank=1", "trainer.fault.at_step=3"]
    for mode in ("raise", "skip")
}
# A row every 2 steps: the row at step 4 sends the agreement that saw step 3, the row at step 6 reads it.
NONFINITE_LATE = ["trainer.max_steps=12", "trainer.log_every_n_steps=2", "trainer.on_nonfinite=raise"] + [
    "trainer.fault.kind=nan_loss",
    "trainer.fault.rank=1",
    "trainer.fault.at_step=3",
]
DRIFT = [
    "trainer.max_steps=8",
    "trainer.check_replicas_every_n_steps=4",
    "trainer.fault.kind=perturb",
    "trainer.fault.rank=1",
    "trainer.fault.at_step=2",
]


def on_rank_0(rank: int, action: Callable[[], Any]) -> Any:
    """action() on rank 0 while rank 1 waits. If it raises, every rank raises, so that no rank goes on
    to the next collective alone (the group would hang or crash, failing every test of the file)."""
    result, error = None, [""]
    if rank == 0:
        try:
            result = action()
        except Exception:
            error = [traceback.format_exc()]
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise RuntimeError(f"rank 0 failed:\n{error[0]}")
    return result


def resume_mid_run(rank: int, world_size: int, sync: str, root: Path) -> dict:
    """Train 12 steps with checkpoints every 4; delete the end, resume from step 4; 12 straight to compare."""
    straight = fit(rank, world_size, [sync, "trainer.max_steps=12"], str(root / "straight"))
    first = fit(rank, world_size, [sync, *CHECKPOINTED], str(root / "resumed"))
    ckpt = root / "resumed" / "checkpoints"
    written = on_rank_0(rank, lambda: [p.name for p in step_files(ckpt)])

    def died_after_step_4() -> None:
        for name in ("step-12.pt", "step-8.pt"):
            (ckpt / name).unlink()
        (ckpt / "last.pt").unlink()
        os.link(ckpt / "step-4.pt", ckpt / "last.pt")

    on_rank_0(rank, died_after_step_4)
    resumed = fit(rank, world_size, [sync, *CHECKPOINTED], str(root / "resumed"))
    return {"straight": straight, "first": first, "written": written, "resumed": resumed}


def refusals(rank: int, world_size: int, root: Path) -> dict:
    """A 2-rank run, then resumes into its dir with a changed config, a logging knob, and resume=never.
    A copy of the dir as the first run left it waits for the 1-rank job (its own spawn)."""
    run_dir = str(root / "run")
    fit(rank, world_size, ["trainer.max_steps=4"], run_dir)
    on_rank_0(rank, lambda: shutil.copytree(run_dir, root / "for_one_rank"))
    changed = fit(rank, world_size, ["trainer.max_steps=4", "optim.lr=0.5"], run_dir)
    # Logging knobs are not training config: changing them still resumes.
    fine = fit(rank, world_size, ["trainer.max_steps=4", "trainer.log_every_n_steps=1"], run_dir)
    fresh = fit(rank, world_size, ["trainer.max_steps=4", "optim.lr=0.5", "trainer.resume=never"], run_dir)
    return {"changed": changed, "fine": fine, "fresh": fresh}


def scenarios(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Every 2-rank scenario of this file, one after another on one group: a spawn of the ranks costs
    more than these small runs. Those that end in an error on every rank come last."""
    cases: dict[str, Callable[[Path], Any]] = {
        **{sync: lambda at, sync=sync: resume_mid_run(rank, world_size, sync, at) for sync in SYNCS},
        "refusals": lambda at: refusals(rank, world_size, at),
        **{
            f"nonfinite-{mode}": lambda at, o=overrides: fit(rank, world_size, o, str(at / "run"))
            for mode, overrides in NONFINITE.items()
        },
        "nonfinite-late": lambda at: fit(rank, world_size, NONFINITE_LATE, str(at / "run")),
        "drift": lambda at: fit(rank, world_size, DRIFT, str(at / "run")),
    }
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = case(Path(root) / name)
        except Exception:  # reported by that case's own test
            results[name] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("reliability")
    return root / "runs", run_on_ranks(scenarios, 2, root / "ranks", str(root / "runs"), timeout_s=600)


def results_of(runs: tuple[Path, list[dict[str, Any]]], case: str) -> tuple[Path, list[Any]]:
    """One scenario's directory and every rank's result, failing with the traceback if it raised."""
    root, ranks = runs
    return root / case, case_results(ranks, case)


@pytest.mark.parametrize("sync", SYNCS)
def test_resume_from_a_mid_run_checkpoint_is_bit_identical(runs: tuple[Path, list[dict[str, Any]]], sync: str) -> None:
    """Train 12 steps with checkpoints every 4; delete the end, resume from step 4; compare with 12 straight."""
    root, (r0, r1) = results_of(runs, sync)
    straight = r0["straight"]
    assert same(r0["first"]["model"], straight["model"])  # checkpointing changes nothing
    assert r0["written"] == ["step-12.pt", "step-8.pt", "step-4.pt"]
    assert r0["resumed"]["step"] == 12
    assert same(r0["resumed"]["model"], straight["model"]) and same(r1["resumed"]["model"], straight["model"])
    # The JSONL continues the step count and the LR schedule where the checkpoint left them, and holds
    # each step once: the first run's rows after step 4 were dropped on resume and logged again.
    rows = train_rows(root / "resumed" / "metrics" / "rank0.jsonl")
    straight_lr = {r["step"]: r["train/lr"] for r in train_rows(root / "straight" / "metrics" / "rank0.jsonl")}
    assert [r["step"] for r in rows] == [2, 4, 6, 8, 10, 12]
    assert all(r["train/lr"] == straight_lr[r["step"]] for r in rows)


def test_resume_refuses_another_world_size_or_training_config(
    runs: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    root, (r0, _) = results_of(runs, "refusals")
    (one,) = run_on_ranks(fit, 1, tmp_path / "b", ["trainer.max_steps=4"], str(root / "for_one_rank"))
    assert "written by 2 ranks, this job has 1" in one["error"] and "trainer.resume=never" in one["error"]
    assert "optim.lr: checkpoint 0.1, now 0.5" in r0["changed"]["error"]
    assert "error" not in r0["fine"]
    assert "error" not in r0["fresh"]
    # resume=never trains from step 0 again in the same dir: its JSONL holds that run's rows, each step
    # once (not appended after the first run's, which would log every step twice).
    steps = [row["step"] for row in train_rows(root / "run" / "metrics" / "rank0.jsonl")]
    assert steps and steps == sorted(set(steps)), steps


def test_corrupt_or_unsafe_checkpoints_are_refused_and_auto_falls_back(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    for step in (2, 4):
        save_checkpoint(ckpt, {"model": {"w": torch.full((3,), float(step))}, "step": step}, keep=3)
    assert load_checkpoint(ckpt / "last.pt")["step"] == 4
    data = (ckpt / "step-4.pt").read_bytes()
    (ckpt / "last.pt").unlink()
    (ckpt / "last.pt").write_bytes(data[: len(data) // 2])  # a truncated last.pt
    with pytest.raises(CheckpointError, match=r"last\.pt is truncated or corrupt"):
        load_checkpoint(ckpt / "last.pt")
    path, state = find_resume_state(tmp_path, "auto")  # falls back to the newest good file
    assert path.name == "step-4.pt" and state["step"] == 4
    # A checkpoint that would need to run code to load is refused, never executed.
    torch.save({"format": 1, "model": {}, "step": 6, "hook": os.system}, ckpt / "step-6.pt")
    with pytest.raises(CheckpointError, match="refusing checkpoint .*step-6.pt"):
        load_checkpoint(ckpt / "step-6.pt")
    assert find_resume_state(tmp_path, "auto")[0].name == "step-4.pt"
    with pytest.raises(CheckpointError, match="step-6.pt"):  # an explicit path is not second-guessed
        find_resume_state(tmp_path, str(ckpt / "step-6.pt"))
    with pytest.raises(CheckpointError, match="no such file"):
        find_resume_state(tmp_path, str(tmp_path / "missing.pt"))
    assert find_resume_state(tmp_path, "never") is None


def test_keep_checkpoints_prunes_old_step_files(tmp_path: Path) -> None:
    for step in range(1, 6):
        save_checkpoint(tmp_path, {"model": {}, "step": step}, keep=2)
    assert [p.name for p in step_files(tmp_path)] == ["step-5.pt", "step-4.pt"]
    assert load_checkpoint(tmp_path / "last.pt")["step"] == 5


@pytest.mark.parametrize(("mode", "expect"), [("raise", "non-finite loss at step 3 on rank(s) 1"), ("skip", None)])
def test_nonfinite_loss_raises_or_is_skipped_on_every_rank(
    runs: tuple[Path, list[dict[str, Any]]], mode: str, expect: str | None
) -> None:
    root, results = results_of(runs, f"nonfinite-{mode}")
    if expect:
        assert all(expect in r["error"] and "NonFiniteError" in r["error"] for r in results)
        return
    assert same(results[0]["model"], results[1]["model"])
    assert all(torch.isfinite(t).all() for t in results[0]["model"].values())
    rows = train_rows(root / "run" / "metrics" / "rank0.jsonl")
    assert rows[-1]["train/skipped_steps"] == 1


def test_nonfinite_loss_stops_every_rank_one_logged_row_after_the_row_that_saw_it(
    runs: tuple[Path, list[dict[str, Any]]],
) -> None:
    # The agreement is launched at a row and read at the next (docs/reliability.md): the loss of
    # step 3 is in the row of step 4, whose agreement the row of step 6 reads and stops at.
    root, results = results_of(runs, "nonfinite-late")
    assert all("non-finite loss at step 3 on rank(s) 1" in r["error"] for r in results)
    for rank in (0, 1):
        rows = train_rows(root / "run" / "metrics" / f"rank{rank}.jsonl")
        assert [row["step"] for row in rows] == [2, 4], f"rank {rank} stopped elsewhere"


def test_replica_check_names_the_rank_that_drifted(runs: tuple[Path, list[dict[str, Any]]]) -> None:
    _, results = results_of(runs, "drift")
    assert all("replica check at step 4: the parameters of rank(s) 1 differ" in r["error"] for r in results)


def test_output_dir_without_room_fails_before_training(tmp_path: Path) -> None:
    check_output_dir(tmp_path / "run", needed_bytes=1)
    with pytest.raises(ConfigError, match=r"hydra.run.dir=.*MiB free, but this run needs about"):
        check_output_dir(tmp_path / "run", needed_bytes=2**60)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="cannot be written"):
        check_output_dir(tmp_path / "file" / "run", needed_bytes=1)


def test_rng_states_survive_a_weights_only_round_trip(tmp_path: Path) -> None:
    """Every generator a rank owns comes back exactly, through the same file format as checkpoints."""
    import random

    import numpy as np

    from trainer.reliability.checkpoint import rng_state, set_rng_state

    save_checkpoint(tmp_path, {"model": {}, "step": 1, "rng": [rng_state(torch.device("cpu"))]}, keep=1)
    expected = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    torch.rand(100), np.random.rand(100), random.random()  # move every generator on
    set_rng_state(load_checkpoint(tmp_path / "last.pt")["rng"][0], torch.device("cpu"))
    again = (torch.rand(4), np.random.rand(4), [random.random() for _ in range(4)])
    assert torch.equal(expected[0], again[0]) and (expected[1] == again[1]).all() and expected[2] == again[2]
