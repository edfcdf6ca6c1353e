"""Splits every step's time into phases without adding a single synchronisation.

On CPU every op has finished when Python moves on, so a monotonic clock is exact. On CUDA kernels
run asynchronously: we record CUDA events at phase boundaries on every step and read them back
only at a logged step, after the one host sync that step makes anyway (reading the loss).
"""

from __future__ import annotations

import time

import torch

PHASES = ("data", "forward", "backward", "sync", "optimizer")


class StepTimer:
    """start(), mark(phase) as each phase ends, stop(); collect() averages the steps since the last call."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._marks: list[tuple[str, object]] = []
        self._steps: list[list[tuple[str, object]]] = []

    def _now(self) -> object:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

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
            for (_, begin), (phase, end) in zip(marks, marks[1:]):
                totals[phase] += self._elapsed(begin, end)
            totals["step"] += self._elapsed(marks[0][1], marks[-1][1])
        return {phase: seconds / len(steps) for phase, seconds in totals.items()}

    def _elapsed(self, begin: object, end: object) -> float:
        if self._cuda:
            return begin.elapsed_time(end) / 1000.0  # type: ignore[attr-defined]
        return end - begin  # type: ignore[operator]
