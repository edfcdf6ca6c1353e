"""Timing the bucket collectives of `bucketed` and `zero`, one step in `time_every_n_steps`: when
each one left and when its result arrived, against the end of backward. Composed in by their
config (`sync.bucket_timer`, a partial of BucketTimer); the launcher knows only the `Untimed`
interface it implements.

Marks are host clocks on CPU (gloo completes a collective's future when the data is there) or CUDA
events on GPU, turned into seconds only when a logged row reads them. A collective after the sync
phase (zero's gathers) is exposed from the moment it is waited for: what ran before that hid it.

On CUDA a wait must also order the streams: the division by the world size (and the optimizer)
runs on the current stream, which must wait for the collective's. A NCCL Work's wait() does that;
a future chained with then() does it only for the CUDA tensors its value holds, so the callback
passes the collective's value on, and the wait also waits on the Work itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from trainer.sync.bucket_launch import Start, Untimed
from trainer.sync.collectives import CommCounters, Waitable, busy_time

Spans = list[tuple[Any, Any]]  # (launch, arrival) per collective
Waited = list[tuple[Any, Any, Any]]  # (launch, arrival, when the wait began)


class Stopwatch:
    """Marks on host clocks (CPU) or CUDA events (GPU), turned into seconds only when read."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def now(self) -> Any:
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, origin: Any, mark: Any) -> float:
        if not self.cuda:
            return float(mark - origin)
        mark.synchronize()
        return float(origin.elapsed_time(mark)) / 1000.0


def timed(work: dist.Work, started: Any, stopwatch: Stopwatch, spans: Spans) -> Waitable:
    """The collective, noting when its result arrived in `spans`: from its future where the backend
    has one (gloo's all_reduce, NCCL), else when the wait returns (an upper bound)."""

    def note() -> None:
        spans.append((started, stopwatch.now()))  # on the communication thread (gloo) or its stream (CUDA)

    def arrived(done: torch.futures.Future[Any]) -> Any:
        note()
        return done.value()  # the collective's tensors: what a CUDA future records its events for

    try:
        return _WaitBoth(work, work.get_future().then(arrived))
    except RuntimeError:  # e.g. gloo's reduce_scatter: "Work::getFuture not implemented"
        return _WaitThenNote(work, note)


class _WaitBoth:
    """A timed collective: its chained future (the arrival noted; wait() returns the reduced tensors)
    and the work itself, also waited on, so the current CUDA stream waits for the collective's."""

    def __init__(self, work: dist.Work, future: torch.futures.Future[Any]) -> None:
        self._work, self._future = work, future

    def wait(self) -> Any:
        value = self._future.wait()
        self._work.wait()
        return value


class _WaitThenNote:
    """A collective without a future: its arrival is noted when the wait returns."""

    def __init__(self, work: dist.Work, note: Callable[[], None]) -> None:
        self._work, self._note = work, note

    def wait(self) -> bool:
        self._work.wait()
        self._note()
        return True


class BucketTimer(Untimed):
    """This step's marks, if it is a timed one; the timed steps since the last row, for the row.

    `ends_at_next_forward`: the step ends when its last collectives are waited for, just before the next
    forward (zero's gathers), so the step read by the row after the next step is timed: the one
    before a logged one (rows log every n steps too).
    """

    def __init__(self, device: torch.device, time_every_n_steps: int, ends_at_next_forward: bool = False) -> None:
        self.stopwatch = Stopwatch(device)
        self.every = time_every_n_steps
        self._lag = 1 if ends_at_next_forward else 0
        self.step = 0
        self.timing = self._timed_step(0)  # this step's collectives are timed
        self._marks: list[Any] = []  # launch mark per started bucket
        self._spans: Spans = []  # (start, end) per collective, up to backward's end
        self._after: Waited = []  # collectives after the sync phase: exposed once waited for
        self._backward_end: Any = None
        # Since the last row, per timed step: (origin, backward's end, spans, spans after).
        self._timed: list[tuple[Any, Any, Spans, Waited]] = []

    def launched(self, start: Start, bucket: int) -> Waitable:
        """Start a bucket's collective; on a timed step, noting its launch and its arrival."""
        if not self.timing:
            return start(bucket)
        self._marks.append(self.stopwatch.now())
        return timed(start(bucket), self._marks[-1], self.stopwatch, self._spans)

    def backward_ended(self) -> None:
        self._backward_end = self.stopwatch.now() if self.timing else None

    def now(self) -> Any:
        """A mark for a collective timed by hand (timed steps only; None otherwise)."""
        return self.stopwatch.now() if self.timing else None

    def note(self, started: Any) -> None:
        """A collective timed by hand ended now (bucketed's rs_ag all_gathers)."""
        if self.timing:
            self._spans.append((started, self.stopwatch.now()))

    def note_after(self, started: Any, waited_from: Any) -> None:
        """A collective after the sync phase ended now; its wait began at `waited_from` (zero's gathers)."""
        if self.timing:
            self._after.append((started, self.stopwatch.now(), waited_from))

    def end_step(self) -> None:
        """The step's collectives are all done: keep a timed step's marks for the next row."""
        if self.timing and self._marks:
            self._timed.append((self._marks[0], self._backward_end, self._spans, self._after))
        self._marks, self._spans, self._after = [], [], []
        self.step += 1
        self.timing = self._timed_step(self.step)

    def _timed_step(self, step: int) -> bool:
        """Whether the step with this 0-based number is timed."""
        return (step + 1 + self._lag) % self.every == 0

    def add_to(self, counts: CommCounters) -> None:
        """Add the timed steps since the last row: busy time, and the part not hidden under backward."""
        for origin, backward_end, spans, after in self._timed:
            seconds = partial(self.stopwatch.seconds, origin)
            intervals = [(seconds(a), seconds(b)) for a, b in spans]
            later = [(seconds(a), seconds(b), seconds(w)) for a, b, w in after]
            end_of_backward = seconds(backward_end)
            counts.seconds += busy_time(intervals + [(a, b) for a, b, _ in later])
            counts.exposed_seconds += max(0.0, max(end for _, end in intervals) - end_of_backward)
            # From the wait on, nothing hides it: what ran between the launch and the wait did.
            counts.exposed_seconds += busy_time([(max(a, w), b) for a, b, w in later if b > w])
            counts.timed_steps += 1
        self._timed = []
