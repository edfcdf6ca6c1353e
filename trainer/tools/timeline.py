"""One timeline of every rank from a trainer.profile=true run: which collective ran when, against backward.

    python -m trainer.tools.timeline <run dir> [--steps 4-5] [--ranks 0,1] [--out DIR]

writes, in --out (default: the run dir):
    timeline.json          the ranks' traces merged on rank 0's clock, one process per rank, plus
                           the lab's collective spans (Perfetto: ui.perfetto.dev, or chrome://tracing)
    timeline.png           per rank a compute lane (each phase named: data, fwd, bwd, sync, opt) and
                           a communication lane (each collective lettered, its wait for the backend
                           hatched as queued), backward shaded; under it a key of the letters'
                           collectives with their sizes in bytes (KiB, MiB)
    timeline_summary.json  per rank "overlap": HTA's communication-computation overlap (the share of
                           communication time under computation); per step the straggler gap
and prints one line. Bad input: one line on stderr, exit code 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from trainer.logger.timeline import TimelineError, percent, write_timeline
from trainer.tools.jobs import job_dirs


def one_line(summary: dict[str, Any], out: Path) -> str:
    overlaps = " ".join(f"rank{r} {percent(v['overlap'])}" for r, v in summary["ranks"].items())
    gaps = [s["straggler_gap_ms"] for s in summary["per_step"].values()]
    gap = f"{max(gaps):.2f} ms" if gaps else "n/a"
    clock = max(v["clock_uncertainty_us"] for v in summary["ranks"].values())
    steps = summary["steps"]
    return (
        f"timeline: steps {steps[0]}-{steps[-1]}, HTA overlap {overlaps}, straggler gap max {gap}, "
        f"clocks aligned within ±{clock:.0f} µs -> {out / 'timeline.png'}"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.timeline", description=__doc__.split("\n")[0])
    parser.add_argument(
        "run_dir", type=Path, help="a run dir of a trainer.profile=true run, or a sweep dir (each job in turn)"
    )
    parser.add_argument("--steps", help="training steps to show, e.g. 4 or 3-5 (default: every profiled step)")
    parser.add_argument("--ranks", help="ranks to show, e.g. 0,1 (default: all)")
    parser.add_argument("--out", type=Path, help="where to write (default: the run dir)")
    args = parser.parse_args(argv)
    jobs = job_dirs(args.run_dir, "profiler") or [args.run_dir]  # no traces anywhere: the run dir says why
    for job in jobs:
        out = (args.out / job.name if len(jobs) > 1 else args.out) if args.out else job
        try:
            summary = write_timeline(job, out, args.steps, args.ranks)
        except TimelineError as err:
            print(f"timeline: {err}", file=sys.stderr)
            return 2
        print(one_line(summary, out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
