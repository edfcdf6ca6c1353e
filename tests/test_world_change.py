"""Resuming at another world size, and for longer (trainer/reliability/world_change.py), on real ranks.

A checkpoint written by N ranks continues on M with the same global batch and trains what the
uninterrupted run trains (to 1e-5: the reductions add in another order); a run continued past its
end moves the schedule's horizon. Three spawns in one fixture: 1 rank, 2 ranks, 1 rank again.
"""

from __future__ import annotations

import os
import shutil
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from tests.cli import jsonl, train_rows
from tests.dist_helpers import run_on_ranks
from tests.test_reliability import fit
from tests.train_helpers import case_results
from trainer.errors import ConfigError
from trainer.reliability import sharded
from trainer.reliability.checkpoint import CheckpointError
from trainer.reliability.resume import find_checkpoint
from trainer.reliability.world_change import check_world_change
from trainer.setup.validate import per_rank_batch
from trainer.sync import zero_checkpoint
from trainer.tools import export

pytestmark = pytest.mark.slow

# BASE: 512 samples, 2 ranks x 32 = 8 steps an epoch; checkpoints every 4, the run cut back to step 4.
CUT = ["trainer.max_steps=12", "trainer.checkpoint_every_n_steps=4", "trainer.keep_checkpoints=5"]
TWO, ONE = ["data.batch_size=32"], ["data.batch_size=64"]  # global batch 64 either way
ONE_ACCUMULATING = ["data.batch_size=32", "trainer.grad_accum_steps=2"]
ELASTIC = ("trainer.global_batch_size=64",)  # data.batch_size 32 on 2 ranks, 64 on 1: the same command


def full(rank: int, world_size: int, overrides: list[str], run_dir: Path) -> dict[str, Any]:
    """fit(), whose model is gathered whole where sharded (every rank), to compare across world sizes."""
    return fit(rank, world_size, overrides, str(run_dir))


def cut_back_to_step_4(rank: int, run_dir: Path) -> None:
    """As if the job had died after step 4's checkpoint (rank 0 edits; the others wait at the next fit).

    Either format: the step files and last.pt, or the step dirs and `last`."""
    if rank != 0:
        return
    ckpt = run_dir / "checkpoints"
    if (ckpt / "step-4.pt").exists():
        for name in ("step-12.pt", "step-8.pt", "last.pt"):
            (ckpt / name).unlink()
        os.link(ckpt / "step-4.pt", ckpt / "last.pt")
        return
    for name in ("step-12", "step-8"):
        shutil.rmtree(ckpt / name)
    (ckpt / "last").unlink()
    os.symlink("step-4", ckpt / "last")


def first_run(
    rank: int, world_size: int, sync: str, root: Path, batch: list[str], extra: tuple[str, ...] = ()
) -> dict[str, Any]:
    """12 steps straight; 12 with checkpoints, cut back to step 4 (a copy of it in resumed-here/ too)."""
    straight = full(rank, world_size, [sync, *batch, *extra, "trainer.max_steps=12"], root / "straight")
    checkpointed = full(rank, world_size, [sync, *batch, *extra, *CUT], root / "resumed")
    torch.distributed.barrier()
    cut_back_to_step_4(rank, root / "resumed")
    if rank == 0:
        shutil.copytree(root / "resumed", root / "resumed-here", symlinks=True)
    torch.distributed.barrier()
    return {"straight": straight, "checkpointed": checkpointed}


def guarded(cases: dict[str, Callable[[Path], Any]], root: Path) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name, case in cases.items():
        try:
            results[name] = case(root / name)
        except Exception:  # reported by that case's own test
            results[name] = traceback.format_exc()
    return results


SHARDED = ("trainer.checkpoint_format=sharded",)
STAGE3 = ("sync.stage=3",)
# Two param groups (decay on matrices only): zero's shard holds a piece per group, at an offset.
GROUPS = ("optim.weight_decay=0.01", "optim.weight_decay_on=matrices")


def staged_copies_stay(rank: int) -> dict[str, bool]:
    """What async_save writes is the copy made in the step: training's later updates do not reach it."""
    plain, chunk = torch.arange(6.0), torch.arange(4.0)
    parts = {"plain": plain, "zero": zero_checkpoint.part(chunk, 0, torch.Size([4]))}
    staged = sharded.CpuCopy().stage(parts)
    plain.add_(100)
    chunk.add_(100)  # a part that is one block is a view of its values, as zero's are of its shard
    return {
        "plain": torch.equal(staged["plain"], torch.arange(6.0)),
        "zero": torch.equal(staged["zero"], torch.arange(4.0)) and staged["zero"].local_sizes == ((4,),),
        "shares_before": torch.equal(parts["zero"], chunk),
    }


def on_one_rank(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return guarded(
        {
            "fsdp": lambda at: first_run(rank, world_size, "sync=fsdp", at, ONE),
            "fsdp-sharded": lambda at: first_run(rank, world_size, "sync=fsdp", at, ONE, SHARDED),
            "staging": lambda _: staged_copies_stay(rank),
        },
        Path(root),
    )


def on_two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    at = Path(root)
    return guarded(
        {
            "ddp": lambda at: first_run(rank, world_size, "sync=ddp", at, TWO),
            "zero": lambda at: first_run(rank, world_size, "sync=zero", at, TWO),
            "zero3": lambda at: first_run(rank, world_size, "sync=zero", at, TWO, STAGE3),
            "zero3-sharded": lambda at: first_run(rank, world_size, "sync=zero", at, TWO, (*STAGE3, *SHARDED, *GROUPS)),
            "zero-groups-sharded": lambda at: first_run(rank, world_size, "sync=zero", at, TWO, (*SHARDED, *GROUPS)),
            "zero-groups-sharded-here": lambda _: full(
                rank,
                world_size,
                ["sync=zero", *TWO, *CUT, *SHARDED, *GROUPS],
                at / "zero-groups-sharded" / "resumed-here",
            ),
            # the other two strategies, one format each: manual full, bucketed sharded
            "manual": lambda at: first_run(rank, world_size, "sync=manual", at, TWO),
            "bucketed-sharded": lambda at: first_run(rank, world_size, "sync=bucketed", at, TWO, SHARDED),
            # what an elastic restart with fewer ranks does: the same command, on another world size
            "elastic": lambda at: first_run(rank, world_size, "sync=ddp", at, [], ELASTIC),
            # fsdp's checkpoint from 1 rank, continued on 2
            "fsdp-resumed": lambda _: full(rank, world_size, ["sync=fsdp", *TWO, *CUT], at / "fsdp" / "resumed"),
            "longer": lambda run: longer(rank, world_size, run),
            "refused": lambda _: full(rank, world_size, ["sync=ddp", *TWO, *CUT], at / "fsdp" / "resumed"),
            **{
                f"{sync}-sharded": lambda at, s=sync: first_run(rank, world_size, f"sync={s}", at, TWO, SHARDED)
                for sync in ("ddp", "zero")
            },
            **{  # the sharded checkpoint at its own world size: bit-identical
                f"{sync}-sharded-here": lambda _, s=sync: full(
                    rank, world_size, [f"sync={s}", *TWO, *CUT, *SHARDED], at / f"{s}-sharded" / "resumed-here"
                )
                for sync in ("ddp", "zero")
            },
            # the same run as zero-sharded-here's, its saves written in the background
            "zero-async": lambda run: full(
                rank, world_size, ["sync=zero", *TWO, *CUT, *SHARDED, "trainer.checkpoint_async=true"], run
            ),
            "fsdp-sharded-resumed": lambda _: full(
                rank, world_size, ["sync=fsdp", *TWO, *CUT, *SHARDED], at / "fsdp-sharded" / "resumed"
            ),
        },
        at,
    )


def on_one_rank_again(rank: int, world_size: int, root: str) -> dict[str, Any]:
    at = Path(root)
    # First the refusal, while ddp's checkpoint is still the 2-rank one; then each continues on 1 rank.
    cases: dict[str, Callable[[Path], Any]] = {
        "other-batch": lambda _: full(rank, world_size, ["sync=ddp", *TWO, *CUT], at / "ddp" / "resumed")
    }
    # zero keeps the global batch with 2 micro-batches of 32: the epoch's position is then 8 micro-batches, not 4
    for sync, batch in (("ddp", ONE), ("zero", ONE_ACCUMULATING)):
        cases[f"{sync}-resumed"] = lambda _, s=sync, b=batch: full(
            rank, world_size, [f"sync={s}", *b, *CUT], at / s / "resumed"
        )
        cases[f"{sync}-sharded-resumed"] = lambda _, s=sync, b=batch: full(
            rank, world_size, [f"sync={s}", *b, *CUT, *SHARDED], at / f"{s}-sharded" / "resumed"
        )
    for case, extra in (
        ("zero3", STAGE3),  # stage 3: the parameters sharded too
        ("zero3-sharded", (*STAGE3, *SHARDED, *GROUPS)),
        ("zero-groups-sharded", (*SHARDED, *GROUPS)),
    ):
        cases[f"{case}-resumed"] = lambda _, c=case, e=extra: full(
            rank, world_size, ["sync=zero", *ONE, *CUT, *e], at / c / "resumed"
        )
    cases["elastic-resumed"] = lambda _: full(
        rank, world_size, ["sync=ddp", *ELASTIC, *CUT], at / "elastic" / "resumed"
    )
    cases["manual-resumed"] = lambda _: full(rank, world_size, ["sync=manual", *ONE, *CUT], at / "manual" / "resumed")
    cases["bucketed-sharded-resumed"] = lambda _: full(
        rank, world_size, ["sync=bucketed", *ONE, *CUT, *SHARDED], at / "bucketed-sharded" / "resumed"
    )
    return guarded(cases, at)


def longer(rank: int, world_size: int, run: Path) -> dict[str, Any]:
    """12 steps, then the same run continued to 20 (and 20 straight); a 20-step checkpoint with max_steps=8."""
    first = full(rank, world_size, ["sync=ddp", *TWO, *CUT], run / "continued")
    more = full(rank, world_size, ["sync=ddp", *TWO, *CUT[1:], "trainer.max_steps=20"], run / "continued")
    fewer = full(rank, world_size, ["sync=ddp", *TWO, *CUT[1:], "trainer.max_steps=8"], run / "continued")
    straight = full(rank, world_size, ["sync=ddp", *TWO, "trainer.max_steps=20"], run / "straight")
    return {"first": first, "more": more, "fewer": fewer, "straight": straight}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, list[dict[str, Any]]]]:
    root = tmp_path_factory.mktemp("world_change")
    runs = root / "runs"
    one = run_on_ranks(on_one_rank, 1, root / "r1", str(runs), timeout_s=600)
    two = run_on_ranks(on_two_ranks, 2, root / "r2", str(runs), timeout_s=600)
    again = run_on_ranks(on_one_rank_again, 1, root / "r3", str(runs), timeout_s=600)
    return runs, {"one": one, "two": two, "again": again}


SIZES = {"one": 1, "two": 2, "again": 1}


def global_rows(run_dir: Path, world_size: int) -> tuple[dict[int, float], dict[int, float]]:
    """Each logged step's loss as the ranks' mean (equal batches: the global batch's mean), and its lr."""
    ranks = [
        {row["step"]: row for row in train_rows(run_dir / "metrics" / f"rank{r}.jsonl")} for r in range(world_size)
    ]
    steps = set.intersection(*(set(rows) for rows in ranks))  # a rank that joined on resume has only later rows
    loss = {step: sum(rows[step]["train/loss"] for rows in ranks) / world_size for step in steps}
    return loss, {step: ranks[0][step]["train/lr"] for step in steps}


def close(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize(
    ("sync", "first", "then"),
    [
        ("ddp", "two", "again"),
        ("manual", "two", "again"),
        ("elastic", "two", "again"),
        ("bucketed-sharded", "two", "again"),
        ("zero", "two", "again"),
        ("zero3", "two", "again"),
        ("zero3-sharded", "two", "again"),
        ("zero-groups-sharded", "two", "again"),
        ("fsdp", "one", "two"),
        ("ddp-sharded", "two", "again"),
        ("zero-sharded", "two", "again"),
        ("fsdp-sharded", "one", "two"),
    ],
)
def test_a_checkpoint_continues_at_another_world_size_as_the_uninterrupted_run(
    runs: tuple[Path, dict[str, list[dict[str, Any]]]], sync: str, first: str, then: str
) -> None:
    root, ranks = runs
    (before, *_) = case_results(ranks[first], sync)
    resumed = case_results(ranks[then], f"{sync}-resumed")
    straight = before["straight"]
    assert close(before["checkpointed"]["model"], straight["model"]) == 0.0  # checkpointing changes nothing
    for rank_result in resumed:
        assert "error" not in rank_result, rank_result["error"]
        assert rank_result["step"] == 12
        assert close(rank_result["model"], straight["model"]) <= 1e-5, sync
    # Each step's loss (the ranks' mean: each logs its own batch's) continues the uninterrupted run's.
    straight_loss, straight_lr = global_rows(root / sync / "straight", SIZES[first])
    loss, lr = global_rows(root / sync / "resumed", SIZES[then])
    assert set(range(6, 13, 2)) <= set(loss)
    for step in range(6, 13, 2):  # the rows of the resumed world size (2 and 4 are the first run's, rank 0's own)
        assert lr[step] == pytest.approx(straight_lr[step], rel=1e-12)
        assert loss[step] == pytest.approx(straight_loss[step], abs=1e-5), step


def test_another_global_batch_is_refused_naming_the_value_that_keeps_it(
    runs: tuple[Path, dict[str, list[dict[str, Any]]]],
) -> None:
    _, ranks = runs
    (one,) = case_results(ranks["again"], "other-batch")
    assert "written by 2 ranks, this job has 1" in one["error"], one
    assert "global batch 64" in one["error"] and "would become 32" in one["error"], one
    assert "resume with data.batch_size=64 or trainer.grad_accum_steps=2 to keep it" in one["error"], one
    # fsdp's 1-rank checkpoint (global batch 64) on 2 ranks × 32 under ddp: same batch, other strategy
    two = case_results(ranks["two"], "refused")
    assert all("different training config" in r["error"] and "sync._target_" in r["error"] for r in two), two


def test_training_longer_moves_the_schedule_horizon_and_fewer_steps_are_refused(
    runs: tuple[Path, dict[str, list[dict[str, Any]]]],
) -> None:
    root, ranks = runs
    r0, _ = case_results(ranks["two"], "longer")
    assert r0["first"]["step"] == 12 and r0["more"]["step"] == 20
    rows = {r["step"]: r["train/lr"] for r in train_rows(root / "longer" / "continued" / "metrics" / "rank0.jsonl")}
    first = {r["step"]: r["train/lr"] for r in train_rows(root / "ddp" / "straight" / "metrics" / "rank0.jsonl")}
    twenty = {r["step"]: r["train/lr"] for r in train_rows(root / "longer" / "straight" / "metrics" / "rank0.jsonl")}
    assert sorted(rows) == list(range(2, 21, 2))
    # Up to the checkpoint: the 12-step cosine; after it, the 20-step run's lr at every step (the horizon moved).
    assert all(rows[s] == first[s] for s in range(2, 13, 2)) and first[12] != twenty[12]
    assert all(rows[s] == pytest.approx(twenty[s], rel=1e-12) for s in range(14, 21, 2))
    assert "error" in r0["fewer"] and "is at step 20, past this run's end at step 8" in r0["fewer"]["error"]


def test_what_cannot_be_mapped_to_another_world_size_is_refused(tmp_path: Path) -> None:
    saved = {"world_size": 2, "batch_size": 32, "grad_accum_steps": 1}
    with pytest.raises(CheckpointError, match="sync=none trains one model per rank"):
        check_world_change(tmp_path / "c.pt", saved, 1, nn.Linear(2, 2), trains_one_model=False)
    with pytest.raises(CheckpointError, match=r"draws randomness \(Dropout with p > 0\)"):
        check_world_change(tmp_path / "c.pt", saved, 1, nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.1)), True)
    check_world_change(tmp_path / "c.pt", saved, 1, nn.Sequential(nn.Linear(2, 2), nn.Dropout(0.0)), True)
    check_world_change(tmp_path / "c.pt", saved, 2, nn.Dropout(0.5), trains_one_model=False)  # same world size: fine
    with pytest.raises(CheckpointError, match="does not say its batch size: resume with 2 ranks"):
        check_world_change(tmp_path / "c.pt", {"world_size": 2}, 1, nn.Linear(2, 2), True)  # built without a config


@pytest.mark.parametrize("sync", ["ddp-sharded", "zero-sharded", "zero-groups-sharded"])
def test_a_sharded_checkpoint_resumes_bit_identical_at_its_own_world_size(
    runs: tuple[Path, dict[str, list[dict[str, Any]]]], sync: str
) -> None:
    _, ranks = runs
    r0, _ = case_results(ranks["two"], sync)
    for resumed in case_results(ranks["two"], f"{sync}-here"):
        assert "error" not in resumed, resumed["error"]
        assert resumed["step"] == 12 and close(resumed["model"], r0["straight"]["model"]) == 0.0


@pytest.mark.parametrize("sync", ["ddp", "zero", "fsdp"])
def test_a_sharded_checkpoint_is_one_part_per_rank_and_exports_the_model(
    runs: tuple[Path, dict[str, list[dict[str, Any]]]], sync: str, tmp_path: Path
) -> None:
    root, ranks = runs
    step = root / f"{sync}-sharded" / "resumed" / "checkpoints" / "step-12"  # written by the resumed run
    sizes = sorted(p.stat().st_size for p in step.glob("__*_0.distcp"))
    world = 1 if sync in ("ddp", "zero") else 2  # who wrote step 12: the resumed run
    assert len(sizes) == world and (step / "meta.pt").is_file() and (step / ".metadata").is_file()
    first = root / f"{sync}-sharded" / "straight"
    del first
    # The first run's step-4 parts, by the run's own world size: 2 ranks each wrote a real share.
    four = root / f"{sync}-sharded" / "resumed" / "checkpoints" / "step-4"
    parts = sorted(p.stat().st_size for p in four.glob("__*_0.distcp"))
    assert len(parts) == (1 if sync == "fsdp" else 2)
    if len(parts) == 2:
        assert parts[0] > 0.25 * sum(parts), parts  # no rank wrote (nearly) everything
    assert export.main([str(step.parent.parent), "--step", "12", "--out", str(tmp_path / "m.pt")]) == 0
    exported = torch.load(tmp_path / "m.pt", weights_only=True)["model"]
    (resumed, *_) = case_results(ranks["again" if world == 1 else "two"], f"{sync}-sharded-resumed")
    assert close(exported, resumed["model"]) == 0.0


def test_a_save_that_died_half_way_leaves_the_previous_checkpoint_the_one_resume_finds(
    runs: tuple[Path, dict[str, list[dict[str, Any]]]], tmp_path: Path
) -> None:
    root, _ = runs
    run = tmp_path / "run"
    shutil.copytree(root / "ddp-sharded" / "straight", run, symlinks=True)  # its final checkpoint: step-12/
    ckpt = run / "checkpoints"
    shutil.copytree(ckpt / "step-12", ckpt / ".step-16.partial")  # a save in progress: never a candidate
    shutil.copytree(ckpt / "step-12", ckpt / "step-14")
    (ckpt / "step-14" / "meta.pt").unlink()  # as if rank 0 died before meta.pt: incomplete
    found = find_checkpoint(run, "auto")
    assert found is not None and found[0] == ckpt / "step-12" and found[1]["step"] == 12


def test_sharded_checkpoints_rotate_and_last_points_at_the_newest(tmp_path: Path) -> None:
    ckpt = tmp_path / "checkpoints"
    for step in (2, 4, 6):
        partial = ckpt / f".step-{step}.partial"
        partial.mkdir(parents=True)
        (partial / ".metadata").write_bytes(b"x")
        (partial / "meta.pt").write_bytes(b"x")
        sharded._publish(partial, ckpt / f"step-{step}", ckpt, keep=2)
    assert [p.name for p in sharded.step_dirs(ckpt)] == ["step-6", "step-4"]
    assert os.readlink(ckpt / "last") == "step-6" and not list(ckpt.glob(".*"))


def everything(step_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a sharded checkpoint, whole, read in this one process."""
    template = {k: torch.empty(m.size, dtype=m.properties.dtype) for k, m in sharded.saved_tensors(step_dir).items()}
    with sharded.quiet_one_process():
        dcp.load(template, checkpoint_id=str(step_dir), no_dist=True)
    return template


def test_an_async_save_equals_the_blocking_one_bit_for_bit(runs: tuple[Path, dict[str, list[dict[str, Any]]]]) -> None:
    root, ranks = runs
    r0, _ = case_results(ranks["two"], "zero-async")
    assert (
        r0["step"] == 12 and close(r0["model"], case_results(ranks["two"], "zero-sharded")[0]["straight"]["model"]) == 0
    )
    blocking = root / "zero-sharded" / "resumed-here" / "checkpoints"
    written = root / "zero-async" / "checkpoints"
    assert os.readlink(written / "last") == "step-12" and not list(written.glob(".*"))  # the last save waited for
    for step in (4, 8, 12):  # every save published, each the same bytes of state as the blocking save's
        mine, theirs = everything(written / f"step-{step}"), everything(blocking / f"step-{step}")
        assert mine.keys() == theirs.keys() and any(k.endswith("/momentum_buffer") for k in mine)
        assert all(torch.equal(mine[k], theirs[k]) for k in mine), step
    saves = [r for r in jsonl(root / "zero-async" / "metrics" / "rank0.jsonl") if "checkpoint/blocked_s" in r]
    assert [r["step"] for r in saves] == [4, 8, 12]


def test_the_async_stager_copies_what_training_changes_next(runs: tuple[Path, dict[str, list[dict[str, Any]]]]) -> None:
    _, ranks = runs
    (copies,) = case_results(ranks["one"], "staging")
    assert copies == {"plain": True, "zero": True, "shares_before": True}


def test_a_global_batch_that_does_not_split_over_the_ranks_is_refused() -> None:
    assert per_rank_batch(64, 2, 2) == 16
    with pytest.raises(
        ConfigError,
        match=r"global_batch_size=64 is invalid on 3 rank\(s\) x trainer.grad_accum_steps=1: accepted: a multiple of 3",
    ):
        per_rank_batch(64, 3, 1)


def test_the_tensors_every_rank_holds_are_split_by_size_and_sync_none_keeps_rank_0s() -> None:
    tensors = {"big": torch.zeros(100), "mid": torch.zeros(60), "small": torch.zeros(50)}
    split = [sharded.mine_to_write(tensors, rank, 2, trains_one_model=True) for rank in (0, 1)]
    assert [sorted(part) for part in split] == [["big"], ["mid", "small"]]  # 400 bytes against 440
    alone = [sharded.mine_to_write(tensors, rank, 2, trains_one_model=False) for rank in (0, 1)]
    assert sorted(alone[0]) == ["big", "mid", "small"] and alone[1] == {}  # each rank's model is its own


def test_the_longer_runs_line_says_what_the_lr_does() -> None:
    from torch.optim.lr_scheduler import LambdaLR

    from trainer.loop.schedule import Constant, WarmupCosine
    from trainer.reliability.world_change import continue_schedule

    for schedule, said in ((WarmupCosine(12, warmup_steps=5), "goes from 0 to 0.0552264"), (Constant(12), "stays 0.1")):
        optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)
        scheduler = LambdaLR(optimizer, schedule)
        for _ in range(12):
            optimizer.step()  # before the schedule's step, as training does (torch warns otherwise)
            scheduler.step()
        line = continue_schedule(scheduler, [20], saved_step=12, total=20)
        assert line is not None and line.endswith(f"the lr at step 12 {said}"), line
        assert continue_schedule(scheduler, [20], 12, 20) is None  # the horizon is this run's now
