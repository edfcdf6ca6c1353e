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

from benchmarks.parts.overhead_loops import MODELS, Framework
from trainer.measures import PHASES
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
    """(piece, µs per step) for each piece of the framework's own work on the step path: first an
    unsampled step's (what every step but 1 in trainer.sample_every_n_steps pays), then the sampled
    step's and the row's extra, spread over the steps between rows."""
    trainer = framework.trainer
    steps, window, observer, fault = trainer.runner, trainer._window, trainer.observer, trainer.settings.fault
    device, every = trainer.ctx.device, trainer.settings.log_every_n_steps
    inputs, targets = (t.to(device) for t in next(iter(trainer.train_loader)))
    logits = trainer.train_model(inputs)
    loss = F.cross_entropy(logits, targets)
    comm, tensor = trainer.sync.comm, torch.zeros(1, device=device)
    unsampled = every * 1000 + 1  # (step + 1) % every != 0: not sampled, not due for anything

    def add() -> None:  # a row resets the window; here the reference lists are emptied by hand
        window.add(loss, unsampled, targets)
        if len(window._losses) >= every:
            window.reset()

    def reports() -> None:  # the step's reports to the observer on an unsampled step
        observer.begin_step(unsampled)
        for phase in PHASES:
            observer.mark(phase)
        observer.end_step()

    def launch() -> None:  # the communication object around a collective, unsampled (the collective a no-op)
        comm._launch("all_reduce", tensor, 0, None, _no_collective, tensor)

    def sixteen_bits() -> None:  # trainer.param_dtype's calls on the step, with fp32 parameters: nothing to do
        masters = trainer.sync.masters
        masters.take_grads()
        masters.refresh()
        masters.zero_grad()
        comm._wire(tensor)  # once per reduction

    def hooks() -> None:
        with trainer.step_boundary:
            faults.maybe_fire(fault, 0, trainer.step, 0, trainer.model)
            fault.poisons_loss(0, trainer.step, 0)

    def between_steps() -> None:  # an unlogged step's checks: nothing due
        trainer._after_step(None)

    def sampled_and_row_us(rows: int) -> tuple[float, float]:
        """µs of a sampled step's observing (its marks, probes and collectives' records: here its
        reports alone, with the memory probe) and of the row itself: `every` steps fill the window."""
        best_sampled, best_row = float("inf"), float("inf")
        for _ in range(3):
            sampled_s = row_s = 0.0
            for _ in range(rows):
                for _ in range(every):
                    window.add(loss, every * 1000 - 1, targets, logits)
                started = time.perf_counter()
                observer.begin_step(every * 1000 - 1)  # the step before the row: sampled
                for phase in PHASES:
                    observer.mark(phase)
                observer.end_step()
                sampled_s += time.perf_counter() - started
                window.num_steps, trainer.step = every, every * 1000
                started = time.perf_counter()
                trainer._after_step(None)  # reads the window (the step's one host sync), writes the row
                row_s += time.perf_counter() - started
            best_sampled, best_row = min(best_sampled, sampled_s), min(best_row, row_s)
        return best_sampled / rows * 1e6, best_row / rows * 1e6

    trainer.step = unsampled
    pieces = [
        ("window.add (a loss reference)", host_us(add, device, number)),
        ("observer reports (begin, 5 marks, end), unsampled", host_us(reports, device, number)),
        ("the communication object, per collective, unsampled", host_us(launch, device, number)),
        ("LR schedule step", host_us(steps.scheduler.step, device, number)),
        ("SIGTERM boundary + fault hooks", host_us(hooks, device, number)),
        ("between-step checks (nothing due)", host_us(between_steps, device, number)),
        ("sync.after_step (no tuner)", host_us(trainer.sync.after_step, device, number)),
        ("16-bit parameters' calls (fp32 here: none to copy)", host_us(sixteen_bits, device, number)),
    ]
    sampled_us, row_us = sampled_and_row_us(max(1, number // every // 10))
    pieces.append((f"the sampled step's observing, per step (1 in {every})", sampled_us / every))
    pieces.append((f"a logged row, per step (1 in {every})", row_us / every))
    return pieces


def _no_collective(*args: object, **kwargs: object) -> None:
    """Stands in for a torch collective: what is left is the communication object's own work."""


UNSAMPLED = 8  # the first pieces: what an unsampled step pays


def _us(us: float) -> str:
    """Two decimals below 1 µs: a call that costs tens of nanoseconds printed as 0.0 reads as free."""
    return f"{us:.2f}" if us < 1 else f"{us:.1f}"


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
        for name, us in pieces[:UNSAMPLED]:
            print(f"| {name} | {_us(us)} |")
        print(f"| **an unsampled step** | **{sum(us for _, us in pieces[:UNSAMPLED]):.1f}** |")
        for name, us in pieces[UNSAMPLED:]:
            print(f"| {name} | {_us(us)} |")
        print(f"| **total, per step** | **{sum(us for _, us in pieces):.1f}** |")
    finally:
        ddist.destroy_process_group()
