"""Splits a step's time into phases without disturbing the steps that are not measured.

On CPU every op has finished when Python moves on, so a monotonic clock is exact. On CUDA kernels
run asynchronously: we record CUDA events at phase boundaries and synchronize once, at the end of a
measured step. Unmeasured steps record nothing and never synchronize.
"""

from __future__ import annotations

import time

import torch

PHASES = ("data", "forward", "backward", "sync", "optimizer")


class StepTimer:
    """Call start(), then mark(phase) as each phase ends, then stop() for seconds per phase."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._active = False
        self._marks: list[tuple[str, object]] = []

    def _now(self) -> object:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def start(self, measure: bool) -> None:
        self._active = measure
        self._marks = [("start", self._now())] if measure else []

    def mark(self, phase: str) -> None:
        if self._active:
            self._marks.append((phase, self._now()))

    def stop(self) -> dict[str, float] | None:
        """Seconds per phase (a phase marked twice, e.g. per micro-batch, is summed) plus `step`."""
        if not self._active:
            return None
        self._active = False
        if self._cuda:
            self._marks[-1][1].synchronize()  # type: ignore[attr-defined]
        totals = dict.fromkeys(PHASES, 0.0)
        for (_, begin), (phase, end) in zip(self._marks, self._marks[1:]):
            totals[phase] += self._elapsed(begin, end)
        totals["step"] = self._elapsed(self._marks[0][1], self._marks[-1][1])
        return totals

    def _elapsed(self, begin: object, end: object) -> float:
        if self._cuda:
            return begin.elapsed_time(end) / 1000.0  # type: ignore[attr-defined]
        return end - begin  # type: ignore[operator]
