"""A parameter no rank used gets no update under sync=zero, though the optimizer steps on the whole
shard: its slice of the shard's parameters and per-element optimizer state is kept before the step
and put back after it (one process's optimizer skips a parameter without a gradient)."""

from __future__ import annotations

import torch
from torch.optim import Optimizer

Kept = list[tuple[torch.Tensor, torch.Tensor]]


def _per_element_state(shard: torch.Tensor, optimizer: Optimizer) -> dict[str, torch.Tensor]:
    state = optimizer.state.get(optimizer.param_groups[0]["params"][0], {})
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor) and v.shape == shard.shape}


def save_unused(
    shard: torch.Tensor, optimizer: Optimizer, slices: list[tuple[int, int]]
) -> tuple[list[tuple[int, int]], Kept]:
    """Copies of the shard's parameters and per-element optimizer state in `slices`, to put back after
    the step: one process's optimizer skips a parameter without a gradient."""
    if not slices:  # the usual step: nothing to keep, nothing looked up
        return slices, []
    tensors = [shard, *_per_element_state(shard, optimizer).values()]
    return slices, [(t[lo:hi], t[lo:hi].clone()) for t in tensors for lo, hi in slices]


def restore_unused(shard: torch.Tensor, optimizer: Optimizer, kept: tuple[list[tuple[int, int]], Kept]) -> None:
    """Put back what save_unused copied; state this step created (e.g. Adam's moments) starts at zero there."""
    slices, saved = kept
    if not slices:
        return
    with torch.no_grad():
        for view, copy in saved:
            view.copy_(copy)
        restored = {view.data_ptr() for view, _ in saved}
        for value in _per_element_state(shard, optimizer).values():
            for lo, hi in slices:
                if value[lo:hi].data_ptr() not in restored:
                    value[lo:hi].zero_()
