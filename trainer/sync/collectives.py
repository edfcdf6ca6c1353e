"""The collectives a strategy issues, in one place: each launched asynchronously, counted for the
comm/* metrics, and named in the profiler's trace while trainer.profile records.

Every strategy sends through its `self.comm` (a Collectives, trainer/sync/base.py), so its own file
says only what is sent and when; the books are kept here. Control collectives (the agreements of
a few bytes that keep the ranks in step: unused-parameter flags, the non-finite check, the cap
tuner's vote) go through it too, through `agree` and `agree_from`, counted apart from gradients.

The names: while the profiler records (`recording`, a module flag trainer/loop/profiling.py sets),
each launch runs inside a range such as `bucket 3 all_reduce 4.0 MiB` around c10d's op, and the
timeline (trainer/logger/timeline_trace.py) pairs each with the backend's record of its execution
(gloo's thread, or the NCCL kernel) to draw one span from launch to completion. With the profiler
off, naming costs one global read per collective.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

recording = False  # True only while trainer.profile=true's profiler is active

MIB = 2**20  # sizes in names are binary (MiB, KiB), as bucket_cap_mb is
# The flat-tensor forms under their torch >= 2.14 names, or the older ones (deprecated there).
all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Waitable(Protocol):
    """A collective in flight: a dist.Work, or a future chained to one."""

    def wait(self) -> Any: ...


@dataclass
class CommCounters:
    """Cumulative since the last pop(): bytes synced, calls, and (when measured) wall time.

    `bytes` is all_reduce-equivalent gradient bytes (a reduce_scatter and its all_gather of a
    gradient count it once). `seconds` and `exposed_seconds` cover `timed_steps` steps: every step
    when a hook times each bucket, or one sampled step per row when DDP's runtime statistics time it.
    """

    bytes: int = 0
    collectives: int = 0
    seconds: float = 0.0  # wall time with at least one collective in flight
    exposed_seconds: float = 0.0  # the part of it not hidden under backward computation
    timed_steps: int = 0  # how many steps seconds/exposed_seconds were measured over (0: untimed)
    # Per kind of collective ("all_reduce", "reduce_scatter", ...): [bytes of the buffer, calls].
    kinds: dict[str, list[int]] = field(default_factory=dict)
    # Control collectives (agreements of a few bytes: unused-parameter flags, the non-finite check,
    # the cap tuner's vote, hook counts): [bytes, calls], kept apart from the gradient traffic above.
    control: list[int] = field(default_factory=lambda: [0, 0])

    def add(self, kind: str, nbytes: int) -> None:
        """One collective of `kind` on a buffer of `nbytes` (nccl-tests' size: the whole buffer)."""
        counts = self.kinds.setdefault(kind, [0, 0])
        counts[0] += nbytes
        counts[1] += 1
        self.collectives += 1

    def pop(self) -> CommCounters:
        """The counts so far; the counters start again from zero."""
        popped = CommCounters(
            self.bytes, self.collectives, self.seconds, self.exposed_seconds, self.timed_steps, self.kinds, self.control
        )
        self.bytes, self.collectives, self.seconds, self.exposed_seconds, self.timed_steps = 0, 0, 0.0, 0.0, 0
        self.kinds, self.control = {}, [0, 0]
        return popped


def busy_time(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: time with at least one collective in flight."""
    total, cursor = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > cursor:
            total += end - max(start, cursor)
            cursor = end
    return total


def exposed_time(intervals: Sequence[tuple[float, float]]) -> float:
    """Communication left after the last bucket was launched, i.e. after backward's compute ended."""
    if not intervals:
        return 0.0
    return max(0.0, max(end for _, end in intervals) - max(start for start, _ in intervals))


class Collectives:
    """torch.distributed's collectives, asynchronous (SUM for reductions), each one counted in
    `counts` and, while trainer.profile records, launched inside a profiler range naming it
    (`bucket 3 all_reduce 4.0 MiB`); otherwise the naming costs one global read.

    `grad_bytes`: the gradient bytes a reduction averages, for comm/bytes_per_step (default: the
    whole tensor); a gather or broadcast of parameters adds none. network=<preset> swaps in
    trainer/sync/network.py's EmulatedCollectives, whose Works are done no earlier than its `link`
    would finish them (DDP's hooks delay their futures through that link too).
    """

    def __init__(self) -> None:
        self.counts = CommCounters()

    def all_reduce(self, tensor: torch.Tensor, bucket: int | None = None, grad_bytes: int | None = None) -> dist.Work:
        nbytes = self._count("all_reduce", tensor, grad_bytes)
        return _launch("all_reduce", nbytes, bucket, dist.all_reduce, tensor, op=dist.ReduceOp.SUM, async_op=True)

    def reduce_scatter(
        self, shard: torch.Tensor, full: torch.Tensor, bucket: int | None = None, grad_bytes: int | None = None
    ) -> dist.Work:
        """This rank's 1/N of the sum of `full` (a padded buffer) into `shard`."""
        nbytes = self._count("reduce_scatter", full, grad_bytes)
        return _launch(
            "reduce_scatter", nbytes, bucket, reduce_scatter_tensor, shard, full, op=dist.ReduceOp.SUM, async_op=True
        )

    def all_gather(self, full: torch.Tensor, shard: torch.Tensor, bucket: int | None = None) -> dist.Work:
        """Every rank's `shard`, side by side, into every rank's `full`."""
        nbytes = self._count("all_gather", full, 0)
        return _launch("all_gather", nbytes, bucket, all_gather_tensor, full, shard, async_op=True)

    def broadcast(self, tensor: torch.Tensor, src: int, bucket: int | None = None) -> dist.Work:
        nbytes = self._count("broadcast", tensor, 0)
        return _launch("broadcast", nbytes, bucket, dist.broadcast, tensor, src=src, async_op=True)

    def agree(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """A control collective: `tensor` all-reduced with `op` in place and waited for (every rank
        must call it). Counted under `control`, never as gradient traffic; named and, on an emulated
        link, delayed like any other collective."""
        nbytes = self._control(tensor)
        work = _launch("control all_reduce", nbytes, None, dist.all_reduce, tensor, op=op, async_op=True)
        self.delayed(work, "all_reduce", nbytes).wait()
        return tensor

    def agree_from(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """A control broadcast: every rank takes `src`'s `tensor` (a decision one rank made)."""
        nbytes = self._control(tensor)
        work = _launch("control broadcast", nbytes, None, dist.broadcast, tensor, src=src, async_op=True)
        self.delayed(work, "broadcast", nbytes).wait()
        return tensor

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Same seed is not enough to trust: every replica starts from rank 0's parameters and buffers.
        Counted as control traffic (set-up, once), not as a step's gradient bytes."""
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                self.agree_from(tensor, 0)

    def delayed(self, work: dist.Work, kind: str, nbytes: int) -> dist.Work:
        """The Work as the link hands it on: here at once; network=<preset>'s subclass delays it."""
        return work

    def _control(self, tensor: torch.Tensor) -> int:
        nbytes = _nbytes(tensor)
        self.counts.control[0] += nbytes
        self.counts.control[1] += 1
        return nbytes

    def _count(self, kind: str, tensor: torch.Tensor, grad_bytes: int | None) -> int:
        nbytes = tensor.numel() * tensor.element_size()
        self.counts.bytes += nbytes if grad_bytes is None else grad_bytes
        self.counts.add(kind, nbytes)
        return nbytes


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def mib(nbytes: int) -> str:
    """4.0 MiB; under 0.1 MiB in KiB (12.3 KiB), so that small buckets still tell apart."""
    return f"{nbytes / MIB:.1f} MiB" if nbytes >= MIB / 10 else f"{nbytes / 1024:.1f} KiB"


def collective_name(kind: str, nbytes: int, bucket: int | None = None) -> str:
    """`bucket 3 all_reduce 4.0 MiB`: what the launch is, as the trace and the timeline show it."""
    return f"{'' if bucket is None else f'bucket {bucket} '}{kind} {mib(nbytes)}"


def named(kind: str, nbytes: int, bucket: int | None = None) -> AbstractContextManager[Any]:
    """The range a collective's launch runs in (a no-op unless the profiler records)."""
    if not recording:
        return nullcontext()
    return record_function(collective_name(kind, nbytes, bucket))


def _launch(kind: str, nbytes: int, bucket: int | None, collective: Any, *args: Any, **kwargs: Any) -> dist.Work:
    if recording:
        with named(kind, nbytes, bucket):
            return _started(collective(*args, **kwargs))
    return _started(collective(*args, **kwargs))


def _started(work: dist.Work | None) -> dist.Work:
    assert work is not None, "async_op=True returns the collective's Work"
    return work
