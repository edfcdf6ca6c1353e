"""What sync=ddp attaches to torch's DistributedDataParallel, kept apart from the strategy (ddp.py):
its communication hooks (its own timing hook, and PyTorch's hooks, counted), DDP's runtime
statistics read at logged rows, and the module that lets bucket_cap_mb=auto swap one DDP for another.

The hooks run on DDP's per-bucket path, inside backward.
No `from __future__ import annotations` here: DDP checks a hook's annotations as real types.
"""

import time
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from trainer.sync.collectives import Collectives
from trainer.sync.ddp_private import logging_data, record_runtime_stats, set_sample_rate


class Link(Protocol):
    """network=<preset>'s link (trainer/sync/network.py's EmulatedLink), as the hooks delay a future on it."""

    def delayed_future(self, future: Future[Any], kind: str, nbytes: int, calls: int = 1) -> Future[Any]: ...


class TimedAllReduceHook:
    """A DDP communication hook doing what DDP's built-in all-reduce does, timed per bucket.

    Each bucket is divided by the world size and all-reduced with SUM, as DDP does without a hook;
    the hook also notes when the bucket left (its gradients were ready) and when the reduced
    bucket came back, which is what tells hidden communication from exposed. Host clocks only
    mean that on CPU, where gloo completes the future when the data is there.
    """

    def __init__(self, world_size: int, comm: Collectives) -> None:
        self.world_size = world_size
        # The strategy's: it counts and names each bucket's all_reduce and, on network=<preset>,
        # hands it on no earlier than the emulated link would.
        self.comm = comm
        self.intervals: list[tuple[float, float]] = []

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer()
        launched = time.perf_counter()
        tensor.div_(self.world_size)
        future = self.comm.all_reduce(tensor, bucket.index()).get_future()

        def arrived(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            self.intervals.append((launched, time.perf_counter()))  # runs on gloo's thread
            return done.value()[0]

        return future.then(arrived)


class CountedHook:
    """One of PyTorch's own DDP communication hooks, called unchanged, counting what it really sends.

    none (only with an emulated network, which needs a hook to reach DDP's collectives): torch's
    allreduce_hook, what DDP does without one (divide, all_reduce SUM). fp16/bf16: each bucket is
    all-reduced cast to 2 bytes per element, one all_reduce per bucket.
    PowerSGD: for its first `start_powerSGD_iter` steps, the whole bucket in its own dtype; after
    that three all_reduces per bucket: the tensors it leaves uncompressed (1-D ones such as biases,
    and matrices too small to gain `min_compression_rate`), then P, then Q. Their element count is
    what PowerSGD's own counter `total_numel_after_compression` grows by while the hook runs (its
    step I sums exactly those sizes), so that is what is counted, in the bucket's element size.
    """

    def __init__(self, name: str, powersgd_rank: int, powersgd_start_step: int, link: Link | None = None) -> None:
        self.name = name
        self.link = link  # network=<preset>: the hook's future done no earlier than its collectives' link time
        self.bytes = 0
        self.calls = 0
        self.powersgd: powerSGD_hook.PowerSGDState | None = None
        if name == "powersgd":  # error feedback and warm start on, PowerSGD's defaults
            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=powersgd_start_step
            )
        self._plain = {
            "none": default_hooks.allreduce_hook,
            "fp16": default_hooks.fp16_compress_hook,
            "bf16": default_hooks.bf16_compress_hook,
        }.get(name)

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if self._plain is not None:
            nbytes, calls = buffer.numel() * (buffer.element_size() if self.name == "none" else 2), 1
            future = self._plain(None, bucket)  # type: ignore[arg-type]  # None: the default group
        else:
            assert self.powersgd is not None
            before = self.powersgd.total_numel_after_compression
            future = powerSGD_hook.powerSGD_hook(self.powersgd, bucket)
            # PowerSGD chains a bucket's all_reduces (P once the uncompressed ones are in, then Q) in
            # callbacks; on gloo those run on its threads in an order that differs between ranks once
            # two buckets are in flight, and gloo aborts on the mismatch. There each bucket's chain is
            # waited for in its hook: every rank sends bucket 0's three, then bucket 1's, ...
            if dist.get_backend() == "gloo":
                future.wait()
            compressed = self.powersgd.total_numel_after_compression - before
            # uncompressed tensors, Ps, Qs; before start_powerSGD_iter, the plain all-reduce of the whole bucket
            numel, calls = (compressed, 3) if compressed else (buffer.numel(), 1)
            nbytes = numel * buffer.element_size()
        self.bytes += nbytes
        self.calls += calls
        if self.link is not None:  # the hook's all_reduces, one after another on the link
            future = self.link.delayed_future(future, "all_reduce", nbytes, calls)
        return future


class RuntimeStats:
    """DDP's own timing of a step's backward communication, read at logged rows.

    DDP's reducer times one step in `sample_rate` (and each of the first 10) with its C++ timers:
    CUDA events on the GPU, host clocks on CPU. It reads them back, synchronising on them, at the
    start of the next step's forward. With the sample rate equal to the logging interval, the
    timed step is the logged one, whose events the trainer has already waited for: reading them
    here, at the row, costs no extra synchronisation and no Python on the per-bucket path.
    """

    def __init__(self, ddp: DistributedDataParallel, sample_rate: int) -> None:
        self._ddp = ddp
        set_sample_rate(ddp, sample_rate)
        self._last_iteration = 0

    def take(self) -> tuple[float, float] | None:
        """(communication, exposed) seconds of the newest timed step, or None if none is new since the last call."""
        record_runtime_stats(self._ddp)  # measures the current step if it is a timed one
        data = logging_data(self._ddp)
        iteration = int(data.get("iteration", 0))
        if iteration <= self._last_iteration or "backward_comm_time" not in data:
            return None
        self._last_iteration = iteration
        # comm: first bucket launched -> last bucket reduced; overlap: first launch -> backward's end.
        comm_s = int(data["backward_comm_time"]) / 1e9
        overlap_s = int(data.get("backward_compute_comm_overlap_time", 0)) / 1e9
        return comm_s, max(0.0, comm_s - overlap_s)


class SwappableDDP(nn.Module):
    """What wrap() returns with bucket_cap_mb=auto: its forward runs the current DDP, which the
    strategy replaces (a DDP's bucket cap is fixed at construction) while the trainer keeps this."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        super().__init__()
        self.ddp = ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)
