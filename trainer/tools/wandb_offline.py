"""Print what W&B offline runs hold (a run dir, or every job of a sweep dir) without uploading them.

    python -m trainer.tools.wandb_offline outputs/<run name>
    python -m trainer.tools.wandb_offline multirun/<run name> --all     # W&B's own keys too

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
    return parser.parse_args(argv)


def aligned(values: dict[str, Any], show_internal: bool, indent: str = "    ") -> list[str]:
    """`key  value` lines, keys padded to one column; W&B's own `_...` keys only when asked for."""
    keys = sorted(k for k in values if show_internal or not k.startswith("_"))
    width = max((len(k) for k in keys), default=0)
    return [f"{indent}{key.ljust(width)}  {_show(values[key])}" for key in keys]


def _show(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, sort_keys=True, default=str)
    return str(value)


def describe(run: OfflineRun, show_internal: bool) -> list[str]:
    last: dict[str, Any] = {}
    for row in run.history:
        last.update(row)
    lines = [
        f"{run.name or run.path.name}  group={run.group or '-'}  id={run.run_id}  "
        f"history_rows={len(run.history)}  exit_code={run.exit_code}  ({run.path})",
        "  last logged values:",
        *aligned(last, show_internal),
        "  summary:",
        *aligned(run.summary, show_internal),
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
            print("\n".join(describe(run, args.all)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
