"""overhead.py sampled: what the observer's sampled step costs in place, phase by phase.

    torchrun --nproc_per_node=1 benchmarks/overhead.py sampled                 # none, ddp, zero, fsdp on mlp-tiny
    torchrun --nproc_per_node=1 benchmarks/overhead.py sampled --strategies ddp --steps 5000

The step section says how much slower the framework is than a hand-written loop; on a
sub-millisecond step the gap is the sampled step (1 in trainer.sample_every_n_steps, the one
before each row). This section says where it goes: one trainer runs as train.py runs it, and
every step's marks (the observer's begin, each phase's mark, its end) are clocked from outside;
each interval of a sampled step is set against the same interval of the unsampled steps (medians
over the run). An interval that ends in a mark holds the mark's own work (on the sampled step,
its memory probe); "begin" and "end" are the observer's own. The clocks add about a µs a mark to
either kind of step alike.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.parts.overhead_loops import MODELS, Framework
from trainer.setup import dist as ddist


def clock_marks(framework: Framework) -> list[tuple[str, int]]:
    """Wrap the observer's reports so each notes (label, ns) into the returned list as it runs."""
    observer, marks = framework.trainer.observer, []
    clock = time.perf_counter_ns
    begin, mark, end = observer.begin_step, observer.mark, observer.end_step

    def wrapped(label: Callable[..., str], report: Callable[..., None]) -> Callable[..., None]:
        def call(*args: object) -> None:
            marks.append((f"{label(*args)} (before)", clock()))
            report(*args)
            marks.append((label(*args), clock()))

        return call

    observer.begin_step = wrapped(lambda step: "begin", begin)  # type: ignore[method-assign]
    observer.mark = wrapped(lambda phase: phase, mark)  # type: ignore[method-assign]
    observer.end_step = wrapped(lambda: "end", end)  # type: ignore[method-assign]
    return marks


def measure(framework: Framework, steps: int) -> tuple[dict[str, list[float]], dict[str, list[float]], int]:
    """µs of each interval between the step's clocked reports, sampled steps and the others apart:
    a report's own work ("forward's mark": its memory probe on a sampled step) and each phase."""
    trainer = framework.trainer
    every = trainer.observer.every
    marks = clock_marks(framework)
    intervals: dict[bool, dict[str, list[float]]] = {True: {}, False: {}}
    for _ in range(steps):
        marks.clear()
        trainer.run_iteration()
        sampled = every > 0 and (trainer.step + 1) % every == 0
        for (a, at), (b, bt) in zip(marks, marks[1:], strict=False):
            if a.endswith(" (before)"):
                name = f"the {b} report" if b in ("begin", "end") else f"{b}'s mark"
            else:
                name = (
                    "between the last mark and the end"
                    if b == "end (before)"
                    else f"the {b[: -len(' (before)')]} phase"
                )
            intervals[sampled].setdefault(name, []).append((bt - at) / 1000)
    return intervals[True], intervals[False], every


def report(strategy: str, sampled: dict[str, list[float]], unsampled: dict[str, list[float]], every: int) -> None:
    print(f"| {strategy}: interval | unsampled µs | sampled µs | the sampled step's extra µs |")
    print("|---|---|---|---|")
    total = unsampled_step = 0.0
    for interval, times in sampled.items():
        if interval not in unsampled:
            continue
        u, s = statistics.median(unsampled[interval]), statistics.median(times)
        total += s - u
        unsampled_step += u
        print(f"| {interval} | {u:.1f} | {s:.1f} | {s - u:+.1f} |")
    share = total / every / unsampled_step if unsampled_step else 0.0
    print(f"| **the sampled step's extra** | {unsampled_step:.1f} | {unsampled_step + total:.1f} | **{total:+.0f}** |")
    print(f"\n{strategy}: the sampled step adds {total:.0f} µs; 1 step in {every}: {share:.1%} of an unsampled step\n")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="overhead.py sampled", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp-tiny", choices=sorted(MODELS))
    parser.add_argument("--strategies", default="none,ddp,zero,fsdp")
    parser.add_argument("--steps", type=int, default=3000, help="steps timed per strategy (after 100 of warm-up)")
    parser.add_argument("--quick", action="store_true", help="200 steps a strategy")
    args = parser.parse_args(argv)
    steps = 200 if args.quick else args.steps
    env = ddist.read_launch_env()
    ctx = ddist.init_process_group(env, ddist.job_store(env), ddist.resolve_device("cpu", env), 600, "ddplab/sampled/")
    try:
        print(f"{args.model} on cpu, world size {ctx.world_size}: medians over {steps} steps\n")
        with tempfile.TemporaryDirectory() as tmp:
            for strategy in args.strategies.split(","):
                where = Path(tmp) / strategy.replace(":", "-")
                # The sampled step taken apart: every candidate sampled (no budget).
                framework = Framework(MODELS[args.model], strategy, ctx, where, extra=["trainer.sample_budget=null"])
                framework.run(100)  # warm: the first steps allocate, DDP rebuilds its buckets
                sampled, unsampled, every = measure(framework, steps)
                if ctx.is_main_process:
                    report(strategy, sampled, unsampled, every)
    finally:
        ddist.destroy_process_group()
