"""How the benchmarks time what they compare: a job's seconds per step, and the spread over rounds.

Every benchmark here interleaves what it compares in rounds (the order reversed every other round),
so that a noisy machine slows each alike, and reports medians over rounds with the interquartile
range of the per-round values: a difference inside it is noise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch
import torch.distributed as dist


def timed(run: Callable[[int], object], steps: int, device: torch.device) -> float:
    """Seconds per step of the slowest rank for `steps` steps started together (a job is as fast as
    its slowest rank: the others wait for it at the next collective)."""
    dist.barrier()
    started = time.perf_counter()
    run(steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = torch.tensor([(time.perf_counter() - started) / steps], dtype=torch.float64, device=device)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return elapsed.item()


def iqr(values: list[float]) -> tuple[float, float]:
    """The interquartile range: a difference inside it is noise."""
    if len(values) < 2:
        return (values[0], values[0])
    q = statistics.quantiles(values, n=4)
    return (q[0], q[2])
