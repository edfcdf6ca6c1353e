"""What a checkpoint holds, and putting a trainer back exactly where a checkpoint left it.

Resuming must end where an uninterrupted run ends, bit for bit: so the checkpoint carries the
model, optimizer and LR schedule, the step, the epoch and how far into it the data went, every
rank's random generators, and a fingerprint of the training config, checked before anything loads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler

from trainer.core import CONF_DIR, DistContext
from trainer.reliability import sharded, world_change
from trainer.reliability.checkpoint import (
    CheckpointError,
    config_differences,
    find_resume_state,
    fingerprint,
    load_checkpoint,
    option_defaults,
    rng_state,
    save_checkpoint,
    set_rng_state,
)
from trainer.sync.checkpointing import Checkpointing

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """What training changes and a checkpoint must carry: the objects, and where in the data it is."""

    model: nn.Module  # unwrapped: its state_dict keys are the plain model's
    optimizer: Optimizer
    scheduler: LRScheduler
    checkpointing: Checkpointing  # the strategy's (sync.checkpointing): a sharded one gathers a full checkpoint's state
    step: int  # optimizer steps done
    epoch: int  # the epoch the next step belongs to
    batches_into_epoch: int  # micro-batches of that epoch already trained on
    total_steps: int  # where this run ends (a resumed run may end later than the checkpoint's)
    batch_size: int  # per rank, and micro-batches per step: with the world size, the global batch
    grad_accum_steps: int
    vocab: dict[str, object] | None = None  # token data: what decodes ids (a sample needs no corpus)
    grad_scaler: torch.amp.GradScaler | None = None  # trainer.precision=fp16: its scale and growth count


def save(
    ctx: DistContext,
    directory: Path,
    keep: int,
    state: TrainState,
    config: dict[str, Any],
    layout: str = "full",
    in_flight: sharded.InFlight | None = None,
    before_publish: Callable[[], None] | None = None,
) -> None:
    """Every rank: contribute its RNG state, and its part of the state (sharded) or the gather (full);
    rank 0 writes the file (full) or the meta.pt beside the parts (sharded); all wait until complete.
    before_publish (trainer.fault.kind=kill_in_save) runs once this rank's part is written."""
    rngs: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(rngs, rng_state(ctx.device))
    facts = _facts(ctx, state, config, rngs)
    if layout == "sharded":
        model, optimizer = state.model, state.optimizer
        sharded.save(
            in_flight,
            ctx.is_main_process,
            directory,
            keep,
            state.checkpointing,
            model,
            optimizer,
            facts,
            before_publish,
        )
        return
    model_state, optimizer_state = state.checkpointing.state_dicts(state.model, state.optimizer)  # every rank
    if ctx.is_main_process:
        save_checkpoint(directory, {"model": model_state, "optimizer": optimizer_state, **facts}, keep, before_publish)
    elif before_publish is not None:
        before_publish()  # this rank's part (the gather) is done
    dist.barrier()  # nobody reads (or resumes from) a checkpoint before rank 0 has finished it


def _facts(ctx: DistContext, state: TrainState, config: dict[str, Any], rngs: list[Any]) -> dict[str, Any]:
    """What a checkpoint holds besides the model and optimizer state (both formats alike)."""
    return {
        "scheduler": state.scheduler.state_dict(),
        "step": state.step,
        "epoch": state.epoch,
        "batches_into_epoch": state.batches_into_epoch,
        "batch_size": state.batch_size,  # with world_size: the global batch, checked on resume
        "grad_accum_steps": state.grad_accum_steps,
        "rng": rngs,
        "world_size": ctx.world_size,
        "fingerprint": fingerprint(config),
        "config": config,
        **({"vocab": state.vocab} if state.vocab is not None else {}),
        **({"grad_scaler": state.grad_scaler.state_dict()} if state.grad_scaler is not None else {}),
    }


def stop_together(
    ctx: DistContext,
    current_step: Callable[[], int],
    save_now: Callable[[], None],
    one_more_step: Callable[[], bool],
    wait_s: float = 3.0,
    max_extra_steps: int = 2,
) -> bool:
    """On SIGTERM: checkpoint only once every rank has stopped at the same step; True if written.

    A lone rank entering the checkpoint's collectives while others train would hang them, and
    ranks told at the same moment can be one step apart (a rank blocked inside step n+1 waits for
    one that stopped after step n). So through the job's store: each stopping rank publishes its
    step; rank 0 decides "save" when all agree, else "step": everyone runs one more step
    (one_more_step(), False when training is over), which unblocks a rank caught mid-step. A rank
    that never stops (only some were signalled) makes the others give up after a few steps: the
    last periodic checkpoint stands.
    """
    store, rank, world = ctx.store, ctx.rank, ctx.world_size
    if store is None:
        log.warning("no store to coordinate a checkpoint on SIGTERM: none written")
        return False
    for _ in range(max_extra_steps + 1):
        step = current_step()
        store.set(f"ddplab/stop/rank-{rank}", str(step))
        if rank == 0:
            agreed = _poll(partial(_all_at, store, world, str(step)), wait_s)
            store.set(f"ddplab/stop/decision-{step}", "save" if agreed else "step")
        # Others wait longer than rank 0 polls, so a decision is never missed for being late.
        decision = _poll(partial(_peek, store, f"ddplab/stop/decision-{step}"), 3 * wait_s)
        if decision == "save":
            save_now()  # the caller's one line about the stop says so
            return True
        if not one_more_step():  # "step", or no decision: rank 0 may be blocked inside the next step
            break
    log.warning(
        "SIGTERM at step %d but the ranks did not stop together: no checkpoint; the last periodic checkpoint stands",
        current_step(),
    )
    return False


def _all_at(store: dist.Store, world_size: int, step: str) -> bool:
    return all(_peek(store, f"ddplab/stop/rank-{r}") == step for r in range(world_size))


def _peek(store: dist.Store, key: str) -> str | None:
    """The key's value without blocking (None while it is unset)."""
    return store.get(key).decode() if store.check([key]) else None


def _poll(condition: Callable[[], Any], timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if result or time.monotonic() >= deadline:
            return result
        time.sleep(0.02)


def resume_choice(resume: str, checkpoint: bool) -> str:
    """trainer.resume as this run reads it. With trainer.checkpoint=false the run keeps no checkpoint of
    its own, so `auto` finds none: a re-run or a torchrun restart starts over at step 0, and checkpoints an
    earlier run left in the run dir are not continued by a run that would not keep their state up to
    date. A path still resumes from that file."""
    return "never" if resume == "auto" and not checkpoint else resume


def start_over_line(attempt: int, checkpoint: bool, run_dir: Path) -> str | None:
    """What a run that starts at step 0 says when that may surprise: a torchrun restart that had no
    checkpoint to resume from, or trainer.checkpoint=false beside an earlier run's checkpoints."""
    if attempt > 0:
        why = "trainer.checkpoint=false keeps none" if not checkpoint else "none was written before the failure"
        return f"restart {attempt} of this job finds no checkpoint ({why}): training starts over at step 0"
    if not checkpoint and (run_dir / "checkpoints").is_dir():
        return (
            f"trainer.checkpoint=false: training starts at step 0; {run_dir / 'checkpoints'} holds an earlier "
            "run's checkpoints, not resumed from and left as they are"
        )
    return None


def finished_line(step: int, max_steps: int | None, num_epochs: int | None) -> str:
    """What a re-run of a finished run says instead of a summary of no steps (it trains and measures nothing)."""
    ends = {key: value for key, value in (("max_steps", max_steps), ("num_epochs", num_epochs)) if value is not None}
    limits = ", ".join(f"trainer.{key}={value}" for key, value in ends.items())
    return (
        f"this run had already finished (step {step} of {limits}): nothing trained or measured, its summary.json "
        f"stands; to train more, raise {' or '.join(f'trainer.{key}' for key in ends)} (it continues from step "
        f"{step}); to start over, add trainer.resume=never or choose another run_name"
    )


def resume_if_any(ctx: DistContext, run_dir: Path, resume: str, state: TrainState, config: dict[str, Any]) -> bool:
    """trainer.resume: rank 0 picks the checkpoint; every rank loads that same file into state, or stops."""
    choice: list[Any] = [None]
    if ctx.is_main_process:
        found = find_checkpoint(run_dir, resume)
        choice[0] = str(found[0]) if found else None
    dist.broadcast_object_list(choice, src=0)  # ranks must not disagree on whether to resume
    if choice[0] is None:
        return False
    path = Path(choice[0])
    if not path.exists():
        raise CheckpointError(
            f"rank {ctx.rank} cannot see checkpoint {path} that rank 0 chose: "
            "put the run dir on a filesystem every node shares"
        )
    restore(ctx, path, sharded.load_meta(path) if path.is_dir() else load_checkpoint(path), state, config)
    return True


def find_checkpoint(run_dir: Path, resume: str) -> tuple[Path, dict[str, Any]] | None:
    """trainer.resume's checkpoint in either format: a path (a file, or a step-<n>/ dir), or with
    `auto` the newest good one of <run dir>/checkpoints/ (step files and step dirs alike: a run may
    have switched trainer.checkpoint_format); an unusable one is named and an older one tried."""
    if resume not in ("auto", "never") and Path(resume).is_dir():
        return Path(resume), sharded.load_meta(Path(resume))
    full = find_resume_state(run_dir, resume)
    directory = run_dir / "checkpoints"
    if resume != "auto" or not directory.is_dir():
        return full
    for candidate in sharded.step_dirs(directory):
        if full is not None and full[1]["step"] >= int(candidate.name.removeprefix("step-")):
            break  # the newest file is at least as new
        try:
            return candidate, sharded.load_meta(candidate)
        except CheckpointError as err:
            log.warning("%s; trying an older checkpoint", err)
    return full


def restore(ctx: DistContext, path: Path, saved: dict[str, Any], state: TrainState, config: dict[str, Any]) -> None:
    """Refuse a checkpoint this job cannot continue exactly; otherwise load it all into state.

    Another world size is mapped when the global batch is the checkpoint's, a longer run continues
    (trainer/reliability/world_change.py); any other change of the training config is refused.
    """
    then, now = world_change.saved_shape(saved), (ctx.world_size, state.batch_size, state.grad_accum_steps)
    world_change.check_global_batch(path, then, now)
    world_change.check_world_change(path, saved, ctx.world_size, state.model, state.checkpointing.trains_one_model)
    mapped = (*world_change.BATCH_SHAPE, *world_change.LENGTH)
    if saved["fingerprint"] != fingerprint(config) and (
        diffs := "; ".join(config_differences(saved["config"], config, option_defaults(CONF_DIR, config), mapped))
    ):
        raise CheckpointError(
            f"checkpoint {path} was written with a different training config ({diffs}); "
            "resume with the same config, or start fresh with trainer.resume=never "
            "or another hydra.run.dir"
        )
    if saved["step"] > state.total_steps:
        raise CheckpointError(
            f"checkpoint {path} is at step {saved['step']}, past this run's end at step {state.total_steps}: "
            "raise trainer.max_steps (or num_epochs) to train on from it, or start fresh with trainer.resume=never"
        )
    if saved.get("sharded"):  # every rank reads its own part (any world size): DCP, a collective
        sharded.load(state.checkpointing, state.model, state.optimizer, path, saved["param_groups"])
    else:
        state.checkpointing.load_state_dicts(state.model, state.optimizer, saved["model"], saved["optimizer"])
    horizons = [getattr(f, "total_steps", None) for f in getattr(state.scheduler, "lr_lambdas", [])]
    state.scheduler.load_state_dict(saved["scheduler"])  # its multipliers' attributes: the saved run's horizon
    longer = world_change.continue_schedule(state.scheduler, horizons, saved["step"], state.total_steps)
    if state.grad_scaler is not None and "grad_scaler" in saved:  # the same on every rank: it was rank 0's
        state.grad_scaler.load_state_dict(saved["grad_scaler"])
    state.step, state.epoch = saved["step"], saved["epoch"]
    state.batches_into_epoch = world_change.batches_into_epoch(saved["batches_into_epoch"], then, now)
    set_rng_state(world_change.rng_of(saved, ctx.rank), ctx.device)
    if ctx.is_main_process:
        if saved["world_size"] != ctx.world_size:
            log.info(
                "resuming at world size %d a checkpoint of %d ranks: the same global batch, the epoch's "
                "position translated (%d micro-batches per rank into it)",
                ctx.world_size,
                saved["world_size"],
                state.batches_into_epoch,
            )
        if longer:
            log.info("%s", longer)
    if state.step < state.total_steps:  # at its end: the finished run's one line says it (Trainer.fit)
        log.info(
            "resumed from %s at step %d (epoch %d, %d micro-batches into it)",
            path,
            state.step,
            state.epoch,
            state.batches_into_epoch,
        )
