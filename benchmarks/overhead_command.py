"""How long a bad command takes to be refused: plain torchrun against the launcher and `make train`.

    python benchmarks/bad_command.py                 # 5 rounds, trainer.max_step=10 (a key typo)
    python benchmarks/bad_command.py --rounds 9 --args optim.lr=-1

Each round runs the three commands once, in an order that rotates every round, from the repo root;
reported: each command's median wall time with its interquartile range, its exit code, the lines it
printed, and its time as a ratio of plain torchrun's (the ratio's spread from the per-round
ratios). Plain torchrun starts every rank, and each imports torch and composes the config before
refusing; the launcher (trainer/tools/launch.py) composes once, in one process, before any worker.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # run as a script from anywhere

from benchmarks.overhead import iqr  # noqa: E402

BIN = Path(sys.executable).parent


def commands(args: list[str]) -> dict[str, list[str]]:
    return {
        "torchrun train.py": [str(BIN / "torchrun"), "--standalone", "--nproc_per_node=2", "train.py", *args],
        "python -m trainer.tools.launch": [
            str(BIN / "python"),
            "-m",
            "trainer.tools.launch",
            "--standalone",
            "--nproc_per_node=2",
            "train.py",
            *args,
        ],
        "make train": ["make", "--no-print-directory", "train", f"ARGS={' '.join(args)}"],
    }


def run_once(cmd: list[str]) -> tuple[float, int, int]:
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    env["OMP_NUM_THREADS"] = "1"
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - start
    return seconds, proc.returncode, len((proc.stdout + proc.stderr).splitlines())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--args", nargs="+", default=["trainer.max_step=10"], help="the bad overrides")
    opts = parser.parse_args()
    cmds = commands(opts.args)
    names = list(cmds)
    times: dict[str, list[float]] = {name: [] for name in names}
    seen: dict[str, tuple[int, int]] = {}
    for r in range(opts.rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            seconds, code, lines = run_once(cmds[name])
            times[name].append(seconds)
            seen[name] = (code, lines)
    base = times[names[0]]
    print(f"bad command: {' '.join(opts.args)}   ({opts.rounds} rounds, interleaved; median [IQR])")
    print(f"{'command':32} {'seconds':>20} {'exit':>5} {'lines':>6} {'vs torchrun':>22}")
    for name in names:
        low, high = iqr(times[name])
        ratios = [t / b for t, b in zip(times[name], base, strict=True)]
        rlow, rhigh = iqr(ratios)
        code, lines = seen[name]
        spread = f"{statistics.median(times[name]):.2f} [{low:.2f}-{high:.2f}]"
        ratio = f"{statistics.median(ratios):.2f} [{rlow:.2f}-{rhigh:.2f}]"
        print(f"{name:32} {spread:>20} {code:>5} {lines:>6} {ratio:>22}")


if __name__ == "__main__":
    main()
