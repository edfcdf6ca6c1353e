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

A parameter's hook can fire more than once in one backward (a layer reused under reentrant
checkpointing accumulates its gradient once per backward pass through it), so a bucket is ready
after a number of hook calls, not of parameters. That number is learned in the first step, as
DDP's static graph does: its buckets all start only after backward, the ranks agree on every
parameter's count (one small all_reduce, once), and later steps start a bucket when its count is
reached. A parameter that got no gradient in the first step on some rank, or whose count differs
across ranks, is refused then with a ConfigError naming it; a later hook beyond the learned count
(the graph changed) is an error naming the parameter rather than a bucket sent incomplete.

Communication is timed on one step in `time_every_n_steps` (the logged one by default): each
bucket's launch and arrival, on host clocks on CPU (where gloo completes the future when the data
is there) or CUDA events on GPU (recorded on the stream that waits for the collective).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer
from torch.utils.hooks import RemovableHandle

from trainer.errors import ConfigError
from trainer.sync import averaging
from trainer.sync.autotune import DEFAULT_CANDIDATES_MB, CapTuner, check_cap
from trainer.sync.base import SyncStrategy
from trainer.sync.bucket_clock import Clock, timed
from trainer.sync.comm import CommCounters, busy_time, check_time_every_n_steps
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
        self._names: list[str] = []
        self._calls: list[int] = []  # per parameter, hook calls in this backward
        self._expected: list[int] | None = None  # per parameter, hook calls per backward (learned in step 1)
        self._bucket_calls: list[int] = []  # per bucket, the hook calls that complete it (1s while learning)
        self._flat: FlatGrads | None = None
        self._handles: list[RemovableHandle] = []
        self._missing: list[int] = []  # per bucket, gradients not yet ready in this backward
        self._next = 0  # the next bucket to start
        self._works: list[averaging.Waitable] = []
        self._accumulating = False
        self._world_size = 1
        self._clock: Clock | None = None
        self._step = 0
        self._timing = False  # this step's buckets are timed
        self._marks: list[Any] = []  # launch mark per started bucket (timed steps)
        self._spans: list[tuple[Any, Any]] = []  # (start, end) marks per collective, this timed step
        # Since the last row, per timed step: (origin, backward's end, spans).
        self._timed: list[tuple[Any, Any, list[tuple[Any, Any]]]] = []

    def wrap(self, model: nn.Module) -> nn.Module:
        broadcast_from_rank0(model)
        self._world_size = dist.get_world_size()
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._names = names_of(model, self._params)
        device = self._params[0].device
        self._clock = Clock(device)
        if self.bucket_cap_mb == "auto":
            self._tuner = CapTuner(self.auto_candidates_mb, self.auto_steps_per_trial, self.auto_warmup_steps, device)
            self.rebuild(self._tuner.cap_mb)
        else:
            self.rebuild(float(self.bucket_cap_mb))
        self._timing = self.time_every_n_steps == 1
        return model

    def rebuild(self, cap_mb: float) -> None:
        """(Re)make the buckets for a cap, keeping the gradients they hold; not while buckets are in flight."""
        for handle in self._handles:
            handle.remove()
        self._cap_mb = cap_mb
        # Reverse registration order: the last layers' gradients are ready first in backward.
        self._flat = FlatGrads(list(plan(reversed(self._params), int(cap_mb * 2**20))), self._world_size)
        position = {id(p): i for i, p in enumerate(self._params)}
        self._count_calls()
        self._handles = [
            param.register_post_accumulate_grad_hook(partial(self._grad_ready, index, position[id(param)], view))
            for index, bucket in enumerate(self._flat.buckets)
            for param, view in zip(bucket.params, bucket.views, strict=True)
        ]
        self._reset()

    def _count_calls(self) -> None:
        """Each bucket's hook calls per backward, from the learned counts (once per build, not per step)."""
        assert self._flat is not None
        if self._expected is None:  # the learning step: no bucket starts during backward
            self._bucket_calls = [1] * len(self._flat.buckets)
            return
        position = {id(p): i for i, p in enumerate(self._params)}
        self._bucket_calls = [
            sum(self._expected[position[id(p)]] for p in bucket.params) for bucket in self._flat.buckets
        ]

    def _reset(self) -> None:
        assert self._flat is not None
        self._calls = [0] * len(self._params)
        self._missing = list(self._bucket_calls)
        self._next = 0
        self._works = []
        self._marks = []

    def _grad_ready(self, index: int, position: int, view: torch.Tensor, param: torch.Tensor) -> None:
        """Autograd's hook: a gradient for `param` was accumulated (once, or once per reuse)."""
        if self._accumulating:
            return
        grad = param.grad
        if grad is not view:  # someone replaced the view (e.g. set_to_none): put it back
            assert grad is not None, "autograd calls this hook after accumulating a gradient"
            view.copy_(grad)
            param.grad = view
        self._calls[position] += 1
        if self._expected is None:
            return  # learning the counts: every bucket starts in after_backward
        if self._calls[position] > self._expected[position]:
            raise RuntimeError(
                f"sync=bucketed: parameter {self._names[position]!r} got gradient number {self._calls[position]} "
                f"in one backward, but {self._expected[position]} in the first step: its bucket may already be "
                "on its way; the graph must be the same in every step (or use sync=manual / sync=ddp)"
            )
        self._missing[index] -= 1
        while self._next < len(self._missing) and self._missing[self._next] == 0:
            self._start(self._next)
            self._next += 1

    def _start(self, index: int) -> None:
        assert self._flat is not None and self._clock is not None
        bucket = self._flat.buckets[index]
        if self._timing:
            self._marks.append(self._clock.now())
        work = averaging.start(bucket, self.collective, index)
        self._works.append(self._timed_work(work, self._marks[-1]) if self._timing else work)

    def _timed_work(self, work: dist.Work, started: Any) -> averaging.Waitable:
        """The collective, noting when its result arrived: from its future where the backend has one
        (gloo's all_reduce, NCCL), else when after_backward's wait returns (an upper bound)."""
        assert self._clock is not None
        return timed(work, started, self._clock, self._spans)

    def _learned(self) -> None:
        """End of the first step's backward: every rank's hook counts agreed (one small all_reduce), then
        every bucket started in order. A refusal happens here on every rank alike, before any bucket."""
        device = self._params[0].device
        counts = torch.tensor(self._calls, dtype=torch.int64, device=device)
        both = torch.cat([counts, -counts])
        dist.all_reduce(both, op=dist.ReduceOp.MAX)  # every rank must reach this: [max count, -min count]
        most, least = both[: len(counts)].tolist(), (-both[len(counts) :]).tolist()
        unused = [self._names[i] for i, n in enumerate(least) if n == 0]
        if unused:
            raise ConfigError(
                f"sync=bucketed is invalid for this model: parameter(s) {unused[:5]} got no gradient in the first "
                "step on some rank, and a bucket is sent when all its gradients are in; use "
                "sync=manual or sync=zero with sync.find_unused_parameters=true, sync=ddp with it, or sync=fsdp"
            )
        uneven = [self._names[i] for i, (a, b) in enumerate(zip(most, least, strict=True)) if a != b]
        if uneven:
            raise ConfigError(
                f"sync=bucketed is invalid for this model: parameter(s) {uneven[:5]} got gradients a different "
                "number of times per backward on different ranks in the first step; use sync=manual"
            )
        self._expected = most
        self._count_calls()
        for index in range(len(self._missing)):
            self._start(index)
        self._next = len(self._missing)

    def after_backward(self, model: nn.Module) -> None:
        assert self._flat is not None and self._clock is not None
        buckets = self._flat.buckets
        if self._expected is None:
            self._learned()
        if self._next < len(buckets):
            assert self._expected is not None
            short = [name for name, n, e in zip(self._names, self._calls, self._expected, strict=True) if n < e]
            raise RuntimeError(
                f"sync=bucketed: {len(buckets) - self._next} bucket(s) never got all their gradients this step: "
                f"parameter(s) {short[:5]} got fewer gradients than in the first step; every trainable parameter "
                "must receive its gradients in every backward (or use sync=manual with sync.find_unused_parameters)"
            )
        backward_end = self._clock.now() if self._timing else None
        gathers: list[tuple[Any, dist.Work]] = []
        for index, (bucket, work) in enumerate(zip(buckets, self._works, strict=True)):
            gather = averaging.finish(bucket, self.collective, work, self._world_size, index)
            averaging.count(self.comm, bucket, self.collective)
            if gather is not None:
                gathers.append((self._clock.now() if self._timing else None, gather))
        for started, gather in gathers:
            gather.wait()
            if self._timing:
                self._spans.append((started, self._clock.now()))
        if self._timing:
            self._timed.append((self._marks[0], backward_end, self._spans))
            self._spans = []
        self._step += 1
        self._timing = (self._step + 1) % self.time_every_n_steps == 0
        self._reset()
        if self._tuner is not None:  # bucket_cap_mb=auto: the averaged gradients move to the new buckets
            cap_mb = self._tuner.after_step()
            if cap_mb is not None:
                self.rebuild(cap_mb)

    def row_metrics(self) -> dict[str, float]:
        return {"sync/bucket_cap_mb": self._cap_mb}

    def take_comm(self) -> CommCounters:
        counts = self.comm.take()
        assert self._clock is not None
        for origin, backward_end, spans in self._timed:
            intervals = [(self._clock.seconds(origin, a), self._clock.seconds(origin, b)) for a, b in spans]
            end_of_backward = self._clock.seconds(origin, backward_end)
            counts.seconds += busy_time(intervals)
            counts.exposed_seconds += max(0.0, max(end for _, end in intervals) - end_of_backward)
            counts.timed_steps += 1
        self._timed = []
        return counts

    @contextmanager
    def _local(self) -> Iterator[None]:
        self._accumulating = True
        try:
            yield
        finally:
            self._accumulating = False

    def no_sync(self, model: nn.Module) -> AbstractContextManager[Any]:
        return self._local()

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
