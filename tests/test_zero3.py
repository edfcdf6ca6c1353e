"""sync=zero sync.stage=3 (trainer/sync/zero3.py) on real gloo ranks: the MLP trains what one process
trains (sgd, adamw, accumulation, prefetch 0 and 2, parameters kept after forward), the ranks'
gathered parameters are bit-identical, each rank holds ZeRO-3's share of memory (from step 1 on:
each unit's gradients are reduced as its backward ends, during backward), the collectives counted
are the ones its units need, resume is bit-identical from both checkpoint formats, and what it
cannot run is refused. The GPT recipe and its tied head (test_recipe.py, test_gpt_equivalence.py),
resume at another world size (test_world_change.py), unused and reused layers (test_edges.py) and
the timeline (test_timeline.py) run it beside the other strategies."""

from __future__ import annotations

import os
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from models.mlp import MLP
from tests.compose import compose_config
from tests.dist_helpers import run_on_ranks
from tests.sync_helpers import class_from_yaml
from tests.test_zero import COMMON, NUMEL, initial_params
from tests.text_helpers import tiny_gpt, write_corpus
from tests.train_helpers import (
    assert_same_model,
    bit_identical,
    build,
    case_results,
    max_abs_diff,
    params_of,
    train_each,
)
from trainer.errors import ConfigError
from trainer.setup.build import build_parts, check_device
from trainer.sync.comm import Comm
from trainer.sync.describe import describe
from trainer.sync.zero3 import Zero3Sync

S3 = ["sync=zero", "sync.stage=3", "data.batch_size=8"]
ACCUM = ["sync=zero", "sync.stage=3", "data.batch_size=4", "trainer.grad_accum_steps=2"]
CASES = {
    "sgd": [*S3, "optim=sgd"],
    "adamw": [*S3, "optim=adamw"],
    "adamw-accum": [*ACCUM, "optim=adamw"],
    "adamw-no-prefetch": [*S3, "optim=adamw", "sync.prefetch=0"],
    "adamw-prefetch-2": [*S3, "optim=adamw", "sync.prefetch=2"],
    "adamw-kept": [*S3, "optim=adamw", "sync.reshard_after_forward=false"],
    # Checkpoints at step 3 (and 6); then step 6 is deleted and a new trainer resumes from step 3.
    "resume": [*S3, "optim=adamw", "trainer.checkpoint_every_n_steps=3"],
    "resume-sharded": [*S3, "optim=adamw", "trainer.checkpoint_every_n_steps=3", "trainer.checkpoint_format=sharded"],
    "ddp": ["sync=ddp", "data.batch_size=8", "optim=adamw"],  # the memory and bytes stage 3 shards
}
# The MLP's units (wrap=auto: no ModuleList, so each Linear is one; the root holds nothing): their
# parameters' elements, each bucket padded to a multiple of 2.
UNITS = [32 * 32 + 32, 32 * 31 + 31 + 1, 31 * 10 + 10]
SHARD_BYTES = 4 * sum(UNITS) // 2
# Five units (32 -> 64 -> 64 -> 64 -> 64 -> 10), every step sampled: step 1's gradient memory.
DEEP = [*S3, "optim=adamw", "sync.wrap=module", "model.hidden_sizes=[64,64,64,64]", "trainer.log_every_n_steps=1"]


def _common(overrides: list[str]) -> list[str]:
    """test_zero's run, less its MLP's and its data's keys where the case trains the GPT."""
    return [o for o in COMMON if "model=gpt" not in overrides or not o.startswith(("model.", "data."))] + overrides


def _train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    trainer = build(rank, world_size, _common(overrides), run_dir)
    trainer.fit()
    _, optimizer_state = trainer.sync.checkpointing.state_dicts(trainer.model, trainer.optimizer)
    return {
        "params": params_of(trainer),
        "rows": [row for row in trainer._rows.rows if "train/loss" in row],
        "describe": describe(trainer.sync),
        "optimizer": optimizer_state,
    }


def _cut_back_to_step_3(run_dir: Path) -> None:
    """As if the run had died after its step-3 checkpoint (either format)."""
    ckpt = run_dir / "checkpoints"
    if (ckpt / "step-3.pt").exists():
        for name in ("step-6.pt", "last.pt"):
            (ckpt / name).unlink()
        os.link(ckpt / "step-3.pt", ckpt / "last.pt")
        return
    shutil.rmtree(ckpt / "step-6")
    (ckpt / "last").unlink()
    os.symlink("step-3", ckpt / "last")


def _case(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    first = _train(rank, world_size, overrides, run_dir)
    if not Path(run_dir).name.startswith("resume"):
        return first
    dist.barrier()  # every rank has read what it needs before rank 0 edits the checkpoints
    if rank == 0:
        _cut_back_to_step_3(Path(run_dir))
    dist.barrier()
    trainer = build(rank, world_size, _common(overrides), run_dir)  # trainer.resume=auto, the default
    resumed_at = trainer.step
    trainer.fit()
    return {**first, "resumed_at": resumed_at, "resumed": params_of(trainer)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("zero3")
    # The tied-head GPT (its embedding and head one parameter under two names, in the root unit),
    # resumed from a sharded checkpoint: each name written and read as this rank's range.
    gpt = tiny_gpt(write_corpus(root / "corpus.txt", 1150), root / "tokens")
    cases = {
        **CASES,
        "resume-gpt-sharded": [*gpt, *CASES["resume-sharded"], "model.activation_checkpointing=true"],
        "deep": [*DEEP, "trainer.max_steps=2"],
        "deep-unused": [*DEEP, "trainer.max_steps=2", "sync.find_unused_parameters=true"],
    }
    return run_on_ranks(train_each, 2, root / "ranks", _case, cases, str(root / "runs"), timeout_s=600)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, torch.Tensor]]:
    """One process on the doubled batch, per optimizer: the references."""
    root = tmp_path_factory.mktemp("single")
    refs = {optim: ["sync=none", "data.batch_size=16", f"optim={optim}"] for optim in ("sgd", "adamw")}
    (results,) = run_on_ranks(train_each, 1, root / "rank", _train, refs, str(root / "runs"))
    return {optim: case_results([results], optim)[0]["params"] for optim in refs}


EQUIVALENT = [c for c in CASES if c != "ddp"]


@pytest.mark.parametrize("case", EQUIVALENT)
def test_two_ranks_equal_one_process_with_twice_the_batch(
    ranks: list[dict[str, Any]], single: dict[str, dict[str, torch.Tensor]], case: str
) -> None:
    """Every rank's gathered parameters the same bits, within 1e-5 of one process."""
    rank0, rank1 = case_results(ranks, case)
    optim = "adamw" if "optim=adamw" in CASES[case] else "sgd"
    assert_same_model([rank0["params"], rank1["params"]], single[optim])
    assert max_abs_diff(rank0["params"], initial_params()) > 1e-3, "nothing was trained"
    info = rank0["describe"]
    assert info["strategy"] == "zero" and info["stage"] == 3 and info["num_units"] == len(UNITS) + 1  # and the root
    assert info["unit_bytes"] == [4 * n for n in UNITS] + [0] and info["shard_numel"] == sum(UNITS) // 2


@pytest.mark.parametrize("case", ["resume", "resume-sharded", "resume-gpt-sharded"])
def test_resume_from_a_mid_run_checkpoint_is_bit_identical(ranks: list[dict[str, Any]], case: str) -> None:
    for rank in case_results(ranks, case):
        assert rank["resumed_at"] == 3
        assert bit_identical(rank["resumed"], rank["params"])


def test_each_rank_holds_half_of_the_parameters_gradients_and_optimizer_state(ranks: list[dict[str, Any]]) -> None:
    """The rows' memory keys: the shards between steps, the units gathered at most on top."""
    for z3, ddp in zip(case_results(ranks, "adamw"), case_results(ranks, "ddp"), strict=True):
        for row, plain in zip(z3["rows"], ddp["rows"], strict=True):
            assert row["memory/parameters_mb"] * 2**20 == SHARD_BYTES == row["memory/gradients_mb"] * 2**20
            assert plain["memory/parameters_mb"] * 2**20 == 4 * NUMEL  # ddp: every parameter on every rank
            assert 0.45 <= row["memory/optimizer_state_mb"] / plain["memory/optimizer_state_mb"] <= 0.55


@pytest.mark.parametrize(
    ("case", "units"), [("adamw-no-prefetch", 1), ("adamw", 2), ("adamw-prefetch-2", 3), ("adamw-kept", 3)]
)
def test_gathered_parameters_are_the_units_in_use(ranks: list[dict[str, Any]], case: str, units: int) -> None:
    """Peak memory of the gathered units (communication buffers since the memory kinds were split;
    before, parameter memory): the unit computing, and with prefetch n the n gathered ahead of it
    (here at most all 3). Kept after forward, every unit until its backward."""
    largest = sorted((4 * n for n in UNITS), reverse=True)
    for rank in case_results(ranks, case):
        for row in rank["rows"]:
            # The parameters are the shard; the gathered units are communication buffers (docs/metrics.md),
            # with a unit's bucket while it is reduced (from step 1 on: each unit as its backward ends).
            assert row["memory/parameters_peak_mb"] * 2**20 == SHARD_BYTES, case
            gathered = sum(largest[:units])
            buffers = row["memory/comm_buffers_peak_mb"] * 2**20
            assert gathered <= buffers <= gathered + largest[0], (case, buffers)
            # gradients: a unit's full ones until reduced, in the first row (step 1's) as in the others
            grads = row["memory/gradients_peak_mb"] * 2**20 - SHARD_BYTES
            assert largest[-1] <= grads <= largest[0], (case, grads)


@pytest.mark.parametrize("case", ["deep", "deep-unused"])
def test_step_1_holds_one_units_gradients_not_every_units(ranks: list[dict[str, Any]], case: str) -> None:
    """Each unit's gradients are reduced and dropped as its backward ends, from the first step on (and
    with find_unused_parameters): step 1's gradient peak is the shard and one 64 x 64 layer's full
    gradients, under a third of the whole gradient, as in step 2."""
    for rank in case_results(ranks, case):
        info = rank["describe"]
        assert info["num_units"] == 6  # five Linear layers and the (empty) root
        whole, shard = sum(info["unit_bytes"]), 4 * info["shard_numel"]
        assert [row["observer/sampled_step"] for row in rank["rows"]] == [1, 2]
        for row in rank["rows"]:
            grads = row["memory/gradients_peak_mb"] * 2**20 - shard
            assert grads == 4 * (64 * 64 + 64) < whole / 3, (case, row["observer/sampled_step"], grads, whole)


class _Phases(Comm):
    """The communication object, noting the phase of the step in which each gradient reduction starts
    (on gloo an all_reduce; control collectives are launched apart, by agree())."""

    def __init__(self) -> None:
        super().__init__()
        self.phase = "forward"
        self.reductions: list[str] = []

    def all_reduce(self, tensor: torch.Tensor, bucket: int | str | None = None, group: Any = None) -> dist.Work:
        self.reductions.append(self.phase)
        return super().all_reduce(tensor, bucket, group)


def _reduction_phases(rank: int, world_size: int) -> dict[str, list[list[str]]]:
    """Two steps by hand of a four-unit mlp (wrap=module): per setting, per step, the phase in which
    each unit's reduction started."""
    phases = {}
    settings: dict[str, dict[str, Any]] = {
        "default": {},
        "no-prefetch": {"prefetch": 0},
        "find-unused": {"find_unused_parameters": True},
    }
    for name, keys in settings.items():
        torch.manual_seed(0)
        model = MLP([16, 16, 16], (8,), 4)
        sync = class_from_yaml(Zero3Sync, "zero", wrap="module", **keys)
        sync.comm = comm = _Phases()
        sync.wrap(model)
        optimizer = sync.build_optimizer(model, partial(torch.optim.SGD, lr=0.1))
        steps = []
        for step in range(2):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(10 * step + rank))
            comm.phase = "forward"
            loss = model(x).square().mean()
            comm.phase = "backward"
            loss.backward()
            comm.phase = "after_backward"
            sync.after_backward(model)
            sync.optimizer_step(optimizer)
            steps.append(comm.reductions)
            comm.reductions = []
        phases[name] = steps
    return phases


def test_units_are_reduced_during_backward_from_step_1(tmp_path: Path) -> None:
    """Step 1 too (it learns backward's order in its forward): each unit's reduction starts during
    backward, as that unit's backward ends; none is left for after_backward (the root holds nothing)."""
    for rank in run_on_ranks(_reduction_phases, 2, tmp_path / "ranks", timeout_s=300):
        for name, steps in rank.items():
            assert steps == [["backward"] * 4] * 2, (name, steps)


def test_counted_collectives_are_each_units_gathers_and_reduction(ranks: list[dict[str, Any]]) -> None:
    """Per step on gloo: each unit gathered in forward and again in backward (one broadcast per rank
    of its slice), its gradients all_reduced once; kept after forward, gathered once."""
    padded = 4 * sum(UNITS)
    for case, gathers in (("adamw", 2), ("adamw-kept", 1)):
        for rank in case_results(ranks, case):
            for row in rank["rows"][1:]:  # the first row's step is step 1, with its agreements (control)
                assert row["comm/broadcast_per_step"] == gathers * 2 * len(UNITS)
                # On the wire (docs/metrics.md), 2 ranks: a broadcast sends half its buffer, an all_reduce all of it.
                assert row["comm/broadcast_bytes_per_step"] == gathers * padded / 2
                # The sampled step's gradient norm (sharded: its squares summed) is a control collective.
                assert row["comm/all_reduce_per_step"] == len(UNITS) and row["comm/control_collectives_per_step"] == 1
                assert row["comm/bytes_per_step"] == padded + gathers * padded / 2


def test_refusals_name_the_key_and_the_accepted_values() -> None:
    for extra, key in (("trainer.compile=true", "trainer.compile=true"), ("trainer.fault.kind=perturb", "perturb")):
        parts = build_parts(compose_config([*COMMON, *S3, extra]))
        with pytest.raises(ConfigError) as refused:
            check_device(parts, torch.device("cpu"))
        assert key in str(refused.value) and "sync.stage=3" in str(refused.value) and "accepted" in str(refused.value)
