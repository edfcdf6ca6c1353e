"""bucketed's timing of its collectives: host clocks or CUDA events, and waits that note arrivals.

On CUDA a wait must also order the streams: the division by the world size (and the optimizer)
runs on the current stream, which must wait for the collective's. A NCCL Work's wait() does that;
a future chained with then() does it only for the CUDA tensors its value holds, so the callback
passes the collective's value on, and the wait also waits on the Work itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from trainer.sync import averaging


class Clock:
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


def timed(work: dist.Work, started: Any, clock: Clock, spans: list[tuple[Any, Any]]) -> averaging.Waitable:
    """The collective, noting when its result arrived in `spans`: from its future where the backend
    has one (gloo's all_reduce, NCCL), else when the wait returns (an upper bound)."""

    def note() -> None:
        spans.append((started, clock.now()))  # on the communication thread (gloo) or its stream (CUDA)

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
