"""What a checkpoint holds, and putting a trainer back exactly where a checkpoint left it.

Resuming must end where an uninterrupted run ends, bit for bit: so the checkpoint carries the
model, optimizer and LR schedule, the step, the epoch and how far into it the data went, every
rank's random generators, and a fingerprint of the training config, checked before anything loads.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from trainer.checkpoint import (
    CheckpointError,
    config_differences,
    find_resume_state,
    fingerprint,
    load_checkpoint,
    rng_state,
    save_checkpoint,
    set_rng_state,
)

if TYPE_CHECKING:
    from trainer.trainer import Trainer

log = logging.getLogger(__name__)


def save(trainer: Trainer) -> None:
    """Every rank: contribute its RNG state; rank 0 writes; all wait until the files are complete."""
    rngs: list[Any] = [None] * trainer.ctx.world_size
    dist.all_gather_object(rngs, rng_state(trainer.ctx.device))
    if trainer.ctx.is_main_process:
        batches_into_epoch = (trainer.step - trainer.epoch * trainer.steps_per_epoch) * trainer.settings.grad_accum_steps
        state = {
            "model": trainer.model.state_dict(),
            "optimizer": trainer.optimizer.state_dict(),
            "scheduler": trainer.scheduler.state_dict(),
            "step": trainer.step,
            "epoch": trainer.epoch,  # the epoch the next step belongs to
            "batches_into_epoch": batches_into_epoch,  # micro-batches of it already trained on
            "rng": rngs,
            "world_size": trainer.ctx.world_size,
            "fingerprint": fingerprint(trainer.config),
            "config": trainer.config,
        }
        save_checkpoint(trainer.run_dir / "checkpoints", state, trainer.settings.keep_checkpoints)
    dist.barrier()  # nobody reads (or resumes from) a checkpoint before rank 0 has finished it


def stop_together(trainer: Trainer, wait_s: float = 3.0, max_extra_steps: int = 2) -> bool:
    """On SIGTERM: checkpoint only once every rank has stopped at the same step; True if written.

    A lone rank entering the checkpoint's collectives while others train would hang them, and
    ranks told at the same moment can be one step apart (a rank blocked inside step n+1 waits for
    one that stopped after step n). So through the job's store: each stopping rank publishes its
    step; rank 0 decides "save" when all agree, else "step": everyone runs one more step, which
    unblocks a rank caught mid-step. A rank that never stops (only some were signalled) makes the
    others give up after a few steps: the last periodic checkpoint stands.
    """
    store, rank, world = trainer.ctx.store, trainer.ctx.rank, trainer.ctx.world_size
    if store is None:
        log.warning("no store to coordinate a checkpoint on SIGTERM: none written")
        return False
    for _ in range(max_extra_steps + 1):
        step = trainer.step
        store.set(f"ddplab/stop/rank-{rank}", str(step))
        if rank == 0:
            agreed = _poll(lambda: all(_peek(store, f"ddplab/stop/rank-{r}") == str(step) for r in range(world)), wait_s)
            store.set(f"ddplab/stop/decision-{step}", "save" if agreed else "step")
        # Others wait longer than rank 0 polls, so a decision is never missed for being late.
        decision = _poll(lambda: _peek(store, f"ddplab/stop/decision-{step}"), 3 * wait_s)
        if decision == "save":
            save(trainer)
            if trainer.ctx.is_main_process:
                log.warning("checkpoint written at step %d on SIGTERM (trainer.checkpoint_on_sigterm)", step)
            return True
        if trainer.step >= trainer.total_steps:
            break
        trainer.run_iteration()  # "step", or no decision: rank 0 may be blocked inside the next step
    log.warning("SIGTERM at step %d but the ranks did not stop together: no checkpoint; the last periodic "
                "checkpoint stands", trainer.step)  # fmt: skip
    return False


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


def resume_if_any(trainer: Trainer) -> None:
    """trainer.resume: rank 0 picks the checkpoint; every rank loads that same file or stops."""
    choice: list[Any] = [None]
    if trainer.ctx.is_main_process:
        found = find_resume_state(trainer.run_dir, trainer.settings.resume)
        choice[0] = str(found[0]) if found else None
    dist.broadcast_object_list(choice, src=0)  # ranks must not disagree on whether to resume
    if choice[0] is None:
        return
    path = Path(choice[0])
    if not path.is_file():
        raise CheckpointError(f"rank {trainer.ctx.rank} cannot see checkpoint {path} that rank 0 chose: "
                              "put the run dir on a filesystem every node shares")  # fmt: skip
    restore(trainer, path, load_checkpoint(path))


def restore(trainer: Trainer, path: Path, state: dict[str, Any]) -> None:
    """Refuse a checkpoint from another world size or training config; otherwise load everything."""
    if state["world_size"] != trainer.ctx.world_size:
        raise CheckpointError(f"checkpoint {path} was written by {state['world_size']} ranks, this job has "
                              f"{trainer.ctx.world_size}: the data shards and batches would differ; resume with "
                              "the same world size, or start fresh with trainer.resume=never")  # fmt: skip
    if state["fingerprint"] != fingerprint(trainer.config):
        diffs = "; ".join(config_differences(state["config"], trainer.config)) or "unknown keys"
        raise CheckpointError(f"checkpoint {path} was written with a different training config ({diffs}); "
                              "resume with the same config, or start fresh with trainer.resume=never "
                              "or another hydra.run.dir")  # fmt: skip
    trainer.model.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    trainer.scheduler.load_state_dict(state["scheduler"])
    trainer.step, trainer.epoch = state["step"], state["epoch"]
    # The next pass over this epoch starts where the checkpoint stopped: skip the sample indices
    # of the micro-batches already trained on (no data is read to get there).
    trainer.train_loader.sampler.skip_next(state["batches_into_epoch"] * trainer.train_loader.batch_size)  # type: ignore[union-attr]
    set_rng_state(state["rng"][trainer.ctx.rank], trainer.ctx.device)
    log.info("resumed from %s at step %d (epoch %d, %d micro-batches into it)",
             path, trainer.step, trainer.epoch, state["batches_into_epoch"])  # fmt: skip
