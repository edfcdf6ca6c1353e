"""Resuming with another number of ranks, or for longer: what may change, and what it maps to.

A checkpoint holds the full state, and the sampler interleaves one permutation (rank r takes
perm[r::N]), so global step k trains on the same samples at any world size N as long as the
global batch (N × data.batch_size × trainer.grad_accum_steps) is the same: the position in the
epoch is a number of global steps, translated into each rank's micro-batches. What cannot be
mapped is refused: another global batch (with the value that would keep it), sync=none (each
rank trained its own model) and a model that draws randomness (each rank's RNG stream belongs to
its N). Raising trainer.max_steps or num_epochs continues the run; the schedule's horizon moves to
the new end (docs/reliability.md).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from torch import nn
from torch.optim.lr_scheduler import LRScheduler

from trainer.reliability.checkpoint import CheckpointError

log = logging.getLogger(__name__)

# Keys that may differ on resume because what they change is mapped here, not refused as
# "a different training config": the global batch's factors (checked as a product) and the length.
BATCH_SHAPE = ("data.batch_size", "trainer.grad_accum_steps")
LENGTH = ("trainer.max_steps", "trainer.num_epochs")


Shape = tuple[int, int, int]  # (ranks, data.batch_size, grad_accum_steps): the global batch's factors


def _get(config: dict[str, Any], dotted: str) -> Any:
    value: Any = config
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def saved_shape(saved: dict[str, Any]) -> Shape | None:
    """The checkpoint's batch shape: written with it, or read from its config (checkpoints before issue
    33); None if neither says (a run built without a config, as some tests build one)."""
    batch = saved.get("batch_size", _get(saved.get("config", {}), "data.batch_size"))
    accum = saved.get("grad_accum_steps", _get(saved.get("config", {}), "trainer.grad_accum_steps"))
    return None if batch is None or accum is None else (saved["world_size"], int(batch), int(accum))


def check_global_batch(path: Path, then: Shape | None, now: Shape) -> None:
    """The same samples per step, or one line naming the data.batch_size (or grad_accum_steps) that keeps them."""
    if then is None:
        return  # nothing to compare: check_world_change refuses another world size then
    ranks, batch, accum = now
    before, after = then[0] * then[1] * then[2], ranks * batch * accum
    if before == after:
        return
    keep = []
    if before % (ranks * accum) == 0:
        keep.append(f"data.batch_size={before // (ranks * accum)}")
    if before % (ranks * batch) == 0:
        keep.append(f"trainer.grad_accum_steps={before // (ranks * batch)}")
    fix = f"resume with {' or '.join(keep)} to keep it" if keep else f"no batch size gives {before} on {ranks} ranks"
    where = f" was written by {then[0]} ranks, this job has {ranks}" if then[0] != ranks else ""
    raise CheckpointError(
        f"checkpoint {path}{where}: its global batch {before} ({then[0]} ranks × data.batch_size={then[1]} × "
        f"grad_accum_steps={then[2]}) would become {after}, so the steps would differ; {fix}, or start fresh "
        "with trainer.resume=never"
    )


def check_world_change(
    path: Path, saved: dict[str, Any], world_size: int, model: nn.Module, trains_one_model: bool
) -> None:
    """At another world size: refuse what cannot be mapped (per-rank models, per-rank random streams)."""
    if saved["world_size"] == world_size:
        return
    was = f"checkpoint {path} was written by {saved['world_size']} ranks, this job has {world_size}"
    if not trains_one_model:
        raise CheckpointError(
            f"{was}: sync=none trains one model per rank, and the checkpoint holds rank 0's only; "
            "resume sync=none with the same world size, or start fresh with trainer.resume=never"
        )
    drawing = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0})
    if drawing:
        raise CheckpointError(
            f"{was}: the model draws randomness ({', '.join(drawing)} with p > 0), and each rank's random "
            "stream cannot be mapped to another world size (the masks would differ from the uninterrupted "
            "run's); resume with the same world size, or start fresh with trainer.resume=never"
        )
    if saved_shape(saved) is None:
        raise CheckpointError(f"{was}, and it does not say its batch size: resume with {saved['world_size']} ranks")


def batches_into_epoch(saved_batches: int, then: Shape | None, now: Shape) -> int:
    """The checkpoint's position in its epoch as this job's micro-batches per rank (the same global samples)."""
    if then is None:
        return saved_batches  # the shape is unknown: the same job (check_world_change refused another N)
    samples = saved_batches * then[0] * then[1]
    return samples // (now[0] * now[1])  # exact: a checkpoint is written between whole global steps


def rng_of(saved: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's random state: its own, or at another world size a saved rank's (nothing draws from it:
    check_world_change refused models that do; the data order has its own seeded generator)."""
    rngs = saved["rng"]
    return rngs[rank] if rank < len(rngs) else rngs[rank % len(rngs)]


def continue_schedule(scheduler: LRScheduler, horizons: list[int | None], saved_step: int, total: int) -> str | None:
    """After loading a checkpoint's scheduler: put back this run's horizon (its total steps) where it differs.

    LambdaLR's state holds each multiplier's attributes, the checkpoint's total_steps among them; a
    run that trains longer keeps its own, so a cosine decays to the new end. Returns the one line
    that says so, or None when nothing changed.
    """
    lambdas = getattr(scheduler, "lr_lambdas", [])
    old = [getattr(f, "total_steps", None) for f in lambdas]
    if old == horizons:
        return None
    before = list(scheduler.get_last_lr())
    for f, horizon in zip(lambdas, horizons, strict=True):
        if horizon is not None:
            f.total_steps = horizon
    for group, base, f in zip(scheduler.optimizer.param_groups, scheduler.base_lrs, lambdas, strict=True):
        group["lr"] = float(base) * f(scheduler.last_epoch)
    scheduler._last_lr = [float(group["lr"]) for group in scheduler.optimizer.param_groups]  # what get_last_lr() reads
    after = scheduler.get_last_lr()[0]
    lr = f"stays {after:.6g}" if after == before[0] else f"goes from {before[0]:.6g} to {after:.6g}"
    return (
        f"training continues from step {saved_step} to step {total} (the checkpoint's run ended at "
        f"{old[0]}): the schedule's horizon moves to step {total}, so the lr at step {saved_step} {lr}"
    )
