"""Training metrics kept on the device between logged steps, and exact evaluation."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader


class Window:
    """Running sums between two logged steps, kept on the device so unlogged steps never sync."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.reset()

    def reset(self) -> None:
        self.loss_sum = torch.zeros((), device=self.device)
        self.correct = torch.zeros((), dtype=torch.int64, device=self.device)
        self.samples = 0
        self.steps = 0
        self.started = time.perf_counter()

    def add(self, loss: torch.Tensor, logits: torch.Tensor, targets: torch.Tensor) -> None:
        self.loss_sum += loss.detach().float()
        self.correct += (logits.detach().argmax(dim=-1) == targets).sum()
        self.samples += targets.shape[0]


@torch.no_grad()
def evaluate(model: nn.Module, loader: DataLoader, device: torch.device,
             autocast: Callable[[], AbstractContextManager[Any]]) -> dict[str, float]:  # fmt: skip
    """eval/loss and eval/accuracy over every rank's shard, summed across ranks: the same on all.

    Takes the unwrapped model: DDP's forward would broadcast buffers, and ranks' shards may differ
    in length by one batch, so a collective inside this loop could pair up wrongly.
    """
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=device)  # loss, correct, count
    for inputs, targets in loader:
        inputs = inputs.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        with autocast():
            logits = model(inputs)
        sums[0] += F.cross_entropy(logits.float(), targets, reduction="sum")
        sums[1] += (logits.argmax(dim=-1) == targets).sum()
        sums[2] += targets.shape[0]
    dist.all_reduce(sums)  # every rank reaches this exactly once per evaluation
    model.train()
    loss_sum, correct, count = sums.tolist()
    if count == 0:
        return {}
    return {"eval/loss": loss_sum / count, "eval/accuracy": correct / count}
