"""Say which collective a failed run stopped in, which rank never came, and where each rank was.

    python -m trainer.tools.hang <run dir>

Reads the snapshots the ranks left in `<run dir>/hang/` when a collective failed (torch's Flight
Recorder and the lab's step and bucket records, trainer/reliability/flight.py) and the log file of
any rank that left none, and prints the lines the job printed as it failed (at most three).
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path
from typing import Any

from trainer.reliability.hang import explain


def snapshots(run_dir: Path) -> dict[int, dict[str, Any] | None]:
    """Every rank's snapshot by rank, None for a rank of the job that left none."""
    found: dict[int, dict[str, Any] | None] = {}
    for path in sorted((run_dir / "hang").glob("rank*.pkl")):
        # The lab's own files (dicts, lists, numbers and strings), written by the run's own ranks.
        dump = pickle.loads(path.read_bytes())
        found[int(dump["rank"])] = dump
    world = max((int(d["world_size"]) for d in found.values() if d is not None), default=0)
    return {rank: found.get(rank) for rank in range(world)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m trainer.tools.hang", description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="the run directory of a job that failed in a collective")
    args = parser.parse_args(argv)
    dumps = snapshots(args.run_dir)
    if not dumps:
        print(
            f"error: no snapshots in {args.run_dir / 'hang'}: the run did not fail in a collective, ran on one "
            "rank, or ran with trainer.flight_recorder=0",
            file=sys.stderr,
        )
        return 2
    for line in explain(dumps, len(dumps), logs=args.run_dir, dumps_dir=args.run_dir / "hang"):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
