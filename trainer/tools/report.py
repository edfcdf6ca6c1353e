"""Sweep report: one row per job of a Hydra multirun (or one job dir), as a table, CSV and plot.

    python -m trainer.tools.report <sweep dir | job dir> [--out DIR]     (writes report.md/.csv/.png)
    python -m trainer.tools.report <dir> --wandb [--wandb-mode offline|online|disabled]
        (also logs the table and the figure as a W&B run "report", grouped under the sweep's name)

Read only from the files a job leaves behind (metrics/rank{r}.jsonl, .hydra/, summary.json), so it
works on finished, failed and copied runs alike. What it prints fits a 100-column terminal (the
columns a reader compares); report.md and report.csv hold every column. This module is the entry
point and the reading of those files; the numbers and their definitions (report.md's legend) are
in report_rows.py, the printed tables, report.md and CSV in report_table.py, the figure in
report_plot.py, the W&B run in report_wandb.py.
"""

from __future__ import annotations

import argparse
import json
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from trainer.logger.timeline_trace import TimelineError
from trainer.tools.report_layout import tie_sentences
from trainer.tools.report_plot import plot
from trainer.tools.report_points import Point, gather_points, spread_sentences
from trainer.tools.report_rows import Job, JobRow, build_rows, job_names, profiled_sentences, rate_sentence
from trainer.tools.report_screen import SCREEN_WIDTH, screen_points, screen_table
from trainer.tools.report_table import WINDOWS_NOTE, format_markdown, notes_under_table, write_csv
from trainer.tools.report_timelines import plot_timelines
from trainer.tools.report_wandb import MODES, log_report  # wandb itself is imported only by log_report


class ReportError(Exception):
    """A problem with the input dir: printed as one line, exit code 2."""


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
    if not root.exists():
        raise ReportError(f"{root} does not exist")
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


def _job_dir(root: Path, job: Job) -> Path:
    return root if (root / "metrics").is_dir() else root / job.name


def notes(rows: Sequence[JobRow], points: Sequence[Point]) -> list[str]:
    """The caps that built the same buckets, what the repeats allow one to say, then why a number is not
    what a reader would work out or see elsewhere: profiled rows left out, samples/s against step ms."""
    rate = rate_sentence(rows)
    spread = spread_sentences(points) if len(points) > 1 else []
    late = [f"job {row.job}: {row.straggler}" for row in rows if row.straggler]  # who the others waited for
    return [*tie_sentences(rows), *spread, *profiled_sentences(rows), *([rate] if rate else []), *late]


def link_sentences(rows: Sequence[JobRow]) -> tuple[str, list[str]]:
    """The emulated link the numbers are for (network=<preset>): for the title when every job ran on the
    same one, else a line per link naming its jobs; ("", []) when no job emulated a link."""
    links: dict[str, list[str]] = {}
    for row in rows:
        links.setdefault(row.link, []).append(row.job)
    if set(links) == {""}:
        return "", []
    if len(links) == 1:
        return f", emulated link {next(iter(links))}", []
    return "", [
        f"{job_names(jobs)}: " + (f"emulated link {link}" if link else "no emulated link")
        for link, jobs in links.items()
    ]


def predict_memory(rows: Sequence[JobRow], jobs: Sequence[Job]) -> list[str]:
    """Each job's predicted total per rank, from its own overrides at its number of ranks (the memory
    predictor composes train.py's config: imported here only); a line for each job it refused."""
    from trainer.errors import ConfigError
    from trainer.tools.memory import predicted_total_mb

    refused = []
    for row, job in zip(rows, jobs, strict=True):
        try:
            row.predicted_memory_mb = predicted_total_mb(job.overrides, max(1, len(row.ranks)))
        except ConfigError as err:
            refused.append(f"note: job {job.name}: no memory prediction: {' '.join(str(err).split())}")
    return refused


def say(text: str) -> None:
    """Print a sentence in the terminal's width, continued lines indented (report.md keeps it on one line)."""
    lines = textwrap.wrap(text, SCREEN_WIDTH, subsequent_indent="  ", break_long_words=False, break_on_hyphens=False)
    print("\n".join(lines))


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.report", description=__doc__.splitlines()[0])
    parser.add_argument("dir", type=Path, help="a Hydra sweep dir (numbered job dirs) or one job dir")
    parser.add_argument("--out", type=Path, default=None, help="where report.md/.csv/.png go (default: dir)")
    parser.add_argument("--wandb", action="store_true", help="also log the table and figure as a W&B run")
    parser.add_argument(
        "--wandb-mode", choices=MODES, default="offline", help="offline runs land in <out>/wandb (default: offline)"
    )
    parser.add_argument(
        "--memory", action="store_true", help="predicted MB/rank beside mem MB/rank (python -m trainer.tools.memory)"
    )
    parser.add_argument(
        "--timelines", action="store_true", help="also timelines.png: every job's timeline (trainer.profile=true)"
    )
    args = parser.parse_args(argv)
    try:
        jobs = find_jobs(args.dir)
        rows = build_rows(jobs)
    except ReportError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    out = args.out or args.dir
    out.mkdir(parents=True, exist_ok=True)
    unpredicted = predict_memory(rows, jobs) if args.memory else []
    if args.timelines:
        table_ms = [r.step_ms if r.profiled_rows else None for r in rows]  # the table's, profiled rows left out
        try:
            shared = set.intersection(*(set(j.overrides) for j in jobs))  # said once, not per job
            label = "job {}: {}".format
            dirs = [
                (label(j.name, " ".join(o for o in j.overrides if o not in shared)), _job_dir(args.dir, j))
                for j in jobs
            ]
            for line in plot_timelines(dirs, out, table_ms):
                say(line)
        except TimelineError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2
        print(f"wrote {out / 'timelines.png'}")
    done = [r for r in rows if r.status == "ok"]
    if len({r.bucket_cap_mb for r in done if r.bucket_cap_mb is not None}) > 1:
        kind = (
            "DDP bucket size sweep:"
            if {r.sync for r in done if r.bucket_cap_mb is not None} == {"ddp"}
            else "Bucket size sweep:"
        )
    elif len({r.sync for r in rows}) > 1:
        kind = "Strategy sweep:"
    else:
        kind = "Job" if len(rows) == 1 else "Sweep"
    link, links = link_sentences(rows)
    title = f"{kind} {args.dir.resolve().name}, {max(len(r.ranks) for r in rows)} ranks{link}"
    points = gather_points(rows)
    repeated = [p for p in points if len(p.jobs) > 1]
    said = notes(rows, points)
    table = screen_table(rows)
    say(title)
    print(table)
    for line in [*notes_under_table(table), *links]:
        say(line)
    if repeated:
        print(f"\nPoints (median over repeats, spread = min-max of the jobs' medians):\n{screen_points(points)}")
    for line in [*said, *unpredicted]:
        say(line)
    if any(0 < min((r.timed_steps for r in row.ranks), default=0) < 5 for row in rows):
        say("note: some ranks have fewer than 5 logged rows: their medians rest on few samples")
    markdown = format_markdown(rows, title, "report.png", points if repeated else (), [*links, *said])
    (out / "report.md").write_text(markdown, encoding="utf-8")
    write_csv(rows, out / "report.csv")
    plot(rows, "\n".join([title, *links]), points).savefig(out / "report.png", dpi=110)
    if args.wandb:
        sweep = args.dir.resolve().name
        where = log_report(
            rows, jobs, sweep=sweep, image=out / "report.png", out=out, mode=args.wandb_mode, title=title
        )
        print(f"W&B run 'report' (group {sweep}, {args.wandb_mode}): {where}")
    # Last, where a reader looks for what the screen left out: the short headers' windows, the full tables.
    say(WINDOWS_NOTE)
    print(f"full tables (every column): report.md and report.csv in {out}; plot: report.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
