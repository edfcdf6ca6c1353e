"""Compose the real conf/ tree with Hydra's compose API, as train.py would (minus the launcher)."""

from __future__ import annotations

from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import DictConfig

from trainer.config import set_run_stamp

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = REPO / "conf"


def compose_config(overrides: list[str]) -> DictConfig:
    set_run_stamp("test-run")
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return compose("config", overrides=overrides)
