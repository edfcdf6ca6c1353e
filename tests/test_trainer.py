"""The trainer's own behaviour on one real rank: epochs, precision, what it writes."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks
from tests.train_helpers import case_results, train_each
from trainer.core import DistContext
from trainer.logger.jsonl import JsonlLogger
from trainer.loop.summary import format_report
from trainer.setup.build import build_parts, build_trainer, prepare_data


def fit(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict:
    cfg = compose_config(
        ["logger=none", "trainer.progress_bar=false", "data.num_samples=256", "data.num_val_samples=32", *overrides]
    )
    parts = build_parts(cfg)
    initial = {k: v.clone() for k, v in parts.model.state_dict().items()}
    ctx = DistContext(rank, rank, world_size, torch.device("cpu"), "gloo")
    prepare_data(parts.data, ctx)
    logger = JsonlLogger(Path(run_dir) / "metrics" / f"rank{rank}.jsonl")
    trainer = build_trainer(parts, ctx, [logger], Path(run_dir), {"note": "test"})
    summary = trainer.fit()
    logger.close()
    changed = any(not torch.equal(initial[k], v) for k, v in trainer.model.state_dict().items())
    return {"summary": summary, "changed": changed, "total_steps": trainer.total_steps}


def rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics" / "rank0.jsonl").read_text().splitlines()]


# The runs of the tests below, by case: one spawn of the ranks serves all the cases of a world size
# (train_each), since a spawn costs more than these small runs. The tests read their case's results.
ONE_RANK = {
    # 256 samples / batch 32 = 8 steps per epoch.
    "epochs": ["data.batch_size=32", "trainer.max_steps=null", "trainer.num_epochs=2", "trainer.log_every_n_steps=4"],
    "bf16": ["trainer.precision=bf16", "trainer.max_steps=5"],
}
SMALL = ["model.hidden_sizes=[32,32]"]
# The observer samples 1 step in trainer.sample_every_n_steps (by default the logging interval: the
# step before each row) and the run's last two steps; DDP's C++ all-reduce as every strategy's collectives.
SAMPLED = ["sync=ddp", *SMALL, "trainer.max_steps=24", "trainer.log_every_n_steps=12"]
TWO_RANKS = {
    # ~1 KB buckets on a ~10 KB model: DDP must end up with several.
    "buckets": ["sync=ddp", "sync.bucket_cap_mb=0.001", *SMALL, "trainer.max_steps=4"],
    "rows-manual": ["sync=manual", *SMALL, "trainer.max_steps=6", "trainer.log_every_n_steps=3"],
    "rows-ddp": ["sync=ddp", *SMALL, "trainer.max_steps=6", "trainer.log_every_n_steps=3", "sync.time_buckets=true"],
    "rows-bucketed": ["sync=bucketed", *SMALL, "trainer.max_steps=6", "trainer.log_every_n_steps=3"],
    "rows-zero": ["sync=zero", *SMALL, "trainer.max_steps=6", "trainer.log_every_n_steps=3"],
    "untimed-zero": [
        "sync=zero",
        *SMALL,
        "trainer.max_steps=6",
        "trainer.log_every_n_steps=3",
        "trainer.sample_every_n_steps=0",
    ],
    "sampled-None": SAMPLED,
    "sampled-100": [*SAMPLED, "trainer.sample_every_n_steps=100"],
}
Runs = tuple[Path, list[dict[str, Any]]]


def run_cases(root: Path, world_size: int, cases: dict[str, list[str]]) -> Runs:
    ranks = run_on_ranks(train_each, world_size, root / "ranks", fit, cases, str(root / "runs"), timeout_s=600)
    return root / "runs", ranks


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return run_cases(tmp_path_factory.mktemp("one_rank"), 1, ONE_RANK)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> Runs:
    return run_cases(tmp_path_factory.mktemp("two_ranks"), 2, TWO_RANKS)


def results_of(runs: Runs, case: str) -> tuple[Path, list[dict]]:
    """One case's run dir and every rank's result, failing with the traceback if it raised."""
    root, ranks = runs
    return root / case, case_results(ranks, case)


def test_num_epochs_sets_the_length_and_rows_carry_their_epoch(one_rank: Runs) -> None:
    run_dir, (result,) = results_of(one_rank, "epochs")
    assert result["total_steps"] == 16 and result["summary"]["epochs"] == 2.0
    train = [(r["step"], r["epoch"]) for r in rows(run_dir) if "train/loss" in r]
    assert train == [(4, 0), (8, 0), (12, 1), (16, 1)]
    assert [(r["step"], r["epoch"]) for r in rows(run_dir) if "eval/loss" in r] == [(16, 1)]
    checkpoint = torch.load(run_dir / "checkpoints" / "last.pt", weights_only=True)
    assert checkpoint["step"] == 16 and checkpoint["config"] == {"note": "test"}
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 16


def test_bf16_autocast_trains_on_cpu(one_rank: Runs) -> None:
    run_dir, (result,) = results_of(one_rank, "bf16")
    assert result["changed"]
    assert all(torch.isfinite(torch.tensor(r["train/loss"])) for r in rows(run_dir) if "train/loss" in r)


def test_ddp_reports_the_bucket_layout_after_its_rebuild(two_ranks: Runs) -> None:
    summaries = [r["summary"] for r in results_of(two_ranks, "buckets")[1]]
    sync = summaries[0]["sync"]
    assert sync["buckets_rebuilt"] and sync["num_buckets"] > 2
    assert sum(sync["bucket_sizes_bytes"]) == sync["total_parameter_bytes"]
    assert summaries[1]["sync"] == sync


def param_bytes() -> int:
    cfg = compose_config(["model.hidden_sizes=[32,32]"])
    return sum(p.numel() * p.element_size() for p in build_parts(cfg).model.parameters())


@pytest.mark.parametrize("sync", ["manual", "ddp", "bucketed", "zero"])
def test_rows_account_for_communication(two_ranks: Runs, sync: str) -> None:
    run_dir, results = results_of(two_ranks, f"rows-{sync}")
    # On the wire, 2 ranks (docs/metrics.md): an all_reduce sends its buffer; zero on gloo all-reduces
    # its padded bucket, then each rank broadcasts its half of the updated parameters (half on the wire).
    padded = 4 * results[0]["summary"]["sync"].get("padded_numel", 0)
    expected = padded * 3 / 2 if sync == "zero" else param_bytes()
    train = [r for r in rows(run_dir) if "train/loss" in r]
    assert len(train) == 2
    for row in train:
        assert row["comm/bytes_per_step"] == expected  # every gradient once per step (zero: and every parameter)
        assert all(row[f"time/{p}_s"] > 0 for p in ("forward", "backward", "optimizer"))
        assert 0 <= row["time/comm_exposed_s"] <= row["time/comm_s"] + 1e-9 and row["time/comm_s"] > 0
        if sync == "ddp":  # DDP's one bucket leaves at the end of backward: backward waits for it
            assert row["time/comm_exposed_s"] > 0
        # The others may find a collective back by the time the training thread asks for it (manual
        # waits right after launching; bucketed and zero launch while backward runs), as a loaded
        # machine showed: nothing exposed, by the one definition (docs/metrics.md).
        assert row["comm/busbw_GBps"] > 0
        if sync == "manual":
            # The default coalescing puts this small model's 6 gradients into one all_reduce, inside the sync phase.
            assert row["time/comm_s"] <= row["time/sync_s"] and row["comm/collectives_per_step"] == 1
        elif sync == "ddp":
            assert row["time/comm_s"] <= row["time/backward_s"]  # DDP communicates inside backward


def test_untimed_rows_carry_no_communication_time(two_ranks: Runs) -> None:
    # trainer.sample_every_n_steps=0: no step is sampled, so nothing is counted or timed (docs/metrics.md).
    run_dir, results = results_of(two_ranks, "untimed-zero")
    train = [r for r in rows(run_dir) if "train/loss" in r]
    assert len(train) == 2 and all("train/loss" in r and "memory/rss_mb" in r for r in train)
    assert not [key for r in train for key in r if key.startswith(("time/", "comm/"))]
    assert results[0]["summary"]["sync"]["comm_timing"] == "none"


def test_sync_none_sends_nothing(tmp_path: Path) -> None:
    run_on_ranks(fit, 2, tmp_path / "job", ["sync=none", "trainer.max_steps=3"], str(tmp_path / "run"))
    assert not any(key.startswith("comm/") for r in rows(tmp_path / "run") for key in r)


def test_profile_flag_leaves_a_trace_per_rank(tmp_path: Path) -> None:
    args = ["trainer.profile=true", "trainer.max_steps=6"]
    (result, _) = run_on_ranks(fit, 2, tmp_path / "job", args, str(tmp_path / "run"))
    # The end-of-run summary points at the traces and the command that draws them.
    timeline = f"  profiler/ holds each rank's trace; draw them: python -m trainer.tools.timeline {tmp_path / 'run'}"
    assert timeline in format_report(result["summary"]).splitlines()
    traces = sorted(p.name.split(".")[0] for p in (tmp_path / "run" / "profiler").glob("*.pt.trace.json"))
    assert traces == ["rank0", "rank1"]
    assert '"traceEvents"' in next((tmp_path / "run" / "profiler").glob("rank0.*")).read_text()[:2000]


@pytest.mark.parametrize(("every", "timed_rows"), [(None, [12, 24]), (100, [24])])
def test_ddp_rows_carry_the_sampled_steps_timing(two_ranks: Runs, every: int | None, timed_rows: list[int]) -> None:
    # A row only carries a sample taken in its own window: with 1 step in 100, the row at 12 has none;
    # the run's last steps are sampled, so the last row has one. DDP's own C++ all-reduce is seen
    # through the process group's hooks. The runs: SAMPLED above.
    run_dir, (result, _) = results_of(two_ranks, f"sampled-{every}")
    train = [r for r in rows(run_dir) if "train/loss" in r]
    assert [r["step"] for r in train if "time/comm_s" in r] == timed_rows
    for row in (r for r in train if "time/comm_s" in r):
        assert row["comm/bytes_per_step"] == param_bytes()
        assert row["comm/collectives_per_step"] == result["summary"]["sync"]["num_buckets"]
        assert 0 < row["time/comm_exposed_s"] <= row["time/comm_s"] < row["time/step_s"] * 12
        assert row["comm/busbw_GBps"] > 0 and "comm/overlap_fraction" in row
    assert result["summary"]["sync"]["comm_timing"] == f"1 step in {every or 12} (the step before each row)"
