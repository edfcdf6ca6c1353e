"""overhead.py flight: what the hang report costs an unsampled step: torch's Flight Recorder and the
lab's two rings, on against off.

    python benchmarks/overhead.py flight              # mlp-tiny; manual (a call a tensor), bucketed, ddp, fsdp
    python benchmarks/overhead.py flight --rounds 3 --models mlp-tiny --strategies bucketed

torch reads TORCH_FR_BUFFER_SIZE once per process, so on and off cannot share one: each round launches
the step section (overhead_step.py) twice under torchrun, with the recorder (and so the lab's rings and
watcher, which come with it: trainer/reliability/flight.py) and without, in an order reversed every other
round, with sampling off (the cost of an unsampled step). Each launch times the framework against the
hand-written loop in the same process; a round's ratio is (framework / loop with the recorder) over
(framework / loop without), so that what differs between two launches (where the OS put them) cancels.
Reported: medians over rounds and their interquartile range. Before that, the recorder alone: an
all_reduce of 16 floats on one gloo rank, in a process with it and one without, alternately; after
it, the lab's own additions alone, in µs per call in this process: a step start noted, a launch noted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.parts.rounds import iqr
from trainer.reliability.flight import AUTO, ENV, Flight

REPO = Path(__file__).resolve().parents[2]
ENTRIES = str(AUTO)  # trainer.flight_recorder=auto on CPU


def launch(models: str, strategies: str, steps: int, entries: str, out: Path, warmup: int) -> list[dict[str, object]]:
    """One run of the step section (2 ranks), with the recorder at `entries` ("0": off); its rows."""
    env = {**os.environ, ENV: entries, "OMP_NUM_THREADS": "1"}
    cmd = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node=2"]
    cmd += [str(REPO / "benchmarks" / "overhead.py"), "step", "--models", models, "--strategies", strategies]
    cmd += ["--rounds", "3", "--steps", str(steps), "--warmup", str(warmup), "--json", str(out)]
    cmd += ["--set", "trainer.sample_every_n_steps=0"]
    subprocess.run(cmd, env=env, check=True, capture_output=True, cwd=REPO)
    rows: list[dict[str, object]] = json.loads(out.read_text())
    return rows


def collective_us(number: int = 3000) -> float:
    """µs per all_reduce of 16 floats on a one-rank gloo group in this process (best of 5 repeats):
    the recorder's own cost per collective, away from any peer's noise."""
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    tensor, best = torch.ones(16), float("inf")
    for _ in range(200):
        dist.all_reduce(tensor)
    for _ in range(5):
        started = time.perf_counter()
        for _ in range(number):
            dist.all_reduce(tensor)
        best = min(best, (time.perf_counter() - started) / number)
    dist.destroy_process_group()
    return best * 1e6


def one_collective(entries: str) -> float:
    """collective_us() in a fresh process with the recorder at `entries`."""
    env = {**os.environ, ENV: entries, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "benchmarks.parts.overhead_flight"]  # its __main__: collective_us()
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True, cwd=REPO)
    return float(done.stdout.split()[-1])


def rings_us(number: int = 200_000) -> tuple[float, float]:
    """µs per call of the lab's additions: a step start noted, a launch noted (as Comm does)."""
    flight = Flight(None, 0, 1, Path("."), 2000)
    tensor, launches = torch.ones(4), deque(maxlen=2000)
    best_step = best_launch = float("inf")
    for _ in range(5):
        started = time.perf_counter()
        for i in range(number):
            flight.step_started(i)
        best_step = min(best_step, (time.perf_counter() - started) / number)
        started = time.perf_counter()
        for _ in range(number):
            launches.append((time.time_ns(), "all_reduce", tensor.numel(), 0, None))
        best_launch = min(best_launch, (time.perf_counter() - started) / number)
    return best_step * 1e6, best_launch * 1e6


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="overhead.py flight", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per inner round of a launch")
    parser.add_argument("--models", default="mlp-tiny")
    parser.add_argument("--strategies", default="manual:coalesce_mb=0,bucketed,ddp,fsdp")
    parser.add_argument("--warmup", type=int, default=10, help="the step section's warm-up steps")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 1 round of 3 steps, bucketed")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.steps, args.warmup, args.strategies = 1, 3, 1, "bucketed"
    per_call: dict[str, list[float]] = {ENTRIES: [], "0": []}
    for r in range(2 * args.rounds):
        for entries in (ENTRIES, "0") if r % 2 == 0 else ("0", ENTRIES):
            per_call[entries].append(one_collective(entries))
    extra = [on - off for on, off in zip(per_call[ENTRIES], per_call["0"], strict=True)]
    low, high = iqr(extra)
    print(
        f"one all_reduce of 16 floats, 1 gloo rank, {2 * args.rounds} rounds of a process each: "
        f"{statistics.median(per_call['0']):.1f} µs off, {statistics.median(per_call[ENTRIES]):.1f} µs on, "
        f"the recorder's µs per collective {statistics.median(extra):+.2f} [{low:+.2f}–{high:+.2f}]\n"
    )
    ratios: dict[tuple[str, str], list[float]] = {}
    ms: dict[tuple[str, str, str], list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for entries in (ENTRIES, "0") if r % 2 == 0 else ("0", ENTRIES):
                out = Path(tmp) / f"{entries}.json"
                rows = launch(args.models, args.strategies, args.steps, entries, out, args.warmup)
                for row in rows:
                    key = (str(row["model"]), str(row["sync"]))
                    ms.setdefault((*key, entries), []).append(float(str(row["framework_ms"])))
                    ms.setdefault((*key, entries + "/loop"), []).append(float(str(row["ratio"])))
            for key in {(m, s) for m, s, _ in ms}:
                on, off = ms[(*key, ENTRIES + "/loop")][-1], ms[(*key, "0/loop")][-1]
                ratios.setdefault(key, []).append(on / off)
    print(f"2 ranks on CPU, gloo; {args.rounds} rounds, each a launch with the recorder ({ENTRIES}) and one without")
    print("| model | sync | ms/step off | ms/step on | on / off [IQR] |\n|---|---|---|---|---|")
    for model, sync in sorted(ratios):
        low, high = iqr(ratios[(model, sync)])
        off, on = statistics.median(ms[(model, sync, "0")]), statistics.median(ms[(model, sync, ENTRIES)])
        print(
            f"| {model} | {sync} | {off:.3f} | {on:.3f} | {statistics.median(ratios[(model, sync)]):.3f} "
            f"[{low:.3f}–{high:.3f}] |"
        )
    step_us, launch_us = rings_us()
    print(f"\nthe lab's rings alone: a step start {step_us:.3f} µs, a launch {launch_us:.3f} µs (best of 5)")


if __name__ == "__main__":  # one_collective()'s process
    print(collective_us())
