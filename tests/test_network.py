"""The emulated network (network=<preset>, trainer/sync/network.py) on real ranks.

One spawn of 2 gloo ranks: each collective kind through a strategy's Collectives (and a DDP hook's
future) completes no earlier than its alpha-beta time and not much later, one after another on the
link, without taking a core while it waits; then every strategy trains the same bits with the link
as without it. Bad values are refused in one line each; the refusals that need no ranks are here too.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests.dist_helpers import run_on_ranks
from tests.train_helpers import SIX_STEPS, bit_identical, build, case_results, params_of, train_each
from trainer.errors import ConfigError
from trainer.links import EMULATED, PRESETS, ring_s
from trainer.links import Preset as Link
from trainer.loop.rows import sync_facts
from trainer.loop.summary import format_report
from trainer.sync.comm import Comm
from trainer.sync.network import Network
from trainer.sync.network import Network as NetworkConfig  # the schema is the class (it moved from schema.py)

SLOW = Network(preset="1gbe", latency_us=20_000.0)  # 20 ms a ring step: far above gloo's own time here
MIB = 2**20


def expected_s(kind: str, nbytes: int, world_size: int = 2) -> float:
    """The link time the docs promise: trainer/scaling's ring formula on 1gbe's beta, alpha 20 ms."""
    link = PRESETS["1gbe"].link(kind)
    return ring_s(kind, nbytes, world_size, type(link)(alpha_s=0.02, beta_Bps=link.beta_Bps))


def timed(start: Any) -> dict[str, float]:
    """Wall and CPU seconds of launching and waiting for one collective (every rank starts together)."""
    dist.barrier()
    wall, cpu = time.perf_counter(), time.process_time()
    start()
    return {"wall": time.perf_counter() - wall, "cpu": time.process_time() - cpu}


def link_times(rank: int, world_size: int) -> dict[str, Any]:
    link = SLOW.link(world_size)
    assert link is not None
    net = Comm(link)
    full, shard = torch.ones(MIB // 4), torch.zeros(MIB // 8)
    times = {
        "all_reduce": timed(lambda: net.all_reduce(full).wait()),
        "reduce_scatter": timed(lambda: net.reduce_scatter(shard, full).wait()),
        "all_gather": timed(lambda: net.all_gather(full, shard).wait()),
        "future": timed(lambda: net.all_reduce(full).get_future().wait()),
        # a DDP hook's path: its future, delayed
        "hook": timed(
            lambda: link.delayed_future(dist.all_reduce(full, async_op=True).get_future(), "all_reduce", MIB).wait()
        ),
        # two launched back to back: the second leaves the link after the first
        "two": timed(lambda: [w.wait() for w in (net.all_reduce(torch.ones(MIB // 4)), net.all_reduce(full))]),
    }
    summed = torch.ones(8)
    net.all_reduce(summed).wait()
    return {"times": times, "sum": summed.tolist()}


COMMON = ["logger=none", "model.hidden_sizes=[32,32]", *SIX_STEPS]
# Each strategy's variants that send differently; every one runs without and with an emulated link.
VARIANTS = {
    "manual": ["sync=manual", "data.batch_size=8"],
    "manual-per-tensor": ["sync=manual", "sync.coalesce_mb=0", "data.batch_size=8"],
    "manual-rs_ag": ["sync=manual", "sync.collective=rs_ag", "data.batch_size=8"],
    "bucketed": ["sync=bucketed", "sync.bucket_cap_mb=0.001", "data.batch_size=8"],
    "bucketed-rs_ag": ["sync=bucketed", "sync.bucket_cap_mb=0.001", "sync.collective=rs_ag", "data.batch_size=8"],
    "ddp": ["sync=ddp", "sync.bucket_cap_mb=0.001", "data.batch_size=8"],
    "ddp-timing-hook": ["sync=ddp", "sync.time_buckets=true", "data.batch_size=8"],
    "ddp-fp16": ["sync=ddp", "sync.comm_hook=fp16", "data.batch_size=8"],
    "ddp-powersgd": ["sync=ddp", "sync.comm_hook=powersgd", "sync.powersgd_start_step=2", "data.batch_size=8"],
    "zero": ["sync=zero", "sync.bucket_cap_mb=0.001", "optim=adamw", "data.batch_size=8"],
    "zero-s1": ["sync=zero", "sync.stage=1", "optim=adamw", "data.batch_size=8"],
    "fsdp": ["sync=fsdp", "data.batch_size=8"],
}
LINKED = ["network=1gbe"]
CASES = {
    **{name: overrides for name, overrides in VARIANTS.items()},
    **{f"{name}-linked": [*overrides, *LINKED] for name, overrides in VARIANTS.items()},
}


def train(rank: int, world_size: int, overrides: list[str], run_dir: str) -> dict[str, Any]:
    trainer = build(rank, world_size, COMMON + overrides, run_dir)
    summary = trainer.fit()
    last = trainer._rows.rows[-1]
    return {
        "screen": format_report(summary),
        "ranks": summary["ranks"],
        "params": params_of(trainer),
        "comm": {k: v for k, v in last.items() if k.startswith("comm/") and k.endswith("_per_step")},
        "network": sync_facts(trainer.sync, trainer._rows.network).get("network"),
    }


def on_ranks(rank: int, world_size: int, root: str) -> dict[str, Any]:
    return {"link": link_times(rank, world_size), "cases": train_each(rank, world_size, train, CASES, root)}


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("network")
    return run_on_ranks(on_ranks, 2, root / "ranks", str(root / "runs"), timeout_s=600)


KINDS = {"all_reduce": MIB, "reduce_scatter": MIB, "all_gather": MIB, "future": MIB, "hook": MIB}


@pytest.mark.parametrize("what", KINDS)
def test_an_emulated_collective_takes_its_link_time_without_a_core(ranks: list[dict[str, Any]], what: str) -> None:
    kind = what if what in ("reduce_scatter", "all_gather") else "all_reduce"
    floor = expected_s(kind, KINDS[what])
    for rank in ranks:
        seen = rank["link"]["times"][what]
        assert floor <= seen["wall"] <= 1.5 * floor + 0.05, (what, seen, floor)
        assert seen["cpu"] < 0.5 * seen["wall"], (what, seen)  # slept, not spun


def test_collectives_leave_the_link_one_after_another_and_keep_their_values(ranks: list[dict[str, Any]]) -> None:
    floor = 2 * expected_s("all_reduce", MIB)
    for rank in ranks:
        assert floor <= rank["link"]["times"]["two"]["wall"] <= 1.5 * floor + 0.05
        assert rank["link"]["sum"] == [2.0] * 8


@pytest.mark.parametrize("variant", VARIANTS)
def test_an_emulated_link_changes_no_value_and_no_count(ranks: list[dict[str, Any]], variant: str) -> None:
    plain = case_results([r["cases"] for r in ranks], variant)
    linked = case_results([r["cases"] for r in ranks], f"{variant}-linked")
    for alone, emulated in zip(plain, linked, strict=True):
        assert bit_identical(alone["params"], emulated["params"])
        assert alone["network"] is None and alone["comm"]
        if not variant.startswith("zero"):
            assert alone["comm"] == emulated["comm"]
            continue
        # zero on gloo sends substitutes (an all_reduce, a broadcast per rank); on an emulated link the
        # collectives a cluster sends, which the link charges by kind. Bytes are what goes on the wire
        # (docs/metrics.md): the gathers the same either way; the reduction a reduce_scatter (stage 2)
        # sends half of what gloo's all_reduce of the same bucket does.
        alone_c, emulated_c = alone["comm"], emulated["comm"]
        assert emulated_c["comm/all_gather_bytes_per_step"] == alone_c["comm/broadcast_bytes_per_step"]
        assert ("comm/reduce_scatter_per_step" in emulated_c) == (variant == "zero")
        reduced = (
            emulated_c.get("comm/reduce_scatter_bytes_per_step", 0) * 2 or emulated_c["comm/all_reduce_bytes_per_step"]
        )
        assert reduced == alone_c["comm/all_reduce_bytes_per_step"]
    said = linked[0]["network"]
    assert said.startswith("1gbe (alpha 50 us, beta 0.11 GB/s)"), said
    # The end-of-run summary says what the link cost; a run without it says nothing of a link.
    assert not any(line.startswith("  link ") for line in plain[0]["screen"].splitlines())
    (line,) = [line for line in linked[0]["screen"].splitlines() if line.startswith("  link ")]

    def ms(key: str) -> str:  # the ranks' mean of their medians
        return f"{1000 * sum(r[key] for r in linked[0]['ranks']) / 2:.2f} ms"

    assert line.startswith(f"  link {said}: median step {ms('median_time/step_s')}"), line
    assert f"communication waited for {ms('median_time/comm_exposed_s')}" in line, line
    assert f"(the link alone: {ms('median_time/comm_exposed_link_s')})" in line, line
    assert "not emulated" not in said  # every strategy's collectives ride the link, FSDP2's through its custom hooks


def test_bad_links_are_refused_in_one_line_naming_the_value() -> None:
    with pytest.raises(ConfigError, match=r"network.gpus_per_node=4 is invalid on 6 rank\(s\): .*\(1, 2, 3, 6\)"):
        Network(preset="100gbe", gpus_per_node=4).link(6)
    with pytest.raises(ConfigError, match=r"network.bandwidth_gbps=5 is invalid with network=none: .*1gbe"):
        Network(bandwidth_gbps=5).link(2)
    assert Network().link(2) is None


def test_a_two_level_link_uses_the_intra_tier_inside_nodes_and_overrides_in_gbps() -> None:
    link = Network(preset="100gbe", gpus_per_node=2, bandwidth_gbps=8.0, latency_us=10.0).link(4)
    assert link is not None
    assert link.topology.nodes == 2 and link.topology.inter.link("all_reduce").beta_Bps == 1e9  # 8 Gb/s
    assert link.topology.intra == PRESETS["nvlink"]
    inside = Network(preset="100gbe", gpus_per_node=4).link(4)
    assert inside is not None and inside.seconds("all_reduce", MIB) == pytest.approx(
        ring_s("all_reduce", MIB, 4, PRESETS["nvlink"].link("all_reduce"))
    )
    scaled = Network(preset="100gbe", time_scale=10.0).link(2)
    assert scaled is not None and scaled.seconds("all_gather", MIB) == pytest.approx(
        10 * ring_s("all_gather", MIB, 2, PRESETS["100gbe"].link("all_gather"))
    )


def test_the_schema_offers_the_presets_the_scaling_table_has() -> None:
    import typing

    assert set(typing.get_args(Link)) == set(EMULATED)
    preset = typing.get_type_hints(NetworkConfig, include_extras=True)["preset"]
    choices = {a for part in typing.get_args(typing.get_args(preset)[0]) for a in typing.get_args(part)}
    assert choices == {"none", *EMULATED}
    assert {p.stem for p in (Path(__file__).parents[1] / "conf" / "network").glob("*.yaml")} == {"none", *EMULATED}


def test_the_emulated_link_charges_a_collective_by_its_group() -> None:
    link = Network(preset="1gbe", gpus_per_node=2).link(4)
    assert link is not None
    inside, across, flat = (link.seconds("all_reduce", 2**20, 1, ranks) for ranks in ((0, 1), (0, 2), None))
    assert inside < across / 100  # nvlink inside a node, 1 GbE between nodes
    assert flat > across  # every rank's ring: 3 of its 6 steps' hops cross nodes, each paced by the slow link
    assert link.across_nodes((0, 1)) is False and link.across_nodes((1, 3)) is True and link.across_nodes(None)
