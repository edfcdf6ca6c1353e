"""Fail before training when the run dir cannot take what the run will write."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

from torch import nn

from trainer.errors import ConfigError

LOG_ALLOWANCE_BYTES = 64 * 2**20  # logs, JSONL, W&B files, summary


def checkpoint_bytes(model: nn.Module) -> int:
    """A generous estimate of one checkpoint: parameters and buffers, plus two optimizer states."""
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return 3 * params + buffers


def bytes_needed(model: nn.Module, keep_checkpoints: int | None) -> int:
    """Room for the kept checkpoints plus the one being written, and the logs; None: the run writes no
    checkpoint (trainer.checkpoint=false), only the logs."""
    if keep_checkpoints is None:
        return LOG_ALLOWANCE_BYTES
    return (keep_checkpoints + 1) * checkpoint_bytes(model) + LOG_ALLOWANCE_BYTES


def check_output_dir(run_dir: Path, needed_bytes: int) -> None:
    """Write (and fsync) a probe file, then compare free space with what the run needs."""
    probe = run_dir / f".ddplab-write-test-{os.getpid()}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        with probe.open("wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
    except OSError as err:
        with contextlib.suppress(OSError):
            probe.unlink(missing_ok=True)
        raise ConfigError(f"hydra.run.dir={run_dir} cannot be written: {err}; choose another hydra.run.dir") from None
    probe.unlink()
    free = shutil.disk_usage(run_dir).free
    if free < needed_bytes:
        raise ConfigError(
            f"hydra.run.dir={run_dir} has {free / 2**20:.0f} MiB free, but this run needs about "
            f"{needed_bytes / 2**20:.0f} MiB (checkpoints of the model x trainer.keep_checkpoints, "
            "and logs): free space or choose another hydra.run.dir"
        )
