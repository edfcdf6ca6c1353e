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

What ddplab adds around the call: a communication hook where one is asked for (sync.comm_hook:
torch's compression hooks; time_buckets or an emulated link: the all-reduce written as a Python
hook, trainer/sync/ddp_hooks.py), sending through `self.comm`; the bucket layout read back from
DDP's record for the sync line (trainer/sync/ddp_private.py); and bucket_cap_mb=auto's rebuild.
DDP's own C++ all-reduce is not touched: the observer sees it through the process group's hooks.
"""

# No `from __future__ import annotations` here: DDP checks the hook's annotations as real types.

import inspect
from contextlib import AbstractContextManager
from functools import partial
from typing import Annotated, Any

import torch
import torch.distributed as dist
from pydantic import Field
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer.comm_schedule import Buckets, Hop, Schedule
from trainer.errors import ConfigError
from trainer.footprint import Footprint, Plan, replicated, whole, wire
from trainer.sync.autotune import AUTO_CANDIDATES_MB, CandidatesMb, CapMb, CapTuner, StepsPerTrial, WarmupSteps
from trainer.sync.base import SyncStrategy
from trainer.sync.ddp_hooks import AllReduceHook, CommHook, SwappableDDP, TorchHook
from trainer.sync.ddp_private import bucket_layout, logging_data, planned_buckets

# torch 2.14 renamed the per-forward buffer broadcast to forward_sync_buffers (the old name warns).
# The new flag always syncs buffers at construction, which we want anyway: replicas start equal.
_BUFFER_FLAG = (
    "forward_sync_buffers"
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else "broadcast_buffers"
)


class DDPSync(SyncStrategy):
    """Gradients are all-reduced in buckets during backward, overlapping communication with compute."""

    name = "ddp"

    def __init__(
        self,
        bucket_cap_mb: CapMb = 25.0,
        auto_candidates_mb: CandidatesMb = AUTO_CANDIDATES_MB,
        auto_steps_per_trial: StepsPerTrial = 3,
        auto_warmup_steps: WarmupSteps = 2,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        find_unused_parameters: bool = False,
        broadcast_buffers: bool = True,
        comm_hook: CommHook = "none",
        powersgd_rank: Annotated[int, Field(ge=1, description="PowerSGD's matrix_approximation_rank")] = 1,
        # With error feedback and warm start PowerSGD refuses less: DDP rebuilds its buckets after step 1.
        powersgd_start_step: Annotated[
            int, Field(ge=2, description="plain all-reduce steps first; with error feedback and warm start at least 2")
        ] = 10,
        time_buckets: Annotated[
            bool, Field(description="the all-reduce as a Python hook through the communication object")
        ] = False,
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
        self._hook: AllReduceHook | TorchHook | None = None
        self._sizes: list[int] = []  # the bucket sizes as last read from DDP's record
        self._rebuilt = False  # DDP rebuilds its buckets once: from then on its layout is fixed

    def wrap(self, model: nn.Module) -> nn.Module:
        device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
        # DDP's own check of a hook's name, which refuses bf16 on any build without CUDA, never sees ours.
        if self.comm_hook == "bf16" and dist.get_backend() == "nccl" and torch.cuda.nccl.version() < (2, 10):
            raise ConfigError(
                f"sync.comm_hook='bf16' is invalid: NCCL {torch.cuda.nccl.version()} cannot all-reduce bfloat16 "
                "(needs 2.10+); use fp16, or trainer.device=cpu (gloo)"
            )
        self._module = model
        self.comm.torch_launches()  # DDP's reducer all-reduces its buckets from C++ (unless a hook sends them)
        if not self.gradient_as_bucket_view:  # DDP's reducer keeps the gradients in buckets of its own
            self.comm.holds(lambda: {"comm_buffers": sum(self._sizes)})
        if self.comm_hook != "none":
            self._hook = TorchHook(self.comm_hook, self.comm, self.powersgd_rank, self.powersgd_start_step)
        elif self.time_buckets or self.comm.link is not None or self.comm.reduce_dtype not in (None, dtype):
            # DDP's all-reduce must pass through self.comm (timed, carried by the link, or sent in
            # trainer.reduce_dtype: DDP's own C++ one reduces each bucket in the parameters' dtype)
            self._hook = AllReduceHook(self.comm)
        if self.bucket_cap_mb != "auto":
            return self._build(float(self.bucket_cap_mb))
        candidates, steps, warmup = self.auto_candidates_mb, self.auto_steps_per_trial, self.auto_warmup_steps
        layout = partial(planned_buckets, model)  # caps that build the same buckets are timed once
        self.tuner = CapTuner(candidates, steps, warmup, device, self.comm, layout, rebuild=self.rebuild)  # after_step
        self._proxy = SwappableDDP(self._build(self.tuner.cap_mb))
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
        self._sizes, self._rebuilt = bucket_layout(self._ddp)
        if self._hook is not None:
            self._ddp.register_comm_hook(state=None, hook=self._hook.hook)
        return self._ddp

    def rebuild(self, cap_mb: float) -> None:
        """bucket_cap_mb=auto: a new DDP with this cap (a DDP's cap is fixed at construction)."""
        assert self._proxy is not None
        self._proxy.ddp = self._build(cap_mb)  # the old DDP, its reducer and hooks go with it

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        assert self._ddp is not None and model in (self._ddp, self._proxy), "no_sync needs the module wrap() returned"
        return self._ddp.no_sync()

    def facts(self) -> dict[str, Any]:
        if self._ddp is None:
            return {}
        if not self._rebuilt:  # read between steps only: inside a step DDP's reducer holds the record's lock
            self._sizes, self._rebuilt = bucket_layout(self._ddp)
        total = int(logging_data(self._ddp).get("total_parameter_size_bytes", 0))
        sizes = {"num_buckets": len(self._sizes), "bucket_sizes_bytes": self._sizes}
        return sizes | {"buckets_rebuilt": self._rebuilt, "total_parameter_bytes": total}

    def footprint(self, plan: Plan) -> Footprint:
        """A replica, plus DDP's reducer buckets (a copy of the gradients, unless they are the .grad
        tensors) and PowerSGD's error-feedback copy of them."""
        grads = whole("comm_buffers", plan.trainable)
        copies = (not self.gradient_as_bucket_view) + (self.comm_hook == "powersgd")
        sent = wire(plan, [sum(p.numel() * p.element_size() for p in plan.trainable)])  # every bucket in flight
        return replicated(plan, whole("gradients", plan.trainable), *[grads] * copies, *sent)

    def schedule(self) -> Schedule:
        """DDP's buckets in gradient-ready order, the first of about 1 MiB (torch's
        _DEFAULT_FIRST_BUCKET_BYTES), each all-reduced as soon as backward has filled it;
        bucket_cap_mb=auto: the largest candidate's."""
        cap_mb = max(self.auto_candidates_mb) if self.bucket_cap_mb == "auto" else float(self.bucket_cap_mb)
        return Schedule(Buckets(cap_mb, rule="ddp", first_cap_mb=1.0, hops=(Hop("all_reduce"),)))
