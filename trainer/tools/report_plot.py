"""The sweep report's figure (report.png): step time and throughput per job or against bucket size.

Kept apart from the text outputs (report_table.py) because it is the only part that needs
matplotlib, and its layout choices (log x, a 1/N right axis, rank marks) are a topic of their own.
"""

from __future__ import annotations

from collections.abc import Sequence

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

from trainer.tools.report_rows import JobRow


def _values(row: JobRow, field: str) -> list[float]:
    return [v for v in (getattr(r, field) for r in row.ranks) if v is not None]


def _other_overrides(row: JobRow) -> list[str]:
    """The row's overrides besides the strategy, model and bucket size: they tell its series apart."""
    keys = ("sync", "model", "sync.bucket_cap_mb")
    return [o for o in row.overrides.split() if o.split("=", 1)[0].lstrip("+~") not in keys]


def plot(rows: Sequence[JobRow], title: str) -> Figure:
    """Step time and throughput against bucket size (log x) when it varies, else per job."""
    done = [r for r in rows if r.status == "ok" and r.step_ms is not None and r.samples_per_s is not None]
    bucketed = sorted((r for r in done if r.bucket_cap_mb is not None), key=lambda r: r.bucket_cap_mb or 0.0)
    if len({r.bucket_cap_mb for r in bucketed}) < 2:  # e.g. a strategy sweep: bars per job, not one x value
        bucketed = []
    vary = [f for f in ("sync", "model") if len({getattr(r, f) for r in done}) > 1]
    series: dict[str, list[JobRow]] = {}
    for r in bucketed:
        series.setdefault(" ".join([getattr(r, f) for f in vary] + _other_overrides(r)) or r.sync, []).append(r)
    colors = [f"C{i % 10}" for i in range(len(done) + 1)]
    fig = Figure(figsize=(13, 5))
    FigureCanvasAgg(fig)  # Agg renders to files only, and without pyplot no figure stays alive globally
    axes = fig.subplots(1, 2)
    num_ranks = max((len(r.ranks) for r in done), default=1)
    fields = ("step_ms", "samples_per_s"), ("median step time (ms)", "global throughput (samples/s)")
    for ax, field, ylabel in zip(axes, *fields, strict=True):
        # Per-rank throughput goes on a right axis scaled 1/N: balanced ranks sit on the job's line.
        marks = ax if field == "step_ms" else ax.twinx()
        if bucketed:
            for color, (label, members) in zip(colors, series.items(), strict=False):
                ax.plot(
                    [r.bucket_cap_mb for r in members],
                    [getattr(r, field) for r in members],
                    "o-",
                    mfc="none",
                    color=color,
                    label=label,
                )
                marks.plot(
                    *zip(*[(r.bucket_cap_mb, v) for r in members for v in _values(r, field)], strict=True),
                    "x",
                    color=color,
                )
            others = [r for r in done if all(r is not b for b in bucketed)]
            for color, r in zip(colors[len(series) :], others, strict=False):
                what = f"buckets {r.bucket_setting}" if r.bucket_setting else "no buckets"
                ax.axhline(getattr(r, field), ls="--", color=color, label=f"{r.sync} (job {r.job}, {what})")
                if field == "step_ms":  # rank spread; on throughput the ranks sit at 1/N of the line
                    ax.axhspan(min(_values(r, field)), max(_values(r, field)), color=color, alpha=0.12)
            ax.set_xscale("log")
            ticks = sorted({r.bucket_cap_mb for r in bucketed if r.bucket_cap_mb is not None})
            ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.set_xlabel("DDP bucket_cap_mb (MiB, log scale)")
        else:
            ax.bar(range(len(done)), [getattr(r, field) for r in done], color="C0", alpha=0.6, label="job")
            marks.plot(
                *zip(*[(x, v) for x, r in enumerate(done) for v in _values(r, field)], strict=True), "x", color="black"
            )
            labels = [f"job {r.job}\n" + r.overrides.replace(" ", "\n") for r in done]
            # Many jobs (a strategy sweep has eight) would overlap their labels: slant them instead.
            slant = {"rotation": 30, "ha": "right", "rotation_mode": "anchor"} if len(done) > 4 else {}
            ax.set_xticks(range(len(done)), labels, fontsize=8, **slant)
            ax.set_xlabel("job (overrides)")
        ax.plot([], [], "x", color="gray", label="per-rank median" + ("" if marks is ax else " (right axis)"))
        ax.set(ylabel=ylabel, ylim=(0, 1.2 * ax.get_ylim()[1]))  # headroom for the legend
        if marks is not ax:
            marks.set(ylabel=f"per-rank samples/s (= left / {num_ranks})", ylim=(0, ax.get_ylim()[1] / num_ranks))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    skipped = [r.job for r in rows if all(r is not d for d in done)]
    if skipped:
        fig.text(0.5, 0.01, f"not drawn (incomplete or no timings): job {', '.join(skipped)}", ha="center", fontsize=9)
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig
