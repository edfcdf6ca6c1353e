"""data.drop_last=false: every sample trained once per epoch, ranks a batch apart, no hang, right math.

33 samples on 2 ranks with batch 4: rank 0 holds 17 (batches 4,4,4,4,1), rank 1 holds 16 (4,4,4,4),
so in the last step of each epoch rank 1 has no batch and shadows rank 0's collectives. 17 val
samples give val shards of 9 and 8 (3 and 2 batches): FSDP's forward communicates, so evaluation
is uneven too.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch.optim.lr_scheduler import LambdaLR

from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks
from tests.train_helpers import bit_identical, build, case_results, max_abs_diff, train_each
from trainer.errors import ConfigError
from trainer.loop.step_math import steps_per_epoch
from trainer.setup.build import build_parts, instantiate
from trainer.setup.precheck import check_overrides

COMMON = [
    "logger=none",
    "model.hidden_sizes=[16]",
    "data.num_samples=33",
    "data.num_val_samples=17",
    "data.batch_size=4",
    "data.drop_last=false",
    "trainer.num_epochs=2",
    "trainer.max_steps=null",
    "trainer.log_every_n_steps=2",
    "trainer.eval_every_n_steps=3",
    "trainer.progress_bar=false",
]
TRAIN_SAMPLES = 33

CASES = {
    "none": ["sync=none"],
    "manual": ["sync=manual"],
    "manual-rs_ag": ["sync=manual", "sync.collective=rs_ag"],
    "manual-accum": ["sync=manual", "trainer.grad_accum_steps=2"],
    "bucketed": ["sync=bucketed", "sync.bucket_cap_mb=0.001"],
    "bucketed-rs_ag": ["sync=bucketed", "sync.bucket_cap_mb=0.001", "sync.collective=rs_ag"],
    "ddp": ["sync=ddp"],
    "ddp-accum": ["sync=ddp", "trainer.grad_accum_steps=2"],
    "zero": ["sync=zero"],
    "zero-adamw": ["sync=zero", "optim=adamw"],
    "fsdp": ["sync=fsdp"],
    "fsdp-accum": ["sync=fsdp", "trainer.grad_accum_steps=2"],
}


def train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    trainer = build(rank, world_size, COMMON + overrides, run_dir)
    summary = trainer.fit()
    model_state, _ = trainer.sync.checkpointing.state_dicts(trainer.model, trainer.optimizer)  # full, on rank 0
    local = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()} if rank else {}
    return {"full": model_state, "local": local, "summary": summary, "steps": trainer.step}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("uneven")
    return run_on_ranks(train_each, 2, root / "ranks", train, CASES, str(root / "runs"))


def reference(overrides: list[str], world_size: int = 2) -> dict[str, torch.Tensor]:
    """The same training done by hand in one process, from the same loaders: each step, every
    rank's micro-batches' gradients (loss / k) summed, divided by the world size; a rank with no
    batch left contributes nothing (zero), as shadowing promises."""
    cfg = compose_config(COMMON + overrides)
    parts = build_parts(cfg)
    settings = parts.settings
    data, model, k = parts.data, parts.model, settings.grad_accum_steps
    data.setup()
    loaders = [data.train_loader(r, world_size, settings.seed) for r in range(world_size)]
    steps = steps_per_epoch(max(len(loader) for loader in loaders), k, keep_partial=True)
    optimizer = parts.optimizer_factory(model.parameters())
    scheduler = LambdaLR(optimizer, parts.schedule_factory(total_steps=2 * steps))
    for epoch in range(2):
        for loader in loaders:
            loader.sampler.set_epoch(epoch)  # type: ignore[union-attr]
        batches = [itertools.chain(iter(loader), itertools.repeat(None)) for loader in loaders]
        for _ in range(steps):
            for _ in range(k):
                for rank_batches in batches:
                    batch = next(rank_batches)
                    if batch is not None:
                        (F.cross_entropy(model(batch[0]), batch[1]) / k).backward()
            for p in model.parameters():
                assert p.grad is not None
                p.grad.div_(world_size)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("case", [c for c in CASES if c != "none"])
def test_uneven_shards_train_the_hand_computed_model(ranks: list[dict[str, Any]], case: str) -> None:
    """Every strategy: no hang, the expected steps, and the model the hand-written loop trains."""
    zero, one = case_results(ranks, case)
    k = 2 if "accum" in case else 1
    assert zero["steps"] == one["steps"] == 2 * -(-5 // k)  # rank 0's 5 batches set the epoch's length
    expected = reference(CASES[case])
    assert max_abs_diff(zero["full"], expected) <= 1e-5
    if "fsdp" not in case:  # every rank holds the whole model, the same bits (fsdp holds shards)
        assert bit_identical(zero["full"], one["local"])


@pytest.mark.parametrize("case", list(CASES))
def test_every_sample_is_trained_once_per_epoch(ranks: list[dict[str, Any]], case: str) -> None:
    zero, _ = case_results(ranks, case)
    summary = zero["summary"]
    assert [r["samples"] for r in summary["ranks"]] == [2 * 17, 2 * 16]
    assert sum(r["samples"] for r in summary["ranks"]) == 2 * TRAIN_SAMPLES
    assert summary["eval/accuracy"] is not None  # evaluation over the uneven val shards finished


@pytest.mark.parametrize(("num_samples", "world_size"), [(33, 2), (35, 3), (7, 4), (8, 2)])
def test_shards_without_padding_partition_the_train_set(num_samples: int, world_size: int) -> None:
    cfg = compose_config([*COMMON, f"data.num_samples={num_samples}"])
    data = instantiate(cfg.data)
    data.setup()
    counts = data.train_batches(world_size)
    seen: list[int] = []
    for rank in range(world_size):
        loader = data.train_loader(rank, world_size, seed=0)
        loader.sampler.set_epoch(1)
        indices = list(loader.sampler)
        assert len(loader) == counts[rank] == -(-len(indices) // 4)
        seen += indices
    assert sorted(seen) == list(range(num_samples))  # each sample once, none padded in
    assert max(counts) - min(counts) <= 1


def test_drop_last_keeps_its_meaning() -> None:
    """drop_last=true (the default): equal shards, partial batches dropped, the original sampler."""
    data = instantiate(compose_config([*COMMON, "data.drop_last=true"]).data)
    data.setup()
    assert data.train_batches(2) == [4, 4]  # 33 // 2 = 16 samples each, 4 batches of 4
    assert steps_per_epoch(5, 2) == 2 and steps_per_epoch(5, 2, keep_partial=True) == 3


def test_bad_drop_last_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"data\.drop_last=maybe is invalid: accepted: true or false"):
        check_overrides([*COMMON, "data.drop_last=maybe"])  # train.py's check of its command line


def test_too_few_samples_for_the_ranks_is_named(tmp_path: Path) -> None:
    data = instantiate(compose_config([*COMMON, "data.num_samples=1"]).data)
    data.setup()
    with pytest.raises(ValueError, match="fewer than the world size 2"):
        data.train_loader(0, 2, seed=0)
