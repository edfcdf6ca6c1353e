"""The one clock of everything timed in a step: the loop's phases, the communication object's
stamps, the bucket-cap tuner's trials.

On CPU a mark is `time.perf_counter()`: an op has finished when Python moves on, and gloo completes
a collective's future when its data is there. On CUDA kernels run asynchronously, so a mark is a
CUDA event recorded on a stream, and two marks become seconds only when read (`seconds` waits for
the later one: a device sync, which the loop makes at logged rows only). Events for the training
thread come from a pool that `reuse()` frees once its marks are read: creating an event costs a
device query, which a GPU step of a few milliseconds would pay at every mark.
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
        # The loop runs a whole step on the stream that is current when it starts.
        self._stream = torch.cuda.current_stream(device) if self.cuda else None
        self._pool: list[torch.cuda.Event] = []
        self._used = 0

    def now(self) -> Mark:
        """A mark on the training thread (pooled events on CUDA)."""
        if not self.cuda:
            return self._source()
        if self._used == len(self._pool):  # only while the first marks fill the pool
            self._pool.append(torch.cuda.Event(enable_timing=True))
        event = self._pool[self._used]
        self._used += 1
        event.record(self._stream)
        return event

    def now_anywhere(self) -> Mark:
        """A mark from any thread, on its current stream (a collective's completion callback)."""
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

    def reuse(self) -> None:
        """Every pooled mark has been read: the pool's events may be recorded again."""
        self._used = 0
