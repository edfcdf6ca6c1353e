"""The communication hooks sync=ddp registers on torch's DistributedDataParallel, and the module that
lets bucket_cap_mb=auto swap one DDP for another.

A DDP communication hook replaces what DDP does with each bucket once backward has filled it; DDP
waits for the future it returns before backward ends. Both hooks here send through the strategy's
communication object (trainer/sync/comm.py), so that what they send is counted, timed and carried
by an emulated link like every other strategy's collectives.
No `from __future__ import annotations` here: DDP checks a hook's annotations as real types.
"""

from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.futures import Future
from torch.nn.parallel import DistributedDataParallel

from trainer.sync.comm import Comm

CommHook = Literal["none", "fp16", "bf16", "powersgd"]  # sync.comm_hook


class AllReduceHook:
    """What DDP's own C++ all-reduce does with a bucket, written out: divide by the world size,
    all_reduce(SUM) the bucket's flat buffer, hand DDP the future of the averaged bucket."""

    def __init__(self, comm: Comm) -> None:
        self.comm = comm

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        tensor = bucket.buffer()
        tensor.div_(dist.get_world_size())
        return self.comm.all_reduce_future(tensor, bucket.index())


class TorchHook:
    """One of PyTorch's own DDP communication hooks, called unchanged, reporting what it really sends.

    fp16/bf16: each bucket is all-reduced cast to 2 bytes per element, one all_reduce per bucket.
    PowerSGD: for its first `start_powerSGD_iter` steps, the whole bucket in its own dtype; after
    that three all_reduces per bucket: the tensors it leaves uncompressed (1-D ones such as biases,
    and matrices too small to gain `min_compression_rate`), then P, then Q. Their element count is
    what PowerSGD's own counter `total_numel_after_compression` grows by while the hook runs.
    """

    def __init__(self, name: str, comm: Comm, powersgd_rank: int, powersgd_start_step: int) -> None:
        self.name, self.comm = name, comm
        self.powersgd: powerSGD_hook.PowerSGDState | None = None
        if name == "powersgd":  # error feedback and warm start on, PowerSGD's defaults
            self.powersgd = powerSGD_hook.PowerSGDState(
                process_group=None, matrix_approximation_rank=powersgd_rank, start_powerSGD_iter=powersgd_start_step
            )
            comm.holds(self._error_feedback)  # PowerSGD's own copy of the gradients, made at its first compression
        self._cast = {"fp16": default_hooks.fp16_compress_hook, "bf16": default_hooks.bf16_compress_hook}.get(name)

    def hook(self, state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        return self.comm.hooked(lambda: self._send(bucket), bucket.index())

    def _error_feedback(self) -> dict[str, int]:
        assert self.powersgd is not None
        return {"comm_buffers": sum(t.numel() * t.element_size() for t in self.powersgd.error_dict.values())}

    def _send(self, bucket: dist.GradBucket) -> tuple[Future[Any], str, int, int]:
        """Run torch's hook on the bucket: its future, and what it sent (kind, bytes, calls)."""
        buffer = bucket.buffer()
        if self._cast is not None:
            return self._cast(None, bucket), "all_reduce", buffer.numel() * 2, 1  # type: ignore[arg-type]
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
        return future, "all_reduce", numel * buffer.element_size(), calls


class SwappableDDP(nn.Module):
    """What wrap() returns with bucket_cap_mb=auto: its forward runs the current DDP, which the
    strategy replaces (a DDP's bucket cap is fixed at construction) while the trainer keeps this."""

    def __init__(self, ddp: DistributedDataParallel) -> None:
        super().__init__()
        self.ddp = ddp

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.ddp(*args, **kwargs)
