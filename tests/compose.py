"""Compose the real conf/ tree with Hydra's compose API, as train.py would (minus the launcher)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from trainer.setup import config

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = config.CONF_DIR


def compose_config(overrides: list[str]) -> DictConfig:
    config.set_run_stamp("test-run")
    return config.compose_config(overrides)
