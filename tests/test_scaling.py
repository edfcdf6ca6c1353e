"""The scaling model's arithmetic: collective costs, the alpha-beta fit, buckets and overlap."""

from __future__ import annotations

import json
import random
import typing
from pathlib import Path

import pytest

from trainer.comm_schedule import Buckets, Hop, Schedule
from trainer.core import CONF_DIR
from trainer.errors import ConfigError
from trainer.links import PRESETS, Link, Network, Topology, ring_s
from trainer.scaling.__main__ import main
from trainer.scaling.networks import fit_link, parse_network
from trainer.scaling.options import schedules
from trainer.scaling.predict import buckets, fsdp_units, layered, layout, overlapped, predict
from trainer.scaling.profile import RunProfile, Tensor, read_profile

LINK = Link(alpha_s=10e-6, beta_Bps=1e9)
FAST = Network.uniform("fast", 1e-6, 100e9)
SLOW = Network.uniform("slow", 5e-6, 10e9)


@pytest.fixture(scope="module")
def described() -> dict[str, Schedule]:
    """What each option of conf/sync/ says its step sends, built as the command builds it."""
    return schedules()[0]


def test_ring_costs_by_hand() -> None:
    # n = 4, S = 4 MB: every ring step moves 1 MB (1 ms at 1 GB/s) after 10 us of latency.
    assert ring_s("all_reduce", 4e6, 4, LINK) == pytest.approx(6 * 1.01e-3)
    assert ring_s("reduce_scatter", 4e6, 4, LINK) == pytest.approx(3 * 1.01e-3)
    assert ring_s("all_gather", 4e6, 4, LINK) == pytest.approx(3 * 1.01e-3)
    assert ring_s("all_reduce", 4e6, 1, LINK) == 0.0  # one rank sends nothing
    with pytest.raises(ValueError, match="unknown collective 'broadcast'"):
        ring_s("broadcast", 1, 2, LINK)


def test_two_levels_by_hand() -> None:
    # 2 nodes of 8, S = 80 MB: inside each node a reduce_scatter and an all_gather of 80 MB over 8
    # ranks at 100 GB/s (7 steps of 10 MB: 7 x (1 us + 100 us) each); across nodes an all_reduce of
    # each rank's 10 MB over 2 nodes at 10 GB/s (2 steps of 5 MB: 2 x (5 us + 500 us)).
    topo = Topology(16, 8, intra=FAST, inter=SLOW)
    assert topo.nodes == 2 and topo.per_node == 8
    assert topo.two_level_s("all_reduce", 80e6) == pytest.approx(2 * 7 * 101e-6 + 2 * 505e-6)
    assert topo.two_level_s("reduce_scatter", 80e6) == pytest.approx(7 * 101e-6 + 505e-6)
    assert topo.two_level_s("all_gather", 80e6) == pytest.approx(7 * 101e-6 + 505e-6)
    # The same buffer as one flat ring of all 16 ranks: every one of its 30 steps (5 MB each) waits
    # for the inter-node hop, 30 x (5 us + 500 us).
    assert topo.collective_s("all_reduce", 80e6) == pytest.approx(30 * 505e-6)
    # A group inside one node pays the intra link, one rank per node the inter link.
    assert topo.collective_s("all_reduce", 80e6, "node") == pytest.approx(2 * 7 * 101e-6)
    assert topo.collective_s("all_reduce", 10e6, "nodes") == pytest.approx(2 * 505e-6)
    # One network everywhere, or one node: one flat ring of every rank.
    flat = Topology(16, 8, intra=SLOW, inter=SLOW)
    assert flat.collective_s("all_reduce", 80e6) == pytest.approx(
        ring_s("all_reduce", 80e6, 16, SLOW.link("all_reduce"))
    )
    assert Topology(8, 8, FAST, SLOW).collective_s("all_reduce", 8e6) == pytest.approx(14 * (1e-6 + 1e-5))


def test_topology_refuses_partial_nodes() -> None:
    with pytest.raises(ValueError, match="12 ranks do not fill nodes of 8"):
        Topology(12, 8, FAST, SLOW)
    Topology(4, 8, FAST, SLOW)  # fewer ranks than one node holds: one node, partly used


@pytest.mark.parametrize("world_size", [2, 4, 8])
@pytest.mark.parametrize("kind", ["all_reduce", "reduce_scatter", "all_gather"])
def test_fit_recovers_alpha_and_beta(kind: str, world_size: int) -> None:
    truth = Link(alpha_s=40e-6, beta_Bps=2.5e9)
    sizes = [1024 * 2**k for k in range(17)]  # 1 KiB .. 64 MiB, as the benchmark sweeps
    exact = [ring_s(kind, s, world_size, truth) for s in sizes]
    fitted = fit_link(kind, sizes, exact, world_size)
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=1e-6)
    assert fitted.beta_Bps == pytest.approx(truth.beta_Bps, rel=1e-6)
    noise = random.Random(world_size)  # +-5 % per timing, as a quiet machine gives
    noisy = [t * noise.uniform(0.95, 1.05) for t in exact]
    fitted = fit_link(kind, sizes, noisy, world_size)
    assert fitted.alpha_s == pytest.approx(truth.alpha_s, rel=0.1)
    assert fitted.beta_Bps == pytest.approx(truth.beta_Bps, rel=0.1)


def test_fit_refuses_what_cannot_be_fitted() -> None:
    with pytest.raises(ConfigError, match="world size 1 measured no communication"):
        fit_link("all_reduce", [1, 2], [1.0, 2.0], 1)
    with pytest.raises(ConfigError, match="do not grow with size"):
        fit_link("all_reduce", [1e3, 1e6, 1e7], [3e-3, 2e-3, 1e-3], 2)
    # Timings flat in size: no latency to resolve beyond noise is fine, no bandwidth is not.
    assert fit_link("all_reduce", [1e3, 1e6], [1e-3, 2e-3], 2).alpha_s > 0
    # Small messages faster than bandwidth alone allows (a negative intercept): alpha is 0, and
    # beta comes from the bandwidth term alone. At 2 ranks an all_reduce's t = S / beta, so each
    # timing says beta = S / t: 2, 1 and 1 GB/s, and 1 / beta = sum(S/t) / sum((S/t)^2) = 4 / 6 ns.
    fitted = fit_link("all_reduce", [1e3, 1e6, 1e7], [0.5e-6, 1e-3, 1e-2], 2)
    assert fitted.alpha_s == 0.0 and fitted.beta_Bps == pytest.approx(1.5e9)


def test_networks_by_name_or_numbers() -> None:
    assert parse_network("ib-ndr400").link("all_reduce") == Link(5e-6, 45e9)
    assert parse_network("3,12.5").link("all_gather") == Link(3e-6, 12.5e9)
    for bad in ("infiniband", "5", "5,0", "-1,10", "a,b"):
        with pytest.raises(ConfigError, match=f"network {bad!r} is neither a preset .*loopback.*alpha_us,beta_GBps"):
            parse_network(bad)


def test_buckets_follow_each_rule() -> None:
    mib = 2**20
    sizes = [mib // 2, mib // 2, mib // 2, 3 * mib, mib // 4]
    # ddplab's flat buffers: close before overflowing the cap; a larger tensor alone.
    assert buckets(sizes, cap_mb=1) == [mib, mib // 2, 3 * mib, mib // 4]
    # DDP: add, close once the cap is reached; the first bucket has its own cap.
    assert buckets(sizes, cap_mb=4, first_cap_mb=0.5, ddp=True) == [mib // 2, mib + 3 * mib, mib // 4]
    assert buckets(sizes, cap_mb=100) == [sum(sizes)]


def test_overlap_by_hand() -> None:
    # Two equal buckets over a 1 s backward: the first is ready at 0.5 s, the second at 1 s.
    assert overlapped([100, 100], 1.0, lambda s: 0.3) == pytest.approx((0.6, 0.3))  # 0.5-0.8, 1.0-1.3
    assert overlapped([100, 100], 1.0, lambda s: 0.6) == pytest.approx((1.2, 0.7))  # 0.5-1.1, 1.1-1.7
    assert overlapped([100], 1.0, lambda s: 0.2) == pytest.approx((0.2, 0.2))  # one bucket: all exposed


def test_layered_pass_by_hand() -> None:
    # Two units of 0.5 s compute, gathers of 0.2 s: gather 0 (0-0.2), unit 0 (0.2-0.7) while gather
    # 1 is prefetched (0.2-0.4), unit 1 (0.7-1.2).
    assert layered([1, 1], 1.0, lambda s: 0.2, None) == pytest.approx((1.2, 0.4))
    # Gathers of 0.4 s: unit 0 at 0.4-0.9, gather 1 prefetched at 0.4-0.8, unit 1 at 0.9-1.4 (not
    # 1.3-1.8, as a gather issued only after unit 0 would make it).
    assert layered([1, 3], 2.0, lambda s: 0.4, None) == pytest.approx((2.4, 0.8))
    # With reduce_scatters of 0.1 s after each unit: 0.7-0.8, then 1.2-1.3 ends the pass.
    assert layered([1, 1], 1.0, lambda s: 0.2, lambda s: 0.1) == pytest.approx((1.3, 0.6))


def test_strategies_by_hand(described: dict[str, Schedule]) -> None:
    mib = 2**20
    tensors = (Tensor("a.weight", 2 * mib), Tensor("a.bias", mib), Tensor("b.weight", mib))
    phases = {"data": 0.0, "forward": 0.01, "backward": 0.02, "optimizer": 0.004}
    profile = RunProfile(Path("run"), 1, "cpu", "none", 32, phases, tensors)
    topo = Topology(4, 8, SLOW, SLOW)
    ar = lambda s: ring_s("all_reduce", s, 4, SLOW.link("all_reduce"))  # noqa: E731
    half = lambda s: ring_s("all_gather", s, 4, SLOW.link("all_gather"))  # noqa: E731  # = reduce_scatter
    assert predict(profile, topo, "none", described["none"]).step_s == pytest.approx(0.034)
    manual = predict(profile, topo, "manual", described["manual"])  # one 25 MiB buffer, after backward
    assert manual.step_s == pytest.approx(0.034 + ar(4 * mib)) and manual.efficiency == pytest.approx(
        0.034 / manual.step_s
    )
    # bucketed, 2 MiB cap, gradient order b.weight, a.bias, a.weight: buckets of 2 MiB (ready at
    # half of backward, 10 ms) and 2 MiB (at 20 ms); each all_reduce takes ar(2 MiB) ~ 0.35 ms.
    bucketed = predict(profile, topo, "bucketed", described["bucketed"].with_cap(2))
    assert bucketed.comm_s == pytest.approx(2 * ar(2 * mib)) and bucketed.exposed_s == pytest.approx(ar(2 * mib))
    no_overlap = predict(profile, topo, "bucketed", described["bucketed"].with_cap(2), overlap=False)
    assert no_overlap.exposed_s == pytest.approx(2 * ar(2 * mib))
    zero = predict(profile, topo, "zero", described["zero"])  # the optimizer steps on 1/4 of the parameters
    assert zero.step_s == pytest.approx(0.030 + 0.001 + 2 * half(4 * mib))
    # With 2 MiB buckets the first bucket's reduce_scatter hides under backward; the other and both
    # all_gathers (after the optimizer step) are exposed.
    zero2 = predict(profile, topo, "zero", described["zero"].with_cap(2))
    assert zero2.comm_s == pytest.approx(4 * half(2 * mib)) and zero2.exposed_s == pytest.approx(3 * half(2 * mib))
    # fsdp: units a (3 MiB, 3/4 of each pass's compute) and b (1 MiB). Forward: a's gather is
    # exposed, b's hides under a. Backward (b, then a): b's gather is exposed, a's hides under b,
    # b's reduce_scatter under a, and a's reduce_scatter comes after all compute.
    g3, g1 = half(3 * mib), half(mib)
    fsdp = predict(profile, topo, "fsdp", described["fsdp"])
    assert fsdp.comm_s == pytest.approx(3 * g3 + 3 * g1)
    assert fsdp.exposed_s == pytest.approx(g3 + g1 + g3)
    assert fsdp.step_s == pytest.approx(0.031 + 2 * g3 + g1)
    # manual with 2 MiB buffers in registration order: a.weight alone, then a.bias with b.weight.
    assert predict(profile, topo, "manual", described["manual"].with_cap(2)).comm_s == pytest.approx(2 * ar(2 * mib))


def _by_name(
    profile: RunProfile, topo: Topology, strategy: str, cap_mb: float, wrap: str, overlap: bool
) -> tuple[float, float, float]:
    """(step, comm, exposed) as the model computed them when it knew the six strategies by name."""
    p = profile.phase_s
    grads = [t.nbytes for t in reversed(profile.tensors)]
    ar = lambda s: topo.collective_s("all_reduce", s)  # noqa: E731
    rs = lambda s: topo.collective_s("reduce_scatter", s)  # noqa: E731
    ag = lambda s: topo.collective_s("all_gather", s)  # noqa: E731
    optimizer = p["optimizer"] / topo.ranks if strategy in ("zero", "fsdp") else p["optimizer"]
    if strategy == "none":
        comm = exposed = 0.0
    elif strategy == "manual":
        comm = exposed = sum(ar(s) for s in buckets([t.nbytes for t in profile.tensors], cap_mb))
    elif strategy in ("bucketed", "ddp"):
        first = 1.0 if strategy == "ddp" else None
        comm, exposed = overlapped(buckets(grads, cap_mb, first, ddp=strategy == "ddp"), p["backward"], ar)
    elif strategy == "zero":
        comm, exposed = overlapped(buckets(grads, cap_mb), p["backward"], rs)
        gathers = sum(ag(s) for s in buckets(grads, cap_mb))
        comm, exposed = comm + gathers, exposed + gathers
    else:
        units = fsdp_units(profile, wrap)
        forward, comm_f = layered(units, p["forward"], ag, None)
        backward, comm_b = layered(units[::-1], p["backward"], ag, rs)
        comm, exposed = comm_f + comm_b, forward - p["forward"] + backward - p["backward"]
    if not overlap:
        exposed = comm
    return profile.compute_s - p["optimizer"] + optimizer + exposed, comm, exposed


ONE_NODE_OR_ONE_NETWORK = [
    Topology(8, 8, PRESETS["loopback"], PRESETS["loopback"]),  # a link per collective kind
    Topology(2, 8, FAST, SLOW),  # one node of a two-network cluster
    Topology(16, 8, SLOW, SLOW),  # two nodes, one network: one flat ring, as before
]


@pytest.mark.parametrize("topo", ONE_NODE_OR_ONE_NETWORK, ids=lambda t: f"{t.ranks}x{t.intra.name}")
def test_the_six_strategies_predict_what_they_did_by_name(described: dict[str, Schedule], topo: Topology) -> None:
    """Each strategy's own schedule(), at its YAML's defaults and at other caps and wraps, gives the
    numbers the model gave when it branched on the six names, wherever a collective's cost did not
    change (one node, or one network everywhere)."""
    tensors = (
        Tensor("emb.weight", 3 << 20),
        Tensor("blocks.0.w", 2 << 20, "blocks.0"),
        Tensor("blocks.0.b", 4 << 10, "blocks.0"),
        Tensor("blocks.1.w", 2 << 20, "blocks.1"),
        Tensor("blocks.1.b", 4 << 10, "blocks.1"),
        Tensor("head.weight", 700 << 10),
    )
    phases = {"data": 0.001, "forward": 0.01, "backward": 0.02, "optimizer": 0.004}
    profile = RunProfile(Path("run"), 1, "cpu", "none", 32, phases, tensors)
    assert set(described) >= {"none", "manual", "bucketed", "ddp", "zero", "fsdp"}
    for name in ("none", "manual", "bucketed", "ddp", "zero", "fsdp"):
        for cap, wrap in [(None, None), (0.5, "module"), (2.0, "block"), (100.0, "auto")]:
            schedule = described[name]
            if cap is not None:
                schedule = schedule.with_cap(cap).with_wrap(wrap)
            for overlap in (True, False):
                new = predict(profile, topo, name, schedule, overlap=overlap)
                old = _by_name(profile, topo, name, cap or 25.0, wrap or "auto", overlap)
                assert (new.step_s, new.comm_s, new.exposed_s) == old, (name, cap, wrap, overlap)
                bucketing = name in ("manual", "bucketed", "ddp", "zero")
                assert new.bucket_cap_mb == ((cap or 25.0) if bucketing else None)


class Hierarchical:
    """A strategy the scaling model knows only by its schedule: sync=hierarchical's buckets (flat,
    gradient-ready order, sent during backward), each reduce_scattered inside the node, its 1/G
    all-reduced across the nodes, all_gathered inside the node."""

    def schedule(self) -> Schedule:
        hops = (Hop("reduce_scatter", "node"), Hop("all_reduce", "nodes", "node"), Hop("all_gather", "node"))
        return Schedule(Buckets(25.0, hops=hops))


def test_a_strategy_known_by_its_schedule_alone_is_priced_in_two_levels(described: dict[str, Schedule]) -> None:
    """Two nodes of 2 ranks, 1 GbE between them and NVLink inside: the hierarchical hops cost
    trainer/links.py's two-level all-reduce per bucket, and hide more of the step than ddp's flat
    ring of all 4 ranks, every step of which waits for the 1 GbE hop."""
    tensors = tuple(Tensor(f"layer{i}.weight", 8 << 20) for i in range(4))
    phases = {"data": 0.0, "forward": 0.1, "backward": 0.2, "optimizer": 0.01}
    profile = RunProfile(Path("run"), 1, "cpu", "none", 32, phases, tensors)
    topo = Topology(4, 2, intra=PRESETS["nvlink"], inter=PRESETS["1gbe"])
    schedule = Hierarchical().schedule()
    hierarchical = predict(profile, topo, "hierarchical", schedule)
    sizes = layout(profile, schedule.sends) if isinstance(schedule.sends, Buckets) else []
    assert sizes == [24 << 20, 8 << 20]  # flat buckets of 25 MiB in gradient-ready order
    assert hierarchical.comm_s == pytest.approx(sum(topo.two_level_s("all_reduce", s) for s in sizes))
    ddp = predict(profile, topo, "ddp", described["ddp"])
    flat = PRESETS["1gbe"].link("all_reduce")  # ddp's buckets: 8 MiB (the first closes past 1 MiB), then 24
    assert ddp.comm_s == pytest.approx(sum(ring_s("all_reduce", s, 4, flat) for s in [8 << 20, 24 << 20]))
    assert hierarchical.exposed_s < ddp.exposed_s and hierarchical.step_s < ddp.step_s
    # On one node the hops are one flat ring's reduce_scatter and all_gather: what all_reduce costs there.
    one = Topology(2, 2, intra=PRESETS["nvlink"], inter=PRESETS["1gbe"])
    assert predict(profile, one, "hierarchical", schedule).comm_s == pytest.approx(
        predict(profile, one, "bucketed", described["bucketed"]).comm_s
    )


def test_what_if_compute_keeps_each_phase_share() -> None:
    phases = {"data": 0.001, "forward": 0.002, "backward": 0.004, "optimizer": 0.001}
    profile = RunProfile(Path("run"), 1, "cpu", "none", 32, phases, (Tensor("w", 4),))
    faster = profile.with_compute(0.004)
    assert faster.phase_s == pytest.approx({"data": 0.0005, "forward": 0.001, "backward": 0.002, "optimizer": 0.0005})
    with pytest.raises(ConfigError, match="--compute-ms=0 is invalid"):
        profile.with_compute(0.0)


def test_fsdp_units_follow_sync_wrap() -> None:
    """sync.wrap's choice: module units (per owning module), or the root's tensors then one unit per
    block; auto is block only when the run recorded blocks (older summaries have none)."""
    from trainer.scaling.predict import FSDP_WRAPS
    from trainer.sync.fsdp_units import Wrap

    assert typing.get_args(Wrap) == FSDP_WRAPS
    tensors = (
        Tensor("emb.weight", 8),
        Tensor("blocks.0.lin.weight", 4, "blocks.0"),
        Tensor("blocks.0.lin.bias", 1, "blocks.0"),
        Tensor("blocks.1.lin.weight", 4, "blocks.1"),
        Tensor("norm.weight", 2),
    )
    profile = RunProfile(Path("run"), 1, "cpu", "none", 32, {"data": 0.0, "forward": 1.0}, tensors)
    assert fsdp_units(profile, "module") == [8, 5, 4, 2]
    assert fsdp_units(profile, "block") == fsdp_units(profile, "auto") == [10, 5, 4]
    flat = RunProfile(Path("run"), 1, "cpu", "none", 32, {}, tuple(Tensor(t.name, t.nbytes) for t in tensors))
    assert fsdp_units(flat, "auto") == [8, 5, 4, 2] and fsdp_units(flat, "block") == [19]
    with pytest.raises(ConfigError, match="--fsdp-wrap='blocks'"):
        fsdp_units(profile, "blocks")


def _summary(path: Path, strategy: str, ranks: list[dict[str, float]], **facts: typing.Any) -> Path:
    """A summary.json as train.py writes it, with only what read_profile reads (and `facts`, the
    strategy's sync facts)."""
    path.mkdir(parents=True)
    rows = [{"rank": r, **{f"median_time/{k}_s": v for k, v in times.items()}} for r, times in enumerate(ranks)]
    summary = {
        "world_size": len(ranks),
        "device": "cpu",
        "sync": {"strategy": strategy, **facts},
        "global_batch_size": 64 * len(ranks),
        "model": {"parameter_tensors": [{"name": "net.0.weight", "bytes": 4096}]},
        "ranks": rows,
    }
    (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_a_strategys_own_run_profiles_its_compute_without_its_waits(tmp_path: Path) -> None:
    sharded = {"zero"}  # a strategy whose schedule shards the optimizer (the command passes every such option)
    """What a run waited for beyond its sync phase comes out of the phases in proportion; a sharded
    strategy's optimizer phase is scaled back to the whole model's step."""
    phases = {"data": 0.0, "forward": 0.02, "backward": 0.07, "optimizer": 0.01}  # 100 ms
    # ddp: 30 ms waited for inside backward, no sync phase: 70 ms of compute left.
    ddp = read_profile(_summary(tmp_path / "ddp", "ddp", [{**phases, "sync": 0.0, "comm_exposed": 0.03}] * 2))
    assert ddp.compute_s == pytest.approx(0.07)
    assert ddp.phase_s == pytest.approx({k: 0.7 * v for k, v in phases.items()})
    # manual: every wait is its sync phase, which the phases never held.
    manual = read_profile(_summary(tmp_path / "manual", "manual", [{**phases, "sync": 0.04, "comm_exposed": 0.04}] * 2))
    assert manual.phase_s == pytest.approx(phases)
    # zero on 2 ranks: 20 ms waited beyond its 10 ms sync phase; its optimizer stepped half the model.
    zero = read_profile(
        _summary(tmp_path / "zero", "zero", [{**phases, "sync": 0.01, "comm_exposed": 0.03}] * 2), sharded
    )
    assert zero.phase_s == pytest.approx({**{k: 0.8 * v for k, v in phases.items()}, "optimizer": 2 * 0.8 * 0.01})
    # hsdp on 4 ranks as 2 nodes of 2: each node's 2 ranks split the optimizer step, not all 4.
    hsdp = read_profile(
        _summary(tmp_path / "hsdp", "hsdp", [{**phases, "sync": 0.01}] * 4, mesh_replicate_x_shard=[2, 2]), {"hsdp"}
    )
    assert hsdp.phase_s["optimizer"] == pytest.approx(2 * 0.01)
    # No communication measured (sync=none, one rank): the phases as they are.
    alone = read_profile(_summary(tmp_path / "none", "none", [phases]))
    assert alone.phase_s == pytest.approx(phases) and alone.caveat() is None


@pytest.mark.parametrize("mesh", [[1, 4], [4, 1], [2, 2]], ids=lambda mesh: f"{mesh[0]}x{mesh[1]}")
def test_hsdps_profile_steps_the_optimizer_of_one_nodes_ranks(tmp_path: Path, mesh: list[int]) -> None:
    """hsdp on 4 ranks: 1 node of 4 split the step four ways, 4 nodes of 1 not at all (each node
    steps the whole model): the measured 10 ms are scaled back by the shard, never the nodes."""
    phases = {"data": 0.0, "forward": 0.02, "backward": 0.07, "optimizer": 0.01}
    run = _summary(tmp_path / "hsdp", "hsdp", [{**phases, "sync": 0.01}] * 4, mesh_replicate_x_shard=mesh)
    assert read_profile(run, {"hsdp"}).phase_s["optimizer"] == pytest.approx(mesh[1] * 0.01)


@pytest.mark.parametrize("nodes", [8, 4])
def test_two_levels_priced_by_hand_in_nodes_of_8(described: dict[str, Schedule], nodes: int) -> None:
    """One 8 MiB tensor (one unit, one bucket) on `nodes` nodes of 8, FAST inside, SLOW between.
    Inside a node a reduce_scatter or all_gather of 8 MiB takes 7 steps of alpha + 1 MiB / beta;
    across the nodes each rank all-reduces its 1/8 (1 MiB) with one rank of every other node.
    hierarchical: all three after backward. hsdp: the unit gathered before forward and again before
    backward (exposed), its reduce_scatter and all_reduce after backward; the optimizer steps 1/8."""
    mib = 2**20
    phases = {"data": 0.0, "forward": 0.01, "backward": 0.02, "optimizer": 0.008}
    profile = RunProfile(Path("run"), 1, "cpu", "none", 32, phases, (Tensor("a.weight", 8 * mib),))
    topo = Topology(8 * nodes, 8, FAST, SLOW)
    inside = 7 * (1e-6 + mib / 100e9)
    across = 2 * (nodes - 1) * (5e-6 + mib / nodes / 10e9)
    hierarchical = predict(profile, topo, "hierarchical", described["hierarchical"])
    assert hierarchical.comm_s == pytest.approx(2 * inside + across) == hierarchical.exposed_s
    assert hierarchical.step_s == pytest.approx(0.038 + 2 * inside + across)
    hsdp = predict(profile, topo, "hsdp", described["hsdp"])
    assert hsdp.comm_s == pytest.approx(3 * inside + across) == hsdp.exposed_s
    assert hsdp.step_s == pytest.approx(0.03 + 0.008 / 8 + 3 * inside + across)
    assert (hsdp.ranks, hsdp.nodes) == (8 * nodes, nodes)


def test_one_rank_of_a_strategy_keeps_its_phases(tmp_path: Path) -> None:
    """On one rank nothing is sent: a strategy's timed waits (DDP's reducer, alone) stay compute."""
    phases = {"data": 0.0, "forward": 0.02, "backward": 0.07, "optimizer": 0.01}
    one = read_profile(_summary(tmp_path / "ddp1", "ddp", [{**phases, "sync": 0.0, "comm_exposed": 0.001}]))
    assert one.phase_s == pytest.approx(phases)
    sharded = read_profile(
        _summary(tmp_path / "zero1", "zero", [{**phases, "sync": 0.0, "comm_exposed": 0.001}]), {"zero"}
    )
    assert sharded.phase_s == pytest.approx(phases)  # a shard of one rank is the whole model


def test_the_command_accepts_exactly_conf_syncs_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--strategies takes its names from conf/sync/: every option passes (the missing run is what is
    refused), and a name that is no option is refused with the options listed."""
    options = sorted(path.stem for path in (CONF_DIR / "sync").glob("*.yaml"))
    missing = tmp_path / "no-run"
    assert main(["--run", str(missing), "--strategies", ",".join(options)]) == 2
    assert f"--run {missing} does not exist" in capsys.readouterr().err
    assert main(["--run", str(missing), "--strategies", "ddp,horovod"]) == 2
    err = capsys.readouterr().err
    assert "--strategies: unknown horovod; accepted: " in err
    assert sorted(err.split("accepted: ")[1].strip().split(", ")) == options
