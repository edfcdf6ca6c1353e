"""Sweep report: one row per job of a Hydra multirun (or one job dir), as a table, CSV and plot.

    python -m trainer.tools.report <sweep dir | job dir> [--out DIR]     (writes report.md/.csv/.png)

Read only from the files a job leaves behind (metrics/rank{r}.jsonl, .hydra/, summary.json), so it
works on finished, failed and copied runs alike. Column definitions (also the report.md legend):
- step ms: per rank the median of `time/step_s` over its training rows; the job's value is the
  median over ranks. A row's `time/step_s` is the mean over the steps since the previous row.
- samples/s: sum over ranks of the median of each rank's `throughput/samples_per_s` (ranks work
  concurrently). It is window wall-clock, so it includes time between steps that step ms omits.
- sync %: per rank sum(time/sync_s) / sum(time/step_s), then the mean over ranks. It is the time in
  the strategy's after_backward hook: DDP all-reduces inside backward, so for ddp it is ~0 and
  its communication is counted in time/backward_s (marked with a dagger).
- train loss: mean over ranks of each rank's last training row's `train/loss`.
- eval acc: the last eval row's `eval/accuracy` (identical on all ranks; rank 0's is taken).
- slowest / fastest: the ranks with the highest / lowest median step time.
- status: `incomplete` when the job dir has no (readable) summary.json, i.e. the job did not
  finish: its numbers are shown in parentheses, are not valid results, and are not plotted.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import NullFormatter

LEGEND = __doc__.split("Column definitions (also the report.md legend):\n", 1)[1].strip()
HIDDEN_OVERRIDES = ("run_name", "hydra.")  # naming, not an experimental variable


class ReportError(Exception):
    """A problem with the input dir: printed as one line, exit code 2."""


@dataclass
class Job:
    name: str
    summary: dict[str, Any] | None  # None: no readable summary.json, the job did not finish
    config: dict[str, Any]
    overrides: list[str]
    rows: dict[int, list[dict[str, Any]]]  # rank -> its JSONL rows, in file order


@dataclass
class RankStats:
    rank: int
    step_ms: float | None
    samples_per_s: float | None
    sync_share: float | None
    train_loss: float | None
    timed_steps: int


@dataclass
class JobRow:
    job: str
    status: str
    overrides: str
    sync: str
    model: str
    bucket_cap_mb: float | None
    ranks: list[RankStats]
    step_ms: float | None
    samples_per_s: float | None
    sync_share_pct: float | None
    train_loss: float | None
    eval_accuracy: float | None
    slowest: RankStats | None
    fastest: RankStats | None


def _read_yaml(path: Path, empty: Any) -> Any:
    return (yaml.safe_load(path.read_text(encoding="utf-8")) or empty) if path.is_file() else empty


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Rows of one rank; a line cut short by a killed process is skipped, not fatal."""
    rows = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [row for row in rows if isinstance(row, dict)]


def _read_summary(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def load_job(path: Path) -> Job:
    files = sorted((path / "metrics").glob("rank*.jsonl"))
    rows = {int(f.stem[4:]): read_jsonl(f) for f in files if f.stem[4:].isdigit()}
    return Job(
        path.name,
        _read_summary(path / "summary.json"),
        _read_yaml(path / ".hydra/config.yaml", {}),
        [str(o) for o in _read_yaml(path / ".hydra/overrides.yaml", [])],
        dict(sorted(rows.items())),
    )


def find_jobs(root: Path) -> list[Job]:
    """A dir with metrics/ is one job; otherwise its numbered subdirs are the sweep's jobs."""
    if not root.is_dir():
        raise ReportError(f"{root}: not a directory")
    if (root / "metrics").is_dir():
        jobs = [load_job(root)]
    else:
        dirs = [d for d in root.iterdir() if d.is_dir() and d.name.isdigit()]
        jobs = [load_job(d) for d in sorted(dirs, key=lambda d: int(d.name))]
    if not jobs:
        raise ReportError(f"{root}: no job dirs (numbered subdirs) and no metrics/ dir")
    if not any(job.rows for job in jobs):
        raise ReportError(f"{root}: no metrics/rank*.jsonl in any of its {len(jobs)} job dir(s)")
    return jobs


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def rank_stats(rank: int, rows: Sequence[dict[str, Any]]) -> RankStats:
    train = [row for row in rows if "train/loss" in row]
    step = [row["time/step_s"] for row in train if "time/step_s" in row]
    timed = [row for row in train if "time/step_s" in row and "time/sync_s" in row]
    step_total = sum(row["time/step_s"] for row in timed)
    return RankStats(
        rank=rank,
        step_ms=None if not step else 1000.0 * statistics.median(step),
        samples_per_s=_median([row["throughput/samples_per_s"] for row in train if "throughput/samples_per_s" in row]),
        sync_share=sum(row["time/sync_s"] for row in timed) / step_total if step_total > 0 else None,
        train_loss=train[-1]["train/loss"] if train else None,
        timed_steps=len(step),
    )


def _mean(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None


def job_row(job: Job, overrides: Sequence[str]) -> JobRow:
    sync_cfg = job.config.get("sync") or {}
    sync = str(sync_cfg.get("_target_", "")).rpartition(".")[0].rpartition(".")[2]  # trainer.sync.ddp.DDPSync -> ddp
    bucket = sync_cfg.get("bucket_cap_mb") if sync == "ddp" else None
    ranks = [rank_stats(rank, rows) for rank, rows in job.rows.items()]
    timed = [r for r in ranks if r.step_ms is not None]
    samples = [r.samples_per_s for r in ranks if r.samples_per_s is not None]
    share = _mean([r.sync_share for r in ranks])
    evals = [row for row in job.rows[min(job.rows)] if "eval/accuracy" in row] if job.rows else []
    return JobRow(
        job=job.name,
        status="incomplete" if job.summary is None else "ok",
        overrides=" ".join(overrides),
        sync=sync,
        model=str((job.config.get("model") or {}).get("_target_", "")).rpartition(".")[2],
        bucket_cap_mb=None if bucket is None else float(bucket),
        ranks=ranks,
        step_ms=_median([r.step_ms for r in timed if r.step_ms is not None]),
        samples_per_s=sum(samples) if samples else None,
        sync_share_pct=None if share is None else 100.0 * share,
        train_loss=_mean([r.train_loss for r in ranks]),
        eval_accuracy=evals[-1]["eval/accuracy"] if evals else None,
        slowest=max(timed, key=_step_ms, default=None),
        fastest=min(timed, key=_step_ms, default=None),
    )


def _step_ms(stats: RankStats) -> float:
    """Sort key over ranks that have a step time (the caller filters the others out)."""
    assert stats.step_ms is not None
    return stats.step_ms


def _key(override: str) -> str:
    return override.split("=", 1)[0].lstrip("+~")


def differing_overrides(per_job: Sequence[Sequence[str]]) -> list[list[str]]:
    """Each job's overrides whose value is not the same in every job (one job: all of them)."""
    shown = [[o for o in job if not _key(o).startswith(HIDDEN_OVERRIDES)] for job in per_job]
    if len(shown) <= 1:
        return shown
    values = [{_key(o): o for o in job} for job in shown]
    keys = {k for v in values for k in v if len({job.get(k) for job in values}) > 1}
    return [[o for o in job if _key(o) in keys] for job in shown]


def build_rows(jobs: Sequence[Job]) -> list[JobRow]:
    shown = differing_overrides([job.overrides for job in jobs])
    return [job_row(job, overrides) for job, overrides in zip(jobs, shown, strict=True)]


def _num(value: float | None, spec: str) -> str:
    return "" if value is None else format(value, spec)


def _rank(r: RankStats | None) -> str:
    return "" if r is None else f"r{r.rank} ({r.step_ms:.2f} ms)"


HEADERS = (
    "job",
    "status",
    "overrides",
    "sync",
    "bucket_mb",
    "step ms",
    "samples/s",
    "sync %",
    "train loss",
    "eval acc",
    "slowest",
    "fastest",
)


def table_cells(row: JobRow) -> list[str]:
    """Display strings; an incomplete job's numbers are wrapped in parentheses."""
    dagger = "†" if row.sync == "ddp" and row.sync_share_pct is not None else ""
    numbers = [
        _num(row.step_ms, ".2f"),
        _num(row.samples_per_s, ".0f"),
        _num(row.sync_share_pct, ".1f") + dagger,
        _num(row.train_loss, ".4f"),
        _num(row.eval_accuracy, ".3f"),
        _rank(row.slowest),
        _rank(row.fastest),
    ]
    if row.status != "ok":
        numbers = [f"({n})" if n else n for n in numbers]
    return [row.job, row.status, row.overrides, row.sync, _num(row.bucket_cap_mb, "g"), *numbers]


def format_table(rows: Sequence[JobRow]) -> str:
    cells = [list(HEADERS), *(table_cells(row) for row in rows)]
    widths = [max(len(line[i]) for line in cells) for i in range(len(HEADERS))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=False)).rstrip() for line in cells)


def format_markdown(rows: Sequence[JobRow], title: str, image: str) -> str:
    lines = [f"# {title}", "", "| " + " | ".join(HEADERS) + " |", "|" + "---|" * len(HEADERS)]
    lines += ["| " + " | ".join(c.replace("|", "\\|") for c in table_cells(row)) + " |" for row in rows]
    return "\n".join([*lines, "", "## Legend", "", LEGEND, "", f"![{title}]({image})", ""])


def csv_records(rows: Sequence[JobRow]) -> list[dict[str, Any]]:
    """Plain numbers (None when missing) plus every rank's median step time, for spreadsheets."""
    all_ranks = sorted({r.rank for row in rows for r in row.ranks})
    return [
        {
            "job": row.job,
            "status": row.status,
            "overrides": row.overrides,
            "sync": row.sync,
            "model": row.model,
            "bucket_cap_mb": row.bucket_cap_mb,
            "num_ranks": len(row.ranks),
            "step_ms": row.step_ms,
            "samples_per_s": row.samples_per_s,
            "sync_share_pct": row.sync_share_pct,
            "train_loss": row.train_loss,
            "eval_accuracy": row.eval_accuracy,
            "slowest_rank": row.slowest and row.slowest.rank,
            "fastest_rank": row.fastest and row.fastest.rank,
            "min_logged_rows": min((r.timed_steps for r in row.ranks), default=0),
            **{f"rank{k}_step_ms": next((r.step_ms for r in row.ranks if r.rank == k), None) for k in all_ranks},
        }
        for row in rows
    ]


def write_csv(rows: Sequence[JobRow], path: Path) -> None:
    records = csv_records(rows)
    with path.open("w", newline="", encoding="utf-8") as f:
        writer = csv.DictWriter(f, fieldnames=list(records[0]))
        writer.writeheader()
        writer.writerows({k: "" if v is None else v for k, v in rec.items()} for rec in records)


def _values(row: JobRow, field: str) -> list[float]:
    return [v for v in (getattr(r, field) for r in row.ranks) if v is not None]


def plot(rows: Sequence[JobRow], title: str) -> Figure:
    """Step time and throughput against bucket size (log x), or per job if no job has a bucket size."""
    done = [r for r in rows if r.status == "ok" and r.step_ms is not None and r.samples_per_s is not None]
    bucketed = sorted((r for r in done if r.bucket_cap_mb is not None), key=lambda r: r.bucket_cap_mb or 0.0)
    vary = [f for f in ("sync", "model") if len({getattr(r, f) for r in done}) > 1]
    series: dict[str, list[JobRow]] = {}
    for r in bucketed:
        series.setdefault(" ".join(getattr(r, f) for f in vary) or r.sync, []).append(r)
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
            for color, r in zip(colors[len(series) :], [r for r in done if r.bucket_cap_mb is None], strict=False):
                ax.axhline(getattr(r, field), ls="--", color=color, label=f"{r.sync} (job {r.job}, no buckets)")
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
            ax.set_xticks(range(len(done)), labels, fontsize=8)
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


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.report", description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a Hydra sweep dir (numbered job dirs) or one job dir")
    parser.add_argument("--out", type=Path, default=None, help="where report.md/.csv/.png go (default: dir)")
    args = parser.parse_args(argv)
    try:
        rows = build_rows(find_jobs(args.dir))
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = args.out or args.dir
    out.mkdir(parents=True, exist_ok=True)
    swept = len(rows) > 1 and any(r.bucket_cap_mb is not None for r in rows if r.status == "ok")
    kind = "DDP bucket size sweep:" if swept else "Job" if len(rows) == 1 else "Sweep"
    title = f"{kind} {args.dir.resolve().name}, {max(len(r.ranks) for r in rows)} ranks"
    print(f"{title}\n{format_table(rows)}")
    if any(0 < min((r.timed_steps for r in row.ranks), default=0) < 5 for row in rows):
        print("note: some ranks have fewer than 5 logged rows: their medians rest on few samples")
    (out / "report.md").write_text(format_markdown(rows, title, "report.png"), encoding="utf-8")
    write_csv(rows, out / "report.csv")
    plot(rows, title).savefig(out / "report.png", dpi=110)
    print(f"wrote {out / 'report.md'}, {out / 'report.csv'}, {out / 'report.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
