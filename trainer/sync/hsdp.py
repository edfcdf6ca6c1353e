"""HSDP (hybrid sharded data parallelism): FSDP2 inside each node, replicas across nodes, on the 2-D
mesh of `sync.replicate` nodes of `sync.shard` ranks (trainer/sync/mesh.py).

What torch does: everything sync=fsdp's FSDP2 does (trainer/sync/fsdp.py), with each unit split
across the ranks of one node only (the mesh's shard dimension): a unit's forward all-gathers its
parameters inside the node, its backward reduce-scatters the gradients inside the node, so the
fast link carries both; each node holds a whole copy of the model between its ranks.

What ddplab adds: the step across nodes. After a unit's reduce-scatter each rank holds its node's
average of its 1/shard of the unit's gradients; FSDP2's all-reduce hook (FSDPModule.
set_all_reduce_hook, which runs right after it) all-reduces that shard with the ranks holding the
same shard in the other nodes (the mesh's replicate dimension), through `self.comm`, and divides by
the number of nodes: the average over every rank. Only this shard crosses the slow link. (FSDP2's
own HSDP, fully_shard on both dimensions, makes that all-reduce a direct torch call the lab could
not emulate, time or name; its result is the same.)

The optimizer steps each rank's shard; checkpoints (both formats) speak in the full model's terms
as fsdp's do, so they resume at another world size and under another strategy.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from trainer.comm_schedule import Hop, Schedule, ShardedUnits
from trainer.sync import mesh
from trainer.sync.fsdp import CheckEveryForward, FSDPSync, ReshardAfterForward, Units


class HSDPSync(FSDPSync):
    """FSDP2 inside each node; the gradient shards all-reduced across the nodes."""

    name = "hsdp"

    def __init__(
        self,
        *,
        reshard_after_forward: ReshardAfterForward = True,
        wrap: Units = "auto",
        find_unused_parameters: CheckEveryForward = False,
        replicate: mesh.Replicate = None,
        shard: mesh.Shard,  # no default here: the YAML's is the node's ranks, ${network.gpus_per_node}
    ) -> None:
        super().__init__(reshard_after_forward, wrap, find_unused_parameters)
        self.replicate, self.shard = replicate, shard
        self._peers: object = None  # the ranks holding this rank's shard in the other nodes
        self._nodes = 1

    def check_world_size(self, world_size: int) -> None:
        mesh.sizes(self.replicate, self.shard, world_size)

    def shards(self, world_size: int) -> int:
        return mesh.sizes(self.replicate, self.shard, world_size)[1]

    def device_mesh(self, device: torch.device) -> DeviceMesh:
        """FSDP2 splits each unit across the mesh's shard dimension: the ranks of this node."""
        two_level = mesh.two_level_mesh(self.replicate, self.shard, dist.get_world_size(), device)
        self._nodes, self._peers = two_level.shape[0], mesh.groups(two_level)[1]
        self.replicate, self.shard = two_level.shape  # resolved: the sync line shows what runs
        self.norm_copies = self._nodes  # every shard is held by one rank in each node
        return two_level["shard"]

    def connect(self, unit: FSDPModule, label: str) -> None:
        super().connect(unit, label)
        unit.set_all_reduce_hook(partial(self._across_nodes, f"hsdp unit {label}"))

    def _across_nodes(self, label: str, shard: torch.Tensor) -> None:
        """After the unit's reduce-scatter: the node's average of this rank's shard, averaged over the nodes."""
        self.comm.all_reduce(shard, label, group=self._peers).wait()
        shard.div_(self._nodes)

    def schedule(self) -> Schedule:
        """fsdp's units, gathered and reduce-scattered inside the node; each reduced shard all_reduced
        across nodes; the optimizer steps this rank's 1/shard."""
        units = ShardedUnits(
            self.wrap_policy,
            gather=Hop("all_gather", "node"),
            scatter=(Hop("reduce_scatter", "node"), Hop("all_reduce", "nodes", "node")),
            reshard_after_forward=self.reshard_after_forward,
        )
        return Schedule(units, optimizer_shard="node")

    def facts(self) -> dict[str, object]:
        facts = super().facts()
        layout = [self._nodes, self._world_size]
        return facts and {**facts, "mesh_replicate_x_shard": layout, "levels": mesh.levels(*layout)}
