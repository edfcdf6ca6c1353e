"""trainer.compile=true: torch.compile before the strategy wraps; the same training as eager."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from torch._dynamo.utils import counters

from tests.dist_helpers import run_on_ranks
from tests.text_helpers import tiny_gpt, write_corpus
from tests.train_helpers import build, case_results, max_abs_diff, train_each
from trainer.loop.lm import compiler_missing, end_of_run_sample

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        compiler_missing(torch.device("cpu")) is not None, reason=str(compiler_missing(torch.device("cpu")))
    ),
]

COMMON = ["logger=none", "trainer.progress_bar=false", "trainer.max_steps=3", "trainer.eval_every_n_steps=0"]
SAMPLE_GRAPHS = "graphs compiled by the closing sample"


def train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, torch.Tensor]:
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir)
    # The run's closing sample, first (after the run, its graphs would exist already): it compiles
    # nothing, though its context grows a token at a time. It draws from its own generator.
    graphs = counters["stats"]["unique_graphs"]
    end_of_run_sample(trainer.model, trainer.data)
    sample_graphs = counters["stats"]["unique_graphs"] - graphs
    trainer.fit()
    # FSDP's shards gathered (rank 0 only)
    full, _ = trainer.sync.checkpointing.state_dicts(trainer.model, trainer.optimizer)
    weights = {k: v.detach().cpu().clone() for k, v in full.items()}
    return {**weights, SAMPLE_GRAPHS: torch.tensor(sample_graphs)}


def test_compiled_trains_as_eager_under_every_wrapping_strategy(tmp_path: Path) -> None:
    gpt = [*tiny_gpt(write_corpus(tmp_path / "c.txt", 1150), tmp_path / "tok"), "data.batch_size=8"]
    mlp = ["model.hidden_sizes=[32,32]", "data.num_samples=64", "data.num_val_samples=16", "data.batch_size=8"]
    cases = {}
    # fsdp on the mlp: on the gpt it stops at the tied head with or without compile.
    runs = [("ddp", gpt, "sync=ddp"), ("manual", gpt, "sync=manual"), ("fsdp", mlp, "sync=fsdp")]
    runs += [("bucketed", gpt, "sync=bucketed"), ("zero", gpt, "sync=zero")]
    for name, base, sync in runs:
        cases[f"{name}-eager"] = [*base, sync]
        cases[f"{name}-compiled"] = [*base, sync, "trainer.compile=true"]
    ranks = run_on_ranks(train_each, 2, tmp_path / "ranks", train, cases, str(tmp_path / "runs"), timeout_s=900)
    for name, _, _ in runs:
        eager, compiled = case_results(ranks, f"{name}-eager"), case_results(ranks, f"{name}-compiled")
        for rank in compiled:
            assert int(rank.pop(SAMPLE_GRAPHS)) == 0, f"{name}: the closing sample compiled graphs"
        for rank in eager:
            rank.pop(SAMPLE_GRAPHS)
        if compiled[1]:  # a sharded strategy's full state exists on rank 0 only
            assert max_abs_diff(compiled[0], compiled[1]) == 0.0, f"{name}: replicas differ"
        assert max_abs_diff(compiled[0], eager[0]) <= 1e-5, name


def test_no_compiler_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shutil, "which", lambda name: None)
    missing = compiler_missing(torch.device("cpu"))
    assert missing is not None and "no C++ compiler" in missing
