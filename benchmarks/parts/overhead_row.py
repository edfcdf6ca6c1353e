"""overhead.py row: what a logged row costs the step, piece by piece, against the hand-written loop.

    torchrun --nproc_per_node=2 benchmarks/overhead.py row              # mlp-tiny, sync=none (~2 min here)
    torchrun --nproc_per_node=2 benchmarks/overhead.py row --sync ddp --rounds 21
    torchrun --nproc_per_node=2 benchmarks/overhead.py row --quick      # a smoke run

The step section compares whole steps; on a sub-millisecond step the framework's rows (one
every trainer.log_every_n_steps) are most of its gap. This section times, in the same rounds
(interleaved, the order reversed every other round, after a barrier), the framework as it runs,
the framework without one piece of its rows, and the hand-written loop with and without one
collective of the kind the row sends, so that each piece's cost reads as a difference measured
side by side:

- `framework`: as train.py builds it (a row every 10 steps).
- `no non-finite agreement`: the same, with trainer.on_nonfinite=raise's per-row all_gather (the
  ranks agree whether any saw a non-finite loss) taken out, by hand: the only collective of a row.
- `no rows`: trainer.log_every_n_steps past the run's end: the step path alone.
- `hand-written`: benchmarks/parts/overhead_loops.py's tutorial loop (the reference of the ratios).
- `hand-written + 1 collective / 10 steps`: that loop, launching a one-element all_gather every 10
  steps and waiting for it 10 steps later, as the row's agreement does.

A job's time per step is its slowest rank's; medians over rounds, each with the interquartile range
of its per-round ratio to the hand-written loop. "CPU µs/step" is the process's CPU time (every
thread: gloo's included) per step, the larger of the two ranks': what a collective costs the
cores besides the wait.

A second table takes one row apart where it runs: in the loop, every step timed alone and the
row's parts timed in place (each wrapped with a clock), the larger rank's median. A micro-benchmark
that calls the same code 20,000 times in a row (the pieces section) finds it warm; once every 10
steps it runs with the step's data in the caches instead, and so does the step after it.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from benchmarks.parts.overhead_loops import MODELS, Framework, HandWritten
from benchmarks.parts.rounds import iqr
from trainer.loop import step as step_module
from trainer.setup import dist as ddist

ROW_EVERY = 10  # the framework's default trainer.log_every_n_steps
EVERY_CANDIDATE = ["trainer.sample_budget=null"]  # every row's window holds a sampled step: no budget


def with_collective(loop: HandWritten) -> Callable[[int], None]:
    """The loop, plus one small async all_gather every ROW_EVERY steps, waited for at the next."""
    pending: list[dist.Work] = []

    def run(steps: int) -> None:
        for _ in range(steps // ROW_EVERY):
            loop.run(ROW_EVERY)
            mine = torch.tensor([-1], dtype=torch.int64)
            gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            work = dist.all_gather(gathered, mine, async_op=True)
            if pending:
                pending.pop().wait()
            pending.append(work)
        while pending:
            pending.pop().wait()

    return run


def variants(model: str, sync: str, ctx: ddist.DistContext, out: Path) -> dict[str, Callable[[int], None]]:
    overrides = MODELS[model]
    # Every row's window holds a sampled step here (no budget): the row and its sampled step are what is taken apart.
    every = EVERY_CANDIDATE
    framework = Framework(overrides, sync, ctx, out / "framework", extra=every)
    unchecked = Framework(overrides, sync, ctx, out / "unchecked", extra=every)
    checks = unchecked.trainer._nonfinite  # the agreement taken out: nothing sent, nothing waited for
    checks.at_row = lambda *_: []  # type: ignore[method-assign]
    checks.previous = lambda: None  # type: ignore[method-assign]
    rowless = Framework(overrides, sync, ctx, out / "rowless", extra=[*every, "trainer.log_every_n_steps=1000000000"])
    loop = HandWritten(overrides, sync, ctx)
    return {
        "framework": framework.run,
        "no non-finite agreement": unchecked.run,
        "no rows": rowless.run,
        "hand-written": loop.run,
        "hand-written + 1 collective / 10 steps": with_collective(loop),
    }


def row_parts(framework: Framework) -> list[tuple[str, Any, str]]:
    """The row's parts, timed where they run: (label, the object holding it, its attribute)."""
    trainer = framework.trainer
    return [
        (
            "the sampled step's gradient norm (train/grad_norm)",
            step_module,
            "grad_norm_later",
        ),  # a function the step calls
        ("the window's totals (its one host sync)", trainer._window, "totals"),
        ("the non-finite agreement (trainer.on_nonfinite=raise)", trainer._nonfinite, "at_row"),
        ("the row (TrainRows.log)", trainer._rows, "log"),
        ("  of which the observer's sampled step", trainer.observer, "take"),
        ("  of which the RSS", trainer._rows._rss, "bytes"),
        ("  of which the JSONL line", trainer._rows.loggers[0], "log"),
    ]


BETWEEN, LOGGED, AFTER = "a step between rows", "the logged step, its row included", "the step after a row"


def in_place(framework: Framework, steps: int) -> dict[str, float]:
    """Median µs of each step position in the row window, and of each row part, over `steps` steps."""
    trainer = framework.trainer
    parts: dict[str, list[float]] = {}
    originals = [(owner, name, getattr(owner, name)) for _, owner, name in row_parts(framework)]
    for label, owner, name in row_parts(framework):
        parts[label] = []
        setattr(owner, name, _clocked(getattr(owner, name), parts[label]))
    positions: dict[str, list[float]] = {BETWEEN: [], LOGGED: [], AFTER: []}
    trainer.train(trainer.step + 1)  # train()'s own set-up, once, outside the timed steps
    for _ in range(steps):
        started = time.perf_counter()
        trainer.run_iteration()
        elapsed = time.perf_counter() - started
        at = trainer.step % trainer.settings.log_every_n_steps
        positions[LOGGED if at == 0 else AFTER if at == 1 else BETWEEN].append(elapsed)
    for owner, name, original in originals:  # the step module's function is shared by every framework
        setattr(owner, name, original)
    return {label: statistics.median(times) * 1e6 for label, times in {**positions, **parts}.items() if times}


def _clocked(method: Callable[..., Any], into: list[float]) -> Callable[..., Any]:
    def clocked(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            into.append(time.perf_counter() - started)

    return clocked


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="overhead.py row", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp-tiny", choices=sorted(MODELS))
    parser.add_argument(
        "--sync", default="none", help="the framework's sync option (and the loop's, as the step section maps it)"
    )
    parser.add_argument("--rounds", type=int, default=13)
    parser.add_argument("--steps", type=int, default=300, help="timed steps per round and variant (a multiple of 10)")
    parser.add_argument("--quick", action="store_true", help="2 rounds of 20 steps")
    args = parser.parse_args(argv)
    rounds, steps = (2, 20) if args.quick else (args.rounds, args.steps)
    apart_steps = max(rounds * steps, 20 * ROW_EVERY)  # the second table's; --quick too: 20 rows at least
    env = ddist.read_launch_env()
    device = ddist.resolve_device("cpu", env)
    ctx = ddist.init_process_group(env, ddist.job_store(env), device, 600, "ddplab/overhead/row/")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            runs = variants(args.model, args.sync, ctx, Path(tmp))
            for run in runs.values():
                run(2 * ROW_EVERY)  # warm: the first steps allocate, DDP rebuilds its buckets
            wall: dict[str, list[float]] = {name: [] for name in runs}
            cpu: dict[str, list[float]] = {name: [] for name in runs}
            names = list(runs)
            for r in range(rounds):
                for name in names if r % 2 == 0 else names[::-1]:
                    dist.barrier()
                    cpu0, wall0 = time.process_time(), time.perf_counter()
                    runs[name](steps)
                    wall[name].append((time.perf_counter() - wall0) / steps)
                    cpu[name].append((time.process_time() - cpu0) / steps)
            apart = Framework(MODELS[args.model], args.sync, ctx, Path(tmp) / "apart", extra=EVERY_CANDIDATE)
            apart.run(2 * ROW_EVERY)
            dist.barrier()
            placed = in_place(apart, apart_steps)
        gathered: list[tuple[dict[str, list[float]], dict[str, list[float]]] | None] = [None] * ctx.world_size
        dist.all_gather_object(gathered, (wall, cpu))
        parts: list[dict[str, float] | None] = [None] * ctx.world_size
        dist.all_gather_object(parts, placed)
        if ctx.is_main_process:
            report(args, ctx.world_size, rounds, steps, [g for g in gathered if g is not None])
            report_parts(apart_steps, [p for p in parts if p is not None])
    finally:
        ddist.destroy_process_group()


def report(args: argparse.Namespace, world_size: int, rounds: int, steps: int, ranks: list) -> None:
    def slowest(which: int, name: str) -> list[float]:  # per round, the slowest rank's
        return [max(values) for values in zip(*(rank[which][name] for rank in ranks), strict=True)]

    loop = slowest(0, "hand-written")
    print(f"{args.model}, sync={args.sync}, {world_size} ranks, gloo on cpu, {rounds} rounds x {steps} steps")
    print("| variant | µs/step | / hand-written [IQR] | CPU µs/step |\n|---|---|---|---|")
    for name in ranks[0][0]:
        times = slowest(0, name)
        ratios = [t / h for t, h in zip(times, loop, strict=True)]
        low, high = iqr(ratios)
        cpu_us = statistics.median(slowest(1, name)) * 1e6
        spread = f"{statistics.median(ratios):.3f} [{low:.2f}–{high:.2f}]"
        print(f"| {name} | {statistics.median(times) * 1e6:.0f} | {spread} | {cpu_us:.0f} |")


def report_parts(steps: int, ranks: list[dict[str, float]]) -> None:
    """The second table: the larger rank's median of each, and what a row adds per step on average."""
    larger = {label: max(rank[label] for rank in ranks) for label in ranks[0]}
    per_step = (larger[LOGGED] + larger[AFTER] - 2 * larger[BETWEEN]) / ROW_EVERY
    print(f"\none row taken apart in the running loop ({steps} steps; the larger rank's median)")
    print("| in the loop | µs |\n|---|---|")
    for label, us in larger.items():
        print(f"| {label} | {us:.0f} |")
    print(f"| a row per step: the excess of the logged step and the next, / {ROW_EVERY} | {per_step:.0f} |")
