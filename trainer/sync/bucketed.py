"""DDP's mechanism written out: gradient buckets, a hook per parameter, communication during backward.

1. wrap(): rank 0's parameters and buffers are broadcast; the parameters are grouped, in reverse
   registration order (roughly the order backward produces their gradients), into buckets of
   about `bucket_cap_mb`, whose flat buffers hold the gradients (each .grad a view: no copies).
2. backward: a post-accumulate-grad hook on each parameter counts the gradients still missing in
   its bucket; when none is, the bucket's collective starts asynchronously while backward goes on
   computing earlier layers. Buckets start strictly in order (a bucket ready early waits for the
   ones before it), so every rank issues the same collectives in the same order, as DDP does.
3. after_backward(): waits for every bucket, divides by the world size (rs_ag: then all_gathers).
4. no_sync(): the hooks do nothing; gradients accumulate locally in the buffers.

The hooks, the learned hook counts (a layer reused under reentrant checkpointing fires its hook
more than once per backward) and the timing are trainer/sync/bucket_launch.py's, shared with
`zero`; here strict: a parameter that got no gradient in the first step on some rank, or whose
count differs across ranks, is refused then with a ConfigError naming it, and a later hook beyond
the learned count (the graph changed) is an error naming the parameter rather than a bucket sent
incomplete. Communication is timed on one step in `time_every_n_steps` (the logged one by default).
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Any

import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from trainer.sync import averaging
from trainer.sync.autotune import DEFAULT_CANDIDATES_MB, CapTuner, check_cap
from trainer.sync.base import SyncStrategy
from trainer.sync.bucket_launch import BucketLauncher
from trainer.sync.comm import CommCounters, check_time_every_n_steps
from trainer.sync.flat import FlatGrads, plan
from trainer.sync.manual import broadcast_from_rank0
from trainer.sync.unused import names_of


class BucketedSync(SyncStrategy):
    """Gradients averaged bucket by bucket as backward produces them, by hooks this module registers."""

    def __init__(
        self,
        bucket_cap_mb: float | str = 25.0,
        collective: str = "all_reduce",
        time_every_n_steps: int = 10,
        auto_candidates_mb: Sequence[float] = DEFAULT_CANDIDATES_MB,
        auto_steps_per_trial: int = 3,
        auto_warmup_steps: int = 2,
    ) -> None:
        super().__init__()
        cap, candidates = check_cap(bucket_cap_mb, auto_candidates_mb, auto_steps_per_trial, auto_warmup_steps)
        check_time_every_n_steps(time_every_n_steps, "the bucket clocks")
        self.bucket_cap_mb = cap  # a number, or "auto"
        self.auto_candidates_mb = candidates
        self.auto_steps_per_trial = auto_steps_per_trial
        self.auto_warmup_steps = auto_warmup_steps
        self._tuner: CapTuner | None = None
        self._cap_mb = 0.0  # the cap the buckets were built with
        self.collective = averaging.check_collective(collective)
        self.time_every_n_steps = time_every_n_steps
        self._params: list[nn.Parameter] = []
        self._flat: FlatGrads | None = None
        self._launcher: BucketLauncher | None = None
        self._world_size = 1

    def wrap(self, model: nn.Module) -> nn.Module:
        broadcast_from_rank0(model)
        self._world_size = dist.get_world_size()
        self._params = [p for p in model.parameters() if p.requires_grad]
        names = names_of(model, self._params)
        self._launcher = BucketLauncher("bucketed", self._params, names, self.time_every_n_steps)
        if self.bucket_cap_mb == "auto":
            device = self._params[0].device
            self._tuner = CapTuner(self.auto_candidates_mb, self.auto_steps_per_trial, self.auto_warmup_steps, device)
            self.rebuild(self._tuner.cap_mb)
        else:
            self.rebuild(float(self.bucket_cap_mb))
        return model

    @property
    def _works(self) -> list[averaging.Waitable]:
        assert self._launcher is not None, "wrap() first"
        return self._launcher.works

    def rebuild(self, cap_mb: float) -> None:
        """(Re)make the buckets for a cap, keeping the gradients they hold; not while buckets are in flight."""
        assert self._launcher is not None
        self._cap_mb = cap_mb
        # Reverse registration order: the last layers' gradients are ready first in backward.
        self._flat = FlatGrads(list(plan(reversed(self._params), int(cap_mb * 2**20))), self._world_size)
        flat = self._flat
        self._launcher.build(
            [b.params for b in flat.buckets],
            self._grad_ready,
            lambda index: averaging.start(flat.buckets[index], self.collective, index),
        )

    def _grad_ready(self, index: int, j: int, param: nn.Parameter, first: bool) -> None:
        """A gradient for `param` was accumulated: it must be in its view (someone may have replaced it)."""
        assert self._flat is not None
        view = self._flat.buckets[index].views[j]
        grad = param.grad
        if grad is not view:  # e.g. set_to_none: put the view back
            assert grad is not None, "autograd calls this hook after accumulating a gradient"
            view.copy_(grad)
            param.grad = view

    def after_backward(self, model: nn.Module) -> None:
        assert self._flat is not None and self._launcher is not None
        launcher = self._launcher
        works = launcher.finish_backward()
        gathers: list[tuple[Any, dist.Work]] = []
        for index, (bucket, work) in enumerate(zip(self._flat.buckets, works, strict=True)):
            gather = averaging.finish(bucket, self.collective, work, self._world_size, index)
            averaging.count(self.comm, bucket, self.collective)
            if gather is not None:
                gathers.append((launcher.now(), gather))
        for started, gather in gathers:
            gather.wait()
            launcher.note(started)
        launcher.end_step()
        if self._tuner is not None:  # bucket_cap_mb=auto: the averaged gradients move to the new buckets
            cap_mb = self._tuner.after_step()
            if cap_mb is not None:
                self.rebuild(cap_mb)

    def row_metrics(self) -> dict[str, float]:
        return {"sync/bucket_cap_mb": self._cap_mb}

    def take_comm(self) -> CommCounters:
        counts = self.comm.take()
        assert self._launcher is not None
        self._launcher.take_timing(counts)
        return counts

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        assert self._launcher is not None
        return self._launcher.local()

    def zero_grad(self, optimizer: Optimizer) -> None:
        assert self._flat is not None
        self._flat.zero()

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {
            "strategy": "bucketed",
            "bucket_cap_mb": self.bucket_cap_mb,
            "collective": self.collective,
            "comm_timing": f"per bucket, 1 step in {self.time_every_n_steps}",
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
