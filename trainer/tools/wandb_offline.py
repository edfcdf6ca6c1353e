"""Print what W&B offline runs hold (a run dir, or every job of a sweep dir) without uploading them.

    python -m trainer.tools.wandb_offline outputs/<run name>
    python -m trainer.tools.wandb_offline multirun/<run name> --all     # W&B's own keys too
    python -m trainer.tools.wandb_offline outputs/<run name> --full     # long values whole, not cut

Nested values (the summary's model layout, sync description, rank record) print as dotted keys,
one per line; a long list shows its first items and its length.

The reading itself lives in trainer/logger/wandb_files.py, beside the logger that also uses it.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.logger.wandb_files import OfflineRun, find_job_runs


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.wandb_offline", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a run dir (holding wandb/) or a sweep dir (its jobs' run dirs)")
    parser.add_argument("--all", action="store_true", help="also show W&B's internal keys (those starting with _)")
    parser.add_argument("--full", action="store_true", help=f"print long values whole (else cut to {WIDTH} characters)")
    return parser.parse_args(argv)


WIDTH = 100  # a value is cut to this many characters on screen; --full prints it whole
LIST_ITEMS = 6  # a list of numbers or words shows this many, then its length


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


def aligned(values: dict[str, Any], show_internal: bool, full: bool = False, indent: str = "    ") -> list[str]:
    """`key  value` lines, keys padded to one column, one line each however large the value."""
    flat = flattened(values, show_internal)
    keys = sorted(flat)
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


def describe(run: OfflineRun, show_internal: bool, full: bool = False) -> list[str]:
    last: dict[str, Any] = {}
    for row in run.history:
        last.update(row)
    lines = [
        f"{run.name or run.path.name}  group={run.group or '-'}  id={run.run_id}  "
        f"history_rows={len(run.history)}  exit_code={run.exit_code}  ({run.path})",
        "  last logged values:",
        *aligned(last, show_internal, full),
        "  summary:",
        *aligned(run.summary, show_internal, full),
    ]
    if run.metrics and show_internal:
        lines += ["  metric definitions:", *aligned(run.metrics, show_internal)]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not args.path.exists():
        print(f"error: {args.path} does not exist", file=sys.stderr)
        return 2
    jobs = [(job, runs) for job, runs in find_job_runs(args.path, tail_ok=True) if runs]  # live runs too
    if not jobs:
        print(f"error: no W&B offline runs (wandb/offline-run-*) under {args.path} or its jobs", file=sys.stderr)
        return 1
    for job, runs in jobs:
        if len(jobs) > 1 or job != args.path:
            print(f"== job {job}")
        for run in runs:
            print("\n".join(describe(run, args.all, args.full)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
