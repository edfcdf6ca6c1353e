"""Manual data parallelism: broadcast rank 0's weights once, then average gradients by hand.

The gradients live in flat buffers of up to `coalesce_mb` MiB (trainer/sync/flat.py), allocated
once, each parameter's .grad a view into one: after backward, one collective per buffer averages
them in place, with no copy into or out of a flat buffer. coalesce_mb=0 gives each gradient its
own buffer: the textbook loop, one all_reduce per gradient.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from trainer.errors import check, is_number
from trainer.sync import averaging
from trainer.sync.base import SyncStrategy
from trainer.sync.flat import FlatGrads


def broadcast_from_rank0(model: nn.Module) -> None:
    """Same seed is not enough to trust: every replica starts from rank 0's parameters and buffers."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)


class ManualSync(SyncStrategy):
    """The algorithm DDP automates, spelled out: all_reduce(SUM) and divide, after backward."""

    comm_in_sync_phase = True  # it communicates only in after_backward, which the trainer times

    def __init__(self, coalesce_mb: float = 25.0, collective: str = "all_reduce") -> None:
        super().__init__()
        check(
            is_number(coalesce_mb) and coalesce_mb >= 0,
            "sync.coalesce_mb",
            coalesce_mb,
            "must be a number >= 0 (0: one buffer per gradient; >0: MiB per flat gradient buffer)",
        )
        self.coalesce_mb = float(coalesce_mb)
        self.collective = averaging.check_collective(collective)
        self._flat: FlatGrads | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        broadcast_from_rank0(model)
        params = [p for p in model.parameters() if p.requires_grad]
        self._flat = FlatGrads(params, int(self.coalesce_mb * 2**20), dist.get_world_size())
        return model

    def after_backward(self, model: nn.Module) -> None:
        assert self._flat is not None, "wrap() first"
        self._flat.bind()  # a no-op unless something replaced a gradient (e.g. zero_grad(set_to_none))
        world_size = dist.get_world_size()
        for bucket in self._flat.buckets:
            averaging.average(bucket, self.collective, world_size)
            averaging.count(self.comm, bucket, self.collective)

    def zero_grad(self, optimizer: Optimizer) -> None:
        assert self._flat is not None, "wrap() first"
        self._flat.zero()

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"strategy": "manual", "coalesce_mb": self.coalesce_mb, "collective": self.collective}
        if self._flat is not None:
            info["num_buffers"] = len(self._flat.buckets)
            info["buffer_sizes_bytes"] = self._flat.sizes()
        return info
