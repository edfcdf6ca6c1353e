"""The report's third panel: where each job's step went, as a stacked bar beside its step-time bar.

compute + exposed communication is the step; communication hidden under backward sits between
them in the stack, so the stack stands taller than the step by exactly what overlap hid. That
is the picture of why a bucket cap helps (more hidden, less exposed) or does not.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.axes import Axes

from trainer.tools.report_rows import REPEAT_KEY, JobRow, override_key


def stack(row: JobRow) -> list[tuple[str, float]]:
    """The stacked bar's pieces, bottom to top: compute, hidden comm, exposed comm (ms); [] when unknown."""
    if row.compute_ms is None:
        return []
    return [
        ("compute", row.compute_ms),
        ("comm hidden under backward", row.hidden_comm_ms or 0.0),
        ("exposed comm", row.comm_exposed_ms or 0.0),
    ]


def _label(row: JobRow) -> str:
    words = [o.replace("sync.bucket_cap_mb=", "cap ") for o in row.overrides.split() if override_key(o) != REPEAT_KEY]
    return f"{row.job}: " + " ".join(words) + (f" (repeat {row.repeat})" if row.repeat else "")


def draw_time_split(ax: Axes, done: Sequence[JobRow]) -> None:
    width = 0.38
    xs = list(range(len(done)))
    ax.bar([x - width / 2 for x in xs], [r.step_ms or 0.0 for r in done], width, color="0.55", label="step")
    colors = {"compute": "C0", "comm hidden under backward": "C2", "exposed comm": "C3"}
    drawn: set[str] = set()
    for x, row in zip(xs, done, strict=True):
        bottom = 0.0
        for name, value in stack(row):
            label = None if name in drawn else name
            ax.bar(x + width / 2, value, width, bottom=bottom, color=colors[name], label=label)
            drawn.add(name)
            bottom += value
    unknown = [r.job for r in done if not stack(r)]
    slant = 35 if len(done) <= 10 else 60  # a repeated strategy sweep has 22 jobs
    ax.set_xticks(xs, [_label(r) for r in done], fontsize=7, rotation=slant, ha="right", rotation_mode="anchor")
    ax.set(ylabel="ms per step (medians)", ylim=(0, 1.25 * ax.get_ylim()[1]))
    title = "per job: step | compute + hidden + exposed comm"
    ax.set_title(title + (f"\n(no comm timing: job {', '.join(unknown)})" if unknown else ""), fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
