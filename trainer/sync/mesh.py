"""The two-level layout of the ranks that sync=hsdp and sync=hierarchical share: `sync.replicate`
groups of `sync.shard` consecutive ranks, as torch's 2-D DeviceMesh of torchrun's ranks.

The mesh's rows are the shard groups (consecutive ranks: the ranks of one node, as torchrun numbers
them and as network.gpus_per_node makes the emulated nodes); its columns are the replicate groups
(one rank of each node: the ranks that hold the same shard). Inside a shard group the fast link
carries the whole buffer; across nodes only each rank's 1/shard of it travels.

`sync.shard` defaults to `${network.gpus_per_node}`, the one home of "ranks per node": the emulated
node's size, or with no emulated network (conf/network/none.yaml) the ranks per node torchrun
reports (LOCAL_WORLD_SIZE). So on a real cluster the mesh has two levels without a word from the
user, and on one node of N it is one level, which the sync line says (`levels`).

The keys are declared here once (both strategies' signatures use them) and checked against the
world size before any rank builds a model (`sizes`, called by precheck and by the builder).
"""

from __future__ import annotations

from typing import Annotated, Any

import torch
from pydantic import Field
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from trainer.errors import ConfigError

Replicate = Annotated[
    int | None, Field(ge=1, description="groups that hold the same shard (one rank per node); null: world size / shard")
]
Shard = Annotated[int, Field(ge=1, description="consecutive ranks that split the buffer (one node's)")]

DIMS = ("replicate", "shard")  # the mesh's dimension names, as torchtitan names them


def sizes(replicate: int | None, shard: int, world_size: int) -> tuple[int, int]:
    """(replicate, shard) for this world size, null replicate filled in; refused in one line naming
    both keys when their product is not the world size."""
    if replicate is None and world_size % shard == 0:
        return world_size // shard, shard
    if replicate is not None and replicate * shard == world_size:
        return replicate, shard
    divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
    given = "null" if replicate is None else str(replicate)
    raise ConfigError(
        f"sync.replicate={given} x sync.shard={shard} is invalid on {world_size} rank(s): accepted: "
        f"replicate x shard = {world_size}, shard one of {', '.join(map(str, divisors))} "
        "(sync.replicate=null: world size / shard)"
    )


def levels(replicate: int, shard: int) -> str:
    """For the sync line: two levels, or one and why (one node holds every rank, or every node one)."""
    ranks = replicate * shard
    if replicate > 1 and shard > 1:
        return f"two levels: {replicate} nodes of {shard} ranks"
    if ranks == 1:
        return "one level: 1 rank"
    if replicate == 1:
        return f"one level: all {ranks} ranks on one node; two levels need nodes > 1"
    return f"one level: {ranks} nodes of 1 rank; two levels need sync.shard > 1 (ranks per node)"


def two_level_mesh(replicate: int | None, shard: int, world_size: int, device: torch.device) -> DeviceMesh:
    """The (replicate, shard) DeviceMesh of every rank; every rank must call it (it makes the groups)."""
    return init_device_mesh(device.type, sizes(replicate, shard, world_size), mesh_dim_names=DIMS)


def groups(mesh: DeviceMesh) -> tuple[Any, Any]:
    """(this rank's shard group: its node; its replicate group: its peers in the other nodes)."""
    return mesh.get_group("shard"), mesh.get_group("replicate")
