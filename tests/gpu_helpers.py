"""Settings and checks for the torchrun runs on CUDA in test_gpu_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.compose import compose_config
from trainer.measures import PHASES
from trainer.setup.build import build_parts

CUDA = "trainer.device=cuda"
QUICK = ["logger=none", "trainer.progress_bar=false", "data.num_samples=1024", "data.num_val_samples=128"]
COMM_TIMING = ("time/comm_s", "time/comm_exposed_s", "comm/overlap_fraction")


def gpu_count() -> int:
    return torch.cuda.device_count()


def summary_of(run_dir: Path) -> dict[str, Any]:
    return json.loads((run_dir / "summary.json").read_text())


def initial_model(overrides: list[str]) -> torch.nn.Module:
    """The model every run with these overrides starts from (same seed), built here without training."""
    cfg = compose_config(overrides)
    return build_parts(cfg).model


def assert_phases_add_up(row: dict[str, Any]) -> None:
    """CUDA events at every phase boundary: the phases tile the step (event resolution is ~0.5 us)."""
    phases = sum(row[f"time/{phase}_s"] for phase in PHASES)
    assert row["time/step_s"] > 0 and phases == pytest.approx(row["time/step_s"], rel=0.03), row
