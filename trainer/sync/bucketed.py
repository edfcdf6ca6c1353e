"""DDP's mechanism written out (the DDP notes' version 2, by hand): gradient buckets, a hook per
parameter, communication while backward goes on.

1. wrap(): rank 0's parameters and buffers are broadcast. The parameters are grouped, in
   *reverse* registration order (roughly the order backward produces their gradients: the last
   layer's first), into buckets of about `bucket_cap_mb`, whose flat buffers hold the gradients
   (each .grad a view: no copies).
2. backward: a hook on each parameter counts the gradients its bucket still misses; when none is
   missing, the bucket's all_reduce(SUM) starts asynchronously, while backward goes on computing
   the earlier layers ("layer 10 syncs while layer 9 computes"). Buckets start strictly in order,
   so every rank issues the same collectives in the same order, as DDP does.
3. after_backward(): wait for every bucket and divide it by world_size (rs_ag: the reduce_scatter
   left each rank its shard of the sum; divide it, then all_gather the shards back).
4. no_sync(): the hooks do nothing; gradients accumulate locally in the buffers.

The hooks and their rules (a parameter without a gradient, a layer reused under checkpointing
firing its hook more than once) are trainer/sync/bucket_launch.py's, shared with `zero`; here
strict: what would leave a bucket incomplete is refused with a ConfigError naming the parameter.
The timing of the buckets (one step in `time_every_n_steps`) is composed in: `bucket_timer`.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any, Literal

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from trainer.sync.autotune import DEFAULT_CANDIDATES_MB, CapTuner
from trainer.sync.base import SyncStrategy
from trainer.sync.bucket_launch import BucketLauncher, TimerFactory, Untimed
from trainer.sync.collectives import CommCounters, Waitable
from trainer.sync.flat import FlatGrads, group_by_size, names_of


class BucketedSync(SyncStrategy):
    """Gradients averaged bucket by bucket as backward produces them, by hooks this module registers."""

    def __init__(
        self,
        bucket_cap_mb: float | str = 25.0,
        collective: Literal["all_reduce", "rs_ag"] = "all_reduce",
        time_every_n_steps: int = 10,
        auto_candidates_mb: Sequence[float] = DEFAULT_CANDIDATES_MB,
        auto_steps_per_trial: int = 3,
        auto_warmup_steps: int = 2,
        bucket_timer: TimerFactory | None = None,
    ) -> None:
        super().__init__()
        self.bucket_cap_mb = bucket_cap_mb if bucket_cap_mb == "auto" else float(bucket_cap_mb)
        self.auto_candidates_mb = [float(c) for c in auto_candidates_mb]
        self.auto_steps_per_trial = auto_steps_per_trial
        self.auto_warmup_steps = auto_warmup_steps
        self.collective = collective
        self.time_every_n_steps = time_every_n_steps
        self.bucket_timer = bucket_timer  # conf/sync: bucket_timing.BucketTimer; None: nothing timed
        self._tuner: CapTuner | None = None
        self._cap_mb = 0.0  # the cap the buckets were built with
        self._params: list[nn.Parameter] = []
        self._flat: FlatGrads | None = None
        self._launcher: BucketLauncher | None = None
        self._world_size = 1

    def wrap(self, model: nn.Module) -> nn.Module:
        self.comm.broadcast_parameters(model)
        self._world_size = dist.get_world_size()
        self._params = [p for p in model.parameters() if p.requires_grad]
        names = names_of(model, self._params)
        device = self._params[0].device
        timer = Untimed() if self.bucket_timer is None else self.bucket_timer(device, self.time_every_n_steps, False)
        self._launcher = BucketLauncher("bucketed", self._params, names, timer, self.comm)
        if self.bucket_cap_mb == "auto":
            self._tuner = CapTuner(
                self.auto_candidates_mb, self.auto_steps_per_trial, self.auto_warmup_steps, device, comm=self.comm
            )
            self.rebuild(self._tuner.cap_mb)
        else:
            self.rebuild(float(self.bucket_cap_mb))
        return model

    def rebuild(self, cap_mb: float) -> None:
        """(Re)make the buckets for a cap, keeping the gradients they hold; not while buckets are in flight."""
        assert self._launcher is not None
        self._cap_mb = cap_mb
        # Reverse registration order: the last layers' gradients are ready first in backward.
        self._flat = FlatGrads(list(group_by_size(reversed(self._params), int(cap_mb * 2**20))), self._world_size)
        self._launcher.build([b.params for b in self._flat.buckets], self._grad_ready, self._start)

    def _grad_ready(self, index: int, j: int, param: nn.Parameter, first: bool) -> None:
        """A gradient for `param` was accumulated: it must be in its view (someone may have replaced it)."""
        assert self._flat is not None
        view = self._flat.buckets[index].views[j]
        grad = param.grad
        if grad is not view:  # e.g. set_to_none: put the view back
            assert grad is not None, "autograd calls this hook after accumulating a gradient"
            view.copy_(grad)
            param.grad = view

    def _start(self, index: int) -> dist.Work:
        """Bucket `index` has all its gradients: its collective leaves now, while backward goes on."""
        assert self._flat is not None
        bucket = self._flat.buckets[index]
        if self.collective == "all_reduce":
            return self.comm.all_reduce(bucket.grads, index)
        return self.comm.reduce_scatter(bucket.shard, bucket.buffer, index, grad_bytes=bucket.nbytes)

    def after_backward(self, model: nn.Module) -> None:
        assert self._flat is not None and self._launcher is not None
        launcher, timer = self._launcher, self._launcher.timer
        works = launcher.finish_backward()  # every bucket has left by now
        gathers: list[tuple[Any, dist.Work]] = []
        for index, (bucket, work) in enumerate(zip(self._flat.buckets, works, strict=True)):
            work.wait()
            if self.collective == "all_reduce":
                bucket.grads.div_(self._world_size)
            else:  # this rank's shard of the sum: average it, then every rank gets every shard back
                bucket.shard.div_(self._world_size)
                gathers.append((timer.now(), self.comm.all_gather(bucket.buffer, bucket.shard, index)))
        for started, gather in gathers:
            gather.wait()
            timer.note(started)
        launcher.end_step()
        if self._tuner is not None:  # bucket_cap_mb=auto: the averaged gradients move to the new buckets
            cap_mb = self._tuner.after_step()
            if cap_mb is not None:
                self.rebuild(cap_mb)

    @property
    def _works(self) -> list[Waitable]:
        assert self._launcher is not None, "wrap() first"
        return self._launcher.works

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        assert self._launcher is not None
        return self._launcher.local()

    def zero_grad(self, optimizer: Optimizer) -> None:
        assert self._flat is not None
        self._flat.zero()

    def pop_comm_counts(self) -> CommCounters:
        counts = self.comm.counts.pop()
        assert self._launcher is not None
        self._launcher.timer.add_to(counts)
        return counts

    def row_metrics(self) -> dict[str, float]:
        return {"sync/bucket_cap_mb": self._cap_mb}

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "strategy": "bucketed",
            "bucket_cap_mb": self.bucket_cap_mb,
            "collective": self.collective,
            "comm_timing": "none" if self.bucket_timer is None else f"per bucket, 1 step in {self.time_every_n_steps}",
        }
        if self._tuner is not None:
            info["auto_trials"] = self._tuner.table()
            info["auto_chosen_mb"] = self._tuner.chosen_mb
            info["bucket_cap_mb_in_use"] = self._cap_mb
        if self._flat is not None:
            info["num_buckets"] = len(self._flat.buckets)
            info["bucket_sizes_bytes"] = self._flat.sizes()
            info["total_parameter_bytes"] = self._flat.nbytes
        return info
