"""The emulated-network experiments compose on an emulated link and sweep what their docs say
(docs/network.md); no training here: the sweeps themselves take minutes."""

from __future__ import annotations

from omegaconf import OmegaConf

from tests.compose import CONF_DIR, compose_config


def sweep(name: str) -> dict[str, str]:
    return dict(OmegaConf.load(CONF_DIR / "experiment" / f"{name}.yaml").hydra.sweeper.params)


def test_network_strategies_runs_each_strategy_on_one_emulated_link() -> None:
    params = sweep("network_strategies")
    strategies = params["sync"].split(",")
    assert list(params) == ["+repeat", "sync"] and params["+repeat"] == "1,2"  # repeats outermost: interleaved
    # every strategy, fsdp included: its collectives ride the link too
    assert set(strategies) == {"none", "manual", "bucketed", "ddp", "zero", "fsdp"}
    for strategy in strategies:
        cfg = compose_config(["experiment=network_strategies", f"sync={strategy}"])
        assert cfg.network.preset == "100gbe" and cfg.network.time_scale == 25
        assert cfg.sync._target_.split(".")[2] == strategy
    # compression: ddp's hooks on the same link and model
    compression = sweep("network_compression")
    assert compression["sync"] == "ddp" and compression["sync.comm_hook"].split(",") == ["none", "fp16", "powersgd"]
    for hook in ("fp16", "powersgd"):
        cfg = compose_config(["experiment=network_compression", "sync=ddp", f"sync.comm_hook={hook}"])
        assert cfg.network.preset == "100gbe" and cfg.network.time_scale == 25 and cfg.sync.comm_hook == hook
    # zero stage 3 on the same link and model, with and without prefetching the next unit's gather
    sharding = sweep("network_sharding")
    assert (sharding["sync"], sharding["sync.stage"], sharding["sync.prefetch"]) == ("zero", 3, "0,1,2")
    cfg = compose_config(["experiment=network_sharding", "sync=zero", "sync.stage=3", "sync.prefetch=0"])
    assert cfg.network.preset == "100gbe" and cfg.network.time_scale == 25 and cfg.sync.prefetch == 0
    # larger than the default 25 MiB cap, so bucketed, ddp and zero build more than one bucket
    cfg = compose_config(["experiment=network_strategies", "sync=ddp"])
    widths = [32, *cfg.model.hidden_sizes, 10]  # data=synthetic's input_dim and classes
    gradient_bytes = 4 * sum(a * b + b for a, b in zip(widths, widths[1:], strict=False))
    assert gradient_bytes > cfg.sync.bucket_cap_mb * 2**20


def test_network_bucket_sweep_sweeps_ddp_caps_on_a_slow_latency_link() -> None:
    params = sweep("network_bucket_sweep")
    assert list(params) == ["+repeat", "sync.bucket_cap_mb"] and params["+repeat"] == "1,2"
    caps = [float(c) for c in params["sync.bucket_cap_mb"].split(",")]
    assert caps == sorted(caps) and caps[0] <= 0.25 and caps[-1] >= 25  # one weight per bucket to one bucket
    for cap in caps:
        cfg = compose_config(["experiment=network_bucket_sweep", f"sync.bucket_cap_mb={cap:g}"])
        assert cfg.sync._target_ == "trainer.sync.ddp.DDPSync" and cfg.sync.bucket_cap_mb == cap
        assert cfg.network.preset == "1gbe" and cfg.network.latency_us == 2000  # raised, as the YAML says
    assert len(cfg.model.hidden_sizes) == 48
