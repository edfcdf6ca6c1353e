"""On NCCL, a timed collective's wait must order the current stream after the collective.

One rank on one GPU (NCCL refuses two ranks on one device). The collective is issued from a side
stream that first sleeps and then changes the bucket, so NCCL's stream (which waits for the
issuing stream) finishes long after the host returns; the default stream then reads the bucket
right after the communication object's timed wait. Only a wait that makes the default stream wait
for NCCL's sees the change.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.observer import Observer
from trainer.sync.comm import Comm
from trainer.sync.flat import FlatGrads


@pytest.mark.gpu
def test_timed_wait_orders_the_stream_after_nccl(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        comm = Comm(observer=Observer(torch.device("cuda:0"), every=1))
        comm.observer.begin_step(1)  # a sampled step: the collective is watched
        param = torch.nn.Parameter(torch.zeros(1 << 20, device="cuda:0"))
        bucket = FlatGrads([[param]], 1).buckets[0]
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles: the host runs far ahead
            bucket.grads.add_(1.0)
            work = comm.all_reduce(bucket.grads)
        work.wait()
        seen = bucket.grads.clone()  # on the default stream, right after the wait
        torch.cuda.synchronize()
        assert bool((seen == 1.0).all()), "the default stream read the bucket before the all_reduce landed"
        comm.observer.end_step()
        row = comm.observer.take()
        assert row["time/comm_s"] > 0, row
    finally:
        dist.destroy_process_group()
