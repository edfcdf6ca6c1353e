"""train.py's build path inside a test's rank process, and comparing what the ranks trained."""

from __future__ import annotations

import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from tests.compose import compose_config
from tests.dist_helpers import collectives_stopped, still_in_step
from trainer.core import DistContext
from trainer.logger.base import MetricLogger
from trainer.loop.trainer import Trainer
from trainer.setup.build import build_parts, build_trainer, prepare_data

# The equivalence tests' run: 64 samples, 2 ranks x 8 = 4 steps per epoch, so 6 steps cross an epoch
# boundary (set_epoch reshuffles); a row every 2 steps, no evaluation.
SIX_STEPS = [
    "data.num_samples=64",
    "data.num_val_samples=16",
    "trainer.max_steps=6",
    "trainer.log_every_n_steps=2",
    "trainer.eval_every_n_steps=0",
    "trainer.progress_bar=false",
]


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
    parts = build_parts(cfg, world_size)  # as train.py: the world size sets what depends on it
    ctx = DistContext(rank, rank, world_size, torch.device(device), "gloo")
    prepare_data(parts.data, ctx)
    return build_trainer(parts, ctx, list(loggers), Path(run_dir), config or {})


def params_of(trainer: Trainer) -> dict[str, torch.Tensor]:
    """The full parameters; sharded ones (fsdp's DTensors, zero stage 3's units) are gathered, so every
    rank must call this together."""
    state = trainer.sync.checkpointing.full_model_state(trainer.model)
    return {name: t.detach().cpu().clone() for name, t in state.items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def assert_same_model(ranks: Sequence[dict[str, torch.Tensor]], single: dict[str, torch.Tensor]) -> None:
    """The promise: every rank holds the same bits, within 1e-5 of one process on the whole batch."""
    assert all(bit_identical(ranks[0], other) for other in ranks[1:]), "replicas differ after training"
    assert max_abs_diff(ranks[0], single) <= 1e-5


def train_each(
    rank: int, world_size: int, fn: Callable[..., Any], cases: dict[str, list[str]], run_root: str
) -> dict[str, Any]:
    """fn(rank, world_size, overrides, run_dir) for every case, one after another on the same group.

    One spawn of the ranks then serves many cases: a spawn costs more than a small case's training
    (importing torch alone takes seconds). A case that raises gives its traceback as its result,
    for its own test to report. After each case the ranks compare, through the store, whether it
    raised: a case refused on every rank alike (bad input) leaves them in step and the next case
    runs; one that failed on some ranks only may have left them at different collectives, where
    whatever ran next would pair with the wrong partner and end, minutes later, in a timeout far
    from the cause. Then no further case runs, and each says which case stopped it.
    """
    results: dict[str, Any] = {}
    for name, overrides in cases.items():
        stopped = collectives_stopped()
        if stopped is not None:
            results[name] = f"not run: {stopped}"
            continue
        raised = False
        try:
            results[name] = fn(rank, world_size, overrides, str(Path(run_root) / name))
        except Exception:  # reported by that case's own test
            results[name] = traceback.format_exc()
            raised = True
        still_in_step(f"case {name!r}", raised, rank, world_size)
    return results


def case_results(ranks: Sequence[dict[str, Any]], case: str) -> list[Any]:
    """Every rank's result for one case of train_each, failing with the traceback if it raised."""
    results = [by_case[case] for by_case in ranks]
    assert not any(isinstance(r, str) for r in results), f"{case} failed:\n" + "\n".join(map(str, results))
    return results
