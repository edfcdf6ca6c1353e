"""overhead.py pieces: what the framework adds to every step, piece by piece, in µs of host time.

    python benchmarks/overhead.py pieces                          # mlp-tiny on CPU, world size 1
    python benchmarks/overhead.py pieces --device cuda --model cnn

The step section compares whole steps, so on a sub-millisecond step its ratio carries the noise of
the machine (two identical trainers built side by side differ by tens of µs here). This section
times each piece of bookkeeping alone, on the objects train.py builds and on a real batch's loss
and logits, as the best of several repeats of many calls. Called back to back, each piece runs
warm; in the running loop a row costs more (the row section times it in place). On CUDA the times
are host time (what a launch-bound GPU step pays), with the device synchronised after each repeat.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.overhead_loops import MODELS, Framework
from trainer.reliability import fault as faults
from trainer.setup import dist as ddist


def host_us(call: Callable[[], object], device: torch.device, number: int, repeats: int = 5) -> float:
    """Best of `repeats` runs of `number` calls, µs per call."""
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(number):
            call()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - started)
    return best / number * 1e6


def measure(framework: Framework, number: int) -> list[tuple[str, float]]:
    """(piece, µs per step) for each piece of the framework's own work on the step path."""
    trainer = framework.trainer
    steps, window, timer, fault = trainer.runner, trainer._window, trainer._timer, trainer.settings.fault
    device, every = trainer.ctx.device, trainer.settings.log_every_n_steps
    inputs, targets = (t.to(device) for t in next(iter(trainer.train_loader)))
    logits = trainer.train_model(inputs)
    loss = F.cross_entropy(logits, targets)

    def add() -> None:  # a row resets the window; here the reference lists are emptied by hand
        window.add(loss, logits, targets, trainer.step)
        if len(window._losses) >= every:
            window.reset()

    def clocks() -> None:
        timer.start()
        for phase in ("data", "forward", "backward", "sync", "optimizer"):
            timer.mark(phase)
        timer.stop()
        if len(timer._collected) >= every:
            timer._collected = []

    def hooks() -> None:
        with trainer.step_boundary:
            faults.maybe_fire(fault, 0, trainer.step, 0, trainer.model)
            fault.poisons_loss(0, trainer.step, 0)

    def between_steps() -> None:  # an unlogged step's checks: nothing due
        trainer._after_step(None)

    def logged_row_us(rows: int) -> float:
        """µs of the row alone: each time, `every` steps fill the window and clocks untimed first."""
        best = float("inf")
        for _ in range(3):
            seconds = 0.0
            for _ in range(rows):
                for _ in range(every):
                    window.add(loss, logits, targets, trainer.step)
                    clocks()
                window.num_steps, trainer.step = every, every * 1000
                started = time.perf_counter()
                trainer._after_step(None)  # reads the window (the step's one host sync), writes the row
                seconds += time.perf_counter() - started
            best = min(best, seconds)
        return best / rows * 1e6

    trainer.step = every * 1000 + 1  # not due for anything: no row, evaluation or checkpoint
    pieces = [
        ("window.add (loss ref, argmax)", host_us(add, device, number)),
        ("phase clocks (start, 5 marks, stop)", host_us(clocks, device, number)),
        ("LR schedule step", host_us(steps.scheduler.step, device, number)),
        ("SIGTERM boundary + fault hooks", host_us(hooks, device, number)),
        ("between-step checks (nothing due)", host_us(between_steps, device, number)),
    ]
    pieces.append((f"a logged row, per step (1 in {every})", logged_row_us(max(1, number // every // 10)) / every))
    return pieces


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="overhead.py pieces", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="mlp-tiny", choices=sorted(MODELS))
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cpu", help="as trainer.device")
    parser.add_argument("--number", type=int, default=20000, help="calls per repeat")
    args = parser.parse_args(argv)
    env = ddist.read_launch_env()
    device = ddist.resolve_device(args.device, env)
    ctx = ddist.init_process_group(env, ddist.job_store(env), device, 600, "ddplab/overhead/pieces/")
    try:
        with tempfile.TemporaryDirectory() as tmp:
            framework = Framework(MODELS[args.model], "none", ctx, Path(tmp))
            framework.run(20)  # warm: the first steps allocate
            pieces = measure(framework, args.number)
        print(f"{args.model} on {device}, world size {ctx.world_size}: host µs per step, best of 5 x {args.number}")
        print("| piece | µs/step |\n|---|---|")
        for name, us in pieces:
            print(f"| {name} | {us:.1f} |")
        print(f"| **total** | **{sum(us for _, us in pieces):.1f}** |")
    finally:
        ddist.destroy_process_group()
