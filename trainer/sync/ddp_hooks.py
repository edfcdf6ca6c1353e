"""The communication hooks sync=ddp registers: its own timing hook, and PyTorch's hooks, counted.

Kept apart from ddp.py (the strategy) because they run on DDP's per-bucket path, inside backward.
No `from __future__ import annotations` here: DDP checks a hook's annotations as real types.
"""

import time

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook


class TimedAllReduceHook:
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


class CountedHook:
    """One of PyTorch's own DDP communication hooks, called unchanged, counting what it really sends.

    fp16/bf16: each bucket is all-reduced cast to 2 bytes per element, one all_reduce per bucket.
    PowerSGD: for its first `start_powerSGD_iter` steps, the whole bucket in its own dtype; after
    that three all_reduces per bucket: the tensors it leaves uncompressed (1-D ones such as biases,
    and matrices too small to gain `min_compression_rate`), then P, then Q. Their element count is
    what PowerSGD's own counter `total_numel_after_compression` grows by while the hook runs (its
    step I sums exactly those sizes), so that is what is counted, in the bucket's element size.
    """

    def __init__(self, name: str, powersgd_rank: int, powersgd_start_step: int) -> None:
        self.name = name
        self.bytes = 0
        self.calls = 0
        self.powersgd: powerSGD_hook.PowerSGDState | None = None
        if name == "powersgd":  # error feedback and warm start on, PowerSGD's defaults
            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=powersgd_start_step
            )
        self._cast = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}.get(name)

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        buffer = bucket.buffer()
        if self._cast is not None:
            self.bytes += buffer.numel() * 2  # float16 and bfloat16 alike
            self.calls += 1
            return self._cast(None, bucket)  # type: ignore[arg-type]  # None: the default group
        assert self.powersgd is not None
        before = self.powersgd.total_numel_after_compression
        future = powerSGD_hook.powerSGD_hook(self.powersgd, bucket)
        compressed = self.powersgd.total_numel_after_compression - before
        if compressed:  # uncompressed tensors, Ps, Qs
            self.bytes += compressed * buffer.element_size()
            self.calls += 3
        else:  # before start_powerSGD_iter: the plain all-reduce of the whole bucket
            self.bytes += buffer.numel() * buffer.element_size()
            self.calls += 1
        return future
