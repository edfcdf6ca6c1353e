"""Checkpoints that are written atomically and can be loaded without running code."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write to a temporary file, fsync, then rename: a crash never leaves a half-written last.pt."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def load_checkpoint(path: Path) -> dict[str, Any]:
    """weights_only=True: a checkpoint holds tensors and plain data, never a pickled callable."""
    return torch.load(path, map_location="cpu", weights_only=True)
