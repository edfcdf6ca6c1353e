"""PyTorch's DistributedDataParallel, with every knob taken from config.

What torch does, in its own C++ (the DDP notes' version 2): the constructor broadcasts rank 0's
parameters and buffers and groups the parameters into buckets of about `bucket_cap_mb` (the first
about 1 MiB), in reverse order; during backward, an autograd hook per parameter marks its gradient
ready, and a bucket whose gradients are all ready is all-reduced (SUM) and divided by the world
size asynchronously while backward goes on; before backward returns, DDP waits for every bucket
and copies the averages into each .grad. After the first iteration it rebuilds the buckets once,
in the order the gradients became ready. A parameter without a gradient is an error unless
find_unused_parameters=true, which walks the autograd graph from the outputs every forward and
marks the unused ones ready (their gradient left alone, as one process leaves it). no_sync()
skips the all-reduces: gradients accumulate locally.

What ddplab adds around the call: the books of what the reducer sent and its own timing of it
(trainer/sync/ddp_private.py, read at logged rows); a communication hook where one is asked for
(sync.comm_hook: torch's compression hooks; time_buckets or an emulated link: the all-reduce written
as a Python hook, trainer/sync/ddp_hooks.py), sending through `self.comm`; and bucket_cap_mb=auto,
which times a few steps with each candidate cap (trainer/sync/autotune.py) and rebuilds the DDP.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as real types.

import inspect
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.errors import ConfigError
from trainer.sync.autotune import DEFAULT_CANDIDATES_MB, CapTuner
from trainer.sync.base import SyncStrategy
from trainer.sync.comm import CommCounters
from trainer.sync.ddp_hooks import AllReduceHook, CommHook, SwappableDDP, TorchHook
from trainer.sync.ddp_private import ReducerBooks, bucket_layout, logging_data

# torch 2.14 renamed the per-forward buffer broadcast to forward_sync_buffers (the old name warns).
# The new flag always syncs buffers at construction, which we want anyway: replicas start equal.
_BUFFER_FLAG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else "broadcast_buffers"
)


class DDPSync(SyncStrategy):
    """Gradients are all-reduced in buckets during backward, overlapping communication with compute."""

    def __init__(
        self,
        bucket_cap_mb: float | str = 25.0,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        time_buckets: bool = False,
        auto_candidates_mb: Sequence[float] = DEFAULT_CANDIDATES_MB,
        auto_steps_per_trial: int = 3,
        auto_warmup_steps: int = 2,
        comm_hook: CommHook = "none",
        powersgd_rank: int = 1,
        powersgd_start_step: int = 10,
    ) -> None:
        super().__init__()
        self.bucket_cap_mb: float | str = bucket_cap_mb if bucket_cap_mb == "auto" else float(bucket_cap_mb)
        self.gradient_as_bucket_view = gradient_as_bucket_view
        self.static_graph = static_graph
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.time_buckets = time_buckets
        self.auto_candidates_mb = [float(c) for c in auto_candidates_mb]
        self.auto_steps_per_trial = auto_steps_per_trial
        self.auto_warmup_steps = auto_warmup_steps
        self.comm_hook = comm_hook
        self.powersgd_rank = powersgd_rank
        self.powersgd_start_step = powersgd_start_step
        self._module: nn.Module | None = None
        self._ddp: DistributedDataParallel | None = None
        self._proxy: SwappableDDP | None = None  # bucket_cap_mb=auto
        self._tuner: CapTuner | None = None
        self._cap_mb = 0.0  # the cap the current DDP was built with
        self._hook: AllReduceHook | TorchHook | None = None
        self._books: ReducerBooks | None = None  # without a hook: what the C++ reducer sent

    def wrap(self, model: nn.Module) -> nn.Module:
        device = next(model.parameters()).device
        if self.time_buckets and device.type != "cpu":
            raise ConfigError(
                f"sync.time_buckets=true times buckets with host clocks, which cannot time NCCL on {device}; "
                "accepted: false (DDP's runtime statistics time communication on CUDA), or trainer.device=cpu"
            )
        # DDP's own check of a hook's name, which refuses bf16 on any build without CUDA, never sees ours.
        if self.comm_hook == "bf16" and dist.get_backend() == "nccl" and torch.cuda.nccl.version() < (2, 10):
            raise ConfigError(
                f"sync.comm_hook='bf16' is invalid: NCCL {torch.cuda.nccl.version()} cannot all-reduce bfloat16 "
                "(needs 2.10+); use fp16, or trainer.device=cpu (gloo)"
            )
        self._module = model
        if self.comm_hook != "none":
            self._hook = TorchHook(self.comm_hook, self.comm, self.powersgd_rank, self.powersgd_start_step)
        elif self.time_buckets or self.comm.link is not None:  # DDP's all-reduce must pass through self.comm
            self._hook = AllReduceHook(self.comm)
        if self.time_buckets and self.comm.every:  # what time_buckets asks for: every bucket of every step
            self.comm.every = 1
        if self.bucket_cap_mb != "auto":
            return self._build(float(self.bucket_cap_mb))
        self._tuner = CapTuner(
            self.auto_candidates_mb, self.auto_steps_per_trial, self.auto_warmup_steps, device, self.comm
        )
        self._proxy = SwappableDDP(self._build(self._tuner.cap_mb))
        return self._proxy

    def _build(self, cap_mb: float) -> DistributedDataParallel:
        """A DDP of the model with this bucket cap; it broadcasts rank 0's parameters and buffers itself."""
        assert self._module is not None
        device = next(self._module.parameters()).device
        buffers: dict[str, Any] = {_BUFFER_FLAG: self.broadcast_buffers}
        self._ddp = DistributedDataParallel(
            self._module,
            device_ids=[device.index] if device.type == "cuda" else None,
            bucket_cap_mb=cap_mb,
            gradient_as_bucket_view=self.gradient_as_bucket_view,
            static_graph=self.static_graph,
            find_unused_parameters=self.find_unused_parameters,
            **buffers,
        )
        self._cap_mb = cap_mb
        if self._hook is not None:
            self._ddp.register_comm_hook(state=None, hook=self._hook.hook)
        else:
            grad_bytes = sum(p.numel() * p.element_size() for p in self._module.parameters() if p.requires_grad)
            self._books = ReducerBooks(self._ddp, grad_bytes, self.comm.every or 10)
        return self._ddp

    def after_backward(self, model: nn.Module) -> None:
        # DDP has already averaged every bucket: backward waited for them.
        if self._books is not None:
            self._books.steps += 1
        if self._tuner is not None:
            cap_mb = self._tuner.after_step()
            if cap_mb is not None:  # every rank at the same step; the gradients are averaged already
                assert self._proxy is not None
                self._count_reduced()  # with the old layout
                self._proxy.ddp = self._build(cap_mb)  # the old DDP, its reducer and hooks go with it

    def pop_comm_counts(self) -> CommCounters:
        counts = self.comm.pop()
        if self._books is not None:
            self._books.add_to(counts)
        return counts

    def _count_reduced(self) -> None:
        if self._books is not None:
            self._books.add_to(self.comm.counts)

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        assert self._ddp is not None and model in (self._ddp, self._proxy), "no_sync needs the module wrap() returned"
        return self._ddp.no_sync()

    def row_metrics(self) -> dict[str, float]:
        return {"sync/bucket_cap_mb": self._cap_mb}

    def settled(self) -> bool:
        # bucket_cap_mb=auto: the trials, then the chosen cap's DDP, whose buckets are final once
        # rebuilt after its first step.
        return self._tuner is None or (self._tuner.done and bool(self.describe().get("buckets_rebuilt", True)))

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "strategy": "ddp",
            "bucket_cap_mb": self.bucket_cap_mb,
            "gradient_as_bucket_view": self.gradient_as_bucket_view,
            "static_graph": self.static_graph,
            "find_unused_parameters": self.find_unused_parameters,
            "broadcast_buffers": self.broadcast_buffers,
            "time_buckets": self.time_buckets,
            "comm_hook": self.comm_hook,
            "comm_timing": self.comm.describe()
            if self._hook is not None or self._ddp is None
            else f"DDP runtime stats, 1 step in {self.comm.every or 10}",
        }
        if self.comm_hook == "powersgd":
            info["powersgd_rank"] = self.powersgd_rank
            info["powersgd_start_step"] = self.powersgd_start_step
        if self._tuner is not None:
            info["auto_trials"] = self._tuner.table()
            info["auto_chosen_mb"] = self._tuner.chosen_mb
            info["bucket_cap_mb_in_use"] = self._cap_mb
        if self._ddp is not None:
            sizes, rebuilt = self._books.layout() if self._books else bucket_layout(self._ddp)
            info["num_buckets"] = len(sizes)
            info["bucket_sizes_bytes"] = sizes
            info["buckets_rebuilt"] = rebuilt
            info["total_parameter_bytes"] = int(logging_data(self._ddp).get("total_parameter_size_bytes", 0))
        return info
