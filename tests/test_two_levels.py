"""Two levels on a 2-D mesh (sync=hierarchical, sync=hsdp): 4 ranks as 2 nodes of 2 train what one
process trains on the 4x batch, with sgd, adamw and the GPT recipe; replicas bit-identical; hsdp's
checkpoints of both formats resume on another world size; on the emulated two-tier link only
1/shard of the flat ring's bytes cross between nodes (worked out by hand), and on one emulated node
none; the sync line's mesh resolved. Three spawns: 1 rank, 4 ranks, 2 ranks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.dist_helpers import run_on_ranks
from tests.test_world_change import CUT, cut_back_to_step_4
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
from trainer.setup.precheck import check_overrides
from trainer.sync.describe import describe

pytestmark = pytest.mark.slow

# Every row's step sampled (no budget), so that every row carries the norm the tests compare.
EVERY_ROW = ["trainer.sample_budget=null"]
MLP = ["logger=none", "model.hidden_sizes=[32,32]", *SIX_STEPS, *EVERY_ROW]
QUIET = ["logger=none", "model.hidden_sizes=[32,32]", "data.num_val_samples=16", "trainer.eval_every_n_steps=0"]
QUIET += ["trainer.progress_bar=false"]
TWO_BY_TWO = ["sync.shard=2", "data.batch_size=4"]  # 4 ranks: 2 nodes of 2, a quarter of the batch each
ADAMW = ["optim=adamw", "optim.lr=0.01"]
RECIPE = ["logger=none", "trainer.progress_bar=false", "trainer.eval_every_n_steps=0", "trainer.max_steps=4"]
RECIPE += ["trainer.log_every_n_steps=1", "model.activation_checkpointing=true", "trainer.max_grad_norm=0.05"]
RECIPE += ["optim=adamw", "optim.lr=0.01", "optim.weight_decay=0.1", "optim.weight_decay_on=matrices"]
RECIPE += EVERY_ROW
STRATEGIES = ("hierarchical", "hsdp")
EMULATED = [*QUIET, "data.num_samples=64", "network=1gbe", "trainer.max_steps=4", "trainer.log_every_n_steps=4"]
LINK = [*EMULATED, "network.gpus_per_node=2"]  # 2 emulated nodes of 2
ONE_NODE = [*EMULATED, "network.gpus_per_node=4"]  # 1 emulated node of 4
RESUMABLE = [*QUIET, "data.num_samples=512", "trainer.log_every_n_steps=2", *CUT]  # 12 steps of global batch 64
SHARDED = ["trainer.checkpoint_format=sharded"]
FP16 = ["trainer.precision=fp16", "trainer.log_every_n_steps=1"]
HUGE_SCALE = 2.0**30  # the first steps overflow for certain


def train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    trainer = build(rank, world_size, overrides, run_dir)
    trainer.fit()
    rows = [row for row in trainer._rows.rows if "comm/bytes_per_step" in row]
    norms = [row.get("train/grad_norm") for row in trainer._rows.rows]
    return {"params": params_of(trainer), "rows": rows, "norms": norms, "sync": describe(trainer.sync)}


def train_fp16(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """fp16 from a loss scale that must overflow at first: every rank must back off alike."""
    trainer = build(rank, world_size, overrides, run_dir)
    scaler = trainer.runner.scaler
    assert scaler is not None
    trainer.runner.scaler = type(scaler)(device="cpu", init_scale=HUGE_SCALE)
    trainer.fit()
    rows = trainer._rows.rows
    return {"params": params_of(trainer), "scales": [r.get("train/grad_scale") for r in rows]}


def single_cases(rank: int, world_size: int, gpt: list[str], root: str) -> dict[str, Any]:
    cases = {
        "sgd": [*MLP, "sync=none", "data.batch_size=16"],
        "adamw": [*MLP, "sync=none", "data.batch_size=16", *ADAMW],
        "recipe": [*gpt, *RECIPE, "sync=none", "data.batch_size=16"],
    }
    return train_each(rank, world_size, train, cases, f"{root}/runs")


def resumable(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    """12 steps with checkpoints, cut back to step 4, as if the job had died there."""
    result = train(rank, world_size, [*RESUMABLE, *overrides], run_dir)
    torch.distributed.barrier()
    cut_back_to_step_4(rank, Path(run_dir))
    torch.distributed.barrier()
    return result


def four_ranks(rank: int, world_size: int, gpt: list[str], root: str) -> dict[str, Any]:
    cases: dict[str, list[str]] = {}
    for sync in STRATEGIES:
        cases[f"{sync}-sgd"] = [*MLP, f"sync={sync}", *TWO_BY_TWO]
        cases[f"{sync}-adamw"] = [*MLP, f"sync={sync}", *TWO_BY_TWO, *ADAMW]
        cases[f"{sync}-recipe"] = [*gpt, *RECIPE, f"sync={sync}", *TWO_BY_TWO]
    cases["hierarchical-small-buckets"] = [*MLP, "sync=hierarchical", "sync.bucket_cap_mb=0.001", *TWO_BY_TWO]
    for sync in ("ddp", "fsdp", *STRATEGIES):  # the emulated two-tier link: 2 nodes of 2
        cases[f"link-{sync}"] = [*LINK, f"sync={sync}", "data.batch_size=4"]
    for sync in STRATEGIES:  # one emulated node of 4: sync.shard follows it, one level
        cases[f"one-node-{sync}"] = [*ONE_NODE, f"sync={sync}", "data.batch_size=4"]
    results = train_each(rank, world_size, train, cases, f"{root}/runs")
    fp16 = {f"{sync}-fp16": [*MLP, f"sync={sync}", *TWO_BY_TWO, *FP16] for sync in STRATEGIES}
    results |= train_each(rank, world_size, train_fp16, fp16, f"{root}/fp16")
    resumed = {
        "hsdp-full": ["sync=hsdp", "sync.shard=2", "data.batch_size=16"],
        "hsdp-sharded": ["sync=hsdp", "sync.shard=2", "data.batch_size=16", *SHARDED],
    }
    results |= train_each(rank, world_size, resumable, resumed, f"{root}/resumed")
    return results


def two_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    """hsdp's checkpoints from 2x2 ranks, continued on 1 node of 2 (the same global batch)."""
    cases = {
        "hsdp-full": [*RESUMABLE, "sync=hsdp", "sync.shard=2", "data.batch_size=32"],
        "hsdp-sharded": [*RESUMABLE, "sync=hsdp", "sync.shard=2", "data.batch_size=32", *SHARDED],
    }
    return {name: train(rank, world_size, o, f"{root}/{name}") for name, o in cases.items()}


@pytest.fixture(scope="module")
def single(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("single")
    (results,) = run_on_ranks(single_cases, 1, root / "rank", corpus, str(root))
    return results


@pytest.fixture(scope="module")
def four(corpus: list[str], tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    root = tmp_path_factory.mktemp("four")
    return run_on_ranks(four_ranks, 4, root / "ranks", corpus, str(root), timeout_s=900), root


@pytest.mark.parametrize("sync", STRATEGIES)
@pytest.mark.parametrize("optim", ["sgd", "adamw", "recipe"])
def test_four_ranks_as_two_nodes_equal_one_process_with_four_times_the_batch(
    four: tuple[list[dict[str, Any]], Path], single: dict[str, Any], sync: str, optim: str
) -> None:
    ranks = case_results(four[0], f"{sync}-{optim}")
    assert_same_model([r["params"] for r in ranks], single[optim]["params"])  # bit-identical replicas, <= 1e-5
    # The logged norm of the averaged gradient is one process's on every rank (hsdp's shards are
    # held once per node: its world's sum of squares counts each twice). sgd and adamw log it
    # from the sampled step alone (its agreement waited for by the row), the recipe clips with it.
    theirs = single[optim]["norms"]
    assert theirs and all(n is not None for n in theirs)
    for rank in ranks:
        assert len(rank["norms"]) == len(theirs)
        assert all(abs(a - b) <= 1e-5 * b for a, b in zip(rank["norms"], theirs, strict=True)), (rank["norms"], theirs)


def test_several_buckets_pipelined_across_the_two_levels(
    four: tuple[list[dict[str, Any]], Path], single: dict[str, Any]
) -> None:
    ranks = case_results(four[0], "hierarchical-small-buckets")
    assert_same_model([r["params"] for r in ranks], single["sgd"]["params"])


@pytest.mark.parametrize("sync", STRATEGIES)
def test_fp16_backs_off_alike_on_every_rank(four: tuple[list[dict[str, Any]], Path], sync: str) -> None:
    """An overflow in some rank's gradient skips the step on all 4 (hsdp's shards agree through one
    small all_reduce), the scale halves alike, and the replicas stay bit-identical."""
    ranks = case_results(four[0], f"{sync}-fp16")
    assert all(r["scales"] == ranks[0]["scales"] for r in ranks), [r["scales"] for r in ranks]
    assert ranks[0]["scales"][0] == HUGE_SCALE / 2 and ranks[0]["scales"][-1] < HUGE_SCALE / 2
    assert all(bit_identical(r["params"], ranks[0]["params"]) for r in ranks)
    assert all(torch.isfinite(t).all() for t in ranks[0]["params"].values())


def inter_node_bytes(four: tuple[list[dict[str, Any]], Path], case: str) -> list[float]:
    return [rank["rows"][-1]["comm/inter_node_bytes_per_step"] for rank in case_results(four[0], case)]


def test_only_a_shard_of_the_gradients_crosses_between_nodes(four: tuple[list[dict[str, Any]], Path]) -> None:
    """2 nodes of 2, the mlp's 2442 float32 gradients (9768 bytes): ddp's flat ring of 4 sends each
    rank's 2(4-1)/4 of them over the slow link, 14652 bytes; hierarchical all-reduces its 1/2 of the
    bucket (4884 bytes) with one rank in the other node, 2(2-1)/2 of it; hsdp its node's shard of each
    unit (FSDP2's padding: none at 2), 4884 bytes in all. fsdp's gathers and reduce-scatters all span
    the nodes: more than twice hsdp's."""
    assert inter_node_bytes(four, "link-ddp") == [14652.0] * 4
    assert inter_node_bytes(four, "link-hierarchical") == [4884.0] * 4
    assert inter_node_bytes(four, "link-hsdp") == [4884.0] * 4
    assert all(f > 2 * 4884 for f in inter_node_bytes(four, "link-fsdp"))


@pytest.mark.parametrize("sync", STRATEGIES)
def test_one_emulated_node_sends_nothing_across_nodes(four: tuple[list[dict[str, Any]], Path], sync: str) -> None:
    """network.gpus_per_node=4 on 4 ranks: the mesh is one node of 4 (one level, said so), and the
    link, which knows where its nodes are, measures 0 bytes between them: a measured zero."""
    for rank in case_results(four[0], f"one-node-{sync}"):
        assert rank["rows"][-1]["comm/inter_node_bytes_per_step"] == 0.0
        assert rank["rows"][-1]["comm/bytes_per_step"] > 0
        facts = rank["sync"]
        assert (facts["replicate"], facts["shard"], facts["mesh_replicate_x_shard"]) == (1, 4, [1, 4])
        assert facts["levels"] == "one level: all 4 ranks on one node; two levels need nodes > 1"


@pytest.mark.parametrize("sync", STRATEGIES)
def test_the_sync_line_gives_the_resolved_mesh(four: tuple[list[dict[str, Any]], Path], sync: str) -> None:
    """sync.replicate=null resolved to the world size / shard: the numbers that run, never null."""
    for rank in case_results(four[0], f"{sync}-sgd"):
        facts = rank["sync"]
        assert (facts["replicate"], facts["shard"], facts["mesh_replicate_x_shard"]) == (2, 2, [2, 2])
        assert facts["levels"] == "two levels: 2 nodes of 2 ranks"


def test_hsdp_resumes_both_formats_on_another_world_size(
    four: tuple[list[dict[str, Any]], Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    results, root = four
    runs = tmp_path_factory.mktemp("two")
    for name in ("hsdp-full", "hsdp-sharded"):  # the 4-rank runs, cut back to step 4, continued on 2 ranks
        (root / "resumed" / name).rename(runs / name)
    continued = run_on_ranks(two_ranks, 2, runs / "ranks", str(runs))
    for name in ("hsdp-full", "hsdp-sharded"):
        straight = case_results(results, name)[0]["params"]
        for rank in continued:
            assert max_abs_diff(rank[name]["params"], straight) <= 1e-5, name


def test_a_mesh_the_ranks_cannot_form_is_refused_naming_both_keys() -> None:
    for sync in STRATEGIES:
        with pytest.raises(ConfigError, match=r"sync.replicate=3 x sync.shard=2 is invalid on 4 rank\(s\): .*1, 2, 4"):
            check_overrides([f"sync={sync}", "sync.replicate=3", "sync.shard=2"], world_size=4)
        with pytest.raises(ConfigError, match=r"sync.replicate=null x sync.shard=3 is invalid on 4 rank\(s\)"):
            check_overrides([f"sync={sync}", "sync.shard=3"], world_size=4)
        check_overrides([f"sync={sync}", "sync.replicate=2", "sync.shard=2"], world_size=4)
