"""Compose the real conf/ tree with Hydra's compose API, as train.py would (minus the launcher)."""

from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig

from trainer.setup import config
from trainer.setup.precheck import explain_compose_error

REPO = Path(__file__).resolve().parents[1]
CONF_DIR = config.CONF_DIR


def compose_config(overrides: list[str]) -> DictConfig:
    """A compose failure is raised as train.py reports it: one ConfigError line naming the key."""
    config.set_run_stamp("test-run")
    try:
        return config.compose_config(overrides)
    except Exception as err:
        raise explain_compose_error(err, overrides) from None
