"""sync=zero (ZeRO-2 by hand) on real gloo ranks: the same model as one process, half the optimizer
state, the full state in checkpoints, bit-identical resume, counted collectives, refusals."""

from __future__ import annotations

import os
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import trainer.loop.faulty_step as faulty_step
import trainer.loop.trainer as trainer_module
from tests.compose import compose_config
from tests.dist_helpers import collectives_stopped, run_on_ranks, still_in_step
from tests.observe_helpers import sampled, sent
from tests.sync_helpers import class_from_yaml
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
from trainer.scaling.memory import window
from trainer.setup.build import build_parts
from trainer.setup.precheck import check_overrides
from trainer.sync.describe import describe
from trainer.sync.grads import grad_norm
from trainer.sync.zero import ZeroSync

# As test_equivalence's COMMON, but hidden sizes whose 2399 parameters do not split evenly over 2
# ranks: the flat buffers carry one element of padding. 64 samples, 2 ranks x 8: 4 steps per
# epoch, so 6 steps cross an epoch boundary.
COMMON = [
    "logger=none",
    "model.hidden_sizes=[32,31]",
    *SIX_STEPS,
    "trainer.check_replicas_every_n_steps=2",  # the trainer's own replica check, after every step
]
NUMEL = 32 * 32 + 32 + 31 * 32 + 31 + 31 * 10 + 10
ZERO = ["sync=zero", "data.batch_size=8"]
ACCUM = ["sync=zero", "data.batch_size=4", "trainer.grad_accum_steps=2"]
# About 1 KiB per bucket: the parameters, last first, make 6 buckets (10 | 310 | 31 | 992 | 32 | 1024
# elements), several in flight at once; the 31-element bias pads its bucket by one.
TINY = "sync.bucket_cap_mb=0.001"
TINY_GRADS = [10, 310, 31, 992, 32, 1024]
TINY_BUCKETS = [10, 310, 32, 992, 32, 1024]  # padded to a multiple of 2
S1 = "sync.stage=1"
EVERY_STEP = "trainer.log_every_n_steps=1"  # every step sampled, the first included

CASES = {
    "sgd": [*ZERO, "optim=sgd"],
    "adamw": [*ZERO, "optim=adamw"],
    "sgd-accum": [*ACCUM, "optim=sgd"],
    "adamw-accum": [*ACCUM, "optim=adamw"],
    "tiny-sgd": [*ZERO, "optim=sgd", TINY],
    "tiny-adamw": [*ZERO, "optim=adamw", TINY],
    "tiny-adamw-accum": [*ACCUM, "optim=adamw", TINY],
    # Stage 2 with 1 and 2 buckets alive at once (the one filling and those being reduced).
    "tiny-k1-adamw": [*ZERO, "optim=adamw", TINY, "sync.num_buckets_staged=1", EVERY_STEP],
    "tiny-k2-sgd": [*ZERO, "optim=sgd", TINY, "sync.num_buckets_staged=2", EVERY_STEP],
    # Two optimizer groups: the weights' 3 buckets (310 | 992 | 1024), then the biases' one (10 + 31 +
    # 32 elements, padded to 74), whose gradients arrive among the weights'.
    "tiny-k2-matrices-adamw": [*ZERO, "optim=adamw", TINY, "optim.weight_decay_on=matrices", EVERY_STEP],
    "s1-sgd": [*ZERO, "optim=sgd", S1],
    "s1-adamw": [*ZERO, "optim=adamw", S1],
    "s1-adamw-accum": [*ACCUM, "optim=adamw", S1],
    "s1-tiny-sgd": [*ZERO, "optim=sgd", S1, TINY],
    "s1-tiny-adamw-accum": [*ACCUM, "optim=adamw", S1, TINY],
    "ddp-adamw": ["sync=ddp", "data.batch_size=8", "optim=adamw"],  # the state zero must shard and rebuild
    # Checkpoints at step 3 (and 6); then step 6 is deleted and a new trainer resumes from step 3.
    "resume": [*ZERO, "optim=adamw", "trainer.checkpoint_every_n_steps=3"],
    # An optimizer with no YAML of its own: the typed optim group replaced by a plain node.
    "lbfgs": [*ZERO, "~optim", "+optim._target_=torch.optim.LBFGS", "+optim._partial_=true", "+optim.lr=0.1"],
    "resume-tiny": [*ZERO, "optim=adamw", TINY, "trainer.checkpoint_every_n_steps=3"],
}
EQUIVALENT = [c for c in CASES if c.split("-")[0] in ("sgd", "adamw", "tiny", "s1")]


def _train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """A trainer's run; then its full optimizer state, as state_dicts() gives it (every rank calls it)."""
    trainer = build(rank, world_size, COMMON + overrides, run_dir)
    trainer.fit()
    assert trainer.step == 6
    _, optimizer_state = trainer.sync.checkpointing.state_dicts(trainer.model, trainer.optimizer)
    return {
        "params": params_of(trainer),
        "state_mb": optimizer_state_mb(trainer.optimizer),
        "optimizer": optimizer_state,
        "checkpoint": load_checkpoint(Path(run_dir) / "checkpoints" / "last.pt")["optimizer"],
        "describe": describe(trainer.sync),
        "row": trainer._rows.rows[-1],  # the last row: the run's last steps are sampled
        "comm_buffers_peaks": {  # per sampled step, the observer's memory/comm_buffers_peak_mb
            row["observer/sampled_step"]: row["memory/comm_buffers_peak_mb"]
            for row in trainer._rows.rows
            if "memory/comm_buffers_peak_mb" in row
        },
    }


def _resume(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """As if the run had died after its step-3 checkpoint: a new trainer in the same run dir resumes there."""
    first = _train(rank, world_size, overrides, run_dir)["params"]
    ckpt = Path(run_dir) / "checkpoints"
    # _train read last.pt on every rank: rank 0 must not unlink it while a slower rank still reads
    # it (that rank's case then failed alone, the ranks fell out of step, and the whole spawn
    # ended in its final barrier's timeout: make test's two workers made it likely).
    dist.barrier()
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
    return (_resume if Path(run_dir).name.startswith("resume") else _train)(rank, world_size, overrides, run_dir)


# (stage, bucket_cap_mb): one bucket of the toy's 23 parameters (padded to 24), or one per tensor,
# last layer first: 2 | 6 | 3 (padded to 4) | 12 elements.
MECHANISMS = {"s2": (2, 25.0), "s2-per-tensor": (2, 1e-6), "s1-per-tensor": (1, 1e-6)}


def _mechanism(rank: int, world_size: int, stage: int, cap_mb: float) -> dict[str, Any]:
    """The strategy alone on a toy model of 23 parameters: views, counts, checks, refusals."""
    torch.manual_seed(rank)  # each rank draws other weights: wrap() must replace them with rank 0's
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    sync = class_from_yaml(ZeroSync, "zero", stage=stage, bucket_cap_mb=cap_mb)
    sync.wrap(model)
    optimizer = sync.build_optimizer(model, partial(torch.optim.SGD, lr=0.1))
    flat = sync.flat
    assert flat is not None and sync._grads is not None
    in_buffer = all(p.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr() for p in model.parameters())
    launched: list[int] = []

    def backward(poison: bool = False, first_layer: bool = True) -> bool:
        torch.manual_seed(100 + rank)  # each rank its own data
        x, y = torch.randn(4, 4), torch.randint(0, 2, (4,))
        F.cross_entropy(model(x) if first_layer else model[2](x[:, :3]), y).backward()
        launched.append(len(sync._works))
        sync.after_backward(model)
        sync.comm.observer.mark("sync")  # on the sampled step: the gradients held now are the row's
        if poison:
            sync._grads.shard[0] = float("nan")  # type: ignore[union-attr]  # one rank's shard: both must answer False
        return bool(torch.isfinite(grad_norm(sync, optimizer)))  # the step's finite check: the agreed norm's

    with sampled(sync, model, optimizer) as counts:  # the observer watches this step (the loop: 1 in n)
        finite = backward()
        sync.optimizer_step(optimizer)
        sync.zero_grad(optimizer)
        in_flight = len(sync._gathers)  # the gathers: waited for by the next forward, or wait_for_parameters()
        with torch.no_grad():  # any forward (evaluation too) waits for the gathers first: its pre-hook
            model(torch.randn(2, 4))
        settled_by_forward = not sync._gathers  # (a step's row is taken once its gathers are in)
    memory = counts
    # Stage 2 drops every .grad; stage 1 zeroes its flat buffers' views and drops a lone tensor's.
    lone = {id(g[0]) for g, place in zip(sync._grads.groups, sync._grads.in_flat, strict=True) if place is None}
    zeroed = all(
        (p.grad is None) if stage == 2 or id(p) in lone else not p.grad.any()  # type: ignore[union-attr]
        for p in model.parameters()
    )
    nonfinite = backward(poison=rank == 1)
    sync.zero_grad(optimizer)
    # No rank's first layer gets a gradient (find_unused_parameters=false, after step 1's check): its
    # buckets wait for after_backward, which refuses on every rank alike, naming them (sending zeros
    # would step them where one process skips them; trainer/sync/unused.py).
    try:
        backward(first_layer=False)
        refused = ""
    except ConfigError as err:
        refused = str(err)
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
        class_from_yaml(ZeroSync, "zero").wrap(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))
    except ConfigError as err:
        refusals["mixed"] = str(err)
    return {
        "in_buffer": in_buffer,
        "finite": finite,
        "nonfinite": nonfinite,
        "zeroed": zeroed,
        "counts": counts,
        "memory": memory,
        "launched": launched,
        "in_flight": in_flight,
        "in_flat": sync._grads.in_flat,
        "settled_by_forward": settled_by_forward,
        "refused": refused,
        "refusals": refusals,
        "describe": describe(sync),
        "params": [p.detach().clone() for p in model.parameters()],
    }


def _settled(rank: int, world_size: int, run_dir: str) -> dict[str, Any]:
    """How many gathers were still in flight where the trainer reads the parameters outside a forward:
    at each replica check, at the step a perturb fault fires, after train() returns."""
    overrides = [*ZERO, "trainer.check_replicas_every_n_steps=2", "trainer.fault.kind=perturb"]
    trainer = build(rank, world_size, [*COMMON, *overrides, "trainer.fault.rank=1", "trainer.fault.at_step=4"], run_dir)
    sync = trainer.sync
    assert isinstance(sync, ZeroSync)
    seen: dict[str, list[int]] = {"replica_check": [], "fault": []}
    fault, fire = trainer.settings.fault, faulty_step.faults.maybe_fire

    def check(model: nn.Module, step: int) -> None:  # the replica check, recording instead (rank 1 drifts)
        seen["replica_check"].append(len(sync._gathers))

    def maybe_fire(fault_: Any, rank_: int, step: int, attempt: int, model: nn.Module) -> None:
        if fault.due(rank_, step, attempt):
            seen["fault"].append(len(sync._gathers))
        fire(fault_, rank_, step, attempt, model)

    original, trainer_module.check_replicas = trainer_module.check_replicas, check
    faulty_step.faults.maybe_fire = maybe_fire  # type: ignore[assignment]
    try:
        trainer.train(5)  # checks after steps 2 and 4; the fault and the end follow unchecked steps
    finally:
        trainer_module.check_replicas = original
        faulty_step.faults.maybe_fire = fire  # type: ignore[assignment]
    return {**seen, "after_train": len(sync._gathers)}


def _ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """Everything at 2 ranks in one spawn: the trainer's cases one after another, then the mechanism."""
    results = {"cases": train_each(rank, world_size, _case, CASES, root)}
    parts: dict[str, Callable[[], Any]] = {"settled": partial(_settled, rank, world_size, str(Path(root) / "settled"))}
    parts.update({name: partial(_mechanism, rank, world_size, *how) for name, how in MECHANISMS.items()})
    for name, part in parts.items():
        stopped = collectives_stopped()
        if stopped is not None:  # the ranks are out of step: any collective would pair wrongly
            results[name] = f"not run: {stopped}"
            continue
        raised = False
        try:
            results[name] = part()
        except Exception:  # reported by its own test
            results[name] = traceback.format_exc()
            raised = True
        still_in_step(name, raised, rank, world_size)
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
    refs["adamw-matrices"] = [*refs["adamw"], "optim.weight_decay_on=matrices"]
    (results,) = run_on_ranks(train_each, 1, root / "rank", _train, refs, str(root / "runs"))
    return {optim: case_results([results], optim)[0]["params"] for optim in refs}


@pytest.mark.parametrize("case", EQUIVALENT)
def test_two_ranks_equal_one_process_with_twice_the_batch(
    ranks: list[dict[str, Any]], single: dict[str, dict[str, torch.Tensor]], case: str
) -> None:
    rank0, rank1 = _cases(ranks, case)
    reference = single["adamw-matrices" if "matrices" in case else "adamw" if "adamw" in case else "sgd"]
    assert_same_model([rank0["params"], rank1["params"]], reference)
    assert max_abs_diff(rank0["params"], initial_params()) > 1e-3, "nothing was trained"
    info = rank0["describe"]
    assert info["strategy"] == "zero" and info["world_size"] == 2 and info["numel"] == NUMEL
    assert info["stage"] == (1 if case.startswith("s1") else 2)
    assert info["padded_numel"] == NUMEL + 1 and info["shard_numel"] == (NUMEL + 1) // 2
    grads = [310, 992, 1024, 10 + 31 + 32] if "matrices" in case else TINY_GRADS if "tiny" in case else [NUMEL]
    assert info["bucket_sizes_bytes"] == [4 * n for n in grads]


@pytest.mark.parametrize("case", ["adamw", "tiny-adamw", "s1-adamw", "s1-tiny-sgd"])
def test_gradient_memory_is_the_shard_under_stage_2(ranks: list[dict[str, Any]], case: str) -> None:
    """memory/gradients_mb, as the rows log it: stage 2 holds this rank's shard of the gradient after
    backward; stage 1 the full (padded) buckets and the shard. Stage 2's buckets, staged in backward
    and reduced, are communication buffers (memory/comm_buffers_peak_mb)."""
    shard, padded = 4 * (NUMEL + 1) // 2, 4 * (NUMEL + 1)
    for rank in _cases(ranks, case):
        held, peak = rank["row"]["memory/gradients_mb"] * 2**20, rank["row"]["memory/gradients_peak_mb"] * 2**20
        if case.startswith("s1"):
            assert held == peak == shard + padded
        else:  # backward's buckets are communication buffers (before the memory kinds were split: gradients)
            assert held == peak == shard
            largest = max(TINY_BUCKETS if "tiny" in case else [NUMEL + 1]) * 4
            buffers = rank["row"]["memory/comm_buffers_peak_mb"] * 2**20
            assert largest <= buffers <= padded  # at least one full bucket, at most all


@pytest.mark.parametrize(
    ("case", "k", "buckets", "out_of_turn"),
    [
        ("tiny-k1-adamw", 1, TINY_BUCKETS, 0),
        ("tiny-k2-sgd", 2, TINY_BUCKETS, 0),
        ("tiny-k2-matrices-adamw", 2, [310, 992, 1024], 74),
    ],
)
def test_stage_2_holds_at_most_its_staged_buckets_in_backward(
    ranks: list[dict[str, Any]], case: str, k: int, buckets: list[int], out_of_turn: int
) -> None:
    """Each bucket is freed once its reduction has landed in the shard, during backward, from step 1
    on: the observer's comm_buffers peak of every step is the most k consecutive buckets hold (the
    predictor's window), not the whole gradient (2400 elements); a second optimizer group's bucket,
    whose turn comes after the first group's, stays staged beside them."""
    held = window([4 * n for n in buckets], k) + 4 * out_of_turn
    for rank in _cases(ranks, case):
        peaks = rank["comm_buffers_peaks"]
        assert 1 in peaks and len(peaks) >= 4, peaks
        assert {step: mb * 2**20 for step, mb in peaks.items()} == dict.fromkeys(peaks, held)


def initial_params() -> dict[str, torch.Tensor]:
    """The weights every run starts from (same seed), built in this process without training."""
    cfg = compose_config(COMMON)
    return build_parts(cfg).model.state_dict()


def test_each_rank_holds_half_of_ddps_optimizer_state(ranks: list[dict[str, Any]]) -> None:
    zero, ddp = _cases(ranks, "adamw")[0]["state_mb"], _cases(ranks, "ddp-adamw")[0]["state_mb"]
    assert 0.45 <= zero / ddp <= 0.55, (zero, ddp)


@pytest.mark.parametrize("case", ["adamw", "tiny-adamw", "s1-adamw"])
def test_checkpoint_holds_the_full_optimizer_state_of_a_plain_optimizer(ranks: list[dict[str, Any]], case: str) -> None:
    zero0, zero1 = _cases(ranks, case)
    expected = _cases(ranks, "ddp-adamw")[0]["optimizer"]  # a plain AdamW over model.parameters()
    for full in (zero0["optimizer"], zero1["optimizer"], zero0["checkpoint"]):  # gathered on every rank; written
        assert full["param_groups"] == expected["param_groups"]
        assert full["state"].keys() == expected["state"].keys() == set(range(6))
        for index, state in expected["state"].items():
            assert full["state"][index].keys() == state.keys()
            for key, value in state.items():
                assert full["state"][index][key].shape == value.shape, (index, key)
                assert (full["state"][index][key] - value).abs().max() <= 1e-6, (index, key)


@pytest.mark.parametrize("case", ["resume", "resume-tiny"])
def test_resume_from_a_mid_run_checkpoint_is_bit_identical(ranks: list[dict[str, Any]], case: str) -> None:
    rank0, rank1 = _cases(ranks, case)
    assert rank0["resumed_at"] == rank1["resumed_at"] == 3
    straight = _cases(ranks, "tiny-adamw" if "tiny" in case else "adamw")[0]["params"]
    assert bit_identical(rank0["first"], straight)  # checkpointing changes nothing
    assert bit_identical(rank0["params"], straight) and bit_identical(rank1["params"], straight)


@pytest.mark.parametrize("mechanism", sorted(MECHANISMS))
def test_strategy_mechanism(ranks: list[dict[str, Any]], mechanism: str) -> None:
    results = [r[mechanism] for r in ranks]
    assert not any(isinstance(r, str) for r in results), "\n".join(map(str, results))
    rank0, rank1 = results
    assert all(torch.equal(a, b) for a, b in zip(rank0["params"], rank1["params"], strict=True))
    stage, cap_mb = MECHANISMS[mechanism]
    buckets = [24] if cap_mb > 1 else [2, 6, 4, 12]  # padded elements per bucket, in the order they are sent
    for rank in results:
        assert rank["in_buffer"] and rank["zeroed"]
        # The step's gathers are still in flight when optimizer_step returns: one entry per bucket.
        assert rank["in_flight"] == len(buckets) and rank["settled_by_forward"]
        # Stage 1: the unpadded one-tensor buckets (sizes 2, 6, 12) are reduced in autograd's
        # tensor, no flat buffer; the first layer's bias (3, padded to 4) is in one.
        assert rank["in_flat"] == ([None, None, 0, None] if stage == 1 else [None] * len(buckets))
        assert rank["finite"] is True and rank["nonfinite"] is False  # rank 1's NaN reached rank 0's answer
        info = rank["describe"]
        assert (info["numel"], info["padded_numel"], info["shard_numel"]) == (23, 24, 12)
        grads = [23] if cap_mb > 1 else [2, 6, 3, 12]  # bucket_sizes_bytes: gradient bytes, as bucketed's
        assert info["num_buckets"] == len(buckets) and info["bucket_sizes_bytes"] == [4 * n for n in grads]
        # One step: per bucket, its reduction (stage 1: all_reduce of the gradients; stage 2: of the
        # padded bucket, which gloo all_reduces where NCCL would reduce_scatter) and the padded bucket
        # gathered (on gloo one broadcast per rank of its half); gradient bytes once.
        # On the wire, 2 ranks (docs/metrics.md): an all_reduce sends its buffer, a broadcast half of it.
        row = rank["counts"]
        reduced = 23 * 4 if stage == 1 else 24 * 4
        assert sent(row) == {"all_reduce": [reduced, len(buckets)], "broadcast": [24 * 4 / 2, 2 * len(buckets)]}
        assert info["collectives"] == "all_reduce + broadcast"
        assert row["comm/bytes_per_step"] == reduced + 24 * 4 / 2
        assert row["comm/collectives_per_step"] == 3 * len(buckets)
        # Timed as bucketed's (time/comm_s, time/comm_exposed_s): every collective of the step, the
        # all_gathers after it included, was waited for by the training thread (the observer gives
        # a row only then; how long that wait was depends on the machine: a gather already back when
        # waited for exposes nothing).
        assert row["time/comm_s"] > 0 and 0 <= row["time/comm_exposed_s"] <= row["time/comm_s"]
        # Gradient memory after backward: the 12-element shard (stage 2), or it and the 24 of the buckets.
        assert rank["memory"]["memory/gradients_mb"] * 2**20 == 4 * (12 if stage == 2 else 12 + 24)
        assert "got no gradient on this rank" in rank["refused"] and "'0.weight'" in rank["refused"], rank["refused"]
        assert "sync.find_unused_parameters=true" in rank["refused"]
    # Stage 2 starts every bucket during backward from step 1 (taking one gradient per parameter);
    # stage 1 learns the hook counts first, so its step 1 starts them after backward. In step 3 no
    # first layer got a gradient: its buckets (the last two) wait for after_backward.
    for rank in (rank0, rank1):
        first = len(buckets) if stage == 2 else 0
        assert rank["launched"] == [first, len(buckets), len(buckets) - 2 if len(buckets) > 1 else 0]


def test_the_trainer_waits_for_the_gathers_before_it_reads_the_parameters(ranks: list[dict[str, Any]]) -> None:
    """The gathers fly from the optimizer step to the next forward; every other read settles first."""
    for rank, result in enumerate(ranks):
        seen = result["settled"]
        assert not isinstance(seen, str), seen
        assert seen["replica_check"] == [0, 0], seen  # none in flight at either check
        assert seen["fault"] == ([0] if rank == 1 else []), seen
        assert seen["after_train"] == 0, seen


def test_refusals_name_the_key_and_the_reason(ranks: list[dict[str, Any]]) -> None:
    through_config = [r["cases"]["lbfgs"] for r in ranks]  # the trainer's build raised: its traceback
    assert all(isinstance(e, str) and "ConfigError" in e for e in through_config), through_config
    for error in through_config + [r["s2"]["refusals"]["lbfgs"] for r in ranks]:
        assert "optim._target_=torch.optim.LBFGS is invalid with sync=zero" in error
        assert "element-wise" in error and "torch.optim.AdamW" in error
    refusals = ranks[0]["s2"]["refusals"]
    assert "2 param groups" in refusals["groups"]
    assert "torch.float32" in refusals["mixed"] and "torch.float64" in refusals["mixed"]


def test_stage_0_is_refused_pointing_to_the_strategy_it_is() -> None:
    # The schema refuses it, before any rank starts (the command-line check train.py runs). Stage 3
    # is tests/test_zero3.py's.
    with pytest.raises(ConfigError) as refused:
        check_overrides([*ZERO, "sync.stage=0"])
    error = str(refused.value)
    assert "sync.stage=0 is invalid" in error and "accepted: 1" in error
    assert "sync=ddp" in error
    check_overrides([*ZERO, "sync.stage=3"])
