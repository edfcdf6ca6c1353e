"""The promise: N ranks with per-rank batch B train the same model as one process with batch N*B."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks
from tests.train_helpers import SIX_STEPS, assert_same_model, build, case_results, max_abs_diff, params_of, train_each
from trainer.setup.build import build_parts

# 64 samples, 2 ranks x 8 = 4 steps per epoch: 6 steps cross an epoch boundary (set_epoch reshuffles).
COMMON = [
    "logger=none",
    "model.hidden_sizes=[32,32]",
    *SIX_STEPS,
]


def train(
    rank: int, world_size: int, overrides: list[str], run_dir: str, device: str = "cpu"
) -> dict[str, torch.Tensor]:
    """The real build path of train.py, on the process group the helper started (gloo, whatever the device)."""
    trainer = build(rank, world_size, COMMON + overrides, run_dir, device)
    trainer.fit()
    assert trainer.step == 6 and trainer.epoch == 1
    return params_of(trainer)


def trained(
    tmp_path: Path, name: str, world_size: int, overrides: list[str], device: str = "cpu"
) -> list[dict[str, torch.Tensor]]:
    return run_on_ranks(train, world_size, tmp_path / name, overrides, str(tmp_path / name / "run"), device)


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """One process, batch 16: the reference every 2-rank run with batch 8 must reproduce."""
    (params,) = trained(tmp_path_factory.mktemp("single"), "ref", 1, ["sync=none", "data.batch_size=16"])
    return params


# Every 2-rank case trains in one pair of spawned ranks, one case after another on the same gloo
# group: a spawn costs more than a case's training (importing torch alone takes seconds).
CASES = {
    "manual": ["sync=manual", "data.batch_size=8"],
    "ddp": ["sync=ddp", "data.batch_size=8"],
    # ~1 KB buckets: many all_reduces per step, reordered after DDP's first-iteration rebuild.
    "ddp-tiny-buckets": ["sync=ddp", "sync.bucket_cap_mb=0.001", "data.batch_size=8"],
    "ddp-bucket-view-static": [
        "sync=ddp",
        "sync.gradient_as_bucket_view=true",
        "sync.static_graph=true",
        "data.batch_size=8",
    ],
    # The timing hook's all-reduce instead of DDP's C++ one.
    "ddp-timing-hook": ["sync=ddp", "sync.time_buckets=true", "data.batch_size=8"],
    # Accumulation: 2 micro-batches of 4 per rank; ddp must not communicate on the first.
    "ddp-accum": ["sync=ddp", "data.batch_size=4", "trainer.grad_accum_steps=2"],
    "manual-accum": ["sync=manual", "data.batch_size=4", "trainer.grad_accum_steps=2"],
    # Per-tensor calls, and flattened into ~1 KB groups: several coalesced all_reduces per step.
    "manual-per-tensor": ["sync=manual", "sync.coalesce_mb=0", "data.batch_size=8"],
    "manual-small-groups": ["sync=manual", "sync.coalesce_mb=0.001", "data.batch_size=8"],
    # reduce_scatter + all_gather on each flat buffer instead of all_reduce.
    "manual-rs_ag": ["sync=manual", "sync.collective=rs_ag", "data.batch_size=8"],
    # DDP by hand: ~1 KB buckets, several in flight during backward; with rs_ag; accumulating.
    "bucketed-tiny-buckets": ["sync=bucketed", "sync.bucket_cap_mb=0.001", "data.batch_size=8"],
    "bucketed-rs_ag": ["sync=bucketed", "sync.bucket_cap_mb=0.001", "sync.collective=rs_ag", "data.batch_size=8"],
    "bucketed-accum": ["sync=bucketed", "data.batch_size=4", "trainer.grad_accum_steps=2"],
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, object]]:
    root = tmp_path_factory.mktemp("pairs")
    cases = {**CASES, "none": ["sync=none", "data.batch_size=8"]}
    return run_on_ranks(train_each, 2, root / "ranks", train, cases, str(root / "runs"), timeout_s=600)


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process_with_twice_the_batch(
    pairs: list[dict[str, object]], single_process: dict[str, torch.Tensor], case: str
) -> None:
    rank0, rank1 = case_results(pairs, case)
    assert_same_model([rank0, rank1], single_process)
    assert max_abs_diff(rank0, initial_params()) > 1e-3, "nothing was trained"


def initial_params() -> dict[str, torch.Tensor]:
    """The weights every run starts from (same seed), built in this process without training."""
    cfg = compose_config(COMMON)
    return build_parts(cfg).model.state_dict()


def test_grad_accumulation_equals_the_full_batch(tmp_path: Path, single_process: dict[str, torch.Tensor]) -> None:
    (accumulated,) = trained(tmp_path, "accum", 1, ["sync=none", "data.batch_size=8", "trainer.grad_accum_steps=2"])
    assert max_abs_diff(accumulated, single_process) <= 1e-5


def test_sync_none_lets_replicas_diverge(
    pairs: list[dict[str, object]], single_process: dict[str, torch.Tensor]
) -> None:
    rank0, rank1 = case_results(pairs, "none")
    assert max_abs_diff(rank0, rank1) > 1e-4
    assert max_abs_diff(rank0, single_process) > 1e-4
