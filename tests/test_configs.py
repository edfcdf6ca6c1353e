"""Every option of every config group composes with Hydra's compose API and instantiates."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf
from torch import nn

from data.base import DataModule
from tests.compose import CONF_DIR, compose_config
from trainer.core import TrainSettings
from trainer.logger.jsonl import JsonlLogger
from trainer.setup.build import instantiate, optimizer_factory
from trainer.setup.validate import validate
from trainer.sync.base import SyncStrategy
from trainer.sync.describe import describe

GROUPS = ("model", "data", "sync", "optim", "schedule", "trainer", "logger", "network", "strategy", "experiment")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


CASES = [(group, option) for group in GROUPS for option in options(group)]


def test_every_group_has_options() -> None:
    for group in GROUPS[:-1]:
        assert options(group), f"conf/{group}/ is empty"
    # Every group directory is covered here: a new group must be added to GROUPS.
    on_disk = {p.name for p in CONF_DIR.iterdir() if p.is_dir()} - {"hydra", "local"}
    assert on_disk <= set(GROUPS), on_disk - set(GROUPS)


def test_strategy_sweeps_list_every_strategy_and_every_preset() -> None:
    strategies = OmegaConf.load(CONF_DIR / "experiment" / "strategy_sweep.yaml").hydra.sweeper.params
    assert sorted(strategies["sync"].split(",")) == options("sync")
    presets = OmegaConf.load(CONF_DIR / "experiment" / "strategy_variants.yaml").hydra.sweeper.params
    assert sorted(presets["+strategy"].split(",")) == options("strategy")


def test_every_strategy_preset_sets_more_than_its_sync_choice() -> None:
    # sync=<name> chooses a strategy; a preset exists for a strategy together with knobs of its own.
    for option in options("strategy"):
        preset = OmegaConf.load(CONF_DIR / "strategy" / f"{option}.yaml")
        assert "sync" in preset and len(preset.sync) > 0, f"conf/strategy/{option}.yaml only picks a sync option"


def test_defaults_compose_and_resolve() -> None:
    cfg = compose_config([])
    assert cfg.run_name == "test-run"
    assert cfg.sync.bucket_cap_mb == 25 and cfg.logger.mode == "offline"
    assert cfg.trainer.device == "auto" and cfg.data.batch_size > 0


@pytest.mark.parametrize(("group", "option"), CASES, ids=[f"{g}={o}" for g, o in CASES])
def test_option_composes_and_instantiates(group: str, option: str, tmp_path: Path) -> None:
    # data=fake gives images, which every image model accepts (the mlp flattens them); the gpt and
    # data=text are each other's only partners.
    extra = {("model", "gpt"): ["data=text"], ("data", "text"): ["model=gpt"]}.get((group, option), [])
    extra = extra or (["data=fake"] if group == "model" else [])
    # strategy is not in the primary config's defaults: its options are added with +strategy=...
    cfg = compose_config([f"{'+' if group == 'strategy' else ''}{group}={option}", *extra])
    if group == "model":
        data = instantiate(cfg.data)
        model = instantiate(cfg.model, input_shape=data.input_shape, num_classes=data.num_classes)
        assert isinstance(model, nn.Module)
        logits = model(torch.zeros(2, *data.input_shape, dtype=data.input_dtype))
        assert logits.shape[0] == 2 and logits.shape[-1] == data.num_classes  # a language model: per token
    elif group == "data":
        assert isinstance(instantiate(cfg.data), DataModule)  # files are opened later, in setup()
    elif group == "sync":
        assert isinstance(instantiate(cfg.sync), SyncStrategy)
    elif group == "strategy":  # a sync choice plus its knobs; its name says which sync it picks
        sync = instantiate(cfg.sync)
        assert isinstance(sync, SyncStrategy) and describe(sync)["strategy"] == option.split("_")[0]
    elif group == "optim":
        # optim.weight_decay_on is the builder's key: the node is built through its optimizer_factory.
        optimizer = optimizer_factory(cfg.optim)([nn.Parameter(torch.zeros(3))])
        assert isinstance(optimizer, torch.optim.Optimizer)
    elif group == "schedule":
        schedule = instantiate(cfg.schedule, total_steps=100)
        assert 0.0 < schedule(50) <= 1.0
    elif group == "trainer":
        assert isinstance(validate(cfg)["trainer"], TrainSettings)
    elif group == "logger":
        logger = instantiate(cfg.logger, dir=str(tmp_path), name="rank-0", group="g", run_config={"a": 1}, rank=0)
        logger.log({"step": 1, "train/loss": 1.0})
        logger.close()
        if option == "wandb":
            assert list((tmp_path / "wandb").glob("offline-run-*/run-*.wandb"))
    elif group == "network":  # none: no link; a preset: its link on 2 ranks, named after it
        link = instantiate(cfg.network).link(2)
        assert link is None if option == "none" else link is not None and link.describe().startswith(option)
    elif group == "experiment":
        for node in ("model", "data", "sync", "optim", "schedule", "logger", "network"):
            assert "_target_" in cfg[node]
        validate(cfg)
    else:
        pytest.fail(f"no check for group {group}")


def test_jsonl_logger_appends_one_object_per_row(tmp_path: Path) -> None:
    logger = JsonlLogger(tmp_path / "metrics" / "rank0.jsonl")
    logger.log({"step": 1, "train/loss": 0.5})
    logger.log({"step": 2, "train/loss": 0.25})
    logger.close()
    lines = (tmp_path / "metrics" / "rank0.jsonl").read_text().splitlines()
    assert [line.count('"step"') for line in lines] == [1, 1] and '"train/loss": 0.25' in lines[1]
