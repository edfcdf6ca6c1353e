"""The observer's budget (trainer/sample_budget.py): samples spaced by what they cost, the ceiling
kept, and every rank deciding alike, so the sampled step's own collectives (a sharded norm's
agreement) pair up."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks
from trainer.core import DistContext
from trainer.logger.jsonl import JsonlLogger
from trainer.sample_budget import SampleBudget
from trainer.setup.build import build_parts, build_trainer, prepare_data


def test_a_window_charges_each_sampled_steps_excess_over_a_plain_step() -> None:
    budget = SampleBudget(0.05, max_gap_steps=50)
    # 10 steps in 12 ms, one of them sampled at 3 ms: the 9 others took 1 ms each, so it cost 2 ms.
    budget.window(0.012, 10, [0.003])
    assert budget.spent_s == pytest.approx(0.002) and budget.run_s == pytest.approx(0.012)
    assert budget.mine() == [2000, 12000]
    budget.window(0.010, 10, [])  # a window without a sample costs nothing, adds its time
    budget.window(0.002, 1, [0.002])  # only sampled steps: no plain step to compare with, nothing charged
    assert budget.mine() == [2000, 24000]


def test_every_rank_decides_from_every_ranks_numbers() -> None:
    budget = SampleBudget(0.05, max_gap_steps=50)
    budget.agree([10, 1000, 40, 1000])  # 1 % and 4 %: within 5 %
    assert budget.allowed and budget.may_sample(19, last_sampled=9)
    budget.agree([10, 1000, 60, 1000])  # one rank over: nobody samples, but at the ceiling
    assert not budget.allowed
    assert not budget.may_sample(58, last_sampled=9) and budget.may_sample(59, last_sampled=9)
    unbounded = SampleBudget(None)
    unbounded.agree([10**6, 1])
    assert unbounded.allowed and not unbounded.active


def fit(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    cfg = compose_config(["logger=none", "trainer.progress_bar=false", "trainer.eval_every_n_steps=0", *overrides])
    parts = build_parts(cfg)
    ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
    prepare_data(parts.data, ctx)
    logger = JsonlLogger(Path(run_dir) / "metrics" / f"rank{rank}.jsonl")
    trainer = build_trainer(parts, ctx, [logger], Path(run_dir), {"note": "test"})
    summary = trainer.fit()
    logger.close()
    return summary


def sampled(run_dir: Path, rank: int) -> list[tuple[int, int | None]]:
    lines = (run_dir / "metrics" / f"rank{rank}.jsonl").read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    return [(r["step"], r.get("observer/sampled_step")) for r in rows if r["row"] == "train"]


GAP = 30


@pytest.mark.slow
def test_the_budget_spaces_samples_alike_on_every_rank(tmp_path: Path) -> None:
    """zero stage 3 with the clip: a sampled step agrees on the sharded norm, so ranks that decided
    differently would hang or fail. mlp-tiny's sub-millisecond step: a sample costs more than 1 %."""
    overrides = [
        "sync=zero",
        "sync.stage=3",
        "trainer.max_grad_norm=1.0",
        "trainer.max_steps=150",
        "trainer.log_every_n_steps=5",
        f"trainer.sample_max_gap_steps={GAP}",
    ]
    (summary, _) = run_on_ranks(fit, 2, tmp_path / "job", overrides, str(tmp_path / "run"))
    assert summary["sync"]["sample_budget"] == f"1 % of the run, at least every {GAP} steps"
    ranks = [sampled(tmp_path / "run", rank) for rank in (0, 1)]
    assert ranks[0] == ranks[1]  # every rank sampled the same steps
    rows = ranks[0]
    assert [s for _, s in rows[:2]] == [4, 9]  # before any numbers are back: every candidate
    steps = [s for _, s in rows if s is not None]
    assert len(steps) < len(rows) - 5, rows  # the budget left rows without a sample
    assert rows[-1] == (150, 150)  # the last row has one
    # The ceiling: the first candidate GAP steps or more after the previous sample is sampled.
    assert all(b - a <= GAP + 5 for a, b in zip(steps, steps[1:], strict=False)), steps
