"""sync=zero (ZeRO-2 by hand) on real gloo ranks: the same model as one process, half the optimizer
state, the full state in checkpoints, bit-identical resume, counted collectives, refusals."""

from __future__ import annotations

import os
import traceback
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks
from tests.train_helpers import (
    SIX_STEPS,
    assert_same_model,
    bit_identical,
    build,
    case_results,
    max_abs_diff,
    params_of,
    train_each,
)
from trainer.errors import ConfigError
from trainer.loop.metrics import optimizer_state_mb
from trainer.reliability.checkpoint import load_checkpoint
from trainer.setup.build import build_parts, instantiate
from trainer.sync.zero import ZeroSync

# As test_equivalence's COMMON, but hidden sizes whose 2399 parameters do not split evenly over 2
# ranks: the flat buffers carry one element of padding. 64 samples, 2 ranks x 8: 4 steps per
# epoch, so 6 steps cross an epoch boundary.
COMMON = [
    "logger=none",
    "model.hidden_sizes=[32,31]",
    *SIX_STEPS,
    "trainer.check_replicas_every_n_steps=1",  # the trainer's own replica check, after every step
]
NUMEL = 32 * 32 + 32 + 31 * 32 + 31 + 31 * 10 + 10
ZERO = ["sync=zero", "data.batch_size=8"]
ACCUM = ["sync=zero", "data.batch_size=4", "trainer.grad_accum_steps=2"]

CASES = {
    "sgd": [*ZERO, "optim=sgd"],
    "adamw": [*ZERO, "optim=adamw"],
    "sgd-accum": [*ACCUM, "optim=sgd"],
    "adamw-accum": [*ACCUM, "optim=adamw"],
    "ddp-adamw": ["sync=ddp", "data.batch_size=8", "optim=adamw"],  # the state zero must shard and rebuild
    # Checkpoints at step 3 (and 6); then step 6 is deleted and a new trainer resumes from step 3.
    "resume": [*ZERO, "optim=adamw", "trainer.checkpoint_every_n_steps=3"],
    "lbfgs": [*ZERO, "optim=sgd", "optim._target_=torch.optim.LBFGS", "~optim.momentum", "~optim.weight_decay"],
}


def _train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """A trainer's run; then its full optimizer state, as state_dicts() gives it (every rank calls it)."""
    trainer = build(rank, world_size, COMMON + overrides, run_dir)
    trainer.fit()
    assert trainer.step == 6
    _, optimizer_state = trainer.sync.state_dicts(trainer.model, trainer.optimizer)
    return {
        "params": params_of(trainer),
        "state_mb": optimizer_state_mb(trainer.optimizer),
        "optimizer": optimizer_state,
        "checkpoint": load_checkpoint(Path(run_dir) / "checkpoints" / "last.pt")["optimizer"],
        "describe": trainer.sync.describe(),
    }


def _resume(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """As if the run had died after its step-3 checkpoint: a new trainer in the same run dir resumes there."""
    first = _train(rank, world_size, overrides, run_dir)["params"]
    ckpt = Path(run_dir) / "checkpoints"
    if rank == 0:
        for name in ("step-6.pt", "last.pt"):
            (ckpt / name).unlink()
        os.link(ckpt / "step-3.pt", ckpt / "last.pt")
    dist.barrier()  # nobody looks for last.pt before rank 0 has pointed it at step 3
    trainer = build(rank, world_size, COMMON + overrides, run_dir)  # trainer.resume=auto, the default
    resumed_at = trainer.step
    trainer.fit()
    return {"first": first, "resumed_at": resumed_at, "params": params_of(trainer)}


def _case(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    return (_resume if Path(run_dir).name == "resume" else _train)(rank, world_size, overrides, run_dir)


def _mechanism(rank: int, world_size: int) -> dict[str, Any]:
    """The strategy alone on a toy model of 23 parameters (padded to 24): views, counts, checks, refusals."""
    torch.manual_seed(rank)  # each rank draws other weights: wrap() must replace them with rank 0's
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    sync = ZeroSync()
    sync.wrap(model)
    optimizer = sync.build_optimizer(model, partial(torch.optim.SGD, lr=0.1))
    flat = sync._params
    assert flat is not None
    in_buffer = all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in model.parameters())

    def backward(poison: bool = False) -> bool:
        torch.manual_seed(100 + rank)  # each rank its own data
        F.cross_entropy(model(torch.randn(4, 4)), torch.randint(0, 2, (4,))).backward()
        sync.after_backward(model)
        if poison:
            sync._grads.shard[0] = float("nan")  # type: ignore[union-attr]  # one rank's shard only: both must still answer False
        return sync.grads_finite(model, optimizer)

    finite = backward()
    sync.optimizer_step(optimizer)
    sync.zero_grad(optimizer)
    counts = sync.take_comm()
    zeroed = all(p.grad is None for p in model.parameters())  # stage 2 keeps only the shard
    nonfinite = backward(poison=rank == 1)
    sync.zero_grad(optimizer)
    refusals: dict[str, str] = {}
    factories: dict[str, Any] = {
        "lbfgs": partial(torch.optim.LBFGS, lr=1.0),
        "groups": lambda ps: torch.optim.SGD([{"params": list(ps)}, {"params": [nn.Parameter(torch.zeros(1))]}], lr=1),
    }
    for name, factory in factories.items():
        try:
            sync.build_optimizer(model, factory)
        except ConfigError as err:
            refusals[name] = str(err)
    try:  # refused before any collective, so a single rank may try it
        ZeroSync().wrap(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))
    except ConfigError as err:
        refusals["mixed"] = str(err)
    return {
        "in_buffer": in_buffer,
        "finite": finite,
        "nonfinite": nonfinite,
        "zeroed": zeroed,
        "counts": counts,
        "refusals": refusals,
        "describe": sync.describe(),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Everything at 2 ranks in one spawn: the trainer's cases one after another, then the mechanism."""
    results = {"cases": train_each(rank, world_size, _case, CASES, root)}
    try:
        results["mechanism"] = _mechanism(rank, world_size)
    except Exception:  # reported by the mechanism's own test
        results["mechanism"] = traceback.format_exc()
    return results


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("zero")
    return run_on_ranks(_ranks, 2, root / "ranks", str(root / "runs"), timeout_s=600)


def _cases(ranks: list[dict[str, Any]], case: str) -> list[Any]:
    return case_results([r["cases"] for r in ranks], case)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """One process on the doubled batch, per optimizer: the references (one spawn for both)."""
    root = tmp_path_factory.mktemp("single")
    refs = {optim: ["sync=none", "data.batch_size=16", f"optim={optim}"] for optim in ("sgd", "adamw")}
    (results,) = run_on_ranks(train_each, 1, root / "rank", _train, refs, str(root / "runs"))
    return {optim: case_results([results], optim)[0]["params"] for optim in refs}


@pytest.mark.parametrize("case", ["sgd", "adamw", "sgd-accum", "adamw-accum"])
def test_two_ranks_equal_one_process_with_twice_the_batch(
    ranks: list[dict[str, Any]], single: dict[str, dict[str, torch.Tensor]], case: str
) -> None:
    rank0, rank1 = _cases(ranks, case)
    reference = single[case.split("-")[0]]
    assert_same_model([rank0["params"], rank1["params"]], reference)
    assert max_abs_diff(rank0["params"], initial_params()) > 1e-3, "nothing was trained"
    info = rank0["describe"]
    assert info["strategy"] == "zero" and info["world_size"] == 2 and info["numel"] == NUMEL
    assert info["padded_numel"] == NUMEL + 1 and info["shard_numel"] == (NUMEL + 1) // 2


def initial_params() -> dict[str, torch.Tensor]:
    """The weights every run starts from (same seed), built in this process without training."""
    cfg = compose_config(COMMON)
    return build_parts(cfg, instantiate(cfg.trainer)).model.state_dict()


def test_each_rank_holds_half_of_ddps_optimizer_state(ranks: list[dict[str, Any]]) -> None:
    zero, ddp = _cases(ranks, "adamw")[0]["state_mb"], _cases(ranks, "ddp-adamw")[0]["state_mb"]
    assert 0.45 <= zero / ddp <= 0.55, (zero, ddp)


def test_checkpoint_holds_the_full_optimizer_state_of_a_plain_optimizer(ranks: list[dict[str, Any]]) -> None:
    zero0, zero1 = _cases(ranks, "adamw")
    expected = _cases(ranks, "ddp-adamw")[0]["optimizer"]  # a plain AdamW over model.parameters()
    for full in (zero0["optimizer"], zero1["optimizer"], zero0["checkpoint"]):  # gathered on every rank; written
        assert full["param_groups"] == expected["param_groups"]
        assert full["state"].keys() == expected["state"].keys() == set(range(6))
        for index, state in expected["state"].items():
            assert full["state"][index].keys() == state.keys()
            for key, value in state.items():
                assert full["state"][index][key].shape == value.shape, (index, key)
                assert (full["state"][index][key] - value).abs().max() <= 1e-6, (index, key)


def test_resume_from_a_mid_run_checkpoint_is_bit_identical(ranks: list[dict[str, Any]]) -> None:
    rank0, rank1 = _cases(ranks, "resume")
    assert rank0["resumed_at"] == rank1["resumed_at"] == 3
    straight = _cases(ranks, "adamw")[0]["params"]
    assert bit_identical(rank0["first"], straight)  # checkpointing changes nothing
    assert bit_identical(rank0["params"], straight) and bit_identical(rank1["params"], straight)


def test_strategy_mechanism(ranks: list[dict[str, Any]]) -> None:
    results = [r["mechanism"] for r in ranks]
    assert not any(isinstance(r, str) for r in results), "\n".join(map(str, results))
    rank0, rank1 = results
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"], strict=True))
    for rank in results:
        assert rank["in_buffer"] and rank["zeroed"]
        assert rank["finite"] is True and rank["nonfinite"] is False  # rank 1's NaN reached rank 0's answer
        info = rank["describe"]
        assert (info["numel"], info["padded_numel"], info["shard_numel"]) == (23, 24, 12)
        # One step: a reduce_scatter and an all_gather of the padded buffer; the gradient bytes once.
        counts = rank["counts"]
        assert counts.kinds == {"reduce_scatter": [24 * 4, 1], "all_gather": [24 * 4, 1]}
        assert counts.bytes == 23 * 4 and counts.collectives == 2


def test_refusals_name_the_key_and_the_reason(ranks: list[dict[str, Any]]) -> None:
    through_config = [r["cases"]["lbfgs"] for r in ranks]  # the trainer's build raised: its traceback
    assert all(isinstance(e, str) and "ConfigError" in e for e in through_config), through_config
    for error in through_config + [r["mechanism"]["refusals"]["lbfgs"] for r in ranks]:
        assert "optim._target_=torch.optim.LBFGS is invalid with sync=zero" in error
        assert "element-wise" in error and "torch.optim.AdamW" in error
    refusals = ranks[0]["mechanism"]["refusals"]
    assert "2 param groups" in refusals["groups"]
    assert "torch.float32" in refusals["mixed"] and "torch.float64" in refusals["mixed"]
