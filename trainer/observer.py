"""The lab's one instrument: it watches the sampled step, and only that step.

The loop reports the step's phase marks to it, the communication object every collective it
launches (trainer/sync/comm.py), and a probe says what memory each kind holds; from those it builds
the row's time/*, comm/* and memory/* keys by trainer/measures.py's definitions, the same for every
strategy. Strategies never count, time or track peaks: they do their algorithm and state its facts.

Which step: 1 in `every` (trainer.sample_every_n_steps), the one before each row by default, so
that what a strategy leaves in flight past its step (zero's gathers, waited for in the next
forward) is back by the row; and the run's last two steps, so that its last row has one too. An
unsampled step costs a flag test per report: no clock read, no CUDA event, no host synchronisation.
On a GPU the marks are CUDA events, read at the row after the synchronisation the row makes anyway
(trainer/clock.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.futures import Future

from trainer import arrivals, measures
from trainer.clock import Clock, Mark
from trainer.sample_budget import SampleBudget


class Probe(Protocol):
    """Bytes held now, per kind of memory (trainer/measures.py's MemoryProbe)."""

    def begin(self) -> None: ...

    def __call__(self) -> dict[str, int]: ...

    def parameter_storages(self) -> set[int]: ...


@dataclass
class _Record:
    """One collective of the sampled step: the marks of its life."""

    kind: str
    nbytes: int
    ranks: int
    control: bool
    link_s: float
    calls: int
    launched: Mark
    hooked: bool = False  # torch waits for it itself (a DDP hook's future, DDP's own all-reduce)
    blocking: bool = False  # launched by torch as a blocking call: waited for from its launch
    completed: Mark | None = None  # where the backend (or the emulated link) completed it
    wait_began: Mark | None = None
    waited: Mark | None = None  # when the training thread's wait returned
    noted: Future[Any] | None = None  # done once the completion above is noted
    across_nodes: bool | None = None  # its group spans emulated nodes (None: the link has none)

    @property
    def back(self) -> bool:
        # A control collective may be waited for after the row took the step (the sampled step's
        # norm agreement, waited for by the row): its completion is enough, nothing of it is timed.
        return self.waited is not None or ((self.hooked or self.control) and self.completed is not None)


@dataclass
class _Sample:
    step: int
    marks: list[tuple[str, Mark]] = field(default_factory=list)
    records: list[_Record] = field(default_factory=list)
    peaks: dict[str, int] = field(default_factory=dict)
    at_sync: dict[str, int] = field(default_factory=dict)  # memory when the sync phase ended
    at_end: dict[str, int] = field(default_factory=dict)  # memory when the step ended
    allocator_peak: int | None = None  # CUDA: the allocator's peak over the step
    ended: bool = False

    @property
    def closed(self) -> bool:
        return self.ended and all(r.back for r in self.records)


# The process group's own record of a collective (torch >= 2.14's pre- and post-hooks) -> our kind.
_KINDS = {
    "ALLREDUCE": "all_reduce",
    "BROADCAST": "broadcast",
    "ALLGATHER": "all_gather",
    "REDUCE_SCATTER": "reduce_scatter",
}
# Marks after which memory is probed (and at each collective's launch and wait). Not the forward's
# end: the activations' peak is counted by the saved-tensor hooks whenever the next probe runs, the
# parameters and optimizer state do not change in a forward, and a unit gathered for it is seen at
# its gather's launch (each probe costs µs on a sub-millisecond step).
_PROBED = ("backward", "sync", "optimizer")
_HOOK_ID = 0xDD1AB  # our hooks' id on the default group: registering again replaces the last observer's


class CommLaunch:
    """Process-wide: a communication object is launching a collective, which it reports itself (the
    default group's hooks leave it alone)."""

    active = False


class Observer:
    """Samples 1 step in `every`; the loop and the communication object report to it.

    Collectives torch launches from C++ without a Python hook of ours (DDP's reducer) reach it
    through the default process group's own pre- and post-collective hooks, registered for the
    sampled step only, and only for a strategy that has such (`Comm.torch_launches`; on a torch
    without the hooks, such collectives are not seen and their keys are left out, docs/metrics.md);
    those the communication object launches it reports itself.
    """

    def __init__(
        self, device: torch.device, every: int = 0, emulated: bool = False, budget: SampleBudget | None = None
    ) -> None:
        self.clock, self.device = Clock(device), device
        self.every = every
        # How often a candidate step (1 in `every`) is sampled: within a share of the run's time
        # (trainer/sample_budget.py); without one, every candidate.
        self.budget = budget if budget is not None else SampleBudget()
        self._last_sampled: int | None = None
        self._host_started = 0.0
        self._host_times: list[float] = []  # the sampled steps' host time since the last row (the budget's)
        self.emulated = emulated  # network=<preset>: rows carry the link's ideal
        self.last_step: int | None = None  # the run's last step (the loop sets it): its last two are sampled
        self.probe: Probe | None = None  # set by the loop once the model and optimizer exist
        # The default group's hooks, for collectives torch launches past the communication object
        # (DDP's reducer): registered on the sampled step where the strategy says it has such
        # (Comm.torch_launches; each registration and removal costs µs).
        self.watch_group = False
        self.sampling = False  # the current step is watched
        self.late: dict[str, float] = {}  # who arrived last at an earlier sampled step, for the next row (arrivals.py)
        self.profiled = 0  # steps a profiler recorded since the last row (trainer/loop/profiling.py counts them)
        self._sample: _Sample | None = None
        self._samples: list[_Sample] = []  # ended, possibly with collectives still in flight
        self._group: Any = None  # the default group while its hooks are ours
        self._world: tuple[Any, int] | None = None  # the default group (None: no hooks) and its size, once known
        self._group_size = 1
        self._launching: dict[int, _Record] = {}  # op id -> its record, between the group's two hooks
        self._launching_in_torch = False
        self.saved = measures.SavedForBackward()  # what the sampled step's forwards save for backward

    def describe(self) -> str:
        """How the lab watches, for the sync line."""
        return f"1 step in {self.every} (the step before each row)" if self.every else "none"

    # The loop's reports.

    def begin_step(self, step: int) -> None:
        """Optimizer step `step` (1-based) starts."""
        last = self.last_step
        final = last is not None and step + 1 >= last  # the run's last two: its last row has a sample
        candidate = (step + 1) % self.every == 0 if self.every > 0 else False
        self.sampling = self.every > 0 and (final or (candidate and self.budget.may_sample(step, self._last_sampled)))
        if self.sampling:
            self._last_sampled = step
            self._host_started = time.perf_counter()  # what the sampled step costs the host: the budget's
            self._sample = _Sample(step)
            self._sample.marks.append(("start", self.clock.now()))
            if self.probe is not None:
                self.probe.begin()
                self.saved.excluded = self.probe.parameter_storages()
            self.saved.peak = 0
            if self.device.type == "cuda":
                measures.reset_cuda_peak(self.device)  # host-side allocator statistics: no sync
            if self.watch_group:
                self._hook_group()

    def mark(self, phase: str) -> None:
        """The phase `phase` of the step just ended."""
        if self.sampling:
            assert self._sample is not None
            self._sample.marks.append((phase, self.clock.now()))
            if phase in _PROBED:  # the phases where parameters, gradients or optimizer state change
                held = self._probe()
                if phase == "sync":
                    self._sample.at_sync = held
                self._sample.at_end = held  # the last mark's: the step's end

    def end_step(self) -> None:
        if not self.sampling:
            return
        assert self._sample is not None
        self._unhook_group()
        if self.device.type == "cuda":
            self._sample.allocator_peak = torch.cuda.max_memory_allocated(self.device)
        self._sample.ended = True
        self._samples.append(self._sample)
        self._sample, self.sampling = None, False
        self._host_times.append(time.perf_counter() - self._host_started)

    def take_host_times(self) -> list[float]:
        """The host time of each step sampled since the last call (a row's window)."""
        taken, self._host_times = self._host_times, []
        return taken

    def _probe(self) -> dict[str, int]:
        if self.probe is None or self._sample is None:
            return {}
        held = self.probe()
        if self.saved.peak:  # the forwards so far: their saved tensors (held until their backward)
            held["activations"] = self.saved.peak
        peaks = self._sample.peaks
        for kind, nbytes in held.items():
            if nbytes > peaks.get(kind, -1):
                peaks[kind] = nbytes
        return held

    # The communication object's reports (only while sampling).

    def launched(
        self,
        kind: str,
        nbytes: int,
        ranks: int,
        control: bool = False,
        link_s: float = 0.0,
        calls: int = 1,
        across_nodes: bool | None = None,
    ) -> _Record:
        """A collective (or `calls` of one kind sharing one future) is about to be launched on the sampled step."""
        assert self._sample is not None
        record = _Record(kind, nbytes, ranks, control, link_s, calls, self.clock.now(), across_nodes=across_nodes)
        self._sample.records.append(record)
        if not self._launching_in_torch:
            self._probe()
        return record

    def watch(self, work: dist.Work, record: _Record) -> dist.Work:
        """The Work to hand the strategy: waiting for it notes when the wait began and ended."""
        return _Watched(work, record, self)

    def watch_future(self, future: Future[Any], record: _Record) -> Future[Any]:
        """A future torch waits for itself (a DDP hook's): its completion noted where the backend completes it."""
        record.hooked = True
        return future.then(partial(self._completed, record))

    def _completed(self, record: _Record, done: Future[Any]) -> Any:
        record.completed = self.clock.now()
        return done.value()

    def _noted(self, record: _Record, done: Future[Any]) -> None:
        """_completed() for a future nobody reads: the record keeps it until the row, and a value would
        keep the collective's buffers alive that long (a released bucket, a unit's flat gathers)."""
        record.completed = self.clock.now()

    # The default group's own hooks: torch's collectives from C++ (DDP's reducer), on the sampled step.

    def _hook_group(self) -> None:
        if self._world is None:  # looked up once: the default group is the run's (each lookup costs µs)
            group = dist.group.WORLD if dist.is_initialized() else None
            hooks = group is not None and hasattr(group, "register_pre_hook")
            self._world = (group, dist.get_world_size(group)) if hooks else (None, 1)
        group, size = self._world
        if group is None:
            return
        group.register_pre_hook(_HOOK_ID, self._group_pre)
        group.register_post_hook(_HOOK_ID, self._group_post)
        self._group, self._group_size = group, size

    def _unhook_group(self) -> None:
        if self._group is not None:
            self._group.unregister_pre_hook(_HOOK_ID)
            self._group.unregister_post_hook(_HOOK_ID)
            self._group, self._launching = None, {}

    def _group_pre(self, args: Any) -> None:
        """Called inside the collective's launch, on the launching thread."""
        kind = _KINDS.get(args.name.name)
        if CommLaunch.active or self._sample is None or kind is None:
            return  # the communication object reports its own; barriers and the like are not traffic
        tensors = args.output_tensors if kind == "all_gather" else args.input_tensors
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        control = not all(t.is_floating_point() for t in tensors)  # DDP's bitmap of the parameters used
        # Inside torch's C++ caller (DDP's reducer holds its lock): no probe, which could call back into it.
        self._launching_in_torch = True
        try:
            record = self.launched(kind, nbytes, self._group_size, control)
        finally:
            self._launching_in_torch = False
        record.hooked, record.blocking = True, not args.async_op
        self._launching[args.op_id] = record

    def _group_post(self, args: Any) -> None:
        record = self._launching.pop(args.op_id, None)
        if record is None:
            return
        try:
            record.noted = args.work.get_future().then(partial(self._noted, record))
        except RuntimeError:  # a backend's Work without a future (gloo's reduce_scatter): done once it returns
            record.completed, record.blocking = self.clock.now(), True

    # The row.

    def _newest_closed(self) -> _Sample | None:
        """The newest sampled step whose collectives are all back (None if none)."""
        for sample in self._samples:  # torch waited for these inside the step: only our note may lag
            for record in sample.records:
                if sample.ended and not record.back and record.noted is not None and (record.hooked or record.control):
                    record.noted.wait()
        closed = [s for s in self._samples if s.closed]
        return closed[-1] if closed else None

    def arrivals(self) -> list[int]:
        """This rank's times inside the collectives of the sample take() returns next, for the row's
        collective (trainer/arrivals.py): the same width on every rank, sampled step or not."""
        newest = self._newest_closed()
        if newest is None:
            return arrivals.mine(None, [])
        return arrivals.mine(newest.step, self._collectives(newest, partial(self.clock.seconds, newest.marks[0][1])))

    def take(self) -> dict[str, float]:
        """The newest sampled step whose collectives are all back, as row keys ({} if none), and who
        arrived last at an earlier one (`late`, once); older closed samples are dropped, open ones
        kept for the next row."""
        late, self.late = self.late, {}
        newest = self._newest_closed()
        if newest is None:
            return late
        self._samples = [s for s in self._samples if not s.closed and s.step > newest.step]
        origin = newest.marks[0][1]
        at = partial(self.clock.seconds, origin)
        row = late | measures.phase_row(
            [(phase, at(mark) if i else 0.0) for i, (phase, mark) in enumerate(newest.marks)]
        )
        row |= measures.comm_row(self._collectives(newest, at), self.emulated)
        # Held: parameters and optimizer state as the step leaves them, gradients and communication
        # buffers as the sync phase does, activations as the forwards left them (their peak).
        held: dict[str, int] = {k: newest.at_end[k] for k in ("parameters", "optimizer_state") if k in newest.at_end}
        held |= {k: newest.at_sync[k] for k in ("gradients", "comm_buffers") if k in newest.at_sync}
        held |= {"activations": newest.peaks["activations"]} if "activations" in newest.peaks else {}
        row |= measures.memory_row(held, newest.peaks, newest.allocator_peak)
        row["observer/sampled_step"] = newest.step
        return row

    @staticmethod
    def _collectives(sample: _Sample, at: Callable[[Mark], float]) -> list[measures.Collective]:
        """The raw records as measures.Collective: instants in seconds from the step's start."""
        hooks_done = max((at(r.launched) for r in sample.records if r.hooked and not r.blocking), default=0.0)
        out = []
        for r in sample.records:
            launched = at(r.launched)
            if r.hooked:  # torch waited for it: from its launch if it blocked, else from the end of
                assert r.completed is not None  # backward's computation (its last bucket's launch)
                needed, completed = (launched if r.blocking else hooks_done), at(r.completed)
            elif r.waited is None:  # a control collective not waited for yet (`back`): never exposed
                assert r.control and r.completed is not None
                needed = completed = at(r.completed)
            else:
                assert r.wait_began is not None
                needed, waited = at(r.wait_began), at(r.waited)
                # The backend's completion; gloo's reduce_scatter has no future, its wait's end bounds it.
                completed = min(at(r.completed), waited) if r.completed is not None else waited
            c = measures.Collective(
                r.kind,
                r.nbytes,
                r.ranks,
                r.control,
                launched,
                completed,
                needed,
                r.link_s,
                r.calls,
                across_nodes=r.across_nodes,
            )
            out.append(c)
        return out


class _Watched(dist.Work):
    """A collective of the sampled step in flight: completion and the training thread's wait noted."""

    def __init__(self, work: dist.Work, record: _Record, observer: Observer) -> None:
        super().__init__()
        self._work, self._record, self._observer = work, record, observer
        with suppress(RuntimeError):  # gloo's reduce_scatter has no future: the wait's end bounds it
            record.noted = work.get_future().then(self._completed)

    def _completed(self, done: Future[Any]) -> None:
        # No value: the record keeps this future until the row, which must not keep the buffers alive.
        self._record.completed = self._observer.clock.now()

    def wait(self, timeout: Any = None) -> bool:
        clock = self._observer.clock
        self._record.wait_began = clock.now()
        self._work.wait()  # on CUDA: the current stream now waits for the collective's
        self._record.waited = clock.now()
        self._observer._probe()  # what it held while waiting (zero stage 3: a bucket, the next unit's gradients)
        return True

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())

    def get_future(self) -> Future[Any]:
        return self._work.get_future()
