"""Manual data parallelism: broadcast rank 0's weights once, then average gradients by hand.

Consecutive gradients are grouped up to `coalesce_mb` MiB. A group of several small gradients
lives in a flat buffer allocated once, each .grad a view into it (trainer/sync/flat.py), so one
collective averages the group in place, with no copy into or out of a flat buffer. A gradient
that makes a group alone (larger than the cap, or coalesce_mb=0: the textbook loop) is
all-reduced in place in its own tensor: a persistent buffer would cost it a zeroing and an
accumulation pass per step, which for a 64 MB weight is a few percent of the step. With rs_ag
every group gets a buffer: reduce_scatter needs the length padded to a multiple of the world size.

A parameter that gets no gradient follows one rule in every grouping (trainer/sync/unused.py):
refused in the first step unless find_unused_parameters, which leaves one that no rank used
without a gradient (no update) and averages one that some rank used as sum / N.
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
from trainer.sync.flat import FlatGrads, plan
from trainer.sync.unused import UsedParams, names_of


def broadcast_from_rank0(model: nn.Module) -> None:
    """Same seed is not enough to trust: every replica starts from rank 0's parameters and buffers."""
    with torch.no_grad():
        for tensor in [*model.parameters(), *model.buffers()]:
            dist.broadcast(tensor, src=0)


class ManualSync(SyncStrategy):
    """The algorithm DDP automates, spelled out: all_reduce(SUM) and divide, after backward."""

    comm_in_sync_phase = True  # it communicates only in after_backward, which the trainer times

    def __init__(
        self, coalesce_mb: float = 25.0, collective: str = "all_reduce", find_unused_parameters: bool = False
    ) -> None:
        super().__init__()
        check(
            isinstance(find_unused_parameters, bool),
            "sync.find_unused_parameters",
            find_unused_parameters,
            "accepted: true or false",
        )
        self.find_unused_parameters = find_unused_parameters
        check(
            is_number(coalesce_mb) and coalesce_mb >= 0,
            "sync.coalesce_mb",
            coalesce_mb,
            "must be a number >= 0 (0: one buffer per gradient; >0: MiB per flat gradient buffer)",
        )
        self.coalesce_mb = float(coalesce_mb)
        self.collective = averaging.check_collective(collective)
        self._flat: FlatGrads | None = None
        self._alone: list[nn.Parameter] = []  # all-reduced in place, in their own .grad
        self._used: UsedParams | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        broadcast_from_rank0(model)
        params = [p for p in model.parameters() if p.requires_grad]
        groups = list(plan(params, int(self.coalesce_mb * 2**20)))
        in_place = self.collective == "all_reduce"
        self._alone = [group[0] for group in groups if in_place and len(group) == 1]
        self._flat = FlatGrads([group for group in groups if not in_place or len(group) > 1], dist.get_world_size())
        self._used = UsedParams(params, names_of(model, params), self.find_unused_parameters, "manual")
        return model

    def after_backward(self, model: nn.Module) -> None:
        assert self._flat is not None and self._used is not None, "wrap() first"
        # Before any gradient collective: a refusal (first step) happens on every rank alike.
        unused = self._used.unused_everywhere()
        self._flat.bind()  # a no-op unless something replaced a gradient (e.g. zero_grad(set_to_none))
        world_size = dist.get_world_size()
        for index, bucket in enumerate(self._flat.buckets):
            averaging.average(bucket, self.collective, world_size, index)
            averaging.count(self.comm, bucket, self.collective)
        skip = {id(self._used.params[i]) for i in unused}
        for param in self._alone:
            if id(param) in skip:
                continue  # no rank used it: it keeps no gradient, as in one process
            if param.grad is None:  # unused here, used on another rank: this rank adds zeros to the sum
                param.grad = torch.zeros_like(param)
            grad = param.grad
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            grad.div_(world_size)
            nbytes = grad.numel() * grad.element_size()
            self.comm.bytes += nbytes
            self.comm.add("all_reduce", nbytes)
        for index in unused:  # its view holds zeros; None makes the optimizer skip it (bind() restores it)
            self._used.params[index].grad = None

    def zero_grad(self, optimizer: Optimizer) -> None:
        assert self._flat is not None, "wrap() first"
        self._flat.zero()
        for param in self._alone:  # autograd then hands the next gradient over without a copy
            param.grad = None

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "strategy": "manual",
            "coalesce_mb": self.coalesce_mb,
            "collective": self.collective,
            "find_unused_parameters": self.find_unused_parameters,
        }
        if self._flat is not None:
            info["num_buffers"] = len(self._flat.buckets)
            info["buffer_sizes_bytes"] = self._flat.sizes()
            info["num_reduced_in_place"] = len(self._alone)
        return info
