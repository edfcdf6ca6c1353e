"""sync.comm_hook: PyTorch's own DDP communication hooks, and comm/bytes_per_step telling what they sent."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks
from tests.train_helpers import build, case_results, params_of, train_each
from trainer.errors import ConfigError
from trainer.setup.build import build_parts
from trainer.setup.precheck import check_overrides
from trainer.sync.describe import describe

# 32 samples, 2 ranks x 8: 2 steps per epoch, so 12 steps see each sample 6 times; a row every 2 steps.
COMMON = [
    "logger=none",
    "sync=ddp",
    "model.hidden_sizes=[32,32]",
    "data.num_samples=32",
    "data.num_val_samples=16",
    "data.batch_size=8",
    "trainer.max_steps=12",
    "trainer.log_every_n_steps=2",
    "trainer.sample_budget=null",  # every row's bytes are checked: every row sampled
    "trainer.eval_every_n_steps=0",
    "trainer.progress_bar=false",
]
POWERSGD_RANK = 2
POWERSGD_START = 2  # steps 1-2 plain all-reduce (the row at step 2), steps 3-12 compressed


def train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """The real build path of train.py on the helper's gloo group: final parameters and every logged row."""
    trainer = build(rank, world_size, COMMON + overrides, run_dir)
    trainer.fit()
    return {"params": params_of(trainer), "rows": trainer._rows.rows, "sync": describe(trainer.sync)}


def parameter_shapes() -> list[torch.Size]:
    cfg = compose_config(COMMON)
    return [p.shape for p in build_parts(cfg).model.parameters()]


def powersgd_numel(shape: torch.Size, rank: int) -> int:
    """Elements PowerSGD all-reduces for one gradient: P and Q if compressing pays 2x, else all of it.

    PowerSGD's rule (min_compression_rate 2): the gradient as an n x m matrix (m = the rest of the
    shape, 1 for a bias) goes as P (n x r) and Q (m x r), r = min(n, m, rank), when (n + m) r 2 < n m.
    """
    n = shape[0]
    m = shape.numel() // n
    r = min(n, m, rank)
    return (n + m) * r if (n + m) * r * 2 < n * m else n * m


def expected_per_step(hook: str, step: int) -> tuple[int, int]:
    """(bytes, collectives) each step sends with this hook; the default 25 MiB cap makes one bucket."""
    shapes = parameter_shapes()
    full = sum(s.numel() for s in shapes)
    if hook in ("fp16", "bf16"):
        return 2 * full, 1
    if hook == "powersgd" and step > POWERSGD_START:  # uncompressed tensors, then P, then Q
        return 4 * sum(powersgd_numel(s, POWERSGD_RANK) for s in shapes), 3
    return 4 * full, 1


HOOKS = ("none", "fp16", "bf16", "powersgd")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every hook's run, one after another in one pair of spawned ranks."""
    knobs = [f"sync.powersgd_rank={POWERSGD_RANK}", f"sync.powersgd_start_step={POWERSGD_START}"]
    cases = {hook: [f"sync.comm_hook={hook}", *knobs] for hook in HOOKS}
    # ~1 KB buckets: several in flight at once, which on gloo aborted PowerSGD once it compressed
    cases["powersgd-buckets"] = ["sync.comm_hook=powersgd", "sync.bucket_cap_mb=0.001", *knobs]
    root = tmp_path_factory.mktemp("hooks")
    return run_on_ranks(train_each, 2, root / "ranks", train, cases, str(root / "runs"), timeout_s=600)


@pytest.mark.parametrize("hook", HOOKS)
def test_hook_keeps_replicas_equal_counts_what_it_sends_and_trains(trained: list[dict[str, Any]], hook: str) -> None:
    rank0, rank1 = case_results(trained, hook)
    assert all(torch.equal(rank0["params"][k], rank1["params"][k]) for k in rank0["params"]), "replicas differ"
    assert rank0["sync"]["comm_hook"] == hook
    for result in (rank0, rank1):
        rows = result["rows"]
        assert [row["step"] for row in rows] == [2, 4, 6, 8, 10, 12]
        for row in rows:
            sent, calls = expected_per_step(hook, row["step"])
            assert row["comm/bytes_per_step"] == sent, (row["step"], row["comm/bytes_per_step"], sent)
            assert row["comm/collectives_per_step"] == calls
        # DDP's runtime statistics still time the hooked communication.
        assert any("time/comm_s" in row for row in rows)
        # Training still works (PowerSGD, the lossiest, fell from 2.32 to 2.12 here; no hook to 2.05).
        assert rows[-1]["train/loss"] < 0.95 * rows[0]["train/loss"], [row["train/loss"] for row in rows]
    if hook == "powersgd":  # compressing really sends less: the check above is not vacuous
        assert expected_per_step(hook, 12)[0] < expected_per_step(hook, 2)[0] / 4


def test_powersgd_with_several_buckets_keeps_the_ranks_in_step_on_gloo(trained: list[dict[str, Any]]) -> None:
    rank0, rank1 = case_results(trained, "powersgd-buckets")
    assert all(torch.equal(rank0["params"][k], rank1["params"][k]) for k in rank0["params"]), "replicas differ"
    assert rank0["sync"]["num_buckets"] > 1
    rows = rank0["rows"]
    assert [row["step"] for row in rows] == [2, 4, 6, 8, 10, 12]  # past its start step, compressing
    assert rows[-1]["comm/collectives_per_step"] == 3 * rank0["sync"]["num_buckets"]
    assert rows[-1]["train/loss"] < 0.95 * rows[0]["train/loss"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            ["sync.comm_hook=bogus"],
            r"sync\.comm_hook='bogus' is invalid: (must be one of|accepted:) none, fp16, bf16, powersgd",
        ),
        (["sync.comm_hook=fp16", "sync.time_buckets=true"], r"sync\.comm_hook='fp16' is invalid: sync\.time_buckets"),
        (["sync.powersgd_rank=0"], r"sync\.powersgd_rank=0 is invalid: (must be|accepted:) an integer >= 1"),
        (["sync.powersgd_rank=1.5"], r"sync\.powersgd_rank=1\.5 is invalid: accepted: an integer >= 1"),
        (
            ["sync.powersgd_start_step=1"],
            r"sync\.powersgd_start_step=1 is invalid: (must be|accepted:) an integer >= 2 .*warm",
        ),
        (
            ["sync.powersgd_start_step=-1"],
            r"sync\.powersgd_start_step=-1 is invalid: (must be|accepted:) an integer >= 2",
        ),
        (
            ["sync.comm_hook=powersgd", "sync.bucket_cap_mb=auto"],
            r"sync\.comm_hook='powersgd' is invalid: with sync\.bucket_cap_mb=auto",
        ),
    ],
    ids=["unknown-hook", "hook-and-time-buckets", "rank-0", "rank-float", "start-1", "start-negative", "powersgd-auto"],
)
def test_bad_hook_settings_are_config_errors(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):  # the command-line check train.py runs first
        check_overrides(["sync=ddp", *overrides])
