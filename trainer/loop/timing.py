"""Splits every step's time into phases without adding a single synchronisation.

On CPU every op has finished when Python moves on, so a monotonic clock is exact. On CUDA kernels
run asynchronously: we record CUDA events at phase boundaries on every step and read them back
only at a logged step, after the one host sync that step makes anyway (reading the loss).

The events are created once and reused from one logged row to the next, and recorded on a stream
fetched once: creating an event or asking for the current stream costs microseconds of host time
(a device query each), which a GPU step of a few milliseconds would otherwise pay six times.
"""

from __future__ import annotations

import time

import torch

PHASES = ("data", "forward", "backward", "sync", "optimizer")


class StepTimer:
    """start(), mark(phase) as each phase ends, stop(); collect() averages the steps since the last call."""

    profiled = 0  # steps the profiler recorded since the last row (only ProfiledStepTimer counts them)

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        # The trainer runs the whole step on the stream that is current when it starts.
        self._stream = torch.cuda.current_stream(device) if self._cuda else None
        self._events: list[torch.cuda.Event] = []  # the pool, reused after every collect()
        self._used = 0
        self._marks: list[tuple[str, object]] = []
        self._steps: list[list[tuple[str, object]]] = []

    def _now(self) -> object:
        if not self._cuda:
            return time.perf_counter()
        if self._used == len(self._events):  # only while the first window fills the pool
            self._events.append(torch.cuda.Event(enable_timing=True))
        event = self._events[self._used]
        self._used += 1
        event.record(self._stream)
        return event

    def start(self) -> None:
        self._marks = [("start", self._now())]

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self._now()))

    def stop(self) -> None:
        self._steps.append(self._marks)

    def collect(self) -> dict[str, float] | None:
        """Mean seconds per phase (summed over micro-batches) and per `step`, over the collected steps."""
        steps, self._steps = self._steps, []
        if not steps:
            return None
        if self._cuda:
            steps[-1][-1][1].synchronize()  # type: ignore[attr-defined]  # later than every other event
        totals = dict.fromkeys((*PHASES, "step"), 0.0)
        for marks in steps:
            for (_, begin), (phase, end) in zip(marks, marks[1:], strict=False):
                totals[phase] += self._elapsed(begin, end)
            totals["step"] += self._elapsed(marks[0][1], marks[-1][1])
        self._used = 0  # called between steps: every recorded event has been read, the pool is free
        return {phase: seconds / len(steps) for phase, seconds in totals.items()}

    def _elapsed(self, begin: object, end: object) -> float:
        if self._cuda:
            return begin.elapsed_time(end) / 1000.0  # type: ignore[attr-defined]
        return end - begin  # type: ignore[operator]
