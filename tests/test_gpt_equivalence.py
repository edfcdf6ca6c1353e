"""The promise on a transformer with a tied head: 2 ranks x B train the same GPT as 1 process x 2B,
for every sync strategy; a resumed run is bit-identical; the sample tool reads the trained run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.compose import REPO, compose_config
from tests.dist_helpers import run_on_ranks
from tests.text_helpers import tiny_gpt, write_corpus
from tests.train_helpers import assert_same_model, build, case_results, max_abs_diff, params_of, train_each
from trainer.setup.config import plain_config

# ~1150 characters: 1035 train tokens = 64 windows of 16, so 2 ranks x 8 = 4 steps per epoch and 6 steps
# cross an epoch boundary (set_epoch reshuffles); 115 validation tokens.
NUM_CHARS = 1150
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
    "ddp-auto": ["sync=ddp", "sync.bucket_cap_mb=auto", "sync.auto_steps_per_trial=1", "sync.auto_warmup_steps=1"],
    "ddp-accum": ["sync=ddp", "data.batch_size=4", "trainer.grad_accum_steps=2"],
    "zero": ["sync=zero"],
    "fsdp": ["sync=fsdp"],
}


def train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, torch.Tensor]:
    config = plain_config(compose_config([*COMMON, *overrides]))  # saved in checkpoints: the sample tool reads it
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir, config=config)
    trainer.fit()
    assert trainer.step == 6 and trainer.epoch == 1
    return params_of(trainer)


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
    results["resume"] = resume_case(rank, world_size, gpt, f"{root}/resume")
    return results


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("text")
    return tiny_gpt(write_corpus(root / "corpus.txt", NUM_CHARS), root / "tokens")


@pytest.fixture(scope="module")
def single(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, torch.Tensor], Path]:
    root = tmp_path_factory.mktemp("single")
    run_dir = root / "run"
    (params,) = run_on_ranks(train, 1, root / "rank", [*corpus, "sync=none", "data.batch_size=16"], str(run_dir))
    return params, run_dir


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


def test_sync_none_lets_replicas_diverge(pairs: list[dict[str, Any]], single: tuple[dict[str, torch.Tensor], Path]):
    rank0, rank1 = case_results(pairs, "none")
    assert max_abs_diff(rank0, rank1) > 1e-4 and max_abs_diff(rank0, single[0]) > 1e-4


def test_resume_mid_epoch_is_bit_identical(pairs: list[dict[str, Any]]) -> None:
    for rank in pairs:
        result = rank["resume"]
        assert result["from"] == 2
        assert all(torch.equal(result["straight"][k], result["resumed"][k]) for k in result["straight"])


def sample(run_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "trainer.tools.sample", str(run_dir), *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


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
