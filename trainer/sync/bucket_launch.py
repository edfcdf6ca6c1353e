"""Starting a collective per gradient bucket as soon as backward has filled it: shared by
`bucketed` (DDP by hand) and `zero` (ZeRO by hand), which differ only in what a bucket holds and
which collective it starts.

A post-accumulate-grad hook per parameter counts the gradients still missing in its bucket; when
none is, the bucket starts, strictly in order (a bucket ready early waits for the ones before it),
so every rank issues the same collectives in the same order. A parameter's hook can fire more than
once per backward (a layer reused under reentrant checkpointing), so a bucket is ready after a
number of hook calls, learned in the first step, as DDP's static graph does: there every bucket
starts only after backward, and the ranks agree on each parameter's count (one small all_reduce,
once). `strict` (bucketed): a parameter with no gradient on some rank in the first step, or a count
that differs across ranks, is refused then, and a bucket still incomplete after backward is an
error. Not strict (zero): the count is the most any rank saw, and buckets still incomplete after
backward start then, in order (a missing gradient counts as zero; every rank still pairs up).
`in_backward=False`: no bucket starts during backward (a graph whose parameters come and go).

Each launch goes through the launcher's `timer`, composed in by the strategy's config
(`sync.bucket_timer`: bucket_timing.py's BucketTimer, which times one step in `time_every_n_steps`);
without one, `Untimed` launches each collective as it is and notes nothing. The strategy reads the
timer at rows and times by hand what it starts itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.hooks import RemovableHandle

from trainer.errors import ConfigError
from trainer.sync.collectives import Collectives, CommCounters, Waitable

# on_grad(bucket index, index in the bucket, parameter, first call in this backward)
OnGrad = Callable[[int, int, nn.Parameter, bool], None]
Start = Callable[[int], dist.Work]


class Untimed:
    """The launcher's timer when none is composed in: collectives leave as they are, nothing is noted."""

    def launched(self, start: Start, bucket: int) -> Waitable:
        return start(bucket)

    def backward_ended(self) -> None:
        pass

    def now(self) -> Any:
        """A mark for a collective timed by hand (None: not timed)."""
        return None

    def note(self, started: Any) -> None:
        pass

    def note_after(self, started: Any, waited_from: Any) -> None:
        pass

    def end_step(self) -> None:
        pass

    def add_to(self, counts: CommCounters) -> None:
        pass


# (device, time_every_n_steps, the step ends at the next forward) -> the timer: sync.bucket_timer
TimerFactory = Callable[[torch.device, int, bool], Untimed]


class BucketLauncher:
    """Hooks that start each bucket's collective once backward has produced its gradients."""

    def __init__(
        self,
        strategy: str,
        params: Sequence[nn.Parameter],
        names: Sequence[str],
        timer: Untimed,
        comm: Collectives,
        strict: bool = True,
        in_backward: bool = True,
    ) -> None:
        self.strategy = strategy
        self.params, self.names = list(params), list(names)
        self.strict, self.in_backward = strict, in_backward
        self.timer = timer
        self.comm = comm  # the strategy's: the first step's count agreement goes through it
        self.expected: list[int] | None = None  # per parameter, hook calls per backward (learned in step 1)
        self.accumulating = False  # no_sync: the hooks do nothing, gradients accumulate locally
        self.works: list[Waitable] = []  # per started bucket, in order
        self._position = {id(p): i for i, p in enumerate(self.params)}
        self._groups: list[list[nn.Parameter]] = []
        self._start: Start | None = None
        self._handles: list[RemovableHandle] = []
        self._calls: list[int] = []  # per parameter, hook calls in this backward
        self._bucket_calls: list[int] = []  # per bucket, the hook calls that complete it
        self._missing: list[int] = []
        self._next = 0  # the next bucket to start

    def build(self, groups: Sequence[Sequence[nn.Parameter]], on_grad: OnGrad, start: Start) -> None:
        """(Re)register the hooks for these buckets; not while buckets are in flight."""
        for handle in self._handles:
            handle.remove()
        self._groups = [list(g) for g in groups]
        self._start = start
        self._count_calls()
        self._handles = [
            param.register_post_accumulate_grad_hook(partial(self._hook, index, j, self._position[id(param)], on_grad))
            for index, group in enumerate(self._groups)
            for j, param in enumerate(group)
        ]
        self._reset()

    def _count_calls(self) -> None:
        """Each bucket's hook calls per backward, from the learned counts (once per build, not per step)."""
        if self.expected is None or not self.in_backward:  # no bucket starts during backward
            self._bucket_calls = [-1] * len(self._groups)
            return
        self._bucket_calls = [sum(self.expected[self._position[id(p)]] for p in g) for g in self._groups]

    def _reset(self) -> None:
        self._calls = [0] * len(self.params)
        self._missing = list(self._bucket_calls)
        self._next = 0
        self.works = []

    def _hook(self, index: int, j: int, position: int, on_grad: OnGrad, param: nn.Parameter) -> None:
        """Autograd's hook: a gradient for `param` was accumulated (once, or once per reuse)."""
        if self.accumulating:
            return
        self._calls[position] += 1
        on_grad(index, j, param, self._calls[position] == 1)
        if self._bucket_calls[index] < 0:
            return  # learning the counts, or never during backward: buckets start in finish_backward
        assert self.expected is not None
        if self._calls[position] > self.expected[position]:
            raise RuntimeError(
                f"sync={self.strategy}: parameter {self.names[position]!r} got gradient number "
                f"{self._calls[position]} in one backward, but {self.expected[position]} in the first step: its "
                "bucket may already be on its way; the graph must be the same in every step (or use sync=manual)"
            )
        self._missing[index] -= 1
        while self._next < len(self._missing) and self._missing[self._next] == 0:
            self._launch(self._next)
            self._next += 1

    def _launch(self, index: int) -> None:
        assert self._start is not None
        self.works.append(self.timer.launched(self._start, index))

    def _learn(self) -> None:
        """End of the first step's backward: every rank's hook counts agreed (one small all_reduce)."""
        device = self.params[0].device
        counts = torch.tensor(self._calls, dtype=torch.int64, device=device)
        both = torch.cat([counts, -counts])
        self.comm.agree(both, dist.ReduceOp.MAX)  # every rank must reach this: [max count, -min count]
        most, least = both[: len(counts)].tolist(), (-both[len(counts) :]).tolist()
        if self.strict:
            unused = [self.names[i] for i, n in enumerate(least) if n == 0]
            if unused:
                raise ConfigError(
                    f"sync={self.strategy} is invalid for this model: parameter(s) {unused[:5]} got no gradient in "
                    "the first step on some rank, and a bucket is sent when all its gradients are in; use "
                    "sync=manual or sync=zero with sync.find_unused_parameters=true, sync=ddp with it, or sync=fsdp"
                )
            uneven = [self.names[i] for i, (a, b) in enumerate(zip(most, least, strict=True)) if a != b]
            if uneven:
                raise ConfigError(
                    f"sync={self.strategy} is invalid for this model: parameter(s) {uneven[:5]} got gradients a "
                    "different number of times per backward on different ranks in the first step; use sync=manual"
                )
        self.expected = most
        self._count_calls()

    def finish_backward(self, fill_missing: Callable[[int], None] | None = None) -> list[Waitable]:
        """After the last backward: every bucket started (the rest now, in order, each after
        `fill_missing` has folded in what its hooks did not deliver); their works, in order."""
        if self.in_backward and self.expected is None:
            self._learn()
        elif self.strict and self._next < len(self._groups):
            assert self.expected is not None
            short = [n for n, c, e in zip(self.names, self._calls, self.expected, strict=True) if c < e]
            raise RuntimeError(
                f"sync={self.strategy}: {len(self._groups) - self._next} bucket(s) never got all their gradients "
                f"this step: parameter(s) {short[:5]} got fewer gradients than in the first step; every trainable "
                "parameter must receive its gradients in every backward (or use sync=manual with "
                "sync.find_unused_parameters)"
            )
        self.timer.backward_ended()
        for index in range(self._next, len(self._groups)):
            if fill_missing is not None:
                fill_missing(index)
            self._launch(index)
        self._next = len(self._groups)
        return self.works

    def end_step(self) -> None:
        """The step's collectives are all done."""
        self.timer.end_step()
        self._reset()

    @contextmanager
    def local(self) -> Iterator[None]:
        self.accumulating = True
        try:
            yield
        finally:
            self.accumulating = False
