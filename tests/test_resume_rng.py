"""On resume, every rank gets back its OWN random generators, not another rank's.

A checkpoint holds one RNG state per rank (resume.save gathers them), and resume.restore must hand
rank r the r-th. Nothing else catches a mix-up: the framework seeds every rank alike and none of
the other tests' models draws a random number after a checkpoint, so handing every rank rank 0's
state changes no number they compare. Here the ranks' streams are made to differ (each reseeds by
its rank after the build, as per-rank augmentation or seeding would), and a tiny GPT with dropout
draws a mask from them in every step's forward. Under sync=ddp the averaged gradient, so the one
model both ranks hold, depends on both ranks' masks: rank 1 drawing rank 0's after the resume
changes the weights. (Not sync=none: a checkpoint holds rank 0's weights only, so there rank 1
could not resume its own model whatever its RNG.)

One spawn of 2 gloo ranks, the real trainer: 4 steps with checkpoints at 2 and 4; then the run dir
is cut back to step 2 and a fresh trainer resumes there (trainer.resume=auto) and trains to 4.
"""

from __future__ import annotations

import os
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_helpers import run_on_ranks
from tests.text_helpers import tiny_gpt, write_corpus
from tests.train_helpers import bit_identical, build, params_of
from trainer.reliability.checkpoint import load_checkpoint, rng_state

CPU = torch.device("cpu")
# 1150 characters: 64 train windows of 16 tokens, 2 ranks x 8 = 4 steps per epoch, so the
# checkpoint at step 2 is mid-epoch and the resumed run skips into the epoch's order.
NUM_CHARS = 1150
RUN = [
    "logger=none",
    "trainer.progress_bar=false",
    "trainer.max_steps=4",
    "trainer.log_every_n_steps=2",
    "trainer.eval_every_n_steps=0",
    "trainer.checkpoint_every_n_steps=2",
    "trainer.keep_checkpoints=5",
    "data.batch_size=8",
    "sync=ddp",  # one model from both ranks' masks (sync=none's checkpoint holds rank 0's weights only)
    "model.dropout=0.2",  # a mask drawn from the global torch RNG in every training forward
    "optim.lr=0.5",  # large steps, so a different mask moves the weights visibly
]
RESUME_STEP = 2


def _seed_by_rank(rank: int) -> None:
    """Give this rank a stream of its own (build seeded every rank alike), for all three generators."""
    random.seed(1000 + rank)
    np.random.seed(1000 + rank)
    torch.manual_seed(1000 + rank)


def _rank_run(rank: int, world_size: int, gpt: list[str], run_dir: str) -> dict[str, Any]:
    """The uninterrupted run, then a fresh trainer resumed from its step-2 checkpoint in the same run dir."""
    overrides = [*gpt, *RUN]
    straight = build(rank, world_size, overrides, run_dir)
    _seed_by_rank(rank)  # after the build: the model's initial weights stay the same on both ranks
    straight.fit()
    assert straight.step == 4
    result: dict[str, Any] = {"straight": params_of(straight), "straight_rng_end": rng_state(CPU)}
    del straight

    # As if the job had died right after step 2: only the step-2 checkpoint is left to resume from.
    ckpt = Path(run_dir) / "checkpoints"
    if rank == 0:
        for name in ("step-4.pt", "last.pt"):
            (ckpt / name).unlink()
        os.link(ckpt / f"step-{RESUME_STEP}.pt", ckpt / "last.pt")
    dist.barrier()  # nobody looks for last.pt before rank 0 has pointed it at step 2
    # What each rank had at step 2, as the uninterrupted run saved it (every rank reads the file).
    result["saved_rngs"] = load_checkpoint(ckpt / "last.pt")["rng"]

    resumed = build(rank, world_size, overrides, run_dir)  # resume=auto: restores inside the constructor
    result["resumed_at"] = resumed.step
    result["rng_after_resume"] = rng_state(CPU)  # before anything draws from it
    resumed.fit()
    result["resumed"] = params_of(resumed)
    result["resumed_rng_end"] = rng_state(CPU)
    return result


def _same_rng(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """torch's, numpy's and Python's generator states all equal (rng_state's plain-data form)."""
    na, nb = a["numpy"], b["numpy"]
    return (
        torch.equal(a["torch"], b["torch"])
        and torch.equal(na["keys"], nb["keys"])
        and (na["pos"], na["has_gauss"], na["cached_gaussian"]) == (nb["pos"], nb["has_gauss"], nb["cached_gaussian"])
        and tuple(a["python"][1]) == tuple(b["python"][1])
    )


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("resume_rng")
    gpt = tiny_gpt(write_corpus(root / "corpus.txt", NUM_CHARS), root / "tokens")
    return run_on_ranks(_rank_run, 2, root / "ranks", gpt, str(root / "run"))


def test_each_rank_resumes_with_its_own_rng_state(ranks: list[dict[str, Any]]) -> None:
    saved = ranks[0]["saved_rngs"]
    # Meaningful only if the ranks' states differ: equal ones would hide a rank given rank 0's.
    assert len(saved) == 2 and not _same_rng(saved[0], saved[1]), "the ranks' RNG states at the checkpoint are equal"
    for rank, result in enumerate(ranks):
        assert result["resumed_at"] == RESUME_STEP
        assert _same_rng(result["rng_after_resume"], saved[rank]), (
            f"rank {rank}'s RNG right after resume is not its own state at step {RESUME_STEP}"
            + (" (it is rank 0's)" if _same_rng(result["rng_after_resume"], saved[0]) else "")
        )


def test_resumed_dropout_run_matches_the_uninterrupted_one_on_each_rank(ranks: list[dict[str, Any]]) -> None:
    # Under DDP both ranks hold one model, made from both ranks' masks: rank 1 drawing rank 0's
    # masks after the resume moves it (on both ranks) away from the uninterrupted run's.
    for rank, result in enumerate(ranks):
        assert bit_identical(result["resumed"], result["straight"]), (
            f"rank {rank}: the resumed run's weights differ from the uninterrupted run's"
        )
        # And the streams go on where the uninterrupted run's went: the same draws, in the same number.
        assert _same_rng(result["resumed_rng_end"], result["straight_rng_end"]), (
            f"rank {rank}: the RNG after the resumed run differs from the uninterrupted run's"
        )
