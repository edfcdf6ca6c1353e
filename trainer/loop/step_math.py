"""Step and batch arithmetic, kept pure so it can be tested without a process group."""

from __future__ import annotations

from trainer.errors import ConfigError


def global_batch_size(batch_size: int, grad_accum_steps: int, world_size: int) -> int:
    """Samples per optimizer step across the job: what one process would need to match it."""
    return batch_size * grad_accum_steps * world_size


def steps_per_epoch(num_batches: int, grad_accum_steps: int, keep_partial: bool = False) -> int:
    """Optimizer steps in one pass over the shard with the most batches (every rank runs as many).

    A trailing partial accumulation is dropped, unless keep_partial (data.drop_last=false: every
    sample is trained, and the last step has fewer micro-batches).
    """
    steps = -(-num_batches // grad_accum_steps) if keep_partial else num_batches // grad_accum_steps
    if steps == 0:
        raise ConfigError(
            f"trainer.grad_accum_steps={grad_accum_steps} needs at least that many batches per epoch, "
            f"but each rank's shard holds only {num_batches}: lower it or data.batch_size"
        )
    return steps


def total_steps(max_steps: int | None, num_epochs: int | None, steps_in_epoch: int) -> int:
    """Optimizer steps to run: max_steps, num_epochs worth, or whichever ends first when both are set.

    One of them is set: the config check refuses both null (trainer/setup/validate.py).
    """
    candidates = []
    if max_steps is not None:
        candidates.append(max_steps)
    if num_epochs is not None:
        candidates.append(num_epochs * steps_in_epoch)
    assert candidates, "max_steps and num_epochs both None"
    return min(candidates)


def is_due(step: int, every_n_steps: int, last_step: int) -> bool:
    """Periodic events (logging, evaluation) fire every n steps and always on the last one."""
    return step == last_step or (every_n_steps > 0 and step % every_n_steps == 0)


def epoch_of(step: int, steps_in_epoch: int) -> int:
    """The 0-based epoch that optimizer step `step` (1-based) belongs to; 0 before any step."""
    return max(0, step - 1) // steps_in_epoch
