"""The bucket mechanism `bucketed` and `zero` share: which buckets may start, strictly in order.

Each bucket waits for a number of gradient arrivals (one per parameter, or more for a parameter
reused under reentrant checkpointing, whose hook fires once per backward pass through it). When
the bucket at the head of the line has none missing, it and every complete bucket after it may
start. Starting strictly in order is what keeps the ranks paired: every rank issues the same
collectives in the same order, whatever order its gradients arrived in.
"""

from __future__ import annotations

from collections.abc import Sequence


class InOrder:
    """Per bucket the arrivals it still misses, and the next bucket to start."""

    def __init__(self, arrivals_per_bucket: Sequence[int]) -> None:
        self.expected = list(arrivals_per_bucket)
        self.reset()

    def reset(self) -> None:
        """A new backward: every bucket misses all its arrivals again."""
        self.missing = list(self.expected)
        self.next = 0

    def arrived(self, bucket: int) -> range:
        """One gradient of `bucket` arrived: the buckets that may start now (none, or a run of them)."""
        self.missing[bucket] -= 1
        first = self.next
        while self.next < len(self.missing) and self.missing[self.next] == 0:
            self.next += 1
        return range(first, self.next)

    def rest(self) -> range:
        """The buckets not started yet (after backward): they start now, in order."""
        first, self.next = self.next, len(self.missing)
        return range(first, self.next)
