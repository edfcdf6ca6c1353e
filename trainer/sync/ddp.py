"""PyTorch's DistributedDataParallel with every knob taken from config."""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as real types.

import inspect
import time
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.errors import ConfigError, check, is_int, is_number
from trainer.sync.base import SyncStrategy
from trainer.sync.comm import CommCounters, busy_time, exposed_time

# torch 2.14 renamed the per-forward buffer broadcast to forward_sync_buffers (the old name warns).
# The new flag always syncs buffers at construction, which we want anyway: replicas start equal.
_BUFFER_FLAG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else "broadcast_buffers"
)


class BucketClock:
    """A DDP communication hook doing what DDP's built-in all-reduce does, timed per bucket.

    Each bucket is divided by the world size and all-reduced with SUM, as DDP does without a hook;
    the hook also notes when the bucket left (its gradients were ready) and when the reduced
    bucket came back, which is what tells hidden communication from exposed. Host clocks only
    mean that on CPU, where gloo completes the future when the data is there.
    """

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.bytes = 0
        self.calls = 0
        self.intervals: list[tuple[float, float]] = []

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer()
        self.bytes += tensor.numel() * tensor.element_size()
        self.calls += 1
        launched = time.perf_counter()
        tensor.div_(self.world_size)
        future = dist.all_reduce(tensor, async_op=True).get_future()

        def arrived(done: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
            self.intervals.append((launched, time.perf_counter()))  # runs on gloo's thread
            return done.value()[0]

        return future.then(arrived)


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
        ddp._set_ddp_runtime_logging_sample_rate(sample_rate)
        self._last_iteration = 0

    def take(self) -> tuple[float, float] | None:
        """(communication, exposed) seconds of the newest timed step, or None if none is new since the last call."""
        assert self._ddp.logger is not None
        self._ddp.logger.set_runtime_stats_and_log()  # measures the current step if it is a timed one
        data = self._ddp._get_ddp_logging_data()
        iteration = int(data.get("iteration", 0))
        if iteration <= self._last_iteration or "backward_comm_time" not in data:
            return None
        self._last_iteration = iteration
        # comm: first bucket launched -> last bucket reduced; overlap: first launch -> backward's end.
        comm_s = int(data["backward_comm_time"]) / 1e9
        overlap_s = int(data.get("backward_compute_comm_overlap_time", 0)) / 1e9
        return comm_s, max(0.0, comm_s - overlap_s)


class DDPSync(SyncStrategy):
    """Gradients are all-reduced in buckets during backward, overlapping communication with compute."""

    def __init__(
        self,
        bucket_cap_mb: float = 25.0,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        time_buckets: bool = False,
        time_every_n_steps: int = 10,
    ) -> None:
        check(
            is_number(bucket_cap_mb) and bucket_cap_mb > 0,
            "sync.bucket_cap_mb",
            bucket_cap_mb,
            "must be a number > 0 (MiB per gradient bucket; DDP's default is 25)",
        )
        check(
            is_int(time_every_n_steps) and time_every_n_steps >= 1,
            "sync.time_every_n_steps",
            time_every_n_steps,
            "must be an integer >= 1 (DDP's runtime statistics time one step in this many)",
        )
        super().__init__()
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.time_buckets = time_buckets
        self.time_every_n_steps = time_every_n_steps
        self._ddp: DistributedDataParallel | None = None
        self._clock: BucketClock | None = None
        self._stats: RuntimeStats | None = None
        self._steps_since_row = 0  # steps since the last row that DDP reduced without our hook
        self._grad_bytes = 0

    def wrap(self, model: nn.Module) -> nn.Module:
        device = next(model.parameters()).device
        buffers: dict[str, Any] = {_BUFFER_FLAG: self.broadcast_buffers}
        # DDP broadcasts rank 0's parameters and buffers itself when it is constructed.
        self._ddp = DistributedDataParallel(
            model,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=self.bucket_cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            find_unused_parameters=self.find_unused_parameters,
            **buffers,
        )
        if self.time_buckets:
            if device.type != "cpu":
                raise ConfigError(
                    f"sync.time_buckets=true times buckets with host clocks, which cannot time NCCL on {device}; "
                    "accepted: false (DDP's runtime statistics time communication on CUDA), or trainer.device=cpu"
                )
            self._clock = BucketClock(dist.get_world_size())
            self._ddp.register_comm_hook(state=None, hook=self._clock.hook)
        else:  # DDP's C++ all-reduce stays in place, timed by DDP itself on the logged steps
            self._stats = RuntimeStats(self._ddp, self.time_every_n_steps)
        self._grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        return self._ddp

    def after_backward(self, model: nn.Module) -> None:
        # DDP has already reduced every bucket (backward waits for them); only the accounting is left.
        clock = self._clock
        if clock is None:
            self.comm.bytes += self._grad_bytes
            self._steps_since_row += 1
            return
        intervals, clock.intervals = clock.intervals, []
        self.comm.bytes += clock.bytes
        self.comm.collectives += clock.calls
        self.comm.seconds += busy_time(intervals)
        self.comm.exposed_seconds += exposed_time(intervals)
        self.comm.timed_steps += 1
        clock.bytes, clock.calls = 0, 0

    def take_comm(self) -> CommCounters:
        counts = self.comm.take()
        if self._stats is None:
            return counts
        # One all_reduce per bucket per step; the layout is read here, not on the step path.
        counts.collectives = self._steps_since_row * len(self._bucket_layout()[0])
        self._steps_since_row = 0
        sample = self._stats.take()
        if sample is not None:
            counts.seconds, counts.exposed_seconds = sample
            counts.timed_steps = 1
        return counts

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        assert isinstance(model, DistributedDataParallel), "no_sync needs the module wrap() returned"
        return model.no_sync()

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "strategy": "ddp",
            "bucket_cap_mb": self.bucket_cap_mb,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph,
            "find_unused_parameters": self.find_unused_parameters,
            "broadcast_buffers": self.broadcast_buffers,
            "time_buckets": self.time_buckets,
            "comm_timing": "per bucket, every step (Python hook)"
            if self.time_buckets
            else f"DDP runtime stats, 1 step in {self.time_every_n_steps}",
        }
        if self._ddp is not None:
            sizes, rebuilt = self._bucket_layout()
            info["num_buckets"] = len(sizes)
            info["bucket_sizes_bytes"] = sizes
            info["buckets_rebuilt"] = rebuilt
            info["total_parameter_bytes"] = int(self._ddp._get_ddp_logging_data().get("total_parameter_size_bytes", 0))
        return info

    def _bucket_layout(self) -> tuple[list[int], bool]:
        """Bucket sizes in bytes, and whether DDP has rebuilt them yet.

        From DDP's own logging record (a prototype API). DDP rebuilds its buckets once, after the
        first iteration, in the order gradients became ready: report that layout once it exists.
        """
        assert self._ddp is not None
        data = self._ddp._get_ddp_logging_data()
        rebuilt = bool(data.get("has_rebuilt_buckets")) and bool(data.get("rebuilt_bucket_sizes"))
        layout = data.get("rebuilt_bucket_sizes") if rebuilt else data.get("bucket_sizes", "")
        return [int(s) for s in str(layout).split(",") if s.strip()], rebuilt
