"""sync.bucket_cap_mb=auto: the CapTuner's choice, DDP rebuilt mid-run without changing the numbers, and
where the trial table lands (rows, log, summary.json)."""

from __future__ import annotations

import json
import weakref
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

import trainer.sync.ddp as ddp_module
from models.mlp import MLP
from tests.cli import CPU, output, torchrun, train_rows
from tests.dist_helpers import run_on_ranks
from tests.train_helpers import assert_same_model, build, case_results, params_of, train_each
from trainer.errors import ConfigError
from trainer.loop.rows import sync_facts, sync_lines
from trainer.setup.precheck import check_overrides
from trainer.sync.autotune import CapTuner
from trainer.sync.ddp_private import planned_buckets
from trainer.sync.describe import describe

# Fed step times (seconds) per rank and candidate: one untimed warm-up step, then two timed ones.
# Alone, rank 0 would pick 1 MiB (median 0.2 s); but rank 1 is slow there, and the job runs at the
# slowest rank's pace: per-step maxima give medians 0.5, 0.325, 0.4 s, so 5 MiB wins.
CANDIDATES = [1.0, 5.0, 25.0]
FED_TIMES = {
    0: [[9.0, 0.1, 0.3], [9.0, 0.3, 0.3], [9.0, 0.4, 0.4]],
    1: [[9.0, 0.5, 0.5], [9.0, 0.35, 0.25], [9.0, 0.4, 0.4]],
}


def tune_with_fed_times(rank: int, world_size: int) -> dict[str, Any]:
    durations = [d for trial in FED_TIMES[rank] for d in trial]
    ticks = iter(accumulate(durations))  # the clock at each call: the step durations add up
    tuner = CapTuner(CANDIDATES, steps_per_trial=2, warmup_steps=1, device=torch.device("cpu"), clock=ticks.__next__)
    returned = [tuner.after_step() for _ in durations]
    after = [tuner.after_step() for _ in range(3)]  # done: no clock read (the fed clock is exhausted)
    return {"returned": returned, "after": after, "table": tuner.table(), "chosen": tuner.chosen_mb}


def test_tuner_takes_the_slowest_rank_and_every_rank_agrees(tmp_path: Path) -> None:
    results = run_on_ranks(tune_with_fed_times, 2, tmp_path / "tune")
    for result in results:
        # Rebuild to the next candidate after each trial, then to the winner (different from the last one).
        assert result["returned"] == [None, None, 5.0, None, None, 25.0, None, None, 5.0]
        assert result["after"] == [None, None, None]
        assert result["chosen"] == 5.0
        assert [t["cap_mb"] for t in result["table"]] == CANDIDATES
        assert [t["steps"] for t in result["table"]] == [2, 2, 2]
        assert [t["median_step_s"] for t in result["table"]] == pytest.approx([0.5, 0.325, 0.4])


def small_mlp() -> MLP:
    """The MLP the runs below train: 9,768 bytes of parameters in 6 tensors, 1,048 bytes being 0.001 MiB."""
    return MLP([32, 32], input_shape=[32], num_classes=10)


def tune_layouts(rank: int, world_size: int, times: list[float], candidates: list[float]) -> dict[str, Any]:
    """The tuner with DDP's real bucket rule for small_mlp() and a clock fed these step times (each
    rank the same: 1 untimed warm-up step, then 2 timed ones per trial)."""
    ticks = iter(accumulate(times))
    layout = partial(planned_buckets, small_mlp())
    tuner = CapTuner(candidates, 2, 1, torch.device("cpu"), layout=layout, clock=ticks.__next__)
    returned = [tuner.after_step() for _ in times]
    return {"returned": returned, "table": tuner.table(), "chosen": tuner.chosen_mb, "line": tuner.describe()}


# 0.01 and 1 MiB put small_mlp()'s 9,768 bytes in one bucket: one layout, timed once (with 0.01);
# 0.001 MiB makes three.
SAME_LAST = [0.001, 0.01, 1.0]


@pytest.mark.parametrize(
    ("second_trial", "chosen", "why"),
    [
        (
            [9.0, 0.33, 0.36],
            0.01,
            "tie: 0.001, 0.01 MiB within noise (step times overlap): kept 0.01, fewest buckets (1)",
        ),
        ([9.0, 0.36, 0.40], 0.001, "fastest, beyond noise"),
    ],
    ids=["overlapping-steps-tie", "apart"],
)
def test_identical_layouts_are_timed_once_and_a_tie_keeps_the_fewest_buckets(
    tmp_path: Path, second_trial: list[float], chosen: float, why: str
) -> None:
    # Two layouts, two trials (the fed clock has no third); 0.001 MiB is the faster median (0.32 s
    # against 0.345 or 0.38 s), but when its slowest step (0.34 s) is no faster than the other's
    # fastest (0.33 s) the trials cannot tell them apart: the one-bucket layout is kept.
    times = [9.0, 0.30, 0.34, *second_trial]
    results = run_on_ranks(tune_layouts, 2, tmp_path / "tune", times, SAME_LAST)
    for result in results:
        assert result["returned"] == [None, None, 0.01, None, None, None if chosen == 0.01 else 0.001]
        assert result["chosen"] == chosen
        table = result["table"]
        assert [(t["cap_mb"], t["same_layout_mb"], t["num_buckets"]) for t in table] == [
            (0.001, [], 3),
            (0.01, [1.0], 1),
        ]
        assert [t["step_s"] for t in table] == [pytest.approx([0.30, 0.34]), pytest.approx(second_trial[1:])]
        # The line's part: rounded ms per layout, the choice and why; the raw steps stay in table().
        line = result["line"]
        assert line["auto_step_ms"] == {"0.001": 320.0, "0.01|1": pytest.approx(1e3 * sum(second_trial[1:]) / 2)}
        assert line["auto_chosen_mb"] == chosen and line["auto_choice"] == why
        assert line["bucket_cap_mb_in_use"] == chosen


def test_when_every_candidate_builds_the_same_buckets_nothing_is_timed() -> None:
    def no_clock() -> float:
        raise AssertionError("nothing to time: the clock must not be read")

    layout = partial(planned_buckets, small_mlp())
    tuner = CapTuner([0.01, 5.0, 25.0], 3, 2, torch.device("cpu"), layout=layout, clock=no_clock)
    assert tuner.done and tuner.chosen_mb == tuner.cap_mb == 0.01  # the first, already built: no rebuild
    assert [tuner.after_step() for _ in range(20)] == [None] * 20 and tuner.table() == []
    assert tuner.describe() == {
        "auto_chosen_mb": 0.01,
        "auto_choice": "every candidate builds the same 1 bucket(s): 0.01 MiB kept, nothing timed",
        "bucket_cap_mb_in_use": 0.01,
    }


# 64 samples, 2 ranks x 8: 4 steps per epoch. Trials: 0.001 MiB (steps 1-2), 0.01 MiB (steps 3-4), then
# the winner (rebuilt at step 4 unless it is 0.01): two or three DDPs, each swap between a backward and its
# optimizer step, and steps 5-8 on the winner.
COMMON = [
    "logger=none",
    "model.hidden_sizes=[32,32]",
    "data.num_samples=64",
    "data.num_val_samples=16",
    "trainer.max_steps=8",
    "trainer.log_every_n_steps=2",
    "trainer.sample_budget=null",  # every row's bytes are read: every row sampled
    "trainer.eval_every_n_steps=0",
    "trainer.progress_bar=false",
]
AUTO = [
    "sync=ddp",
    "sync.bucket_cap_mb=auto",
    "sync.auto_candidates_mb=[0.001,0.01]",
    "sync.auto_steps_per_trial=1",
    "sync.auto_warmup_steps=1",
    "data.batch_size=8",
]


def train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """The real build path of train.py; every DDP built is watched by a weak reference."""
    built: list[weakref.ref[DistributedDataParallel]] = []

    class Watched(DistributedDataParallel):
        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            built.append(weakref.ref(self))

    ddp_module.DistributedDataParallel = Watched  # in this spawned process only
    trainer = build(rank, world_size, COMMON + overrides, run_dir)
    trainer.fit()
    assert trainer.step == 8
    current = getattr(trainer.sync, "_ddp", None)
    tuner = trainer.sync.tuner
    # DDP's rule for each cap, as the tuner compares them: each bucket's bytes.
    planned = {
        cap: [sum(p.numel() * p.element_size() for p in bucket) for bucket in planned_buckets(trainer.model, cap)]
        for cap in (tuner.candidates_mb if tuner else [])
    }
    return {
        "params": params_of(trainer),
        "rows": trainer._rows.rows,
        "sync": describe(trainer.sync),
        "trials": tuner.table() if tuner else [],
        "line": sync_lines(sync_facts(trainer.sync, None)),
        "planned": planned,
        "alive": [ref() is not None for ref in built],
        "last_is_current": bool(built) and built[-1]() is current,
    }


@pytest.fixture(scope="module")
def single_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, torch.Tensor]:
    """One process, batch 16: what two ranks with batch 8 must reproduce."""
    run = tmp_path_factory.mktemp("single")
    (result,) = run_on_ranks(train, 1, run / "ref", ["sync=none", "data.batch_size=16"], str(run / "run"))
    return result["params"]


# 0.01 and 1 MiB both put the model's 9,768 bytes in one bucket.
SAME = "sync.auto_candidates_mb=[0.01,1]"
CASES = {
    "ddp-auto": AUTO,
    "ddp-auto-timing-hook-bucket-view": [*AUTO, "sync.time_buckets=true", "sync.gradient_as_bucket_view=true"],
    "bucketed-auto": ["sync=bucketed", *AUTO[1:]],
    "ddp-auto-same": [*AUTO, SAME],
    "bucketed-auto-same": ["sync=bucketed", *AUTO[1:], SAME],
}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """Every auto case, one after another in one pair of spawned ranks."""
    root = tmp_path_factory.mktemp("auto")
    return run_on_ranks(train_each, 2, root / "ranks", train, CASES, str(root / "runs"), timeout_s=600)


@pytest.mark.parametrize("case", ["ddp-auto", "ddp-auto-timing-hook-bucket-view"])
def test_auto_is_equivalent_and_drops_each_old_ddp(
    pairs: list[dict[str, Any]], single_process: dict[str, torch.Tensor], case: str
) -> None:
    rank0, rank1 = case_results(pairs, case)
    params = rank0["params"]
    assert_same_model([params, rank1["params"]], single_process)
    full = 4 * sum(t.numel() for t in params.values())
    for result in (rank0, rank1):
        info = result["sync"]
        assert info["bucket_cap_mb"] == "auto"
        assert [t["cap_mb"] for t in result["trials"]] == [0.001, 0.01]
        chosen = info["auto_chosen_mb"]
        assert chosen in (0.001, 0.01) and info["bucket_cap_mb_in_use"] == chosen
        # The layout the tuner predicted for the chosen cap is the one DDP built (after its rebuild).
        assert result["planned"][chosen] == info["bucket_sizes_bytes"]
        assert [len(result["planned"][cap]) for cap in (0.001, 0.01)] == [3, 1]
        # Only the DDP in use is alive: each replaced one (and its reducer's autograd hooks) is gone.
        assert result["alive"] == [False] * (len(result["alive"]) - 1) + [True] and result["last_is_current"]
        assert len(result["alive"]) == (2 if chosen == 0.01 else 3)
        rows = result["rows"]
        assert [row["sync/bucket_cap_mb"] for row in rows] == [0.01, chosen, chosen, chosen]
        # Every gradient sent once per step, also after the swaps; with the timing hook this is measured
        # per bucket, so a leftover reducer still all-reducing would show here.
        assert all(row["comm/bytes_per_step"] == full for row in rows)


def test_bucketed_auto_rebuilds_its_buckets_without_changing_the_numbers(
    pairs: list[dict[str, Any]], single_process: dict[str, torch.Tensor]
) -> None:
    # The same tuner as ddp's, in sync=bucketed: the buckets are rebuilt between backward and the
    # optimizer step, carrying the averaged gradients into the new buffers.
    rank0, rank1 = case_results(pairs, "bucketed-auto")
    params = rank0["params"]
    assert_same_model([params, rank1["params"]], single_process)
    full = 4 * sum(t.numel() for t in params.values())
    for result in (rank0, rank1):
        info = result["sync"]
        assert info["strategy"] == "bucketed" and info["bucket_cap_mb"] == "auto"
        assert [t["cap_mb"] for t in result["trials"]] == [0.001, 0.01]
        chosen = info["auto_chosen_mb"]
        assert chosen in (0.001, 0.01) and info["bucket_cap_mb_in_use"] == chosen
        # 9,768 bytes of gradients in 6 tensors: one per ~1 KB bucket, or all in one ~10 KB bucket.
        assert full == 9768 and info["num_buckets"] == (6 if chosen == 0.001 else 1)
        assert [row["sync/bucket_cap_mb"] for row in result["rows"]] == [0.01, chosen, chosen, chosen]
        assert all(row["comm/bytes_per_step"] == full for row in result["rows"])


@pytest.mark.parametrize("case", ["ddp-auto", "bucketed-auto"])
def test_the_sync_line_rounds_the_trials(pairs: list[dict[str, Any]], case: str) -> None:
    rank0, _ = case_results(pairs, case)
    info, line = rank0["sync"], rank0["line"]
    # Each layout's median in ms, rounded; the choice and why; no raw trial table on the line.
    steps = ",".join(f"{t['cap_mb']:g}:{round(t['median_step_s'] * 1e3, 2)}" for t in rank0["trials"])
    assert f"auto_step_ms={{{steps}}}" in line, line
    assert f"auto_chosen_mb={info['auto_chosen_mb']}" in line and "auto_choice=" in line, line
    assert "auto_trials" not in line and "median_step_s" not in line, line
    assert info["auto_choice"].startswith(("fastest", "tie: 0.001, 0.01 MiB within noise")), info


@pytest.mark.parametrize("case", ["ddp-auto-same", "bucketed-auto-same"])
def test_auto_between_identical_layouts_times_nothing(pairs: list[dict[str, Any]], case: str) -> None:
    rank0, rank1 = case_results(pairs, case)
    for result in (rank0, rank1):
        info = result["sync"]
        assert result["trials"] == [] and "auto_step_ms" not in info
        assert info["auto_chosen_mb"] == info["bucket_cap_mb_in_use"] == 0.01 and info["num_buckets"] == 1
        assert info["auto_choice"] == "every candidate builds the same 1 bucket(s): 0.01 MiB kept, nothing timed"
        # The first candidate from the first step: no rebuild, one DDP for the whole run.
        assert [row["sync/bucket_cap_mb"] for row in result["rows"]] == [0.01] * 4
        assert result["alive"] == ([True] if case.startswith("ddp") else [])
    assert 'auto_choice="every candidate builds the same 1 bucket(s)' in rank0["line"]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["sync.bucket_cap_mb=0"], r"sync\.bucket_cap_mb=0 is invalid: (must be|accepted:) a number > 0.* or auto"),
        (
            ["sync.bucket_cap_mb=bogus"],
            r"sync\.bucket_cap_mb='bogus' is invalid: (must be|accepted:) a number > 0.* or auto",
        ),
        (
            ["sync.auto_candidates_mb=[]"],
            r"sync\.auto_candidates_mb=\[\] is invalid: (must be a non-empty list|accepted: a list .*\(not empty\))",
        ),
        (["sync.auto_candidates_mb=[1,0]"], r"sync\.auto_candidates_mb=\[1(\.0)?, 0(\.0)?\] is invalid: .*numbers > 0"),
        (
            ["sync.auto_steps_per_trial=0"],
            r"sync\.auto_steps_per_trial=0 is invalid: (must be|accepted:) an integer >= 1",
        ),
        (["sync.auto_warmup_steps=0"], r"sync\.auto_warmup_steps=0 is invalid: (must be|accepted:) an integer >= 1"),
    ],
    ids=["cap-0", "cap-bogus", "no-candidates", "candidate-0", "steps-0", "warmup-0"],
)
@pytest.mark.parametrize("sync", ["ddp", "bucketed"])
def test_bad_auto_settings_are_config_errors(sync: str, overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError, match=message):  # the command-line check train.py runs first
        check_overrides([f"sync={sync}", *overrides])


@pytest.mark.slow
def test_cli_auto_writes_the_cap_to_rows_and_the_trials_to_summary(tmp_path: Path) -> None:
    # The default MLP's 307,240 bytes: several buckets at 0.1 MiB, one at 25.
    run_dir = tmp_path / "run"
    args = [CPU, "logger=none", "trainer.progress_bar=false", "data.num_samples=1024", "data.num_val_samples=128"]
    args += ["sync=ddp", "sync.bucket_cap_mb=auto", "sync.auto_candidates_mb=[0.1,25]", "sync.auto_steps_per_trial=2"]
    args += ["sync.auto_warmup_steps=1", "trainer.max_steps=10", "trainer.log_every_n_steps=2"]
    proc = torchrun([*args, f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, output(proc)

    summary = json.loads((run_dir / "summary.json").read_text())["sync"]
    assert summary["bucket_cap_mb"] == "auto"
    trials = summary["auto_trials"]  # the raw trials: every timed step, at the slowest rank's time
    assert [t["cap_mb"] for t in trials] == [0.1, 25.0] and [t["steps"] for t in trials] == [2, 2]
    assert all(t["median_step_s"] > 0 and len(t["step_s"]) == 2 for t in trials)
    assert trials[0]["num_buckets"] > 1 and trials[1]["num_buckets"] == 1
    chosen = summary["auto_chosen_mb"]
    tie = max(trials[1]["step_s"]) >= min(trials[0]["step_s"]) and max(trials[0]["step_s"]) >= min(trials[1]["step_s"])
    assert chosen == (25.0 if tie else min(trials, key=lambda t: t["median_step_s"])["cap_mb"]), trials
    assert summary["auto_choice"].startswith("tie: 0.1, 25 MiB" if tie else "fastest, beyond noise"), summary
    for rank in (0, 1):
        rows = train_rows(run_dir / "metrics" / f"rank{rank}.jsonl")
        # Steps 1-3: 0.1 MiB; 4-6: 25 MiB; from step 6 the winner.
        assert [row["sync/bucket_cap_mb"] for row in rows] == [0.1, 25.0, chosen, chosen, chosen]
    log = (run_dir / "train_rank0.log").read_text()
    assert log.count("bucket cap trial:") == 2 and f"bucket cap chosen: {chosen:g} MiB" in log
    # The sync line comes once, after the choice, with the chosen cap's layout (not a trial's).
    assert log.count("sync: strategy=ddp") == 1, log
    assert log.index("bucket cap chosen:") < log.index("sync: strategy=ddp"), log
    assert f"auto_chosen_mb={chosen}" in log and f"bucket_cap_mb_in_use={chosen}" in log, log
    line = log[log.index("sync: strategy=ddp") :]
    assert "auto_step_ms={0.1:" in line and "median_step_s" not in line, line
