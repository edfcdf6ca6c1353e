"""train.py's build path inside a test's rank process, and comparing what the ranks trained."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tests.compose import compose_config
from trainer.logger.base import MetricLogger
from trainer.loop.trainer import Trainer
from trainer.setup.build import build_parts, build_trainer, instantiate, prepare_data
from trainer.setup.dist import DistContext


def build(
    rank: int,
    world_size: int,
    overrides: list[str],
    run_dir: str | Path,
    device: str = "cpu",
    loggers: Sequence[MetricLogger] = (),
    config: dict[str, Any] | None = None,
) -> Trainer:
    """The Trainer train.py would build, on the process group the test helper started (gloo)."""
    cfg = compose_config(overrides)
    settings = instantiate(cfg.trainer)
    parts = build_parts(cfg, settings)
    ctx = DistContext(rank, rank, world_size, torch.device(device), "gloo")
    prepare_data(parts.data, ctx)
    return build_trainer(parts, settings, ctx, list(loggers), Path(run_dir), config or {})


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {name: t.detach().cpu().clone() for name, t in trainer.model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_same_model(ranks: Sequence[dict[str, torch.Tensor]], single: dict[str, torch.Tensor]) -> None:
    """The promise: every rank holds the same bits, within 1e-5 of one process on the whole batch."""
    assert all(bit_identical(ranks[0], other) for other in ranks[1:]), "replicas differ after training"
    assert max_abs_diff(ranks[0], single) <= 1e-5
