"""One instrument: strategies that move the same data report the same numbers (docs/metrics.md).

Bytes are what a rank puts on the wire, from each collective's kind, buffer and group, whichever
collectives carry the data; time, exposure and overlap come from the same instants by the same
function (trainer/measures.py). Real runs on 2 gloo ranks, the rows as the loggers wrote them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.dist_helpers import run_on_ranks
from tests.train_helpers import build, case_results, train_each

COMMON = ["logger=none", "trainer.progress_bar=false", "trainer.max_steps=6", "trainer.log_every_n_steps=3"]
MLP = ["model.hidden_sizes=[32,32]"]
ONE_BUCKET = ["sync.bucket_cap_mb=25"]  # the whole small model in one bucket (ddp's first bucket is ~1 MiB)
CASES = {
    # One all_reduce of every gradient, after backward or at its end: the same bytes.
    "manual": [*COMMON, *MLP, "sync=manual"],
    "bucketed": [*COMMON, *MLP, "sync=bucketed", *ONE_BUCKET],
    "ddp": [*COMMON, *MLP, "sync=ddp", *ONE_BUCKET],
    "ddp-hook": [*COMMON, *MLP, "sync=ddp", *ONE_BUCKET, "sync.time_buckets=true"],
    # The same units (every Linear, wrap=module), the same data moved: gathered in forward and in
    # backward, reduce-scattered once. On gloo zero stage 3 sends each gather as a broadcast per
    # rank of its slice and its reduction as an all_reduce; on an emulated link what NCCL would.
    "fsdp": [*COMMON, *MLP, "sync=fsdp", "sync.wrap=module"],
    "zero3": [*COMMON, *MLP, "sync=zero", "sync.stage=3", "sync.wrap=module", "sync.prefetch=0"],
    "fsdp-link": [*COMMON, *MLP, "sync=fsdp", "sync.wrap=module", "network=nvlink"],
    "zero3-link": [*COMMON, *MLP, "sync=zero", "sync.stage=3", "sync.wrap=module", "sync.prefetch=0", "network=nvlink"],
}


def _rows(rank: int, world_size: int, overrides: list[str], run_dir: str) -> list[dict[str, Any]]:
    trainer = build(rank, world_size, overrides, run_dir)
    trainer.fit()
    return trainer._rows.rows


@pytest.fixture(scope="module")
def rows(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    root = tmp_path_factory.mktemp("instrument")
    ranks = run_on_ranks(train_each, 2, root / "ranks", _rows, CASES, str(root / "runs"), timeout_s=600)
    return {case: case_results(ranks, case)[0] for case in CASES}  # rank 0's rows


def _close(a: float, b: float, within: float = 0.05) -> bool:
    return abs(a - b) <= within * max(a, b)


def test_one_bucket_of_the_same_size_is_the_same_bytes_and_timed_alike(rows: dict[str, list[dict[str, Any]]]) -> None:
    last = {case: rows[case][-1] for case in ("manual", "bucketed", "ddp", "ddp-hook")}
    bytes_ = {case: row["comm/bytes_per_step"] for case, row in last.items()}
    assert len(set(bytes_.values())) == 1, bytes_  # the same one all_reduce of every gradient
    for case, row in last.items():
        assert row["comm/all_reduce_per_step"] == 1, (case, row)
        # (bucketed's bucket may be back before after_backward asks for it: nothing exposed)
        assert 0 <= row["time/comm_exposed_s"] <= row["time/comm_s"] <= row["time/step_s"], (case, row)
        assert 0 <= row["comm/overlap_fraction"] <= 1 and row["comm/busbw_GBps"] > 0, (case, row)
        assert row["observer/sampled_step"] in (5, 6), (case, row)  # the same sampled step for every strategy


def test_the_same_units_are_the_same_bytes_whatever_collectives_carry_them(
    rows: dict[str, list[dict[str, Any]]],
) -> None:
    fsdp, zero3 = rows["fsdp"][-1], rows["zero3"][-1]
    # The gathers: fsdp's all_gathers and zero stage 3's broadcast per rank move the same parameters.
    assert _close(fsdp["comm/all_gather_bytes_per_step"], zero3["comm/broadcast_bytes_per_step"])
    # The reduction: on gloo zero stage 3 all-reduces (2x a reduce_scatter's bytes on 2 ranks), and says so.
    assert _close(2 * fsdp["comm/reduce_scatter_bytes_per_step"], zero3["comm/all_reduce_bytes_per_step"])
    # Where zero stage 3 sends what fsdp sends (an emulated link takes NCCL's collectives), the totals agree.
    linked_fsdp, linked_zero3 = rows["fsdp-link"][-1], rows["zero3-link"][-1]
    assert "comm/broadcast_per_step" not in linked_zero3 and "comm/all_reduce_per_step" not in linked_zero3
    assert _close(linked_fsdp["comm/bytes_per_step"], linked_zero3["comm/bytes_per_step"]), (linked_fsdp, linked_zero3)
    for row in (linked_fsdp, linked_zero3):
        assert "time/comm_exposed_link_s" in row and 0 <= row["time/comm_exposed_s"] <= row["time/comm_s"]


def test_a_row_names_the_step_it_measured(rows: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    """Rows at 3 and 6: the observer sampled the step before each (2, 5) and the last two (5, 6);
    every row's time/*, comm/* and memory/* come from one step, the one it names."""
    for case, case_rows in rows.items():
        assert [row["step"] for row in case_rows] == [3, 6], case
        assert [row["observer/sampled_step"] for row in case_rows] in ([2, 6], [2, 5]), case
        for row in case_rows:
            phases = sum(row[f"time/{p}_s"] for p in ("data", "forward", "backward", "sync", "optimizer"))
            assert phases == pytest.approx(row["time/step_s"], rel=1e-6), case
