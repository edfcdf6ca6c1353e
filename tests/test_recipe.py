"""The GPT recipe under every strategy: 2 ranks x B train what 1 process x 2B trains with the global
gradient norm clipped (the clip active: the norm is above the limit at every step), weight decay on
matrices only and every block recomputed in backward, all at once; train/grad_norm in every row equal
to one process's; fp16's scale the same on every rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_on_ranks
from tests.train_helpers import assert_same_model, build, case_results, max_abs_diff, params_of, train_each

MAX_NORM = 0.05  # below the tiny gpt's gradient norm at every step (asserted): the clip always acts
COMMON = ["logger=none", "trainer.progress_bar=false", "trainer.eval_every_n_steps=0"]
COMMON += ["trainer.max_steps=4", "trainer.log_every_n_steps=1", "model.activation_checkpointing=true"]
DECAY = ["optim=adamw", "optim.lr=0.01", "optim.weight_decay=0.1", "optim.weight_decay_on=matrices"]
CLIP = [f"trainer.max_grad_norm={MAX_NORM}"]

CASES = {
    "manual": ["sync=manual"],
    "manual-rs_ag": ["sync=manual", "sync.collective=rs_ag"],
    "bucketed": ["sync=bucketed", "sync.bucket_cap_mb=0.002"],
    "ddp": ["sync=ddp", "sync.bucket_cap_mb=0.002"],
    "ddp-hook": ["sync=ddp", "sync.time_buckets=true"],
    "zero-stage-1": ["sync=zero", "sync.stage=1", "sync.bucket_cap_mb=0.002"],
    "zero": ["sync=zero", "sync.bucket_cap_mb=0.002"],
    "zero-stage-3": ["sync=zero", "sync.stage=3"],  # the blocks' units gathered and recomputed in backward
    "fsdp": ["sync=fsdp"],
}


FP16 = ["trainer.precision=fp16", "trainer.max_steps=8"]
FP16_SYNCS = {
    "ddp": ["sync=ddp"],
    "zero": ["sync=zero"],
    "zero-stage-3": ["sync=zero", "sync.stage=3"],
    "fsdp": ["sync=fsdp"],
}
HUGE_SCALE = 2.0**22  # the first steps overflow for certain: the scaler must back off alike on every rank


def train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    trainer = build(rank, world_size, [*COMMON, *overrides], run_dir)
    scaler = trainer.runner.scaler
    if scaler is not None and not Path(run_dir).name.startswith("fp16-plain"):
        # the same kind of scaler the trainer chose, started where it must overflow
        trainer.runner.scaler = type(scaler)(device="cpu", init_scale=HUGE_SCALE)
    trainer.fit()
    # a collective when sharded
    _, optimizer_state = trainer.sync.checkpointing.state_dicts(trainer.model, trainer.optimizer)
    saved = torch.load(Path(run_dir) / "checkpoints" / "last.pt", weights_only=False) if scaler else {}
    # trainer.resume=auto: a new trainer in the same run dir starts from the checkpoint's scale.
    resumed = build(rank, world_size, [*COMMON, *overrides], run_dir).runner.scaler if scaler else None
    return {
        "params": params_of(trainer),
        "norms": [row.get("train/grad_norm") for row in trainer._rows.rows],
        "scales": [row.get("train/grad_scale") for row in trainer._rows.rows],
        "overflows": [row.get("train/overflow_steps") for row in trainer._rows.rows],
        "saved_scale": saved.get("grad_scaler", {}).get("scale"),
        "resumed_scale": resumed.get_scale() if resumed is not None else None,
        "optimizer": optimizer_state,
    }


def all_cases(rank: int, world_size: int, gpt: list[str], root: str) -> dict[str, Any]:
    cases = {name: [*gpt, "data.batch_size=8", *DECAY, *CLIP, *o] for name, o in CASES.items()}
    # Without a clip the norm is still logged; sharded, it still needs the ranks' reduction.
    cases["zero-unclipped"] = [*gpt, "data.batch_size=8", *DECAY, "sync=zero"]
    for name, sync in FP16_SYNCS.items():  # replicated gradients, and sharded ones whose overflow the ranks agree on
        cases[f"fp16-{name}"] = [*gpt, "data.batch_size=8", *DECAY, *CLIP, *FP16, *sync]
    # fp16 at its default scale against fp32: the logged norm (and so the clip) is the unscaled gradient's
    cases["fp16-plain-ddp"] = [*gpt, "data.batch_size=8", *DECAY, *CLIP, *FP16, "sync=ddp"]
    cases["fp32-ddp"] = [*gpt, "data.batch_size=8", *DECAY, *CLIP, "trainer.max_steps=8", "sync=ddp"]
    return train_each(rank, world_size, train, cases, f"{root}/runs")


def single_cases(rank: int, world_size: int, gpt: list[str], root: str) -> dict[str, Any]:
    one = [*gpt, "sync=none", "data.batch_size=16", *DECAY]
    return train_each(rank, world_size, train, {"clipped": [*one, *CLIP], "unclipped": one}, f"{root}/runs")


@pytest.fixture(scope="module")
def single(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("single")
    (results,) = run_on_ranks(single_cases, 1, root / "rank", corpus, str(root))
    return results


@pytest.fixture(scope="module")
def pairs(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("pairs")
    return run_on_ranks(all_cases, 2, root / "ranks", corpus, str(root), timeout_s=900)


def same_norms(ours: list[float | None], theirs: list[float | None]) -> bool:
    mine, other = [float(n) for n in ours if n is not None], [float(n) for n in theirs if n is not None]
    assert len(mine) == len(ours) and len(other) == len(theirs), "every row reports train/grad_norm"
    return len(mine) == len(other) and all(abs(a - b) <= 1e-5 * b for a, b in zip(mine, other, strict=True))


@pytest.mark.parametrize("case", CASES)
def test_two_ranks_equal_one_process_with_the_clip_active_and_decay_on_matrices(
    pairs: list[dict[str, Any]], single: dict[str, Any], case: str
) -> None:
    rank0, rank1 = case_results(pairs, case)
    assert_same_model([rank0["params"], rank1["params"]], single["clipped"]["params"])
    # The norm before clipping, of the averaged gradient: one process's, on every rank.
    assert same_norms(rank0["norms"], single["clipped"]["norms"]) and same_norms(rank1["norms"], rank0["norms"])
    assert min(rank0["norms"]) > MAX_NORM, "the clip must act at every step for this test to mean anything"


def test_the_clip_changes_what_is_trained(single: dict[str, Any]) -> None:
    assert max_abs_diff(single["clipped"]["params"], single["unclipped"]["params"]) > 1e-4


def test_an_unclipped_run_still_logs_the_global_norm(pairs: list[dict[str, Any]], single: dict[str, Any]) -> None:
    for rank in case_results(pairs, "zero-unclipped"):
        assert same_norms(rank["norms"], single["unclipped"]["norms"])
        assert_same_model([rank["params"]], single["unclipped"]["params"])


def test_matrices_decay_and_the_rest_does_not(single: dict[str, Any]) -> None:
    groups = single["clipped"]["optimizer"]["param_groups"]
    assert [group["weight_decay"] for group in groups] == [0.1, 0.0]
    decayed, kept = ({int(i) for i in group["params"]} for group in groups)
    assert decayed and kept and not decayed & kept


@pytest.mark.parametrize("case", ["zero", "zero-stage-1", "zero-stage-3", "fsdp"])
def test_a_sharded_checkpoint_holds_what_a_replicated_one_does(pairs: list[dict[str, Any]], case: str) -> None:
    """zero's pieces of the shard (one per group) map back to the full state, groups and all, as ddp's."""
    ours, theirs = case_results(pairs, case)[0]["optimizer"], case_results(pairs, "ddp")[0]["optimizer"]
    strip = [{k: v for k, v in g.items() if k != "params"} for g in ours["param_groups"]]
    assert strip == [{k: v for k, v in g.items() if k != "params"} for g in theirs["param_groups"]]
    if case.startswith("zero"):  # fsdp's optimizer state is keyed by its own parameter order
        assert [g["params"] for g in ours["param_groups"]] == [g["params"] for g in theirs["param_groups"]]
        assert ours["state"].keys() == theirs["state"].keys()
        for index, state in theirs["state"].items():
            for key, value in state.items():
                mine = ours["state"][index][key]
                assert torch.allclose(mine, value, atol=1e-5), f"{case}: state {index}.{key}"


@pytest.mark.parametrize("sync", FP16_SYNCS)
def test_fp16_scales_back_alike_on_every_rank_and_keeps_the_scale(pairs: list[dict[str, Any]], sync: str) -> None:
    rank0, rank1 = case_results(pairs, f"fp16-{sync}")
    assert rank0["scales"] == rank1["scales"] and rank0["overflows"] == rank1["overflows"]
    assert rank0["overflows"][0] == 1 and rank0["scales"][0] == HUGE_SCALE / 2, "an overflow halves the scale"
    assert rank0["overflows"][-1] < len(rank0["overflows"]), "the scale came down far enough to train"
    assert rank0["saved_scale"] == rank0["scales"][-1], "the checkpoint holds the scale in use"
    assert rank0["resumed_scale"] == rank1["resumed_scale"] == rank0["saved_scale"] != 65536.0, "resume restores it"
    assert max_abs_diff(rank0["params"], rank1["params"]) == 0.0, "every rank stepped alike"
    assert all(torch.isfinite(t).all() for t in rank0["params"].values())
    assert all(n is None or n > 0 for n in rank0["norms"])  # an overflowed step logs no norm


def test_fp16_logs_and_clips_the_norm_of_the_unscaled_gradient(pairs: list[dict[str, Any]]) -> None:
    """What fp16 clips by is the gradient's norm after the scaler divides it out: an fp32 run's, to
    fp16's rounding (measured within 0.1 %), not the loss scale (65,536) times it."""
    fp16, fp32 = case_results(pairs, "fp16-plain-ddp")[0], case_results(pairs, "fp32-ddp")[0]
    compared = [(a, b) for a, b in zip(fp16["norms"], fp32["norms"], strict=True) if a is not None]
    assert len(compared) >= 6, fp16["norms"]  # at most the first steps overflow at the default scale
    assert all(abs(a - b) <= 0.02 * b for a, b in compared), compared
    assert min(b for _, b in compared) > MAX_NORM, "the clip acts at every compared step"
