"""The hierarchical all-reduce by hand (NCCL's and Horovod's two-level form), on a 2-D mesh of the
ranks: `sync.replicate` nodes of `sync.shard` ranks (trainer/sync/mesh.py).

A flat ring of every rank sends each rank's 2(N-1)/N of the gradients over its slowest hop, the
link between nodes. Split in two levels, only 1/shard of them crosses it:

1. wrap(): rank 0's parameters and buffers are broadcast; the gradients live in flat buckets of up
   to `bucket_cap_mb` (each .grad a view), padded to a multiple of `shard`.
2. forward and backward run locally.
3. after_backward(), per bucket, pipelined (bucket i+1's step 1 runs while bucket i's step 2 does):
   1. reduce_scatter inside the node: each of its ranks holds the node's sum of its 1/shard;
   2. all_reduce that shard across the nodes, with the rank holding the same shard in each node:
      now it is the sum over every rank; divided by the world size, the average;
   3. all_gather inside the node: every rank holds the whole averaged bucket.
   The same averages as one all_reduce of every rank, so the same local optimizer step keeps the
   replicas equal.

A parameter without a gradient follows manual's rule (trainer/sync/unused.py), with the same
`find_unused_parameters` key.
"""

from __future__ import annotations

from typing import Annotated, Any

import torch.distributed as dist
from pydantic import Field
from torch import nn
from torch.optim import Optimizer

from trainer.comm_schedule import Buckets, Hop, Schedule
from trainer.footprint import Footprint, Plan
from trainer.sync import mesh
from trainer.sync.base import SyncStrategy
from trainer.sync.flat import FlatGrads, group_by_size, names_of
from trainer.sync.unused import Arrivals


class HierarchicalSync(SyncStrategy):
    """Reduce-scatter inside each node, all-reduce the shards across nodes, all-gather inside the node."""

    name = "hierarchical"

    def __init__(
        self,
        *,
        bucket_cap_mb: Annotated[float, Field(gt=0, description="MiB of gradients per bucket")] = 25.0,
        replicate: mesh.Replicate = None,
        shard: mesh.Shard,  # no default here: the YAML's is the node's ranks, ${network.gpus_per_node}
        find_unused_parameters: Annotated[
            bool, Field(description="a flag per parameter and a small all_reduce per step (sync=manual's rule)")
        ] = False,
    ) -> None:
        super().__init__()
        self.bucket_cap_mb, self.replicate, self.shard = float(bucket_cap_mb), replicate, shard
        self.find_unused_parameters = find_unused_parameters
        self._node: Any = None  # this rank's node: the ranks that split each bucket
        self._peers: Any = None  # the ranks holding this rank's shard, one in each node
        self._flat: FlatGrads | None = None
        self._arrivals: Arrivals | None = None

    def check_world_size(self, world_size: int) -> None:
        mesh.sizes(self.replicate, self.shard, world_size)

    def wrap(self, model: nn.Module) -> nn.Module:
        self.comm.broadcast_parameters(model)
        device = next(model.parameters()).device
        two_level = mesh.two_level_mesh(self.replicate, self.shard, dist.get_world_size(), device)
        self.replicate, self.shard = two_level.shape  # resolved: the sync line shows what runs
        self._node, self._peers = mesh.groups(two_level)
        params = [p for p in model.parameters() if p.requires_grad]
        self._flat = FlatGrads(self._groups(params), self.shard)
        self.comm.holds(self._flat.held)  # its shards, beyond the .grad views the probe sees
        self._arrivals = Arrivals(params, names_of(model, params), self.comm, self.name, self.find_unused_parameters)
        return model

    def _groups(self, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        return list(group_by_size(params, int(self.bucket_cap_mb * 2**20)))

    def after_backward(self, model: nn.Module) -> None:
        assert self._flat is not None and self._arrivals is not None, "wrap() first"
        comm, world_size, buckets = self.comm, dist.get_world_size(), self._flat.buckets
        # Before any gradient collective, so that a refusal happens on every rank alike.
        no_rank_used = [self._arrivals.params[i] for i in self._arrivals.unused_everywhere()]
        self._flat.bind()
        inside = [comm.reduce_scatter(b.shard, b.buffer, i, group=self._node) for i, b in enumerate(buckets)]
        across = []
        for index, (bucket, work) in enumerate(zip(buckets, inside, strict=True)):
            work.wait()
            across.append(comm.all_reduce(bucket.shard, index, group=self._peers))
        gathers = []
        for index, (bucket, work) in enumerate(zip(buckets, across, strict=True)):
            work.wait()
            bucket.shard.div_(world_size)  # the sum over every rank: the average
            gathers.append(comm.all_gather(bucket.buffer, bucket.shard, index, group=self._node))
        for work in gathers:
            work.wait()
        for param in no_rank_used:  # its view holds zeros; None makes the optimizer skip it (bind() restores it)
            param.grad = None

    def zero_grad(self, optimizer: Optimizer) -> None:
        assert self._flat is not None, "wrap() first"
        self._flat.zero()

    def schedule(self) -> Schedule:
        """Buckets in registration order, each after backward: reduce_scatter inside the node, all_reduce
        of its 1/shard across nodes, all_gather inside the node."""
        hops = (Hop("reduce_scatter", "node"), Hop("all_reduce", "nodes", "node"), Hop("all_gather", "node"))
        return Schedule(Buckets(self.bucket_cap_mb, order="registration", overlap=False, hops=hops))

    def footprint(self, plan: Plan) -> Footprint:
        """A replica's, with its buckets padded to the node's ranks and each one's shard."""
        return FlatGrads.replica(plan, self._groups(plan.trainable), self.shard)  # every reduce_scatter, then waits

    def facts(self) -> dict[str, Any]:
        if self._flat is None:
            return {}
        sizes, layout = self._flat.sizes(), mesh.sizes(self.replicate, self.shard, dist.get_world_size())
        facts = {"num_buckets": len(sizes), "bucket_sizes_bytes": sizes, "mesh_replicate_x_shard": list(layout)}
        return facts | {"levels": mesh.levels(*layout)}
