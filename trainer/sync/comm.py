"""The communication object: every collective a strategy makes goes through its `self.comm`.

A strategy's file says what is sent and when; this module keeps the books, so that nothing of
them sits between the algorithm's lines:
- counting: each collective's kind and bytes (`CommCounters`), gradient traffic apart from the
  control collectives (the agreements of a few bytes that keep the ranks in step);
- naming: while the profiler records (`recording`), each launch runs inside a range such as
  `bucket 3 all_reduce 4.0 MiB`, which the timeline pairs with the backend's execution;
- timing: on a step the loop times (`timing`), each collective is stamped when it is launched,
  when it completes and when the training thread waits for it (trainer/clock.py's marks); at a
  logged row those stamps become its communication time, the part the step waited for, and the part
  an emulated link alone would have made it wait;
- the emulated link (network=<preset>, trainer/sync/network.py): each collective is handed on no
  earlier than the link would have finished it.

Collectives are launched asynchronously (SUM for reductions) and return a Work to wait for.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext, suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.futures import Future
from torch.profiler import record_function

from trainer import comm_math, trace_names
from trainer.clock import Clock, Mark


def all_gather_tensor(*args: Any, **kwargs: Any) -> Any:
    """The flat-tensor all_gather under its torch >= 2.14 name, or the older one (deprecated there)."""
    return (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(*args, **kwargs)


def reduce_scatter_tensor(*args: Any, **kwargs: Any) -> Any:
    """The flat-tensor reduce_scatter under its torch >= 2.14 name, or the older one."""
    return (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(*args, **kwargs)


class Link(Protocol):
    """network=<preset>'s emulated link, as the communication object uses it (trainer/sync/network.py)."""

    def seconds(self, kind: str, nbytes: int, calls: int = 1) -> float: ...

    def delayed(self, work: dist.Work, kind: str, nbytes: int, recording: bool = False) -> dist.Work: ...

    def delayed_future(
        self, future: Future[Any], kind: str, nbytes: int, calls: int = 1, recording: bool = False
    ) -> Future[Any]: ...

    def describe(self) -> str: ...


@dataclass
class CommCounters:
    """Cumulative since the last pop: bytes synced, calls, and (when timed) wall time.

    `bytes` is all_reduce-equivalent gradient bytes (a reduce_scatter and its all_gather of a
    gradient count it once). The times cover `timed_steps` steps.
    """

    bytes: int = 0
    collectives: int = 0
    seconds: float = 0.0  # wall time with at least one collective in flight
    exposed_seconds: float = 0.0  # the part of it the training thread waited for
    timed_steps: int = 0  # how many steps the times were measured over (0: untimed)
    # On an emulated link (`emulated`): what the step would have waited for if the link alone were slow
    # (each collective on it from its launch, one at a time, for its link time; nothing else costing time).
    link_exposed_seconds: float = 0.0
    emulated: bool = False
    # Per kind of collective ("all_reduce", "reduce_scatter", ...): [bytes of the buffer, calls].
    kinds: dict[str, list[int]] = field(default_factory=dict)
    # Control collectives (unused-parameter flags, the non-finite check, the cap tuner's vote): [bytes, calls].
    control: list[int] = field(default_factory=lambda: [0, 0])

    def add(self, kind: str, nbytes: int) -> None:
        """One collective of `kind` on a buffer of `nbytes` (nccl-tests' size: the whole buffer)."""
        self.add_many(kind, nbytes, 1)

    def pop(self) -> CommCounters:
        """The counts so far, as a new object; these start again from zero."""
        popped = CommCounters(**vars(self))
        self.__init__()  # type: ignore[misc]
        return popped

    def add_many(self, kind: str, nbytes: int, calls: int) -> None:
        """`calls` collectives of `kind` moving `nbytes` between them."""
        counts = self.kinds.setdefault(kind, [0, 0])
        counts[0] += nbytes
        counts[1] += calls
        self.collectives += calls


@dataclass
class Stamp:
    """One collective of a timed step: the marks of its life."""

    step: int
    launched: Mark
    link_s: float = 0.0  # its time on the emulated link (0: none)
    hooked: bool = False  # handed to torch as a future (a DDP hook): torch waits for it, inside backward
    completed: Mark | None = None  # where the backend (or the link) completed it
    wait_began: Mark | None = None
    waited: Mark | None = None  # when the training thread's wait returned


class Stamped(dist.Work):
    """A collective of a timed step in flight: waiting for it notes when the wait began and ended."""

    def __init__(self, work: dist.Work, stamp: Stamp, clock: Clock) -> None:
        super().__init__()
        self._work, self._stamp, self._clock = work, stamp, clock
        # Completion noted where the backend completes it (gloo's thread, the NCCL stream); gloo's
        # reduce_scatter has no future: the wait's end bounds it.
        with suppress(RuntimeError):
            work.get_future().then(self._completed)

    def _completed(self, done: Future[Any]) -> Any:
        self._stamp.completed = self._clock.now_anywhere()
        return done.value()

    def wait(self, timeout: Any = None) -> bool:
        self._stamp.wait_began = self._clock.now_anywhere()
        self._work.wait()  # on CUDA: the current stream now waits for the collective's
        self._stamp.waited = self._clock.now_anywhere()
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def get_future(self) -> Future[Any]:
        return self._work.get_future()


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class Comm:
    """torch.distributed's collectives for one strategy: launched, counted, named, stamped, emulated.

    `grad_bytes`: the gradient bytes a reduction averages, for comm/bytes_per_step (default: the
    whole tensor); a gather or broadcast of parameters adds none. `bucket` names the collective: a
    bucket's index, or a label (`fsdp unit blocks.2`).
    """

    def __init__(self, link: Link | None = None, device: torch.device | None = None, every: int = 0) -> None:
        self.counts = CommCounters()
        self.link = link  # network=<preset>
        self.clock = Clock(device or torch.device("cpu"))
        self.every = every  # trainer.time_comm_every_n_steps: 1 step in n is timed (0: none)
        self.timing = False  # this step's collectives are stamped
        self.recording = False  # the profiler records: each launch is named in its trace
        self.step = 0  # the step being run, for the stamps
        self._stamps: list[Stamp] = []

    @contextmanager
    def uncounted(self) -> Iterator[None]:
        """Outside the training steps (evaluation's forwards, which FSDP gathers for): nothing counted
        or stamped, so that the rows' comm/* stay per training step."""
        counts, timing = self.counts, self.timing
        self.counts, self.timing = CommCounters(), False
        try:
            yield
        finally:
            self.counts, self.timing = counts, timing

    def begin_step(self, step: int) -> None:
        """The loop starts optimizer step `step` (1-based). The step before each n-th is timed, so
        that what a strategy leaves in flight past its step (zero's gathers, waited for in the next
        forward) is back by the n-th step's row."""
        self.step = step
        self.timing = self.every > 0 and (step + 1) % self.every == 0

    # The collectives a strategy averages and gathers with.

    def all_reduce(
        self, tensor: torch.Tensor, bucket: int | str | None = None, grad_bytes: int | None = None
    ) -> dist.Work:
        nbytes = self._count("all_reduce", tensor, grad_bytes)
        return self._launch("all_reduce", nbytes, bucket, dist.all_reduce, tensor, op=dist.ReduceOp.SUM)

    def reduce_scatter(
        self,
        shard: torch.Tensor,
        full: torch.Tensor,
        bucket: int | str | None = None,
        grad_bytes: int | None = None,
        op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM,
        group: dist.ProcessGroup | None = None,
    ) -> dist.Work:
        """This rank's 1/N of the sum of `full` (a padded buffer) into `shard`."""
        nbytes = self._count("reduce_scatter", full, grad_bytes)
        return self._launch("reduce_scatter", nbytes, bucket, reduce_scatter_tensor, shard, full, op=op, group=group)

    def all_gather(
        self,
        full: torch.Tensor,
        shard: torch.Tensor,
        bucket: int | str | None = None,
        grad_bytes: int = 0,
        group: dist.ProcessGroup | None = None,
    ) -> dist.Work:
        """Every rank's `shard`, side by side, into every rank's `full` (parameters: no gradient bytes)."""
        nbytes = self._count("all_gather", full, grad_bytes)
        return self._launch("all_gather", nbytes, bucket, all_gather_tensor, full, shard, group=group)

    def broadcast(self, tensor: torch.Tensor, src: int, bucket: int | str | None = None) -> dist.Work:
        nbytes = self._count("broadcast", tensor, 0)
        return self._launch("broadcast", nbytes, bucket, dist.broadcast, tensor, src=src)

    # Control collectives: a few bytes that keep the ranks in step, waited for at once.

    def agree(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
        """`tensor` all-reduced with `op` in place (every rank must call it); counted as control traffic."""
        nbytes = self._control(tensor)
        self._launch("control all_reduce", nbytes, None, dist.all_reduce, tensor, op=op, kind="all_reduce").wait()
        return tensor

    def agree_from(self, tensor: torch.Tensor, src: int) -> torch.Tensor:
        """Every rank takes `src`'s `tensor` (a decision one rank made); counted as control traffic."""
        nbytes = self._control(tensor)
        self._launch("control broadcast", nbytes, None, dist.broadcast, tensor, src=src, kind="broadcast").wait()
        return tensor

    def broadcast_parameters(self, model: nn.Module) -> None:
        """Same seed is not enough to trust: every replica starts from rank 0's parameters and buffers."""
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                self.agree_from(tensor, 0)

    # For DDP's communication hooks: futures that torch waits for itself, inside backward.

    def all_reduce_future(self, tensor: torch.Tensor, bucket: int | str | None = None) -> Future[torch.Tensor]:
        """all_reduce(SUM) of `tensor`, as the future of the summed tensor (a DDP hook's result)."""
        return self.hooked(lambda: self._all_reduce_started(tensor, bucket), bucket)

    def _all_reduce_started(self, tensor: torch.Tensor, bucket: int | str | None) -> tuple[Future[Any], str, int, int]:
        nbytes = _nbytes(tensor)
        with record_function(trace_names.collective("all_reduce", nbytes, bucket)) if self.recording else nullcontext():
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, async_op=True)
        return work.get_future().then(lambda done: done.value()[0]), "all_reduce", nbytes, 1

    def hooked(
        self, start: Callable[[], tuple[Future[Any], str, int, int]], bucket: int | str | None = None
    ) -> Future[Any]:
        """Collectives torch launches itself (one of its DDP hooks): `start()` launches them and says
        what it sent (future, kind, bytes, calls: the bytes are gradient traffic, as sent, compressed
        or not). Counted, stamped, and carried by the link like ours."""
        launched = self.clock.now_anywhere() if self.timing else None
        future, kind, nbytes, calls = start()
        self.counts.bytes += nbytes
        self.counts.add_many(kind, nbytes, calls)
        if self.link is not None:
            future = self.link.delayed_future(future, kind, nbytes, calls, self.recording)
        if launched is None:
            return future
        link_s = self.link.seconds(kind, nbytes, calls) if self.link is not None else 0.0
        stamp = Stamp(self.step, launched, link_s, hooked=True)
        self._stamps.append(stamp)
        return future.then(partial(self._hook_completed, stamp))

    def _hook_completed(self, stamp: Stamp, done: Future[Any]) -> Any:
        stamp.completed = self.clock.now_anywhere()
        return done.value()

    # The books.

    def _count(self, kind: str, tensor: torch.Tensor, grad_bytes: int | None) -> int:
        nbytes = _nbytes(tensor)
        self.counts.bytes += nbytes if grad_bytes is None else grad_bytes
        self.counts.add(kind, nbytes)
        return nbytes

    def _control(self, tensor: torch.Tensor) -> int:
        nbytes = _nbytes(tensor)
        self.counts.control[0] += nbytes
        self.counts.control[1] += 1
        return nbytes

    def _launch(
        self,
        label: str,
        nbytes: int,
        bucket: int | str | None,
        collective: Any,
        *args: Any,
        kind: str = "",
        **kwargs: Any,
    ) -> dist.Work:
        """Start it; count nothing (the caller did). A control collective (`kind` given) is not
        stamped: the rows' communication time is the traffic the bytes count."""
        timed = self.timing and not kind
        kind = kind or label
        launched = self.clock.now_anywhere() if timed else None
        with record_function(trace_names.collective(label, nbytes, bucket)) if self.recording else nullcontext():
            work = collective(*args, async_op=True, **kwargs)
            if self.link is not None:
                work = self.link.delayed(work, kind, nbytes, self.recording)  # recording: its completion marked
        if launched is None:
            return work
        link_s = self.link.seconds(kind, nbytes) if self.link is not None else 0.0
        stamp = Stamp(self.step, launched, link_s)
        self._stamps.append(stamp)
        return Stamped(work, stamp, self.clock)

    def pop(self) -> CommCounters:
        """What was sent since the last call, and the times of the timed steps whose collectives are
        all back; the counters start again from zero (a stamp still in flight waits for the next call)."""
        counts = self.counts.pop()
        counts.emulated = self.link is not None
        done = [s for s in self._stamps if s.waited is not None or (s.hooked and s.completed is not None)]
        open_steps = {s.step for s in self._stamps if s not in done}
        closed = [s for s in done if s.step not in open_steps]
        self._stamps = [s for s in self._stamps if s.step in open_steps]
        for step in sorted({s.step for s in closed}):
            busy, exposed, link_exposed = self._times([s for s in closed if s.step == step])
            counts.seconds += busy
            counts.exposed_seconds += exposed
            counts.link_exposed_seconds += link_exposed
            counts.timed_steps += 1
        return counts

    def _times(self, stamps: list[Stamp]) -> tuple[float, float, float]:
        """One step's (communication, waited for, a FIFO link's own exposure) in seconds."""
        origin = stamps[0].launched
        at = lambda mark: self.clock.seconds(origin, mark)  # noqa: E731
        spans, blocked, link = [], [], []
        # Futures torch waits for inside backward (DDP's hooks): its computation ended when the last left.
        hooks_done = max((at(s.launched) for s in stamps if s.hooked), default=0.0)
        for s in stamps:
            launched = at(s.launched)
            if s.hooked:  # waited for from the end of backward's computation until it came back
                began = hooks_done
                ended = max(at(s.completed), began)
                waited = ended
            else:  # waited for from the training thread's wait() until the collective was back
                began = at(s.wait_began)
                ended = at(s.completed) if s.completed is not None else at(s.waited)
                waited = max(began, min(at(s.waited), ended))  # never past the span: exposed <= busy
            spans.append((launched, max(ended, launched)))
            blocked.append((began, waited))
            link.append((launched, s.link_s, began))
        return comm_math.busy_time(spans), comm_math.busy_time(blocked), comm_math.fifo_exposed(link)

    def describe(self) -> str:
        """How communication is timed, for the sync line."""
        return f"per collective, 1 step in {self.every}" if self.every else "none"
