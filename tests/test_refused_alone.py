"""A parameter one rank leaves out in a later step, without find_unused_parameters: only that rank
can know it (later steps check each rank's own gradients, in no collective, so they cost nothing).
It refuses alone, in one line naming the parameter and the fix; its peer, waiting in that step's
collective, is let go when the refusing rank's process leaves, as under torchrun, never left to
hang (docs/sync.md, "A parameter unused in some steps"). One launch per strategy: after a refusal
on one rank the ranks are out of step and none may issue another collective."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest

from tests.dist_helpers import run_on_ranks, stop_collectives
from tests.edge_models import Case, train
from tests.sync_helpers import from_yaml

# Rank 1 leaves the branch out in step 2 (0-based 1), after both used it in step 1.
SOME_LATER = {1: (0,)}
STRATEGIES: dict[str, tuple[Any, str]] = {
    "manual": (partial(from_yaml, "manual"), "got no gradient on this rank in step 2"),
    "manual-alone": (partial(from_yaml, "manual", coalesce_mb=0), "got no gradient on this rank in step 2"),
    "zero": (partial(from_yaml, "zero"), "got no gradient on this rank in step 2"),
    "zero3-root": (partial(from_yaml, "zero", stage=3, wrap="block"), "got no gradient on this rank in step 2"),
    "bucketed": (partial(from_yaml, "bucketed"), "a bucket never got all its gradients this step"),
    # DDP's own error, at rank 1's next forward: its bucket with the branch was never sent there
    "ddp": (partial(from_yaml, "ddp"), "find_unused_parameters=True"),
}


def _one_rank_refuses(rank: int, world_size: int, name: str) -> dict[str, Any]:
    case = Case("branchy", STRATEGIES[name][0], (0, 1), branch_steps=SOME_LATER, optimizer="sgd", steps=3)
    try:
        result = train(rank, case, alone=True)
    except RuntimeError as err:  # DDP's refusal; or the peer's collective, ended by the refusing rank's exit
        result = {"error": str(err), "raised": type(err).__name__}
    stop_collectives(f"{name}: rank 1 refuses alone")  # no final barrier: the ranks are out of step
    return result


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_the_rank_that_left_it_out_refuses_and_the_job_ends(tmp_path: Any, name: str) -> None:
    rank0, rank1 = run_on_ranks(_one_rank_refuses, 2, tmp_path / "run", name, timeout_s=120)
    words = STRATEGIES[name][1]
    assert words in rank1.get("error", ""), rank1
    if name != "ddp":
        assert "'branch.weight'" in rank1["error"] and "find_unused_parameters=true" in rank1["error"], rank1
        assert rank1["step"] == 1  # step 2 (0-based 1): the first step where that rank can know it
    # rank 0 used the branch and waited in the step's collective: ended by its peer's exit, not a hang
    assert "params" not in rank0 and rank0.get("raised") == "RuntimeError", rank0
