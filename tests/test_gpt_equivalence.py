"""The promise on a transformer with a tied head: 2 ranks x B train the same GPT as 1 process x 2B,
for every sync strategy, with model.activation_checkpointing too; a resumed run is bit-identical;
trainer.eval_max_samples evaluates the same windows at world sizes 1 and 2; the sample tool reads
the trained run."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests import forks
from tests.compose import REPO, compose_config
from tests.dist_helpers import run_on_ranks
from tests.train_helpers import (
    assert_same_model,
    bit_identical,
    build,
    case_results,
    max_abs_diff,
    params_of,
    train_each,
)
from trainer.setup.config import plain_config

STEPS = ["trainer.max_steps=6", "trainer.log_every_n_steps=2", "trainer.eval_every_n_steps=0"]
COMMON = ["logger=none", "trainer.progress_bar=false", "optim.lr=0.5", *STEPS]

CASES = {
    "manual": ["sync=manual"],
    "manual-rs_ag": ["sync=manual", "sync.collective=rs_ag"],
    "manual-per-tensor": ["sync=manual", "sync.coalesce_mb=0"],
    "bucketed": ["sync=bucketed", "sync.bucket_cap_mb=0.002"],  # several buckets in flight
    "bucketed-rs_ag": ["sync=bucketed", "sync.bucket_cap_mb=0.002", "sync.collective=rs_ag"],
    "ddp": ["sync=ddp", "sync.bucket_cap_mb=0.002"],
    "ddp-hook": ["sync=ddp", "sync.time_buckets=true"],  # a Python comm hook's all-reduce
    "ddp-auto": [  # two layouts (several buckets, one): a rebuild after each trial, then maybe to the winner
        "sync=ddp",
        "sync.bucket_cap_mb=auto",
        "sync.auto_candidates_mb=[0.002,1]",
        "sync.auto_steps_per_trial=1",
        "sync.auto_warmup_steps=1",
    ],
    "ddp-accum": ["sync=ddp", "data.batch_size=4", "trainer.grad_accum_steps=2"],
    "zero": ["sync=zero"],
    "zero-stage-3": ["sync=zero", "sync.stage=3"],  # the tied embedding and head stay in the root unit
    "zero-stage-3-module": ["sync=zero", "sync.stage=3", "sync.wrap=module", "sync.prefetch=2"],
    "fsdp": ["sync=fsdp"],
}
# model.activation_checkpointing=true under the strategies whose hooks meet the recomputed blocks:
# bucketed's and zero's post-accumulate-grad hooks (and their first-step check that every parameter
# got a gradient), DDP's reducer, FSDP's unit gathers around each block.
CHECKPOINTED = ("manual", "bucketed", "ddp", "zero", "zero-stage-3", "fsdp")
# A fixed subset of the 7 validation windows: shards of 2 and 1 at 2 ranks; 1000 is more than the split.
EVAL_MAX_SAMPLES = 3


def train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, torch.Tensor]:
    config = plain_config(compose_config([*COMMON, *overrides]))  # saved in checkpoints: the sample tool reads it
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir, config=config)
    trainer.fit()
    assert trainer.step == 6 and trainer.epoch == 1
    return params_of(trainer)


def train_checkpointed(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """train() with model.activation_checkpointing=true, counting block 0's forwards with autograd
    on: twice per micro-batch (the forward, then the recomputation in backward) if it applies."""
    config = plain_config(compose_config([*COMMON, *overrides]))
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir, config=config)
    grad_forwards = [0]

    def count(module: torch.nn.Module, args: Any) -> None:  # a pre-hook: the recomputation stops early
        grad_forwards[0] += torch.is_grad_enabled()

    trainer.model.blocks[0].register_forward_pre_hook(count)
    trainer.fit()
    return {"params": params_of(trainer), "grad_forwards": grad_forwards[0], "micro_batches": trainer.step}


def perturbed_eval(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """eval/* of the initial GPT moved by a fixed random step (the same on every rank at any world
    size), so that windows differ in loss; and how many windows this rank evaluates."""
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for param in trainer.model.parameters():
            param.add_(0.5 * torch.randn(param.shape, generator=generator))
    windows = sum(targets.shape[0] for _, targets in trainer.val_loader)
    return {"metrics": trainer.evaluate(), "windows": windows}


def eval_cases(rank: int, world_size: int, gpt: list[str], root: str) -> dict[str, Any]:
    """The whole split, its first EVAL_MAX_SAMPLES windows, and more samples than the split has."""
    sync = "sync=none" if world_size == 1 else "sync=ddp"
    cases = {
        "eval-full": [*gpt, sync, "data.batch_size=8"],
        "eval-subset": [*gpt, sync, "data.batch_size=8", f"trainer.eval_max_samples={EVAL_MAX_SAMPLES}"],
        "eval-over": [*gpt, sync, "data.batch_size=8", "trainer.eval_max_samples=1000"],
    }
    return train_each(rank, world_size, perturbed_eval, cases, root)


def resume_case(rank: int, world_size: int, gpt: list[str], root: str) -> dict[str, Any]:
    """6 steps straight; 6 with a checkpoint every 2, cut back to step 2 (mid-epoch); resumed to 6."""
    every = ["sync=ddp", "trainer.checkpoint_every_n_steps=2", "trainer.keep_checkpoints=5"]
    straight = train(rank, world_size, [*gpt, "data.batch_size=8", *every], f"{root}/straight")
    run_dir = Path(root) / "resumed"
    train(rank, world_size, [*gpt, "data.batch_size=8", *every], str(run_dir))
    if rank == 0:
        ckpt = run_dir / "checkpoints"
        for name in ("step-6.pt", "step-4.pt", "last.pt"):
            (ckpt / name).unlink()
        os.link(ckpt / "step-2.pt", ckpt / "last.pt")
    dist.barrier()
    overrides = [*COMMON, *gpt, "data.batch_size=8", *every]
    trainer = build(rank, world_size, overrides, str(run_dir), config=plain_config(compose_config(overrides)))
    resumed_from = trainer.step
    trainer.fit()
    return {"straight": straight, "resumed": params_of(trainer), "from": resumed_from}


def all_cases(rank: int, world_size: int, gpt: list[str], root: str) -> dict[str, Any]:
    cases = {name: [*gpt, "data.batch_size=8", *o] for name, o in CASES.items()}
    cases["none"] = [*gpt, "data.batch_size=8", "sync=none"]
    results = train_each(rank, world_size, train, cases, f"{root}/runs")
    checkpointed = {
        f"{name}-checkpointed": [*cases[name], "model.activation_checkpointing=true"] for name in CHECKPOINTED
    }
    results |= train_each(rank, world_size, train_checkpointed, checkpointed, f"{root}/checkpointed")
    results |= eval_cases(rank, world_size, gpt, f"{root}/eval")
    results["resume"] = resume_case(rank, world_size, gpt, f"{root}/resume")
    return results


def single_cases(rank: int, world_size: int, corpus: list[str], run_dir: str) -> dict[str, Any]:
    """One process x 16 windows (the reference), and the evaluation cases at world size 1."""
    params = train(rank, world_size, [*corpus, "sync=none", "data.batch_size=16"], run_dir)
    return {"params": params, **eval_cases(rank, world_size, corpus, f"{run_dir}-eval")}


@pytest.fixture(scope="module")
def single_run(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    root = tmp_path_factory.mktemp("single")
    run_dir = root / "run"
    (results,) = run_on_ranks(single_cases, 1, root / "rank", corpus, str(run_dir))
    return results, run_dir


@pytest.fixture(scope="module")
def single(single_run: tuple[dict[str, Any], Path]) -> tuple[dict[str, torch.Tensor], Path]:
    return single_run[0]["params"], single_run[1]


@pytest.fixture(scope="module")
def pairs(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("pairs")
    return run_on_ranks(all_cases, 2, root / "ranks", corpus, str(root), timeout_s=900)


# fsdp included: sync.wrap=auto makes each block a unit and keeps the tied wte/lm_head weight in the root.
@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process_with_twice_the_batch(
    pairs: list[dict[str, Any]], single: tuple[dict[str, torch.Tensor], Path], case: str
) -> None:
    rank0, rank1 = case_results(pairs, case)
    assert_same_model([rank0, rank1], single[0])
    assert max_abs_diff(rank0, pairs[0]["none"]) > 1e-4 or case == "none"


@pytest.mark.parametrize("case", CHECKPOINTED)
def test_activation_checkpointing_trains_the_same_model(
    pairs: list[dict[str, Any]], single: tuple[dict[str, torch.Tensor], Path], case: str
) -> None:
    """Recomputed blocks (no randomness at dropout 0) give the gradients of the plain run: the same
    parameters as this strategy without checkpointing, and so as one process on twice the batch."""
    ranks = case_results(pairs, f"{case}-checkpointed")
    assert_same_model([r["params"] for r in ranks], single[0])
    for rank, plain in zip(ranks, case_results(pairs, case), strict=True):
        assert bit_identical(rank["params"], plain)  # on CPU the recomputation repeats the same kernels
        # It applied: block 0 ran twice per training micro-batch (the recomputation in backward),
        # and evaluation (no grad) ran it plainly.
        assert rank["grad_forwards"] == 2 * rank["micro_batches"]


def test_eval_max_samples_gives_the_same_eval_loss_at_world_sizes_1_and_2(
    pairs: list[dict[str, Any]], single_run: tuple[dict[str, Any], Path]
) -> None:
    one, two = single_run[0], case_results(pairs, "eval-subset")
    (full_one,) = case_results([one], "eval-full")
    (subset_one,) = case_results([one], "eval-subset")
    (over_one,) = case_results([one], "eval-over")
    loss = subset_one["metrics"]["eval/loss"]
    for rank in two:  # the same windows: equal up to float summation order
        assert rank["metrics"]["eval/loss"] == pytest.approx(loss, rel=1e-6)
        assert rank["metrics"]["eval/accuracy"] == subset_one["metrics"]["eval/accuracy"]
    # The key applies: another loss than the whole split's, over a fraction of its windows, cut
    # before sharding (rank r takes windows r, r + 2, ... of the first 3).
    assert abs(loss - full_one["metrics"]["eval/loss"]) > 1e-3 * loss
    assert subset_one["windows"] == EVAL_MAX_SAMPLES and full_one["windows"] == 7
    assert [rank["windows"] for rank in two] == [2, 1]
    # More samples than the split has: the whole split.
    assert over_one["metrics"] == full_one["metrics"]
    for over, full in zip(case_results(pairs, "eval-over"), case_results(pairs, "eval-full"), strict=True):
        assert over["metrics"] == full["metrics"]


def test_sync_none_lets_replicas_diverge(pairs: list[dict[str, Any]], single: tuple[dict[str, torch.Tensor], Path]):
    rank0, rank1 = case_results(pairs, "none")
    assert max_abs_diff(rank0, rank1) > 1e-4 and max_abs_diff(rank0, single[0]) > 1e-4


def test_resume_mid_epoch_is_bit_identical(pairs: list[dict[str, Any]]) -> None:
    for rank in pairs:
        result = rank["resume"]
        assert result["from"] == 2
        assert all(torch.equal(result["straight"][k], result["resumed"][k]) for k in result["straight"])


def sample(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """`python -m trainer.tools.sample run_dir *args`, forked from tests/forks.py's server (torch imported)."""
    return forks.python(["-m", "trainer.tools.sample", str(run_dir), *args], REPO, dict(os.environ), 120)


def test_sample_tool_reads_the_trained_run(single: tuple[dict[str, torch.Tensor], Path]) -> None:
    run_dir = single[1]
    assert (run_dir / "vocab.json").is_file()
    one = sample(run_dir, "--prompt", "the ", "--tokens", "40", "--temperature", "0.8", "--top-k", "5", "--seed", "1")
    assert one.returncode == 0, one.stderr
    assert one.stdout.startswith("the ") and len(one.stdout) == len("the ") + 40 + 1
    again = sample(run_dir, "--prompt", "the ", "--tokens", "40", "--top-k", "5", "--seed", "1")
    other = sample(run_dir, "--prompt", "the ", "--tokens", "40", "--top-k", "5", "--seed", "2")
    assert again.stdout == one.stdout and other.stdout != one.stdout
    bad = sample(run_dir, "--prompt", "QQ")  # not in the corpus's characters
    assert bad.returncode == 2 and "--prompt" in bad.stderr and "Traceback" not in bad.stderr
    sweep = run_dir.parent / "sweep"  # a sweep dir: each job's sample in turn
    for job in ("0", "1"):
        (sweep / job).mkdir(parents=True, exist_ok=True)
        (sweep / job / "checkpoints").symlink_to(run_dir / "checkpoints")
    both = sample(sweep, "--prompt", "the ", "--tokens", "40", "--top-k", "5", "--seed", "1")
    assert both.returncode == 0 and both.stdout.count("== job ") == 2 and both.stdout.count(one.stdout) == 2
