"""Which sync.bucket_cap_mb to use for a bucketing strategy (the command asks for sync=ddp), said
honestly: caps that build the same buckets tie.

A cap only matters through the buckets it builds. When every cap gives the model the same
buckets, naming the largest as "best" would present a tie-break as a finding; so this says that
the caps tie, and names the caps that share a layout when only some do.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path

from trainer.comm_schedule import Buckets, Schedule
from trainer.links import Topology
from trainer.scaling.predict import Prediction, best_cap, layout
from trainer.scaling.profile import RunProfile

NOISE_BOUND = 0.2  # how far the median logged step time may lie above the fastest before it warns


def cap_layout(profile: RunProfile, schedule: Schedule, cap_mb: float) -> tuple[int, ...]:
    """The buckets (bytes) the model predicts the strategy builds at this cap, in the order it sends them."""
    sends = schedule.with_cap(cap_mb).sends
    assert isinstance(sends, Buckets), "only a strategy that sends buckets has a cap"
    return tuple(layout(profile, sends))


def tied_caps(profile: RunProfile, schedule: Schedule, caps_mb: Sequence[float]) -> list[list[float]]:
    """The caps grouped by the layout they build, groups in the order of their first cap."""
    groups: dict[tuple[int, ...], list[float]] = {}
    for cap in caps_mb:
        groups.setdefault(cap_layout(profile, schedule, cap), []).append(cap)
    return list(groups.values())


def _caps(caps: Sequence[float]) -> str:
    words = [f"{c:g}" for c in caps]
    return ", ".join(words[:-1]) + f" and {words[-1]}" if len(words) > 1 else words[0]


def cap_advice(
    profile: RunProfile,
    topologies: Sequence[Topology],
    strategy: str,
    schedule: Schedule,
    caps_mb: Sequence[float],
    *,
    overlap: bool,
) -> tuple[str, list[Prediction] | None]:
    """The line to print for the strategy named `strategy`, and the best cap per N (None when every cap ties)."""
    groups = tied_caps(profile, schedule, caps_mb)
    if len(groups) == 1:
        count = len(cap_layout(profile, schedule, caps_mb[0]))
        return (
            f"sync.bucket_cap_mb for sync={strategy}: all caps give the same buckets ({count}), so none is best",
            None,
        )
    best = [best_cap(profile, topo, strategy, schedule, caps_mb, overlap=overlap) for topo in topologies]
    line = f"best sync.bucket_cap_mb for sync={strategy}: " + ", ".join(
        f"N={b.ranks}: {b.bucket_cap_mb:g} ({b.step_s * 1e3:.3f} ms)" for b in best
    )
    ties = [g for g in groups if len(g) > 1]
    if ties:
        line += "; " + "; ".join(f"caps {_caps(g)} give the same buckets" for g in ties)
    return line, best


def noise_warning(step_s: Sequence[float], bound: float = NOISE_BOUND) -> str | None:
    """A warning when other work slowed most of the run, so that its compute is not a stable base, else None.

    Every step does the same work, and whatever else takes the core (another process, the run's own
    threads without OMP_NUM_THREADS=1) only adds time: on an idle core the median logged step lies
    within about a tenth of the fastest, and a median far above it is largely waiting for the CPU.
    A spread measure such as the interquartile range would be symmetric where the noise is not, and
    the ten rows of a 100-step run estimate it too loosely to tell a quiet run from a busy one.
    """
    if len(step_s) < 4:  # too few rows to call it either way
        return None
    fastest, median = min(step_s), statistics.median(step_s)
    if fastest <= 0 or median <= (1 + bound) * fastest:
        return None
    return (
        f"warning: the run's median step time ({median * 1e3:.3f} ms) is {median / fastest - 1:.0%} above its "
        f"fastest ({fastest * 1e3:.3f} ms; over {bound:.0%}): something else took the CPU for most of the run, so "
        "its compute is not a stable base for predictions; rerun it on an idle machine, with OMP_NUM_THREADS=1"
    )


def logged_step_s(run_dir: Path) -> list[float]:
    """Every rank's logged `time/step_s` values (metrics/rank*.jsonl), unreadable lines skipped."""
    values: list[float] = []
    for path in sorted((run_dir / "metrics").glob("rank*.jsonl")):
        for line in path.read_text(encoding="utf-8").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and isinstance(row.get("time/step_s"), int | float) and "train/loss" in row:
                values.append(float(row["time/step_s"]))
    return values
