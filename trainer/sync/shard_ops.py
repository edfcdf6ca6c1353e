"""How zero reduces a bucket to this rank's shard and gathers every rank's shard: per backend, the
fastest of torch.distributed's own collectives for the job.

NCCL (and any other backend): reduce_scatter into the shard, all_gather of the shards: each moves
half an all_reduce's bytes, as ZeRO intends.

gloo: its reduce_scatter and all_gather are slow paths. Measured here (2 CPU ranks, 64 MiB of
fp32): all_reduce 43 ms, reduce_scatter 85 ms, all_gather 70 ms, but one broadcast from each rank
of its shard 20 ms. So on gloo a bucket is all_reduced in place and this rank's slice copied into
its shard (the full bucket is held until then either way: the staged gradient), and the shards
are gathered by one broadcast per rank, each from its owner (as ZeroRedundancyOptimizer
broadcasts its parameters). Same bytes on every rank, bit-identical results: only the
collectives differ, and comm/* counts the ones really issued.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer import spans
from trainer.sync import averaging


class ShardOps:
    """reduce(): a bucket's SUM, leaving this rank's slice for take(); gather(): every slice into every rank."""

    def __init__(self, backend: str, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.native = backend != "gloo"
        self.reduce_kind = "reduce_scatter" if self.native else "all_reduce"
        self.gather_kind = "all_gather" if self.native else "broadcast"

    def reduce(self, shard: torch.Tensor, full: torch.Tensor, bucket: int) -> dist.Work:
        """Start summing `full` (a padded bucket) across ranks; take() then fills `shard` from it.
        Launched in its range for trainer.profile's trace (`bucket 3 all_reduce ...`), as gather()'s."""
        if not self.native:
            return self.all_reduce(full, bucket)
        with spans.named(self.reduce_kind, full.numel() * full.element_size(), bucket):
            work = averaging.reduce_scatter_tensor(shard, full, op=dist.ReduceOp.SUM, async_op=True)
        assert work is not None, "async_op=True returns the collective's Work"
        return work

    def all_reduce(self, full: torch.Tensor, bucket: int) -> dist.Work:
        """Start summing `full` in place across ranks (gloo's reduce; stage 1's lone tensor), in its range."""
        with spans.named("all_reduce", full.numel() * full.element_size(), bucket):
            work = dist.all_reduce(full, op=dist.ReduceOp.SUM, async_op=True)
        assert work is not None, "async_op=True returns the collective's Work"
        return work

    def take(self, shard: torch.Tensor, full: torch.Tensor, divisor: int) -> None:
        """After reduce()'s wait: this rank's slice of the summed bucket, divided, in its shard
        (on gloo read from the bucket in the same pass: one pass over the slice, not a copy and a division)."""
        if self.native:
            shard.div_(divisor)
        else:
            size = shard.numel()
            torch.div(full[self.rank * size : (self.rank + 1) * size], divisor, out=shard)

    def gather(self, full: torch.Tensor, mine: torch.Tensor, bucket: int) -> list[dist.Work]:
        """Start filling `full` (a padded bucket) with every rank's slice; `mine` is this rank's.
        Each collective launches in its range for trainer.profile's trace (`bucket 3 broadcast ...`)."""
        if self.native:
            with spans.named(self.gather_kind, full.numel() * full.element_size(), bucket):
                work = averaging.all_gather_tensor(full, mine, async_op=True)
            assert work is not None
            return [work]
        size = mine.numel()
        works = []
        for owner in range(self.world_size):  # every rank issues the same broadcasts, in the same order
            tensor = mine if owner == self.rank else full[owner * size : (owner + 1) * size]
            with spans.named(self.gather_kind, size * mine.element_size(), bucket):
                work = dist.broadcast(tensor, src=owner, async_op=True)
            assert work is not None
            works.append(work)
        full[self.rank * size : (self.rank + 1) * size].copy_(mine)
        return works
