"""The shared-spawn harness itself: a case that raises on one rank only is reported as that case's
failure, with its own traceback, and the cases after it say why they did not run (instead of the
ranks pairing the wrong collectives and the whole spawn ending in a timeout far from the cause)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import dist_helpers
from tests.cli import TORCHRUN, output, run_torchrun
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


RANK_SCRIPT = """
import os, sys, signal, torch
print("rank", os.environ["RANK"], __name__, sys.argv[1:], sys.path[0] == os.path.dirname(__file__),
      torch.get_num_threads(), signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)
print("unflushed", os.environ["RANK"])  # kept only if output is unbuffered, as under python -u
if os.environ["RANK"] == "1":
    import time
    time.sleep(1)  # rank 0 has printed: torch stops the other ranks once one fails
    os._exit(3)
os._exit(0)
"""


def test_a_forked_rank_runs_the_script_as_a_fresh_interpreter_would(tmp_path: Path) -> None:
    # tests/forks.py's agent forks each rank; what the rank sees must be what `python -u script` gives it.
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    proc = run_torchrun([TORCHRUN, "--standalone", "--nproc_per_node=2", str(script), "a", "b"], cwd=tmp_path)
    text = output(proc)
    assert proc.returncode == 1, text  # torchrun's own exit code for a failed rank
    assert "exitcode  : 3" in text, text  # rank 1's own code, in torchrun's report
    assert "rank 0 __main__ ['a', 'b'] True 1 True" in proc.stdout, text  # OMP_NUM_THREADS=1 from tests.cli.env()
    assert "unflushed 0" in proc.stdout, text
