"""Manual data parallelism, as the DDP notes' version 1 does it by hand:

1. wrap(): broadcast rank 0's parameters and buffers, so that every replica starts equal.
2. forward and backward run locally, each rank on its own batch.
3. after_backward(): every gradient is summed across ranks with all_reduce(SUM), waited for, then
   divided by world_size: every rank now holds the average, so the same local optimizer step keeps
   the replicas equal. (collective=rs_ag does the notes' identity instead: reduce_scatter, divide
   the shard, all_gather.)

Sending each gradient tensor alone costs a collective's latency per tensor, so consecutive small
gradients share a flat buffer of up to `coalesce_mb` MiB, allocated once, each .grad a view into it:
one collective averages the group in place, with no copy in or out. A gradient that makes a group
alone (above the cap, or coalesce_mb=0: the textbook loop) is all-reduced where autograd put it.
rs_ag gives every group a buffer: reduce_scatter needs a length that splits evenly.

A parameter without a gradient (trainer/sync/unused.py's rule): before any gradient collective the
ranks agree on which parameters got one (a small all_reduce, in step 1 only, or in every step with
find_unused_parameters=true). Without the flag, one missing on some rank is refused; with it, one
no rank used keeps no gradient (no update, as in one process) and one some rank used is sum / N.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn
from torch.optim import Optimizer

from trainer.comm_schedule import Buckets, Hop, Schedule
from trainer.footprint import Footprint, Plan
from trainer.sync.base import SyncStrategy
from trainer.sync.flat import Collective, FlatGrads, group_by_size, names_of
from trainer.sync.unused import Arrivals


class ManualSync(SyncStrategy):
    """The algorithm DDP automates, spelled out: all_reduce(SUM) and divide, after backward."""

    name = "manual"

    def __init__(
        self,
        coalesce_mb: Annotated[float, Field(ge=0, description="0: one buffer per gradient tensor")] = 25.0,
        collective: Collective = "all_reduce",
        find_unused_parameters: bool = False,
    ) -> None:
        super().__init__()
        self.coalesce_mb = float(coalesce_mb)
        self.collective = collective
        self._shards = collective == "rs_ag"  # each flat buffer gets a shard to reduce into
        self.find_unused_parameters = find_unused_parameters
        self._flat: FlatGrads | None = None  # groups of gradients, one flat buffer each
        self._in_place: list[nn.Parameter] = []  # gradients all-reduced alone, where autograd put them
        self._arrivals: Arrivals | None = None

    def wrap(self, model: nn.Module) -> nn.Module:
        self.comm.broadcast_parameters(model)
        params = [p for p in model.parameters() if p.requires_grad]
        flat, self._in_place = self._split(params)
        self._flat = FlatGrads(flat, dist.get_world_size(), self._shards)
        self.comm.holds(self._flat.held)  # its shards (rs_ag), beyond the .grad views the probe sees
        names = names_of(model, params)
        self._arrivals = Arrivals(params, names, self.comm, "manual", self.find_unused_parameters)
        return model

    def _split(self, params: list[nn.Parameter]) -> tuple[list[list[nn.Parameter]], list[nn.Parameter]]:
        """The groups of up to coalesce_mb that share a flat buffer, and the gradients all-reduced alone."""
        groups = list(group_by_size(params, int(self.coalesce_mb * 2**20)))
        alone = self.collective == "all_reduce"
        return [g for g in groups if not alone or len(g) > 1], [g[0] for g in groups if alone and len(g) == 1]

    def after_backward(self, model: nn.Module) -> None:
        assert self._flat is not None and self._arrivals is not None, "wrap() first"
        comm, world_size = self.comm, dist.get_world_size()
        # Before any gradient collective, so that a refusal happens on every rank alike.
        no_rank_used = [self._arrivals.params[i] for i in self._arrivals.unused_everywhere()]
        self._flat.bind()  # a no-op unless something replaced a gradient (e.g. zero_grad(set_to_none))
        for index, bucket in enumerate(self._flat.buckets):
            if self.collective == "all_reduce":
                comm.all_reduce(bucket.grads, index).wait()
                bucket.grads.div_(world_size)
            else:  # all_reduce = reduce_scatter + all_gather
                comm.reduce_scatter(bucket.shard, bucket.buffer, index).wait()
                bucket.shard.div_(world_size)
                comm.all_gather(bucket.buffer, bucket.shard, index).wait()
        for param in self._in_place:
            if any(param is p for p in no_rank_used):
                continue  # no rank used it: it keeps no gradient, as in one process
            if param.grad is None:  # unused here, used on another rank: this rank adds zeros to the sum
                param.grad = torch.zeros_like(param)
            comm.all_reduce(param.grad).wait()
            param.grad.div_(world_size)
        for param in no_rank_used:  # its view holds zeros; None makes the optimizer skip it (bind() restores it)
            param.grad = None

    def zero_grad(self, optimizer: Optimizer) -> None:
        assert self._flat is not None, "wrap() first"
        self._flat.zero()
        for param in self._in_place:  # autograd then hands the next gradient over without a copy
            param.grad = None

    def footprint(self, plan: Plan) -> Footprint:
        """Its flat buffers (padded) and their shards, and the gradients all-reduced alone, one at a time."""
        flat, alone = self._split(plan.trainable)
        return FlatGrads.replica(plan, flat, plan.world_size, self._shards, alone, at_once=1)

    def facts(self) -> dict[str, Any]:
        if self._flat is None:
            return {}
        sizes = self._flat.sizes()
        return {"num_buffers": len(sizes), "buffer_sizes_bytes": sizes, "num_reduced_in_place": len(self._in_place)}

    def schedule(self) -> Schedule:
        """Every buffer of coalesce_mb, in registration order, averaged after backward: all_reduce, or
        reduce_scatter then all_gather."""
        hops = (Hop("all_reduce"),) if self.collective == "all_reduce" else (Hop("reduce_scatter"), Hop("all_gather"))
        return Schedule(Buckets(self.coalesce_mb, order="registration", overlap=False, hops=hops))
