"""fp16 on sharded gradients: one rank's shard alone overflows, and every rank still skips that step.

Each rank of zero and fsdp holds its own shard of the gradient, so one rank can find an inf where the
other finds none. The overflow is the step's global gradient norm being non-finite
(trainer/loop/loss_scale.py): the norm reduces every shard's squares, so every rank sees the same
flag, skips the same step (on the device: a fused AdamW itself, SGD and a plain AdamW through
trainer/loop/device_skip.py) and backs its scale off alike. Here an inf is put into rank 1's shard
only, after the averaging of step 3.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.dist_helpers import run_on_ranks
from tests.train_helpers import build, case_results, params_of, train_each

COMMON = [
    "logger=none",
    "trainer.progress_bar=false",
    "model.hidden_sizes=[16,16]",
    "trainer.precision=fp16",
    "trainer.max_steps=5",
    "trainer.log_every_n_steps=1",
    "trainer.eval_every_n_steps=0",
]
POISONED_STEP = 3
CASES = {
    "zero-adamw-fused": ["sync=zero", "optim=adamw", "optim.fused=true"],
    "zero-sgd": ["sync=zero", "optim=sgd"],
    "zero3-adamw-fused": ["sync=zero", "sync.stage=3", "optim=adamw", "optim.fused=true"],
    "fsdp-adamw-fused": ["sync=fsdp", "optim=adamw", "optim.fused=true"],
    "fsdp-adamw": ["sync=fsdp", "optim=adamw"],
    # 16-bit parameters and gradients (trainer.param_dtype=fp16): the shards are the fp32 master copy's
    "zero-fp16-params": ["sync=zero", "optim=adamw", "optim.fused=true", "trainer.param_dtype=fp16"],
    "zero3-fp16-params": ["sync=zero", "sync.stage=3", "optim=sgd", "trainer.param_dtype=fp16"],
    "fsdp-fp16-params": ["sync=fsdp", "optim=adamw", "optim.fused=true", "trainer.param_dtype=fp16"],
}


def _poisoned(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir)
    after_backward = trainer.sync.after_backward
    before: dict[str, torch.Tensor] = {}

    def poison(model: Any) -> None:
        after_backward(model)
        if trainer.step + 1 == POISONED_STEP:
            before.update(params_of(trainer))  # the parameters the skipped step must leave as they are
            if rank == 1:  # this rank's shard only: the other's gradient is finite
                grads = [p.grad for group in trainer.optimizer.param_groups for p in group["params"]]
                grad = next(g for g in grads if g is not None)
                local = grad.to_local() if hasattr(grad, "to_local") else grad
                local.view(-1)[0] = float("inf")

    trainer.sync.after_backward = poison  # type: ignore[method-assign]
    trainer.train(POISONED_STEP)
    after = params_of(trainer)
    trainer.train(trainer.total_steps)
    rows = trainer._rows.rows
    return {
        "skipped": all(torch.equal(before[k], after[k]) for k in before),
        "scales": [row["train/grad_scale"] for row in rows],
        "overflows": [row["train/overflow_steps"] for row in rows],
        "params": params_of(trainer),
    }


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("fp16_agreement")
    return run_on_ranks(train_each, 2, root / "ranks", _poisoned, CASES, str(root / "runs"), timeout_s=600)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_shards_overflow_skips_the_step_on_every_rank(runs: list[dict[str, Any]], case: str) -> None:
    rank0, rank1 = case_results(runs, case)
    for rank in (rank0, rank1):
        assert rank["skipped"], "the overflowed step changed the parameters"
        assert rank["overflows"][-1] == 1 and rank["overflows"][POISONED_STEP - 1] == 1, rank["overflows"]
    assert rank0["scales"] == rank1["scales"]  # backed off alike, grown alike
    assert rank0["scales"][POISONED_STEP - 1] < rank0["scales"][POISONED_STEP - 2]
    assert all(torch.equal(rank0["params"][k], rank1["params"][k]) for k in rank0["params"])
