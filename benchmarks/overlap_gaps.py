"""What two of zero's waits cost, measured on an emulated link: the most a finer wait could win back.

    python benchmarks/overlap_gaps.py            # 7 rounds (~1 min)
    python benchmarks/overlap_gaps.py --quick    # a smoke run

Both waits keep the strategy correct and are kept on purpose (docs/performance.md, "Two waits in
zero"); this script says what they cost, so the choice is a measured one:

- zero stages 1 and 2 launch the post-step all_gathers first layers first, but the forward waits for
  all of them in one pre-hook on the model before its first layer runs. A per-bucket wait could
  start the forward once the first bucket is in; it can hide at most the smaller of the wait and
  the forward's own compute.
- zero stage 3 reduces one unit at a time: before unit u's reduce_scatter starts, backward waits
  for the one of the unit before it (so gradient memory stays about two units'; FSDP2 keeps one
  in flight too). More in flight could hide at most the time backward spent in those waits.

Two gloo ranks train an MLP of 8 square layers (~1 MiB each, a bucket and a unit per layer) on an
emulated link (latency 50 us, 10 Gb/s, x time_scale), interleaving the variants round by round.
Each wait is timed around the strategy's own method from outside it (a strategy never measures);
the table gives, per variant, medians over rounds of the per-step means and the rounds' IQR.
"""

from __future__ import annotations

import argparse
import datetime as dt
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks.parts.rounds import iqr  # noqa: E402
from trainer.sync.comm import Comm  # noqa: E402
from trainer.sync.network import Network  # noqa: E402
from trainer.sync.zero import zero_sync  # noqa: E402

WIDTH, LAYERS, BATCH, STEPS, WARMUP = 512, 8, 64, 12, 3
SHARED = {
    "bucket_cap_mb": 1.0,
    "num_buckets_staged": 2,
    "find_unused_parameters": False,
    "wrap": "module",
    "reshard_after_forward": True,
}
VARIANTS = {  # sync=zero's own builder, as the config calls it
    "zero stage 2": {**SHARED, "stage": 2, "prefetch": 1},
    "zero stage 1": {**SHARED, "stage": 1, "prefetch": 1},
    "zero stage 3": {**SHARED, "stage": 3, "prefetch": 1},
    # the experiment: backward never waits for a reduction (every one in flight until after_backward)
    "zero stage 3, all reductions in flight": {**SHARED, "stage": 3, "prefetch": 1},
}


def model() -> nn.Module:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(WIDTH, 10))


class Stopwatch:
    """Seconds spent inside a method, this step; wraps the bound method on the instance only."""

    def __init__(self, obj: Any, name: str, when: Callable[[], bool] = lambda: True) -> None:
        self.total, inner = 0.0, getattr(obj, name)

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not when():
                return inner(*args, **kwargs)
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - start

        setattr(obj, name, timed)

    def take(self) -> float:
        total, self.total = self.total, 0.0
        return total


def one_variant(rank: int, kwargs: dict[str, Any], time_scale: float, steps: int, in_flight: bool) -> dict[str, float]:
    """Per-step means over the measured steps: step, forward, backward, and the wait in question."""
    net = model()
    sync = zero_sync(**kwargs)
    sync.comm = Comm(Network("100gbe", latency_us=50, bandwidth_gbps=10, time_scale=time_scale).link(2))
    module = sync.wrap(net)
    optimizer = sync.build_optimizer(net, lambda p: torch.optim.SGD(p, lr=0.01))
    in_backward = {"on": False}
    if kwargs["stage"] == 3:  # backward's waits for the unit before (_settle, called from _reduce)
        wait = Stopwatch(sync, "_settle", lambda: in_backward["on"])
        if in_flight:  # backward never settles (the timed call is skipped, not a no-op timed: 0 exactly)
            settle = sync._settle
            sync._settle = lambda: None if in_backward["on"] else settle()  # type: ignore[method-assign]
    else:  # the forward's one wait for every gather
        wait = Stopwatch(sync, "wait_for_parameters")
    gen = torch.Generator().manual_seed(rank)
    sums = {"step_s": 0.0, "forward_s": 0.0, "backward_s": 0.0, "wait_s": 0.0}
    for step in range(WARMUP + steps):
        x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randint(0, 10, (BATCH,), generator=gen)
        start = time.perf_counter()  # no barrier here: it would queue behind the gathers on gloo
        loss = F.cross_entropy(module(x), y)
        forwarded = time.perf_counter()
        in_backward["on"] = True
        loss.backward()
        in_backward["on"] = False
        backwarded = time.perf_counter()
        sync.after_backward(module)
        sync.optimizer_step(optimizer)
        sync.zero_grad(optimizer)
        end = time.perf_counter()
        waited = wait.take()
        if step >= WARMUP:
            sums["step_s"] += end - start
            sums["forward_s"] += forwarded - start
            sums["backward_s"] += backwarded - forwarded
            sums["wait_s"] += waited
    if hasattr(sync, "wait_for_parameters"):
        sync.wait_for_parameters()
    return {k: v / steps for k, v in sums.items()}


def rank_main(rank: int, store_path: str, out: str, rounds: int, time_scale: float, steps: int) -> None:
    torch.set_num_threads(1)
    store = dist.FileStore(store_path, 2)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=dt.timedelta(seconds=300))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in VARIANTS}
    for _ in range(rounds):  # interleaved: each round runs every variant once
        for name, kwargs in VARIANTS.items():
            results[name].append(one_variant(rank, kwargs, time_scale, steps, "in flight" in name))
    torch.save(results, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--quick", action="store_true", help="2 rounds of 4 steps: a smoke run")
    args = parser.parse_args()
    rounds, steps = (2, 4) if args.quick else (args.rounds, STEPS)
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(rank_main, args=(str(Path(tmp) / "store"), tmp, rounds, args.time_scale, steps), nprocs=2)
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(2)]
    print(
        f"{LAYERS} layers of {WIDTH}x{WIDTH} fp32, batch {BATCH}; link 50 us, 10 Gb/s x{args.time_scale:g}; "
        f"{rounds} rounds of {steps} steps, 2 ranks; medians over rounds (rank 0, ± the IQR's width)"
    )
    print("| variant | step ms | forward ms | backward ms | wait ms | wait / step | at most hideable / step |")
    print("|---|---|---|---|---|---|---|")
    for name in VARIANTS:
        rows = ranks[0][name]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
        spread = {k: (lambda q: q[1] - q[0])(iqr([r[k] for r in rows])) for k in rows[0]}
        if VARIANTS[name]["stage"] == 3:
            hideable = med["wait_s"]  # backward blocked on the unit before's reduction
        else:  # the forward could start after the first bucket: its own compute is what overlap can use
            hideable = min(med["wait_s"], med["forward_s"] - med["wait_s"])
        cells = [f"{med[k] * 1e3:.1f} ±{spread[k] * 1e3:.1f}" for k in ("step_s", "forward_s", "backward_s", "wait_s")]
        print(
            f"| {name} | {' | '.join(cells)} | {med['wait_s'] / med['step_s']:.0%} | {hideable / med['step_s']:.0%} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
