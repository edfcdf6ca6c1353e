"""DDP's mechanism written out (the DDP notes' version 2, by hand): gradient buckets, a hook per
parameter, communication while backward goes on.

1. wrap(): rank 0's parameters and buffers are broadcast. The parameters are grouped in *reverse*
   registration order (roughly the order backward produces their gradients: the last layer's
   first) into buckets of about `bucket_cap_mb`, whose flat buffers hold the gradients (each .grad
   a view: no copies), and each parameter gets a hook that autograd calls once its gradient is in.
2. Step 1 learns how many gradients each parameter receives per backward (more than one for a
   layer reused under reentrant checkpointing) and the ranks agree on the counts: a parameter
   without a gradient on some rank, or with different counts on different ranks, is refused
   (trainer/sync/unused.py's rule). Until the counts are known no bucket can tell it is complete,
   so step 1's buckets all start after its backward: overlap begins at step 2. Step 1 also notes
   the order the gradients arrived in, and the buckets are rebuilt once in rank 0's order (the
   ranks take it from rank 0, so they build the same buckets), as DDP rebuilds its own: a model
   whose registration order is not its backward order then keeps no finished bucket waiting.
3. From step 2, backward: each hook counts its bucket's arrivals; when a bucket has them all and
   every bucket before it has started, its all_reduce(SUM) starts asynchronously while backward
   goes on computing the earlier layers ("layer 10 syncs while layer 9 computes"). Strictly in
   order (trainer/sync/buckets.py): every rank issues the same collectives in the same order.
4. after_backward(): wait for each bucket and divide it by world_size: every rank now holds the
   average (collective=rs_ag: the reduce_scatter left each rank its shard of the sum; divide it,
   then all_gather the shards back).
5. no_sync(): the hooks do nothing; gradients accumulate locally in the buffers.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from trainer.comm_schedule import Buckets, Hop, Schedule
from trainer.errors import ConfigError
from trainer.footprint import Footprint, Plan
from trainer.sync.autotune import AUTO_CANDIDATES_MB, CandidatesMb, CapMb, CapTuner, StepsPerTrial, WarmupSteps
from trainer.sync.base import SyncStrategy
from trainer.sync.buckets import InOrder
from trainer.sync.flat import Collective, FlatGrads, group_by_size, names_of
from trainer.sync.unused import fewest_and_most, ranks_using, refuse_missing

REFUSAL_FIX = "use sync=manual or sync=zero with sync.find_unused_parameters=true, sync=ddp with it, or sync=fsdp"


class BucketedSync(SyncStrategy):
    """Gradients averaged bucket by bucket as backward produces them, by hooks this module registers."""

    name = "bucketed"

    def __init__(
        self,
        bucket_cap_mb: CapMb = 25.0,
        auto_candidates_mb: CandidatesMb = AUTO_CANDIDATES_MB,
        auto_steps_per_trial: StepsPerTrial = 3,
        auto_warmup_steps: WarmupSteps = 2,
        collective: Collective = "all_reduce",
    ) -> None:
        super().__init__()
        self.bucket_cap_mb = bucket_cap_mb if bucket_cap_mb == "auto" else float(bucket_cap_mb)
        self.collective = collective
        self.auto_candidates_mb = [float(c) for c in auto_candidates_mb]
        self.auto_steps_per_trial, self.auto_warmup_steps = auto_steps_per_trial, auto_warmup_steps
        self._params: list[nn.Parameter] = []
        self._names: list[str] = []
        self._flat: FlatGrads | None = None
        self._handles: list[RemovableHandle] = []
        self._calls: list[int] = []  # per parameter, the gradients it received in this backward
        self._arrival: list[int] = []  # step 1: the parameters (positions) in the order their gradients came
        self._expected: list[int] | None = None  # per parameter, per backward: learned in step 1
        self._order: InOrder | None = None  # None in step 1
        self._works: list[dist.Work] = []  # this step's bucket collectives, in order
        self._accumulating = False

    def wrap(self, model: nn.Module) -> nn.Module:
        self.comm.broadcast_parameters(model)
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._names = names_of(model, self._params)
        self._calls = [0] * len(self._params)
        self.comm.holds(lambda: self._flat.held() if self._flat is not None else {})  # rebuild() remakes it
        if self.bucket_cap_mb == "auto":  # the tuner tries caps in the first steps (SyncStrategy.after_step)
            candidates, steps, warmup = self.auto_candidates_mb, self.auto_steps_per_trial, self.auto_warmup_steps
            self.tuner = CapTuner(
                candidates, steps, warmup, self._params[0].device, self.comm, self._groups, rebuild=self.rebuild
            )
        self.rebuild(self.tuner.cap_mb if self.tuner else float(self.bucket_cap_mb))
        return model

    def rebuild(self, cap_mb: float) -> None:
        """(Re)make the buckets for a cap, keeping the gradients they hold; not while buckets are in flight."""
        self._flat = FlatGrads(self._groups(cap_mb), dist.get_world_size(), shards=self.collective == "rs_ag")
        position = {id(p): i for i, p in enumerate(self._params)}
        for handle in self._handles:
            handle.remove()
        # Autograd calls a parameter's hook once its gradient has been accumulated into .grad.
        self._handles = [
            param.register_post_accumulate_grad_hook(partial(self._gradient_ready, index, j, position[id(param)]))
            for index, bucket in enumerate(self._flat.buckets)
            for j, param in enumerate(bucket.params)
        ]
        self._order = self._in_order()

    def _groups(self, cap_mb: float) -> list[list[nn.Parameter]]:
        """The parameters each bucket holds with this cap: consecutive in the order gradients arrive,
        once step 1 has seen it; until then reverse registration order (the last layers' gradients are
        ready first in backward)."""
        ordered = [self._params[i] for i in self._arrival] if self._order else list(reversed(self._params))
        return list(group_by_size(ordered, int(cap_mb * 2**20)))

    def _in_order(self) -> InOrder | None:
        """Each bucket's arrivals per backward, from the learned counts (None until step 1 taught them)."""
        if self._expected is None or self._flat is None:
            return None
        position = {id(p): i for i, p in enumerate(self._params)}
        return InOrder([sum(self._expected[position[id(p)]] for p in b.params) for b in self._flat.buckets])

    def _gradient_ready(self, index: int, j: int, position: int, param: nn.Parameter) -> None:
        """Autograd's hook: `param`'s gradient is in (once, or once per reuse). Maybe start buckets."""
        if self._accumulating:  # no_sync: the gradient stays in its bucket, summed with the next micro-batch's
            return
        assert self._flat is not None
        view = self._flat.buckets[index].views[j]
        if param.grad is not view:  # something replaced it (set_to_none): back into the bucket
            assert param.grad is not None, "autograd calls this hook after accumulating a gradient"
            view.copy_(param.grad)
            param.grad = view
        self._calls[position] += 1
        if self._order is None:  # step 1: the counts and the order are being learned; buckets start after backward
            if self._calls[position] == 1:
                self._arrival.append(position)
            return
        assert self._expected is not None
        if self._calls[position] > self._expected[position]:
            raise RuntimeError(
                f"sync=bucketed: parameter {self._names[position]!r} got gradient number {self._calls[position]} "
                f"in one backward, but {self._expected[position]} in the first step: its bucket may already be on "
                "its way; the graph must be the same in every step (or use sync=manual)"
            )
        for ready in self._order.arrived(index):  # complete, and every bucket before it has started
            self._works.append(self._send(ready))

    def _send(self, index: int) -> dist.Work:
        """Bucket `index` has all its gradients: its collective leaves now, while backward goes on."""
        assert self._flat is not None
        bucket = self._flat.buckets[index]
        if self.collective == "all_reduce":
            return self.comm.all_reduce(bucket.grads, index)
        return self.comm.reduce_scatter(bucket.shard, bucket.buffer, index)

    def after_backward(self, model: nn.Module) -> None:
        assert self._flat is not None
        learning = self._order is None
        if self._order is None:
            self._learn()
        elif self._order.next < len(self._flat.buckets):
            self._refuse_incomplete()
        assert self._order is not None
        for index in self._order.rest():  # step 1: every bucket, in order
            self._works.append(self._send(index))
        world_size, gathers = dist.get_world_size(), []
        for index, (bucket, work) in enumerate(zip(self._flat.buckets, self._works, strict=True)):
            work.wait()
            if self.collective == "all_reduce":
                bucket.grads.div_(world_size)  # every rank now holds the average
            else:  # this rank's shard of the sum: average it, then every rank gets every shard back
                bucket.shard.div_(world_size)
                gathers.append(self.comm.all_gather(bucket.buffer, bucket.shard, index))
        for gather in gathers:
            gather.wait()
        self._works, self._calls = [], [0] * len(self._params)
        self._order.reset()
        if learning:  # the buckets in the order step 1's gradients came, rank 0's (the averages move along)
            arrival = torch.tensor(self._arrival, dtype=torch.int64, device=self._params[0].device)
            self._arrival = self.comm.agree_from(arrival, 0).tolist()
            self.rebuild(self.tuner.cap_mb if self.tuner else float(self.bucket_cap_mb))

    def _learn(self) -> None:
        """End of step 1's backward: the ranks agree on each parameter's gradient count (every rank
        must reach this), which must be the same on every rank and never zero."""
        device = self._params[0].device
        refuse_missing(ranks_using(self.comm, self._calls, device), self._names, "bucketed", REFUSAL_FIX)
        fewest, most = fewest_and_most(self.comm, self._calls, device)
        uneven = [name for name, a, b in zip(self._names, fewest, most, strict=True) if a != b]
        if uneven:
            raise ConfigError(
                f"sync=bucketed is invalid for this model: parameter(s) {uneven[:5]} got gradients a different "
                "number of times per backward on different ranks in the first step; use sync=manual"
            )
        self._expected = most
        self._order = self._in_order()

    def _refuse_incomplete(self) -> None:
        assert self._expected is not None
        short = [name for name, c, e in zip(self._names, self._calls, self._expected, strict=True) if c < e]
        raise ConfigError(
            f"sync=bucketed: a bucket never got all its gradients this step: parameter(s) {short[:5]} got fewer "
            "gradients than in the first step; every trainable parameter must receive its gradients in every "
            "backward (sending the bucket with zeros would train another model than one process, which skips a "
            "parameter without a gradient): use sync=manual or sync=ddp with sync.find_unused_parameters=true"
        )

    @contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def zero_grad(self, optimizer: Optimizer) -> None:
        assert self._flat is not None
        self._flat.zero()

    def footprint(self, plan: Plan) -> Footprint:
        """Its buckets (bucket_cap_mb=auto: the largest candidate's), padded, and their shards."""
        cap_mb = max(self.auto_candidates_mb) if self.bucket_cap_mb == "auto" else float(self.bucket_cap_mb)
        groups = list(group_by_size(reversed(plan.trainable), int(cap_mb * 2**20)))
        return FlatGrads.replica(plan, groups, plan.world_size, self.collective == "rs_ag")  # all in flight at once

    def facts(self) -> dict[str, Any]:
        if self._flat is None:
            return {}
        sizes = self._flat.sizes()
        return {"num_buckets": len(sizes), "bucket_sizes_bytes": sizes, "total_parameter_bytes": sum(sizes)}

    def schedule(self) -> Schedule:
        """Buckets in gradient-ready order, each reduced as soon as backward has filled it (rs_ag: its
        reduce_scatter then, every all_gather after backward); bucket_cap_mb=auto: the largest candidate's."""
        cap_mb = max(self.auto_candidates_mb) if self.bucket_cap_mb == "auto" else float(self.bucket_cap_mb)
        if self.collective == "all_reduce":
            return Schedule(Buckets(cap_mb, hops=(Hop("all_reduce"),)))
        return Schedule(Buckets(cap_mb, hops=(Hop("reduce_scatter"),), after=(Hop("all_gather"),)))
