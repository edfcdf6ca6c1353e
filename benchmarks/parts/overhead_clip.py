"""overhead.py clip: what trainer.max_grad_norm costs per step, for every strategy: the framework
with and without the clip, side by side in one run.

    torchrun --nproc_per_node=2 benchmarks/overhead.py clip                  # mlp-tiny and gpt, 7 strategies
    torchrun --nproc_per_node=2 benchmarks/overhead.py clip --models gpt --rounds 5 --steps 10

Each round times both trainers (the order reversed every other round) for the same number of steps
after a barrier, the slower rank's time; reported: the median of the per-round differences in µs
per step, with their interquartile range, and the ratio. With the clip every step computes the
global norm (sharded strategies: one all_reduce of a scalar) and scales the gradients; without it,
only sampled steps compute the norm (for train/grad_norm).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path

import torch

from benchmarks.parts.overhead_loops import MODELS, Framework
from benchmarks.parts.rounds import iqr, timed
from trainer.setup import dist as ddist

STRATEGIES = ("manual", "bucketed", "ddp", "zero:stage=1", "zero", "zero:stage=3", "fsdp")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="overhead.py clip", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp-tiny,gpt")
    parser.add_argument("--strategies", default=",".join(STRATEGIES))
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=0, help="per round (default: 200 on mlp-tiny, 20 otherwise)")
    args = parser.parse_args(argv)
    env = ddist.read_launch_env()
    ctx = ddist.init_process_group(env, ddist.job_store(env), torch.device("cpu"), 600, "ddplab/overhead/clip/")
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            for model in args.models.split(","):
                steps = args.steps or (200 if model == "mlp-tiny" else 20)
                for strategy in args.strategies.split(","):
                    out = Path(tmp) / f"{model}-{strategy.replace(':', '-')}"
                    plain = Framework(MODELS[model], strategy, ctx, out / "plain")
                    clipped = Framework(MODELS[model], strategy, ctx, out / "clip", ["trainer.max_grad_norm=1.0"])
                    pair = [plain, clipped]
                    for impl in pair:
                        impl.run(5)
                    times: dict[int, list[float]] = {0: [], 1: []}
                    for round_ in range(args.rounds):
                        for index in (0, 1) if round_ % 2 == 0 else (1, 0):
                            times[index].append(timed(pair[index].run, steps, ctx.device))
                    extra = [(c - p) * 1e6 for p, c in zip(times[0], times[1], strict=True)]
                    ratio = [c / p for p, c in zip(times[0], times[1], strict=True)]
                    rows.append(
                        (
                            model,
                            strategy,
                            statistics.median(times[0]) * 1e3,
                            statistics.median(extra),
                            iqr(extra),
                            statistics.median(ratio),
                            iqr(ratio),
                        )
                    )
        if ctx.is_main_process:
            print(f"{ctx.world_size} ranks, gloo on cpu, {args.rounds} rounds; the slower rank's time")
            print("| model | sync | ms/step without the clip | extra µs/step with it [IQR] | with / without [IQR] |")
            print("|---|---|---|---|---|")
            for model, strategy, ms, us, us_iqr, r, r_iqr in rows:
                print(
                    f"| {model} | {strategy} | {ms:.2f} | {us:.0f} [{us_iqr[0]:.0f}–{us_iqr[1]:.0f}] "
                    f"| {r:.3f} [{r_iqr[0]:.2f}–{r_iqr[1]:.2f}] |"
                )
    finally:
        ddist.destroy_process_group()
