"""Averaging one flat bucket across ranks: all_reduce, or reduce_scatter then all_gather.

The notes' identity, all_reduce = reduce_scatter + all_gather, made runnable: reduce_scatter
leaves each rank the sum of its 1/N shard of the buffer, the shard is divided by N, and
all_gather puts every rank's averaged shard back into every rank's buffer. Each element is summed
over the same ranks either way; on gloo the two give bit-identical results (a test checks it).

Both run in two halves so that a strategy can start the first while backward continues and
finish it later: start() issues the first collective asynchronously, finish() waits for it,
divides, and (rs_ag) runs the all_gather. Every rank must start and finish the same buckets in
the same order: collectives are paired by the order they are issued.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch.distributed as dist

from trainer import spans
from trainer.errors import check
from trainer.sync.comm import CommCounters
from trainer.sync.flat import Bucket

COLLECTIVES = ("all_reduce", "rs_ag")
# The flat-tensor forms under their torch >= 2.14 names, or the older ones (deprecated there).
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Waitable(Protocol):
    """A collective in flight: a dist.Work, or a future chained to one."""

    def wait(self) -> Any: ...


def check_collective(collective: str) -> str:
    check(
        collective in COLLECTIVES,
        "sync.collective",
        collective,
        "accepted: all_reduce (one all_reduce per buffer) or rs_ag (reduce_scatter, then all_gather)",
    )
    return collective


def start(bucket: Bucket, collective: str, index: int | None = None) -> dist.Work:
    """Issue the bucket's first collective (SUM) without waiting for it.

    With trainer.profile=true the launch runs inside a range naming it (`bucket 3 all_reduce
    1.0 MiB`, index 3) for the profiler's trace; otherwise this costs one global read.
    """
    if spans.recording:
        kind, nbytes = (
            ("all_reduce", bucket.nbytes) if collective == "all_reduce" else ("reduce_scatter", bucket.padded_nbytes)
        )
        with spans.named(kind, nbytes, index):
            return _start(bucket, collective)
    return _start(bucket, collective)


def _start(bucket: Bucket, collective: str) -> dist.Work:
    if collective == "all_reduce":
        work: dist.Work | None = dist.all_reduce(bucket.grads, op=dist.ReduceOp.SUM, async_op=True)
    else:
        work = reduce_scatter_tensor(bucket.shard, bucket.buffer, op=dist.ReduceOp.SUM, async_op=True)
    assert work is not None, "async_op=True returns the collective's Work"
    return work


def finish(
    bucket: Bucket, collective: str, work: Waitable, world_size: int, index: int | None = None
) -> dist.Work | None:
    """Wait for start()'s collective and divide; for rs_ag, return the all_gather still in flight."""
    work.wait()
    if collective == "all_reduce":
        bucket.grads.div_(world_size)
        return None
    bucket.shard.div_(world_size)
    if spans.recording:
        with spans.named("all_gather", bucket.padded_nbytes, index):
            return all_gather_tensor(bucket.buffer, bucket.shard, async_op=True)
    return all_gather_tensor(bucket.buffer, bucket.shard, async_op=True)


def average(bucket: Bucket, collective: str, world_size: int, index: int | None = None) -> None:
    """Both halves back to back: the bucket holds the average on every rank when this returns."""
    gather = finish(bucket, collective, start(bucket, collective, index), world_size, index)
    if gather is not None:
        gather.wait()


def count(comm: CommCounters, bucket: Bucket, collective: str) -> None:
    """What one bucket's average sends: its gradient bytes, and each collective by kind."""
    comm.bytes += bucket.nbytes
    if collective == "all_reduce":
        comm.add("all_reduce", bucket.nbytes)
    else:  # both operate on the padded buffer (the input of one, the output of the other)
        comm.add("reduce_scatter", bucket.padded_nbytes)
        comm.add("all_gather", bucket.padded_nbytes)
