"""The shared-spawn harness itself: a case that raises on one rank only is reported as that case's
failure, with its own traceback, and the cases after it say why they did not run (instead of the
ranks pairing the wrong collectives and the whole spawn ending in a timeout far from the cause)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import dist_helpers
from tests.dist_helpers import run_on_ranks
from tests.train_helpers import case_results, train_each

CASES = {
    "before": ["fine"],
    "refused": ["all fail"],  # bad input refused on every rank alike: the ranks stay in step
    "between": ["fine"],
    "one-rank-fails": ["rank 1 fails"],
    "after": ["fine"],
}


def _case(rank: int, world_size: int, overrides: list[str], run_dir: str) -> float:
    if overrides == ["rank 1 fails"] and rank == 1:
        raise RuntimeError("rank 1 alone broke")
    if overrides == ["all fail"]:
        raise ValueError("refused on every rank")
    total = torch.ones(1)
    dist.all_reduce(total)  # rank 0 waits here for a rank 1 that never comes, in the failing case
    return float(total.item())


def _every_case(rank: int, world_size: int, root: str) -> dict[str, Any]:
    dist_helpers.GRACE_S = 5.0  # the failing rank takes its silent peer for stuck sooner (this process only)
    return train_each(rank, world_size, _case, CASES, root)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("harness")
    return run_on_ranks(_every_case, 2, root / "ranks", str(root / "runs"))


def test_cases_before_the_failure_keep_their_results(ranks: list[dict[str, Any]]) -> None:
    assert case_results(ranks, "before") == [2.0, 2.0]
    assert all("refused on every rank" in r["refused"] for r in ranks)
    assert case_results(ranks, "between") == [2.0, 2.0]  # a refusal on every rank is not a stop


def test_the_failing_case_reports_its_own_error(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = (r["one-rank-fails"] for r in ranks)
    assert "rank 1 alone broke" in rank1  # the cause, on the rank that raised
    assert "Traceback" in rank0 and "rank 1 alone broke" not in rank0  # its peer's collective ended
    with pytest.raises(AssertionError, match="one-rank-fails failed"):
        case_results(ranks, "one-rank-fails")


def test_the_cases_after_it_say_why_they_did_not_run(ranks: list[dict[str, Any]]) -> None:
    for result in (r["after"] for r in ranks):
        assert result.startswith("not run: case 'one-rank-fails' raised on some ranks only"), result
