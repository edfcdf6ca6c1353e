"""Manual data parallelism: broadcast rank 0's weights once, then average gradients by hand."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from trainer.errors import check, is_number
from trainer.sync.base import SyncStrategy


def average_gradients(grads: Iterable[torch.Tensor], world_size: int) -> int:
    """all_reduce(SUM) every gradient, then divide by world_size; returns the number of calls.

    Every rank must call this with the same gradients in the same order: the collectives are
    matched by position, so a rank that skips one would pair its calls with the wrong tensors.
    """
    calls = 0
    for grad in grads:
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        grad.div_(world_size)
        calls += 1
    return calls


def coalesce(grads: list[torch.Tensor], cap_bytes: int) -> Iterator[list[torch.Tensor]]:
    """Consecutive groups of gradients of at most cap_bytes each (a larger tensor goes alone)."""
    group: list[torch.Tensor] = []
    size = 0
    for grad in grads:
        nbytes = grad.numel() * grad.element_size()
        if group and (size + nbytes > cap_bytes or grad.dtype != group[0].dtype):
            yield group
            group, size = [], 0
        group.append(grad)
        size += nbytes
    if group:
        yield group


def average_gradients_coalesced(grads: list[torch.Tensor], world_size: int, cap_bytes: int) -> int:
    """The same average with one all_reduce per flattened group: fewer, larger calls.

    Costs a copy into and out of each flat buffer; wins when per-call latency dominates (many
    small gradients). Elementwise the sums are the same as per-tensor calls.
    """
    calls = 0
    for group in coalesce(grads, cap_bytes):
        calls += 1
        if len(group) == 1:  # nothing to coalesce: reduce in place, no copies
            average_gradients(group, world_size)
            continue
        flat = torch.cat([g.reshape(-1) for g in group])
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        flat.div_(world_size)
        offset = 0
        for grad in group:
            grad.copy_(flat[offset : offset + grad.numel()].view_as(grad))
            offset += grad.numel()
    return calls


class ManualSync(SyncStrategy):
    """The algorithm DDP automates, spelled out: all_reduce(SUM) and divide, after backward."""

    comm_in_sync_phase = True  # it communicates only in after_backward, which the trainer times

    def __init__(self, coalesce_mb: float = 25.0) -> None:
        super().__init__()
        check(
            is_number(coalesce_mb) and coalesce_mb >= 0,
            "sync.coalesce_mb",
            coalesce_mb,
            "must be a number >= 0 (0: one all_reduce per gradient; >0: MiB per flattened all_reduce)",
        )
        self.coalesce_mb = float(coalesce_mb)

    def wrap(self, model: nn.Module) -> nn.Module:
        # Same seed is not enough to trust: broadcast so every replica starts from rank 0's state.
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                dist.broadcast(tensor, src=0)
        return model

    def after_backward(self, model: nn.Module) -> None:
        grads = [p.grad for p in model.parameters() if p.requires_grad and p.grad is not None]
        world_size = dist.get_world_size()
        if self.coalesce_mb > 0:
            calls = average_gradients_coalesced(grads, world_size, int(self.coalesce_mb * 2**20))
        else:
            calls = average_gradients(grads, world_size)
        self.comm.bytes += sum(g.numel() * g.element_size() for g in grads)
        self.comm.collectives += calls

    def describe(self) -> dict[str, Any]:
        return {"strategy": "manual", "coalesce_mb": self.coalesce_mb}
