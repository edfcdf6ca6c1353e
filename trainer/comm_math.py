"""The communication arithmetic, defined once: ring step counts, the bytes a rank sends, nccl-tests'
bus factors, the time intervals cover, and the overlap and hidden shares. The rows
(trainer/measures.py), the report, the timeline, the scaling model and the collectives tool all
take them from here.

A ring of n ranks moves a buffer of S bytes in steps of S/n per rank: reduce_scatter and
all_gather take n-1 steps, all_reduce (a reduce_scatter then an all_gather) 2(n-1). A broadcast
runs as a pipelined ring: n-1 hops, each paying one latency, while the buffer crosses every link
but the one into the root once.

Two shares of S, which differ only for a broadcast:

- The wire factor: the bytes one rank sends, as a share of S, averaged over the n ranks (the rows'
  `comm/*bytes_per_step`). A broadcast's n-1 senders each send S and the last rank none: (n-1)/n.
  So the same data moved the same way counts the same whichever collective carries it: an
  all_gather of S, or a broadcast from each rank of its S/n slice, are both (n-1)/n S.
- The bus factor: nccl-tests' busbw/algbw (its doc/PERFORMANCE.md), the share of S that crosses
  the busiest link in the collective's time, so that busbw compares with a link's speed whatever
  the kind and n (the rows' `comm/busbw_GBps`, the collectives tool). A broadcast's busiest link
  carries all of S: 1.

    kind            ring steps    wire factor   bus factor
    all_reduce      2(n-1)        2(n-1)/n      2(n-1)/n
    reduce_scatter   n-1           (n-1)/n       (n-1)/n     S = the full input
    all_gather       n-1           (n-1)/n       (n-1)/n     S = the full output
    broadcast        n-1           (n-1)/n       1

One rank sends nothing: 0 steps, both factors 0. A leaf: the standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable

KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")


def _check(kind: str, n: int) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown collective {kind!r}; one of {', '.join(KINDS)}")
    if n < 1:
        raise ValueError(f"need n >= 1 ranks, got {n}")


def ring_steps(kind: str, n: int) -> int:
    """The ring algorithm's steps over n ranks, each one link latency."""
    _check(kind, n)
    return 2 * (n - 1) if kind == "all_reduce" else n - 1


def wire_factor(kind: str, n: int) -> float:
    """The bytes one rank sends for a collective over n ranks, as a share of its buffer, averaged
    over the ranks (module docstring)."""
    _check(kind, n)
    return (2 if kind == "all_reduce" else 1) * (n - 1) / n


def bus_factor(kind: str, n: int) -> float:
    """busbw / algbw over n ranks: the bytes each rank sends as a share of the buffer."""
    _check(kind, n)
    if n == 1:
        return 0.0
    return 1.0 if kind == "broadcast" else ring_steps(kind, n) / n


def busy_time(intervals: Iterable[tuple[float, float]]) -> float:
    """Length of the union of [start, end] intervals: time with at least one of them in progress."""
    total, cursor = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > cursor:
            total += end - max(start, cursor)
            cursor = end
    return total


def overlap_fraction(busy_s: float, exposed_s: float) -> float:
    """The share of communication time hidden under compute: 1 - exposed / busy, at least 0
    (exposed measured a little past busy still reads as nothing hidden)."""
    if busy_s <= 0:
        raise ValueError(f"busy_s={busy_s}: an overlap needs communication time > 0")
    return max(0.0, 1.0 - exposed_s / busy_s)


def hidden_time(busy_s: float, exposed_s: float) -> float:
    """The communication time hidden under compute: busy minus exposed, at least 0 (the overlap's
    numerator; the report's hidden ms)."""
    return max(0.0, busy_s - exposed_s)
