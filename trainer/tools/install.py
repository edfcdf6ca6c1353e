"""`pip install -e '.[dev]'` into the running interpreter's venv, its wheels unpacked by two pips at once.

    .venv/bin/python -m trainer.tools.install        # what `make setup` runs; pip's output on stdout

Why: pip unpacks and byte-compiles one wheel after another on one core, and the CUDA build of torch
brings 5.5 GB of them (torch, triton and the nvidia-* libraries), which is most of a new clone's set-up.
So pip resolves the project once (`--dry-run --report`: what it would install, nothing written),
the wheels are dealt to `--jobs` pips that install them with `--no-deps` side by side, and a last
plain `pip install -e '.[dev]'` installs the project itself and checks that every requirement is
met, as if it had done everything alone. Only pip and the standard library: it runs before anything
else is installed. What is already installed (TORCH=cpu's torch) is left as it is.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import unquote, urlparse

PROJECT = ".[dev]"


def pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def planned_wheels(report: dict) -> list[str]:
    """The wheels a report would install, as paths or URLs pip accepts; the project itself (a local
    directory, installed editable by the last pip) is left out."""
    wheels = []
    for item in report["install"]:
        url = item["download_info"]["url"]
        if "dir_info" in item["download_info"]:
            continue
        wheels.append(unquote(urlparse(url).path) if url.startswith("file://") else url)
    return wheels


def size(wheel: str) -> int:
    """A local wheel's bytes; a download counts as none (the big ones lie on disk or come alone)."""
    path = Path(wheel)
    return path.stat().st_size if path.is_file() else 0


def deal(wheels: list[str], jobs: int) -> list[list[str]]:
    """The wheels in `jobs` groups of about equal bytes: biggest first, each to the lightest group so
    far; downloads (no size known) in turn. Empty groups are left out."""
    groups: list[list[str]] = [[] for _ in range(jobs)]
    loads = [0] * jobs
    sized = sorted(((size(wheel), wheel) for wheel in wheels), reverse=True)
    for i, (nbytes, wheel) in enumerate(sized):
        k = loads.index(min(loads)) if nbytes else i % jobs
        groups[k].append(wheel)
        loads[k] += nbytes
    return [group for group in groups if group]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--jobs", type=int, default=2, help="pips unpacking wheels at once (default: 2)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs={args.jobs} is invalid: accepted: an integer >= 1")
    plan = subprocess.run(
        pip("install", "--dry-run", "--quiet", "--report", "-", "-e", PROJECT), capture_output=True, text=True
    )
    sys.stderr.write(plan.stderr)
    if plan.returncode != 0:
        return plan.returncode
    groups = deal(planned_wheels(json.loads(plan.stdout)), args.jobs)
    with tempfile.TemporaryDirectory() as tmp:
        procs = []
        for k, group in enumerate(groups):
            listed = Path(tmp) / f"wheels-{k}.txt"
            listed.write_text("".join(f"{wheel}\n" for wheel in group))
            procs.append(subprocess.Popen(pip("install", "--no-deps", "--requirement", str(listed))))
        codes = [proc.wait() for proc in procs]  # every pip ends before a failure is reported
    if any(codes):
        return 1
    return subprocess.run(pip("install", "-e", PROJECT)).returncode


if __name__ == "__main__":
    sys.exit(main())
