"""A resumed run continues the learning-rate schedule where it stopped, step by step.

schedule=warmup_cosine changes the rate at every step (warmup to the peak at step 5, which step 6
uses too, then cosine decay to step 10). One run trains straight to step 10; others checkpoint at
step k, die at the start of step k + 1 (trainer.fault.kind=crash on every rank), and the same
command resumes from checkpoints/last.pt (trainer.resume=auto) and goes on to 10. With a row at
every step, each step's `train/lr` (the rate that step used) must be the uninterrupted run's, and
the final parameters its bits, on every rank. test_reliability.py compares the rates only at its
logged rows, every second step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.cli import train_rows
from tests.dist_helpers import run_on_ranks
from tests.test_reliability import fit, same

STEPS = 10
RUN = [f"trainer.max_steps={STEPS}", "trainer.log_every_n_steps=1"]  # with BASE: warmup_cosine, 5 warmup steps
DIED_AT = {"in-warmup": 3, "in-decay": 7}  # the checkpoint's step; the run dies starting the next


def _runs(rank: int, world_size: int, root: str) -> dict[str, Any]:
    results = {"straight": fit(rank, world_size, RUN, str(Path(root) / "straight"))}
    for name, k in DIED_AT.items():
        run_dir, every = str(Path(root) / name), f"trainer.checkpoint_every_n_steps={k}"
        crash = ["trainer.fault.kind=crash", f"trainer.fault.rank={rank}", f"trainer.fault.at_step={k + 1}"]
        died = fit(rank, world_size, [*RUN, every, *crash], run_dir)  # every rank fails at the same step
        resumed = fit(rank, world_size, [*RUN, every], run_dir)  # the same command again (the fault is gone)
        results[name] = {"died": died, "resumed": resumed}
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("resume-schedule")
    return root / "runs", run_on_ranks(_runs, 2, root / "ranks", str(root / "runs"), timeout_s=300)


def _rates(run_dir: Path, rank: int) -> list[tuple[int, float]]:
    return [(row["step"], row["train/lr"]) for row in train_rows(run_dir / "metrics" / f"rank{rank}.jsonl")]


@pytest.mark.parametrize("name", sorted(DIED_AT))
def test_a_resumed_run_uses_every_steps_learning_rate_of_the_uninterrupted_run(
    runs: tuple[Path, list[dict[str, Any]]], name: str
) -> None:
    root, ranks = runs
    straight = _rates(root / "straight", 0)
    assert [step for step, _ in straight] == list(range(1, STEPS + 1))
    # Every step its own rate, but for the peak, which the warmup's last step and the decay's first share.
    assert len({lr for _, lr in straight}) == STEPS - 1, straight
    k = DIED_AT[name]
    for rank, result in enumerate(ranks):
        died, resumed = result[name]["died"], result[name]["resumed"]
        assert "injected fault" in died.get("error", ""), died
        assert "error" not in resumed, resumed["error"]
        assert resumed["step"] == STEPS
        rates = _rates(root / name, rank)  # the dead attempt's rows to step k, then the resumed run's
        assert rates[:k] == straight[:k], f"rank {rank} before the crash"
        assert rates == straight, f"rank {rank}: steps {k + 1}-{STEPS} after resuming at step {k}"
        assert same(resumed["model"], result["straight"]["model"]), f"rank {rank}: final parameters differ"
