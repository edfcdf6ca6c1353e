"""Print what W&B offline runs hold (a run dir, or every job of a sweep dir) without uploading them.

    python -m trainer.tools.wandb_offline outputs/<run name>                 # a line per run: headline values
    python -m trainer.tools.wandb_offline outputs/<run name> --keys 'train/*,comm/bytes' --ranks 0
    python -m trainer.tools.wandb_offline outputs/<run name> --keys '*'      # every key of every run
    python -m trainer.tools.wandb_offline multirun/<run name> --all          # and W&B's own keys too
    python -m trainer.tools.wandb_offline outputs/<run name> --full          # every key, long values whole

By default one line per run: its name, rank, last step, rows, exit code and the last value of a
few headline metrics. With --keys (glob patterns, or prefixes when a pattern has no * ? [) each
run's last logged values and summary, the matching keys only; --all and --full show every key.
Nested values (the summary's model layout, sync description, rank record) print as dotted keys,
one per line; a long list shows its first items and its length.

The reading itself lives in trainer/logger/wandb_files.py, beside the logger that also uses it.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.logger.wandb_files import OfflineRun, find_job_runs
from trainer.windows import LAST_EVAL, LAST_ROW


def _patterns(text: str) -> list[str]:
    patterns = [p.strip() for p in text.split(",") if p.strip()]
    if not patterns:
        raise argparse.ArgumentTypeError(f"{text!r} names no key: give glob patterns or prefixes, comma-separated")
    return patterns


def _ranks(text: str) -> set[int]:
    try:
        return {int(r) for r in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a rank list: e.g. 0 or 0,1") from None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.tools.wandb_offline",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="\n".join(__doc__.splitlines()[2:8]),
    )
    parser.add_argument("path", type=Path, help="a run dir (holding wandb/) or a sweep dir (its jobs' run dirs)")
    parser.add_argument(
        "--keys",
        type=_patterns,
        metavar="PATTERNS",
        help="show these keys of each run (comma-separated globs, e.g. 'train/*,comm/bytes*', or prefixes); "
        "'*' for every key",
    )
    parser.add_argument("--ranks", type=_ranks, metavar="RANKS", help="only these ranks' runs, e.g. 0 or 0,1")
    parser.add_argument(
        "--all", action="store_true", help="every key, W&B's internal ones (starting with _) and metric definitions too"
    )
    parser.add_argument("--full", action="store_true", help=f"print long values whole (else cut to {WIDTH} characters)")
    return parser.parse_args(argv)


WIDTH = 100  # a value is cut to this many characters on screen; --full prints it whole
LIST_ITEMS = 6  # a list of numbers or words shows this many, then its length
# The default line per run: the last logged value of those of these a run has (classification or
# token data), in this order.
HEADLINE = (
    "train/loss",
    "train/accuracy",
    "eval/loss",
    "eval/accuracy",
    "throughput/samples_per_s",
    "throughput/tokens_per_s",
    "time/step_s",
)
RANK_NAME = re.compile(r"rank-(\d+)$")  # the W&B logger names each rank's run rank-N


def flattened(values: dict[str, Any], show_internal: bool, prefix: str = "") -> dict[str, Any]:
    """Nested dicts as dotted keys (model.parameter_bytes), leaving out W&B's own `_...` parts unless asked."""
    flat: dict[str, Any] = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if not show_internal and any(part.startswith("_") for part in name.split(".")):
            continue  # _step, _runtime, and an image's or table's profiler/timeline._type
        if isinstance(value, dict) and value:
            flat.update(flattened(value, show_internal, f"{name}."))
        else:
            flat[name] = value
    return flat


def matches(key: str, patterns: Sequence[str] | None) -> bool:
    """Whether --keys selects this (dotted) key: a glob matches it whole, a plain pattern is a prefix."""
    if patterns is None:
        return True
    return any(fnmatch.fnmatchcase(key, p) if any(c in p for c in "*?[") else key.startswith(p) for p in patterns)


def aligned(
    values: dict[str, Any],
    show_internal: bool,
    full: bool = False,
    indent: str = "    ",
    patterns: Sequence[str] | None = None,
) -> list[str]:
    """`key  value` lines, keys padded to one column, one line each however large the value."""
    flat = flattened(values, show_internal)
    keys = sorted(k for k in flat if matches(k, patterns))
    width = max((len(k) for k in keys), default=0)
    return [f"{indent}{key.ljust(width)}  {_show(flat[key], full)}" for key in keys]


def _show(value: Any, full: bool = False) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list) and not full and len(value) > LIST_ITEMS:
        if all(isinstance(v, dict) for v in value):  # a list of records: its length and their fields
            fields = sorted({k for v in value for k in v})
            return f"[{len(value)} items, each {{{', '.join(fields)}}}]"
        shown = ", ".join(_show(v) for v in value[:LIST_ITEMS])
        return _cut(f"[{shown}, ... {len(value)} items]")
    if isinstance(value, (dict, list)):
        text = json.dumps(value, sort_keys=True, default=str)
        return text if full else _cut(text)
    return str(value) if full else _cut(str(value))


def _cut(text: str) -> str:
    return text if len(text) <= WIDTH else f"{text[: WIDTH - 20]}... ({len(text)} chars; --full)"


def last_values(run: OfflineRun) -> dict[str, Any]:
    """Every key's last logged value (a row holds only the keys logged at its step)."""
    last: dict[str, Any] = {}
    for row in run.history:
        last.update(row)
    return last


def rank_of(run: OfflineRun) -> int | None:
    """The rank whose run this is, from its name (rank-N); None for another run (the report's)."""
    named = RANK_NAME.search(run.name)
    return int(named.group(1)) if named else None


def describe(
    run: OfflineRun, show_internal: bool, full: bool = False, patterns: Sequence[str] | None = None
) -> list[str]:
    """A run's header line, then its last logged values and summary (the keys `patterns` selects)."""
    last = last_values(run)
    lines = [
        f"{run.name or run.path.name}  group={run.group or '-'}  id={run.run_id}  "
        f"history_rows={len(run.history)}  exit_code={run.exit_code}  ({run.path})"
    ]
    sections = [("last logged values", last), ("summary", run.summary)]
    if show_internal:
        sections.append(("metric definitions", run.metrics))
    for title, values in sections:
        shown = aligned(values, show_internal, full and title != "metric definitions", patterns=patterns)
        lines += [f"  {title}:", *shown] if shown else []
    if len(lines) == 1:
        lines.append(f"  no key matches --keys {','.join(patterns or [])}")
    return lines


def headline_table(rows: list[tuple[str, OfflineRun]]) -> list[str]:
    """One line per run (its job first, for a sweep): name, rank, last step, rows, exit code, and
    the last value of each HEADLINE key some run has."""
    lasts = [last_values(run) for _, run in rows]
    keys = [k for k in HEADLINE if any(k in last for last in lasts)]
    jobs = any(job for job, _ in rows)
    header = [*(["job"] if jobs else []), "run", "rank", "step", "rows", "exit", *keys]
    table = [header]
    for (job, run), last in zip(rows, lasts, strict=True):
        rank, exit_code = rank_of(run), run.exit_code
        cells = [run.name or run.path.name, "-" if rank is None else str(rank)]
        cells += [str(last.get("step", last.get("_step", "-"))), str(len(run.history))]
        cells += ["-" if exit_code is None else str(exit_code)]
        values = [f"{last[k]:.4g}" if isinstance(last.get(k), float) else str(last.get(k, "")) for k in keys]
        table.append([*([job] if jobs else []), *cells, *values])
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]
    return ["  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in table]


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.path.exists():
        print(f"error: {args.path} does not exist", file=sys.stderr)
        return 2
    jobs = [(job, runs) for job, runs in find_job_runs(args.path, tail_ok=True) if runs]  # live runs too
    if not jobs:
        print(f"error: no W&B offline runs (wandb/offline-run-*) under {args.path} or its jobs", file=sys.stderr)
        return 1
    ranks = sorted({r for _, runs in jobs for r in map(rank_of, runs) if r is not None})
    if args.ranks is not None:
        jobs = [(job, [r for r in runs if rank_of(r) in args.ranks]) for job, runs in jobs]
        jobs = [(job, runs) for job, runs in jobs if runs]
        if not jobs:
            print(
                f"error: no run of rank {sorted(args.ranks)} under {args.path}: its ranks are {ranks}", file=sys.stderr
            )
            return 1
    try:
        if args.keys is None and not args.all and not args.full:
            sweep = len(jobs) > 1 or jobs[0][0] != args.path
            rows = [(job.name if sweep else "", run) for job, runs in jobs for run in runs]
            print("\n".join(headline_table(rows)))
            more = "--keys 'train/*,comm/bytes' (globs or prefixes), --ranks 0; every key: --keys '*'; W&B's too: --all"
            # The values' window (trainer/windows.py): the rank's own, where the end-of-run report means over ranks.
            print(f"{len(rows)} run(s). More: {more}. Values: each rank's {LAST_ROW} ({LAST_EVAL} for eval/*)")
            return 0
        for job, runs in jobs:
            if len(jobs) > 1 or job != args.path:
                print(f"== job {job}")
            for run in runs:
                print("\n".join(describe(run, args.all, args.full, args.keys)))
    except BrokenPipeError:  # `| head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's flush at exit must not fail
    return 0


if __name__ == "__main__":
    sys.exit(main())
