"""Manual data parallelism: broadcast rank 0's weights once, then average gradients by hand."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.sync.base import SyncStrategy


def average_gradients(params: Iterable[torch.Tensor], world_size: int) -> int:
    """all_reduce(SUM) every gradient, then divide by world_size; returns the bytes reduced.

    Every rank must call this with the same parameters in the same order: the collectives are
    matched by position, so a rank that skips one would pair its calls with the wrong tensors.
    """
    num_bytes = 0
    for param in params:
        if param.grad is None:
            continue
        dist.all_reduce(param.grad, op=dist.ReduceOp.SUM)
        param.grad.div_(world_size)
        num_bytes += param.grad.numel() * param.grad.element_size()
    return num_bytes


class ManualSync(SyncStrategy):
    """The algorithm DDP automates, spelled out: one all_reduce per gradient after backward."""

    def __init__(self) -> None:
        self._bytes_per_step = 0
        self._num_tensors = 0

    def wrap(self, model: nn.Module) -> nn.Module:
        # Same seed is not enough to trust: broadcast so every replica starts from rank 0's state.
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        return model

    def after_backward(self, model: nn.Module) -> None:
        params = [p for p in model.parameters() if p.requires_grad]
        self._num_tensors = sum(p.grad is not None for p in params)
        self._bytes_per_step = average_gradients(params, dist.get_world_size())

    def describe(self) -> dict[str, Any]:
        return {"strategy": "manual", "num_tensors": self._num_tensors, "bytes_per_step": self._bytes_per_step}
