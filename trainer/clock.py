"""The one clock of everything timed: the observer's marks of the sampled step (trainer/observer.py)
and the bucket-cap tuner's trials.

On CPU a mark is `time.perf_counter()`: an op has finished when Python moves on, and gloo completes
a collective's future when its data is there. On CUDA kernels run asynchronously, so a mark is a
CUDA event recorded on the current stream of the thread that marks, and two marks become seconds
only when read (`seconds` waits for the later one: a device sync, which the loop makes at logged
rows only). Creating an event costs a device query: marks are taken on sampled steps only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

Mark = Any  # a float (host clock) or a torch.cuda.Event


class Clock:
    """Marks now, seconds between two marks later; `source` replaces the host clock (tests)."""

    def __init__(self, device: torch.device, source: Callable[[], float] = time.perf_counter) -> None:
        self.cuda = device.type == "cuda"
        self._source = source

    def now(self) -> Mark:
        """A mark from any thread, on its current stream (the training thread's, or a collective's
        completion callback's)."""
        if not self.cuda:
            return self._source()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, begin: Mark, end: Mark) -> float:
        """end - begin in seconds (on CUDA after waiting for `end`)."""
        if not self.cuda:
            return float(end - begin)
        end.synchronize()
        return float(begin.elapsed_time(end)) / 1000.0
