"""Splits every step's time into phases without adding a single synchronisation.

The marks are trainer/clock.py's: host clocks on CPU, where every op has finished when Python
moves on; CUDA events on a GPU, recorded at phase boundaries on every step and read back only at a
logged row, after the host sync that row makes anyway (reading the loss). That read is the one
device sync timing adds, once per row.
"""

from __future__ import annotations

import torch

from trainer.clock import Clock, Mark

PHASES = ("data", "forward", "backward", "sync", "optimizer")


class StepTimer:
    """start(), mark(phase) as each phase ends, stop(); collect() averages the steps since the last call."""

    profiled = 0  # steps the profiler recorded since the last row (only ProfiledStepTimer counts them)

    def __init__(self, device: torch.device) -> None:
        self.clock = Clock(device)
        self._marks: list[tuple[str, Mark]] = []
        self._collected: list[list[tuple[str, Mark]]] = []

    def start(self) -> None:
        self._marks = [("start", self.clock.now())]

    def mark(self, phase: str) -> None:
        self._marks.append((phase, self.clock.now()))

    def stop(self) -> None:
        self._collected.append(self._marks)

    def collect(self) -> dict[str, float] | None:
        """Mean seconds per phase (summed over micro-batches) and per `step`, over the collected steps."""
        steps, self._collected = self._collected, []
        if not steps:
            return None
        totals = dict.fromkeys((*PHASES, "step"), 0.0)
        for marks in steps:  # on CUDA each read waits for its later event (all done by the row's own sync)
            for (_, begin), (phase, end) in zip(marks, marks[1:], strict=False):
                totals[phase] += self.clock.seconds(begin, end)
            totals["step"] += self.clock.seconds(marks[0][1], marks[-1][1])
        self.clock.reuse()  # called between steps: every recorded mark has been read
        return {phase: seconds / len(steps) for phase, seconds in totals.items()}
