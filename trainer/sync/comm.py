"""The communication object: every collective a strategy makes goes through its `self.comm`.

A strategy's file says what is sent and when; this module launches it and, only when asked, does
the rest, so that nothing of it sits between the algorithm's lines:
- reporting: on the observer's sampled step, each collective's kind, buffer, group and control
  flag, and the Work that notes its completion and the training thread's wait (trainer/observer.py
  turns them into the row's comm/* and time/comm* keys; trainer/measures.py defines them);
- naming: while the profiler records (`recording`), each launch runs inside a range such as
  `bucket 3 all_reduce 4.0 MiB`, which the timeline pairs with the backend's execution;
- the emulated link (network=<preset>, trainer/sync/network.py): each collective is handed on no
  earlier than the link would have finished it, charged by the ranks of the group it runs on.
On any other step a collective is the torch.distributed call and nothing else, save one tuple
appended to `launches` (the hang report's: which bucket or unit each of torch's Flight Recorder
records was, trainer/reliability/flight.py; None when the recorder is off).

It also sends every gradient reduction (all_reduce, reduce_scatter) in trainer.reduce_dtype
(`reduce_dtype`): where a strategy's buffer is in another dtype (16-bit gradients reduced in fp32,
or an fp32 shard receiving a 16-bit reduce_scatter), the collective runs on a copy in that dtype,
and the result lands in the strategy's buffer when the Work is waited for (`held()`: the copies
alive). Gathers and broadcasts move parameters and keep their dtype; agreements are control.

Collectives are launched asynchronously (SUM for reductions) and return a Work to wait for.
Control collectives (`agree`, `agree_from`: a few bytes that keep the ranks in step) are waited
for at once and reported apart from the data the strategy moves.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future
from torch.profiler import record_function

from trainer import trace_names
from trainer.observer import CommLaunch, Observer


def all_gather_tensor(*args: Any, **kwargs: Any) -> Any:
    """The flat-tensor all_gather under its torch >= 2.14 name, or the older one (deprecated there)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
    """The flat-tensor reduce_scatter under its torch >= 2.14 name, or the older one."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class Link(Protocol):
    """network=<preset>'s emulated link, as the communication object uses it (trainer/sync/network.py).
    `ranks`: the global ranks of the collective's group (None: every rank), which it is charged by."""

    def seconds(self, kind: str, nbytes: int, calls: int = 1, ranks: tuple[int, ...] | None = None) -> float: ...

    def across_nodes(self, ranks: tuple[int, ...] | None) -> bool | None: ...

    def delayed(
        self, work: dist.Work, kind: str, nbytes: int, recording: bool = False, ranks: tuple[int, ...] | None = None
    ) -> dist.Work: ...

    def delayed_future(
        self, future: Future[Any], kind: str, nbytes: int, calls: int = 1, recording: bool = False
    ) -> Future[Any]: ...

    def describe(self) -> str: ...


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _ranks_of(group: Any) -> tuple[int, ...] | None:
    """The global ranks of a collective's group, which the emulated link charges it by; None: every rank."""
    if group is None or group is dist.GroupMember.WORLD:
        return None
    return tuple(dist.get_process_group_ranks(group))  # torch's own table: a dict lookup


def _first(done: Future[Any]) -> Any:
    """An all_reduce's future holds a list of tensors; a DDP hook hands back the tensor."""
    return done.value()[0]


class Comm:
    """torch.distributed's collectives for one strategy: launched, and reported, named and emulated
    where asked. `bucket` names a collective in a trace: a bucket's index, or a label (`fsdp unit blocks.2`)."""

    def __init__(
        self, link: Link | None = None, observer: Observer | None = None, reduce_dtype: torch.dtype | None = None
    ) -> None:
        self.link = link  # network=<preset>
        self.reduce_dtype = reduce_dtype  # trainer.reduce_dtype; None: each buffer's own
        self._wire_bytes = 0  # the copies in reduce_dtype in flight
        self._holdings: list[Callable[[], dict[str, int]]] = []  # what the strategy declared it holds (holds())
        # A strategy built alone (a test) gets an observer that samples nothing; the builder gives the run's.
        self.observer = observer or Observer(torch.device("cpu"))
        self.recording = False  # the profiler records: each launch is named in its trace
        self._alone: bool | None = None  # a world of one rank (known at the first agreement)
        self.launches: deque[tuple[Any, ...]] | None = None  # (time_ns, kind, numel, bucket, group): the hang report's

    # The collectives a strategy averages and gathers with.

    def all_reduce(self, tensor: torch.Tensor, bucket: int | str | None = None, group: Any = None) -> dist.Work:
        wire = self._wire(tensor)
        work = self._launch("all_reduce", wire, bucket, group, dist.all_reduce, wire, op=dist.ReduceOp.SUM)
        return work if wire is tensor else self._landing(work, tensor, wire)

    def reduce_scatter(
        self,
        shard: torch.Tensor,
        full: torch.Tensor,
        bucket: int | str | None = None,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        group: Any = None,
    ) -> dist.Work:
        """This rank's 1/N of the sum of `full` (a padded buffer) into `shard`."""
        wire = self._wire(full)
        out = shard
        if shard.dtype != wire.dtype:  # e.g. an fp32 gradient shard receiving a 16-bit reduce_scatter
            out = shard.new_empty(shard.shape, dtype=wire.dtype)
            self._wire_bytes += out.numel() * out.element_size()
        work = self._launch("reduce_scatter", wire, bucket, group, reduce_scatter_tensor, out, wire, op=op)
        return work if out is shard and wire is full else self._landing(work, shard, out, wire)

    def all_gather(
        self, full: torch.Tensor, shard: torch.Tensor, bucket: int | str | None = None, group: Any = None
    ) -> dist.Work:
        """Every rank's `shard`, side by side, into every rank's `full`."""
        return self._launch("all_gather", full, bucket, group, all_gather_tensor, full, shard)

    def broadcast(
        self, tensor: torch.Tensor, src: int, bucket: int | str | None = None, group: Any = None
    ) -> dist.Work:
        return self._launch("broadcast", tensor, bucket, group, dist.broadcast, tensor, src=src)

    def _wire(self, tensor: torch.Tensor) -> torch.Tensor:
        """What a reduction sends: `tensor`, or a copy of it in reduce_dtype (counted in held())."""
        if self.reduce_dtype is None or tensor.dtype == self.reduce_dtype or not tensor.is_floating_point():
            return tensor
        self._wire_bytes += tensor.numel() * self.reduce_dtype.itemsize
        return tensor.to(self.reduce_dtype)

    def _landing(self, work: dist.Work, into: torch.Tensor, out: torch.Tensor, *keep: torch.Tensor) -> dist.Work:
        """The Work whose wait() also copies the result `out` into the strategy's `into`."""
        nbytes = sum(t.numel() * t.element_size() for t in {id(t): t for t in (out, *keep) if t is not into}.values())
        return _Landing(work, into, out, keep, lambda: self._landed(nbytes))

    def _landed(self, nbytes: int) -> None:
        self._wire_bytes -= nbytes

    def torch_launches(self) -> None:
        """The strategy declares that torch launches some of its collectives itself, past this object
        (DDP's reducer, from C++): on the sampled step the observer then also watches the process
        group through its own hooks (a cost of µs that every other strategy skips)."""
        self.observer.watch_group = True

    def holds(self, nbytes: Callable[[], dict[str, int]]) -> None:
        """The strategy declares, where it allocates them, tensors the memory probe cannot see: bytes by
        kind beyond the model's parameters and gradients and the optimizer's tensors (`comm_buffers`:
        a bucket being reduced, DDP's reducer buckets, gathered units; `gradients`: full ones outside
        any .grad). `nbytes` is read on the sampled step only."""
        self._holdings.append(nbytes)

    def held(self) -> dict[str, int]:
        """Bytes held now beyond what the probe sees: the reductions' copies in reduce_dtype in flight,
        and what the strategy declared (holds())."""
        held = {"comm_buffers": self._wire_bytes} if self._wire_bytes else {}
        for nbytes in self._holdings:
            for kind, n in nbytes().items():
                held[kind] = held.get(kind, 0) + n
        return held

    # Control collectives: a few bytes that keep the ranks in step, waited for at once (or where needed).

    def agree(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """`tensor` all-reduced with `op` in place (every rank must call it); reported as control traffic."""
        work = self.agree_later(tensor, op)
        if work is not None:
            work.wait()
        return tensor

    def agree_later(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> dist.Work | None:
        """agree(), launched now and waited for by the caller where it needs the value (the row, for
        the sampled step's gradient norm): the step goes on meanwhile. None: nothing to wait for."""
        if self.alone():
            return None
        return self._launch("all_reduce", tensor, "control", None, dist.all_reduce, tensor, op=op, control=True)

    def agree_from(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Every rank takes `src`'s `tensor` (a decision one rank made); reported as control traffic."""
        if not self.alone():
            self._launch("broadcast", tensor, "control", None, dist.broadcast, tensor, src=src, control=True).wait()
        return tensor

    def alone(self) -> bool:
        """A world of one rank: an agreement is the tensor itself, and is not sent (a launch and a
        wait cost ~100 µs on gloo for nothing: on every step where a one-rank run clips a sharded
        strategy's gradient)."""
        if self._alone is None:
            self._alone = dist.get_world_size() == 1
        return self._alone

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Same seed is not enough to trust: every replica starts from rank 0's parameters and buffers."""
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                self.agree_from(tensor, 0)

    # For DDP's communication hooks: futures that torch waits for itself, inside backward.

    def all_reduce_future(self, tensor: torch.Tensor, bucket: int | str | None = None) -> Future[torch.Tensor]:
        """all_reduce(SUM) of `tensor`, as the future of the summed tensor (a DDP hook's result)."""
        wire = self._wire(tensor)
        if self.launches is not None:
            self.launches.append((time.time_ns(), "all_reduce", wire.numel(), bucket, None))
        if not (self.observer.sampling or self.recording or self.link is not None):
            future = dist.all_reduce(wire, async_op=True).get_future().then(_first)
        else:
            future = self.hooked(lambda: self._all_reduce_started(wire, bucket), bucket)
        if wire is tensor:
            return future
        nbytes = wire.numel() * wire.element_size()

        def land(done: Future[Any]) -> torch.Tensor:
            tensor.copy_(done.value())
            self._landed(nbytes)
            return tensor

        return future.then(land)

    def _all_reduce_started(self, tensor: torch.Tensor, bucket: int | str | None) -> tuple[Future[Any], str, int, int]:
        nbytes = _nbytes(tensor)
        with record_function(trace_names.collective("all_reduce", nbytes, bucket)) if self.recording else nullcontext():
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        return work.get_future().then(_first), "all_reduce", nbytes, 1

    def hooked(
        self, start: Callable[[], tuple[Future[Any], str, int, int]], bucket: int | str | None = None
    ) -> Future[Any]:
        """Collectives torch launches itself (one of its DDP hooks): `start()` launches them and says
        what it sent (future, kind, bytes of the buffers sent, calls). Reported and carried by the
        link like ours."""
        observer = self.observer
        if not observer.sampling:
            future, kind, nbytes, calls = start()
            return (
                future if self.link is None else self.link.delayed_future(future, kind, nbytes, calls, self.recording)
            )
        # The launch instant is noted before start(), its size after: the record is filled in once known.
        record = observer.launched("all_reduce", 0, dist.get_world_size())
        CommLaunch.active = True
        try:
            future, kind, nbytes, calls = start()
        finally:
            CommLaunch.active = False
        record.kind, record.nbytes, record.calls = kind, nbytes, calls
        if self.link is not None:
            record.link_s = self.link.seconds(kind, nbytes, calls)
            record.across_nodes = self.link.across_nodes(None)
            future = self.link.delayed_future(future, kind, nbytes, calls, self.recording)
        return observer.watch_future(future, record)

    def _launch(
        self,
        kind: str,
        buffer: torch.Tensor,
        bucket: int | str | None,
        group: Any,
        collective: Any,
        *args: Any,
        control: bool = False,
        **kwargs: Any,
    ) -> dist.Work:
        """Start it: on an unwatched, unnamed, unemulated step, the torch call alone."""
        observer, link = self.observer, self.link
        if self.launches is not None:
            self.launches.append((time.time_ns(), kind, buffer.numel(), "control" if control else bucket, group))
        if not (observer.sampling or self.recording or link is not None):
            return collective(*args, async_op=True, group=group, **kwargs)
        nbytes = _nbytes(buffer)
        ranks = _ranks_of(group)
        record = None
        if observer.sampling:
            link_s = link.seconds(kind, nbytes, 1, ranks) if link is not None else 0.0
            across = link.across_nodes(ranks) if link is not None else None
            record = observer.launched(kind, nbytes, dist.get_world_size(group), control, link_s, 1, across)
        # Named only while the profiler records (the name is a string built per launch).
        label = f"control {kind}" if control else kind
        name = trace_names.collective(label, nbytes, None if control else bucket) if self.recording else ""
        with record_function(name) if self.recording else nullcontext():
            CommLaunch.active = True  # the process group's own hooks leave this one to us
            try:
                work = collective(*args, async_op=True, group=group, **kwargs)
            finally:
                CommLaunch.active = False
            if link is not None:
                work = link.delayed(work, kind, nbytes, self.recording, ranks)  # recording: its completion marked
        return work if record is None else observer.watch(work, record)


class _Landing(dist.Work):
    """A reduction sent in reduce_dtype: waiting for it also puts its result into the strategy's buffer."""

    def __init__(
        self,
        work: dist.Work,
        into: torch.Tensor,
        out: torch.Tensor,
        keep: tuple[torch.Tensor, ...],
        landed: Callable[[], None],
    ) -> None:
        super().__init__()
        self._work, self._into, self._out, self._keep, self._landed = work, into, out, keep, landed
        self._done = False

    def wait(self, timeout: Any = None) -> bool:
        self._work.wait()
        if not self._done:
            self._done = True
            self._into.copy_(self._out)
            self._out, self._keep = self._into, ()  # the copies go
            self._landed()
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def get_future(self) -> Future[Any]:
        return self._work.get_future()
