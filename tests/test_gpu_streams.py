"""On NCCL, a timed bucket's wait must order the current stream after the collective (issue 26).

One rank on one GPU (NCCL refuses two ranks on one device). The collective is issued from a side
stream that first sleeps and then changes the bucket, so NCCL's stream (which waits for the
issuing stream) finishes long after the host returns; the default stream then reads the bucket
right after bucketed's timed wait. Only a wait that makes the default stream wait for NCCL's sees
the change: a chained future whose value holds no CUDA tensor records no event and would not.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from trainer.sync.bucket_timing import Stopwatch, timed
from trainer.sync.collectives import Collectives
from trainer.sync.flat import FlatGrads


@pytest.mark.gpu
def test_timed_wait_orders_the_stream_after_nccl(tmp_path: Path) -> None:
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("nccl", store=store, rank=0, world_size=1, device_id=torch.device("cuda:0"))
    try:
        clock, spans = Stopwatch(torch.device("cuda:0")), []  # as bucket_timing.py times every bucket
        param = torch.nn.Parameter(torch.zeros(1 << 20, device="cuda:0"))
        bucket = FlatGrads([[param]], 1).buckets[0]
        torch.cuda.synchronize()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(2_000_000_000)  # about a second of GPU cycles: the host runs far ahead
            bucket.grads.add_(1.0)
            work = Collectives().all_reduce(bucket.grads)
        waited = timed(work, clock.now(), clock, spans).wait()
        seen = bucket.grads.clone()  # on the default stream, right after the wait
        torch.cuda.synchronize()
        assert isinstance(waited, list) and waited[0].is_cuda, waited
        assert bool((seen == 1.0).all()), "the default stream read the bucket before the all_reduce landed"
        assert len(spans) == 1
    finally:
        dist.destroy_process_group()
