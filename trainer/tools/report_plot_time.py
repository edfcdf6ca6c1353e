"""The report's third panel: where each job's step went, one bar per job as tall as its step.

A bar is compute (the step minus the exposed communication) with the exposed communication on
top: together they are the step. Communication hidden under backward ran *during* compute, so it
is drawn inside the compute piece, as a narrower bar ending where compute ends (backward is the
end of it), never stacked on top: adding it would count the same milliseconds twice. That is
the picture of why a bucket cap helps (more of the communication inside, less on top) or not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from matplotlib.axes import Axes

from trainer.tools.report_rows import REPEAT_KEY, JobRow, override_key

WIDTH = 0.7  # a job's bar
INNER = 0.3  # the hidden communication's bar, inside the compute piece
COMPUTE = "compute (step - exposed comm)"
EXPOSED = "exposed comm (the step waited for it)"
HIDDEN = "comm hidden under backward (ran during compute, not added)"
UNTIMED = "step (its communication not timed)"


@dataclass(frozen=True)
class Split:
    """A job's step in ms: compute + exposed = the step; hidden ran inside compute."""

    compute: float
    exposed: float
    hidden: float


def split(row: JobRow) -> Split | None:
    """The job's split; None when it sent bytes but timed none of them (unknown)."""
    if row.compute_ms is None or row.step_ms is None:
        return None
    compute = row.compute_ms
    # Hidden time is measured apart from the step (a median of time/comm_s): drawn no taller than
    # the compute it ran under.
    return Split(compute, row.step_ms - compute, min(row.hidden_comm_ms or 0.0, compute))


def _label(row: JobRow) -> str:
    words = [o.replace("sync.bucket_cap_mb=", "cap ") for o in row.overrides.split() if override_key(o) != REPEAT_KEY]
    same = f" (= {row.same_buckets_as})" if row.same_buckets_as else ""  # the same buckets as that cap's job
    return f"{row.job}: " + " ".join(words) + same + (f" (repeat {row.repeat})" if row.repeat else "")


def draw_time_split(ax: Axes, done: Sequence[JobRow]) -> None:
    xs = list(range(len(done)))
    known = [(x, s) for x, s in zip(xs, map(split, done), strict=True) if s is not None]
    if known:
        at, parts = [x for x, _ in known], [s for _, s in known]
        ax.bar(at, [s.compute for s in parts], WIDTH, color="C0", label=COMPUTE)
        ax.bar(at, [s.exposed for s in parts], WIDTH, bottom=[s.compute for s in parts], color="C3", label=EXPOSED)
        shown = [(x, s) for x, s in known if s.hidden > 0]
        if shown:
            ax.bar(
                [x for x, _ in shown],
                [s.hidden for _, s in shown],
                INNER,
                bottom=[s.compute - s.hidden for _, s in shown],
                color="C2",
                edgecolor="white",
                linewidth=0.6,
                label=HIDDEN,
            )
    unknown = [(x, r) for x, r in zip(xs, done, strict=True) if split(r) is None]
    if unknown:
        ax.bar([x for x, _ in unknown], [r.step_ms or 0.0 for _, r in unknown], WIDTH, color="0.6", label=UNTIMED)
    slant = 35 if len(done) <= 10 else 60  # a repeated strategy sweep has 22 jobs
    ax.set_xticks(xs, [_label(r) for r in done], fontsize=7, rotation=slant, ha="right", rotation_mode="anchor")
    ax.set(ylabel="ms per step (medians)", ylim=(0, 1.3 * ax.get_ylim()[1]))
    ax.set_title("per job: the step = compute + exposed comm", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    if ax.containers:  # a sweep with no finished job draws no bar
        ax.legend(fontsize=8, loc="upper left")
