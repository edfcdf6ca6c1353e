"""Counting what a sync strategy communicates, and turning the counts into per-step metrics."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from trainer.errors import check, is_int


@dataclass
class CommCounters:
    """Cumulative since the last take(): bytes all-reduced, calls, and (when measured) wall time.

    `seconds` and `exposed_seconds` cover `timed_steps` steps: every step when a hook times each
    bucket, or one sampled step per row when DDP's runtime statistics time it.
    """

    bytes: int = 0
    collectives: int = 0
    seconds: float = 0.0  # wall time with at least one collective in flight
    exposed_seconds: float = 0.0  # the part of it not hidden under backward computation
    timed_steps: int = 0  # how many steps seconds/exposed_seconds were measured over (0: untimed)
    # Per kind of collective ("all_reduce", "reduce_scatter", ...): [bytes of the buffer, calls].
    kinds: dict[str, list[int]] = field(default_factory=dict)

    def add(self, kind: str, nbytes: int) -> None:
        """One collective of `kind` on a buffer of `nbytes` (nccl-tests' size: the whole buffer)."""
        counts = self.kinds.setdefault(kind, [0, 0])
        counts[0] += nbytes
        counts[1] += 1
        self.collectives += 1

    def take(self) -> CommCounters:
        """The counts so far; the counters start again from zero."""
        taken = CommCounters(
            self.bytes, self.collectives, self.seconds, self.exposed_seconds, self.timed_steps, self.kinds
        )
        self.bytes, self.collectives, self.seconds, self.exposed_seconds, self.timed_steps = 0, 0, 0.0, 0.0, 0
        self.kinds = {}
        return taken


def check_time_every_n_steps(value: int, timed_by: str) -> None:
    """sync.time_every_n_steps, shared by the strategies that time one step in n."""
    check(
        is_int(value) and value >= 1,
        "sync.time_every_n_steps",
        value,
        f"must be an integer >= 1 ({timed_by} time one step in this many)",
    )


def all_reduce_bus_factor(world_size: int) -> float:
    """nccl-tests' busbw/algbw for all_reduce, 2(n-1)/n: what each link really carries."""
    return 2 * (world_size - 1) / world_size


def busy_time(intervals: Sequence[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: time with at least one collective in flight."""
    total, cursor = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > cursor:
            total += end - max(start, cursor)
            cursor = end
    return total


def exposed_time(intervals: Sequence[tuple[float, float]]) -> float:
    """Communication left after the last bucket was launched, i.e. after backward's compute ended."""
    if not intervals:
        return 0.0
    return max(0.0, max(end for _, end in intervals) - max(start for start, _ in intervals))


def comm_metrics(
    counts: CommCounters, steps: int, sync_phase_s: float, in_sync_phase: bool, world_size: int
) -> dict[str, float]:
    """Per-step communication metrics for one logged row (an empty dict when nothing was sent).

    `in_sync_phase`: the strategy communicates only inside after_backward (manual), so the timed
    sync phase is its communication time, all of it exposed. Otherwise the strategy's own timing
    is used if it has one (ddp), averaged over the steps it timed, and time is left out when
    nothing measured it in this row's window.
    """
    if counts.bytes == 0 or steps == 0:
        return {}
    metrics = {"comm/bytes_per_step": counts.bytes / steps, "comm/collectives_per_step": counts.collectives / steps}
    for kind, (nbytes, calls) in counts.kinds.items():
        metrics[f"comm/{kind}_bytes_per_step"] = nbytes / steps
        metrics[f"comm/{kind}_per_step"] = calls / steps
    if in_sync_phase:
        seconds, exposed = sync_phase_s, sync_phase_s
    elif counts.timed_steps:
        seconds, exposed = counts.seconds / counts.timed_steps, counts.exposed_seconds / counts.timed_steps
    else:
        return metrics
    metrics["time/comm_s"] = seconds
    metrics["time/comm_exposed_s"] = exposed
    if seconds > 0:
        metrics["comm/overlap_fraction"] = max(0.0, 1.0 - exposed / seconds)
        algbw = (counts.bytes / steps) / seconds
        metrics["comm/busbw_GBps"] = algbw * all_reduce_bus_factor(world_size) / 1e9
    return metrics
