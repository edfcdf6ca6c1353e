"""overhead.py command: how long a bad command takes to be refused, plain torchrun against the
launcher and `make train`.

    python benchmarks/overhead.py command                 # 5 rounds, trainer.max_step=10 (a key typo)
    python benchmarks/overhead.py command --rounds 9 --args optim.lr=-1
    python benchmarks/overhead.py command --rounds 1 --commands torchrun,launch   # a smoke run

Each round runs the commands once, in an order that rotates every round, from the repo root;
reported: each command's median wall time with its interquartile range, its exit code, the lines it
printed, and its time as a ratio of the first command's (the ratio's spread from the per-round
ratios). Plain torchrun starts every rank, and each imports torch and composes the config before
refusing; the launcher (trainer/tools/launch.py) composes once, in one process, before any worker;
`make train` is the launcher behind make (the set-up check included).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from benchmarks.parts.rounds import iqr

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LABELS = {"torchrun": "torchrun train.py", "launch": "python -m trainer.tools.launch", "make": "make train"}


def commands(args: list[str]) -> dict[str, list[str]]:
    """Each way to start training, by its key in LABELS, with the bad overrides."""
    launch = ["--standalone", "--nproc_per_node=2", "train.py", *args]
    return {
        "torchrun": [str(BIN / "torchrun"), *launch],
        "launch": [str(BIN / "python"), "-m", "trainer.tools.launch", *launch],
        "make": ["make", "--no-print-directory", "train", f"ARGS={' '.join(args)}"],
    }


def run_once(cmd: list[str]) -> tuple[float, int, int]:
    """(seconds, exit code, lines printed) of one command, with make's own variables not inherited."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    return seconds, proc.returncode, len((proc.stdout + proc.stderr).splitlines())


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="overhead.py command", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--args", nargs="+", default=["trainer.max_step=10"], help="the bad overrides")
    parser.add_argument(
        "--commands", default=",".join(LABELS), help=f"a comma-separated subset of: {', '.join(LABELS)}, in order"
    )
    opts = parser.parse_args(argv)
    names = opts.commands.split(",")
    if unknown := [name for name in names if name not in LABELS]:
        parser.error(f"unknown command(s) {', '.join(unknown)}; choose from {', '.join(LABELS)}")
    cmds = commands(opts.args)
    times: dict[str, list[float]] = {name: [] for name in names}
    seen: dict[str, tuple[int, int]] = {}
    for r in range(opts.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds, code, lines = run_once(cmds[name])
            times[name].append(seconds)
            seen[name] = (code, lines)
    base = times[names[0]]
    print(f"bad command: {' '.join(opts.args)}   ({opts.rounds} rounds, interleaved; median [IQR])")
    print(f"| command | seconds [IQR] | exit | lines | / {LABELS[names[0]]} [IQR] |\n|---|---|---|---|---|")
    for name in names:
        low, high = iqr(times[name])
        ratios = [t / b for t, b in zip(times[name], base, strict=True)]
        rlow, rhigh = iqr(ratios)
        code, lines = seen[name]
        spread = f"{statistics.median(times[name]):.2f} [{low:.2f}–{high:.2f}]"
        ratio = f"{statistics.median(ratios):.2f} [{rlow:.2f}–{rhigh:.2f}]"
        print(f"| {LABELS[name]} | {spread} | {code} | {lines} | {ratio} |")
