"""The timeline's figures on plain intervals: communication hidden under computation, stragglers,
and where the picture puts the labels that do not fit in their bars.

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


def spread(wanted: Sequence[Span], lo: float, hi: float) -> list[float]:
    """Where a row of labels goes: each wanted span (a label's width, centred on its bar) moved as
    little as keeping them apart allows (a run that collides is centred on its members' wishes),
    in their order, kept inside lo-hi where they fit there. Returns each one's new start."""
    groups: list[tuple[list[int], float, float]] = []  # members, start, width
    for i in sorted(range(len(wanted)), key=lambda i: sum(wanted[i])):
        members, width = [i], wanted[i][1] - wanted[i][0]
        start = min(max(wanted[i][0], lo), hi - width)
        while groups and groups[-1][1] + groups[-1][2] > start:
            before, _, before_width = groups.pop()
            members, width = before + members, before_width + width
            # the start that minimises the members' squared shifts
            offsets = [sum(wanted[j][1] - wanted[j][0] for j in members[:k]) for k in range(len(members))]
            start = sum(wanted[j][0] - off for j, off in zip(members, offsets, strict=True)) / len(members)
            start = max(min(start, hi - width), lo)
        groups.append((members, start, width))
    starts = [0.0] * len(wanted)
    for members, start, _ in groups:
        for j in members:
            starts[j] = start
            start += wanted[j][1] - wanted[j][0]
    return starts
