"""PyTorch's DistributedDataParallel with every knob taken from config."""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as real types.

import inspect
from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.errors import ConfigError
from trainer.sync.autotune import DEFAULT_CANDIDATES_MB, CapTuner
from trainer.sync.base import SyncStrategy
from trainer.sync.collectives import CommCounters, busy_time, exposed_time
from trainer.sync.ddp_hooks import CountedHook, RuntimeStats, SwappableDDP, TimedAllReduceHook
from trainer.sync.ddp_private import logging_data

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
        time_every_n_steps: int = 10,
        auto_candidates_mb: Sequence[float] = DEFAULT_CANDIDATES_MB,
        auto_steps_per_trial: int = 3,
        auto_warmup_steps: int = 2,
        comm_hook: Literal["none", "fp16", "bf16", "powersgd"] = "none",
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
        self.time_every_n_steps = time_every_n_steps
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
        self._timed_hook: TimedAllReduceHook | None = None
        self._hook: CountedHook | None = None
        self._stats: RuntimeStats | None = None
        self._steps_since_row = 0  # steps since the last row that DDP reduced without our hook
        self._rebuilt_layout: tuple[DistributedDataParallel, list[int]] | None = None  # (the DDP it is of, sizes)
        self._grad_bytes = 0

    def wrap(self, model: nn.Module) -> nn.Module:
        device = next(model.parameters()).device
        if self.time_buckets and device.type != "cpu":
            raise ConfigError(
                f"sync.time_buckets=true times buckets with host clocks, which cannot time NCCL on {device}; "
                "accepted: false (DDP's runtime statistics time communication on CUDA), or trainer.device=cpu"
            )
        # gloo all-reduces bf16 (tried, torch 2.14); NCCL only from 2.10. DDP's own check of the hook's
        # name, which refuses bf16 on any build without CUDA, never sees our counting wrapper's name.
        if self.comm_hook == "bf16" and dist.get_backend() == "nccl" and torch.cuda.nccl.version() < (2, 10):
            raise ConfigError(
                f"sync.comm_hook='bf16' is invalid: NCCL {torch.cuda.nccl.version()} cannot all-reduce bfloat16 "
                "(needs 2.10+); use fp16, or trainer.device=cpu (gloo)"
            )
        self._module = model
        self._grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        link = getattr(self.comm, "link", None)  # network=<preset>: it reaches DDP's collectives through a hook
        if self.time_buckets:
            self._timed_hook = TimedAllReduceHook(dist.get_world_size(), self.comm)
        elif self.comm_hook != "none" or link is not None:
            self._hook = CountedHook(self.comm_hook, self.powersgd_rank, self.powersgd_start_step, link)
        if self.bucket_cap_mb != "auto":
            return self._build(float(self.bucket_cap_mb))
        self._tuner = CapTuner(
            self.auto_candidates_mb, self.auto_steps_per_trial, self.auto_warmup_steps, device, comm=self.comm
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
        if self._timed_hook is not None:
            self._ddp.register_comm_hook(state=None, hook=self._timed_hook.hook)
            return self._ddp
        if self._hook is not None:
            self._ddp.register_comm_hook(state=None, hook=self._hook.hook)
        # DDP times its communication itself on the logged steps, its C++ all-reduce or a hook's.
        self._stats = RuntimeStats(self._ddp, self.time_every_n_steps)
        return self._ddp

    def _rebuild(self, cap_mb: float) -> None:
        """Swap in a DDP with a new cap, between a step's backward and its optimizer step.

        Every rank does this at the same step (the tuner decides in lockstep). The gradients are
        already averaged; the new DDP's broadcast of rank 0's parameters changes nothing, they are equal.
        """
        assert self._proxy is not None
        self._count_untimed_collectives()  # with the old layout
        # The old DDP goes with its last reference, and with it its reducer's
        # buckets and autograd hooks; those hooks were inert anyway: a reducer expects them only after its
        # own forward.
        self._proxy.ddp = self._build(cap_mb)

    def after_backward(self, model: nn.Module) -> None:
        # DDP has already reduced every bucket (backward waits for them); only the accounting is left.
        timed, hook, counts = self._timed_hook, self._hook, self.comm.counts
        if timed is not None:
            intervals, timed.intervals = timed.intervals, []  # its all_reduces are counted by self.comm
            counts.seconds += busy_time(intervals)
            counts.exposed_seconds += exposed_time(intervals)
            counts.timed_steps += 1
        elif hook is not None:
            counts.bytes += hook.bytes
            counts.collectives += hook.calls
            hook.bytes, hook.calls = 0, 0
        else:
            counts.bytes += self._grad_bytes
            self._steps_since_row += 1
        if self._tuner is not None:
            cap_mb = self._tuner.after_step()
            if cap_mb is not None:
                self._rebuild(cap_mb)

    def pop_comm_counts(self) -> CommCounters:
        self._count_untimed_collectives()
        counts = self.comm.counts.pop()
        sample = self._stats.take() if self._stats is not None else None
        if sample is not None:
            counts.seconds, counts.exposed_seconds = sample
            counts.timed_steps = 1
        return counts

    def _count_untimed_collectives(self) -> None:
        """Without a hook, one all_reduce per bucket per step; the layout is read here, not on the step path."""
        if self._steps_since_row:
            self.comm.counts.collectives += self._steps_since_row * len(self._bucket_layout()[0])
            self._steps_since_row = 0

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        assert self._ddp is not None and model in (self._ddp, self._proxy), "no_sync needs the module wrap() returned"
        return self._ddp.no_sync()

    def row_metrics(self) -> dict[str, float]:
        return {"sync/bucket_cap_mb": self._cap_mb}

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
            "comm_timing": "per bucket, every step (Python hook)"
            if self.time_buckets
            else f"DDP runtime stats, 1 step in {self.time_every_n_steps}",
        }
        if self.comm_hook == "powersgd":
            info["powersgd_rank"] = self.powersgd_rank
            info["powersgd_start_step"] = self.powersgd_start_step
        if self._tuner is not None:
            info["auto_trials"] = self._tuner.table()
            info["auto_chosen_mb"] = self._tuner.chosen_mb
            info["bucket_cap_mb_in_use"] = self._cap_mb
        if self._ddp is not None:
            sizes, rebuilt = self._bucket_layout()
            info["num_buckets"] = len(sizes)
            info["bucket_sizes_bytes"] = sizes
            info["buckets_rebuilt"] = rebuilt
            info["total_parameter_bytes"] = int(logging_data(self._ddp).get("total_parameter_size_bytes", 0))
        return info

    def _bucket_layout(self) -> tuple[list[int], bool]:
        """Bucket sizes in bytes, and whether DDP has rebuilt them yet.

        From DDP's own logging record (a private API, read through ddp_private.py). DDP rebuilds its
        buckets once, after the first iteration, in the order gradients became ready: report that
        layout once it exists.
        """
        assert self._ddp is not None
        if self._rebuilt_layout is not None and self._rebuilt_layout[0] is self._ddp:
            return self._rebuilt_layout[1], True  # fixed once rebuilt: a row reads DDP's record once, not twice
        data = logging_data(self._ddp)
        rebuilt = bool(data.get("has_rebuilt_buckets")) and bool(data.get("rebuilt_bucket_sizes"))
        layout = data.get("rebuilt_bucket_sizes") if rebuilt else data.get("bucket_sizes", "")
        sizes = [int(s) for s in str(layout).split(",") if s.strip()]
        if rebuilt:
            self._rebuilt_layout = (self._ddp, sizes)
        return sizes, rebuilt
