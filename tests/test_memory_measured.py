"""The memory each rank measures on its sampled steps (docs/metrics.md, Memory), for every strategy
from one spawn of 2 gloo ranks: the five kinds and the step's total in every row, the same
activations whatever the strategy (what autograd saves depends on the model and the batch, never
on how gradients are synchronised), that count against the MLP's own arithmetic, gathered units
and buckets as communication buffers, and the total as the sum of the kinds' peaks on CPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_helpers import run_on_ranks
from tests.train_helpers import build, case_results, train_each

MIB = 2**20
BATCH, INPUT, HIDDEN, CLASSES = 16, 32, [24, 20], 10
COMMON = [
    "logger=none",
    "trainer.progress_bar=false",
    f"model.hidden_sizes=[{HIDDEN[0]},{HIDDEN[1]}]",
    f"data.batch_size={BATCH}",
    "data.num_samples=256",
    "trainer.max_steps=3",
    "trainer.log_every_n_steps=1",
    "trainer.eval_every_n_steps=0",
    "optim=adamw",
]
CASES = {
    "none": ["sync=none"],
    "manual": ["sync=manual"],
    "bucketed": ["sync=bucketed"],
    "ddp": ["sync=ddp"],
    "ddp-bucket-view": ["sync=ddp", "sync.gradient_as_bucket_view=true"],
    "zero-stage1": ["sync=zero", "sync.stage=1"],
    "zero": ["sync=zero"],
    "zero-stage3": ["sync=zero", "sync.stage=3", "sync.wrap=module"],
    "fsdp": ["sync=fsdp", "sync.wrap=module"],
    "accumulation": ["sync=ddp", "trainer.grad_accum_steps=2"],
}
KINDS = ("parameters", "gradients", "optimizer_state", "comm_buffers", "activations")
NUMEL = INPUT * HIDDEN[0] + HIDDEN[0] + HIDDEN[0] * HIDDEN[1] + HIDDEN[1] + HIDDEN[1] * CLASSES + CLASSES


def _run(rank: int, world_size: int, overrides: list[str], run_dir: str) -> list[dict[str, float]]:
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir)
    trainer.train(3)
    return [row for row in trainer._rows.rows if "memory/peak_mb" in row]


def _every_case(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return train_each(rank, world_size, _run, CASES, root)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("memory")
    return run_on_ranks(_every_case, 2, root / "ranks", str(root / "runs"), timeout_s=600)


def saved_bytes(batch: int) -> int:
    """What the MLP's forward and loss save for backward, counted by hand: the input, each ReLU's
    output (the next Linear's input, the same storage), the log-softmax's output, and the targets
    (int64); each Linear's weight is a parameter, not an activation."""
    floats = batch * (INPUT + HIDDEN[0] + HIDDEN[1] + CLASSES)
    return 4 * floats + 8 * batch


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_kind_and_the_total_in_every_row(ranks: list[dict[str, Any]], case: str) -> None:
    for rows in case_results(ranks, case):
        assert len(rows) >= 2, rows
        for row in rows:
            for kind in KINDS:
                assert row[f"memory/{kind}_peak_mb"] >= row.get(f"memory/{kind}_mb", 0.0) >= 0.0, (kind, row)
            # CPU: no allocator statistics, so the total is the kinds' peaks added up (an upper bound)
            assert row["memory/peak_mb"] == pytest.approx(sum(row[f"memory/{k}_peak_mb"] for k in KINDS))


@pytest.mark.parametrize("case", sorted(CASES))
def test_activations_are_the_models_whatever_the_strategy(ranks: list[dict[str, Any]], case: str) -> None:
    micro = BATCH  # data.batch_size is a micro-batch's: accumulation's two are counted apart, not summed
    for rows in case_results(ranks, case):
        for row in rows:
            saved = row["memory/activations_peak_mb"] * MIB
            # the loss's scalars (nll_loss's total weight) come on top: a few bytes
            assert saved_bytes(micro) <= saved <= saved_bytes(micro) + 64, (case, saved, saved_bytes(micro))


def test_model_states_by_kind(ranks: list[dict[str, Any]]) -> None:
    """Replicas hold all of it; zero's shards half (padded); DDP's reducer buckets are a second copy
    of the gradients unless they are the gradients (gradient_as_bucket_view)."""
    full = 4 * NUMEL
    last = {case: case_results(ranks, case)[0][-1] for case in CASES}
    for case in ("none", "manual", "bucketed", "ddp", "ddp-bucket-view"):
        assert last[case]["memory/parameters_mb"] * MIB == full, case
        assert last[case]["memory/gradients_mb"] * MIB >= full, case  # flat buffers may pad
        adamw = last[case]["memory/optimizer_state_mb"] * MIB
        assert 2 * full <= adamw <= 2 * full + 4 * 16, case  # exp_avg, exp_avg_sq, a 0-d step per tensor
    assert last["ddp"]["memory/comm_buffers_mb"] * MIB == full
    assert last["ddp-bucket-view"]["memory/comm_buffers_peak_mb"] == 0.0
    for case in ("zero", "zero-stage3", "fsdp"):
        assert last[case]["memory/optimizer_state_mb"] < 0.55 * last["ddp"]["memory/optimizer_state_mb"], case
    # zero stage 3 keeps the shard; its units, gathered for their turn, are communication buffers
    shard = last["zero-stage3"]["memory/parameters_peak_mb"] * MIB
    assert full / 2 <= shard <= full / 2 + 4 * 8
    assert last["zero-stage3"]["memory/comm_buffers_peak_mb"] * MIB >= 4 * INPUT * HIDDEN[0]  # the largest unit
    assert last["fsdp"]["memory/comm_buffers_peak_mb"] * MIB >= 4 * INPUT * HIDDEN[0]
    assert last["none"]["memory/comm_buffers_peak_mb"] == 0.0


def test_the_activation_count_leaves_parameters_out() -> None:
    """In one process: a layer that saves its own weight's transpose (a Linear) adds nothing for it,
    and a parameter's storage named as excluded (zero's flat buffer behind views) neither."""
    from trainer.measures import SavedForBackward

    layer = torch.nn.Linear(8, 4)
    flat = torch.zeros(40, requires_grad=True)
    view = flat[:8]
    counter = SavedForBackward()
    counter.excluded = {flat.untyped_storage()._cdata}
    x = torch.randn(3, 8)
    with counter:
        (layer(x) * view[:4]).sum()
    assert counter.peak == 3 * 8 * 4 + 3 * 4 * 4  # the input (the Linear's), the Linear's output (the product's)
