"""The timeline's figures on plain intervals: communication hidden under computation, and stragglers.

Pure functions on (start, end) pairs in one unit, so that tests can check them exactly on
hand-built intervals.
"""

from __future__ import annotations

from collections.abc import Sequence

from trainer.comm_math import busy_time, overlap_fraction

Span = tuple[float, float]


def union(spans: Sequence[Span]) -> list[Span]:
    """The spans merged where they touch or overlap, sorted."""
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def intersection(a: Sequence[Span], b: Sequence[Span]) -> float:
    """Length of the time covered by both a and b."""
    total, ua, ub = 0.0, union(a), union(b)
    i = j = 0
    while i < len(ua) and j < len(ub):
        lo, hi = max(ua[i][0], ub[j][0]), min(ua[i][1], ub[j][1])
        total += max(0.0, hi - lo)
        if ua[i][1] < ub[j][1]:
            i += 1
        else:
            j += 1
    return total


def overlap(comm: Sequence[Span], compute: Sequence[Span]) -> float | None:
    """Holistic Trace Analysis' communication-computation overlap ("HTA overlap" where shown): the
    share of communication time during which computation also ran, trainer/comm_math.py's
    overlap_fraction with exposed = the communication time no computation covered (None without
    communication)."""
    busy = busy_time(comm)
    if busy <= 0:
        return None
    return overlap_fraction(busy, busy - intersection(comm, compute))


def straggler_gaps(last_launch: dict[int, float]) -> tuple[float, dict[int, float]]:
    """At one step's last collective, launched by each rank at last_launch[rank]: how long the
    fastest rank waited for the slowest (the gap), and each rank's own wait for the slowest."""
    latest = max(last_launch.values())
    waits = {rank: latest - t for rank, t in last_launch.items()}
    return max(waits.values()), waits
