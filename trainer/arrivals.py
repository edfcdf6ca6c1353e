"""Who arrived last: each collective of the sampled step, as long as each rank was inside it.

No clock is shared between hosts, so no rank can say when another arrived. Each rank measures its
own time inside a collective instead, from its launch to its completion on that rank: the ranks
leave a collective together (none finishes before the last has sent its part), so the rank that
arrived last spent the least time inside, and the others' median time inside less its own is how
late it was (against the typical rank: the earliest of the others is early by its own noise).
docs/metrics.md ("Who arrived last") defines the row's keys from this.

Each rank sends its times with the row's one collective (trainer/reliability/guards.py), a fixed
width for every rank: the sampled step, then µs inside each of its first `SLOTS` data collectives
(-1 where the step had fewer). The answer comes back with the next row, as the non-finite check's
does, so a row names the last arrivals of the previous row's sampled step (`comm/late_of_step`).
"""

from __future__ import annotations

import statistics
from collections import Counter
from collections.abc import Sequence
from typing import Any

from trainer.measures import Collective

SLOTS = 64  # data collectives compared per sampled step (a bucketed GPT-2 step has ~10; zero3's units ~50)
WIDTH = 1 + SLOTS  # what a rank sends: its sampled step, then its times
NONE = -1


def mine(step: int | None, collectives: Sequence[Collective]) -> list[int]:
    """This rank's numbers: the sampled step (-1: none closed) and µs inside each data collective, in launch order."""
    inside = [round(max(0.0, c.completed - c.launched) * 1e6) for c in collectives if not c.control][:SLOTS]
    return [NONE if step is None else step, *inside, *[NONE] * (SLOTS - len(inside))]


def late_row(by_rank: Sequence[Sequence[int]]) -> dict[str, float]:
    """The row's keys from every rank's `mine()`, in rank order: {} where the ranks did not send the
    same sampled step, or it had no data collective.

    For each collective: the rank inside it the shortest time arrived last, by the other ranks'
    median time inside less its own (how long the typical rank waited for it). `comm/late_rank`: the rank the others
    waited for the longest in all (the lowest on a tie); `comm/late_rank_share`: the share of the
    step's collectives at which it arrived last; `comm/late_ms`: how late it was at the first meeting
    of the ranks, the most by which it was last at one collective; `comm/late_of_step`: the sampled
    step they are about. Once the ranks have met in a collective that every one waits for, the next
    ones start level: which rank is last there is noise (of µs on a GPU, up to ms on CPU ranks
    sharing cores), which the sum outweighs and the maximum leaves out."""
    steps = {numbers[0] for numbers in by_rank}
    if len(by_rank) < 2 or len(steps) != 1 or NONE in steps:
        return {}
    columns = [[numbers[1 + i] for numbers in by_rank] for i in range(SLOTS)]
    columns = [times for times in columns if NONE not in times]
    if not columns:
        return {}
    last = [min(range(len(times)), key=times.__getitem__) for times in columns]
    late = [_late(times, r) for times, r in zip(columns, last, strict=True)]
    waited: dict[int, float] = {}
    for r, us in zip(last, late, strict=True):
        waited[r] = waited.get(r, 0) + us
    rank = min(waited, key=lambda r: (-waited[r], r))
    late_us = [us for r, us in zip(last, late, strict=True) if r == rank]
    return {
        "comm/late_rank": rank,
        "comm/late_rank_share": len(late_us) / len(columns),
        "comm/late_ms": max(late_us) / 1e3,
        "comm/late_of_step": steps.pop(),
    }


def _late(times: Sequence[int], last: int) -> float:
    """How late rank `last` was at one collective: the other ranks' median time inside less its own."""
    return statistics.median(t for r, t in enumerate(times) if r != last) - times[last]


PERSISTENT_ROWS = 4  # rows that compared arrivals, at least
PERSISTENT_SHARE = 0.75  # of which at least this share named the same rank


def straggler(rows: Sequence[dict[str, Any]]) -> dict[str, float]:
    """For summary.json, from a rank's rows (every rank's carry the same keys): the rank they named
    most often (`late_rank`), in how many of the rows that compared arrivals (`late_rows`, of
    `compared_rows`), at what share of the step's collectives and how late at the median over
    those rows; {} where no row compared. `persistent` (1 or 0): named in at least 75 % of at least
    4 rows. Two equally fast ranks on idle cores are each last about half the time; ranks sharing
    cores with other work can be steadily a millisecond apart, and are then named (they are late)."""
    named = [(int(r["comm/late_rank"]), r) for r in rows if "comm/late_rank" in r]
    if not named:
        return {}
    counts = Counter(rank for rank, _ in named)
    rank = min(counts, key=lambda r: (-counts[r], r))
    mine = [row for r, row in named if r == rank]
    persistent = len(named) >= PERSISTENT_ROWS and counts[rank] >= PERSISTENT_SHARE * len(named)
    return {
        "late_rank": rank,
        "late_rows": counts[rank],
        "compared_rows": len(named),
        "late_collectives_share": statistics.median(float(row["comm/late_rank_share"]) for row in mine),
        "late_ms": statistics.median(float(row["comm/late_ms"]) for row in mine),
        "persistent": int(persistent),
    }


def straggler_line(found: dict[str, float]) -> str | None:
    """The end-of-run line naming a persistent straggler, or None."""
    if not found.get("persistent"):
        return None
    return (
        f"  straggler  rank {int(found['late_rank'])} arrived last in {int(found['late_rows'])} of "
        f"{int(found['compared_rows'])} sampled steps, {found['late_ms']:.1f} ms late at the median (last at "
        f"{100 * found['late_collectives_share']:.0f} % of their collectives; docs/metrics.md#who-arrived-last)"
    )
